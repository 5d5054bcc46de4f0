package engine_test

import (
	"bytes"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/engine/enginetest"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// core is an engine on a fake kernel and a fake clock, with hooks and
// metrics that remember what they were told: no root, no maps, no real
// time, so everything a test asserts is decided when its call returns.
type core struct {
	t       *testing.T
	e       *engine.Engine
	k       *enginetest.Kernel
	clk     *enginetest.Clock
	logs    *bytes.Buffer // the engine is used by this goroutine alone
	hooks   *hooks
	metrics *metrics
}

// hooks remember the transitions the engine applied, and the names of
// their circuits.
type hooks struct {
	transitions []policy.Transition
	circuits    []string
}

func (h *hooks) Opened(*engine.Circuit, policy.State, policy.State, time.Time) {}
func (h *hooks) Transitioned(c *engine.Circuit, t policy.Transition) {
	h.transitions = append(h.transitions, t)
	h.circuits = append(h.circuits, c.Name())
}

// count is a Counter and an Observer.
type count struct{ n float64 }

func (c *count) Inc()              { c.n++ }
func (c *count) Add(v float64)     { c.n += v }
func (c *count) Observe(v float64) {}

// metrics keep every series as a count, by name and labels.
type metrics struct{ series map[string]*count }

func (m *metrics) get(key string) *count {
	if m.series[key] == nil {
		m.series[key] = &count{}
	}
	return m.series[key]
}
func (m *metrics) Outcome(outcome, target, workload string) engine.Counter {
	return m.get("outcome/" + outcome + "/" + target + "/" + workload)
}
func (m *metrics) Handshake(target string) engine.Observer { return m.get("handshake/" + target) }
func (m *metrics) Transition(from, to, reason, workload string) engine.Counter {
	return m.get("transition/" + from + "/" + to + "/" + reason)
}
func (m *metrics) Refused(target string) engine.Counter { return m.get("refused/" + target) }
func (m *metrics) Evicted() engine.Counter              { return m.get("evicted") }
func (m *metrics) VerdictWriteErrors() engine.Counter   { return m.get("verdict_write_errors") }
func (m *metrics) LimitChanges(target, kind string) engine.Counter {
	return m.get("limit_changes/" + target + "/" + kind)
}

// newCore makes an engine with ids ids on kernel k (a new one when nil:
// pass the last core's to restart on the same maps).
func newCore(t *testing.T, ids uint32, k *enginetest.Kernel) *core {
	t.Helper()
	if k == nil {
		k = enginetest.NewKernel()
	}
	c := &core{t: t, k: k, clk: enginetest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)), logs: &bytes.Buffer{},
		hooks: &hooks{}, metrics: &metrics{series: map[string]*count{}}}
	c.e = engine.New(engine.Config{Kernel: k, Clock: c.clk, Log: slog.New(slog.NewTextHandler(c.logs, nil)), Metrics: c.metrics,
		Hooks: c.hooks, Rand: func() float64 { return 0.5 }, IDs: ids})
	c.e.SetMatching(engine.Matching{Classes: (&policy.Config{}).Classes()})
	c.e.LoadKept()
	return c
}

// options are all's: two consecutive failures open for a second.
func options() *policy.Options {
	o := policy.DefaultOptions()
	o.ConsecutiveFailures, o.OpenDuration, o.Jitter, o.HalfOpenProbes = 2, time.Second, 0, 1
	return &o
}

func dest(port uint16) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.MustParseAddr("192.0.2.10"), port)}
}

// circuit returns port's dynamic circuit, made when there is none.
func (c *core) circuit(port uint16, o *policy.Options) *engine.Circuit {
	c.t.Helper()
	if x, ok := c.e.At(dest(port)); ok {
		return x
	}
	x := c.e.Make("", engine.AllTarget, "", o, policy.NoOverride, nil, dest(port), c.clk.Now())
	if x == nil {
		c.t.Fatalf("no circuit made for port %d", port)
	}
	c.e.Attach(x, dest(port))
	return x
}

func (c *core) record(x *engine.Circuit, r policy.Result, n int) bool {
	return c.e.Record(x, c.clk.Now(), r, policy.Classify(x.Machine.Options(), r), n)
}

func (c *core) fail(x *engine.Circuit, n int) {
	for range n {
		c.record(x, policy.Result{Kind: policy.Failure}, 1)
	}
}

// probe has the kernel begin x's half-open round and admit one probe,
// which succeeds.
func (c *core) probe(x *engine.Circuit) {
	c.t.Helper()
	v := c.verdict(x.First())
	c.k.SetBudget(v.CircuitID, maps.Budget{Round: v.Round})
	if t, moved := x.Machine.BeginHalfOpen(c.clk.Now(), v.Round); moved {
		c.e.Apply(x, t)
	}
	c.record(x, policy.Result{Kind: policy.Success, Probe: true, Round: v.Round}, 1)
}

func (c *core) verdict(d maps.Dest) maps.Verdict {
	c.t.Helper()
	v, ok := c.k.Verdicts()[d]
	if !ok {
		c.t.Fatalf("%s has no verdict", d)
	}
	return v
}

