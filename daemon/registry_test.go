package daemon

import (
	"net/netip"
	"testing"
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// checkRegistry fails t unless the registry's sets say what the circuits'
// states say: active holds exactly the circuits that reject, idle exactly
// the closed dynamic ones (in order of last touch), endpoints exactly the
// endpoint-scoped ones (a dropped circuit in none).
func checkRegistry(t *testing.T, e *engine.Engine) {
	t.Helper()
	if err := e.CheckSets(); err != nil {
		t.Error(err)
	}
}

// The sets the tick and eviction rely on follow every kind of change:
// trips, half-open, closing, a change by hand, eviction and a reload that
// drops circuits; eviction takes the least recently active closed dynamic
// circuit, never an open one.
func TestRegistrySetsFollowState(t *testing.T) {
	f := newFixture(t, `max_circuits: 6
all:
  consecutive_failures: 2
  open_duration: 50ms
  half_open_probes: 1
targets:
  eps:
    match: {cidrs: [198.19.200.0/24]}
    scope: endpoint
`)
	d := f.start()
	now := time.Now()
	rec := func(i int, o maps.Outcome) {
		d.hold()
		defer d.release()
		d.eng.HandleBatch([]maps.Event{{Dest: dynamicDest(i), Outcome: o}}, now)
	}
	for i := range 5 {
		rec(i, maps.Established)
	}
	rec(2, maps.Refused)
	rec(2, maps.Refused) // circuit 2 opens
	d.hold()
	checkRegistry(t, d.eng)
	if d.eng.ActiveCount() != 1 {
		t.Fatalf("active %d, want 1", d.eng.ActiveCount())
	}
	d.eng.HandleBatch([]maps.Event{{Dest: maps.Dest{Proto: maps.TCP, Addr: dynamicDest(0).Addr}, Outcome: maps.Established}}, now) // 0 becomes the most recent
	d.eng.HandleBatch([]maps.Event{{Dest: endpointDest(1), Outcome: maps.Established}}, now)                                       // an endpoint circuit: 6 destinations
	d.release()
	rec(7, maps.Established) // a 7th destination evicts the least recently active closed dynamic one: 1
	d.hold()
	checkRegistry(t, d.eng)
	if _, ok := d.eng.At(dynamicDest(1)); ok {
		t.Errorf("circuit 1 not evicted")
	}
	if _, ok := d.eng.At(dynamicDest(2)); !ok {
		t.Errorf("the open circuit was evicted")
	}
	if _, ok := d.eng.At(dynamicDest(0)); !ok {
		t.Errorf("the most recently active circuit was evicted")
	}
	d.release()
	// Half-open (the tick), then closed by its probe.
	time.Sleep(60 * time.Millisecond)
	d.hold()
	c, _ := d.eng.At(dynamicDest(2))
	if tr, moved := c.Machine.BeginHalfOpen(time.Now(), c.Machine.Round()); moved {
		d.eng.Apply(c, tr)
	}
	checkRegistry(t, d.eng)
	d.eng.HandleBatch([]maps.Event{{Dest: dynamicDest(2), Outcome: maps.Established, Probe: true, Round: c.Machine.Round()}}, time.Now())
	if s := c.Machine.State(); s != policy.Closed {
		t.Fatalf("after the probe: %s", s)
	}
	checkRegistry(t, d.eng)
	name := c.Name()
	d.release()
	if _, err := d.Force(name, "open"); err != nil {
		t.Fatal(err)
	}
	d.hold()
	checkRegistry(t, d.eng)
	d.release()
	f.writeConfig("max_circuits: 6\nall:\n  consecutive_failures: 3\n")
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	d.hold()
	checkRegistry(t, d.eng) // the removed target's endpoint circuit is in no set
	d.release()
}

func endpointDest(i int) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(mustAddr("198.19.200.1"), uint16(80+i))}
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }
