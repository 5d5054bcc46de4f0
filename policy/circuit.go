package policy

import (
	"math"
	"slices"
	"time"
)

// State is a circuit's state.
type State uint8

// The states. Disabled records metrics and never rejects.
const (
	Closed State = iota
	Open
	HalfOpen
	ForcedOpen
	ForcedClosed
	Disabled
	// FleetOpen: open because a quorum of other nodes has the circuit
	// open on their own evidence (Follow); it never probes.
	FleetOpen
)

// NumStates is the number of states.
const NumStates = int(FleetOpen) + 1

// Tally counts circuits by state.
type Tally [NumStates]int

// Shared is what many circuits share rather than hold each: the random
// source of their jitter, and the tally of their states, which a circuit
// keeps up to date through every change of its state from Share to
// Release, so the owner of many circuits knows how many are in each state
// without walking them.
type Shared struct {
	Rand  func() float64 // numbers in [0, 1) for jitter
	Tally Tally
}

var stateNames = [...]string{"closed", "open", "half_open", "forced_open", "forced_closed", "disabled", "fleet_open"}

// String returns the state's name (closed, open, half_open, …).
func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return "unknown"
}

// Rejects reports whether the kernel should hold a verdict for this state.
func (s State) Rejects() bool { return s == Open || s == HalfOpen || s == ForcedOpen || s == FleetOpen }

// Kind is how a call ended, as the kernel recorded it. Classify decides
// what each counts as.
type Kind uint8

// The kinds of result.
const (
	// Success: the connection was established (slow if its handshake took
	// at least slow_call_duration). A target that follows responses
	// counts its requests instead.
	Success Kind = iota
	// Failure: refused, timed out, unreachable or stalled while
	// connecting, or a request the daemon saw waiting past
	// response_timeout.
	Failure
	// Abandoned: the application closed a connecting socket; nothing
	// before slow_call_duration, slow (or, with count_abandoned, failed)
	// after, and failed from connect_timeout.
	Abandoned
	// Answered: a response came (its first byte): failed with a status in
	// failure_statuses or from response_timeout, slow from
	// slow_response_duration. A batch of them is what the kernel counted.
	Answered
	// Reset: an established connection was reset, Duration after its
	// handshake: failed within reset_failure_window, nothing after.
	Reset
	// NoResponse: the connection ended with a request unanswered: failed
	// if the peer closed it (PeerClosed; nothing with count_dropped off),
	// nothing if the client gave up first.
	NoResponse
)

// Result is one call's outcome fed to a circuit.
type Result struct {
	Kind Kind
	// Duration is the handshake time (Success), the time spent
	// connecting (Failure, Abandoned), a response's time (Answered,
	// NoResponse) or the connection's age (Reset).
	Duration time.Duration
	// Status is the HTTP status of an Answered result whose status line
	// was read (HTTP).
	Status uint16
	HTTP   bool
	// PeerClosed says the peer ended a NoResponse (a FIN or reset) and
	// Err that it was a reset or an error.
	PeerClosed, Err bool
	// Probe is set for a connection the kernel admitted as a half-open
	// probe; Round is the round that admitted it.
	Probe bool
	Round uint32
}

// Reason says why a transition happened.
type Reason string

// The reasons.
const (
	ReasonFailureRate    Reason = "failure_rate"
	ReasonSlowCallRate   Reason = "slow_call_rate"
	ReasonConsecutive    Reason = "consecutive_failures"
	ReasonDue            Reason = "open_duration_elapsed"
	ReasonProbeFailed    Reason = "probe_failed"
	ReasonProbeTimeout   Reason = "probe_timeout"
	ReasonProbesOK       Reason = "probes_succeeded"
	ReasonNewRound       Reason = "probe_round"
	ReasonEjectionLimit  Reason = "max_ejection_percent"
	ReasonForcedOpen     Reason = "forced_open"
	ReasonForcedClosed   Reason = "forced_closed"
	ReasonDisabled       Reason = "disabled"
	ReasonReleased       Reason = "override_released"
	ReasonReset          Reason = "reset"
	ReasonRestoredFromKV Reason = "adopted_from_kernel"
	ReasonNotEnforced    Reason = "not_enforced"
)

