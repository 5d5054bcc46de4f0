package engine_test

import (
	"log/slog"
	"math"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// slowStart are options() with a 10 s linear slow start from 0.1.
func slowStart() *policy.Options {
	o := options()
	o.SlowStart = policy.SlowStartOptions{Duration: 10 * time.Second, Floor: 0.1, Aggression: 1}
	return o
}

// recover opens x and closes it on a successful probe.
func (c *core) recover(x *engine.Circuit) {
	c.t.Helper()
	c.fail(x, 2)
	c.clk.Advance(time.Second)
	c.probe(x)
	if s := x.Machine.State(); s != policy.Closed {
		c.t.Fatalf("after a successful probe: %s, want closed", s)
	}
}

// near fails t unless got is within 0.01 of want.
func near(t *testing.T, what string, got, want float64) {
	t.Helper()
	if math.Abs(got-want) > 0.01 {
		t.Fatalf("%s = %.4f, want %.4f", what, got, want)
	}
}

// A circuit with slow start that closes on successful probes leaves a
// ramp in the kernel: from the close, under its id, with the overload
// errno and the configured curve; the share the engine reports follows
// it, and once it is over the tick deletes the verdict.
func TestSlowStartRampsAfterRecovery(t *testing.T) {
	c := newCore(t, 8, nil)
	x := c.circuit(9501, slowStart())
	c.recover(x)
	closedAt := c.clk.Mono()
	v := c.verdict(dest(9501))
	if v.State != maps.Ramp || v.Due != closedAt || v.RampLen != 10*time.Second || v.CircuitID != x.ID || x.ID == 0 || v.Errno != syscall.EAGAIN {
		t.Fatalf("verdict after recovery %+v (id %d), want a 10 s ramp from %v under the circuit's id with EAGAIN", v, x.ID, closedAt)
	}
	if v.Curve[0] != 26 || v.Curve[4] != 128 {
		t.Fatalf("curve %v, want 0.1 (26/256) at 0 and 0.5 (128/256) at 4/8", v.Curve)
	}
	share, until, ok := c.e.Ramping(x)
	if !ok || !until.Equal(c.clk.Now().Add(10*time.Second)) {
		t.Fatalf("Ramping = %v, %v, %v; want ramping until %v", share, until, ok, c.clk.Now().Add(10*time.Second))
	}
	near(t, "share at the close", share, 0.1)
	c.clk.Advance(5 * time.Second)
	share, _, _ = c.e.Ramping(x)
	near(t, "share half way", share, 0.5)

	c.e.Tick(c.clk.Now()) // not over: kept
	if !c.hasVerdict(dest(9501)) {
		t.Fatal("the tick deleted a ramp in progress")
	}
	c.clk.Advance(5 * time.Second)
	if _, _, ok := c.e.Ramping(x); ok {
		t.Fatal("still ramping at its end")
	}
	c.e.Tick(c.clk.Now())
	if c.hasVerdict(dest(9501)) || c.e.RampCount() != 0 {
		t.Fatalf("after the ramp: verdict %v, ramps %d; want none", c.hasVerdict(dest(9501)), c.e.RampCount())
	}
}

// Without slow start, recovery deletes the verdict as always; a close
// that is not a recovery (forced) never ramps, and ends a ramp in
// progress.
func TestSlowStartOnlyOnRecovery(t *testing.T) {
	c := newCore(t, 8, nil)
	plain := c.circuit(9511, options())
	c.recover(plain)
	if c.hasVerdict(dest(9511)) {
		t.Fatalf("recovery without slow start left %+v", c.verdict(dest(9511)))
	}

	x := c.circuit(9512, slowStart())
	c.e.Force(x, "open", c.clk.Now())
	c.e.Force(x, "release", c.clk.Now())
	if c.hasVerdict(dest(9512)) {
		t.Fatalf("a released override ramps: %+v", c.verdict(dest(9512)))
	}
	c.recover(x)
	if c.verdict(dest(9512)).State != maps.Ramp {
		t.Fatal("no ramp after recovery")
	}
	c.e.Force(x, "close", c.clk.Now())
	if c.hasVerdict(dest(9512)) || c.e.RampCount() != 0 {
		t.Fatalf("forced closed during the ramp: verdict %v, ramps %d; want none", c.hasVerdict(dest(9512)), c.e.RampCount())
	}
}

// A failure during the ramp is judged as always: enough of them open the
// circuit again (an open verdict replaces the ramp), and the next
// recovery ramps anew from its own close.
func TestSlowStartFailuresDuringTheRampReopen(t *testing.T) {
	c := newCore(t, 8, nil)
	x := c.circuit(9521, slowStart())
	c.recover(x)
	c.clk.Advance(2 * time.Second)
	c.fail(x, 2)
	if v := c.verdict(dest(9521)); v.State != maps.Open || x.Machine.State() != policy.Open {
		t.Fatalf("failures during the ramp: %s, verdict %+v; want open", x.Machine.State(), v)
	}
	if _, _, ok := c.e.Ramping(x); ok {
		t.Fatal("an open circuit is ramping")
	}
	c.clk.Advance(2 * time.Second) // the open duration doubled
	c.probe(x)
	if v := c.verdict(dest(9521)); v.State != maps.Ramp || v.Due != c.clk.Mono() {
		t.Fatalf("second recovery: %+v, want a ramp from %v", v, c.clk.Mono())
	}
}

// A ramping circuit keeps its id when ids are scarce (the kernel counts
// its ramp under it) and gives it back once the ramp is over.
func TestSlowStartKeepsTheIDUntilTheRampEnds(t *testing.T) {
	c := newCore(t, 3, nil) // ids 1 and 2: scarce from one held
	x := c.circuit(9531, slowStart())
	c.recover(x)
	if x.ID == 0 || c.verdict(dest(9531)).CircuitID != x.ID {
		t.Fatalf("ramping with ids scarce: id %d, verdict %+v", x.ID, c.verdict(dest(9531)))
	}
	c.clk.Advance(10 * time.Second)
	c.e.Tick(c.clk.Now())
	if x.ID != 0 || c.hasVerdict(dest(9531)) {
		t.Fatalf("after the ramp with ids scarce: id %d, verdict %v; want the id given back", x.ID, c.hasVerdict(dest(9531)))
	}
}

// A restarted daemon adopts a ramp in progress as it finds it (same
// start, curve and id), reports its share, and deletes it at its end; a
// ramp already over, or one whose circuit is now forced open, is deleted.
func TestSlowStartRampIsAdopted(t *testing.T) {
	c := newCore(t, 8, nil)
	x := c.circuit(9541, slowStart())
	c.recover(x)
	left := c.verdict(dest(9541))
	c.clk.Advance(3 * time.Second)

	// The next daemon, on the same maps and the same clock.
	n := newCore(t, 8, c.k)
	n.clk = c.clk
	n.e = engine.New(engine.Config{Kernel: c.k, Clock: c.clk, Log: slog.New(slog.NewTextHandler(n.logs, nil)), Metrics: n.metrics, Hooks: n.hooks, Rand: func() float64 { return 0.5 }, IDs: 8})
	n.e.SetMatching(engine.Matching{Classes: (&policy.Config{}).Classes()})
	n.e.LoadKept()
	n.e.IDs().LoadPinned(c.k.Verdicts(), nil, nil)
	y := n.circuit(9541, slowStart())
	if !n.e.AdoptRamp(y, dest(9541), left) {
		t.Fatal("a ramp in progress was not adopted")
	}
	if v := n.verdict(dest(9541)); v != left || y.ID != left.CircuitID {
		t.Fatalf("adopted verdict %+v (id %d), want it as left %+v", v, y.ID, left)
	}
	share, _, ok := n.e.Ramping(y)
	if !ok {
		t.Fatal("not ramping after adoption")
	}
	near(t, "share 3 s into an adopted ramp", share, 0.3) // max(0.1, 0.3)
	n.clk.Advance(7 * time.Second)
	n.e.Tick(n.clk.Now())
	if n.hasVerdict(dest(9541)) {
		t.Fatal("an adopted ramp outlived its end")
	}

	// Over already when found: deleted at once.
	z := n.circuit(9542, slowStart())
	over := left
	over.Due = n.clk.Mono() - 20*time.Second
	_ = c.k.PutVerdict(dest(9542), over)
	if n.e.AdoptRamp(z, dest(9542), over) || n.hasVerdict(dest(9542)) {
		t.Fatal("a finished ramp was adopted")
	}
	// A circuit forced open now: its ramp goes.
	f := n.circuit(9543, slowStart())
	n.e.Force(f, "open", n.clk.Now())
	if n.e.AdoptRamp(f, dest(9543), left) || n.verdict(dest(9543)).State == maps.Ramp {
		t.Fatal("a forced-open circuit adopted a ramp")
	}
}

// A reload that changes slow_start leaves a ramp in progress as it was
// written; the next recovery ramps with the new options.
func TestSlowStartReloadAppliesFromTheNextClose(t *testing.T) {
	c := newCore(t, 8, nil)
	x := c.circuit(9551, slowStart())
	c.recover(x)
	before := c.verdict(dest(9551))
	o := slowStart()
	o.SlowStart = policy.SlowStartOptions{Duration: 3 * time.Second, Floor: 0.5, Aggression: 2}
	x.Machine.SetOptions(o, c.clk.Now())
	c.e.Tick(c.clk.Now())
	if v := c.verdict(dest(9551)); v != before {
		t.Fatalf("a reload rewrote the ramp in progress: %+v, was %+v", v, before)
	}
	c.clk.Advance(time.Second)
	c.recover(x)
	if v := c.verdict(dest(9551)); v.State != maps.Ramp || v.RampLen != 3*time.Second || v.Curve[0] != 128 {
		t.Fatalf("the next recovery's ramp %+v, want 3 s from 0.5", v)
	}
}
