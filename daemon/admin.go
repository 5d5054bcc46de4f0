package daemon

import (
	"fmt"
	"slices"
	"time"

	"github.com/breakerd/breakerd/admin"
	"github.com/breakerd/breakerd/api"
	"github.com/breakerd/breakerd/engine"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Bounds of what the admin API shows. Every response is built from a
// copy the owner makes in a step (in-memory state of at most a page of
// circuits, and every circuit's name when the set changed since the last
// sort; no kernel reads), then completed and encoded
// on the client's goroutine, so a slow or hostile client never holds up
// the event loop or the heartbeat.
const (
	// PageSize is the most circuits one page lists (admin.PageSize).
	PageSize = admin.PageSize
	// listedDests is the most destinations one circuit lists; the count
	// of all is destinations_total.
	listedDests = 32
)

// CircuitInfo is api.CircuitInfo.
type CircuitInfo = api.CircuitInfo

// circuitSnap is what the owner copies of a circuit; complete turns it
// into a CircuitInfo outside the owner's steps.
type circuitSnap struct {
	info  CircuitInfo
	opts  *policy.Options // from the loaded configuration: never changed after load
	dests []maps.Dest
	round uint32 // the half-open round the circuit's verdict admits probes of
	// cgroups whose connections failed, named as pods by complete.
	cgroups []uint64
	bulk    []bulkSlot // the sharing workloads' bulkheads
	owners  []owner    // key the cgroups it rejected (rejections.go)
}

// snap copies what the API shows of c. Called in a step of the owner; no
// kernel reads.
func (d *Daemon) snap(c *circuit, now time.Time) circuitSnap {
	st := c.Machine.Status(now)
	scope := string(c.Scope())
	if c.Target() == allTarget {
		scope = "dynamic"
	}
	s := circuitSnap{
		info: CircuitInfo{Name: c.Name(), Target: c.Target(), Workload: c.Workload(), Scope: scope, State: st.State.String(),
			FailureRate: st.FailureRate, SlowRate: st.SlowRate, Calls: st.Calls, Failures: st.Failures, Slow: st.Slow,
			ConsecutiveFailures: st.ConsecutiveFailures, OpenUntil: st.OpenUntil, Trip: st.Trip, CircuitID: c.ID,
			DestinationsTotal: len(c.Dests()), ClosedEstablished: c.ClosedEstablished(), Unenforced: d.isUnenforced(c),
			AdaptiveLimits: adaptiveLimits(c)},
		opts:    c.Machine.Options(),
		dests:   slices.Clone(c.Dests()[:min(len(c.Dests()), listedDests)]),
		round:   st.Round,
		cgroups: c.FailedCgroups(),
		bulk:    c.BulkSlots(),
		owners:  owners(c),
	}
	d.fleetInfo(c, &s.info)
	if share, until, ok := d.eng.Ramping(c); ok {
		s.info.SlowStart = &api.SlowStart{Share: share, Until: until}
	}
	return s
}

// complete adds the kernel's view (probe tokens, counters) to a snapshot.
// Called outside the owner: the maps are safe for concurrent use.
func (d *Daemon) complete(s circuitSnap, names *cgroupNamer) CircuitInfo {
	ci := s.info
	ci.Options = optionsMap(s.opts)
	ci.Fallback = s.opts.FallbackText()
	ci.FailedPods = d.podNames(s.cgroups)
	if s.opts.CloseEstablished {
		ci.CloseMechanism = string(maps.CloseNone)
		if m, ok := d.closeMech.Load().(maps.CloseMechanism); ok {
			ci.CloseMechanism = string(m)
		}
	}
	ci.RejectedBy, ci.RejectedByTotal = d.rejectedBy(s.owners, names)
	ci.Destinations = make([]string, 0, len(s.dests))
	for _, dst := range s.dests {
		ci.Destinations = append(ci.Destinations, dst.String())
	}
	slices.Sort(ci.Destinations)
	if ci.CircuitID != 0 && (ci.State == policy.Open.String() || ci.State == policy.HalfOpen.String()) {
		// One budget per circuit: the tokens left in its current round,
		// all of them when the round has not begun.
		left := int32(s.opts.HalfOpenProbes)
		if b, err := d.kernel.Budget(ci.CircuitID); err == nil && b.Round == s.round {
			left = int32(b.Tokens)
		}
		ci.ProbesLeft = &left
	}
	if ci.CircuitID != 0 { // 0: a dynamic circuit that never rejected has nothing in the kernel
		if cnt, err := d.kernel.Counters(ci.CircuitID); err == nil {
			ci.Rejected, ci.ShadowRejected, ci.BulkheadRejected = cnt.Rejected, cnt.ShadowRejected, cnt.BulkheadRejected
			ci.SlowStartRejected = cnt.SlowStartRejected
			ci.Redirected = cnt.Redirected
		}
		if b, err := d.kernel.BulkCount(ci.CircuitID); err == nil {
			ci.Connections, ci.Connecting = b.Connections, b.Connecting
		}
	}
	d.completeBulkheads(&ci, s.bulk)
	return ci
}

func optionsMap(o *policy.Options) map[string]any {
	m := map[string]any{
		"failure_rate_threshold": o.FailureRateThreshold, "window_size": o.WindowSize, "window_duration": o.WindowDuration.String(),
		"min_requests": o.MinRequests, "consecutive_failures": o.ConsecutiveFailures, "slow_call_duration": o.SlowCallDuration.String(),
		"slow_call_rate_threshold": o.SlowCallRateThreshold, "connect_timeout": o.ConnectTimeout.String(), "open_duration": o.OpenDuration.String(),
		"open_duration_multiplier": o.OpenDurationMultiplier, "max_open_duration": o.MaxOpenDuration.String(), "jitter": o.Jitter,
		"half_open_probes": o.HalfOpenProbes, "half_open_success_threshold": o.HalfOpenSuccessThreshold, "probe_timeout": o.ProbeTimeout.String(),
		"reject_errno": policy.ErrnoName(o.RejectErrno), "count_abandoned": o.CountAbandoned, "reset_failure_window": o.ResetFailureWindow.String(),
		"max_connections": o.MaxConnections, "max_connecting": o.MaxConnecting, "bulkhead_reject_errno": policy.ErrnoName(o.BulkheadRejectErrno),
		"close_established": o.CloseEstablished,
	}
	if o.SlowStart.On() {
		m["slow_start"] = fmt.Sprintf("%v from %g, aggression %g", o.SlowStart.Duration, o.SlowStart.Floor, o.SlowStart.Aggression)
	}
	if o.HasFallback() {
		m["fallback"] = o.FallbackText()
	}
	for _, a := range []struct {
		key  string
		spec policy.Adaptive
	}{{"max_connections", o.AdaptiveConnections}, {"max_connecting", o.AdaptiveConnecting}} {
		if a.spec.On() {
			m[a.key] = map[string]any{"adaptive": a.spec.Algorithm.String(), "min": a.spec.Min, "initial": a.spec.Initial, "max": a.spec.Max}
		}
	}
	responseOptions(m, &o.Responses)
	return m
}

// CircuitsPage returns up to limit circuits (1..PageSize; other values
// mean PageSize) whose names sort after after, in name order, and whether
// more follow. The owner's steps only copy names and then the chosen
// circuits' in-memory state; sorting, kernel reads and encoding happen
// outside them. The sorted names are kept: a first page (after "")
// sorts them again only when the set of circuits changed since
// (registry.version); a later page uses them as they are for up to
// pagesStale, so a walk through every page sorts them once, not once a
// page: it lists the circuits there were when some first page (its own,
// or another client's up to pagesStale before) sorted them, less those
// gone since. The tick drops names no page asked for in pagesIdle.
func (d *Daemon) CircuitsPage(after string, limit int) (_ []CircuitInfo, more bool) {
	if limit <= 0 || limit > PageSize {
		limit = PageSize
	}
	all := d.sortedNames(after != "")
	i, found := slices.BinarySearch(all, after)
	if found {
		i++
	}
	names := all[i:]
	if len(names) > limit {
		names, more = names[:limit], true
	}
	snaps := make([]circuitSnap, 0, len(names))
	d.do(func() {
		now := d.now()
		for _, name := range names {
			if c, ok := d.eng.Get(name); ok { // it may have gone in between
				snaps = append(snaps, d.snap(c, now))
			}
		}
	})
	out := make([]CircuitInfo, 0, len(snaps))
	var namer cgroupNamer
	for _, s := range snaps {
		out = append(out, d.complete(s, &namer))
	}
	return out, more
}

// sortedNames returns the names of every circuit, sorted: the kept list
// while the set of circuits is unchanged (or, with stale, whenever there
// is one), else a new one. The slice is shared: do not change it.
func (d *Daemon) sortedNames(stale bool) []string {
	// The owner copies only a named circuit's name and a dynamic one's
	// destination (its name is made here).
	type dyn struct {
		dst      maps.Dest
		workload string
	}
	var (
		kept    []string
		named   []string
		dynamic []dyn
		version uint64
		at      time.Time
	)
	d.do(func() {
		version = d.eng.Version()
		d.pages.mu.Lock()
		d.pages.used = time.Now()
		if d.pages.names != nil && (d.pages.version == version || stale && time.Since(d.pages.at) < pagesStale) {
			kept = d.pages.names
		}
		d.pages.mu.Unlock()
		if kept != nil {
			return
		}
		at = time.Now()
		named = make([]string, 0, d.eng.NamedCount())
		for c := range d.eng.Named() {
			named = append(named, c.Name())
		}
		dynamic = make([]dyn, 0, d.eng.Count()-d.eng.NamedCount())
		for c := range d.eng.All() {
			if !c.IsNamed() {
				dynamic = append(dynamic, dyn{c.First(), c.Workload()})
			}
		}
	})
	if kept != nil {
		return kept
	}
	names := make([]string, 0, len(named)+len(dynamic))
	names = append(names, named...)
	for _, x := range dynamic {
		names = append(names, engine.Classed(engine.DynamicName(x.dst), x.workload))
	}
	slices.Sort(names)
	d.pages.mu.Lock()
	d.pages.names, d.pages.version, d.pages.at = names, version, at
	d.pages.mu.Unlock()
	return names
}

const (
	// pagesStale is how long a walk's later pages may use names sorted
	// for an earlier first page.
	pagesStale = 10 * time.Second
	// pagesIdle is how long sorted names are kept with no page asking
	// (a million of them take tens of MiB).
	pagesIdle = 30 * time.Second
)

// dropIdlePages forgets the sorted names once no page asked for them in
// pagesIdle.
func (d *Daemon) dropIdlePages() {
	d.pages.mu.Lock()
	defer d.pages.mu.Unlock()
	if d.pages.names != nil && time.Since(d.pages.used) >= pagesIdle {
		d.pages.names = nil
	}
}

// Circuits returns every circuit's state, sorted by name, page by page.
func (d *Daemon) Circuits() []CircuitInfo {
	out := []CircuitInfo{}
	after := ""
	for {
		page, more := d.CircuitsPage(after, PageSize)
		out = append(out, page...)
		if !more || len(page) == 0 {
			return out
		}
		after = page[len(page)-1].Name
	}
}

// Circuit returns one circuit's state.
func (d *Daemon) Circuit(name string) (CircuitInfo, bool) {
	var s circuitSnap
	var ok bool
	d.do(func() {
		var c *circuit
		if c, ok = d.eng.Get(name); ok {
			s = d.snap(c, d.now())
		}
	})
	if !ok {
		return CircuitInfo{}, false
	}
	return d.complete(s, &cgroupNamer{}), true
}

// Events returns the recent transitions, oldest first.
func (d *Daemon) Events() []TransitionEvent { return d.events.list() }

// ErrNoCircuit is returned for an unknown circuit name.
var ErrNoCircuit = admin.ErrNoCircuit

// Force applies an operator's change to a circuit: "open", "close",
// "release" (back to the configured behaviour) or "reset".
func (d *Daemon) Force(name, action string) (CircuitInfo, error) {
	var s circuitSnap
	var err error
	d.do(func() {
		c, ok := d.eng.Get(name)
		if !ok {
			err = fmt.Errorf("%w: %s", ErrNoCircuit, admin.Quote(name))
			return
		}
		now := d.now()
		t, ok := d.eng.Force(c, action, now)
		if !ok {
			err = fmt.Errorf("unknown action %s (open, close, release, reset)", admin.Quote(action))
			return
		}
		d.closePasses(c, t.From, t.To, now)
		d.metrics.transitions.WithLabelValues(t.From.String(), t.To.String(), string(t.Reason), c.Workload()).Inc()
		d.log.Info("circuit changed by hand", "circuit", c.Name(), "action", action, "from", t.From.String(), "to", t.To.String())
		d.events.add(TransitionEvent{Time: now, Circuit: c.Name(), Target: c.Target(), Workload: c.Workload(), From: t.From.String(), To: t.To.String(), Reason: string(t.Reason)})
		s = d.snap(c, now)
	})
	if err != nil {
		return CircuitInfo{}, err
	}
	return d.complete(s, &cgroupNamer{}), nil
}

// isUnenforced reports whether c is a rejecting circuit whose verdicts the
// kernel does not all have yet (engine.Engine.Unenforced). Called in a
// step of the owner.
func (d *Daemon) isUnenforced(c *circuit) bool { return d.eng.Unenforced(c) }
