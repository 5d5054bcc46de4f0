package daemon

import (
	"errors"
	"fmt"
	"iter"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// allTarget is the target label of dynamic circuits (those of `all`).
const allTarget = "all"

// circuit is one circuit with what the daemon knows around it: its name,
// target, the destinations its verdict covers and its counter slot.
//
// A node may hold a hundred thousand dynamic circuits, so one takes a
// single allocation of 192 bytes: its state machine is held by value, its
// only destination inline, and its name (its destination's) is made when
// asked for; what only a named target's circuit has is apart (named).
type circuit struct {
	// What a record touches comes first (see policy.Circuit).
	// metrics are its target's outcome series (and name its target:
	// allTarget for a dynamic circuit).
	metrics *engine.Series
	id      uint32
	inIdle  bool
	// referenced: it recorded a call since it was last queued in
	// registry.idle (eviction gives it a second chance).
	referenced bool
	// endpoint: one circuit of an endpoint-scoped target (see scope).
	endpoint bool
	// enumerated: a destination of it is enumerated from the target's
	// match (it stays in its endpoint group while configured).
	enumerated bool
	// machine is its state machine.
	machine policy.Circuit
	// first is its first destination: a dynamic circuit's only one.
	first [1]maps.Dest
	// extra is nil for a dynamic circuit without failures.
	extra *circuitExtra
	// prev and next link it into registry.idle while it is a closed
	// dynamic circuit (inIdle).
	prev, next *circuit
}

// circuitExtra is what a circuit of a named target has beyond a dynamic
// one, a name of its own and any number of destinations, and what only a
// circuit that saw failures needs: the cgroups they came from. A dynamic
// circuit gets one at its first failure.
type circuitExtra struct {
	name  string      // "" for a dynamic circuit
	dests []maps.Dest // every destination, first included (named circuits)
	// failedCgroups are the cgroups whose connections to it failed last
	// (at most maxFailedCgroups, most recent last; kube.go).
	failedCgroups []uint64
	// bulkSlots are a shared circuit's bulkheads of the workloads that
	// share it, by bulkhead class (bulkheads.go).
	bulkSlots map[uint8]bulkSlot
	// closed counts the established connections its close passes
	// closed since the daemon started (close_established).
	closed uint64
	// epoch keys the kernel's count of the cgroups its verdicts and its
	// own bulkhead reject (rejections.go); 0 until it first writes a
	// rejecting verdict or a limit.
	epoch uint32
}

// isNamed reports whether c is a named target's circuit.
func (c *circuit) isNamed() bool { return c.extra != nil && c.extra.name != "" }

// failedCgroups are the cgroups its failed connections came from (a copy).
func (c *circuit) failedCgroups() []uint64 {
	if c.extra == nil {
		return nil
	}
	return slices.Clone(c.extra.failedCgroups)
}

// target is the name of the circuit's target (allTarget for a dynamic
// circuit).
func (c *circuit) target() string { return c.metrics.Target() }

// removeDest forgets one destination of a named circuit that keeps others
// (the caller has removed its verdict, limit and registry entry).
func (c *circuit) removeDest(dst maps.Dest) {
	if !c.isNamed() {
		return
	}
	c.extra.dests = slices.DeleteFunc(c.extra.dests, func(x maps.Dest) bool { return x == dst })
}

// name is the circuit's name: its target's (service scope),
// target/address (endpoint scope) or its destination's (dynamic).
func (c *circuit) name() string {
	if c.isNamed() {
		return c.extra.name
	}
	return engine.Classed(engine.DynamicName(c.first[0]), c.workload())
}

// workload is policy.SharedWorkload, or the isolated workload whose
// circuit it is.
func (c *circuit) workload() string { return c.metrics.Workload() }

// dests are the destinations whose verdicts the circuit writes
// (registry.byDest maps back). The slice is the circuit's own: do not
// keep it past a change of the circuit's destinations.
func (c *circuit) dests() []maps.Dest {
	if c.isNamed() {
		return c.extra.dests
	}
	return c.first[:]
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
		if !c.enumerated && c.machine.State() == policy.Closed && now.Sub(c.machine.LastActivity()) >= d.endpointIdle {
			gone = append(gone, c)
		}
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i].name() < gone[j].name() })
	for _, c := range gone {
		d.log.Debug("endpoint departed (idle)", "circuit", c.name())
		d.drop(c)
	}
}

