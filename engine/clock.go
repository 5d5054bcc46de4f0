package engine

import "time"

// Clock tells the core the time: the wall clock in the daemon, a clock a
// test moves by hand in the engine's tests.
type Clock interface {
	Now() time.Time
}

// SystemClock is time.Now.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }
