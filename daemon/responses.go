package daemon

import (
	"slices"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Responses: for a target with response options the kernel follows every
// connection's request/response turns (bpf/responses.h, cgroup_skb) and
// reports each response's first byte (maps.Response) and each connection
// that ended while a request awaited one (maps.NoResponse). Each turn is
// one call of the target's circuit; the handshake is not a call of its own
// (its failures still are). response_timeout is the daemon's: the kernel
// cannot time out by itself, so every tick the daemon reads the inflight
// map (one entry per socket with a request awaiting its first byte, with
// the request's start) and counts a request older than response_timeout
// as failed then. A late answer to it, or the connection's end, is not
// counted again (timedOut remembers the turn by its start).

// followsResponses reports whether some target of cfg has response options
// (only then are the response programs attached).
func followsResponses(cfg *policy.Config) bool {
	for _, t := range cfg.Targets {
		if t.Options.Responses.Followed() {
			return true
		}
	}
	return false
}

// limitOf is the limits entry of a circuit with id and options o.
func limitOf(id uint32, o *policy.Options) maps.Limit {
	l := maps.Limit{Slot: id, MaxConnections: uint32(o.MaxConnections), MaxConnecting: uint32(o.MaxConnecting), Errno: o.BulkheadRejectErrno}
	if r := &o.Responses; r.Followed() {
		l.Responses = maps.RespTimed
		if r.HTTP {
			l.Responses |= maps.RespHTTP
		}
		if r.ResponseTimeout > 0 {
			l.Responses |= maps.RespInflight
		}
	}
	return l
}

// limitFor is limits entry e of circuit c (options o): its limits, the
// response flags, and with them, where the kernel may count c's ordinary
// successes, its answered word (written first by batchOf). The caller
// holds d.mu.
func (d *Daemon) limitFor(c *circuit, o *policy.Options, e bulkEntry) maps.Limit {
	l := limitOf(e.slot, o)
	l.Epoch = e.epoch
	if l.Responses != 0 {
		if b, ok := d.batchOf(c, o); ok {
			l.Responses |= maps.RespBatch
			l.BatchID, l.BatchEpoch, l.FastBound = b.id, b.epoch, b.fast
		}
	}
	return l
}

// setResponses attaches or detaches the response programs as cfg needs
// them. A request whose turn began before they were last attached is
// never counted (respSince): its socket may carry a stale turn. The
// caller holds d.mu.
func (d *Daemon) setResponses(cfg *policy.Config) {
	on := followsResponses(cfg)
	if on && !d.k.Responses() {
		d.respSince = maps.Now()
		d.unbatchAll()
	}
	if err := d.k.SetResponses(on); err != nil {
		d.log.Error("response programs (responses are not followed until the next reload)", "err", err)
	}
}

// handleResponse feeds a Response or NoResponse record to circuit c.
func (d *Daemon) handleResponse(c *circuit, ev *maps.Event, now time.Time) {
	o := &c.Machine.Options().Responses
	start := ev.Time - ev.Duration // the request's first byte
	if !o.Followed() || start < d.respSince {
		return // the target no longer follows responses, or a stale turn
	}
	if m, ok := d.timedOut[ev.Cookie]; ok && m.start == start {
		delete(d.timedOut, ev.Cookie) // counted at response_timeout
		return
	}
	r := policy.Result{Kind: policy.Answered, Duration: ev.Duration, Status: ev.Status, HTTP: ev.HTTP,
		Probe: ev.Probe, Round: ev.Round}
	if ev.Outcome == maps.NoResponse {
		r.Kind, r.PeerClosed, r.Err = policy.NoResponse, ev.PeerClosed, ev.Err != 0
	}
	call := policy.Classify(c.Machine.Options(), r)
	c.Metrics.Response(call.Response).Inc()
	if !call.Counts {
		return
	}
	if call.Failed {
		c.NoteFailedCgroup(ev.CgroupID)
	}
	d.record(c, r, call, 1, now)
}

// record feeds n calls with result r, classified as call, to c
// (engine.Record); calls that move nothing give c its second chance at
// eviction.
func (d *Daemon) record(c *circuit, r policy.Result, call policy.Call, n int, now time.Time) {
	if !d.eng.Record(c, now, r, call, n) {
		c.Referenced() // see engine.Registry.Victim
	}
}

// scanResponseTimeouts counts every request that has waited longer than
// its circuit's response_timeout (once per turn). The caller holds d.mu.
func (d *Daemon) scanResponseTimeouts(now time.Time) {
	if !d.respTimeouts {
		return
	}
	// The clock first: a request seen still waiting got no response byte
	// before it, so one the kernel counted as an ordinary success (faster
	// than response_timeout) is never also seen timed out here.
	mono := maps.Now()
	var err error
	d.awaiting, err = d.k.Awaiting(d.awaiting[:0])
	if err != nil {
		d.log.Warn("reading requests in flight", "err", err)
		return
	}
	seen := make(map[uint64]bool, len(d.timedOut))
	for i := range d.awaiting {
		a := &d.awaiting[i]
		seen[a.Cookie] = true
		if a.Since == 0 || a.Since < d.respSince {
			continue
		}
		if m, ok := d.timedOut[a.Cookie]; ok && m.start == a.Since {
			continue
		}
		c, _ := d.reg.At(a.Dest)
		if c == nil {
			continue
		}
		o := &c.Machine.Options().Responses
		waited := mono - a.Since
		if o.ResponseTimeout == 0 || waited < o.ResponseTimeout {
			continue
		}
		d.timedOut[a.Cookie] = timedOut{start: a.Since}
		c.Metrics.Response(policy.ResponseTimeout).Inc()
		c.NoteFailedCgroup(a.CgroupID)
		r := policy.Result{Kind: policy.Failure, Duration: waited, Probe: a.Probe, Round: a.Round}
		d.record(c, r, policy.Classify(c.Machine.Options(), r), 1, now)
	}
	for cookie, m := range d.timedOut {
		if seen[cookie] {
			continue
		}
		// The socket is gone. Its last record (a late answer, the
		// connection's end) was in the ring before its entry went, and
		// the reader reads the ring every tick: keep the mark a few
		// scans, until that record has surely been handled.
		if m.gone++; m.gone > timedOutKeep {
			delete(d.timedOut, cookie)
		} else {
			d.timedOut[cookie] = m
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

// hasResponseTimeouts reports whether some target of cfg has a
// response_timeout (only then does the tick read the inflight map).
func hasResponseTimeouts(cfg *policy.Config) bool {
	for _, t := range cfg.Targets {
		if t.Options.Responses.ResponseTimeout > 0 {
			return true
		}
	}
	return false
}

// minSlowResponse is the shortest slow_response_duration of cfg (0: none).
func minSlowResponse(cfg *policy.Config) time.Duration {
	var m time.Duration
	for _, t := range cfg.Targets {
		if s := t.Options.Responses.SlowResponseDuration; s > 0 && (m == 0 || s < m) {
			m = s
		}
	}
	return m
}

// responseOptions adds a target's response options to its options in the
// API (only when it follows responses).
func responseOptions(m map[string]any, r *policy.ResponseOptions) {
	if !r.Followed() {
		return
	}
	m["slow_response_duration"] = r.SlowResponseDuration.String()
	m["response_timeout"] = r.ResponseTimeout.String()
	m["protocol"] = "tcp"
	if r.HTTP {
		m["protocol"] = "http"
		m["failure_statuses"] = r.FailureStatuses.String()
	}
	m["count_dropped"] = !r.IgnoreDropped
}

// limitEntries are the limits entries of dst of c: its bulkheads' (see
// bulkheadEntries), or, for a circuit that follows responses without a
// bulkhead, one under every class connect looks its limits up with (the
// slot is then unused: an entry with both limits 0 only marks sockets).
func (d *Daemon) limitEntries(c *circuit, dst maps.Dest) []bulkEntry {
	if c.Machine.Options().HasLimits() {
		return d.bulkheadEntries(c, dst)
	}
	if c.ID == 0 {
		return nil // no id free for it (writeLimit logged it): nothing in slot 0
	}
	var out []bulkEntry
	if c.Workload() != policy.SharedWorkload || !d.cfg.Scoped() {
		out = append(out, bulkEntry{dst: dst, slot: c.ID})
	}
	if c.Workload() == policy.SharedWorkload {
		for _, k := range d.classes.SharedBulkheads() {
			b := dst
			b.Class = uint8(k)
			if !slices.ContainsFunc(out, func(e bulkEntry) bool { return e.dst == b }) {
				out = append(out, bulkEntry{dst: b, slot: c.ID})
			}
		}
	}
	return out
}
