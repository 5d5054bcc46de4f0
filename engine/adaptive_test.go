package engine_test

import (
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

const adaptiveConfig = `
targets:
  pool:
    match: {cidrs: [SRV], ports: ["9600"]}
    max_connections: {adaptive: vegas, min: 2, initial: 20, max: 40}
`

// limitNow is the max_connections the kernel's limits entry of port
// holds.
func (f *fed) limitNow(port uint16) int {
	f.t.Helper()
	l, ok := f.k.Limits()[dest(port)]
	if !ok {
		f.t.Fatalf("port %d has no limits entry", port)
	}
	return int(l.MaxConnections)
}

// tickWith runs one tick of 100 ms in which the destination at port
// handshakes policy.LimitWindow connects in rtt each, with its bulkhead
// full (as many sockets as the kernel's limit), and returns the limit the
// kernel holds after it.
func (f *fed) tickWith(port uint16, rtt time.Duration) int {
	f.t.Helper()
	c := f.at(port)
	f.k.SetBulkCount(c.ID, maps.BulkCount{Connections: int64(f.limitNow(port))})
	for range policy.LimitWindow {
		f.feed(maps.Event{Outcome: maps.Established, Dest: dest(port), Duration: rtt})
	}
	f.clk.Advance(100 * time.Millisecond)
	f.tick()
	return f.limitNow(port)
}

// A target whose handshakes slow down as its limit rises (a server that
// takes k at a time: n sockets, n/k × base) has its kernel limit driven
// down within a few ticks, held within its bounds, and brought back up
// once its handshakes are fast again; it moves at most once a tick, and
// each move is counted.
func TestAdaptiveLimitFollowsHandshakes(t *testing.T) {
	f := newFed(t, adaptiveConfig, nil)
	const port, base, k = 9600, 10 * time.Millisecond, 4
	if got := f.limitNow(port); got != 20 {
		t.Fatalf("starts at %d, want initial 20", got)
	}
	for range 3 {
		f.tickWith(port, base) // the no-load latency
	}
	queued := func() time.Duration { return max(base, base*time.Duration(f.limitNow(port))/k) }
	ticks, limit := 0, f.limitNow(port)
	for ; ticks < 30 && limit > 10; ticks++ {
		limit = f.tickWith(port, queued())
	}
	if limit > 10 {
		t.Fatalf("latency rising with the limit for %d ticks left it at %d", ticks, limit)
	}
	t.Logf("down to %d in %d ticks", limit, ticks)
	for range 50 {
		if l := f.tickWith(port, queued()); l < 2 || l > 40 {
			t.Fatalf("limit %d outside [2, 40]", l)
		}
	}
	low := f.limitNow(port)
	ticks = 0
	for ; ticks < 30 && f.limitNow(port) < 40; ticks++ {
		f.tickWith(port, base)
	}
	if f.limitNow(port) != 40 {
		t.Fatalf("handshakes back to %v for %d ticks took the limit from %d to %d, want the max 40", base, ticks, low, f.limitNow(port))
	}
	c := f.at(port)
	al := c.AdaptiveLimits()
	moves := f.metrics.get("limit_changes/pool/" + engine.KindConnections).n
	if len(al) != 1 || al[0].Limit != 40 || al[0].Changes == 0 || float64(al[0].Changes) != moves || al[0].Latency != base {
		t.Fatalf("adaptive limits %+v, %v moves counted", al, moves)
	}
	// 3 + ≤30 + 50 + ≤30 ticks: never more than one move each.
	if al[0].Changes > 113 {
		t.Fatalf("%d moves in at most 113 ticks", al[0].Changes)
	}
}

// A window is LimitWindow samples: fewer, and several ticks, move nothing;
// a full window moves the limit once however many samples it holds.
func TestAdaptiveLimitMovesOncePerTick(t *testing.T) {
	f := newFed(t, adaptiveConfig, nil)
	const port = 9600
	c := f.at(port)
	f.k.SetBulkCount(c.ID, maps.BulkCount{Connections: 20})
	puts := f.k.Calls("PutLimit")
	for range 5 {
		f.feed(maps.Event{Outcome: maps.Established, Dest: dest(port), Duration: 10 * time.Millisecond})
		f.clk.Advance(100 * time.Millisecond)
		f.tick()
	}
	if f.k.Calls("PutLimit") != puts {
		t.Fatal("moved on fewer samples than a window")
	}
	for range policy.LimitWindow - 5 { // the window Vegas takes its no-load latency from
		f.feed(maps.Event{Outcome: maps.Established, Dest: dest(port), Duration: 10 * time.Millisecond})
	}
	f.tick()
	for range 3 * policy.LimitWindow {
		f.feed(maps.Event{Outcome: maps.Established, Dest: dest(port), Duration: 10 * time.Millisecond})
	}
	f.clk.Advance(100 * time.Millisecond)
	f.tick()
	if got := f.limitNow(port); got != 26 || f.k.Calls("PutLimit")-puts != 1 {
		t.Fatalf("limit %d after %d writes, want one move to 26 (20 + 6)", got, f.k.Calls("PutLimit")-puts)
	}
}

const adaptiveHTTPConfig = `
targets:
  web:
    match: {cidrs: [SRV], ports: ["9601"]}
    protocol: http
    max_connections: {adaptive: aimd, min: 2, initial: 20, max: 40}
`

// On a target that follows responses, the limit is fed responses: an
// overload status (503) is a drop; refusals (4xx), connects refused and
// handshakes say nothing of capacity and move nothing. Its responses are
// recorded one by one (no batch in the limits entry).
func TestAdaptiveLimitFeedsOnlyWhatShowsCapacity(t *testing.T) {
	f := newFed(t, adaptiveHTTPConfig, nil)
	const port = 9601
	c := f.at(port)
	f.k.SetBulkCount(c.ID, maps.BulkCount{Connections: 20})
	if l := f.k.Limits()[dest(port)]; l.Responses&maps.RespBatch != 0 {
		t.Fatalf("limits entry %+v: batched", l)
	}
	start := f.clk.Mono()
	response := func(status uint16) maps.Event {
		return maps.Event{Outcome: maps.Response, Dest: dest(port), HTTP: true, Status: status, Time: start + time.Second, Duration: 5 * time.Millisecond}
	}
	f.clk.Advance(2 * time.Second)
	for range 5 * policy.LimitWindow {
		f.feed(response(404))
		f.feed(response(500))
		f.feed(maps.Event{Outcome: maps.Established, Dest: dest(port), Duration: time.Second})
	}
	f.refused(port, 20)
	f.tick()
	if got := f.limitNow(port); got != 20 || c.AdaptiveLimits()[0].Changes != 0 {
		t.Fatalf("4xx, other 5xx, handshakes and refusals moved the limit to %d", got)
	}
	for range policy.LimitWindow {
		f.feed(response(503))
	}
	f.clk.Advance(100 * time.Millisecond)
	f.tick()
	if got := f.limitNow(port); got != 18 {
		t.Fatalf("a window of 503s: limit %d, want 18 (20 × 0.9)", got)
	}
	for range policy.LimitWindow {
		f.feed(response(200))
	}
	f.clk.Advance(100 * time.Millisecond)
	f.tick()
	if got := f.limitNow(port); got != 19 {
		t.Fatalf("a window of 200s: limit %d, want 19", got)
	}
}

// A restarted engine resumes from the limit the pinned entry holds (not
// initial), clamped into the bounds; a reload keeps the limit, clamped
// into the new ones.
func TestAdaptiveLimitAcrossRestartAndReload(t *testing.T) {
	f := newFed(t, adaptiveConfig, nil)
	const port = 9600
	for range 3 {
		f.tickWith(port, 10*time.Millisecond)
	}
	for i := 0; i < 30 && f.limitNow(port) > 8; i++ {
		f.tickWith(port, 200*time.Millisecond)
	}
	held := f.limitNow(port)
	if held > 8 {
		t.Fatalf("slow handshakes left the limit at %d", held)
	}

	k := f.k
	cfg, err := policy.Parse([]byte(strings.ReplaceAll(adaptiveConfig, "SRV", srv.String()+"/32")), false)
	if err != nil {
		t.Fatal(err)
	}
	g := &fed{core: newCore(t, maps.MaxCircuitIDs, k)}
	g.e.SetPinnedLimits(k.Limits())
	g.e.SetMatching(engine.Matching{Config: cfg, Classes: cfg.Classes()})
	for _, dst := range engine.StaticDests(cfg.Targets["pool"], nil) {
		g.e.Lookup(dst, g.clk.Now())
	}
	g.e.SetPinnedLimits(nil)
	if got := g.limitNow(port); got != held {
		t.Fatalf("after a restart: %d, want the %d the kernel held", got, held)
	}
	if al := g.at(port).AdaptiveLimits(); len(al) != 1 || al[0].Limit != held {
		t.Fatalf("after a restart: %+v", al)
	}

	// A reload raising min above the limit clamps it.
	next := cfg.Targets["pool"].Options
	next.AdaptiveConnections.Min = held + 3
	g.at(port).Machine.SetOptions(&next, g.clk.Now())
	g.e.WriteLimit(g.at(port), dest(port))
	if got := g.limitNow(port); got != held+3 {
		t.Fatalf("after a reload with min %d: %d", held+3, got)
	}
	// A limit made static takes the static value.
	static := cfg.Targets["pool"].Options
	static.AdaptiveConnections, static.MaxConnections = policy.Adaptive{}, 30
	g.at(port).Machine.SetOptions(&static, g.clk.Now())
	g.e.WriteLimit(g.at(port), dest(port))
	if got := g.limitNow(port); got != 30 || g.at(port).AdaptiveLimits() != nil {
		t.Fatalf("made static: %d, %+v", got, g.at(port).AdaptiveLimits())
	}
}

const criticalityAdaptiveConfig = `
workloads:
  - {name: web, cgroups: [web], criticality: critical}
  - {name: batch, cgroups: [batch], criticality: sheddable, share: 0.25}
  - {name: other, cgroups: [other]}
targets:
  pool:
    match: {cidrs: [SRV], ports: ["9602"]}
    max_connections: {adaptive: aimd, min: 4, initial: 20, max: 40}
`

// The workloads with a criticality share one slot, the critical one under
// the whole limit and the sheddable one under its share; a workload
// without one keeps a slot of its own. As the adaptive limit moves, the
// share follows it.
func TestCriticalityPoolFollowsTheAdaptiveLimit(t *testing.T) {
	f := newFed(t, criticalityAdaptiveConfig, nil)
	const port = 9602
	cfg, _ := policy.Parse([]byte(strings.ReplaceAll(criticalityAdaptiveConfig, "SRV", srv.String()+"/32")), false)
	cl := cfg.Classes()
	entry := func(w string) maps.Limit {
		d := dest(port)
		d.Class = uint8(cl.Bulkhead(w))
		l, ok := f.k.Limits()[d]
		if !ok {
			t.Fatalf("no limits entry for %s", w)
		}
		return l
	}
	web, batch, other := entry("web"), entry("batch"), entry("other")
	if web.Slot != batch.Slot || other.Slot == web.Slot || web.Slot == 0 {
		t.Fatalf("slots: web %d, batch %d, other %d: want web and batch in one, other apart", web.Slot, batch.Slot, other.Slot)
	}
	if web.MaxConnections != 20 || batch.MaxConnections != 5 || other.MaxConnections != 20 {
		t.Fatalf("limits: web %d, batch %d, other %d; want 20, 5 (a quarter), 20", web.MaxConnections, batch.MaxConnections, other.MaxConnections)
	}
	if slots := f.at(port).BulkSlots(); len(slots) != 2 {
		t.Fatalf("bulk slots %+v, want the pool's and other's, each once", slots)
	}
	// A window of drops: AIMD takes a tenth off (20 → 18); a quarter of it.
	f.k.SetBulkCount(web.Slot, maps.BulkCount{Connections: 18})
	for range policy.LimitWindow {
		f.feed(maps.Event{Outcome: maps.TimedOut, Dest: dest(port)})
	}
	f.clk.Advance(100 * time.Millisecond)
	f.tick()
	if w, b := entry("web").MaxConnections, entry("batch").MaxConnections; w != 18 || b != 4 {
		t.Fatalf("after a move to 18: web %d, batch %d; want 18 and 4", w, b)
	}
}