// Transition is a change of a circuit's state, with what the daemon needs
// to write the verdict map, log and count it. A transition with From == To
// is a notice (an endpoint kept closed by max_ejection_percent) or, with
// ReasonNewRound, a new half-open round whose verdict must be written.
type Transition struct {
	From, To State
	Reason   Reason
	// FailureRate and SlowRate are the window's ratios at the transition.
	FailureRate, SlowRate float64
	// Calls is the number of calls in the window.
	Calls int
	// At is when it happened; OpenUntil when an open circuit becomes due
	// (zero unless To is Open).
	At, OpenUntil time.Time
	// Trip counts the consecutive trips without a clean close (0 for the
	// first).
	Trip int
	// Round is the half-open round the verdict admits probes of (To Open,
	// or a new round).
	Round uint32
}

// Circuit is one circuit's state machine. It is not safe for concurrent
// use; the daemon serialises calls.
//
// A node may hold a hundred thousand of them, so the fields are small:
// times are stamps (8 bytes, not time.Time's 24) and counts 32 bits.
type Circuit struct {
	// What Record reads and writes comes first, so a call touches as few
	// cache lines as it can.
	opts        *Options
	state       State
	blocked     bool
	roundBegun  bool
	consecutive int32
	win         window
	last        stamp
	group       *Group
	shared      *Shared
	openUntil   stamp
	roundStart  stamp
	trips       int32
	// round is the half-open round the circuit's verdict admits probes
	// of; outcomes of other rounds are ignored. roundBegun says the kernel
	// admitted its first probe, at roundStart.
	round uint32
	// probeOK counts the successful probes since the circuit became
	// half-open (across rounds); roundOK those of the current round.
	probeOK, roundOK int32
}

// stamp is a time as nanoseconds since the process's epoch: 8 bytes
// instead of time.Time's 24. A time taken from time.Now keeps its
// monotonic reading through the round trip (both it and stampEpoch have one, so
// Sub uses the monotonic clock), so wall-clock steps do not move a
// circuit's timers.
type stamp int64

var stampEpoch = time.Now()

func stampOf(t time.Time) stamp { return stamp(t.Sub(stampEpoch)) }

func (s stamp) time() time.Time { return stampEpoch.Add(time.Duration(s)) }

// NewCircuit makes a closed circuit (or one in the override's state) with
// options o, in endpoint group g (nil outside endpoint scope). rnd returns
// numbers in [0, 1) for jitter.
func NewCircuit(o *Options, override Override, g *Group, now time.Time, rnd func() float64) *Circuit {
	c := new(Circuit)
	c.Init(o, override, g, now, rnd)
	return c
}

// Init makes c what NewCircuit returns, in place (a circuit held by value
// in a larger struct saves an allocation per circuit). An owner of many
// circuits passes a nil rnd and then gives each its Shared (Share).
func (c *Circuit) Init(o *Options, override Override, g *Group, now time.Time, rnd func() float64) {
	c.unshare()
	*c = Circuit{opts: o, group: g, win: newWindow(o, now), last: stampOf(now)}
	c.state = overrideState(override)
	if rnd != nil {
		c.Share(&Shared{Rand: rnd})
	}
	if g != nil {
		g.endpoints++
	}
}

func overrideState(o Override) State {
	switch o {
	case ForceOpen:
		return ForcedOpen
	case ForceClosed:
		return ForcedClosed
	case DisableState:
		return Disabled
	}
	return Closed
}

// SetOptions gives the circuit new options (a reload). Its state, trips,
// open time and probe count stay; the new options apply from the next call
// and the next transition. The window keeps its calls unless its shape
// (window_size or window_duration) changed: then it starts empty.
func (c *Circuit) SetOptions(o *Options, now time.Time) {
	if o.WindowSize != c.opts.WindowSize || o.WindowDuration != c.opts.WindowDuration {
		c.win = newWindow(o, now)
	}
	c.opts = o
}

