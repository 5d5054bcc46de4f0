package engine_test

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/engine/enginetest"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// fed is an engine as the daemon runs it on a configuration, on the fake
// kernel and clock: records are fed to HandleBatch as the reader feeds
// them and the tick is run by hand, so everything a test asserts is
// decided by the time its call returns.
type fed struct {
	*core
	cfg  *policy.Config // the configuration matched with
	next uint64         // the next socket cookie
}

// lazyConfig: dynamic circuits that open on two failures for a second,
// rejecting with EHOSTUNREACH, and take their ids as they open.
const lazyConfig = `
all:
  reject_errno: EHOSTUNREACH
  consecutive_failures: 2
  open_duration: 1s
  jitter: 0
  half_open_probes: 1
`

// srv is the address of the destinations the tests connect to.
var srv = netip.MustParseAddr("192.0.2.10")

// newFed makes an engine on configuration yaml (SRV stands for srv) and
// kernel k (a new one when nil: pass the last one's to restart on the
// same maps), with what the daemon does on a first start: the matching,
// the room in the destination index and the circuits of the targets'
// enumerable destinations.
func newFed(t *testing.T, yaml string, k *enginetest.Kernel) *fed {
	t.Helper()
	cfg, err := policy.Parse([]byte(strings.ReplaceAll(yaml, "SRV", srv.String()+"/32")), false)
	if err != nil {
		t.Fatalf("configuration: %v", err)
	}
	f := &fed{core: newCore(t, maps.MaxCircuitIDs, k), cfg: cfg}
	f.e.SetMatching(engine.Matching{Config: cfg, Classes: cfg.Classes()})
	f.e.Reserve(cfg.MaxCircuits)
	names := make([]string, 0, len(cfg.Targets))
	for name := range cfg.Targets {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		for _, dst := range engine.StaticDests(cfg.Targets[name], nil) {
			if c, _ := f.e.Lookup(dst, f.clk.Now()); c != nil {
				c.Enumerated = true
			}
		}
	}
	return f
}

// reload has the engine follow a new configuration, as the daemon's
// reload does.
func (f *fed) reload(yaml string) policy.Change {
	f.t.Helper()
	cfg, err := policy.Parse([]byte(strings.ReplaceAll(yaml, "SRV", srv.String()+"/32")), false)
	if err != nil {
		f.t.Fatalf("configuration: %v", err)
	}
	old := f.cfg
	f.cfg = cfg
	f.e.SetMatching(engine.Matching{Config: cfg, Classes: cfg.Classes()})
	ch := f.e.Reconfigure(old, f.clk.Now())
	f.e.Rematch(f.clk.Now())
	return ch
}

// feed hands one record to the engine, as the reader does.
func (f *fed) feed(ev maps.Event) {
	f.next++
	if ev.Cookie == 0 {
		ev.Cookie = f.next
	}
	f.e.HandleBatch([]maps.Event{ev}, f.clk.Now())
}

// refused feeds n refused connects to port.
func (f *fed) refused(port uint16, n int) {
	for range n {
		f.feed(maps.Event{Outcome: maps.Refused, Dest: dest(port), Duration: time.Millisecond})
	}
}

// connected feeds n established connects to port.
func (f *fed) connected(port uint16, n int) {
	for range n {
		f.feed(maps.Event{Outcome: maps.Established, Dest: dest(port), Duration: time.Millisecond})
	}
}

// probeRound has the kernel begin the half-open round of port's verdict
// and admit one probe, which connects (ok) or is refused.
func (f *fed) probeRound(port uint16, ok bool) {
	f.t.Helper()
	v := f.verdict(dest(port))
	f.k.SetBudget(v.CircuitID, maps.Budget{Round: v.Round})
	f.feed(maps.Event{Outcome: maps.ProbeRound, Dest: dest(port), Round: v.Round})
	out := maps.Refused
	if ok {
		out = maps.Established
	}
	f.feed(maps.Event{Outcome: out, Dest: dest(port), Duration: time.Millisecond, Probe: true, Round: v.Round})
}

// tick runs the engine's timers once at the clock's time.
func (f *fed) tick() { f.e.Tick(f.clk.Now()) }

