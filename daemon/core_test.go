package daemon

import (
	"bytes"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/engine/enginetest"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// core is a daemon's event-to-verdict core on a fake kernel and a fake
// clock: no root, no maps, no goroutines. A test feeds it records as the
// reader would and runs its tick by hand, so everything it asserts is
// decided by the time the call returns.
type core struct {
	t    *testing.T
	d    *Daemon
	k    *enginetest.Kernel
	clk  *enginetest.Clock
	logs *syncBuffer
	next uint64 // the next socket cookie
}

// syncBuffer is a bytes.Buffer for a logger.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// coreAddr is the address of the destinations the tests connect to.
var coreAddr = netip.MustParseAddr("192.0.2.10")

// newCore makes the core of a daemon started with configuration yaml
// (SRV stands for coreAddr) on kernel k (a new one when nil: pass the
// last core's to restart on the same maps).
func newCore(t *testing.T, yaml string, k *enginetest.Kernel) *core {
	t.Helper()
	cfg, err := policy.Parse([]byte(strings.ReplaceAll(yaml, "SRV", coreAddr.String()+"/32")), false)
	if err != nil {
		t.Fatalf("configuration: %v", err)
	}
	if k == nil {
		k = enginetest.NewKernel()
	}
	e := &core{t: t, k: k, clk: enginetest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)), logs: &syncBuffer{}}
	d := &Daemon{
		log: slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})), rand: func() float64 { return 0.5 },
		kernel: k, clock: e.clk,
		resolved: map[string][]netip.Addr{}, services: map[string][]policy.ServiceDest{},
		closeJobs: make(chan closeJob, closeQueue),
	}
	d.metrics = newMetrics(d)
	d.newEngine(0)
	d.eng.LoadKept()
	// What applyConfig does on a first start, without the cgroup watch,
	// the closer and the response programs (orchestration, not the core).
	d.cfg = cfg
	d.eng.Reserve(cfg.MaxCircuits)
	d.classes = cfg.Classes()
	d.rematch()
	e.d = d
	return e
}

func coreDest(port uint16) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(coreAddr, port)}
}

// record feeds one record to the core, as the reader does.
func (e *core) record(ev maps.Event) {
	e.next++
	if ev.Cookie == 0 {
		ev.Cookie = e.next
	}
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	e.d.eng.HandleBatch([]maps.Event{ev}, e.d.now())
}

// fail records n refused connects to port.
func (e *core) fail(port uint16, n int) {
	for range n {
		e.record(maps.Event{Outcome: maps.Refused, Dest: coreDest(port), Duration: time.Millisecond})
	}
}

// ok records n established connects to port.
func (e *core) ok(port uint16, n int) {
	for range n {
		e.record(maps.Event{Outcome: maps.Established, Dest: coreDest(port), Duration: time.Millisecond})
	}
}

// probe has the kernel begin the half-open round of port's verdict and
// admit one probe, which connects (ok) or is refused.
func (e *core) probe(port uint16, ok bool) {
	e.t.Helper()
	v := e.verdict(port)
	e.k.SetBudget(v.CircuitID, maps.Budget{Round: v.Round})
	e.record(maps.Event{Outcome: maps.ProbeRound, Dest: coreDest(port), Round: v.Round})
	out := maps.Refused
	if ok {
		out = maps.Established
	}
	e.record(maps.Event{Outcome: out, Dest: coreDest(port), Duration: time.Millisecond, Probe: true, Round: v.Round})
}

// tick runs the daemon's timers once at the clock's time.
func (e *core) tick() {
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	e.d.tick(e.d.now())
}

// at returns the circuit of port (nil: none).
func (e *core) at(port uint16) *circuit {
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	c, _ := e.d.eng.At(coreDest(port))
	return c
}

// state is the state of port's circuit.
func (e *core) state(port uint16) policy.State {
	e.t.Helper()
	c := e.at(port)
	if c == nil {
		e.t.Fatalf("no circuit for port %d", port)
	}
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	return c.Machine.State()
}