// Release removes the circuit from its group; call it when the circuit is
// dropped.
func (c *Circuit) Release() {
	c.unshare()
	if c.group == nil {
		return
	}
	c.group.endpoints--
	if c.state == Open || c.state == HalfOpen {
		c.group.ejected--
	}
	c.group = nil
}

// State returns the current state.
func (c *Circuit) State() State { return c.state }

// setState changes the state, and the tally counting it.
func (c *Circuit) setState(s State) {
	if c.shared != nil {
		c.shared.Tally[c.state]--
		c.shared.Tally[s]++
	}
	c.state = s
}

// Share makes the circuit use s, and count itself in its tally from now
// on (until Release), in its current state.
func (c *Circuit) Share(s *Shared) {
	c.unshare()
	c.shared = s
	s.Tally[c.state]++
}

func (c *Circuit) unshare() {
	if c.shared != nil {
		c.shared.Tally[c.state]--
		c.shared = nil
	}
}

// Options returns the circuit's options.
func (c *Circuit) Options() *Options { return c.opts }

// LastActivity is when the circuit last recorded a call or changed state.
func (c *Circuit) LastActivity() time.Time { return c.last.time() }

// Seat gives a circuit that has no kernel slot one, when it is about to
// open: its verdict needs a slot's counters and probe budget, and its
// rounds must continue after the rounds that slot's budget has seen, so
// the slot is found before the transition is computed.
type Seat interface {
	// Seat finds the circuit a slot and returns the round of its probe
	// budget; false: none is free (the circuit opens all the same, and
	// its verdict waits for one).
	Seat() (round uint32, ok bool)
}

// Record feeds one call's result and returns the transition it caused
// (RecordN of one call, classified here, for a circuit with a slot).
func (c *Circuit) Record(now time.Time, r Result) (Transition, bool) {
	return c.RecordN(now, r, Classify(c.opts, r), 1, nil)
}

// RecordN feeds n calls with the same result r, classified as call
// (Classify(c.Options(), r)), and returns the transition they caused, as
// n calls recorded one by one would: the successes the kernel counted for
// a circuit arrive as one record of their number. A probe's result is one
// call whatever n is. A batch causes at most one change of state: once
// the circuit leaves Closed the other calls are ignored; an
// ejection-limit notice keeps it Closed, and the group's counts do not
// change within the batch, so no open follows it. The work does not grow
// with n: at most the window's size plus the consecutive-failure bound in
// calls of a count-based window, a few points of a time-based one.
//
// seat, when not nil, is asked for a kernel slot just before the circuit
// opens from Closed (a circuit without one); the round of the open
// verdict then follows the slot's.
func (c *Circuit) RecordN(now time.Time, r Result, call Call, n int, seat Seat) (Transition, bool) {
	c.last = stampOf(now)
	if !call.Counts || n <= 0 {
		return Transition{}, false
	}
	if r.Probe {
		n = 1
	}
	failed, slow := call.Failed, call.Slow
	switch c.state {
	case Open:
		if !r.Probe || r.Round != c.round {
			// Started before the circuit opened, or a probe of an
			// earlier round: neither reopens nor extends it.
			return Transition{}, false
		}
		// The kernel's round record was lost: the probe says it began.
		c.halfOpen(now)
		return c.probeResult(now, failed)
	case HalfOpen:
		if !r.Probe || r.Round != c.round {
			// Not a probe, or one of an earlier round (late).
			return Transition{}, false
		}
		if !c.roundBegun {
			c.roundBegun, c.roundStart, c.roundOK = true, stampOf(now), 0
		}
		return c.probeResult(now, failed)
	case Closed:
	default: // forced, disabled or followed: metrics only
		c.win.recordN(now, failed, slow, n)
		return Transition{}, false
	}
	if n == 1 { // a record's one call: the common case, kept short
		c.win.record(now, failed, slow)
		if failed {
			c.consecutive++
		} else {
			c.consecutive = 0
		}
		reason, open := c.shouldOpen()
		if !open {
			c.blocked = false
			return Transition{}, false
		}
		t, ok, _ := c.opening(now, reason, seat)
		return t, ok
	}
	if !c.win.timed() {
		return c.recordClosed(now, failed, slow, n, seat)
	}
	return c.recordClosedTimed(now, failed, slow, n, seat)
}