// at returns the circuit of port (nil: none).
func (f *fed) at(port uint16) *engine.Circuit {
	c, _ := f.e.At(dest(port))
	return c
}

// status is port's circuit's status at the clock's time.
func (f *fed) status(port uint16) policy.Status {
	f.t.Helper()
	c := f.at(port)
	if c == nil {
		f.t.Fatalf("no circuit for port %d", port)
	}
	return c.Machine.Status(f.clk.Now())
}

func (f *fed) wantState(port uint16, want policy.State) {
	f.t.Helper()
	if got := f.status(port).State; got != want {
		f.t.Fatalf("port %d: %s, want %s (logs:\n%s)", port, got, want, f.logs.String())
	}
}

func (f *fed) unenforced(port uint16) bool { return f.e.Unenforced(f.at(port)) }

// transitions lists name's transitions as from>to:reason.
func (f *fed) transitions(name string) string {
	var out []string
	for i, t := range f.hooks.transitions {
		if f.hooks.circuits[i] == name {
			out = append(out, t.From.String()+">"+t.To.String()+":"+string(t.Reason))
		}
	}
	return strings.Join(out, " ")
}

func dynName(port uint16) string { return engine.DynamicName(dest(port)) }

// With ids scarce, a circuit that opens with none is counted, logged and
// left unenforced (no verdict write is tried); one that closes gives its
// id back and keeps its kernel counts in its target's totals; the
// waiting circuit takes the id at the next tick, within its open
// duration, with a round after the slot's; the other open circuit keeps
// its id and verdict throughout.
func TestRecordsScarceIDsAreGivenBackAndWaitedFor(t *testing.T) {
	f := newFed(t, lazyConfig, nil)
	f.e.IDs().SetLimit(3) // ids 1 and 2; scarce from one held
	for _, p := range []uint16{9411, 9412} {
		f.refused(p, 2)
		f.wantState(p, policy.Open)
		if v := f.verdict(dest(p)); v.State != maps.Open || v.CircuitID == 0 || v.Errno != 113 {
			t.Fatalf("port %d open: verdict %+v, want open with an id, EHOSTUNREACH", p, v)
		}
	}
	c11, c12 := f.at(9411), f.at(9412)
	id11, id12 := c11.ID, c12.ID
	if id11 == id12 {
		t.Fatalf("two open circuits share id %d", id11)
	}

	f.clk.Advance(500 * time.Millisecond)
	puts := f.k.Calls("PutVerdict")
	f.refused(9413, 2)
	f.wantState(9413, policy.Open)
	if c := f.at(9413); c.ID != 0 {
		t.Fatalf("a third open circuit with two ids: id %d", c.ID)
	}
	if f.hasVerdict(dest(9413)) || f.k.Calls("PutVerdict") != puts {
		t.Fatalf("an open circuit with no id: verdict %v, %d verdict writes tried, want none", f.hasVerdict(dest(9413)), f.k.Calls("PutVerdict")-puts)
	}
	if n := f.metrics.get("verdict_write_errors").n; n != 1 {
		t.Fatalf("verdict write errors %v, want 1", n)
	}
	if !strings.Contains(f.logs.String(), "no circuit id free") || !f.unenforced(9413) {
		t.Fatalf("not logged, or not among the unenforced (%v):\n%s", f.unenforced(9413), f.logs.String())
	}

	// 9411 recovers at the end of its open duration: its probe closes it
	// and, ids being scarce, its id goes back; what the kernel counted
	// under it stays in the target's totals.
	f.k.SetCounters(id11, maps.Counters{Rejected: 5})
	f.clk.Advance(500 * time.Millisecond)
	round11 := f.verdict(dest(9411)).Round
	f.probeRound(9411, true)
	f.wantState(9411, policy.Closed)
	if c11.ID != 0 || f.hasVerdict(dest(9411)) {
		t.Fatalf("closed with ids scarce: id %d, verdict %v; want the id given back and no verdict", c11.ID, f.hasVerdict(dest(9411)))
	}
	if r := f.e.Retired(engine.AllTarget).Rejected; r != 5 {
		t.Fatalf("retired rejections of all: %d, want 5", r)
	}

	// 9413 takes the freed id at the tick, and is enforced in rounds
	// after those 9411 used.
	f.tick()
	c13 := f.at(9413)
	if c13.ID != id11 || f.unenforced(9413) {
		t.Fatalf("9413 after an id was freed: id %d (want %d), unenforced %v (logs:\n%s)", c13.ID, id11, f.unenforced(9413), f.logs.String())
	}
	if v := f.verdict(dest(9413)); v.State != maps.Open || v.CircuitID != id11 || v.Round <= round11 {
		t.Fatalf("9413's verdict %+v, want open under id %d in a round after %d", v, id11, round11)
	}
	if n := f.k.Calls("ResetCounters"); n < 3 {
		t.Fatalf("%d counter resets, want one for each id given (3)", n)
	}
	f.wantState(9413, policy.Open)

	// At the end of its own open duration its probe closes it.
	f.clk.Advance(500 * time.Millisecond)
	f.probeRound(9413, true)
	f.wantState(9413, policy.Closed)
	if c13.ID != 0 || f.hasVerdict(dest(9413)) {
		t.Fatalf("9413 closed: id %d, verdict %v", c13.ID, f.hasVerdict(dest(9413)))
	}
	// The other open circuit kept its id and its verdict throughout.
	if v := f.verdict(dest(9412)); c12.ID != id12 || v.CircuitID != id12 {
		t.Fatalf("9412: id %d, verdict %+v, want id %d", c12.ID, v, id12)
	}
}

