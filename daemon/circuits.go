package daemon

import (
	"fmt"
	"net/netip"
	"sort"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// allTarget is the target label of dynamic circuits (those of `all`).
const allTarget = "all"

// circuit is one circuit with what the daemon knows around it: its name,
// target, the destinations its verdict covers and its counter slot.
type circuit struct {
	name   string
	target string // allTarget for dynamic circuits
	// workload is policy.SharedWorkload, or the isolated workload whose
	// circuit it is.
	workload string
	scope    policy.Scope
	id       uint32
	c        *policy.Circuit
	dests    []maps.Dest // destinations whose verdict this circuit writes (registry.byDest maps back)
	// metrics are its target's outcome series.
	metrics *targetMetrics
	// prev and next link it into registry.idle while it is a closed
	// dynamic circuit (inIdle).
	prev, next *circuit
	inIdle     bool
	// enumerated: a destination of it is enumerated from the target's
	// match (it stays in its endpoint group while configured).
	enumerated bool
	// failedCgroups are the cgroups whose connections to it failed last
	// (at most maxFailedCgroups, most recent last; kube.go).
	failedCgroups []uint64
}

// endpointIdle is how long a closed endpoint circuit seen only in traffic
// may stay idle before it leaves its group (and so the denominator of
// max_ejection_percent).
const endpointIdle = 10 * time.Minute

// sweepDepartedEndpoints drops closed endpoint circuits seen only in
// traffic that have been idle for d.endpointIdle.
func (d *Daemon) sweepDepartedEndpoints(now time.Time) {
	var gone []*circuit
	for c := range d.reg.endpoints {
		if !c.enumerated && c.c.State() == policy.Closed && now.Sub(c.c.LastActivity()) >= d.endpointIdle {
			gone = append(gone, c)
		}
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i].name < gone[j].name })
	for _, c := range gone {
		d.log.Debug("endpoint departed (idle)", "circuit", c.name)
		d.drop(c)
	}
}

// registry holds every circuit. It is used under Daemon.mu.
//
// Besides the indexes by name and destination it keeps the few circuits
// periodic work visits, so that this work does not grow with the number of
// closed circuits: active (open, half-open or forced open: the tick and
// the reconciliation after lost records), endpoints (the departed-endpoint
// sweep), and idle, the closed dynamic circuits least recently active
// first, from whose front eviction takes its victim in O(1).
type registry struct {
	byName    map[string]*circuit
	byDest    map[maps.Dest]*circuit
	active    map[*circuit]struct{}
	endpoints map[*circuit]struct{}
	idle      idleList
	groups    map[string]*policy.Group
	ids       *ids
	dynamic   int
	// adopting is set while start-up rebuilds the circuits of the pinned
	// verdicts: max_circuits does not refuse those (an open verdict is
	// never dropped for want of room; eviction brings the count back).
	adopting bool
}

func newRegistry(k *maps.Kernel) *registry {
	return &registry{byName: map[string]*circuit{}, byDest: map[maps.Dest]*circuit{}, groups: map[string]*policy.Group{},
		active: map[*circuit]struct{}{}, endpoints: map[*circuit]struct{}{}, ids: newIDs(k)}
}

// track files c under the sets its state puts it in; call it whenever c's
// state may have changed.
func (r *registry) track(c *circuit) {
	s := c.c.State()
	if s.Rejects() {
		r.active[c] = struct{}{}
	} else {
		delete(r.active, c)
	}
	if c.target == allTarget && s == policy.Closed {
		r.idle.touch(c)
	} else {
		r.idle.remove(c)
	}
}

// untrack removes c from every set (it is being dropped).
func (r *registry) untrack(c *circuit) {
	delete(r.active, c)
	delete(r.endpoints, c)
	r.idle.remove(c)
}

// idleList is an intrusive doubly linked list of circuits, least recently
// touched first.
type idleList struct{ head, tail *circuit }

