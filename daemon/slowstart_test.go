package daemon

import (
	"math"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// slowStartConfig opens "ramp" after two refusals, probes 300 ms later and,
// when the probe succeeds, ramps new connects up from 0.2 over RAMP.
const slowStartConfig = `
targets:
  ramp:
    match: {cidrs: [SRV], ports: ["8095"]}
    consecutive_failures: 2
    window_size: 1000
    min_requests: 1000
    open_duration: 300ms
    jitter: 0
    slow_start: {duration: RAMP, floor: 0.2}
`

// streamed collects a stream helper's results as they come.
type streamed struct {
	mu  sync.Mutex
	all []kerneltest.DialResult
}

func (s *streamed) collect(st *kerneltest.Stream) {
	for r := range st.Results {
		s.mu.Lock()
		s.all = append(s.all, r)
		s.mu.Unlock()
	}
}

func (s *streamed) results() []kerneltest.DialResult {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]kerneltest.DialResult(nil), s.all...)
}

// last is the start (Unix ns) of the latest result, 0 before any.
func (s *streamed) last() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.all) == 0 {
		return 0
	}
	return s.all[len(s.all)-1].Start
}

// recoverWithRamp opens "ramp" with two refused connects, serves port 8095
// and runs a steady client (a connect every 5 ms) until the circuit has
// recovered: it returns the client's results so far and the ramp verdict
// the daemon wrote.
func (f *fixture) recoverWithRamp(t *testing.T) (*streamed, *kerneltest.Stream, maps.Verdict) {
	t.Helper()
	if got := errnos(f.dial(8095, 2, 0)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("connects to the closed port: %v", got)
	}
	f.waitState("ramp", "open", 2*time.Second)
	f.srv.Serve(t, 8095, func(c *net.TCPConn) { c.Close() })
	st := f.topo.Client.StartStream(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8095), Interval: 5 * time.Millisecond})
	t.Cleanup(func() { st.Close() })
	s := &streamed{}
	go s.collect(st)
	var v maps.Verdict
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		got, ok, err := f.d.Kernel().Verdict(f.dest(8095))
		v = got
		return err == nil && ok && got.State == maps.Ramp
	}) {
		c, _ := f.circuit("ramp")
		t.Fatalf("no ramp after recovery: circuit %+v (logs:\n%s)", c, f.logs.String())
	}
	return s, st, v
}