func (e *core) wantState(port uint16, want policy.State) {
	e.t.Helper()
	if got := e.state(port); got != want {
		e.t.Fatalf("port %d: %s, want %s (logs:\n%s)", port, got, want, e.logs.String())
	}
}

// verdict is port's verdict in the fake kernel; the test fails without one.
func (e *core) verdict(port uint16) maps.Verdict {
	e.t.Helper()
	v, ok := e.k.Verdicts()[coreDest(port)]
	if !ok {
		e.t.Fatalf("port %d has no verdict", port)
	}
	return v
}

func (e *core) hasVerdict(port uint16) bool {
	_, ok := e.k.Verdicts()[coreDest(port)]
	return ok
}

func (e *core) unenforced(port uint16) bool {
	c := e.at(port)
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	return e.d.eng.Unenforced(c)
}

// transitions lists name's events as from>to:reason.
func (e *core) transitions(name string) string {
	var out []string
	for _, ev := range e.d.Events() {
		if ev.Circuit == name {
			out = append(out, ev.From+">"+ev.To+":"+ev.Reason)
		}
	}
	return strings.Join(out, " ")
}

func coreName(port uint16) string { return engine.DynamicName(coreDest(port)) }

// The core's twin of TestScarceIDsAreGivenBackAndWaitedFor, on the fake
// clock: with ids scarce, a circuit that opens with none is counted,
// logged and left unenforced (no verdict write is tried); one that
// closes gives its id back and keeps its kernel counts in its target's
// totals; the waiting circuit takes the id at the next tick, within its
// open duration, with a round after the slot's; the other open circuit
// keeps its id and verdict throughout.
func TestCoreScarceIDsAreGivenBackAndWaitedFor(t *testing.T) {
	e := newCore(t, lazyConfig, nil)
	e.d.eng.IDs().SetLimit(3) // ids 1 and 2; scarce from one held
	for _, p := range []uint16{9411, 9412} {
		e.fail(p, 2)
		e.wantState(p, policy.Open)
		if v := e.verdict(p); v.State != maps.Open || v.CircuitID == 0 || v.Errno != 113 {
			t.Fatalf("port %d open: verdict %+v, want open with an id, EHOSTUNREACH", p, v)
		}
	}
	c11, c12 := e.at(9411), e.at(9412)
	id11, id12 := c11.ID, c12.ID
	if id11 == id12 {
		t.Fatalf("two open circuits share id %d", id11)
	}

	e.clk.Advance(500 * time.Millisecond)
	errsBefore := testutil.ToFloat64(e.d.metrics.verdictWriteErrors)
	puts := e.k.Calls("PutVerdict")
	e.fail(9413, 2)
	e.wantState(9413, policy.Open)
	if c := e.at(9413); c.ID != 0 {
		t.Fatalf("a third open circuit with two ids: id %d", c.ID)
	}
	if e.hasVerdict(9413) || e.k.Calls("PutVerdict") != puts {
		t.Fatalf("an open circuit with no id: verdict %v, %d verdict writes tried, want none", e.hasVerdict(9413), e.k.Calls("PutVerdict")-puts)
	}
	if n := testutil.ToFloat64(e.d.metrics.verdictWriteErrors); n != errsBefore+1 {
		t.Fatalf("verdict write errors %v, want %v", n, errsBefore+1)
	}
	if !strings.Contains(e.logs.String(), "no circuit id free") || !e.unenforced(9413) {
		t.Fatalf("not logged, or not among the unenforced (%v):\n%s", e.unenforced(9413), e.logs.String())
	}

	// 9411 recovers at the end of its open duration: its probe closes it
	// and, ids being scarce, its id goes back; what the kernel counted
	// under it stays in the target's totals.
	e.k.SetCounters(id11, maps.Counters{Rejected: 5})
	e.clk.Advance(500 * time.Millisecond)
	round11 := e.verdict(9411).Round
	e.probe(9411, true)
	e.wantState(9411, policy.Closed)
	if c11.ID != 0 || e.hasVerdict(9411) {
		t.Fatalf("closed with ids scarce: id %d, verdict %v; want the id given back and no verdict", c11.ID, e.hasVerdict(9411))
	}
	if r := e.d.eng.Retired(allTarget).Rejected; r != 5 {
		t.Fatalf("retired rejections of all: %d, want 5", r)
	}

	// 9413 takes the freed id at the tick, and is enforced in rounds
	// after those 9411 used.
	e.tick()
	c13 := e.at(9413)
	if c13.ID != id11 || e.unenforced(9413) {
		t.Fatalf("9413 after an id was freed: id %d (want %d), unenforced %v (logs:\n%s)", c13.ID, id11, e.unenforced(9413), e.logs.String())
	}
	if v := e.verdict(9413); v.State != maps.Open || v.CircuitID != id11 || v.Round <= round11 {
		t.Fatalf("9413's verdict %+v, want open under id %d in a round after %d", v, id11, round11)
	}
	if n := e.k.Calls("ResetCounters"); n < 3 {
		t.Fatalf("%d counter resets, want one for each id given (3)", n)
	}
	e.wantState(9413, policy.Open)

	// At the end of its own open duration its probe closes it.
	e.clk.Advance(500 * time.Millisecond)
	e.probe(9413, true)
	e.wantState(9413, policy.Closed)
	if c13.ID != 0 || e.hasVerdict(9413) {
		t.Fatalf("9413 closed: id %d, verdict %v", c13.ID, e.hasVerdict(9413))
	}
	// The other open circuit kept its id and its verdict throughout.
	if v := e.verdict(9412); c12.ID != id12 || v.CircuitID != id12 {
		t.Fatalf("9412: id %d, verdict %+v, want id %d", c12.ID, v, id12)
	}
}

