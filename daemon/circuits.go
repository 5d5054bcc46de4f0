package daemon

import (
	"errors"
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
		d.drop(c)
	}
}

// idLimitForTest, when not 0, is the number of ids a new daemon has
// (tests that run out of ids at start-up).
var idLimitForTest uint32

func newRegistry(k engine.Kernel) *registry {
	limit := uint32(maps.MaxCircuitIDs)
	if idLimitForTest != 0 {
		limit = idLimitForTest
	}
	return engine.NewRegistry(k, limit)
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
	if !d.reg.Adopting && d.reg.ByDest.Len() >= cfg.MaxCircuits && !d.evictIdle() {
		d.metrics.circuitsRefused.WithLabelValues(label).Inc()
		return nil, false
	}
	if target == "" {
		c := d.newCircuit("", allTarget, "", &cfg.All, policy.NoOverride, nil, dst, now)
		if c == nil {
			return nil, false
		}
		d.reg.Dynamic++
		d.attach(c, dst)
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
			c = d.newCircuit(name, target, policy.EndpointScope, &t.Options, t.State, g, dst, now)
			if c == nil {
				return nil, false
			}
		}
		d.attach(c, dst)
		return c, made
	default:
		name := engine.Classed(target, workload)
		c, ok := d.reg.ByName[name]
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
	if !dynamic || needsLimitEntry(o) || d.reg.IDs.PinnedFor(dst) {
		var ok bool
		id, inherited, ok = d.reg.IDs.Alloc(name, dst)
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
	cname := name
	if dynamic {
		cname = ""
	}
	c := engine.NewCircuit(cname, scope == policy.EndpointScope, id, d.metrics.forTarget(target, workload), dst)
	c.Machine.Init(o, ov, g, now, d.rand)
	if id != 0 {
		d.seat(c, id, inherited)
	}
	if !dynamic {
		d.reg.ByName[name] = c
		d.reg.Version++
	}
	if scope == policy.EndpointScope {
		d.reg.Endpoints[c] = struct{}{}
	}
	d.reg.Track(c)
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
	c.ID = id
	if c.Epoch() != 0 {
		d.reg.Recording[id] = c // its rejections are recorded under its id
	}
	if !inherited {
		if err := d.kernel.ResetCounters(id); err != nil {
			d.log.Warn("resetting counters", "circuit", c.Name(), "err", err)
		}
	} else if e := d.reg.IDs.PinnedEpoch(id); e != 0 {
		d.setEpoch(c, e) // its rejections carry on with its counters
	}
	if b, err := d.kernel.Budget(id); err == nil {
		if c.Machine.State().Rejects() {
			c.Machine.RoundAfter(b.Round)
		} else {
			c.Machine.SeedRound(b.Round)
		}
	}
}

// ensureID gives c a kernel circuit id if it has none (a dynamic circuit
// that is about to reject for the first time), and reports whether it has
// one. Without one, nothing of c can be written to the kernel: the caller
// logs and counts it, and the tick tries again (retryUnenforced).
func (d *Daemon) ensureID(c *circuit) bool {
	if c.ID != 0 {
		return true
	}
	id, inherited, ok := d.reg.IDs.Alloc(c.Name(), c.First())
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
	if c.ID == 0 || c.IsNamed() || needsLimitEntry(c.Machine.Options()) || c.Machine.State() != policy.Closed || !d.reg.IDs.Scarce() {
		return
	}
	d.retire(c.Target(), c.ID)
	d.forgetEpoch(c)
	d.unbatch(c)
	c.SetEpoch(0)
	d.reg.IDs.Release(c.ID, c.Name())
	c.ID = 0
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
		if !needsLimitEntry(c.Machine.Options()) {
			delete(d.unlimited, c) // its limits went with a reload
			continue
		}
		if !d.ensureID(c) {
			return
		}
		for _, dst := range c.Dests() {
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
	if st := c.Machine.Status(now); st.State == policy.Open && !now.Before(st.OpenUntil) {
		partly = d.partlyEnforced(c)
	}
	if !partly {
		if t, moved := c.Machine.NotEnforced(now); moved {
			delete(d.unenforced, c)
			d.log.Warn("the open circuit was not enforced through its open duration (no circuit id or verdict room); closed, counting afresh", "circuit", c.Name())
			d.apply(c, t)
			return true
		}
	}
	st := c.Machine.Status(now)
	if !st.State.Rejects() {
		delete(d.unenforced, c)
		return true
	}
	if !d.ensureID(c) {
		return false
	}
	for _, dst := range c.Dests() {
		if err := d.putVerdict(c, dst, st.State, st.OpenUntil, c.Machine.Round()); err != nil {
			return false
		}
	}
	delete(d.unenforced, c)
	d.log.Info("the open circuit's verdicts are written: it is enforced", "circuit", c.Name(), "state", st.State.String(), "circuit_id", c.ID)
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
	if err := d.kept.Keep(c.Name(), o); err != nil {
		d.log.Warn("the override will not survive a restart", "circuit", c.Name(), "err", err)
	}
}

// loadKept reads the overrides a previous daemon kept in the pinned map
// (engine.Overrides).
func (d *Daemon) loadKept() { d.kept = engine.LoadOverrides(d.kernel) }

// attach adds dst to c; if c already rejects, the new destination's
// verdict is written at once.
func (d *Daemon) attach(c *circuit, dst maps.Dest) {
	if cur, _ := d.reg.At(dst); cur == c {
		return
	}
	d.reg.Attach(c, dst)
	if o := c.Machine.Options(); needsLimitEntry(o) {
		d.writeLimit(c, dst)
	}
	if s := c.Machine.State(); s.Rejects() {
		d.writeVerdict(c, dst, s, c.Machine.Status(d.now()).OpenUntil, c.Machine.Round())
	}
}

// writeLimit writes (or removes) the bulkhead limits of one destination of
// c from its options.
func (d *Daemon) writeLimit(c *circuit, dst maps.Dest) {
	if dst.Proto != maps.TCP {
		return
	}
	o := c.Machine.Options()
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
		d.errorEverySecond("", "no circuit id free (every id is in use or held by open sockets); bulkhead and response options are not enforced for a circuit until one is", "circuit", c.Name(), "dest", dst)
		return
	}
	d.syncBulkSlots(c)
	for _, e := range d.limitEntries(c, dst) {
		if err := d.kernel.PutLimit(e.dst, d.limitFor(c, o, e)); err != nil {
			d.metrics.verdictWriteErrors.Inc()
			d.log.Error("writing bulkhead limits (not enforced for this destination)", "circuit", c.Name(), "dest", e.dst, "err", err)
		}
	}
}

// evictIdle drops the least recently active closed dynamic circuit
// (registry.Victim: second chance), in amortized O(1).
func (d *Daemon) evictIdle() bool {
	victim := d.reg.Victim()
	if victim == nil {
		return false
	}
	d.drop(victim)
	d.metrics.circuitsEvicted.Inc()
	return true
}

// drop forgets a circuit and removes its verdicts.
func (d *Daemon) drop(c *circuit) {
	for _, dst := range c.Dests() {
		if err := d.kernel.DeleteVerdict(dst); err != nil {
			d.log.Warn("deleting verdict", "dest", dst, "err", err)
		}
		d.deleteLimits(c, dst)
		d.reg.ByDest.Del(dst.Compact())
		d.reg.Version++
	}
	// Keep its kernel counts so the per-target counters never go down.
	if c.ID != 0 {
		d.retire(c.Target(), c.ID)
	}
	for _, s := range c.BulkSlots() {
		d.releaseBulkSlot(c, s)
	}
	c.Machine.Release()
	if s := c.Machine.State(); s == policy.ForcedOpen || s == policy.ForcedClosed || s == policy.Disabled {
		d.keepOverride(c, policy.NoOverride)
	}
	if c.IsNamed() {
		delete(d.reg.ByName, c.Name())
	}
	d.reg.Untrack(c)
	delete(d.unenforced, c)
	delete(d.unlimited, c)
	if c.Target() == allTarget {
		d.reg.Dynamic--
	}
	d.forgetEpoch(c)
	d.unbatch(c)
	d.reg.IDs.Release(c.ID, c.Name())
	d.reg.Version++ // also for a named circuit left with no destination
}

// writeVerdicts makes the kernel enforce what a transition says, for every
// destination of the circuit; c is in d.unenforced after it exactly when
// it rejects and a verdict could not be written.
func (d *Daemon) writeVerdicts(c *circuit, t policy.Transition) {
	ok := true
	for _, dst := range c.Dests() {
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
		d.errorEverySecond("", "no circuit id free (every id is in use or held by open sockets); an open circuit is not enforced until one is", "circuit", c.Name(), "dest", dst)
		return false
	}
	if s.Rejects() {
		d.errorEverySecond("", "writing verdict (the kernel fails open for this destination until it is written)", "circuit", c.Name(), "dest", dst, "err", err)
	} else {
		d.errorEverySecond("", "removing verdict (the kernel may go on rejecting this destination under the old one)", "circuit", c.Name(), "dest", dst, "err", err)
	}
	return false
}

// partlyEnforced reports whether some verdict of c, which has an id, is
// in the kernel: a circuit the verdict map had room for only in part
// rejected some of its traffic, so it keeps its open duration and its
// half-open probes rather than closing as not enforced (it stays in
// d.unenforced until every verdict is written, or it stops rejecting).
func (d *Daemon) partlyEnforced(c *circuit) bool {
	if c.ID == 0 {
		return false
	}
	for _, dst := range c.Dests() {
		if v, ok, err := d.kernel.Verdict(dst); err == nil && ok && v.CircuitID == c.ID {
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
	o := c.Machine.Options()
	if s.Rejects() && c.ID == 0 {
		if !d.ensureID(c) {
			return errNoID
		}
		round = c.Machine.Round() // continued after the slot's (seat)
	}
	switch s {
	case policy.Open, policy.HalfOpen:
		due := maps.Now()
		if s == policy.Open {
			due += openUntil.Sub(d.now())
		}
		v := maps.OpenVerdict(due, round, uint32(o.HalfOpenProbes), o.RejectErrno, c.ID)
		v.Epoch = d.epochOf(c)
		return d.kernel.PutVerdict(dst, v)
	case policy.ForcedOpen:
		return d.kernel.PutVerdict(dst, maps.Verdict{State: maps.ForcedOpen, Errno: o.RejectErrno, CircuitID: c.ID, Epoch: d.epochOf(c)})
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