// A circuit that recovers ramps its new connects up in the kernel: in
// every 100 ms window of the ramp, a steady client's admitted connects
// follow the configured curve, max(0.2, elapsed/2s), to within 3 connects
// (the kernel admits the running sum of the shares to within one; the
// client stamps a connect a few microseconds before the kernel sees it;
// the kernel's 8-point curve is off by at most 0.03 near the floor's
// corner: under one connect of a window's ~20). The others see EAGAIN,
// the overload errno, and are counted apart from the open circuit's
// rejections; none counts as a failure:
// the circuit stays closed with every admitted connect counted as a call
// and no failure. The kernel counts the turned-away connects against the
// client's cgroup under the ramp verdict's id and epoch (the epoch the
// open verdict's rejections are counted under too), and /v1/circuits
// names the cgroup in rejected_by with both counts. /v1/circuits shows
// the ramp while it lasts, and after it every connect is admitted.
func TestSlowStartRampFollowsTheCurve(t *testing.T) {
	const ramp = 2 * time.Second
	f := newFixture(t, strings.ReplaceAll(slowStartConfig, "RAMP", ramp.String()))
	f.start()
	s, st, v := f.recoverWithRamp(t)
	if c, _ := f.circuit("ramp"); c.State != "closed" || c.SlowStart == nil || c.SlowStart.Share < 0.19 || c.SlowStart.Share >= 1 {
		t.Fatalf("during the ramp /v1/circuits shows %s with %+v, want closed and ramping", c.State, c.SlowStart)
	}
	// The kernel's clock (the verdict's) in the client's (Unix ns).
	offset := time.Now().UnixNano() - int64(maps.Now())
	begin := int64(v.Due) + offset
	end := begin + int64(ramp)
	if !kerneltest.WaitFor(ramp+3*time.Second, func() bool { return s.last() > end+int64(300*time.Millisecond) }) {
		t.Fatalf("the client stopped: %d results", len(s.results()))
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	want := policy.SlowStartOptions{Duration: ramp, Floor: 0.2, Aggression: 1}
	const window = int64(100 * time.Millisecond)
	type win struct {
		n, admitted int
		expected    float64
	}
	wins := make([]win, ramp/time.Duration(window))
	successes, rejected, after, refused := 0, 0, 0, 0
	inPlace := false // the ramp's verdict has replaced the half-open one
	for _, r := range s.results() {
		switch r.Errno {
		case 0:
			successes++
		case unix.ECONNREFUSED: // the server listens: the open circuit's
			refused++
		}
		// The verdict's start is read before it is written: on a slow
		// machine the first connects after it may still meet the
		// half-open verdict, whose one probe is spent (ECONNREFUSED).
		if r.Start >= begin && !inPlace && r.Errno == unix.ECONNREFUSED {
			continue
		}
		switch {
		case r.Start < begin:
			continue // rejected while open, or the probe
		case r.Start >= end:
			if r.Errno != 0 {
				t.Fatalf("a connect %v after the ramp: %v", time.Duration(r.Start-end), r.Errno)
			}
			after++
			continue
		}
		inPlace = true
		switch r.Errno {
		case 0:
		case unix.EAGAIN:
			rejected++
		default:
			t.Fatalf("a connect %v into the ramp: %v, want admitted or EAGAIN", time.Duration(r.Start-begin), r.Errno)
		}
		w := &wins[(r.Start-begin)/window]
		w.n++
		w.expected += want.Share(float64(r.Start-begin) / float64(ramp))
		if r.Errno == 0 {
			w.admitted++
		}
	}
	for i, w := range wins {
		t.Logf("window %2d: %2d connects, %2d admitted, %5.1f expected", i, w.n, w.admitted, w.expected)
		if math.Abs(float64(w.admitted)-w.expected) > 3 {
			t.Errorf("window %d (%v into the ramp): %d of %d admitted, want %.1f ± 3", i, time.Duration(int64(i)*window), w.admitted, w.n, w.expected)
		}
	}
	if n := successes + rejected; rejected == 0 || after == 0 || n < 60 {
		t.Fatalf("%d connects turned away during the ramp, %d after it, %d in all: too few to show the ramp", rejected, after, n)
	}
	// Every connect admitted since the close is a call (the probe closed
	// the circuit before them): once the daemon has counted them all, no
	// failure is among them, and the turned-away ones are counted apart.
	calls := successes - 1
	if !kerneltest.WaitFor(3*time.Second, func() bool { c, _ := f.circuit("ramp"); return c.Calls == calls }) {
		c, _ := f.circuit("ramp")
		t.Fatalf("circuit counts %d calls, want the %d connects admitted since it closed", c.Calls, calls)
	}
	c, _ := f.circuit("ramp")
	if c.State != "closed" || c.Failures != 0 || c.SlowStartRejected != uint64(rejected) || c.Rejected != uint64(refused) {
		t.Fatalf("after the ramp: %s, %d failures, %d slow-start rejections (client saw %d), %d open rejections (client saw %d)", c.State, c.Failures, c.SlowStartRejected, rejected, c.Rejected, refused)
	}
	if n := f.counter("breakerd_slow_start_rejections_total", map[string]string{"target": "ramp"}); n != float64(rejected) {
		t.Fatalf("breakerd_slow_start_rejections_total = %v, want %d", n, rejected)
	}
	cgID, err := f.cg.ID()
	if err != nil {
		t.Fatal(err)
	}
	key := maps.RejectionKey{CgroupID: cgID, CircuitID: v.CircuitID, Epoch: v.Epoch}
	wantEntry := maps.Rejection{RejectionKey: key, Rejected: uint64(refused), SlowStartRejected: uint64(rejected)}
	rs, err := f.d.Kernel().Rejections()
	if err != nil || len(rs) != 1 || rs[0] != wantEntry || v.Epoch == 0 {
		t.Fatalf("rejections map %+v (%v), want only %+v", rs, err, wantEntry)
	}
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		c, _ := f.circuit("ramp")
		return c.RejectedByTotal == 1 && len(c.RejectedBy) == 1 && c.RejectedBy[0] == RejectedBy{Cgroup: f.cgroupRel(), Rejected: uint64(refused), SlowStartRejected: uint64(rejected)}
	}) {
		c, _ = f.circuit("ramp")
		t.Fatalf("rejected_by %+v (total %d), want %s with %d open and %d slow-start rejections", c.RejectedBy, c.RejectedByTotal, f.cgroupRel(), refused, rejected)
	}
	if c.SlowStart != nil {
		t.Fatalf("still ramping after the ramp: %+v", c.SlowStart)
	}
	if !kerneltest.WaitFor(3*time.Second, func() bool { _, ok, _ := f.d.Kernel().Verdict(f.dest(8095)); return !ok }) {
		t.Fatal("the finished ramp's verdict was not deleted")
	}
}