// The core's twin of TestUnenforcedOpenCircuitCloses: an open circuit
// that found no id for its whole open duration closes as not_enforced at
// the tick (it rejected nothing), and opens again, unenforced, on new
// failures.
func TestCoreUnenforcedOpenCircuitCloses(t *testing.T) {
	e := newCore(t, lazyConfig, nil)
	e.d.eng.IDs().SetLimit(2) // one id
	e.fail(9421, 2)
	e.fail(9422, 2)
	e.wantState(9422, policy.Open)
	if c := e.at(9422); c.ID != 0 || !e.unenforced(9422) {
		t.Fatalf("9422 with the one id taken: id %d, unenforced %v", c.ID, e.unenforced(9422))
	}
	e.tick() // within its open duration: it waits
	e.wantState(9422, policy.Open)
	e.clk.Advance(time.Second)
	e.tick()
	e.wantState(9422, policy.Closed)
	if got, want := e.transitions(coreName(9422)), "closed>open:consecutive_failures open>closed:not_enforced"; got != want {
		t.Fatalf("9422's transitions %q, want %q", got, want)
	}
	if !strings.Contains(e.logs.String(), "was not enforced through its open duration") {
		t.Fatalf("not logged:\n%s", e.logs.String())
	}
	e.fail(9422, 2)
	e.wantState(9422, policy.Open)
	if !e.unenforced(9422) {
		t.Fatal("reopened with no id free, and not among the unenforced")
	}
	// The one that had the id was enforced all along.
	if v := e.verdict(9421); v.CircuitID == 0 {
		t.Fatalf("9421's verdict %+v", v)
	}
}

