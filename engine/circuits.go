package engine

import (
	"iter"
	"sort"
	"strings"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// The engine's circuits as the daemon reads them (the admin API, the
// metrics, reload and adoption): the registry itself is the engine's.

// At returns the circuit of destination dst.
func (e *Engine) At(dst maps.Dest) (*Circuit, bool) { return e.reg.At(dst) }

// Get returns the circuit named name (a dynamic one by its destination's
// name).
func (e *Engine) Get(name string) (*Circuit, bool) { return e.reg.Get(name) }

// All yields every circuit once, in no order.
func (e *Engine) All() iter.Seq[*Circuit] { return e.reg.All() }

// Named yields the named circuits (of targets), in no order.
func (e *Engine) Named() iter.Seq[*Circuit] {
	return func(yield func(*Circuit) bool) {
		for _, c := range e.reg.byName {
			if !yield(c) {
				return
			}
		}
	}
}

// Count is the number of circuits.
func (e *Engine) Count() int { return e.reg.Count() }

// NamedCount is the number of circuits of targets.
func (e *Engine) NamedCount() int { return len(e.reg.byName) }

// Destinations is the number of destinations with a circuit (what
// max_circuits bounds).
func (e *Engine) Destinations() int { return e.reg.byDest.Len() }

// Version counts the changes of the set of circuits and of their
// destinations: equal versions, the same circuits.
func (e *Engine) Version() uint64 { return e.reg.version }

// Active yields the circuits that reject (open, half-open or forced
// open), in no order.
func (e *Engine) Active() iter.Seq[*Circuit] {
	return func(yield func(*Circuit) bool) {
		for c := range e.reg.active {
			if !yield(c) {
				return
			}
		}
	}
}

// ActiveCount is the number of circuits Active yields.
func (e *Engine) ActiveCount() int { return len(e.reg.active) }

// Track files c under the sets its state puts it in; call it whenever c's
// state was changed outside the engine (an override, adoption).
func (e *Engine) Track(c *Circuit) { e.reg.Track(c) }

// IDs are the circuits' kernel ids.
func (e *Engine) IDs() *IDs { return e.reg.ids }

// Recording returns the circuit that records the kernel's rejections
// under id (nil: none).
func (e *Engine) Recording(id uint32) *Circuit { return e.reg.recording[id] }

// Group returns the endpoint group of a target (target@workload for an
// isolated workload's), nil when it has none.
func (e *Engine) Group(name string) *policy.Group { return e.reg.groups[name] }

// SetAdopting tells the engine that start-up is rebuilding the circuits of
// pinned verdicts (on) or is done (off): max_circuits refuses none of
// them, eviction brings the count back later.
func (e *Engine) SetAdopting(on bool) { e.reg.adopting = on }

// Reserve makes room in the destination index for n destinations.
func (e *Engine) Reserve(n int) { e.reg.byDest.Reserve(n) }

// IndexBytes is the memory the destination index takes.
func (e *Engine) IndexBytes() uintptr { return e.reg.byDest.Bytes() }

// CheckSets reports the first way the engine's sets of circuits disagree
// with the circuits' states (nil: none). For tests.
func (e *Engine) CheckSets() error { return e.reg.checkSets() }

// SetEjection gives the endpoint groups of cfg's endpoint-scoped targets
// their max_ejection_percent (a reload).
func (e *Engine) SetEjection(cfg *policy.Config) {
	for name, g := range e.reg.groups {
		tname, _, _ := strings.Cut(name, "@") // target@workload
		if t := cfg.Targets[tname]; t != nil && t.Scope == policy.EndpointScope {
			g.MaxEjectionPercent = t.MaxEjectionPercent
		}
	}
}

// Detach removes departed destinations from c, which keeps others: their
// verdicts and limits go, the circuit's state stays.
func (e *Engine) Detach(c *Circuit, gone []maps.Dest) {
	for _, dst := range gone {
		if err := e.k.DeleteVerdict(dst); err != nil {
			e.log.Warn("deleting verdict", "dest", dst, "err", err)
		}
		e.deleteLimits(c, dst)
		e.reg.Detach(dst)
		c.RemoveDest(dst)
	}
}

// Ordered returns the circuits: named ones by name, then dynamic ones in
// the destination index's order (sorting a million of them, by name or by
// destination, took seconds of a reload).
func (e *Engine) Ordered() []*Circuit {
	type named struct {
		name string
		c    *Circuit
	}
	byName := make([]named, 0, len(e.reg.byName))
	for _, c := range e.reg.byName {
		byName = append(byName, named{c.Name(), c})
	}
	sort.Slice(byName, func(i, j int) bool { return byName[i].name < byName[j].name })
	out := make([]*Circuit, 0, e.reg.Count())
	for _, n := range byName {
		out = append(out, n.c)
	}
	for _, c := range e.reg.byDest.All() {
		if !c.IsNamed() {
			out = append(out, c)
		}
	}
	return out
}
