package engine_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// summaryConfig has a named endpoint-scope target with a bulkhead, a
// service-scope one, and dynamic circuits few enough to be evicted.
const summaryConfig = `
max_circuits: 12
all:
  consecutive_failures: 2
  open_duration: 1s
  jitter: 0
  half_open_probes: 1
targets:
  pay:
    match: {cidrs: [SRV], ports: ["8101-8104"]}
    scope: endpoint
    consecutive_failures: 1
    open_duration: 2s
    max_connections: 10
  svc:
    match: {cidrs: [SRV], ports: ["9431-9432"]}
    consecutive_failures: 2
    open_duration: 1s
    jitter: 0
`

// The Summary the metrics read (states by target, id owners, retired
// counts) says what a walk of every circuit says, after each of a few
// thousand random steps: records of every kind, probes, ticks, forced
// states, drops, evictions and ids given back while scarce. The engine keeps it up to date as it goes
// instead of walking, so a path that changes a state or an id without
// it shows here.
func TestSummaryFollowsTheCircuits(t *testing.T) {
	f := newFed(t, summaryConfig, nil)
	f.e.IDs().SetLimit(14) // scarce from 7 held: closing circuits give theirs back
	rng := rand.New(rand.NewPCG(1, 2))
	ports := []uint16{8101, 8102, 8103, 8104, 9431, 9432}
	for p := uint16(7000); p < 7016; p++ {
		ports = append(ports, p) // dynamic: more than max_circuits leaves room for
	}
	for step := range 3000 {
		p := ports[rng.IntN(len(ports))]
		what := rng.IntN(9)
		switch what {
		case 0, 1:
			f.refused(p, 1+rng.IntN(2))
		case 2:
			f.connected(p, 1)
		case 3:
			if c := f.at(p); c != nil && c.Machine.State() == policy.Open {
				f.probeRound(p, rng.IntN(2) == 0)
			}
		case 4:
			f.clk.Advance(time.Duration(rng.IntN(700)) * time.Millisecond)
			f.tick()
		case 5:
			if c := f.at(p); c != nil {
				action := []string{"open", "close", "release", "reset"}[rng.IntN(4)]
				f.e.Force(c, action, f.clk.Now())
			}
		case 6:
			if c := f.at(p); c != nil && rng.IntN(4) == 0 {
				f.e.Drop(c)
			}
		case 7:
			f.e.EvictIdle()
		case 8:
			f.k.SetCounters(uint32(1+rng.IntN(8)), maps.Counters{Rejected: uint64(rng.IntN(5))})
		}
		f.e.Publish()
		if err := summaryMatchesWalk(f.e); err != nil {
			t.Fatalf("step %d (%d on port %d): %v", step, what, p, err)
		}
	}
}

// summaryMatchesWalk compares e's Summary with what a walk of its
// circuits finds.
func summaryMatchesWalk(e *engine.Engine) error {
	s := e.Summary()
	states := map[string]policy.Tally{}
	owners := map[uint32]engine.IDOwner{}
	for c := range e.All() {
		tl := states[c.Target()]
		tl[c.Machine.State()]++
		states[c.Target()] = tl
		if c.ID != 0 {
			owners[c.ID] = engine.IDOwner{Target: c.Target()}
		}
		for _, b := range c.BulkSlots() {
			owners[b.ID] = engine.IDOwner{Target: c.Target(), Bulk: true}
		}
	}
	for name, ts := range s.Targets {
		if ts.States != states[name] {
			return fmt.Errorf("target %s: summary says %v, the circuits %v", name, ts.States, states[name])
		}
		if ts.Retired != e.Retired(name) {
			return fmt.Errorf("target %s: retired %+v, want %+v", name, ts.Retired, e.Retired(name))
		}
	}
	for id := range s.NextID {
		got, ok := s.Owner(id)
		want, held := owners[id]
		if ok != held || got != want {
			return fmt.Errorf("id %d: summary says %+v (%v), the circuits %+v (%v)", id, got, ok, want, held)
		}
	}
	if s.Unenforced != e.UnenforcedCount() {
		return fmt.Errorf("unenforced %d, want %d", s.Unenforced, e.UnenforcedCount())
	}
	return nil
}
