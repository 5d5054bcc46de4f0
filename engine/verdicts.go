package engine

import (
	"errors"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// errNoID: a circuit that has to reject found no kernel circuit id free.
var errNoID = errors.New("no circuit id free")

// seatID gives c the kernel circuit id id (seat) and continues c's rounds
// after the slot's probe budget: a closed circuit's next open verdict
// begins a new round there, and so does the verdict of an open one that
// waited for an id (enforce), written next.
func (e *Engine) seatID(c *Circuit, id uint32, inherited bool) {
	round, ok := e.seat(c, id, inherited)
	if !ok {
		return
	}
	if c.Machine.State().Rejects() {
		c.Machine.RoundAfter(round)
	} else {
		c.Machine.SeedRound(round)
	}
}

// seat gives c the kernel circuit id id: a new one's counters are zeroed;
// an inherited one's carry on, with its rejections' epoch. It returns the
// round of the slot's probe budget (false: unread), which c's rounds must
// continue after; c's state machine is the caller's.
func (e *Engine) seat(c *Circuit, id uint32, inherited bool) (round uint32, ok bool) {
	c.ID = id
	e.owners.set(id, IDOwner{Target: c.Target()})
	if c.Epoch() != 0 {
		e.reg.recording[id] = c // its rejections are recorded under its id
	}
	if !inherited {
		if err := e.k.ResetCounters(id); err != nil {
			e.log.Warn("resetting counters", "circuit", c.Name(), "err", err)
		}
	} else if ep := e.reg.ids.PinnedEpoch(id); ep != 0 {
		e.setEpoch(c, ep) // its rejections carry on with its counters
	}
	b, err := e.k.Budget(id)
	return b.Round, err == nil
}

// EnsureID gives c a kernel circuit id if it has none (Seat), and reports
// whether it has one. Without one, nothing of c can be written to the
// kernel: the caller logs and counts it, and the tick tries again
// (RetryUnenforced).
func (e *Engine) EnsureID(c *Circuit) bool {
	if c.ID != 0 {
		return true
	}
	id, inherited, ok := e.reg.ids.Alloc(c.Name(), c.First())
	if !ok {
		return false
	}
	e.seatID(c, id, inherited)
	return true
}

// Record feeds n calls with result r, classified as call, to c, applies
// the transition they cause and reports whether they caused one. A
// circuit without a kernel id is given one as it is about to open, before
// its transition is computed (policy.Seat), so that the transition's
// round is the one its verdict admits probes of.
func (e *Engine) Record(c *Circuit, now time.Time, r policy.Result, call policy.Call, n int) bool {
	var seat policy.Seat
	if c.ID == 0 {
		e.seating, seat = c, (*seater)(e)
	}
	t, moved := c.Machine.RecordN(now, r, call, n, seat)
	if seat != nil {
		e.seating = nil
	}
	if moved {
		e.Apply(c, t)
	}
	return moved
}

// seater is the engine as the policy.Seat of the circuit being recorded
// (Engine.seating): a pointer, so passing it costs a record no
// allocation.
type seater Engine

// Seat gives the circuit being recorded a kernel id, and returns the
// round of its slot's probe budget.
func (s *seater) Seat() (uint32, bool) {
	e := (*Engine)(s)
	c := e.seating
	id, inherited, ok := e.reg.ids.Alloc(c.Name(), c.First())
	if !ok {
		return 0, false
	}
	round, _ := e.seat(c, id, inherited)
	return round, true
}

// releaseID gives back the kernel id of a dynamic circuit that closed,
// when ids are scarce (half of them handed out or held back: with
// max_circuits above policy.GuaranteedCircuits, or many bulkhead slots of
// sharing workloads), so closed circuits that took ids while they were
// plentiful do not keep every id from circuits opening later (nothing
// takes an id back from a closed circuit that holds one otherwise). Its
// kernel counts go to its target's totals (which never go down); its own
// count of rejections, and whom it rejected, start again if it opens
// again.
func (e *Engine) releaseID(c *Circuit) {
	if _, ramping := e.ramps[c]; ramping {
		return // its ramp counts under its id; EndRamps gives it back
	}
	if c.ID == 0 || c.IsNamed() || NeedsLimitEntry(c.Machine.Options()) || c.Machine.State() != policy.Closed || !e.reg.ids.Scarce() {
		return
	}
	e.retire(c.Target(), c.ID)
	e.forgetEpoch(c)
	e.unbatch(c)
	c.SetEpoch(0)
	e.owners.clear(c.ID)
	e.reg.ids.Release(c.ID, c.Name())
	c.ID = 0
}

// RetryUnenforced writes what could not be written for want of a kernel
// id or of room in a map: the verdicts of rejecting circuits
// (e.unenforced) and the limits entries of circuits that need them
// (e.unlimited). Called from the tick, once a second. Ids and map room
// are shared, so the pass stops at the first circuit that still finds
// none: a node short of them does one try a second, not one a circuit.
func (e *Engine) RetryUnenforced() {
	for c := range e.unenforced {
		if !e.enforce(c) {
			return
		}
	}
	for c := range e.unlimited {
		if !NeedsLimitEntry(c.Machine.Options()) {
			delete(e.unlimited, c) // its limits went with a reload
			continue
		}
		if !e.EnsureID(c) {
			return
		}
		for _, dst := range c.Dests() {
			e.WriteLimit(c, dst) // takes it out of the set (seatForLimits)
		}
	}
}

// seatForLimits gives c, which needs limits entries, a kernel id for
// their slot, and reports whether it has one. Without one c waits in
// e.unlimited for the tick; given one, it leaves it, and a rejecting
// circuit that waited for an id (e.unenforced) has its verdicts written
// with it.
func (e *Engine) seatForLimits(c *Circuit) bool {
	if !e.EnsureID(c) {
		e.unlimited[c] = struct{}{}
		return false
	}
	delete(e.unlimited, c)
	if _, ok := e.unenforced[c]; ok {
		e.enforce(c)
	}
	return true
}

// enforce writes the verdicts of c, which is in e.unenforced, if it still
// rejects and can now be given an id; it leaves the set when it no longer
// rejects or every verdict is written, and false says it found no id or
// no room. An open circuit that stayed unenforced for its whole open
// duration closes instead (policy.Circuit.NotEnforced): it rejected
// nothing, and a verdict now would turn traffic away on old evidence (not
// one with some verdicts written: partlyEnforced).
func (e *Engine) enforce(c *Circuit) bool {
	now := e.clock.Now()
	// Past its open duration, one the kernel enforced in part (it admits
	// its probes) is no circuit that rejected nothing.
	partly := false
	if st := c.Machine.Status(now); st.State == policy.Open && !now.Before(st.OpenUntil) {
		partly = e.partlyEnforced(c)
	}
	if !partly {
		if t, moved := c.Machine.NotEnforced(now); moved {
			delete(e.unenforced, c)
			e.log.Warn("the open circuit was not enforced through its open duration (no circuit id or verdict room); closed, counting afresh", "circuit", c.Name())
			e.Apply(c, t)
			return true
		}
	}
	st := c.Machine.Status(now)
	if !st.State.Rejects() {
		delete(e.unenforced, c)
		return true
	}
	if !e.EnsureID(c) {
		return false
	}
	for _, dst := range c.Dests() {
		if err := e.putVerdict(c, dst, st.State, st.OpenUntil, c.Machine.Round()); err != nil {
			return false
		}
	}
	delete(e.unenforced, c)
	e.log.Info("the open circuit's verdicts are written: it is enforced", "circuit", c.Name(), "state", st.State.String(), "circuit_id", c.ID)
	e.hooks.Opened(c, policy.Closed, st.State, now) // its close_established pass, if it has one
	return true
}

// WriteVerdicts makes the kernel enforce what a transition says, for every
// destination of the circuit; c is in e.unenforced after it exactly when
// it rejects and a verdict could not be written.
//
// A close on successful probes of a circuit with slow start writes its
// ramp instead of deleting its verdicts (beginRamp); any other transition
// ends a ramp in progress.
func (e *Engine) WriteVerdicts(c *Circuit, t policy.Transition) {
	e.endRamp(c)
	if ramps(c, t) {
		e.beginRamp(c)
		delete(e.unenforced, c)
		return
	}
	ok := true
	for _, dst := range c.Dests() {
		ok = e.writeVerdict(c, dst, t.To, t.OpenUntil, t.Round) && ok
	}
	if ok || !t.To.Rejects() {
		delete(e.unenforced, c)
	}
}

// writeVerdict writes what state s means for dst. Open and half-open are
// both an open verdict, due at openUntil (half-open: now), admitting the
// probes of round from the circuit's one probe budget. A rejecting
// verdict that cannot be written (no kernel id free, the map refused it)
// is logged and counted, the circuit is filed in e.unenforced, whose
// verdicts the tick writes once they can be, and false is returned.
func (e *Engine) writeVerdict(c *Circuit, dst maps.Dest, s policy.State, openUntil time.Time, round uint32) bool {
	err := e.putVerdict(c, dst, s, openUntil, round)
	if err == nil {
		return true
	}
	e.metrics.VerdictWriteErrors().Inc()
	if s.Rejects() {
		e.unenforced[c] = struct{}{}
	}
	if errors.Is(err, errNoID) {
		e.ErrorEverySecond("", "no circuit id free (every id is in use or held by open sockets); an open circuit is not enforced until one is", "circuit", c.Name(), "dest", dst)
		return false
	}
	if s.Rejects() {
		e.ErrorEverySecond("", "writing verdict (the kernel fails open for this destination until it is written)", "circuit", c.Name(), "dest", dst, "err", err)
	} else {
		e.ErrorEverySecond("", "removing verdict (the kernel may go on rejecting this destination under the old one)", "circuit", c.Name(), "dest", dst, "err", err)
	}
	return false
}

// partlyEnforced reports whether some verdict of c, which has an id, is
// in the kernel: a circuit the verdict map had room for only in part
// rejected some of its traffic, so it keeps its open duration and its
// half-open probes rather than closing as not enforced (it stays in
// e.unenforced until every verdict is written, or it stops rejecting).
func (e *Engine) partlyEnforced(c *Circuit) bool {
	if c.ID == 0 {
		return false
	}
	for _, dst := range c.Dests() {
		if v, ok, err := e.k.Verdict(dst); err == nil && ok && v.CircuitID == c.ID {
			return true
		}
	}
	return false
}

// putVerdict writes what state s means for dst (see writeVerdict), with
// round, the transition's; it never changes c. A circuit without an id
// writes no rejecting verdict (errNoID): Record seats one before it opens.
func (e *Engine) putVerdict(c *Circuit, dst maps.Dest, s policy.State, openUntil time.Time, round uint32) error {
	o := c.Machine.Options()
	if s.Rejects() && c.ID == 0 {
		return errNoID // seated before its transition, or waiting for an id
	}
	// The fallback before a rejecting verdict, so none of its connects is
	// turned away for want of it; gone with the last one.
	e.syncFallback(c, s.Rejects())
	switch s {
	case policy.Open, policy.HalfOpen:
		due := e.clock.Mono()
		if s == policy.Open {
			due += openUntil.Sub(e.clock.Now())
		}
		v := maps.OpenVerdict(due, round, uint32(o.HalfOpenProbes), o.RejectErrno, c.ID)
		v.Epoch = e.EpochOf(c)
		return e.k.PutVerdict(dst, v)
	case policy.ForcedOpen, policy.FleetOpen: // neither probes (a follower's probes are its reporters')
		return e.k.PutVerdict(dst, maps.Verdict{State: maps.ForcedOpen, Errno: o.RejectErrno, CircuitID: c.ID, Epoch: e.EpochOf(c)})
	default:
		return e.k.DeleteVerdict(dst)
	}
}