// An open circuit that found no id for its whole open duration closes as
// not_enforced at the tick (it rejected nothing), and opens again,
// unenforced, on new failures.
func TestRecordsUnenforcedOpenCircuitCloses(t *testing.T) {
	f := newFed(t, lazyConfig, nil)
	f.e.IDs().SetLimit(2) // one id
	f.refused(9421, 2)
	f.refused(9422, 2)
	f.wantState(9422, policy.Open)
	if c := f.at(9422); c.ID != 0 || !f.unenforced(9422) {
		t.Fatalf("9422 with the one id taken: id %d, unenforced %v", c.ID, f.unenforced(9422))
	}
	f.tick() // within its open duration: it waits
	f.wantState(9422, policy.Open)
	f.clk.Advance(time.Second)
	f.tick()
	f.wantState(9422, policy.Closed)
	if got, want := f.transitions(dynName(9422)), "closed>open:consecutive_failures open>closed:not_enforced"; got != want {
		t.Fatalf("9422's transitions %q, want %q", got, want)
	}
	if !strings.Contains(f.logs.String(), "was not enforced through its open duration") {
		t.Fatalf("not logged:\n%s", f.logs.String())
	}
	f.refused(9422, 2)
	f.wantState(9422, policy.Open)
	if !f.unenforced(9422) {
		t.Fatal("reopened with no id free, and not among the unenforced")
	}
	// The one that had the id was enforced all along.
	if v := f.verdict(dest(9421)); v.CircuitID == 0 {
		t.Fatalf("9421's verdict %+v", v)
	}
}

// A target's circuit whose verdict map had room for some of its
// destinations only keeps its open duration and half-open rounds past it
// (it rejected some traffic): the tick does not close it as
// not_enforced, and writes its last verdict once there is room.
func TestRecordsPartlyEnforcedCircuitIsNotClosed(t *testing.T) {
	f := newFed(t, `
targets:
  svc:
    match: {cidrs: [SRV], ports: ["9431-9432"]}
    consecutive_failures: 2
    open_duration: 1s
    jitter: 0
`, nil)
	f.k.SetMaxVerdicts(1)
	f.refused(9431, 2)
	f.wantState(9431, policy.Open)
	if !f.hasVerdict(dest(9431)) || f.hasVerdict(dest(9432)) || !f.unenforced(9431) {
		t.Fatalf("one verdict of room: 9431 %v, 9432 %v, unenforced %v", f.hasVerdict(dest(9431)), f.hasVerdict(dest(9432)), f.unenforced(9431))
	}
	f.clk.Advance(time.Second)
	f.tick()
	if s := f.status(9431).State; s == policy.Closed {
		t.Fatalf("a partly enforced circuit closed: %s", f.transitions("svc"))
	}
	f.k.SetMaxVerdicts(0)
	f.clk.Advance(time.Second) // the retry runs once a second
	f.tick()
	if !f.hasVerdict(dest(9432)) || f.unenforced(9431) {
		t.Fatalf("room made: 9432's verdict %v, unenforced %v", f.hasVerdict(dest(9432)), f.unenforced(9431))
	}
}