// touch moves c to the back (most recent), adding it if needed.
func (l *idleList) touch(c *circuit) {
	if c.inIdle {
		if l.tail == c {
			return
		}
		l.remove(c)
	}
	c.prev, c.next, c.inIdle = l.tail, nil, true
	if l.tail != nil {
		l.tail.next = c
	} else {
		l.head = c
	}
	l.tail = c
}

func (l *idleList) remove(c *circuit) {
	if !c.inIdle {
		return
	}
	if c.prev != nil {
		c.prev.next = c.next
	} else {
		l.head = c.next
	}
	if c.next != nil {
		c.next.prev = c.prev
	} else {
		l.tail = c.prev
	}
	c.prev, c.next, c.inIdle = nil, nil, false
}

func dynamicName(d maps.Dest) string { return d.Shared().String() }

func endpointName(target string, d maps.Dest) string { return target + "/" + d.Addr.String() }

// classed names the circuit of an isolated workload: name@workload.
func classed(name, workload string) string {
	if workload == policy.SharedWorkload {
		return name
	}
	return name + "@" + workload
}

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
// no circuit id is free.
func (d *Daemon) lookup(dst maps.Dest, now time.Time) *circuit {
	if c, ok := d.reg.byDest[dst]; ok {
		return c
	}
	cfg := d.cfg
	m, workload := d.matcherOf(dst.Class)
	if m == nil {
		return nil
	}
	target, excluded := m.Match(dst.Addr.Addr(), dst.Addr.Port(), dst.Proto.String())
	if excluded {
		return nil
	}
	label := target
	if label == "" {
		label = allTarget
	}
	if !d.reg.adopting && len(d.reg.byDest) >= cfg.MaxCircuits && !d.evictIdle() {
		d.metrics.circuitsRefused.WithLabelValues(label).Inc()
		return nil
	}
	if target == "" {
		c := d.newCircuit(classed(dynamicName(dst), workload), allTarget, "", &cfg.All, policy.NoOverride, nil, dst, now)
		if c == nil {
			return nil
		}
		d.reg.dynamic++
		d.attach(c, dst)
		return c
	}
	t := cfg.Targets[target]
	switch t.Scope {
	case policy.EndpointScope:
		name := classed(endpointName(target, dst), workload)
		c, ok := d.reg.byName[name]
		if !ok {
			// One endpoint group per target and workload.
			group := classed(target, workload)
			g := d.reg.groups[group]
			if g == nil {
				g = policy.NewGroup(t.MaxEjectionPercent)
				d.reg.groups[group] = g
			}
			c = d.newCircuit(name, target, policy.EndpointScope, &t.Options, t.State, g, dst, now)
			if c == nil {
				return nil
			}
		}
		d.attach(c, dst)
		return c
	default:
		name := classed(target, workload)
		c, ok := d.reg.byName[name]
		if !ok {
			c = d.newCircuit(name, target, policy.ServiceScope, &t.Options, t.State, nil, dst, now)
			if c == nil {
				return nil
			}
		}
		d.attach(c, dst)
		return c
	}
}

// newCircuit makes a circuit whose first destination is dst; nil when no
// circuit id is free.
func (d *Daemon) newCircuit(name, target string, scope policy.Scope, o *policy.Options, ov policy.Override, g *policy.Group, dst maps.Dest, now time.Time) *circuit {
	id, inherited, ok := d.reg.ids.alloc(name, dst)
	if !ok {
		d.metrics.circuitsRefused.WithLabelValues(target).Inc()
		d.log.Error("no circuit id free (every id is in use or held by open sockets); destination not protected", "circuit", name)
		return nil
	}
	// An override set through the API before a restart (or before the
	// circuit was last dropped and made again) comes back.
	if kept, ok, err := d.k.Override(name); err != nil {
		d.log.Warn("reading a kept override", "circuit", name, "err", err)
	} else if ok {
		ov = policyOverride(kept)
	}
	workload := d.classes.Name(policy.Class(dst.Class))
	c := &circuit{name: name, target: target, workload: workload, scope: scope, id: id,
		c: policy.NewCircuit(o, ov, g, now, d.rand), metrics: d.metrics.forTarget(target, workload)}
	if !inherited {
		if err := d.k.ResetCounters(c.id); err != nil {
			d.log.Warn("resetting counters", "circuit", name, "err", err)
		}
	}
	// Continue the rounds of the slot's probe budget, so the first open
	// verdict begins a new round there.
	if b, err := d.k.Budget(c.id); err == nil {
		c.c.SeedRound(b.Round)
	}
	d.reg.byName[name] = c
	if scope == policy.EndpointScope {
		d.reg.endpoints[c] = struct{}{}
	}
	d.reg.track(c)
	if ov == policy.ForceOpen {
		d.writeVerdicts(c, policy.Transition{To: policy.ForcedOpen, At: now})
	}
	return c
}

