package engine

import (
	"sort"
	"time"

	"github.com/breakerd/breakerd/policy"
)

// EndpointIdle is how long a closed endpoint circuit seen only in traffic
// may stay idle before it leaves its group (and so the denominator of
// max_ejection_percent).
const EndpointIdle = 10 * time.Minute

// Tick runs the timers: connect timeouts, response timeouts, probe
// timeouts, the sweep of departed endpoints and, once a second, the
// retry of unenforced circuits, the clean-up of finished slow starts and
// the reconciliation after lost records.
func (e *Engine) Tick(now time.Time) {
	for cookie, p := range e.pending {
		c, _ := e.reg.At(p.dest)
		if c == nil {
			delete(e.pending, cookie)
			continue
		}
		if now.Sub(p.start) < c.Machine.Options().ConnectTimeout {
			continue
		}
		delete(e.pending, cookie)
		e.counted[cookie] = true
		e.metrics.Outcome("connect_timeout", c.Target(), c.Workload()).Inc()
		r := policy.Result{Kind: policy.Failure, Duration: now.Sub(p.start), Probe: p.probe, Round: p.round}
		feedDrop(c)
		e.Record(c, now, r, policy.Classify(c.Machine.Options(), r), 1)
	}
	if len(e.counted) > 100000 {
		clear(e.counted) // final records of those sockets were lost
	}
	e.scanResponseTimeouts(now)
	if len(e.adaptive) > 0 {
		e.moveLimits()
	}
	for c := range e.reg.active { // only a half-open circuit has timers
		if t, moved := c.Machine.Tick(now); moved {
			e.Apply(c, t)
		}
	}
	if now.Sub(e.lastSweep) >= EndpointIdle/10 {
		e.lastSweep = now
		e.sweepDepartedEndpoints(now)
	}
	if now.Sub(e.lastLostCheck) >= time.Second {
		e.lastLostCheck = now
		e.RetryUnenforced()
		e.EndRamps()
		if st, err := e.k.Stats(); err == nil && st.EventsLost != e.lostSeen {
			e.lostSeen = st.EventsLost
			e.ReconcileRounds(now)
		}
	}
}

// HoldChecks keeps the tick's once-a-second work (RetryUnenforced, the
// look at lost records) from running before until (tests of what else
// writes a verdict).
func (e *Engine) HoldChecks(until time.Time) { e.lastLostCheck = until }

// ReconcileRounds runs (from Tick) after the kernel lost records: a round's first-probe
// record and its probes' outcomes may be among them, which would leave a
// circuit open (or waiting for its new round) in the engine's view while
// the kernel has spent the round's tokens, rejecting for good. Every
// circuit whose probe budget has reached its round begins that round
// here, so probe_timeout applies to it.
func (e *Engine) ReconcileRounds(now time.Time) {
	for c := range e.reg.active {
		if s := c.Machine.State(); s != policy.Open && s != policy.HalfOpen {
			continue
		}
		if c.ID == 0 {
			continue // no verdict: nothing of it in the kernel
		}
		b, err := e.k.Budget(c.ID)
		if err != nil || b.Round != c.Machine.Round() {
			continue
		}
		if t, moved := c.Machine.BeginHalfOpen(now, b.Round); moved {
			e.Apply(c, t)
		}
	}
}

// sweepDepartedEndpoints drops closed endpoint circuits seen only in
// traffic that have been idle for EndpointIdle.
func (e *Engine) sweepDepartedEndpoints(now time.Time) {
	var gone []*Circuit
	for c := range e.reg.endpoints {
		if !c.Enumerated && c.Machine.State() == policy.Closed && now.Sub(c.Machine.LastActivity()) >= EndpointIdle {
			gone = append(gone, c)
		}
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i].Name() < gone[j].Name() })
	for _, c := range gone {
		e.log.Debug("endpoint departed (idle)", "circuit", c.Name())
		e.Drop(c)
	}
}

// scanResponseTimeouts counts every request that has waited longer than
// its circuit's response_timeout (once per turn).
func (e *Engine) scanResponseTimeouts(now time.Time) {
	if !e.respTimeouts {
		return
	}
	// The clock first: a request seen still waiting got no response byte
	// before it, so one the kernel counted as an ordinary success (faster
	// than response_timeout) is never also seen timed out here.
	mono := e.clock.Mono()
	var err error
	e.awaiting, err = e.k.Awaiting(e.awaiting[:0])
	if err != nil {
		e.log.Warn("reading requests in flight", "err", err)
		return
	}
	seen := make(map[uint64]bool, len(e.timedOut))
	for i := range e.awaiting {
		a := &e.awaiting[i]
		seen[a.Cookie] = true
		if a.Since == 0 || a.Since < e.respSince {
			continue
		}
		if m, ok := e.timedOut[a.Cookie]; ok && m.start == a.Since {
			continue
		}
		c, _ := e.reg.At(a.Dest)
		if c == nil {
			continue
		}
		o := &c.Machine.Options().Responses
		waited := mono - a.Since
		if o.ResponseTimeout == 0 || waited < o.ResponseTimeout {
			continue
		}
		e.timedOut[a.Cookie] = timedOut{start: a.Since}
		c.Metrics.Response(policy.ResponseTimeout).Inc()
		c.NoteFailedCgroup(a.CgroupID)
		feedDrop(c)
		r := policy.Result{Kind: policy.Failure, Duration: waited, Probe: a.Probe, Round: a.Round}
		e.record(c, r, policy.Classify(c.Machine.Options(), r), 1, now)
	}
	for cookie, m := range e.timedOut {
		if seen[cookie] {
			continue
		}
		// The socket is gone. Its last record (a late answer, the
		// connection's end) was in the ring before its entry went, and
		// the reader reads the ring every tick: keep the mark a few
		// scans, until that record has surely been handled.
		if m.gone++; m.gone > timedOutKeep {
			delete(e.timedOut, cookie)
		} else {
			e.timedOut[cookie] = m
		}
	}
}

// timedOut marks a turn counted at response_timeout (by its request's
// start), so its answer or its connection's end is not counted again.
type timedOut struct {
	start time.Duration
	gone  int // scans since the socket's inflight entry went
}

// timedOutKeep is how many scans a mark outlives its socket's entry.
const timedOutKeep = 10