// A circuit whose verdict map had room for some of its destinations only
// keeps its open duration and half-open rounds past it (it rejected some
// traffic): it is not closed as not_enforced, and its last verdict is
// written once there is room.
func TestCorePartlyEnforcedCircuitIsNotClosed(t *testing.T) {
	e := newCore(t, `
targets:
  svc:
    match: {cidrs: [SRV], ports: ["9431-9432"]}
    consecutive_failures: 2
    open_duration: 1s
    jitter: 0
`, nil)
	e.k.SetMaxVerdicts(1)
	e.fail(9431, 2)
	e.wantState(9431, policy.Open)
	if !e.hasVerdict(9431) || e.hasVerdict(9432) || !e.unenforced(9431) {
		t.Fatalf("one verdict of room: 9431 %v, 9432 %v, unenforced %v", e.hasVerdict(9431), e.hasVerdict(9432), e.unenforced(9431))
	}
	e.clk.Advance(time.Second)
	e.tick()
	if s := e.state(9431); s == policy.Closed {
		t.Fatalf("a partly enforced circuit closed: %s", e.transitions("svc"))
	}
	e.k.SetMaxVerdicts(0)
	e.clk.Advance(time.Second) // the retry runs once a second
	e.tick()
	if !e.hasVerdict(9432) || e.unenforced(9431) {
		t.Fatalf("room made: 9432's verdict %v, unenforced %v", e.hasVerdict(9432), e.unenforced(9431))
	}
}

// Past max_circuits a new destination evicts the least recently queued
// idle closed dynamic circuit, passing over (and requeueing) one that
// recorded a call since; open circuits are never evicted, and with
// nothing to evict a new destination is refused and counted.
func TestCoreEvictionGivesSecondChance(t *testing.T) {
	e := newCore(t, `
max_circuits: 2
all:
  consecutive_failures: 2
  open_duration: 1m
`, nil)
	e.ok(9441, 1)
	e.ok(9442, 1)
	e.ok(9441, 1) // referenced since queued: a second chance
	e.ok(9443, 1)
	if e.at(9441) == nil || e.at(9442) != nil || e.at(9443) == nil {
		t.Fatalf("after a third destination: 9441 %v, 9442 %v, 9443 %v; want 9442 evicted", e.at(9441), e.at(9442), e.at(9443))
	}
	if n := testutil.ToFloat64(e.d.metrics.circuitsEvicted); n != 1 {
		t.Fatalf("evicted %v, want 1", n)
	}
	e.fail(9441, 2)
	e.fail(9443, 2)
	e.wantState(9441, policy.Open)
	e.wantState(9443, policy.Open)
	e.ok(9444, 1)
	if e.at(9444) != nil || e.at(9441) == nil || e.at(9443) == nil {
		t.Fatal("an open circuit was evicted for a new destination")
	}
	if n := testutil.ToFloat64(e.d.metrics.circuitsRefused.WithLabelValues(allTarget)); n != 1 {
		t.Fatalf("refused %v, want 1", n)
	}
	if n := testutil.ToFloat64(e.d.metrics.circuitsEvicted); n != 1 {
		t.Fatalf("evicted %v after the refusal, want still 1", n)
	}
}

// An override set through the API is written to the kernel and kept in
// the pinned overrides map; a daemon started on the same maps gives it
// back to the circuit when it is made again; release forgets it.
func TestCoreOverridesSurviveRestart(t *testing.T) {
	const cfg = `
all:
  consecutive_failures: 2
  open_duration: 1m
`
	e := newCore(t, cfg, nil)
	e.ok(9451, 1)
	if _, err := e.d.Force(coreName(9451), "open"); err != nil {
		t.Fatal(err)
	}
	if v := e.verdict(9451); v.State != maps.ForcedOpen || v.CircuitID == 0 {
		t.Fatalf("forced open: verdict %+v", v)
	}
	if _, err := e.d.Force(coreName(9451), "sideways"); err == nil {
		t.Fatal("an unknown action was taken")
	}

	again := newCore(t, cfg, e.k)
	again.ok(9451, 1) // the circuit is made again by traffic
	again.wantState(9451, policy.ForcedOpen)
	if _, err := again.d.Force(coreName(9451), "release"); err != nil {
		t.Fatal(err)
	}
	again.wantState(9451, policy.Closed)
	if again.hasVerdict(9451) {
		t.Fatal("released: the forced-open verdict is still in the kernel")
	}
	for name := range e.k.Overrides() {
		t.Fatalf("released: override of %s still kept", name)
	}
	third := newCore(t, cfg, e.k)
	third.ok(9451, 1)
	third.wantState(9451, policy.Closed)
}