// keptOverrides maps the API's overrides to the pinned map's states.
var keptOverrides = map[policy.Override]maps.OverrideState{
	policy.ForceOpen: maps.OverrideForcedOpen, policy.ForceClosed: maps.OverrideForcedClosed, policy.DisableState: maps.OverrideDisabled,
}

func policyOverride(s maps.OverrideState) policy.Override {
	for o, k := range keptOverrides {
		if k == s {
			return o
		}
	}
	return policy.NoOverride
}

// keepOverride records (or, for NoOverride, forgets) c's override set
// through the API in the pinned overrides map, so it survives a restart.
func (d *Daemon) keepOverride(c *circuit, o policy.Override) {
	var err error
	if k, ok := keptOverrides[o]; ok {
		err = d.k.PutOverride(c.name, k)
	} else {
		err = d.k.DeleteOverride(c.name)
	}
	if err != nil {
		d.log.Warn("the override will not survive a restart", "circuit", c.name, "err", err)
	}
}

// attach adds dst to c; if c already rejects, the new destination's
// verdict is written at once.
func (d *Daemon) attach(c *circuit, dst maps.Dest) {
	if d.reg.byDest[dst] == c {
		return
	}
	c.dests = append(c.dests, dst)
	d.reg.byDest[dst] = c
	if o := c.c.Options(); o.HasLimits() {
		d.writeLimit(c, dst)
	}
	if s := c.c.State(); s.Rejects() {
		d.writeVerdict(c, dst, s, c.c.Status(d.now()).OpenUntil, c.c.Round())
	}
}

// writeLimit writes (or removes) the bulkhead limits of one destination of
// c from its options.
func (d *Daemon) writeLimit(c *circuit, dst maps.Dest) {
	if dst.Proto != maps.TCP {
		return
	}
	o := c.c.Options()
	if !o.HasLimits() {
		if err := d.k.DeleteLimit(dst); err != nil {
			d.log.Warn("deleting bulkhead limits", "circuit", c.name, "dest", dst, "err", err)
		}
		return
	}
	l := maps.Limit{Slot: c.id, MaxConnections: uint32(o.MaxConnections), MaxConnecting: uint32(o.MaxConnecting), Errno: o.BulkheadRejectErrno}
	if err := d.k.PutLimit(dst, l); err != nil {
		d.metrics.verdictWriteErrors.Inc()
		d.log.Error("writing bulkhead limits (not enforced for this destination)", "circuit", c.name, "dest", dst, "err", err)
	}
}

// staticDests lists the destinations a named target covers that can be
// enumerated: full-length prefixes (single addresses) and resolved host
// names, times explicit ports (ranges up to 256 ports). Wider CIDRs and
// "any port" are covered as destinations are seen.
func staticDests(t *policy.Target, resolved map[string][]netip.Addr) []maps.Dest {
	var addrs []netip.Addr
	for _, p := range t.Match.Prefixes {
		if p.IsSingleIP() {
			addrs = append(addrs, p.Addr())
		}
	}
	for _, h := range t.Match.Hosts {
		addrs = append(addrs, resolved[h]...)
	}
	var ports []uint16
	for _, pr := range t.Match.Ports {
		if int(pr.Hi)-int(pr.Lo) > 255 {
			continue
		}
		for p := int(pr.Lo); p <= int(pr.Hi); p++ {
			ports = append(ports, uint16(p))
		}
	}
	var protos []maps.Proto
	switch t.Match.Proto {
	case "udp":
		protos = []maps.Proto{maps.UDP}
	case "any":
		protos = []maps.Proto{maps.TCP, maps.UDP}
	default:
		protos = []maps.Proto{maps.TCP}
	}
	var out []maps.Dest
	for _, a := range addrs {
		for _, p := range ports {
			for _, pr := range protos {
				out = append(out, maps.Dest{Proto: pr, Addr: netip.AddrPortFrom(a.Unmap(), p)})
			}
		}
	}
	return out
}

