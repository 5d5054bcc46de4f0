package daemon

import (
	"net/netip"
	"strconv"
	"testing"
	"time"
	"unsafe"

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
		d.mu.Lock()
		defer d.mu.Unlock()
		d.eng.HandleBatch([]maps.Event{{Dest: dynamicDest(i), Outcome: o}}, now)
	}
	for i := range 5 {
		rec(i, maps.Established)
	}
	rec(2, maps.Refused)
	rec(2, maps.Refused) // circuit 2 opens
	d.mu.Lock()
	checkRegistry(t, d.eng)
	if d.eng.ActiveCount() != 1 {
		t.Fatalf("active %d, want 1", d.eng.ActiveCount())
	}
	d.eng.HandleBatch([]maps.Event{{Dest: maps.Dest{Proto: maps.TCP, Addr: dynamicDest(0).Addr}, Outcome: maps.Established}}, now) // 0 becomes the most recent
	d.eng.HandleBatch([]maps.Event{{Dest: endpointDest(1), Outcome: maps.Established}}, now)                                       // an endpoint circuit: 6 destinations
	d.mu.Unlock()
	rec(7, maps.Established) // a 7th destination evicts the least recently active closed dynamic one: 1
	d.mu.Lock()
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
	d.mu.Unlock()
	// Half-open (the tick), then closed by its probe.
	time.Sleep(60 * time.Millisecond)
	d.mu.Lock()
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
	d.mu.Unlock()
	if _, err := d.Force(name, "open"); err != nil {
		t.Fatal(err)
	}
	d.mu.Lock()
	checkRegistry(t, d.eng)
	d.mu.Unlock()
	f.writeConfig("max_circuits: 6\nall:\n  consecutive_failures: 3\n")
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	d.mu.Lock()
	checkRegistry(t, d.eng) // the removed target's endpoint circuit is in no set
	d.mu.Unlock()
}

func endpointDest(i int) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(mustAddr("198.19.200.1"), uint16(80+i))}
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

// A dynamic circuit is one allocation of this size (plus its 8-byte
// window ring and its registry entry): BenchmarkCircuitFootprint measures
// the whole; this keeps a new field from growing it unnoticed.
func TestCircuitSize(t *testing.T) {
	if s := unsafe.Sizeof(circuit{}); s > 192 {
		t.Fatalf("a circuit takes %d bytes, more than 192 (the footprint goal is ≤ 300 bytes per dynamic circuit)", s)
	}
}

// handleBatch, which looks circuits up ahead of handling records (with
// many circuits), ends exactly where handling the records one by one does,
// also when records in a chunk make circuits that evict ones looked up
// earlier in it.
func TestHandleBatchMatchesOneByOne(t *testing.T) {
	const n = 8192 // the engine's prefetchFrom
	cfg := "max_circuits: " + strconv.Itoa(n) + "\nall:\n  consecutive_failures: 3\n  open_duration: 4m\n"
	var evs []maps.Event
	cookie := uint64(1)
	ev := func(i int, o maps.Outcome) {
		evs = append(evs, maps.Event{Dest: dynamicDest(i), Outcome: o, Duration: time.Millisecond, Cookie: cookie, Time: time.Duration(cookie) * time.Microsecond})
		cookie++
	}
	for i := range n {
		ev(i, maps.Established)
	}
	// Then chunks mixing old destinations (some failing three times in a
	// row, which opens them), new ones (each evicts the least recently
	// active idle circuit, often one looked up earlier in the chunk) and
	// resets dated by the reset-dating table.
	for round := range 8 {
		for j := range 300 {
			switch j % 5 {
			case 0:
				ev(n+round*300+j, maps.Established)
			case 1, 2:
				ev((round*977+j*31)%n, maps.Refused)
			case 3:
				ev((round*977+j*31)%n, maps.Established)
			default:
				ev(j, maps.Refused)
			}
		}
	}
	now := time.Now()
	type summary struct {
		state                              string
		calls, failures, consecutive, trip int
	}
	run := func(batched bool) map[string]summary {
		f := newFixture(t, cfg)
		d := f.start()
		d.mu.Lock()
		if batched {
			for rest := evs; len(rest) > 0; {
				k := min(len(rest), readBatch)
				d.eng.HandleBatch(rest[:k], now)
				rest = rest[k:]
			}
		} else {
			for i := range evs {
				d.eng.HandleBatch(evs[i:i+1], now)
			}
		}
		checkRegistry(t, d.eng)
		d.mu.Unlock()
		out := map[string]summary{}
		for _, c := range d.Circuits() {
			out[c.Name] = summary{c.State, c.Calls, c.Failures, c.ConsecutiveFailures, c.Trip}
		}
		f.stop()
		return out
	}
	one, batched := run(false), run(true)
	if len(one) != n || len(batched) != len(one) {
		t.Fatalf("%d circuits one by one, %d batched, want %d", len(one), len(batched), n)
	}
	open := 0
	for name, c := range one {
		if b := batched[name]; b != c {
			t.Fatalf("%s: one by one %+v, batched %+v", name, c, b)
		}
		if c.state == "open" {
			open++
		}
	}
	if open == 0 {
		t.Fatal("no circuit opened: the records test nothing")
	}
}
