package daemon

import (
	"sync"
	"time"
)

// eventRing keeps the last maxEvents transitions in a fixed array: adding
// to a full ring overwrites the oldest, so it never grows. The owner
// adds to it in its steps; the admin API lists it from its own
// goroutines, under the ring's small lock.
type eventRing struct {
	mu   sync.Mutex
	buf  [maxEvents]TransitionEvent
	next int // where the next event goes
	n    int // how many are held (at most maxEvents)
}

func (r *eventRing) add(ev TransitionEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.buf[r.next] = ev
	r.next = (r.next + 1) % len(r.buf)
	r.n = min(r.n+1, len(r.buf))
}

// noteClosed sets the close pass's count on the transition of circuit
// at time at (the newest such event; none when it is gone from the ring).
func (r *eventRing) noteClosed(circuit string, at time.Time, n uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range r.n {
		ev := &r.buf[(r.next-1-i+2*len(r.buf))%len(r.buf)]
		if ev.Circuit == circuit && ev.Time.Equal(at) {
			ev.ClosedEstablished = n
			return
		}
	}
}

// list returns a copy of the events, oldest first (never nil).
func (r *eventRing) list() []TransitionEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]TransitionEvent, 0, r.n)
	start := (r.next - r.n + len(r.buf)) % len(r.buf)
	for i := range r.n {
		out = append(out, r.buf[(start+i)%len(r.buf)])
	}
	return out
}
