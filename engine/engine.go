package engine

import (
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Engine is the core's state: the circuits (registry), their kernel ids
// and verdicts, the circuits whose verdicts or limits wait for an id or
// for room, the overrides kept across restarts, the kernel counts of
// circuits gone, and what handling records and the tick keep (sockets
// connecting or awaiting a response, the answered batches). It reaches
// the kernel only through Kernel and the time only through Clock, and
// tells the daemon of transitions through Hooks. It is not safe for
// concurrent use: one goroutine owns it (the daemon's owner, which runs
// every step that touches it), and other goroutines read only what it
// publishes (Summary).
type Engine struct {
	reg     *registry
	k       Kernel
	clock   Clock
	log     *slog.Logger
	metrics Metrics
	hooks   Hooks
	rand    func() float64
	// seriesOf are the outcome series, by target and workload.
	seriesOf map[string]*Series
	// unenforced are the rejecting circuits whose verdicts could not be
	// written (no kernel id free, or the verdict map refused one); the
	// tick writes them once it can (RetryUnenforced).
	unenforced map[*Circuit]struct{}
	// unlimited are the circuits whose limits entries could not be
	// written for want of a kernel id (RetryUnenforced).
	unlimited map[*Circuit]struct{}
	// kept are the overrides kept in the pinned overrides map, by circuit
	// name (LoadKept, KeepOverride).
	kept *Overrides
	// retired are the kernel counts of dropped circuits, by target.
	retired map[string]maps.Counters
	// seating is the circuit Record feeds while it has no kernel id (the
	// seater's).
	seating *Circuit
	// errorsLogged: when each rate-limited error line was last logged
	// (ErrorEverySecond).
	errorsLogged map[string]time.Time

	// matching decides which circuit a destination belongs to (the
	// daemon's input, SetMatching); matchers are its matchers by class,
	// made as classes are seen.
	matching Matching
	matchers map[uint8]*policy.Matcher
	// pending are connecting sockets seen retransmitting SYNs, by cookie;
	// counted the sockets already counted as timed out by connect_timeout.
	pending map[uint64]pendingConn
	counted map[uint64]bool
	// timedOut are the turns counted at response_timeout, by cookie, and
	// awaiting the last scan of the inflight map (reused).
	timedOut map[uint64]timedOut
	awaiting []maps.Awaiting
	// respSince: turns that began before the response programs were last
	// attached are not counted (RespondingSince); respTimeouts: some
	// target has a response_timeout, so the tick scans the inflight map.
	respSince    time.Duration
	respTimeouts bool
	recent       recentConns // established connections by cookie, to date their resets
	warmSum      uintptr     // see warm
	// batched are the circuits whose ordinary successes the kernel counts
	// in their answered words (answered.go), and batchedIDs the same by
	// circuit id.
	batched    map[*Circuit]batch
	batchedIDs map[uint32]*Circuit
	// ramps are the closed circuits whose slow-start verdicts are in the
	// kernel (slowstart.go).
	ramps map[*Circuit]ramp
	// lastSweep is the tick's last sweep of departed endpoints;
	// lastLostCheck its last look at the kernel's count of lost records,
	// which was lostSeen then (ReconcileRounds).
	lastSweep     time.Time
	lastLostCheck time.Time
	lostSeen      uint64
	// tallies are what each target's circuits share, with their count
	// by state; owners is whom each kernel id counts for; summary is
	// what Publish made of them last, for the metrics (summary.go).
	tallies map[string]*policy.Shared
	owners  idOwners
	summary atomic.Pointer[Summary]
	// adaptive are the circuits with adaptive limits (adaptive.go);
	// pinned the limits entries a previous daemon left, while starting
	// (SetPinnedLimits).
	adaptive map[*Circuit]struct{}
	pinned   map[maps.Dest]maps.Limit
	// fallbacks is what the kernel's fallbacks map holds, by circuit id, as
	// this engine wrote it (fallbacks.go).
	fallbacks map[uint32]maps.Fallback
}

// Hooks are what the daemon does around the engine's decisions, with
// state the engine does not hold.
type Hooks interface {
	// Opened is told that c went from one state to another with new
	// verdicts (its close_established passes: when it began rejecting,
	// and with a fallback, when it stopped).
	Opened(c *Circuit, from, to policy.State, at time.Time)
	// Transitioned is told of every transition applied, after it was
	// written and logged (the event list, the Kubernetes Event).
	Transitioned(c *Circuit, t policy.Transition)
}

// Config is what an Engine is made with.
type Config struct {
	Kernel  Kernel
	Clock   Clock
	Log     *slog.Logger
	Metrics Metrics
	Hooks   Hooks
	// Rand returns numbers in [0, 1) for the circuits' jitter.
	Rand func() float64
	// IDs is the number of circuit ids (maps.MaxCircuitIDs; fewer in
	// tests that run out of them).
	IDs uint32
	// RespondingSince is when the response programs were attached, on
	// the maps.Now clock: turns begun before it are not counted.
	RespondingSince time.Duration
}

// New returns an engine with no circuits.
func New(cfg Config) *Engine {
	e := &Engine{reg: newRegistry(cfg.Kernel, cfg.IDs), k: cfg.Kernel, clock: cfg.Clock, log: cfg.Log, metrics: cfg.Metrics, hooks: cfg.Hooks, rand: cfg.Rand, seriesOf: map[string]*Series{},
		unenforced: map[*Circuit]struct{}{}, unlimited: map[*Circuit]struct{}{}, retired: map[string]maps.Counters{}, errorsLogged: map[string]time.Time{},
		matchers: map[uint8]*policy.Matcher{}, pending: map[uint64]pendingConn{}, counted: map[uint64]bool{}, timedOut: map[uint64]timedOut{},
		respSince: cfg.RespondingSince, batched: map[*Circuit]batch{}, batchedIDs: map[uint32]*Circuit{}, tallies: map[string]*policy.Shared{}, ramps: map[*Circuit]ramp{},
		fallbacks: map[uint32]maps.Fallback{}, adaptive: map[*Circuit]struct{}{}}
	e.reg.classes = &e.matching.Classes
	return e
}

// keptOverride returns the override kept for the circuit named name.
func (e *Engine) keptOverride(name string) (policy.Override, bool) { return e.kept.Get(name) }

// Unenforced reports whether c rejects and some verdict of it is not in
// the kernel yet.
func (e *Engine) Unenforced(c *Circuit) bool {
	_, ok := e.unenforced[c]
	return ok
}

// UnenforcedCount is the number of circuits Unenforced reports.
func (e *Engine) UnenforcedCount() int { return len(e.unenforced) }

// MarkUnenforced files c, which rejects, among the circuits whose
// verdicts the tick writes once it can.
func (e *Engine) MarkUnenforced(c *Circuit) { e.unenforced[c] = struct{}{} }

// UnlimitedCount is the number of circuits whose limits entries wait for
// an id.
func (e *Engine) UnlimitedCount() int { return len(e.unlimited) }

// noLimits notes that c needs no limits entries (its options changed):
// it no longer waits for an id for them.
func (e *Engine) noLimits(c *Circuit) { delete(e.unlimited, c) }

// Retired is the kernel counts of target's dropped circuits.
func (e *Engine) Retired(target string) maps.Counters { return e.retired[target] }

// NeedsLimitEntry reports whether a circuit with options o has a limits
// entry: a bulkhead, or responses followed (connect marks their sockets
// for the response programs).
func NeedsLimitEntry(o *policy.Options) bool { return o.HasLimits() || o.Responses.Followed() }

// Apply writes a transition to the kernel, the log and the metrics, and
// tells the hooks (the close pass of close_established, the event list,
// the Kubernetes Event).
func (e *Engine) Apply(c *Circuit, t policy.Transition) {
	e.reg.Track(c)
	if t.From != t.To {
		if t.To != policy.HalfOpen { // the kernel began the round itself
			e.WriteVerdicts(c, t)
			e.hooks.Opened(c, t.From, t.To, t.At)
		}
		e.metrics.Transition(t.From.String(), t.To.String(), string(t.Reason), c.Workload()).Inc()
	} else if t.Reason == policy.ReasonNewRound {
		e.WriteVerdicts(c, t)
	}
	attrs := []any{"circuit", c.Name(), "target", c.Target(), "from", t.From.String(), "to", t.To.String(),
		"reason", string(t.Reason), "failure_ratio", round3(t.FailureRate), "slow_ratio", round3(t.SlowRate), "calls", t.Calls, "workload", c.Workload()}
	if !t.OpenUntil.IsZero() {
		attrs = append(attrs, "open_until", t.OpenUntil.UTC().Format(time.RFC3339Nano), "trip", t.Trip)
	}
	msg := "circuit transition"
	if t.Reason == policy.ReasonNewRound {
		msg = "new half-open round"
		attrs = append(attrs, "round", t.Round)
	} else if t.From == t.To {
		msg = "circuit kept " + t.To.String()
	}
	e.log.Info(msg, attrs...)
	e.hooks.Transitioned(c, t)
	if t.From != t.To && t.To == policy.Closed {
		e.releaseID(c) // after the Event named whom it rejected
	}
}

func round3(f float64) float64 { return float64(int(f*1000+0.5)) / 1000 }

// EvictIdle drops the least recently active closed dynamic circuit
// (registry.Victim: second chance), in amortized O(1).
func (e *Engine) EvictIdle() bool {
	victim := e.reg.Victim()
	if victim == nil {
		return false
	}
	e.Drop(victim)
	e.metrics.Evicted().Inc()
	return true
}

// Drop forgets a circuit and removes its verdicts.
func (e *Engine) Drop(c *Circuit) {
	e.syncFallback(c, false)
	for _, dst := range c.Dests() {
		if err := e.k.DeleteVerdict(dst); err != nil {
			e.log.Warn("deleting verdict", "dest", dst, "err", err)
		}
		e.deleteLimits(c, dst)
		e.reg.byDest.Del(dst.Compact())
		e.reg.version++
	}
	// Keep its kernel counts so the per-target counters never go down.
	if c.ID != 0 {
		e.retire(c.Target(), c.ID)
	}
	for _, s := range c.BulkSlots() {
		e.releaseBulkSlot(c, s)
	}
	c.Machine.Release()
	if s := c.Machine.State(); s == policy.ForcedOpen || s == policy.ForcedClosed || s == policy.Disabled {
		e.KeepOverride(c, policy.NoOverride)
	}
	if c.IsNamed() {
		delete(e.reg.byName, c.Name())
	}
	e.reg.Untrack(c)
	delete(e.unenforced, c)
	delete(e.unlimited, c)
	delete(e.adaptive, c)
	if c.Target() == AllTarget {
		e.reg.dynamic--
	}
	e.forgetEpoch(c)
	e.unbatch(c)
	e.owners.clear(c.ID)
	e.endRamp(c)
	e.reg.ids.Release(c.ID, c.Name())
	e.reg.version++ // also for a named circuit left with no destination
}

// ErrorEverySecond logs msg at error level at most once a second per key
// (msg and key): a shortage of ids or map room meets every circuit or
// record at once. The metrics count each.
func (e *Engine) ErrorEverySecond(key, msg string, args ...any) {
	now := e.clock.Now()
	if now.Sub(e.errorsLogged[msg+"\x00"+key]) < time.Second {
		return
	}
	e.errorsLogged[msg+"\x00"+key] = now
	e.log.Error(msg, args...)
}

// KeepOverride records (or, for NoOverride, forgets) c's override set
// through the API in the pinned overrides map, so it survives a restart.
func (e *Engine) KeepOverride(c *Circuit, o policy.Override) {
	if err := e.kept.Keep(c.Name(), o); err != nil {
		e.log.Warn("the override will not survive a restart", "circuit", c.Name(), "err", err)
	}
}

// LoadKept reads the overrides a previous daemon kept in the pinned map
// (Overrides).
func (e *Engine) LoadKept() { e.kept = LoadOverrides(e.k) }
