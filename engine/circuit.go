package engine

import (
	"fmt"
	"slices"
	"sort"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// AllTarget is the target label of dynamic circuits (those of `all`).
const AllTarget = "all"

// MaxFailedCgroups bounds the cgroups a circuit remembers failures of.
const MaxFailedCgroups = 8

// Circuit is one circuit with what the core knows around it: its name,
// target, the destinations its verdict covers and its counter slot.
//
// A node may hold a hundred thousand dynamic circuits, so one takes a
// single allocation of 192 bytes: its state machine is held by value, its
// only destination inline, and its name (its destination's) is made when
// asked for; what only a named target's circuit has is apart (extra).
type Circuit struct {
	// What a record touches comes first (see policy.Circuit).
	// Metrics are its target's outcome series (and name its target:
	// AllTarget for a dynamic circuit).
	Metrics *Series
	// ID is its kernel circuit id: its counters, probe budget and
	// bulkhead slot (0: none; a dynamic circuit takes one when it first
	// rejects or needs a limits entry).
	ID     uint32
	inIdle bool
	// referenced: it recorded a call since it was last queued in
	// registry's idle list (eviction gives it a second chance).
	referenced bool
	// endpoint: one circuit of an endpoint-scoped target (see Scope).
	endpoint bool
	// Enumerated: a destination of it is enumerated from the target's
	// match (it stays in its endpoint group while configured).
	Enumerated bool
	// Machine is its state machine.
	Machine policy.Circuit
	// first is its first destination: a dynamic circuit's only one.
	first [1]maps.Dest
	// extra is nil for a dynamic circuit without failures.
	extra *circuitExtra
	// prev and next link it into the idle list while it is a closed
	// dynamic circuit (inIdle).
	prev, next *Circuit
}

// circuitExtra is what a circuit of a named target has beyond a dynamic
// one, a name of its own and any number of destinations, and what only a
// circuit that saw failures needs: the cgroups they came from. A dynamic
// circuit gets one at its first failure.
type circuitExtra struct {
	name  string      // "" for a dynamic circuit
	dests []maps.Dest // every destination, first included (named circuits)
	// failedCgroups are the cgroups whose connections to it failed last
	// (at most MaxFailedCgroups, most recent last).
	failedCgroups []uint64
	// bulkSlots are a shared circuit's bulkheads of the workloads that
	// share it, by bulkhead class.
	bulkSlots map[uint8]BulkSlot
	// closed counts the established connections its close passes
	// closed since the daemon started (close_established).
	closed uint64
	// adaptive are its adaptive limits (adaptive.go); nil when its
	// limits are static.
	adaptive *adaptiveLimits
	// epoch keys the kernel's count of the cgroups its verdicts and its
	// own bulkhead reject; 0 until it first writes a rejecting verdict or
	// a limit.
	epoch uint32
}

// BulkSlot is one sharing workload's bulkhead slot of a circuit. Its
// epoch keys the cgroups its limits turn away in the rejections map; a
// slot a previous daemon left keeps its epoch.
type BulkSlot struct {
	ID       uint32
	Epoch    uint32
	Workload string
}

// newCircuit makes a circuit whose first destination is dst, named name
// ("" for a dynamic circuit, named by dst), counting in series m. Its
// state machine is the caller's to initialise.
func newCircuit(name string, endpoint bool, id uint32, m *Series, dst maps.Dest) *Circuit {
	c := &Circuit{endpoint: endpoint, ID: id, Metrics: m}
	c.first[0] = dst
	if name != "" {
		c.extra = &circuitExtra{name: name}
	}
	return c
}

func (c *Circuit) ensureExtra() *circuitExtra {
	if c.extra == nil {
		c.extra = &circuitExtra{}
	}
	return c.extra
}

// IsNamed reports whether c is a named target's circuit.
func (c *Circuit) IsNamed() bool { return c.extra != nil && c.extra.name != "" }

// FailedCgroups are the cgroups its failed connections came from (a copy).
func (c *Circuit) FailedCgroups() []uint64 {
	if c.extra == nil {
		return nil
	}
	return slices.Clone(c.extra.failedCgroups)
}

// NoteFailedCgroup remembers that a connection of cgroup id to c failed
// (0: the kernel did not say). No lookup here: it runs on the record path.
func (c *Circuit) NoteFailedCgroup(id uint64) {
	if id == 0 {
		return
	}
	x := c.ensureExtra()
	if i := slices.Index(x.failedCgroups, id); i >= 0 {
		x.failedCgroups = slices.Delete(x.failedCgroups, i, i+1)
	} else if len(x.failedCgroups) >= MaxFailedCgroups {
		x.failedCgroups = slices.Delete(x.failedCgroups, 0, 1)
	}
	x.failedCgroups = append(x.failedCgroups, id)
}

// Target is the name of the circuit's target (AllTarget for a dynamic
// circuit).
func (c *Circuit) Target() string { return c.Metrics.Target() }

// Workload is policy.SharedWorkload, or the isolated workload whose
// circuit it is.
func (c *Circuit) Workload() string { return c.Metrics.Workload() }

// RemoveDest forgets one destination of a named circuit that keeps others
// (the caller has removed its verdict, limit and registry entry).
func (c *Circuit) RemoveDest(dst maps.Dest) {
	if !c.IsNamed() {
		return
	}
	c.extra.dests = slices.DeleteFunc(c.extra.dests, func(x maps.Dest) bool { return x == dst })
}

// Name is the circuit's name: its target's (service scope),
// target/address (endpoint scope) or its destination's (dynamic).
func (c *Circuit) Name() string {
	if c.IsNamed() {
		return c.extra.name
	}
	return Classed(DynamicName(c.first[0]), c.Workload())
}

// First is the circuit's first destination.
func (c *Circuit) First() maps.Dest { return c.first[0] }

// Dests are the destinations whose verdicts the circuit writes (the
// registry's index maps back). The slice is the circuit's own: do not
// keep it past a change of the circuit's destinations.
func (c *Circuit) Dests() []maps.Dest {
	if c.IsNamed() {
		return c.extra.dests
	}
	return c.first[:]
}

// Scope is the circuit's target's scope ("" for a dynamic circuit).
func (c *Circuit) Scope() policy.Scope {
	switch {
	case c.Target() == AllTarget:
		return ""
	case c.endpoint:
		return policy.EndpointScope
	}
	return policy.ServiceScope
}

func (c *Circuit) String() string { return fmt.Sprintf("%s(%s)", c.Name(), c.Machine.State()) }

// Referenced notes that c recorded a call that moved nothing: an idle
// closed dynamic circuit then gets a second chance at eviction (the flag
// costs a record one store, not a move in the list).
func (c *Circuit) Referenced() {
	if c.inIdle {
		c.referenced = true
	}
}

// Epoch is the epoch c's rejecting verdicts carry (0: none written yet).
func (c *Circuit) Epoch() uint32 {
	if c.extra == nil {
		return 0
	}
	return c.extra.epoch
}

// SetEpoch gives c epoch e (0: none). The registry's Recording is the
// caller's to keep.
func (c *Circuit) SetEpoch(e uint32) {
	if e == 0 && c.extra == nil {
		return
	}
	c.ensureExtra().epoch = e
}

// ClosedEstablished is how many connections c's close passes closed.
func (c *Circuit) ClosedEstablished() uint64 {
	if c.extra == nil {
		return 0
	}
	return c.extra.closed
}

// AddClosedEstablished counts n connections a close pass of c closed.
func (c *Circuit) AddClosedEstablished(n uint64) { c.ensureExtra().closed += n }

// SharedSlots are c's sharing workloads' bulkhead slots by bulkhead
// class: the circuit's own map (nil without one), which the caller may
// delete from.
func (c *Circuit) SharedSlots() map[uint8]BulkSlot {
	if c.extra == nil {
		return nil
	}
	return c.extra.bulkSlots
}

// SetSharedSlot gives c bulkhead slot s for class k.
func (c *Circuit) SetSharedSlot(k uint8, s BulkSlot) {
	x := c.ensureExtra()
	if x.bulkSlots == nil {
		x.bulkSlots = map[uint8]BulkSlot{}
	}
	x.bulkSlots[k] = s
}

// BulkSlots lists c's sharing workloads' slots by workload name (a copy),
// each once: the classes of its criticality pool share one slot.
func (c *Circuit) BulkSlots() []BulkSlot {
	if c.extra == nil || len(c.extra.bulkSlots) == 0 {
		return nil
	}
	out := make([]BulkSlot, 0, len(c.extra.bulkSlots))
	for _, s := range c.extra.bulkSlots {
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Workload < out[j].Workload })
	return out
}

// addDest adds dst to a named circuit's destinations (a dynamic circuit
// has only its first).
func (c *Circuit) addDest(dst maps.Dest) {
	if c.IsNamed() {
		c.extra.dests = append(c.extra.dests, dst)
	}
}
