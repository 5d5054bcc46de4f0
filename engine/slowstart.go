package engine

import (
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Slow start after recovery: a circuit with a `slow_start` block that
// closes on successful probes keeps a verdict in the kernel, a ramp,
// from which connect computes the share of new connects it admits (no
// round trip per connect). The engine only writes the ramp when the
// circuit closes, carries it over a restart (AdoptRamp) and deletes it
// once it is over (EndRamps, from the tick); the kernel admits everything
// past its end whether or not it is deleted yet.

// ramp is a circuit's slow start in progress: the verdict written for
// each of its destinations.
type ramp struct {
	v maps.Verdict
}

// ramps reports whether t, applied to c, begins a slow start: a close on
// successful probes of a circuit whose options have one, and which holds
// a kernel id (its counters carry the ramp's running sum).
func ramps(c *Circuit, t policy.Transition) bool {
	return t.To == policy.Closed && t.From == policy.HalfOpen && t.Reason == policy.ReasonProbesOK &&
		c.Machine.Options().SlowStart.On() && c.ID != 0
}

// beginRamp writes c's slow-start verdicts, from now, and reports whether
// every one is written. One that cannot be written leaves its destination
// without a ramp (every connect admitted, as without slow start).
func (e *Engine) beginRamp(c *Circuit) bool {
	o := c.Machine.Options()
	v := maps.RampVerdict(e.clock.Mono(), o.SlowStart.Duration, o.SlowStart.Share, o.BulkheadRejectErrno, c.ID)
	v.Epoch = e.EpochOf(c)
	e.ramps[c] = ramp{v: v}
	ok := true
	for _, dst := range c.Dests() {
		ok = e.putRamp(c, dst, v) && ok
	}
	return ok
}

// putRamp writes ramp verdict v for dst of c.
func (e *Engine) putRamp(c *Circuit, dst maps.Dest, v maps.Verdict) bool {
	if err := e.k.PutVerdict(dst, v); err != nil {
		e.metrics.VerdictWriteErrors().Inc()
		e.ErrorEverySecond("", "writing a slow-start verdict (its connects are all admitted)", "circuit", c.Name(), "dest", dst, "err", err)
		return false
	}
	return true
}

// endRamp forgets c's ramp: its verdicts are replaced or deleted by the
// caller.
func (e *Engine) endRamp(c *Circuit) { delete(e.ramps, c) }

// Ramping returns the share of new connects c's slow start admits at now
// (the kernel's own reckoning from its verdict) and when it ends; ok is
// false when c is not ramping.
func (e *Engine) Ramping(c *Circuit) (share float64, until time.Time, ok bool) {
	r, ok := e.ramps[c]
	if !ok {
		return 0, time.Time{}, false
	}
	mono := e.clock.Mono()
	if mono >= r.v.RampEnd() {
		return 0, time.Time{}, false // over; the tick deletes it
	}
	return r.v.RampShare(mono), e.clock.Now().Add(r.v.RampEnd() - mono), true
}

// RampCount is the number of circuits whose slow start is in progress
// or not yet cleaned up.
func (e *Engine) RampCount() int { return len(e.ramps) }

// EndRamps deletes the verdicts of slow starts that are over (the kernel
// admitted every connect under them already), and gives back the ids of
// dynamic circuits that no longer need them. Called from the tick.
func (e *Engine) EndRamps() {
	if len(e.ramps) == 0 {
		return
	}
	mono := e.clock.Mono()
	for c, r := range e.ramps {
		if mono < r.v.RampEnd() {
			continue
		}
		delete(e.ramps, c)
		if c.Machine.State() != policy.Closed {
			continue // its verdicts are its state's now
		}
		for _, dst := range c.Dests() {
			if err := e.k.DeleteVerdict(dst); err != nil {
				e.log.Warn("deleting a finished slow-start verdict", "circuit", c.Name(), "dest", dst, "err", err)
			}
		}
		e.releaseID(c)
	}
}

// AdoptRamp takes over the slow-start verdict v of dst, which a previous
// daemon wrote, for c: kept while c is closed and v's ramp is not over,
// re-pointed to c's id and epoch when they differ; deleted otherwise
// (left to c when c rejects: its own verdict replaced it). It reports
// whether it was kept.
func (e *Engine) AdoptRamp(c *Circuit, dst maps.Dest, v maps.Verdict) bool {
	if c.Machine.State().Rejects() {
		return false // its own verdict replaced the ramp when it was made
	}
	if c.Machine.State() != policy.Closed || e.clock.Mono() >= v.RampEnd() || !e.EnsureID(c) {
		if err := e.k.DeleteVerdict(dst); err != nil {
			e.log.Warn("deleting an adopted slow-start verdict", "circuit", c.Name(), "dest", dst, "err", err)
		}
		return false
	}
	if r, ok := e.ramps[c]; ok {
		v = r.v // another destination of c brought it first
	}
	if ep := e.EpochOf(c); v.CircuitID != c.ID || v.Epoch != ep {
		v.CircuitID, v.Epoch = c.ID, ep
	}
	e.ramps[c] = ramp{v: v}
	if cur, ok, err := e.k.Verdict(dst); err == nil && ok && cur == v {
		return true
	}
	return e.putRamp(c, dst, v)
}