// evictIdle drops the least recently active closed dynamic circuit, in
// O(1): the front of the registry's idle list.
func (d *Daemon) evictIdle() bool {
	victim := d.reg.idle.head
	if victim == nil {
		return false
	}
	d.drop(victim)
	d.metrics.circuitsEvicted.Inc()
	return true
}

// drop forgets a circuit and removes its verdicts.
func (d *Daemon) drop(c *circuit) {
	for _, dst := range c.dests {
		if err := d.k.DeleteVerdict(dst); err != nil {
			d.log.Warn("deleting verdict", "dest", dst, "err", err)
		}
		if err := d.k.DeleteLimit(dst); err != nil {
			d.log.Warn("deleting bulkhead limits", "dest", dst, "err", err)
		}
		delete(d.reg.byDest, dst)
	}
	// Keep its kernel counts so the per-target counters never go down.
	if cnt, err := d.k.Counters(c.id); err == nil {
		r := d.retired[c.target]
		r.Rejected += cnt.Rejected
		r.ShadowRejected += cnt.ShadowRejected
		r.Probes += cnt.Probes
		r.BulkheadRejected += cnt.BulkheadRejected
		d.retired[c.target] = r
	}
	c.c.Release()
	if s := c.c.State(); s == policy.ForcedOpen || s == policy.ForcedClosed || s == policy.Disabled {
		d.keepOverride(c, policy.NoOverride)
	}
	delete(d.reg.byName, c.name)
	d.reg.untrack(c)
	if c.target == allTarget {
		d.reg.dynamic--
	}
	d.reg.ids.release(c.id, c.name)
}

// writeVerdicts makes the kernel enforce what a transition says, for every
// destination of the circuit.
func (d *Daemon) writeVerdicts(c *circuit, t policy.Transition) {
	for _, dst := range c.dests {
		d.writeVerdict(c, dst, t.To, t.OpenUntil, t.Round)
	}
}

// writeVerdict writes what state s means for dst. Open and half-open are
// both an open verdict, due at openUntil (half-open: now), admitting the
// probes of round from the circuit's one probe budget.
func (d *Daemon) writeVerdict(c *circuit, dst maps.Dest, s policy.State, openUntil time.Time, round uint32) {
	o := c.c.Options()
	var err error
	switch s {
	case policy.Open, policy.HalfOpen:
		due := maps.Now()
		if s == policy.Open {
			due += openUntil.Sub(d.now())
		}
		err = d.k.PutVerdict(dst, maps.OpenVerdict(due, round, uint32(o.HalfOpenProbes), o.RejectErrno, c.id))
	case policy.ForcedOpen:
		err = d.k.PutVerdict(dst, maps.Verdict{State: maps.ForcedOpen, Errno: o.RejectErrno, CircuitID: c.id})
	default:
		err = d.k.DeleteVerdict(dst)
	}
	if err != nil {
		d.metrics.verdictWriteErrors.Inc()
		d.log.Error("writing verdict (the kernel fails open for this destination)", "circuit", c.name, "dest", dst, "err", err)
	}
}

// sortedCircuits returns the circuits by name.
func (d *Daemon) sortedCircuits() []*circuit {
	out := make([]*circuit, 0, len(d.reg.byName))
	for _, c := range d.reg.byName {
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

func (c *circuit) String() string { return fmt.Sprintf("%s(%s)", c.name, c.c.State()) }