// Past max_circuits a new destination evicts the least recently queued
// idle closed dynamic circuit, passing over (and requeueing) one that
// recorded a call since; open circuits are never evicted, and with
// nothing to evict a new destination is refused and counted.
func TestRecordsEvictionGivesSecondChance(t *testing.T) {
	f := newFed(t, `
max_circuits: 2
all:
  consecutive_failures: 2
  open_duration: 1m
`, nil)
	f.connected(9441, 1)
	f.connected(9442, 1)
	f.connected(9441, 1) // referenced since queued: a second chance
	f.connected(9443, 1)
	if f.at(9441) == nil || f.at(9442) != nil || f.at(9443) == nil {
		t.Fatalf("after a third destination: 9441 %v, 9442 %v, 9443 %v; want 9442 evicted", f.at(9441), f.at(9442), f.at(9443))
	}
	if n := f.metrics.get("evicted").n; n != 1 {
		t.Fatalf("evicted %v, want 1", n)
	}
	f.refused(9441, 2)
	f.refused(9443, 2)
	f.wantState(9441, policy.Open)
	f.wantState(9443, policy.Open)
	f.connected(9444, 1)
	if f.at(9444) != nil || f.at(9441) == nil || f.at(9443) == nil {
		t.Fatal("an open circuit was evicted for a new destination")
	}
	if n := f.metrics.get("refused/" + engine.AllTarget).n; n != 1 {
		t.Fatalf("refused %v, want 1", n)
	}
	if n := f.metrics.get("evicted").n; n != 1 {
		t.Fatalf("evicted %v after the refusal, want still 1", n)
	}
	if err := f.e.CheckSets(); err != nil {
		t.Fatal(err)
	}
}

// An override set by hand (Force) is written to the kernel and kept in
// the pinned overrides map; an engine started on the same maps gives it
// back to the circuit when traffic makes it again; release forgets it.
func TestRecordsOverridesSurviveRestart(t *testing.T) {
	const cfg = `
all:
  consecutive_failures: 2
  open_duration: 1m
`
	f := newFed(t, cfg, nil)
	f.connected(9451, 1)
	if _, ok := f.e.Force(f.at(9451), "open", f.clk.Now()); !ok {
		t.Fatal("open refused")
	}
	if v := f.verdict(dest(9451)); v.State != maps.ForcedOpen || v.CircuitID == 0 {
		t.Fatalf("forced open: verdict %+v", v)
	}
	if _, ok := f.e.Force(f.at(9451), "sideways", f.clk.Now()); ok {
		t.Fatal("an unknown action was taken")
	}

	again := newFed(t, cfg, f.k)
	again.connected(9451, 1) // the circuit is made again by traffic
	again.wantState(9451, policy.ForcedOpen)
	if _, ok := again.e.Force(again.at(9451), "release", again.clk.Now()); !ok {
		t.Fatal("release refused")
	}
	again.wantState(9451, policy.Closed)
	if again.hasVerdict(dest(9451)) {
		t.Fatal("released: the forced-open verdict is still in the kernel")
	}
	for name := range f.k.Overrides() {
		t.Fatalf("released: override of %s still kept", name)
	}
	third := newFed(t, cfg, f.k)
	third.connected(9451, 1)
	third.wantState(9451, policy.Closed)
}