// recordClosed records the calls of a closed circuit one by one, up to
// the point after which more of them change nothing but the consecutive
// count: a count-based window holding only such calls, and the
// consecutive-failure bound reached or out of reach.
func (c *Circuit) recordClosed(now time.Time, failed, slow bool, n int, seat Seat) (Transition, bool) {
	var first Transition
	var moved bool
	steps := n
	if bound := int(c.win.size) + c.opts.ConsecutiveFailures + 1; steps > bound {
		steps = bound
	}
	for range steps {
		t, ok, opened := c.step(now, failed, slow, seat)
		if opened {
			return t, true
		}
		if ok && !moved {
			first, moved = t, true
		}
	}
	if rest := n - steps; rest > 0 {
		// The window holds only calls like these (its counts stay), the
		// consecutive bound is reached or cannot be, and so shouldOpen
		// says what it said last: the rest move nothing.
		c.win.pos = int32((int(c.win.pos) + rest) % int(c.win.size))
		if failed {
			c.consecutive = int32(min(int64(c.consecutive)+int64(rest), math.MaxInt32))
		}
	}
	return first, moved
}

// step records one call of a closed circuit; opened says it opened (t
// is that transition), ok without opened an ejection-limit notice.
func (c *Circuit) step(now time.Time, failed, slow bool, seat Seat) (t Transition, ok, opened bool) {
	c.win.record(now, failed, slow)
	if failed {
		c.consecutive++
	} else {
		c.consecutive = 0
	}
	return c.decide(now, seat)
}

// decide opens the circuit (or notes the ejection limit) when its counts
// say so.
func (c *Circuit) decide(now time.Time, seat Seat) (t Transition, ok, opened bool) {
	reason, open := c.shouldOpen()
	if !open {
		c.blocked = false
		return Transition{}, false, false
	}
	return c.opening(now, reason, seat)
}

// opening opens the circuit for reason, which shouldOpen gave, unless its
// endpoint group may eject no more: then it notes the ejection limit once
// (ok without opened).
func (c *Circuit) opening(now time.Time, reason Reason, seat Seat) (t Transition, ok, opened bool) {
	if c.group != nil && !c.group.mayEject() {
		if c.blocked {
			return Transition{}, false, false
		}
		c.blocked = true
		return c.transition(now, Closed, ReasonEjectionLimit), true, false
	}
	if seat != nil {
		if round, ok := seat.Seat(); ok {
			c.SeedRound(round)
		}
	}
	return c.open(now, reason, false), true, true
}

// recordClosedTimed records n calls of a closed circuit with a
// time-based window. They all go into now's bucket, so after k of them
// every count is linear in k and each of shouldOpen's conditions changes
// at most once: the circuit decides only where one may change, and the
// calls between those points are added at once.
func (c *Circuit) recordClosedTimed(now time.Time, failed, slow bool, n int, seat Seat) (Transition, bool) {
	c.win.age(now)
	o := c.opts
	calls0, fails0, slow0, cons0 := int64(c.win.calls), int64(c.win.failures), int64(c.win.slow), int64(c.consecutive)
	f, s := int64(0), int64(0)
	if failed {
		f = 1
	}
	if slow {
		s = 1
	}
	// The points where a condition may change: the first call, the
	// consecutive bound, min_requests, and where each rate crosses its
	// threshold (a ratio of two linear counts is monotone in k).
	N := int64(n)
	points := []int64{1, int64(o.MinRequests) - calls0,
		crossing(N, func(k int64) bool { return float64(fails0+k*f)/float64(calls0+k) >= o.FailureRateThreshold }),
		crossing(N, func(k int64) bool { return float64(slow0+k*s)/float64(calls0+k) >= o.SlowCallRateThreshold })}
	if failed && o.ConsecutiveFailures > 0 {
		points = append(points, int64(o.ConsecutiveFailures)-cons0)
	}
	slices.Sort(points)
	var first Transition
	var moved bool
	done := int64(0) // calls added so far
	add := func(k int64) {
		if k <= done {
			return
		}
		c.win.addN(now, failed, slow, int(k-done))
		if failed {
			c.consecutive = int32(min(cons0+k, math.MaxInt32))
		} else {
			c.consecutive = 0
		}
		done = k
	}
	for _, k := range slices.Compact(points) {
		if k < 1 || k > N {
			continue
		}
		// What the circuit decides at k holds until the next point.
		add(k)
		t, ok, opened := c.decide(now, seat)
		if opened {
			return t, true
		}
		if ok && !moved {
			first, moved = t, true
		}
	}
	add(N)
	return first, moved
}