// registry holds every circuit: dynamic ones by destination only, named
// ones also by name. It is used under Daemon.mu.
//
// Besides the indexes by name and destination it keeps the few circuits
// periodic work visits, so that this work does not grow with the number of
// closed circuits: active (open, half-open or forced open: the tick and
// the reconciliation after lost records), endpoints (the departed-endpoint
// sweep), and idle, the closed dynamic circuits in the order they were
// queued, from whose front eviction takes its victim (second chance, see
// evictIdle).
type registry struct {
	byName    map[string]*circuit       // named circuits only: use get and all
	byDest    engine.DestIndex[circuit] // use at() to look up
	active    map[*circuit]struct{}
	endpoints map[*circuit]struct{}
	idle      idleList
	groups    map[string]*policy.Group
	ids       *engine.IDs
	classes   *policy.Classes // the daemon's, for the names of isolated workloads' circuits
	version   uint64          // counts the changes of byDest and byName
	dynamic   int
	// adopting is set while start-up rebuilds the circuits of the pinned
	// verdicts: max_circuits does not refuse those (an open verdict is
	// never dropped for want of room; eviction brings the count back).
	adopting bool
	// recording holds the circuits that have an epoch, by id (only the
	// circuits that ever wrote a rejecting verdict or a limit), and the
	// circuits of the sharing workloads' bulkhead slots, by slot id
	// (rejections.go).
	recording map[uint32]*circuit
	nextEpoch uint32
}

// idLimitForTest, when not 0, is the number of ids a new daemon has
// (tests that run out of ids at start-up).
var idLimitForTest uint32

func newRegistry(k engine.Kernel) *registry {
	limit := uint32(maps.MaxCircuitIDs)
	if idLimitForTest != 0 {
		limit = idLimitForTest
	}
	return &registry{byName: map[string]*circuit{}, groups: map[string]*policy.Group{},
		active: map[*circuit]struct{}{}, endpoints: map[*circuit]struct{}{}, ids: engine.NewIDs(k, limit), recording: map[uint32]*circuit{}}
}

// get returns the circuit named name.
func (r *registry) get(name string) (*circuit, bool) {
	if c, ok := r.byName[name]; ok {
		return c, true
	}
	// A dynamic circuit: its destination's name, and @workload for an
	// isolated workload's (see engine.Classed).
	base, class := name, policy.Class(0)
	if i := strings.LastIndexByte(name, '@'); i >= 0 && r.classes != nil {
		w := name[i+1:]
		class = r.classes.Of(w)
		if class == 0 || r.classes.Name(class) != w {
			return nil, false
		}
		base = name[:i]
	}
	if dst, ok := engine.ParseDynamicName(base); ok {
		dst.Class = uint8(class)
		if c, ok := r.at(dst); ok && !c.isNamed() {
			return c, true
		}
	}
	return nil, false
}

// all yields every circuit once, in no order.
func (r *registry) all() iter.Seq[*circuit] {
	return func(yield func(*circuit) bool) {
		for _, c := range r.byName {
			if !yield(c) {
				return
			}
		}
		for _, c := range r.byDest.All() {
			if !c.isNamed() && !yield(c) {
				return
			}
		}
	}
}

// count is the number of circuits.
func (r *registry) count() int { return len(r.byName) + r.dynamic }

// at returns the circuit of destination dst.
func (r *registry) at(dst maps.Dest) (*circuit, bool) {
	c := r.byDest.Get(dst.Compact())
	return c, c != nil
}