// An endpoint-scoped target's circuits, made from its match before any
// traffic, share a group that ejects at most max_ejection_percent of its
// endpoints: the second failing endpoint of three at 34% stays closed,
// kept so by the group, until the first comes back.
func TestRecordsEndpointGroupEjectsOne(t *testing.T) {
	f := newFed(t, `
targets:
  pay:
    match: {cidrs: [SRV], ports: ["8101-8103"]}
    scope: endpoint
    max_ejection_percent: 34
    consecutive_failures: 1
    open_duration: 1m
`, nil)
	for _, p := range []uint16{8101, 8102, 8103} {
		if c := f.at(p); c == nil || !c.Enumerated {
			t.Fatalf("endpoint %d not made from the match", p)
		}
	}
	f.refused(8101, 1)
	f.wantState(8101, policy.Open)
	f.refused(8102, 1)
	f.refused(8103, 1)
	f.wantState(8102, policy.Closed)
	f.wantState(8103, policy.Closed)
	if f.hasVerdict(dest(8102)) || f.hasVerdict(dest(8103)) {
		t.Fatal("a verdict for an endpoint the group kept closed")
	}
	// The first comes back; the next to fail may be ejected.
	f.clk.Advance(time.Minute)
	f.probeRound(8101, true)
	f.wantState(8101, policy.Closed)
	f.refused(8102, 1)
	f.wantState(8102, policy.Open)
}

// A circuit whose ordinary successes the kernel counts gets an answered
// word under a fresh epoch in its limits entry; an Answered record of
// that epoch credits its successes in the record's place among the
// circuit's failures (they end a run of consecutive failures), and one
// of another epoch credits nothing.
func TestRecordsAnsweredCreditsInOrder(t *testing.T) {
	f := newFed(t, `
targets:
  web:
    match: {cidrs: [SRV], ports: ["8090"]}
    protocol: http
    consecutive_failures: 2
    window_size: 100
    min_requests: 100
    open_duration: 4m
`, nil)
	l, ok := f.k.Limits()[dest(8090)]
	if !ok || l.Responses&maps.RespBatch == 0 || l.BatchID == 0 || l.BatchEpoch == 0 {
		t.Fatalf("limits entry %+v (%v), want one counting successes in an answered word", l, ok)
	}
	if epoch, _, _ := f.k.Answered(l.BatchID); epoch != l.BatchEpoch {
		t.Fatalf("answered word's epoch %d, the limits entry's %d", epoch, l.BatchEpoch)
	}
	if n := f.e.Counting(); n != 1 {
		t.Fatalf("%d circuits count their successes in the kernel, want 1", n)
	}
	credit := func(epoch uint32, n int) {
		f.feed(maps.Event{Outcome: maps.Answered, Round: l.BatchID, Count: epoch, Duration: time.Duration(n)})
	}
	f.refused(8090, 1)
	credit(l.BatchEpoch+1, 7) // another epoch: not this circuit's
	credit(l.BatchEpoch, 3)
	if s := f.status(8090); s.Calls != 4 || s.ConsecutiveFailures != 0 {
		t.Fatalf("a failure and 3 credited successes: %+v, want 4 calls and the run of failures ended", s)
	}
	f.refused(8090, 1)
	f.wantState(8090, policy.Closed)
	f.refused(8090, 1)
	f.wantState(8090, policy.Open)
}