// An endpoint-scoped target's circuits share a group that ejects at most
// max_ejection_percent of its endpoints: the second failing endpoint of
// three at 34% stays closed, kept so by the group.
func TestCoreEndpointGroupEjectsOne(t *testing.T) {
	e := newCore(t, `
targets:
  pay:
    match: {cidrs: [SRV], ports: ["8101-8103"]}
    scope: endpoint
    max_ejection_percent: 34
    consecutive_failures: 1
    open_duration: 1m
`, nil)
	for _, p := range []uint16{8101, 8102, 8103} {
		if c := e.at(p); c == nil || !c.Enumerated {
			t.Fatalf("endpoint %d not made from the match", p)
		}
	}
	e.fail(8101, 1)
	e.wantState(8101, policy.Open)
	e.fail(8102, 1)
	e.fail(8103, 1)
	e.wantState(8102, policy.Closed)
	e.wantState(8103, policy.Closed)
	if e.hasVerdict(8102) || e.hasVerdict(8103) {
		t.Fatal("a verdict for an endpoint the group kept closed")
	}
	// The first comes back; the next to fail may be ejected.
	e.clk.Advance(time.Minute)
	e.probe(8101, true)
	e.wantState(8101, policy.Closed)
	e.fail(8102, 1)
	e.wantState(8102, policy.Open)
}

// status is port's circuit's status at the clock's time.
func (e *core) status(port uint16) policy.Status {
	e.t.Helper()
	c := e.at(port)
	if c == nil {
		e.t.Fatalf("no circuit for port %d", port)
	}
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	return c.Machine.Status(e.d.now())
}

// A circuit whose ordinary successes the kernel counts gets an answered
// word under a fresh epoch in its limits entry; an Answered record of
// that epoch credits its successes in the record's place among the
// circuit's failures (they end a run of consecutive failures), and one
// of another epoch credits nothing.
func TestCoreAnsweredCreditsInOrder(t *testing.T) {
	e := newCore(t, `
targets:
  web:
    match: {cidrs: [SRV], ports: ["8090"]}
    protocol: http
    consecutive_failures: 2
    window_size: 100
    min_requests: 100
    open_duration: 4m
`, nil)
	l, ok := e.k.Limits()[coreDest(8090)]
	if !ok || l.Responses&maps.RespBatch == 0 || l.BatchID == 0 || l.BatchEpoch == 0 {
		t.Fatalf("limits entry %+v (%v), want one counting successes in an answered word", l, ok)
	}
	if epoch, _, _ := e.k.Answered(l.BatchID); epoch != l.BatchEpoch {
		t.Fatalf("answered word's epoch %d, the limits entry's %d", epoch, l.BatchEpoch)
	}
	credit := func(epoch uint32, n int) {
		e.record(maps.Event{Outcome: maps.Answered, Round: l.BatchID, Count: epoch, Duration: time.Duration(n)})
	}
	e.fail(8090, 1)
	credit(l.BatchEpoch+1, 7) // another epoch: not this circuit's
	credit(l.BatchEpoch, 3)
	if s := e.status(8090); s.Calls != 4 || s.ConsecutiveFailures != 0 {
		t.Fatalf("a failure and 3 credited successes: %+v, want 4 calls and the run of failures ended", s)
	}
	e.fail(8090, 1)
	e.wantState(8090, policy.Closed)
	e.fail(8090, 1)
	e.wantState(8090, policy.Open)
}

