package engine

import (
	"time"

	"github.com/breakerd/breakerd/maps"
)

// Clock tells the core the time: the wall clock in the daemon, a clock a
// test moves by hand in the engine's tests.
type Clock interface {
	// Now is the wall time decisions are made at.
	Now() time.Time
	// Mono is the kernel's monotonic clock (CLOCK_MONOTONIC, which the
	// programs read with bpf_ktime_get_ns): what verdicts' due times and
	// the kernel's request start times are written in.
	Mono() time.Duration
}

// SystemClock is time.Now and the kernel's monotonic clock.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// Mono returns maps.Now(), CLOCK_MONOTONIC.
func (SystemClock) Mono() time.Duration { return maps.Now() }
