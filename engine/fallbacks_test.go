package engine_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

var house = netip.MustParseAddrPort("192.0.2.99:8080")

// named makes target pay's circuit over port's destination, with options o.
func (c *core) named(name string, port uint16, o *policy.Options) *engine.Circuit {
	c.t.Helper()
	x := c.e.Make(name, name, policy.ServiceScope, o, policy.NoOverride, nil, dest(port), c.clk.Now())
	if x == nil {
		c.t.Fatal("no circuit made")
	}
	c.e.Attach(x, dest(port))
	return x
}

// fallbackOf is the fake kernel's fallback entry of x's id.
func (c *core) fallbackOf(x *engine.Circuit) (maps.Fallback, bool) {
	f, ok := c.k.Fallbacks()[x.ID]
	return f, ok
}

// A circuit with a fallback has its entry in the kernel exactly while it
// rejects (open and half-open), under the epoch of its verdicts, written
// once for all its destinations and before them, and deleted when it
// closes.
func TestFallbackIsWrittenWhileTheCircuitRejects(t *testing.T) {
	c := newCore(t, 8, nil)
	o := options()
	o.Fallback = house
	x := c.named("pay", 9501, o)
	c.e.Attach(x, dest(9502))
	if _, ok := c.fallbackOf(x); ok || c.k.Calls("PutFallback") != 0 {
		t.Fatal("a closed circuit's fallback is in the kernel")
	}
	c.fail(x, 2)
	f, ok := c.fallbackOf(x)
	if !ok || f.Addr != house || f.Proto != 0 {
		t.Fatalf("open: fallback %+v %v, want %v for either protocol", f, ok, house)
	}
	for _, d := range []maps.Dest{dest(9501), dest(9502)} {
		if v := c.verdict(d); v.Epoch != f.Epoch || v.Epoch == 0 || v.CircuitID != x.ID {
			t.Fatalf("verdict %+v; the fallback's epoch %d must be the verdicts'", v, f.Epoch)
		}
	}
	if n := c.k.Calls("PutFallback"); n != 1 {
		t.Fatalf("%d fallback writes for one opening of two destinations, want 1", n)
	}
	// Half-open: it still rejects what its probes leave.
	c.clk.Advance(time.Second)
	v := c.verdict(x.First())
	c.k.SetBudget(v.CircuitID, maps.Budget{Round: v.Round})
	if tr, moved := x.Machine.BeginHalfOpen(c.clk.Now(), v.Round); moved {
		c.e.Apply(x, tr)
	}
	if _, ok := c.fallbackOf(x); !ok {
		t.Fatal("half-open: the fallback is gone while connects are still rejected")
	}
	c.record(x, policy.Result{Kind: policy.Success, Probe: true, Round: v.Round}, 1)
	if x.Machine.State() != policy.Closed {
		t.Fatalf("state %s, want closed", x.Machine.State())
	}
	if _, ok := c.fallbackOf(x); ok {
		t.Fatal("closed: the fallback is still in the kernel")
	}
}

// A circuit without a fallback writes none; a reload that gives an open
// circuit one, changes it or takes it away applies at once.
func TestFallbackFollowsTheOptionsOfAnOpenCircuit(t *testing.T) {
	c := newCore(t, 8, nil)
	x := c.named("pay", 9511, options())
	c.fail(x, 2)
	if _, ok := c.fallbackOf(x); ok {
		t.Fatal("a fallback without one configured")
	}
	o := options()
	o.Fallback = house
	x.Machine.SetOptions(o, c.clk.Now())
	c.e.SyncFallback(x)
	if f, ok := c.fallbackOf(x); !ok || f.Addr != house || f.Epoch != c.verdict(dest(9511)).Epoch {
		t.Fatalf("after the reload: %+v %v", f, ok)
	}
	o2 := options()
	o2.Fallback = netip.MustParseAddrPort("192.0.2.98:8080")
	x.Machine.SetOptions(o2, c.clk.Now())
	c.e.SyncFallback(x)
	if f, _ := c.fallbackOf(x); f.Addr != o2.Fallback {
		t.Fatalf("after the change: %+v", f)
	}
	x.Machine.SetOptions(options(), c.clk.Now())
	c.e.SyncFallback(x)
	if _, ok := c.fallbackOf(x); ok {
		t.Fatal("removed from the options, the fallback stays in the kernel")
	}
}

// A dropped circuit's fallback goes with it; a restarted engine keeps the
// entries of its rejecting circuits and deletes those a previous daemon
// left for ids no rejecting circuit with a fallback holds now.
func TestFallbacksAcrossDropAndRestart(t *testing.T) {
	c := newCore(t, 8, nil)
	o := options()
	o.Fallback = house
	x := c.named("pay", 9521, o)
	y := c.named("web", 9522, o)
	c.fail(x, 2)
	c.fail(y, 2)
	if len(c.k.Fallbacks()) != 2 {
		t.Fatalf("fallbacks %v, want two", c.k.Fallbacks())
	}
	c.e.Drop(y)
	if _, ok := c.k.Fallbacks()[y.ID]; ok {
		t.Fatal("a dropped circuit's fallback stays")
	}
	// A leftover of another daemon, under an id nobody holds.
	if err := c.k.PutFallback(7, maps.Fallback{Addr: house, Epoch: 99}); err != nil {
		t.Fatal(err)
	}
	keep := c.k.Fallbacks()[x.ID]
	d := newCore(t, 8, c.k)
	x2 := d.named("pay", 9521, o)
	if x2.ID != x.ID {
		t.Fatalf("the restarted circuit holds id %d, want %d", x2.ID, x.ID)
	}
	v := c.verdict(dest(9521))
	x2.Machine.Restore(d.clk.Now(), d.clk.Now().Add(time.Second), v.Round, false)
	d.e.SyncFallbacks()
	got := d.k.Fallbacks()
	if f := got[x.ID]; len(got) != 1 || f.Addr != keep.Addr || f.Epoch != x2.Epoch() || f.Epoch == 0 {
		t.Fatalf("after restart: fallbacks %v, want only %v under %d, of the circuit's epoch %d", got, keep.Addr, x.ID, x2.Epoch())
	}
}

// A Service fallback is written once its Service resolved (the daemon's
// Matching), follows a new address, and goes when the Service does.
func TestServiceFallbackFollowsItsResolution(t *testing.T) {
	c := newCore(t, 8, nil)
	o := options()
	o.FallbackService = policy.ServiceFallback{Service: "shop/house", Port: 80}
	x := c.named("pay", 9531, o)
	c.fail(x, 2)
	if _, ok := c.fallbackOf(x); ok {
		t.Fatal("a fallback written before its Service resolved")
	}
	resolve := func(a string) {
		m := engine.Matching{Classes: (&policy.Config{}).Classes(), Fallbacks: map[policy.ServiceFallback]netip.AddrPort{}}
		if a != "" {
			m.Fallbacks[o.FallbackService] = netip.MustParseAddrPort(a)
		}
		c.e.SetMatching(m)
		c.e.SyncFallback(x)
	}
	resolve("10.96.0.10:80")
	if f, ok := c.fallbackOf(x); !ok || f.Addr.String() != "10.96.0.10:80" {
		t.Fatalf("resolved: %+v %v", f, ok)
	}
	resolve("10.96.0.11:80")
	if f, _ := c.fallbackOf(x); f.Addr.String() != "10.96.0.11:80" {
		t.Fatalf("re-resolved: %+v", f)
	}
	resolve("")
	if _, ok := c.fallbackOf(x); ok {
		t.Fatal("the Service went, its fallback stays")
	}
}