func (c *core) hasVerdict(d maps.Dest) bool {
	_, ok := c.k.Verdicts()[d]
	return ok
}

// A dynamic circuit is given its kernel id as it is about to open, before
// its transition is computed: the transition's round, the one its
// verdict is written with, comes after the rounds of the slot's probe
// budget, and writing the verdict changes nothing of the state machine.
func TestRecordSeatsBeforeTheTransition(t *testing.T) {
	c := newCore(t, 8, nil)
	c.k.SetBudget(1, maps.Budget{Round: 7}) // a former holder's rounds
	x := c.circuit(9401, options())
	if x.ID != 0 {
		t.Fatalf("a closed dynamic circuit without limits holds id %d", x.ID)
	}
	c.fail(x, 1)
	if x.ID != 0 || c.k.Calls("Budget") != 0 {
		t.Fatalf("seated (id %d, %d budget reads) before it opened", x.ID, c.k.Calls("Budget"))
	}
	c.fail(x, 1)
	if len(c.hooks.transitions) != 1 {
		t.Fatalf("transitions %+v, want one", c.hooks.transitions)
	}
	tr, v := c.hooks.transitions[0], c.verdict(dest(9401))
	if tr.To != policy.Open || x.ID != 1 || v.CircuitID != 1 {
		t.Fatalf("opened: %+v, id %d, verdict %+v", tr, x.ID, v)
	}
	if tr.Round != 8 || v.Round != tr.Round || x.Machine.Round() != tr.Round {
		t.Fatalf("transition round %d, verdict round %d, machine round %d: want all 8, after the slot's 7", tr.Round, v.Round, x.Machine.Round())
	}
}

// With ids scarce, a circuit that opens with none is counted, logged and
// left unenforced (no verdict write is tried); one that closes gives its
// id back and keeps its kernel counts in its target's totals; the
// waiting circuit takes the id at the next retry, within its open
// duration, in a round after the slot's.
func TestScarceIDsAreGivenBackAndWaitedFor(t *testing.T) {
	c := newCore(t, 3, nil) // ids 1 and 2; scarce from one held
	o := options()
	a, b := c.circuit(9411, o), c.circuit(9412, o)
	c.fail(a, 2)
	c.fail(b, 2)
	if a.ID == 0 || b.ID == 0 || a.ID == b.ID {
		t.Fatalf("two open circuits: ids %d and %d", a.ID, b.ID)
	}
	idA := a.ID
	c.clk.Advance(500 * time.Millisecond)
	puts := c.k.Calls("PutVerdict")
	w := c.circuit(9413, o)
	c.fail(w, 2)
	if w.Machine.State() != policy.Open || w.ID != 0 || c.hasVerdict(dest(9413)) || c.k.Calls("PutVerdict") != puts {
		t.Fatalf("a third open circuit with two ids: %s, id %d, verdict %v, %d writes tried", w.Machine.State(), w.ID, c.hasVerdict(dest(9413)), c.k.Calls("PutVerdict")-puts)
	}
	if n := c.metrics.get("verdict_write_errors").n; n != 1 || !c.e.Unenforced(w) || !strings.Contains(c.logs.String(), "no circuit id free") {
		t.Fatalf("verdict write errors %v, unenforced %v, logs:\n%s", n, c.e.Unenforced(w), c.logs.String())
	}

	c.k.SetCounters(idA, maps.Counters{Rejected: 5})
	c.clk.Advance(500 * time.Millisecond)
	roundA := c.verdict(dest(9411)).Round
	c.probe(a)
	if a.Machine.State() != policy.Closed || a.ID != 0 || c.hasVerdict(dest(9411)) {
		t.Fatalf("closed with ids scarce: %s, id %d, verdict %v", a.Machine.State(), a.ID, c.hasVerdict(dest(9411)))
	}
	if r := c.e.Retired(engine.AllTarget).Rejected; r != 5 {
		t.Fatalf("retired rejections %d, want 5", r)
	}

	c.e.RetryUnenforced()
	if w.ID != idA || c.e.Unenforced(w) {
		t.Fatalf("after an id was freed: id %d (want %d), unenforced %v", w.ID, idA, c.e.Unenforced(w))
	}
	if v := c.verdict(dest(9413)); v.State != maps.Open || v.CircuitID != idA || v.Round <= roundA {
		t.Fatalf("verdict %+v, want open under id %d in a round after %d", v, idA, roundA)
	}
}

// An open circuit that found no id for its whole open duration closes as
// not_enforced at the retry (it rejected nothing).
func TestUnenforcedOpenCircuitCloses(t *testing.T) {
	c := newCore(t, 2, nil) // one id
	o := options()
	a, b := c.circuit(9421, o), c.circuit(9422, o)
	c.fail(a, 2)
	c.fail(b, 2)
	if b.ID != 0 || !c.e.Unenforced(b) {
		t.Fatalf("with the one id taken: id %d, unenforced %v", b.ID, c.e.Unenforced(b))
	}
	c.e.RetryUnenforced() // within its open duration: it waits
	if b.Machine.State() != policy.Open {
		t.Fatalf("closed within its open duration: %s", b.Machine.State())
	}
	c.clk.Advance(time.Second)
	c.e.RetryUnenforced()
	if b.Machine.State() != policy.Closed || c.e.Unenforced(b) {
		t.Fatalf("past its open duration: %s, unenforced %v", b.Machine.State(), c.e.Unenforced(b))
	}
	if last := c.hooks.transitions[len(c.hooks.transitions)-1]; last.Reason != policy.ReasonNotEnforced {
		t.Fatalf("last transition %+v, want not_enforced", last)
	}
}