// The state machine through the records: the kernel's round record makes
// an open circuit half-open; a failed probe reopens it for a longer trip
// with a new round in its verdict; a probe that never reports is timed
// out by the tick (probe_timeout); a connect seen retransmitting SYNs and
// never finished counts as a failure at connect_timeout, once, and its
// late final record is not counted again.
func TestRecordsStateMachine(t *testing.T) {
	f := newFed(t, `
all:
  consecutive_failures: 2
  open_duration: 1s
  open_duration_multiplier: 2
  jitter: 0
  half_open_probes: 1
  connect_timeout: 1s
  probe_timeout: 2s
`, nil)
	f.refused(9461, 2)
	f.wantState(9461, policy.Open)
	first, trip := f.verdict(dest(9461)), f.status(9461).Trip
	f.clk.Advance(time.Second)
	f.probeRound(9461, false)
	f.wantState(9461, policy.Open)
	if v := f.verdict(dest(9461)); v.Round <= first.Round || f.status(9461).Trip != trip+1 {
		t.Fatalf("reopened: verdict %+v (first %+v), trip %d (first %d)", v, first, f.status(9461).Trip, trip)
	}
	if got := f.status(9461).OpenUntil.Sub(f.clk.Now()); got != 2*time.Second {
		t.Fatalf("second trip open for %v, want 2s", got)
	}
	f.clk.Advance(2 * time.Second)
	v := f.verdict(dest(9461))
	f.k.SetBudget(v.CircuitID, maps.Budget{Round: v.Round})
	f.feed(maps.Event{Outcome: maps.ProbeRound, Dest: dest(9461), Round: v.Round})
	f.wantState(9461, policy.HalfOpen)
	f.clk.Advance(time.Second)
	f.tick()
	f.wantState(9461, policy.HalfOpen) // within probe_timeout
	f.clk.Advance(time.Second)
	f.tick()
	f.wantState(9461, policy.Open)
	if got := f.transitions(dynName(9461)); !strings.HasSuffix(got, "half_open>open:probe_timeout") {
		t.Fatalf("transitions %q, want a probe timeout last", got)
	}

	// connect_timeout: a SYN retransmitted, then nothing.
	f.connected(9462, 1)
	f.feed(maps.Event{Outcome: maps.SYNRetrans, Dest: dest(9462), Cookie: 1 << 40, Duration: 200 * time.Millisecond})
	f.clk.Advance(700 * time.Millisecond)
	f.tick()
	if s := f.status(9462); s.Calls != 1 {
		t.Fatalf("before connect_timeout: %+v", s)
	}
	f.clk.Advance(100 * time.Millisecond)
	f.tick()
	if s := f.status(9462); s.Calls != 2 || s.ConsecutiveFailures != 1 {
		t.Fatalf("at connect_timeout: %+v, want the connect counted as a failure", s)
	}
	if n := f.metrics.get("outcome/connect_timeout/" + engine.AllTarget + "/" + policy.SharedWorkload).n; n != 1 {
		t.Fatalf("connect timeouts counted %v, want 1", n)
	}
	f.feed(maps.Event{Outcome: maps.TimedOut, Dest: dest(9462), Cookie: 1 << 40, Duration: 3 * time.Second})
	f.connected(9462, 1) // a later record: the one before it was handled
	if s := f.status(9462); s.Calls != 3 || s.Failures != 1 {
		t.Fatalf("the late final record counted again: %+v", s)
	}
}

// A reset the kernel could not date is dated by its connection's
// established record: counted when it came within reset_failure_window,
// not when later, and not at all (no circuit made) when no established
// record of its socket was seen.
func TestRecordsResetsDatedByTheirConnection(t *testing.T) {
	f := newFed(t, `
all:
  consecutive_failures: 5
  reset_failure_window: 1s
`, nil)
	f.feed(maps.Event{Outcome: maps.Established, Dest: dest(9491), Cookie: 7, Time: 10 * time.Second})
	f.feed(maps.Event{Outcome: maps.Established, Dest: dest(9491), Cookie: 8, Time: 10 * time.Second})
	f.feed(maps.Event{Outcome: maps.Reset, Dest: dest(9491), Cookie: 7, Time: 10*time.Second + 500*time.Millisecond, NoAge: true})
	f.feed(maps.Event{Outcome: maps.Reset, Dest: dest(9491), Cookie: 8, Time: 15 * time.Second, NoAge: true})
	if s := f.status(9491); s.Calls != 3 || s.ConsecutiveFailures != 1 {
		t.Fatalf("a reset within the window and one after: %+v, want 3 calls (the later reset is none), one failure", s)
	}
	f.feed(maps.Event{Outcome: maps.Reset, Dest: dest(9492), Cookie: 9, Time: 20 * time.Second, NoAge: true})
	f.connected(9491, 1) // a later record: the one before it was handled
	if f.at(9492) != nil {
		t.Fatal("a reset of a socket never seen established made a circuit")
	}
}

