package daemon

import (
	"sort"
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// circuit, registry and bulkSlot are the engine's; allTarget names the
// target of dynamic circuits.
type (
	circuit  = engine.Circuit
	registry = engine.Registry
	bulkSlot = engine.BulkSlot
)

const allTarget = engine.AllTarget

// endpointIdle is how long a closed endpoint circuit seen only in traffic
// may stay idle before it leaves its group (and so the denominator of
// max_ejection_percent).
const endpointIdle = 10 * time.Minute

// sweepDepartedEndpoints drops closed endpoint circuits seen only in
// traffic that have been idle for d.endpointIdle.
func (d *Daemon) sweepDepartedEndpoints(now time.Time) {
	var gone []*circuit
	for c := range d.reg.Endpoints {
		if !c.Enumerated && c.Machine.State() == policy.Closed && now.Sub(c.Machine.LastActivity()) >= d.endpointIdle {
			gone = append(gone, c)
		}
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i].Name() < gone[j].Name() })
	for _, c := range gone {
		d.log.Debug("endpoint departed (idle)", "circuit", c.Name())
		d.eng.Drop(c)
	}
}

// idLimitForTest, when not 0, is the number of ids a new daemon has
// (tests that run out of ids at start-up).
var idLimitForTest uint32

// newEngine makes the daemon's core on d.kernel and d.clock.
func (d *Daemon) newEngine() {
	limit := uint32(maps.MaxCircuitIDs)
	if idLimitForTest != 0 {
		limit = idLimitForTest
	}
	d.eng = engine.New(engine.Config{Kernel: d.kernel, Clock: d.clock, Log: d.log, Metrics: d.metrics, Hooks: hooks{d}, Rand: d.rand, IDs: limit})
	d.reg = d.eng.Registry()
}

// hooks are the daemon's part in what the engine decides (engine.Hooks).
type hooks struct{ d *Daemon }

// Opened queues c's close_established pass (closer.go).
func (h hooks) Opened(c *circuit, from, to policy.State, at time.Time) { h.d.opened(c, from, to, at) }

// Transitioned files the transition in the event list and sends its
// Kubernetes Event.
func (h hooks) Transitioned(c *circuit, t policy.Transition) {
	d := h.d
	d.kubeEvent(c, t)
	d.events.add(TransitionEvent{Time: t.At, Circuit: c.Name(), Target: c.Target(), Workload: c.Workload(), From: t.From.String(), To: t.To.String(),
		Reason: string(t.Reason), FailureRate: t.FailureRate, SlowRate: t.SlowRate, Calls: t.Calls, OpenUntil: t.OpenUntil, Trip: t.Trip})
}

// WriteLimit writes dst's limits entries of c.
func (h hooks) WriteLimit(c *circuit, dst maps.Dest) { h.d.writeLimit(c, dst) }

// Unbatch forgets the successes the kernel counts for c (answered.go).
func (h hooks) Unbatch(c *circuit) { h.d.unbatch(c) }

// matcherOf returns the matcher of a destination's class and its
// workload; nil for a class no workload has (a stale key).
func (d *Daemon) matcherOf(class uint8) (*policy.Matcher, string) {
	w := d.classes.Name(policy.Class(class))
	if w == "" {
		return nil, ""
	}
	m := d.matchers[class]
	if m == nil {
		name := w
		if class == 0 {
			name = ""
		}
		m = policy.NewWorkloadMatcher(d.cfg, name, d.resolved, d.services)
		d.matchers[class] = m
	}
	return m, w
}