// crossing returns the least k in [1, n] at which the monotone p has
// another value than p(1) (n+1: none has).
func crossing(n int64, p func(int64) bool) int64 {
	at1 := p(1)
	lo, hi := int64(1), n+1 // p(lo) == at1; p(hi) != at1, or hi == n+1
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if p(mid) == at1 {
			lo = mid
		} else {
			hi = mid
		}
	}
	return hi
}

func (c *Circuit) shouldOpen() (Reason, bool) {
	if c.opts.ConsecutiveFailures > 0 && int(c.consecutive) >= c.opts.ConsecutiveFailures {
		return ReasonConsecutive, true
	}
	// record has just aged the window to now.
	calls, failures, slow := int(c.win.calls), int(c.win.failures), int(c.win.slow)
	if calls < c.opts.MinRequests || calls == 0 {
		return "", false
	}
	if float64(failures)/float64(calls) >= c.opts.FailureRateThreshold {
		return ReasonFailureRate, true
	}
	if float64(slow)/float64(calls) >= c.opts.SlowCallRateThreshold {
		return ReasonSlowCallRate, true
	}
	return "", false
}

func (c *Circuit) transition(now time.Time, to State, reason Reason) Transition {
	calls, failures, slow := c.win.counts(now)
	t := Transition{
		From: c.state, To: to, Reason: reason, At: now, Calls: calls, Trip: int(c.trips),
		Round: c.round,
	}
	if calls > 0 {
		t.FailureRate = float64(failures) / float64(calls)
		t.SlowRate = float64(slow) / float64(calls)
	}
	return t
}

// OpenDurationOf returns the open period of trip n (0 for the first),
// before jitter: open_duration × multiplier^n, capped.
func (o *Options) OpenDurationOf(n int) time.Duration {
	d := float64(o.OpenDuration) * math.Pow(o.OpenDurationMultiplier, float64(n))
	if d > float64(o.MaxOpenDuration) || math.IsInf(d, 0) {
		return o.MaxOpenDuration
	}
	return time.Duration(d)
}

func (c *Circuit) open(now time.Time, reason Reason, fromHalfOpen bool) Transition {
	if fromHalfOpen {
		c.trips++
	} else {
		c.trips = 0
		if c.group != nil {
			c.group.ejected++
		}
	}
	d := c.opts.OpenDurationOf(int(c.trips))
	if c.opts.Jitter > 0 && c.shared != nil && c.shared.Rand != nil {
		d += time.Duration(float64(d) * c.opts.Jitter * c.shared.Rand())
	}
	c.round++
	c.roundBegun = false
	t := c.transition(now, Open, reason)
	t.Trip = int(c.trips)
	t.OpenUntil = now.Add(d)
	c.setState(Open)
	c.openUntil, c.blocked = stampOf(t.OpenUntil), false
	c.consecutive = 0
	return t
}

func (c *Circuit) halfOpen(now time.Time) Transition {
	t := c.transition(now, HalfOpen, ReasonDue)
	c.setState(HalfOpen)
	c.probeOK = 0
	c.roundBegun, c.roundStart, c.roundOK = true, stampOf(now), 0
	return t
}