// Eviction takes the least recently queued idle closed dynamic circuit,
// passing over (and requeueing) one that recorded a call since; an open
// circuit is never a victim.
func TestEvictionGivesSecondChance(t *testing.T) {
	c := newCore(t, 8, nil)
	o := options()
	a, b := c.circuit(9441, o), c.circuit(9442, o)
	ok := policy.Result{Kind: policy.Success, Duration: time.Millisecond}
	if !c.record(a, ok, 1) {
		a.Referenced() // what the daemon does with a call that moves nothing
	}
	if !c.e.EvictIdle() {
		t.Fatal("nothing evicted")
	}
	if _, ok := c.e.At(dest(9442)); ok {
		t.Fatal("the circuit without a call since was not the victim")
	}
	if _, ok := c.e.At(dest(9441)); !ok || c.metrics.get("evicted").n != 1 {
		t.Fatal("the referenced circuit was evicted, or the eviction not counted")
	}
	_ = b
	c.fail(a, 2)
	if c.e.EvictIdle() {
		t.Fatal("an open circuit was evicted")
	}
	if err := c.e.CheckSets(); err != nil {
		t.Fatal(err)
	}
}

// An override kept for a circuit comes back when an engine on the same
// maps makes the circuit again: its forced-open verdict is written with
// an id; forgetting it clears the kept map.
func TestKeptOverrideComesBack(t *testing.T) {
	c := newCore(t, 8, nil)
	x := c.circuit(9451, options())
	c.e.EnsureID(x)
	c.e.Apply(x, x.Machine.Override(c.clk.Now(), policy.ForceOpen))
	c.e.KeepOverride(x, policy.ForceOpen)
	if v := c.verdict(dest(9451)); v.State != maps.ForcedOpen || v.CircuitID == 0 {
		t.Fatalf("forced open: verdict %+v", v)
	}
	again := newCore(t, 8, c.k)
	y := again.circuit(9451, options())
	if y.Machine.State() != policy.ForcedOpen || y.ID == 0 {
		t.Fatalf("made again: %s, id %d", y.Machine.State(), y.ID)
	}
	again.e.KeepOverride(y, policy.NoOverride)
	for name := range c.k.Overrides() {
		t.Fatalf("forgotten, and %s still kept", name)
	}
}

// Successes the kernel counted arrive as one record of their number: the
// engine records them in one call, in the record's place among the
// circuit's failures (they end a run of consecutive failures).
func TestCountedSuccessesEndAFailureRun(t *testing.T) {
	c := newCore(t, 8, nil)
	x := c.circuit(9461, options())
	c.fail(x, 1)
	if c.record(x, policy.Result{Kind: policy.Success, Duration: time.Millisecond}, 100000) {
		t.Fatal("successes moved the circuit")
	}
	if s := x.Machine.Status(c.clk.Now()); s.ConsecutiveFailures != 0 {
		t.Fatalf("after the successes: %+v", s)
	}
	c.fail(x, 1)
	if x.Machine.State() != policy.Closed {
		t.Fatal("opened on one failure after the successes")
	}
}

// A circuit whose verdict map had room for some of its destinations only
// rejected some traffic: past its open duration it is not closed as
// not_enforced, and its last verdict is written once there is room.
func TestPartlyEnforcedCircuitIsNotClosed(t *testing.T) {
	c := newCore(t, 8, nil)
	c.k.SetMaxVerdicts(1)
	x := c.e.Make("svc", "svc", policy.ServiceScope, options(), policy.NoOverride, nil, dest(9431), c.clk.Now())
	c.e.Attach(x, dest(9431))
	c.e.Attach(x, dest(9432))
	c.fail(x, 2)
	if !c.hasVerdict(dest(9431)) || c.hasVerdict(dest(9432)) || !c.e.Unenforced(x) {
		t.Fatalf("one verdict of room: %v, %v, unenforced %v", c.hasVerdict(dest(9431)), c.hasVerdict(dest(9432)), c.e.Unenforced(x))
	}
	c.clk.Advance(time.Second)
	c.e.RetryUnenforced()
	if x.Machine.State() == policy.Closed {
		t.Fatalf("a partly enforced circuit closed: %+v", c.hooks.transitions)
	}
	c.k.SetMaxVerdicts(0)
	c.e.RetryUnenforced()
	if !c.hasVerdict(dest(9432)) || c.e.Unenforced(x) {
		t.Fatalf("room made: verdict %v, unenforced %v", c.hasVerdict(dest(9432)), c.e.Unenforced(x))
	}
}