// A ramp survives a restart (the SIGTERM path: stop, start on the same
// pins), a refused second start and a reload that changes slow_start: the
// verdict stays as written (same start, length and curve), connects are
// still turned away with EAGAIN after each step, and the ramp ends at its
// own end (the engine's TestSlowStartReloadAppliesFromTheNextClose shows
// the changed slow_start applies from the next close). The client's
// cgroup's slow-start rejections carry on across every step, those made
// while no daemon ran included: rejected_by counts all of them, exactly
// what the circuit's counters count (the only cgroup that connects).
func TestSlowStartRampSurvivesRestartAndReload(t *testing.T) {
	// Every step's check must fall within the ramp: in an emulated guest
	// (seconds a step) it is made longer.
	ramp := 4 * time.Second
	if kerneltest.Emulated() {
		ramp = 12 * time.Second
	}
	f := newFixture(t, strings.ReplaceAll(slowStartConfig, "RAMP", ramp.String()))
	f.start()
	_, st, v := f.recoverWithRamp(t)
	st.Close()
	turnedAway := 0 // by the checks' connects
	check := func(step string) {
		t.Helper()
		got, ok, err := f.d.Kernel().Verdict(f.dest(8095))
		if err != nil || !ok || got != v {
			t.Fatalf("%s: verdict %+v (present %v, %v), want the ramp as written %+v", step, got, ok, err, v)
		}
		// The share is at most 0.2 + 0.8 × (elapsed/ramp) < 1: some of
		// 20 back-to-back connects are turned away.
		n := errnos(f.dial(8095, 20, 0))
		if n[unix.EAGAIN] == 0 || n[0] == 0 || n[0]+n[unix.EAGAIN] != 20 {
			t.Fatalf("%s: 20 connects during the ramp: %v, want some admitted and some EAGAIN", step, n)
		}
		turnedAway += n[unix.EAGAIN]
		if c, _ := f.circuit("ramp"); c.State != "closed" || c.SlowStart == nil {
			t.Fatalf("%s: /v1/circuits shows %s, ramp %+v", step, c.State, c.SlowStart)
		}
	}
	check("before the restart")
	f.stop()
	// No daemon: the pinned programs keep the ramp (the heartbeat is
	// fresh) and count what it turns away.
	gap := errnos(f.dial(8095, 20, 0))
	if gap[unix.EAGAIN] == 0 || gap[0]+gap[unix.EAGAIN] != 20 {
		t.Fatalf("20 connects with the daemon stopped: %v, want some EAGAIN", gap)
	}
	turnedAway += gap[unix.EAGAIN]
	f.start()
	check("after a restart")
	if _, err := New(Options{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs}); err == nil {
		t.Fatal("a second daemon started on the same pins")
	}
	check("after a second start was refused")
	f.writeConfig(strings.ReplaceAll(slowStartConfig, "RAMP", "1s"))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	check("after a reload")
	mono := maps.Now()
	if !kerneltest.WaitFor(ramp+2*time.Second, func() bool { _, ok, _ := f.d.Kernel().Verdict(f.dest(8095)); return !ok }) {
		t.Fatal("the ramp outlived its end")
	}
	if now := maps.Now(); now < v.RampEnd() {
		t.Fatalf("the ramp was deleted %v before its end (waited from %v)", v.RampEnd()-now, mono)
	}
	if got := errnos(f.dial(8095, 20, 0)); got[0] != 20 {
		t.Fatalf("after the ramp: %v, want all admitted", got)
	}
	var c CircuitInfo
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		c, _ = f.circuit("ramp")
		return c.RejectedByTotal == 1 && len(c.RejectedBy) == 1 && c.RejectedBy[0] == RejectedBy{Cgroup: f.cgroupRel(), Rejected: c.Rejected, SlowStartRejected: c.SlowStartRejected}
	}) || c.SlowStartRejected < uint64(turnedAway) {
		t.Fatalf("rejected_by %+v (total %d), want %s with the circuit's %d open and %d slow-start rejections (at least the checks' %d)",
			c.RejectedBy, c.RejectedByTotal, f.cgroupRel(), c.Rejected, c.SlowStartRejected, turnedAway)
	}
}