// The state machine through the core: the kernel's round record makes an
// open circuit half-open; a failed probe reopens it for a longer trip
// with a new round in its verdict; a probe that never reports is timed
// out by the tick (probe_timeout); a connect seen retransmitting SYNs and
// never finished counts as a failure at connect_timeout, once, and its
// late final record is not counted again.
func TestCoreStateMachineThroughTheCore(t *testing.T) {
	e := newCore(t, `
all:
  consecutive_failures: 2
  open_duration: 1s
  open_duration_multiplier: 2
  jitter: 0
  half_open_probes: 1
  connect_timeout: 1s
  probe_timeout: 2s
`, nil)
	e.fail(9461, 2)
	e.wantState(9461, policy.Open)
	first, trip := e.verdict(9461), e.status(9461).Trip
	e.clk.Advance(time.Second)
	e.probe(9461, false)
	e.wantState(9461, policy.Open)
	if v := e.verdict(9461); v.Round <= first.Round || e.status(9461).Trip != trip+1 {
		t.Fatalf("reopened: verdict %+v (first %+v), trip %d (first %d)", v, first, e.status(9461).Trip, trip)
	}
	if got := e.status(9461).OpenUntil.Sub(e.clk.Now()); got != 2*time.Second {
		t.Fatalf("second trip open for %v, want 2s", got)
	}
	e.clk.Advance(2 * time.Second)
	v := e.verdict(9461)
	e.k.SetBudget(v.CircuitID, maps.Budget{Round: v.Round})
	e.record(maps.Event{Outcome: maps.ProbeRound, Dest: coreDest(9461), Round: v.Round})
	e.wantState(9461, policy.HalfOpen)
	e.clk.Advance(time.Second)
	e.tick()
	e.wantState(9461, policy.HalfOpen) // within probe_timeout
	e.clk.Advance(time.Second)
	e.tick()
	e.wantState(9461, policy.Open)
	if got := e.transitions(coreName(9461)); !strings.HasSuffix(got, "half_open>open:probe_timeout") {
		t.Fatalf("transitions %q, want a probe timeout last", got)
	}

	// connect_timeout: a SYN retransmitted, then nothing.
	e.ok(9462, 1)
	e.record(maps.Event{Outcome: maps.SYNRetrans, Dest: coreDest(9462), Cookie: 1 << 40, Duration: 200 * time.Millisecond})
	e.clk.Advance(700 * time.Millisecond)
	e.tick()
	if s := e.status(9462); s.Calls != 1 {
		t.Fatalf("before connect_timeout: %+v", s)
	}
	e.clk.Advance(100 * time.Millisecond)
	e.tick()
	if s := e.status(9462); s.Calls != 2 || s.ConsecutiveFailures != 1 {
		t.Fatalf("at connect_timeout: %+v, want the connect counted as a failure", s)
	}
	e.record(maps.Event{Outcome: maps.TimedOut, Dest: coreDest(9462), Cookie: 1 << 40, Duration: 3 * time.Second})
	e.ok(9462, 1) // a later record: the one before it was handled
	if s := e.status(9462); s.Calls != 3 || s.Failures != 1 {
		t.Fatalf("the late final record counted again: %+v", s)
	}
}

// After the kernel lost records, every open circuit whose probe budget
// has reached its round begins that round (its first-probe record may be
// among those lost), so probe_timeout applies to it; one whose budget has
// not is left open.
func TestCoreLostRoundRecordsAreReconciled(t *testing.T) {
	e := newCore(t, lazyConfig, nil)
	e.fail(9471, 2)
	e.fail(9472, 2)
	e.clk.Advance(time.Second)
	v := e.verdict(9471)
	e.k.SetBudget(v.CircuitID, maps.Budget{Round: v.Round}) // its round began in the kernel
	e.tick()                                                // no records lost yet
	e.wantState(9471, policy.Open)
	stats := e.k.Calls("Stats")
	e.k.LoseEvents(3)
	e.clk.Advance(time.Second)
	e.tick()
	if e.k.Calls("Stats") != stats+1 {
		t.Fatalf("the tick read the kernel's statistics %d times, want once", e.k.Calls("Stats")-stats)
	}
	e.wantState(9471, policy.HalfOpen)
	e.wantState(9472, policy.Open)
}