// A request awaiting its first response byte past response_timeout is
// counted as failed at the tick, once; its late answer is not counted
// again.
func TestRecordsResponseTimeoutCountedOnce(t *testing.T) {
	f := newFed(t, `
targets:
  web:
    match: {cidrs: [SRV], ports: ["8095"]}
    protocol: http
    response_timeout: 1s
    consecutive_failures: 5
`, nil)
	since := f.clk.Mono() - 2*time.Second // waited longer than response_timeout
	f.k.SetAwaiting([]maps.Awaiting{{Cookie: 42, Dest: dest(8095), Since: since}})
	f.tick()
	f.tick()
	if s := f.status(8095); s.Calls != 1 || s.ConsecutiveFailures != 1 {
		t.Fatalf("after two ticks: %+v, want the request counted once as failed", s)
	}
	f.feed(maps.Event{Outcome: maps.Response, Dest: dest(8095), Cookie: 42, Time: since + 3*time.Second, Duration: 3 * time.Second, HTTP: true, Status: 200})
	f.feed(maps.Event{Outcome: maps.Response, Dest: dest(8095), Cookie: 43, Time: since + 3*time.Second, Duration: time.Millisecond, HTTP: true, Status: 200})
	if s := f.status(8095); s.Calls != 2 || s.ConsecutiveFailures != 0 {
		t.Fatalf("the late answer and another: %+v, want only the other counted", s)
	}
}

// After the kernel lost records, every open circuit whose probe budget
// has reached its round begins that round (its first-probe record may be
// among those lost), so probe_timeout applies to it; one whose budget has
// not is left open.
func TestRecordsLostRoundRecordsAreReconciled(t *testing.T) {
	f := newFed(t, lazyConfig, nil)
	f.refused(9471, 2)
	f.refused(9472, 2)
	f.clk.Advance(time.Second)
	v := f.verdict(dest(9471))
	f.k.SetBudget(v.CircuitID, maps.Budget{Round: v.Round}) // its round began in the kernel
	f.tick()                                                // no records lost yet
	f.wantState(9471, policy.Open)
	stats := f.k.Calls("Stats")
	f.k.LoseEvents(3)
	f.clk.Advance(time.Second)
	f.tick()
	if f.k.Calls("Stats") != stats+1 {
		t.Fatalf("the tick read the kernel's statistics %d times, want once", f.k.Calls("Stats")-stats)
	}
	f.wantState(9471, policy.HalfOpen)
	f.wantState(9472, policy.Open)
}

// A circuit with a bulkhead needs an id for its slot: with none free, a
// new destination gets no circuit (refused and counted) rather than a
// limits entry in slot 0, which would share one count among every such
// destination; once an id is free, its next connect makes the circuit.
func TestRecordsBulkheadNeedsAnID(t *testing.T) {
	f := newFed(t, `
all:
  max_connections: 10
  consecutive_failures: 2
`, nil)
	f.e.IDs().SetLimit(3) // ids 1 and 2
	for _, p := range []uint16{9481, 9482, 9483} {
		f.connected(p, 1)
	}
	limits := f.k.Limits()
	if len(limits) != 2 || f.k.Calls("PutLimit") != 2 {
		t.Fatalf("limits %v after %d writes, want two", limits, f.k.Calls("PutLimit"))
	}
	for _, p := range []uint16{9481, 9482} {
		if l := limits[dest(p)]; l.Slot == 0 || l.Slot != f.at(p).ID || l.MaxConnections != 10 {
			t.Fatalf("port %d: limits %+v, circuit id %d", p, l, f.at(p).ID)
		}
	}
	if f.at(9483) != nil {
		t.Fatal("a circuit with a bulkhead and no id")
	}
	if n := f.metrics.get("refused/" + engine.AllTarget).n; n != 1 {
		t.Fatalf("refused %v, want 1", n)
	}
	f.e.IDs().SetLimit(4) // id 3 comes free
	f.connected(9483, 1)
	if c := f.at(9483); c == nil || c.ID != 3 || f.k.Limits()[dest(9483)].Slot != 3 {
		t.Fatalf("9483 once id 3 is free: %v, limits %+v", c, f.k.Limits()[dest(9483)])
	}
}

