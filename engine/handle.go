package engine

import (
	"time"
	"unsafe"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// pendingConn is a connecting socket seen retransmitting SYNs: the tick
// counts it as failed at its circuit's connect_timeout.
type pendingConn struct {
	dest  maps.Dest
	start time.Time
	probe bool
	round uint32
}

// The second cache line warm reads is inside the circuit: this fails to
// compile if a circuit shrinks to one line.
var _ [unsafe.Sizeof(Circuit{}) - 65]byte

// prefetchFrom is the number of circuits from which HandleBatch warms the
// caches first: below it they stay in the CPU caches anyway.
const prefetchFrom = 8192

// prefetchChunk is how many records one warming pass covers: their index
// slots and circuits (some 256 bytes each) stay within a core's L2.
const prefetchChunk = 256

// HandleBatch feeds records to their circuits, in their order. With many
// circuits most records find theirs outside the CPU caches, and handle
// would wait for each miss in turn (the index slot, then the circuit); so
// each chunk is first walked with loads that do not depend on one
// another, which the CPU overlaps, and then handled from warm caches.
func (e *Engine) HandleBatch(evs []maps.Event, now time.Time) {
	if len(evs) < 2 || e.reg.byDest.Len() < prefetchFrom {
		for i := range evs {
			e.handle(&evs[i], now, nil)
		}
		return
	}
	var found [prefetchChunk]*Circuit
	for len(evs) > 0 {
		chunk := evs[:min(len(evs), prefetchChunk)]
		evs = evs[len(chunk):]
		e.warm(chunk, found[:len(chunk)])
		// What warm found stays each record's circuit until the map
		// changes (a record can make, and evict, circuits).
		v := e.reg.version
		for i := range chunk {
			var c *Circuit
			if e.reg.version == v {
				c = found[i]
			}
			e.handle(&chunk[i], now, c)
		}
	}
}

// warm loads what handling evs will touch: each record's first index slot
// (where its key is, or where the search for it starts), the first two
// cache lines of its circuit (its metrics, flags and the state machine's
// counters and window), and the reset-dating slot of its cookie; found
// gets each record's circuit (nil when it has none yet). It goes over the
// chunk in four loops: the hashes; the first slots, whose addresses the
// hashes alone give; the lookups, which find those slots loaded; the
// circuits and reset-dating slots. The loads of one loop do not depend on
// one another, so the CPU overlaps their misses. The sum is kept so the
// loads are not optimised away.
func (e *Engine) warm(evs []maps.Event, found []*Circuit) {
	var keys [prefetchChunk]maps.DestKey
	var hs [prefetchChunk]uint32
	x := &e.reg.byDest
	if x.Len() == 0 {
		clear(found)
		return
	}
	var sum uintptr
	for i := range evs {
		keys[i] = evs[i].Dest.Compact()
		hs[i] = x.Hash(&keys[i])
	}
	// Loops of loads alone: the CPU has as many of them in flight as
	// it can keep misses outstanding.
	for _, h := range hs[:len(evs)] {
		sum += x.Touch(h)
	}
	for i := range evs {
		found[i] = x.GetHashed(&keys[i], hs[i])
	}
	for i, c := range found {
		if c != nil {
			sum += uintptr(c.ID) + uintptr(*(*byte)(unsafe.Add(unsafe.Pointer(c), 64)))
		}
		sum += uintptr(e.recent.peek(evs[i].Cookie))
	}
	e.warmSum += sum
}

// handle feeds one kernel record to its circuit: c when the caller has
// looked it up already, else the one at the record's destination (made if
// there is none yet).
func (e *Engine) handle(ev *maps.Event, now time.Time, c *Circuit) {
	if ev.Outcome == maps.Answered {
		e.creditAnswered(ev, now)
		return
	}
	if ev.Outcome == maps.ProbeRound {
		if c == nil {
			c, _ = e.reg.At(ev.Dest)
		}
		if c != nil {
			if t, moved := c.Machine.BeginHalfOpen(now, ev.Round); moved {
				e.Apply(c, t)
			}
		}
		return
	}
	var resetAt time.Duration
	if ev.Outcome == maps.Reset && ev.NoAge {
		// A reset the kernel could not date (reset_seen, or on_close of a
		// socket without storage) is dated by its established record. The
		// tracepoint sees the storage-less sockets of every breakerd on
		// the machine: one this daemon has no record of may be another's,
		// so it makes no circuit and counts nothing (nor does one whose
		// record was evicted: the fail-open direction).
		at, ok := e.recent.established(ev.Cookie)
		if !ok || ev.Time < at {
			return
		}
		resetAt = at
	}
	known := true // not made by this record
	if c == nil {
		var made bool
		if c, made = e.Lookup(ev.Dest, now); c == nil {
			return
		}
		known = !made
	}
	if ev.Outcome == maps.Response || ev.Outcome == maps.NoResponse {
		e.handleResponse(c, ev, now)
		return
	}
	tm := c.Metrics
	tm.Outcome(ev.Outcome).Inc()
	if ev.Outcome == maps.SYNRetrans {
		e.pending[ev.Cookie] = pendingConn{dest: ev.Dest, start: now.Add(-ev.Duration), probe: ev.Probe, round: ev.Round}
		return
	}
	if len(e.pending) > 0 {
		delete(e.pending, ev.Cookie)
	}
	if len(e.counted) > 0 && e.counted[ev.Cookie] {
		// Already counted as timed out by connect_timeout.
		delete(e.counted, ev.Cookie)
		return
	}
	feedHandshake(c, ev.Outcome, ev.Duration)
	r := policy.Result{Duration: ev.Duration, Probe: ev.Probe, Round: ev.Round}
	switch ev.Outcome {
	case maps.Established:
		r.Kind = policy.Success
		tm.Handshake().Observe(ev.Duration.Seconds())
		if c.Machine.Options().ResetFailureWindow > 0 {
			e.recent.add(ev.Cookie, ev.Time)
		}
	case maps.Abandoned:
		r.Kind = policy.Abandoned
	case maps.Reset:
		r.Kind = policy.Reset
		if ev.NoAge {
			// Dated by its established record, above (the handshake
			// time is within the window's precision).
			r.Duration = ev.Time - resetAt
		}
	case maps.Refused, maps.TimedOut, maps.Unreachable, maps.Stalled, maps.Error:
		r.Kind = policy.Failure
	default:
		return
	}
	call := policy.Classify(c.Machine.Options(), r)
	if call.Failed {
		c.NoteFailedCgroup(ev.CgroupID) // the pods that saw failures
	}
	if !e.Record(c, now, r, call, 1) && known {
		c.Referenced() // see registry.Victim
	}
}

// handleResponse feeds a Response or NoResponse record to circuit c.
func (e *Engine) handleResponse(c *Circuit, ev *maps.Event, now time.Time) {
	o := &c.Machine.Options().Responses
	start := ev.Time - ev.Duration // the request's first byte
	if !o.Followed() || start < e.respSince {
		return // the target no longer follows responses, or a stale turn
	}
	if m, ok := e.timedOut[ev.Cookie]; ok && m.start == start {
		delete(e.timedOut, ev.Cookie) // counted at response_timeout
		return
	}
	r := policy.Result{Kind: policy.Answered, Duration: ev.Duration, Status: ev.Status, HTTP: ev.HTTP,
		Probe: ev.Probe, Round: ev.Round}
	if ev.Outcome == maps.NoResponse {
		r.Kind, r.PeerClosed, r.Err = policy.NoResponse, ev.PeerClosed, ev.Err != 0
	}
	feedResponse(c, &r)
	call := policy.Classify(c.Machine.Options(), r)
	c.Metrics.Response(call.Response).Inc()
	if !call.Counts {
		return
	}
	if call.Failed {
		c.NoteFailedCgroup(ev.CgroupID)
	}
	e.record(c, r, call, 1, now)
}

// record feeds n calls with result r, classified as call, to c (Record);
// calls that move nothing give c its second chance at eviction.
func (e *Engine) record(c *Circuit, r policy.Result, call policy.Call, n int, now time.Time) {
	if !e.Record(c, now, r, call, n) {
		c.Referenced() // see registry.Victim
	}
}

// RespondingSince notes that the response programs were attached at
// since (maps.Now clock): a turn begun before it is never counted, as
// its socket may carry a stale turn, and every batch is retired (the
// next limits writes give new epochs).
func (e *Engine) RespondingSince(since time.Duration) {
	e.respSince = since
	e.unbatchAll()
}