// A circuit with a bulkhead needs an id for its slot: with none free, a
// new destination gets no circuit (refused and counted) rather than a
// limits entry in slot 0, which would share one count among every such
// destination; once an id is free, its next connect makes the circuit.
func TestCoreBulkheadNeedsAnID(t *testing.T) {
	e := newCore(t, `
all:
  max_connections: 10
  consecutive_failures: 2
`, nil)
	e.d.eng.IDs().SetLimit(3) // ids 1 and 2
	for _, p := range []uint16{9481, 9482, 9483} {
		e.ok(p, 1)
	}
	limits := e.k.Limits()
	if len(limits) != 2 || e.k.Calls("PutLimit") != 2 {
		t.Fatalf("limits %v after %d writes, want two", limits, e.k.Calls("PutLimit"))
	}
	for _, p := range []uint16{9481, 9482} {
		if l := limits[coreDest(p)]; l.Slot == 0 || l.Slot != e.at(p).ID || l.MaxConnections != 10 {
			t.Fatalf("port %d: limits %+v, circuit id %d", p, l, e.at(p).ID)
		}
	}
	if e.at(9483) != nil {
		t.Fatal("a circuit with a bulkhead and no id")
	}
	if n := testutil.ToFloat64(e.d.metrics.circuitsRefused.WithLabelValues(allTarget)); n != 1 {
		t.Fatalf("refused %v, want 1", n)
	}
	e.d.eng.IDs().SetLimit(4) // id 3 comes free
	e.ok(9483, 1)
	if c := e.at(9483); c == nil || c.ID != 3 || e.k.Limits()[coreDest(9483)].Slot != 3 {
		t.Fatalf("9483 once id 3 is free: %v, limits %+v", c, e.k.Limits()[coreDest(9483)])
	}
}

// An endpoint seen only in traffic leaves its group once closed and idle
// for endpointIdle (the tick's sweep, every tenth of it), while one
// enumerated from the target's match stays, idle or not.
func TestCoreIdleEndpointLeavesItsGroup(t *testing.T) {
	e := newCore(t, `
targets:
  wide:
    match: {cidrs: [SRV], ports: ["8000-9000"]}
    scope: endpoint
    consecutive_failures: 2
  pinned:
    match: {cidrs: [SRV], ports: ["9001"]}
    scope: endpoint
    consecutive_failures: 2
`, nil)
	e.ok(8500, 1)
	if e.at(8500) == nil || e.at(9001) == nil {
		t.Fatal("no endpoint circuits")
	}
	count := func(group string) int { n, _ := e.d.eng.Group(group).Counts(); return n }
	if count("wide") != 1 || count("pinned") != 1 {
		t.Fatalf("endpoints: wide %d, pinned %d, want 1 each", count("wide"), count("pinned"))
	}
	e.clk.Advance(engine.EndpointIdle - time.Second)
	e.tick()
	if e.at(8500) == nil {
		t.Fatal("the endpoint left before EndpointIdle")
	}
	// The sweep runs every tenth of endpointIdle.
	e.clk.Advance(engine.EndpointIdle / 10)
	e.tick()
	if e.at(8500) != nil || count("wide") != 0 {
		t.Fatalf("idle endpoint stayed: circuit %v, %d in its group", e.at(8500), count("wide"))
	}
	if e.at(9001) == nil || count("pinned") != 1 {
		t.Fatal("an enumerated endpoint left its group")
	}
}

// A fleet block anywhere (all, or one target) is what the daemon warns
// of at start and reload: this version validates it and acts on nothing.
func TestFleetBlocksAreSeen(t *testing.T) {
	for _, c := range []struct {
		yaml string
		want bool
	}{
		{"all: {consecutive_failures: 2}\n", false},
		{"all: {fleet: {}}\n", true},
		{"targets:\n  web:\n    match: {cidrs: [198.18.0.2/32], ports: [\"80\"]}\n    fleet: {quorum: 3}\n", true},
		{"targets:\n  web:\n    match: {cidrs: [198.18.0.2/32], ports: [\"80\"]}\n", false},
	} {
		cfg, err := policy.Parse([]byte(c.yaml), false)
		if err != nil {
			t.Fatalf("%q: %v", c.yaml, err)
		}
		if got := fleetBlocks(cfg); got != c.want {
			t.Errorf("%q: fleetBlocks %v, want %v", c.yaml, got, c.want)
		}
	}
}