// An endpoint seen only in traffic leaves its group once closed and idle
// for EndpointIdle (the tick's sweep, every tenth of it), while one
// enumerated from the target's match stays, idle or not.
func TestRecordsIdleEndpointLeavesItsGroup(t *testing.T) {
	f := newFed(t, `
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
	f.connected(8500, 1)
	if f.at(8500) == nil || f.at(9001) == nil {
		t.Fatal("no endpoint circuits")
	}
	count := func(group string) int { n, _ := f.e.Group(group).Counts(); return n }
	if count("wide") != 1 || count("pinned") != 1 {
		t.Fatalf("endpoints: wide %d, pinned %d, want 1 each", count("wide"), count("pinned"))
	}
	f.clk.Advance(engine.EndpointIdle - time.Second)
	f.tick() // a sweep: the first tick's
	if f.at(8500) == nil {
		t.Fatal("the endpoint left before EndpointIdle")
	}
	// The next sweep runs a tenth of EndpointIdle later.
	f.clk.Advance(engine.EndpointIdle/10 - time.Millisecond)
	f.tick()
	if f.at(8500) == nil {
		t.Fatal("swept before a tenth of EndpointIdle had passed")
	}
	f.clk.Advance(time.Millisecond)
	f.tick()
	if f.at(8500) != nil || count("wide") != 0 {
		t.Fatalf("idle endpoint stayed: circuit %v, %d in its group", f.at(8500), count("wide"))
	}
	if f.at(9001) == nil || count("pinned") != 1 {
		t.Fatal("an enumerated endpoint left its group")
	}
}

// A dynamic circuit is one allocation of at most 192 bytes (the
// footprint goal is ≤ 300 bytes per dynamic circuit, its index slot
// included).
func TestCircuitSize(t *testing.T) {
	if s := unsafe.Sizeof(engine.Circuit{}); s > 192 {
		t.Fatalf("a circuit takes %d bytes, more than 192", s)
	}
}

// HandleBatch, which looks circuits up ahead of handling records (with
// many circuits), ends exactly where handling the records one by one
// does, also when records in a chunk make circuits that evict ones looked
// up earlier in it.
func TestHandleBatchMatchesOneByOne(t *testing.T) {
	const n = 8192 // the circuits from which HandleBatch looks ahead
	cfg := "max_circuits: " + strconv.Itoa(n) + "\nall:\n  consecutive_failures: 3\n  open_duration: 4m\n  reset_failure_window: 1s\n"
	var evs []maps.Event
	cookie := uint64(1)
	ev := func(i int, o maps.Outcome) {
		evs = append(evs, maps.Event{Dest: scattered(i), Outcome: o, Duration: time.Millisecond, Cookie: cookie, Time: time.Duration(cookie) * time.Microsecond})
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
				evs = append(evs, maps.Event{Dest: scattered(j), Outcome: maps.Reset, NoAge: true, Cookie: uint64(j + 1), Time: time.Duration(cookie) * time.Microsecond})
				cookie++
			}
		}
	}
	type summary struct {
		state                              policy.State
		calls, failures, consecutive, trip int
	}
	run := func(batched bool) map[string]summary {
		f := newFed(t, cfg, nil)
		now := f.clk.Now()
		if batched {
			for rest := evs; len(rest) > 0; {
				k := min(len(rest), 2048) // the daemon's read batch
				f.e.HandleBatch(rest[:k], now)
				rest = rest[k:]
			}
		} else {
			for i := range evs {
				f.e.HandleBatch(evs[i:i+1], now)
			}
		}
		if err := f.e.CheckSets(); err != nil {
			t.Fatal(err)
		}
		out := map[string]summary{}
		for c := range f.e.All() {
			s := c.Machine.Status(now)
			out[c.Name()] = summary{s.State, s.Calls, s.Failures, s.ConsecutiveFailures, s.Trip}
		}
		return out
	}
	one, batched := run(false), run(true)
	if len(one) != n || len(batched) != len(one) {
		t.Fatalf("%d circuits one by one, %d batched, want %d", len(one), len(batched), n)
	}
	open, failed := 0, 0
	for name, c := range one {
		if b := batched[name]; b != c {
			t.Fatalf("%s: one by one %+v, batched %+v", name, c, b)
		}
		if c.state == policy.Open {
			open++
		}
		failed += c.failures
	}
	if open == 0 || failed == 0 {
		t.Fatal("no circuit opened, or none failed: the records test nothing")
	}
}

// scattered is the i-th of many dynamic destinations.
func scattered(i int) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, byte(i >> 16), byte(i >> 8)}), uint16(1+i&0xff))}
}