func (c *Circuit) probeResult(now time.Time, failed bool) (Transition, bool) {
	if failed {
		return c.open(now, ReasonProbeFailed, true), true
	}
	c.probeOK++
	c.roundOK++
	if int(c.probeOK) < c.opts.HalfOpenSuccessThreshold {
		return Transition{}, false
	}
	return c.close(now, ReasonProbesOK), true
}

func (c *Circuit) close(now time.Time, reason Reason) Transition {
	t := c.transition(now, Closed, reason)
	if c.group != nil && (c.state == Open || c.state == HalfOpen) {
		c.group.ejected--
	}
	c.setState(Closed)
	c.trips, c.consecutive, c.blocked = 0, 0, false
	c.win.reset(now)
	return t
}

// BeginHalfOpen is called when the kernel reports that it admitted the
// first probe of round (the open period elapsed and a connection came, or
// a new round began). A record of another round than the circuit's
// current one is stale and ignored.
func (c *Circuit) BeginHalfOpen(now time.Time, round uint32) (Transition, bool) {
	if round != c.round {
		return Transition{}, false
	}
	c.last = stampOf(now)
	switch c.state {
	case Open:
		return c.halfOpen(now), true
	case HalfOpen:
		if !c.roundBegun {
			c.roundBegun, c.roundStart, c.roundOK = true, stampOf(now), 0
		}
	}
	return Transition{}, false
}

// Tick advances time. probe_timeout after a half-open round began: when no
// probe of the round succeeded (and none failed: that reopens at once),
// the circuit reopens (a trip, so the open duration grows); when some
// succeeded, it stays half-open with its count of successes and begins a
// new round (a transition with ReasonNewRound, whose verdict the daemon
// writes), so a little traffic closes it in time. A round no connection
// has begun waits for one. The daemon calls Tick periodically.
func (c *Circuit) Tick(now time.Time) (Transition, bool) {
	if c.state != HalfOpen || !c.roundBegun || now.Sub(c.roundStart.time()) < c.opts.ProbeTimeout {
		return Transition{}, false
	}
	c.last = stampOf(now)
	if c.roundOK == 0 {
		return c.open(now, ReasonProbeTimeout, true), true
	}
	c.round++
	c.roundBegun, c.roundOK = false, 0
	return c.transition(now, HalfOpen, ReasonNewRound), true
}

// Round returns the half-open round the circuit's verdict admits probes
// of.
func (c *Circuit) Round() uint32 { return c.round }

// SeedRound makes the circuit's rounds continue after round (the probe
// budget its counter slot holds in the kernel, from an earlier circuit of
// that slot or an earlier daemon), so its first open verdict begins a new
// round there.
func (c *Circuit) SeedRound(round uint32) {
	if int32(round-c.round) > 0 {
		c.round = round
	}
}

// NotEnforced closes an open circuit whose verdict the kernel never had
// through its open duration (the daemon found no room for it): it
// rejected nothing and admits no probe, so it would stay open for good;
// closed, it counts its calls afresh and opens again if they still fail.
// It does nothing (false) in any other state or before the open duration
// has elapsed.
func (c *Circuit) NotEnforced(now time.Time) (Transition, bool) {
	if c.state != Open || now.Before(c.openUntil.time()) {
		return Transition{}, false
	}
	c.last = stampOf(now)
	return c.close(now, ReasonNotEnforced), true
}

// RoundAfter makes the round the circuit's verdict admits probes of come
// after round, the probe budget of a counter slot it takes while it
// rejects (a dynamic circuit is given its kernel id when it first
// rejects), so its verdict, written next, begins a new round there. A
// round already begun stays as it is. It returns the circuit's round.
func (c *Circuit) RoundAfter(round uint32) uint32 {
	if !c.roundBegun && int32(c.round-round) <= 0 {
		c.round = round + 1
	}
	return c.round
}