// lookup finds or makes the circuit of destination d under cfg. It
// returns nil for an excluded destination, and for a new one past
// max_circuits (which bounds the destinations of every circuit, dynamic or
// of a target) when no idle closed dynamic circuit can be evicted, or when
// no circuit id is free. made tells whether this call made the circuit
// (a destination added to a target's existing circuit is not a new one).
func (d *Daemon) lookup(dst maps.Dest, now time.Time) (c *circuit, made bool) {
	if c, ok := d.reg.At(dst); ok {
		return c, false
	}
	cfg := d.cfg
	m, workload := d.matcherOf(dst.Class)
	if m == nil {
		return nil, false
	}
	target, excluded := m.Match(dst.Addr.Addr(), dst.Addr.Port(), dst.Proto.String())
	if excluded {
		return nil, false
	}
	label := target
	if label == "" {
		label = allTarget
	}
	if !d.reg.Adopting && d.reg.ByDest.Len() >= cfg.MaxCircuits && !d.eng.EvictIdle() {
		d.metrics.circuitsRefused.WithLabelValues(label).Inc()
		return nil, false
	}
	if target == "" {
		c := d.eng.Make("", allTarget, "", &cfg.All, policy.NoOverride, nil, dst, now)
		if c == nil {
			return nil, false
		}
		d.eng.Attach(c, dst)
		return c, true
	}
	t := cfg.Targets[target]
	switch t.Scope {
	case policy.EndpointScope:
		name := engine.Classed(engine.EndpointName(target, dst), workload)
		c, ok := d.reg.ByName[name]
		made := !ok
		if !ok {
			// One endpoint group per target and workload.
			group := engine.Classed(target, workload)
			g := d.reg.Groups[group]
			if g == nil {
				g = policy.NewGroup(t.MaxEjectionPercent)
				d.reg.Groups[group] = g
			}
			c = d.eng.Make(name, target, policy.EndpointScope, &t.Options, t.State, g, dst, now)
			if c == nil {
				return nil, false
			}
		}
		d.eng.Attach(c, dst)
		return c, made
	default:
		name := engine.Classed(target, workload)
		c, ok := d.reg.ByName[name]
		made := !ok
		if !ok {
			c = d.eng.Make(name, target, policy.ServiceScope, &t.Options, t.State, nil, dst, now)
			if c == nil {
				return nil, false
			}
		}
		d.eng.Attach(c, dst)
		return c, made
	}
}

// writeLimit writes (or removes) the bulkhead limits of one destination of
// c from its options.
func (d *Daemon) writeLimit(c *circuit, dst maps.Dest) {
	if dst.Proto != maps.TCP {
		return
	}
	o := c.Machine.Options()
	if !engine.NeedsLimitEntry(o) {
		d.eng.NoLimits(c) // a reload took its limits away: it needs no id for them
		if b, ok := d.batched[c]; ok && !b.off {
			d.retireBatch(c) // its sockets stop counting successes
		}
		d.eng.DeleteLimits(c, dst)
		d.eng.SyncBulkSlots(c)
		return
	}
	if !d.eng.SeatForLimits(c) {
		d.metrics.verdictWriteErrors.Inc()
		d.eng.ErrorEverySecond("", "no circuit id free (every id is in use or held by open sockets); bulkhead and response options are not enforced for a circuit until one is", "circuit", c.Name(), "dest", dst)
		return
	}
	d.eng.SyncBulkSlots(c)
	for _, e := range d.limitEntries(c, dst) {
		if err := d.kernel.PutLimit(e.dst, d.limitFor(c, o, e)); err != nil {
			d.metrics.verdictWriteErrors.Inc()
			d.log.Error("writing bulkhead limits (not enforced for this destination)", "circuit", c.Name(), "dest", e.dst, "err", err)
		}
	}
}

// orderedCircuits returns the circuits: named ones by name, then dynamic
// ones in the destination index's order (sorting a million of them, by
// name or by destination, took seconds of a reload).
func (d *Daemon) orderedCircuits() []*circuit {
	type named struct {
		name string
		c    *circuit
	}
	byName := make([]named, 0, len(d.reg.ByName))
	for _, c := range d.reg.ByName {
		byName = append(byName, named{c.Name(), c})
	}
	sort.Slice(byName, func(i, j int) bool { return byName[i].name < byName[j].name })
	out := make([]*circuit, 0, d.reg.Count())
	for _, n := range byName {
		out = append(out, n.c)
	}
	for _, c := range d.reg.ByDest.All() {
		if !c.IsNamed() {
			out = append(out, c)
		}
	}
	return out
}