// track files c under the sets its state puts it in; call it whenever c's
// state may have changed.
func (r *registry) track(c *circuit) {
	s := c.machine.State()
	if s.Rejects() {
		r.active[c] = struct{}{}
	} else {
		delete(r.active, c)
	}
	if c.target() == allTarget && s == policy.Closed {
		if c.inIdle {
			c.referenced = true
		} else {
			r.idle.touch(c)
		}
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

// touch moves c to the back (most recent), adding it if needed, and
// clears its referenced flag.
func (l *idleList) touch(c *circuit) {
	c.referenced = false
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
	if c, ok := d.reg.at(dst); ok {
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
	if !d.reg.adopting && d.reg.byDest.Len() >= cfg.MaxCircuits && !d.evictIdle() {
		d.metrics.circuitsRefused.WithLabelValues(label).Inc()
		return nil, false
	}
	if target == "" {
		c := d.newCircuit("", allTarget, "", &cfg.All, policy.NoOverride, nil, dst, now)
		if c == nil {
			return nil, false
		}
		d.reg.dynamic++
		d.attach(c, dst)
		return c, true
	}
	t := cfg.Targets[target]
	switch t.Scope {
	case policy.EndpointScope:
		name := engine.Classed(engine.EndpointName(target, dst), workload)
		c, ok := d.reg.byName[name]
		made := !ok
		if !ok {
			// One endpoint group per target and workload.
			group := engine.Classed(target, workload)
			g := d.reg.groups[group]
			if g == nil {
				g = policy.NewGroup(t.MaxEjectionPercent)
				d.reg.groups[group] = g
			}
			c = d.newCircuit(name, target, policy.EndpointScope, &t.Options, t.State, g, dst, now)
			if c == nil {
				return nil, false
			}
		}
		d.attach(c, dst)
		return c, made
	default:
		name := engine.Classed(target, workload)
		c, ok := d.reg.byName[name]
		made := !ok
		if !ok {
			c = d.newCircuit(name, target, policy.ServiceScope, &t.Options, t.State, nil, dst, now)
			if c == nil {
				return nil, false
			}
		}
		d.attach(c, dst)
		return c, made
	}
}

// newCircuit makes a circuit whose first destination is dst (named name;
// "" for a dynamic circuit, named by dst); nil when no circuit id is free.
func (d *Daemon) newCircuit(name, target string, scope policy.Scope, o *policy.Options, ov policy.Override, g *policy.Group, dst maps.Dest, now time.Time) *circuit {
	workload := d.classes.Name(policy.Class(dst.Class))
	dynamic := name == ""
	if dynamic {
		name = engine.Classed(engine.DynamicName(dst), workload)
	}
	// A dynamic circuit without limits entries takes its kernel id when it
	// first rejects (ensureID), unless it inherits one now.
	var id uint32
	var inherited bool
	if !dynamic || needsLimitEntry(o) || d.reg.ids.PinnedFor(dst) {
		var ok bool
		id, inherited, ok = d.reg.ids.Alloc(name, dst)
		if !ok {
			d.metrics.circuitsRefused.WithLabelValues(target).Inc()
			// At most a line a second a target: every new destination
			// of a target with limits meets this once ids run out.
			d.errorEverySecond(target, "no circuit id free (every id is in use or held by open sockets); destination not protected (breakerd_circuits_refused_total counts each)", "circuit", name, "target", target)
			return nil
		}
	}
	// An override set through the API before a restart (or before the
	// circuit was last dropped and made again) comes back.
	if kept, ok := d.kept.Get(name); ok {
		ov = kept
	}
	c := &circuit{endpoint: scope == policy.EndpointScope, id: id, metrics: d.metrics.forTarget(target, workload)}
	c.first[0] = dst
	if !dynamic {
		c.extra = &circuitExtra{name: name}
	}
	c.machine.Init(o, ov, g, now, d.rand)
	if id != 0 {
		d.seat(c, id, inherited)
	}
	if !dynamic {
		d.reg.byName[name] = c
		d.reg.version++
	}
	if scope == policy.EndpointScope {
		d.reg.endpoints[c] = struct{}{}
	}
	d.reg.track(c)
	if ov == policy.ForceOpen {
		d.writeVerdicts(c, policy.Transition{To: policy.ForcedOpen, At: now})
		d.opened(c, policy.Closed, policy.ForcedOpen, now)
	}
	return c
}

// seat gives c the kernel circuit id id: a new one's counters are zeroed;
// an inherited one's carry on, with its rejections' epoch. c's rounds
// continue after the slot's probe budget, so its next open verdict begins
// a new round there (also when c is open already: see ensureID).
func (d *Daemon) seat(c *circuit, id uint32, inherited bool) {
	c.id = id
	if c.epoch() != 0 {
		d.reg.recording[id] = c // its rejections are recorded under its id
	}
	if !inherited {
		if err := d.kernel.ResetCounters(id); err != nil {
			d.log.Warn("resetting counters", "circuit", c.name(), "err", err)
		}
	} else if e := d.reg.ids.PinnedEpoch(id); e != 0 {
		d.setEpoch(c, e) // its rejections carry on with its counters
	}
	if b, err := d.kernel.Budget(id); err == nil {
		if c.machine.State().Rejects() {
			c.machine.RoundAfter(b.Round)
		} else {
			c.machine.SeedRound(b.Round)
		}
	}
}

// ensureID gives c a kernel circuit id if it has none (a dynamic circuit
// that is about to reject for the first time), and reports whether it has
// one. Without one, nothing of c can be written to the kernel: the caller
// logs and counts it, and the tick tries again (retryUnenforced).
func (d *Daemon) ensureID(c *circuit) bool {
	if c.id != 0 {
		return true
	}
	id, inherited, ok := d.reg.ids.Alloc(c.name(), c.first[0])
	if !ok {
		return false
	}
	d.seat(c, id, inherited)
	return true
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
func (d *Daemon) releaseID(c *circuit) {
	if c.id == 0 || c.isNamed() || needsLimitEntry(c.machine.Options()) || c.machine.State() != policy.Closed || !d.reg.ids.Scarce() {
		return
	}
	d.retire(c.target(), c.id)
	d.forgetEpoch(c)
	d.unbatch(c)
	if c.extra != nil {
		c.extra.epoch = 0
	}
	d.reg.ids.Release(c.id, c.name())
	c.id = 0
}

// retryUnenforced writes what could not be written for want of a kernel
// id or of room in a map: the verdicts of rejecting circuits
// (d.unenforced) and the limits entries of circuits that need them
// (d.unlimited). Called from the tick, once a second. Ids and map room
// are shared, so the pass stops at the first circuit that still finds
// none: a node short of them does one try a second, not one a circuit.
func (d *Daemon) retryUnenforced() {
	for c := range d.unenforced {
		if !d.enforce(c) {
			return
		}
	}
	for c := range d.unlimited {
		if !needsLimitEntry(c.machine.Options()) {
			delete(d.unlimited, c) // its limits went with a reload
			continue
		}
		if !d.ensureID(c) {
			return
		}
		for _, dst := range c.dests() {
			d.writeLimit(c, dst) // takes it out of the set (seatForLimits)
		}
	}
}

// seatForLimits gives c, which needs limits entries, a kernel id for
// their slot, and reports whether it has one. Without one c waits in
// d.unlimited for the tick; given one, it leaves it, and a rejecting
// circuit that waited for an id (d.unenforced) has its verdicts written
// with it.
func (d *Daemon) seatForLimits(c *circuit) bool {
	if !d.ensureID(c) {
		d.unlimited[c] = struct{}{}
		return false
	}
	delete(d.unlimited, c)
	if _, ok := d.unenforced[c]; ok {
		d.enforce(c)
	}
	return true
}

// enforce writes the verdicts of c, which is in d.unenforced, if it still
// rejects and can now be given an id; it leaves the set when it no longer
// rejects or every verdict is written, and false says it found no id or
// no room. An open circuit that stayed unenforced for its whole open
// duration closes instead (policy.Circuit.NotEnforced): it rejected
// nothing, and a verdict now would turn traffic away on old evidence (not
// one with some verdicts written: partlyEnforced).
func (d *Daemon) enforce(c *circuit) bool {
	now := d.now()
	// Past its open duration, one the kernel enforced in part (it admits
	// its probes) is no circuit that rejected nothing.
	partly := false
	if st := c.machine.Status(now); st.State == policy.Open && !now.Before(st.OpenUntil) {
		partly = d.partlyEnforced(c)
	}
	if !partly {
		if t, moved := c.machine.NotEnforced(now); moved {
			delete(d.unenforced, c)
			d.log.Warn("the open circuit was not enforced through its open duration (no circuit id or verdict room); closed, counting afresh", "circuit", c.name())
			d.apply(c, t)
			return true
		}
	}
	st := c.machine.Status(now)
	if !st.State.Rejects() {
		delete(d.unenforced, c)
		return true
	}
	if !d.ensureID(c) {
		return false
	}
	for _, dst := range c.dests() {
		if err := d.putVerdict(c, dst, st.State, st.OpenUntil, c.machine.Round()); err != nil {
			return false
		}
	}
	delete(d.unenforced, c)
	d.log.Info("the open circuit's verdicts are written: it is enforced", "circuit", c.name(), "state", st.State.String(), "circuit_id", c.id)
	d.opened(c, policy.Closed, st.State, now) // its close_established pass, if it has one
	return true
}

// errorEverySecond logs msg at error level at most once a second per key
// (msg and key): a shortage of ids or map room meets every circuit or
// record at once. The metrics count each.
func (d *Daemon) errorEverySecond(key, msg string, args ...any) {
	now := time.Now()
	if now.Sub(d.errorsLogged[msg+"\x00"+key]) < time.Second {
		return
	}
	d.errorsLogged[msg+"\x00"+key] = now
	d.log.Error(msg, args...)
}

// keepOverride records (or, for NoOverride, forgets) c's override set
// through the API in the pinned overrides map, so it survives a restart.
func (d *Daemon) keepOverride(c *circuit, o policy.Override) {
	if err := d.kept.Keep(c.name(), o); err != nil {
		d.log.Warn("the override will not survive a restart", "circuit", c.name(), "err", err)
	}
}

// loadKept reads the overrides a previous daemon kept in the pinned map
// (engine.Overrides).
func (d *Daemon) loadKept() { d.kept = engine.LoadOverrides(d.kernel) }

// attach adds dst to c; if c already rejects, the new destination's
// verdict is written at once.
func (d *Daemon) attach(c *circuit, dst maps.Dest) {
	if cur, _ := d.reg.at(dst); cur == c {
		return
	}
	if c.isNamed() {
		c.extra.dests = append(c.extra.dests, dst)
	}
	d.reg.byDest.Put(dst.Compact(), c)
	d.reg.version++
	if o := c.machine.Options(); needsLimitEntry(o) {
		d.writeLimit(c, dst)
	}
	if s := c.machine.State(); s.Rejects() {
		d.writeVerdict(c, dst, s, c.machine.Status(d.now()).OpenUntil, c.machine.Round())
	}
}

// writeLimit writes (or removes) the bulkhead limits of one destination of
// c from its options.
func (d *Daemon) writeLimit(c *circuit, dst maps.Dest) {
	if dst.Proto != maps.TCP {
		return
	}
	o := c.machine.Options()
	if !needsLimitEntry(o) {
		delete(d.unlimited, c) // a reload took its limits away: it needs no id for them
		if b, ok := d.batched[c]; ok && !b.off {
			d.retireBatch(c) // its sockets stop counting successes
		}
		d.deleteLimits(c, dst)
		d.syncBulkSlots(c)
		return
	}
	if !d.seatForLimits(c) {
		d.metrics.verdictWriteErrors.Inc()
		d.errorEverySecond("", "no circuit id free (every id is in use or held by open sockets); bulkhead and response options are not enforced for a circuit until one is", "circuit", c.name(), "dest", dst)
		return
	}
	d.syncBulkSlots(c)
	for _, e := range d.limitEntries(c, dst) {
		if err := d.kernel.PutLimit(e.dst, d.limitFor(c, o, e)); err != nil {
			d.metrics.verdictWriteErrors.Inc()
			d.log.Error("writing bulkhead limits (not enforced for this destination)", "circuit", c.name(), "dest", e.dst, "err", err)
		}
	}
}

// evictIdle drops the least recently active closed dynamic circuit, in
// amortized O(1), by second chance (the CLOCK algorithm): the idle list is
// in the order circuits were queued; a circuit that recorded a call since
// (referenced) is queued again at the back instead of dropped, so a record
// costs one flag, not a move in the list that touches two other circuits'
// memory. Every circuit passed over loses its flag, so the loop ends within
// one pass.
func (d *Daemon) evictIdle() bool {
	l := &d.reg.idle
	victim := l.head
	for victim != nil && victim.referenced {
		victim.referenced = false
		l.touch(victim)
		victim = l.head
	}
	if victim == nil {
		return false
	}
	d.drop(victim)
	d.metrics.circuitsEvicted.Inc()
	return true
}

// drop forgets a circuit and removes its verdicts.
func (d *Daemon) drop(c *circuit) {
	for _, dst := range c.dests() {
		if err := d.kernel.DeleteVerdict(dst); err != nil {
			d.log.Warn("deleting verdict", "dest", dst, "err", err)
		}
		d.deleteLimits(c, dst)
		d.reg.byDest.Del(dst.Compact())
		d.reg.version++
	}
	// Keep its kernel counts so the per-target counters never go down.
	if c.id != 0 {
		d.retire(c.target(), c.id)
	}
	for _, s := range c.bulkSlots() {
		d.releaseBulkSlot(c, s)
	}
	c.machine.Release()
	if s := c.machine.State(); s == policy.ForcedOpen || s == policy.ForcedClosed || s == policy.Disabled {
		d.keepOverride(c, policy.NoOverride)
	}
	if c.isNamed() {
		delete(d.reg.byName, c.extra.name)
	}
	d.reg.untrack(c)
	delete(d.unenforced, c)
	delete(d.unlimited, c)
	if c.target() == allTarget {
		d.reg.dynamic--
	}
	d.forgetEpoch(c)
	d.unbatch(c)
	d.reg.ids.Release(c.id, c.name())
	d.reg.version++ // also for a named circuit left with no destination
}

// writeVerdicts makes the kernel enforce what a transition says, for every
// destination of the circuit; c is in d.unenforced after it exactly when
// it rejects and a verdict could not be written.
func (d *Daemon) writeVerdicts(c *circuit, t policy.Transition) {
	ok := true
	for _, dst := range c.dests() {
		ok = d.writeVerdict(c, dst, t.To, t.OpenUntil, t.Round) && ok
	}
	if ok || !t.To.Rejects() {
		delete(d.unenforced, c)
	}
}

// writeVerdict writes what state s means for dst. Open and half-open are
// both an open verdict, due at openUntil (half-open: now), admitting the
// probes of round from the circuit's one probe budget. A rejecting
// verdict that cannot be written (no kernel id free, the map refused it)
// is logged and counted, the circuit is filed in d.unenforced, whose
// verdicts the tick writes once they can be, and false is returned.
func (d *Daemon) writeVerdict(c *circuit, dst maps.Dest, s policy.State, openUntil time.Time, round uint32) bool {
	err := d.putVerdict(c, dst, s, openUntil, round)
	if err == nil {
		return true
	}
	d.metrics.verdictWriteErrors.Inc()
	if s.Rejects() {
		d.unenforced[c] = struct{}{}
	}
	if errors.Is(err, errNoID) {
		d.errorEverySecond("", "no circuit id free (every id is in use or held by open sockets); an open circuit is not enforced until one is", "circuit", c.name(), "dest", dst)
		return false
	}
	if s.Rejects() {
		d.errorEverySecond("", "writing verdict (the kernel fails open for this destination until it is written)", "circuit", c.name(), "dest", dst, "err", err)
	} else {
		d.errorEverySecond("", "removing verdict (the kernel may go on rejecting this destination under the old one)", "circuit", c.name(), "dest", dst, "err", err)
	}
	return false
}

// partlyEnforced reports whether some verdict of c, which has an id, is
// in the kernel: a circuit the verdict map had room for only in part
// rejected some of its traffic, so it keeps its open duration and its
// half-open probes rather than closing as not enforced (it stays in
// d.unenforced until every verdict is written, or it stops rejecting).
func (d *Daemon) partlyEnforced(c *circuit) bool {
	if c.id == 0 {
		return false
	}
	for _, dst := range c.dests() {
		if v, ok, err := d.kernel.Verdict(dst); err == nil && ok && v.CircuitID == c.id {
			return true
		}
	}
	return false
}

// errNoID: a circuit that has to reject found no kernel circuit id free.
var errNoID = errors.New("no circuit id free")

// putVerdict writes what state s means for dst (see writeVerdict), giving
// c a kernel id first if it rejects and has none.
func (d *Daemon) putVerdict(c *circuit, dst maps.Dest, s policy.State, openUntil time.Time, round uint32) error {
	o := c.machine.Options()
	if s.Rejects() && c.id == 0 {
		if !d.ensureID(c) {
			return errNoID
		}
		round = c.machine.Round() // continued after the slot's (seat)
	}
	switch s {
	case policy.Open, policy.HalfOpen:
		due := maps.Now()
		if s == policy.Open {
			due += openUntil.Sub(d.now())
		}
		v := maps.OpenVerdict(due, round, uint32(o.HalfOpenProbes), o.RejectErrno, c.id)
		v.Epoch = d.epochOf(c)
		return d.kernel.PutVerdict(dst, v)
	case policy.ForcedOpen:
		return d.kernel.PutVerdict(dst, maps.Verdict{State: maps.ForcedOpen, Errno: o.RejectErrno, CircuitID: c.id, Epoch: d.epochOf(c)})
	default:
		return d.kernel.DeleteVerdict(dst)
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
	byName := make([]named, 0, len(d.reg.byName))
	for _, c := range d.reg.byName {
		byName = append(byName, named{c.name(), c})
	}
	sort.Slice(byName, func(i, j int) bool { return byName[i].name < byName[j].name })
	out := make([]*circuit, 0, d.reg.count())
	for _, n := range byName {
		out = append(out, n.c)
	}
	for _, c := range d.reg.byDest.All() {
		if !c.isNamed() {
			out = append(out, c)
		}
	}
	return out
}

// scope is the circuit's target's scope ("" for a dynamic circuit).
func (c *circuit) scope() policy.Scope {
	switch {
	case c.target() == allTarget:
		return ""
	case c.endpoint:
		return policy.EndpointScope
	}
	return policy.ServiceScope
}

func (c *circuit) String() string { return fmt.Sprintf("%s(%s)", c.name(), c.machine.State()) }