// Override applies an operator's change: forced_open, forced_closed,
// disabled, or NoOverride to release an override (back to closed, fresh).
func (c *Circuit) Override(now time.Time, o Override) Transition {
	c.last = stampOf(now)
	to := overrideState(o)
	reason := map[Override]Reason{ForceOpen: ReasonForcedOpen, ForceClosed: ReasonForcedClosed, DisableState: ReasonDisabled, NoOverride: ReasonReleased}[o]
	if to == Closed {
		return c.close(now, reason)
	}
	t := c.close(now, reason)
	t.To = to
	c.setState(to)
	return t
}

// Reset closes the circuit and forgets its window and trips.
func (c *Circuit) Reset(now time.Time) Transition {
	c.last = stampOf(now)
	if c.state == ForcedOpen || c.state == ForcedClosed || c.state == Disabled {
		// An override stays; only the counts are forgotten.
		s := c.state
		t := c.close(now, ReasonReset)
		t.To = s
		c.setState(s)
		return t
	}
	return c.close(now, ReasonReset)
}

// Restore puts the circuit in the open state the kernel's verdict map
// shows (a restarted daemon adopting its predecessor's circuits): due at
// openUntil, admitting probes of round. begun says the kernel's budget has
// reached that round (its first probe was admitted): the circuit is then
// half-open, its round timed from now.
func (c *Circuit) Restore(now time.Time, openUntil time.Time, round uint32, begun bool) {
	if c.group != nil && c.state != Open && c.state != HalfOpen {
		c.group.ejected++
	}
	c.setState(Open)
	c.openUntil, c.round, c.last = stampOf(openUntil), round, stampOf(now)
	c.roundBegun = false
	if begun {
		c.setState(HalfOpen)
		c.probeOK = 0
		c.roundBegun, c.roundStart, c.roundOK = true, stampOf(now), 0
	}
}

// Status is a circuit's state and window, for the admin API and metrics.
type Status struct {
	State                 State
	Calls, Failures, Slow int
	FailureRate, SlowRate float64
	ConsecutiveFailures   int
	OpenUntil             time.Time
	Trip                  int
	ProbesSucceeded       int
	// Round is the half-open round the verdict admits probes of.
	Round uint32
}

// Status reports the circuit's state at now.
func (c *Circuit) Status(now time.Time) Status {
	calls, failures, slow := c.win.counts(now)
	s := Status{State: c.state, Calls: calls, Failures: failures, Slow: slow, ConsecutiveFailures: int(c.consecutive), Trip: int(c.trips), ProbesSucceeded: int(c.probeOK), Round: c.round}
	if calls > 0 {
		s.FailureRate = float64(failures) / float64(calls)
		s.SlowRate = float64(slow) / float64(calls)
	}
	if c.state == Open || c.state == HalfOpen || c.state == FleetOpen {
		s.OpenUntil = c.openUntil.time()
	}
	return s
}

// Group is the set of endpoint circuits of one endpoint-scoped target; it
// keeps no more than MaxEjectionPercent of its endpoints open (or half-open)
// at once, but always lets one endpoint be ejected (Envoy's rule: with few
// endpoints a percentage would otherwise round down to none).
type Group struct {
	// MaxEjectionPercent is the cap, in percent of the known endpoints
	// (1..100). A reload may change it; it applies to the next ejection.
	MaxEjectionPercent int
	endpoints, ejected int
}

// NewGroup makes an endpoint group.
func NewGroup(maxEjectionPercent int) *Group { return &Group{MaxEjectionPercent: maxEjectionPercent} }

// mayEject reports whether one more endpoint may be ejected: the first
// always may; then only while the ejected ones stay within
// MaxEjectionPercent of the known endpoints, rounded down.
func (g *Group) mayEject() bool {
	if g.ejected == 0 {
		return true
	}
	return (g.ejected+1)*100 <= g.MaxEjectionPercent*g.endpoints
}

// Counts returns the group's known and ejected endpoints.
func (g *Group) Counts() (endpoints, ejected int) { return g.endpoints, g.ejected }
