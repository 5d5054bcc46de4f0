package engine

import (
	"slices"
	"strings"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// FleetVerdict is the fleet's decision on one circuit: Nodes other nodes
// (at least Quorum) have the circuit named Key open on their own
// evidence, and, with no new report, fewer than Quorum will from Until.
type FleetVerdict struct {
	Key    string
	Nodes  int
	Quorum int
	Until  time.Time
}

// Follower keeps the circuits this node has open because the fleet has
// them open (policy.FleetOpen): a follow is no operator override (it is
// not kept in the pinned overrides map), never probes (its kernel verdict
// has the forced-open shape: the reporters probe for the fleet), and is
// reported by no one (only own evidence is). Like its engine, it is used
// by the engine's owner alone.
type Follower struct {
	e *Engine
	// by are the followed circuits and the verdicts they follow.
	by map[*Circuit]FleetVerdict
	// opened are when and why the circuits open on this node's own
	// evidence opened (Noted), for their report.
	opened map[*Circuit]openedAt
}

type openedAt struct {
	at     time.Time
	reason policy.Reason
}

// FleetMargin is added to what a report's entry counts for: a reporter's
// next write may come up to a second (fleet.WriteInterval) after the
// transition it reports.
const FleetMargin = time.Second

// FleetEntry is one circuit this node has open on its own evidence, as
// its report lists it (fleet.Circuit).
type FleetEntry struct {
	Key, Target, Workload, Reason string
	Since, OpenUntil              time.Time
}

// NewFollower returns a Follower of e's circuits that follows none.
func NewFollower(e *Engine) *Follower {
	return &Follower{e: e, by: map[*Circuit]FleetVerdict{}, opened: map[*Circuit]openedAt{}}
}

// Noted is told of every transition applied, to date the openings its
// reports list.
func (f *Follower) Noted(c *Circuit, t policy.Transition) {
	own := func(s policy.State) bool { return s == policy.Open || s == policy.HalfOpen }
	switch {
	case own(t.To) && !own(t.From):
		f.opened[c] = openedAt{t.At, t.Reason}
	case !own(t.To):
		delete(f.opened, c)
	}
}

// Reported returns what this node's report lists at now: every circuit
// with a fleet block open or half-open on its own evidence (not a
// follow, not an operator's forced_open), ordered by key. An open
// circuit's entry counts until its open duration ends plus one
// probe_timeout and FleetMargin, so that followers stay open through its
// first probe round; a half-open one's until its round began plus as
// much (each new round, or its end, is a transition and a new report).
// A round that began within FleetMargin of the due time keeps the open
// entry as it was, so the usual half-open transition costs no write and
// the close that follows it is written at once. A due open circuit that
// no probe has come to yet is left out once its entry has expired.
func (f *Follower) Reported(now time.Time) []FleetEntry {
	var out []FleetEntry
	for c := range f.e.reg.active {
		o := c.Machine.Options()
		st := c.Machine.Status(now)
		if !o.Fleet.Enabled || (st.State != policy.Open && st.State != policy.HalfOpen) {
			continue
		}
		// Open: from its due time; half-open: from when its round began
		// (now, unless it began within FleetMargin of its due time:
		// then the entry it had while open still covers the round, and
		// needs no write of its own).
		from := st.OpenUntil
		if st.State == policy.HalfOpen && now.Sub(from) > FleetMargin {
			from = now
		}
		until := from.Add(o.ProbeTimeout + FleetMargin)
		if !until.After(now) {
			continue
		}
		op, ok := f.opened[c]
		if !ok {
			op = openedAt{now, policy.ReasonRestoredFromKV} // adopted at start-up
			f.opened[c] = op
		}
		out = append(out, FleetEntry{Key: c.Name(), Target: c.Target(), Workload: c.Workload(), Reason: string(op.reason), Since: op.at, OpenUntil: until})
	}
	for c := range f.opened {
		if _, ok := f.e.reg.active[c]; !ok {
			delete(f.opened, c)
		}
	}
	slices.SortFunc(out, func(a, b FleetEntry) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// Apply makes the followed circuits those of verdicts, the whole set of
// what the fleet has open now. find returns the circuit named by a key,
// made if need be (nil: none here, as for a target this node does not
// have). A closed circuit of a verdict opens at once (reason
// fleet_quorum); a followed one takes the verdict's Until; one open on
// this node's own evidence, or under an operator's override, is left as
// it is: own evidence and operators win. A followed circuit whose key is
// no longer among verdicts closes (fleet_quorum_lost). It returns how
// many circuits opened and closed.
func (f *Follower) Apply(verdicts []FleetVerdict, now time.Time, find func(key string) *Circuit) (opened, closed int) {
	e := f.e
	seen := make(map[*Circuit]bool, len(verdicts))
	for _, v := range verdicts {
		c := find(v.Key)
		if c == nil || c.Name() != v.Key {
			continue
		}
		switch c.Machine.State() {
		case policy.Closed:
			// Its verdict needs an id; none free, it follows all the
			// same and waits, unenforced, for one (writeVerdict).
			e.EnsureID(c)
			t, _ := c.Machine.Follow(now, v.Until)
			e.Apply(c, t)
			opened++
		case policy.FleetOpen:
			c.Machine.Follow(now, v.Until)
		default:
			continue
		}
		f.by[c], seen[c] = v, true
	}
	var gone []*Circuit
	for c := range f.by {
		if !seen[c] {
			gone = append(gone, c)
		}
	}
	slices.SortFunc(gone, func(a, b *Circuit) int { return strings.Compare(a.Name(), b.Name()) })
	for _, c := range gone {
		delete(f.by, c)
		if !f.live(c) {
			continue // dropped meanwhile (a reload): nothing left to close
		}
		if t, ok := c.Machine.Unfollow(now); ok {
			e.Apply(c, t)
			closed++
		}
	}
	return opened, closed
}

// Adopt makes c, closed, follow until until without a verdict of the
// fleet: a restarted daemon keeps the follow its predecessor's pinned
// verdict shows until its first decision (Apply) after its watch has
// listed the reports, or until until. The transition's reason is
// policy.ReasonRestoredFromKV.
func (f *Follower) Adopt(c *Circuit, until, now time.Time) bool {
	if c.Machine.State() != policy.Closed {
		return false
	}
	f.e.EnsureID(c)
	t, _ := c.Machine.Follow(now, until)
	t.Reason = policy.ReasonRestoredFromKV
	f.e.Apply(c, t)
	f.by[c] = FleetVerdict{Key: c.Name(), Until: until}
	return true
}

// Of returns the verdict c follows (false: c is not followed).
func (f *Follower) Of(c *Circuit) (FleetVerdict, bool) {
	v, ok := f.by[c]
	if !ok || c.Machine.State() != policy.FleetOpen {
		return FleetVerdict{}, false
	}
	return v, true
}

// Count is the number of followed circuits.
func (f *Follower) Count() int {
	n := 0
	for c := range f.by {
		if c.Machine.State() == policy.FleetOpen && f.live(c) {
			n++
		}
	}
	return n
}

// live reports whether c is still the engine's circuit of its name.
func (f *Follower) live(c *Circuit) bool {
	cur, ok := f.e.reg.Get(c.Name())
	return ok && cur == c
}

// FleetQuorum returns the quorum of the circuit key names on this node
// (0: none here, or it has no fleet block), for the fleet's tally.
func (e *Engine) FleetQuorum(key string) int {
	var o *policy.Options
	if c, ok := e.reg.Get(key); ok {
		o = c.Machine.Options()
	} else if _, target, ok := e.fleetDest(key); ok {
		if target == AllTarget {
			o = &e.matching.Config.All
		} else if t := e.matching.Config.Targets[target]; t != nil {
			o = &t.Options
		}
	}
	if o == nil || !o.Fleet.Enabled {
		return 0
	}
	return o.Fleet.Quorum
}

// FleetCircuit returns the circuit key names on this node, made from its
// destination (Lookup) when it is a dynamic or an endpoint circuit not
// made yet; nil: none here.
func (e *Engine) FleetCircuit(key string, now time.Time) *Circuit {
	if c, ok := e.reg.Get(key); ok {
		return c
	}
	dst, _, ok := e.fleetDest(key)
	if !ok {
		return nil
	}
	c, _ := e.Lookup(dst, now)
	return c
}

// fleetDest reads the destination out of a dynamic circuit's key
// (tcp/ADDR:PORT) or an endpoint circuit's (TARGET/ADDR:PORT), with
// @WORKLOAD for an isolated workload's, and the target it matches on
// this node (AllTarget for a dynamic one); false when the key names no
// destination, or one this node's configuration puts elsewhere.
func (e *Engine) fleetDest(key string) (maps.Dest, string, bool) {
	cfg := e.matching.Config
	if cfg == nil {
		return maps.Dest{}, "", false
	}
	base, class := key, policy.Class(0)
	if i := strings.LastIndexByte(key, '@'); i >= 0 {
		w := key[i+1:]
		class = e.matching.Classes.Of(w)
		if class == 0 || e.matching.Classes.Name(class) != w {
			return maps.Dest{}, "", false
		}
		base = key[:i]
	}
	dst, dynamic := ParseDynamicName(base)
	var named string
	if !dynamic {
		t, addr, ok := strings.Cut(base, "/")
		tg := cfg.Targets[t]
		if !ok || tg == nil || tg.Scope != policy.EndpointScope {
			return maps.Dest{}, "", false
		}
		if dst, ok = ParseDynamicName("tcp/" + addr); !ok {
			return maps.Dest{}, "", false
		}
		named = t
	}
	dst.Class = uint8(class)
	m, _ := e.MatcherOf(dst.Class)
	if m == nil {
		return maps.Dest{}, "", false
	}
	target, excluded := m.Match(dst.Addr.Addr(), dst.Addr.Port(), dst.Proto.String())
	if target == "" {
		target = AllTarget
	}
	if excluded || (dynamic && target != AllTarget) || (!dynamic && target != named) {
		return maps.Dest{}, "", false
	}
	return dst, target, true
}
