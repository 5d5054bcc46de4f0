package daemon

import (
	"fmt"
	"net/netip"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

const closeConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8601"]}
    close_established: true
    consecutive_failures: 3
    open_duration: 1m
    connect_timeout: 1s
  plain:
    match: {cidrs: [SRV], ports: ["8602"]}
    consecutive_failures: 3
    open_duration: 1m
`

// closeMechanism returns the mechanism the daemon uses, failing the test
// when a target asks for close_established and it has none while CI asks
// for every kernel test to run.
func closeMechanism(t *testing.T, d *Daemon) maps.CloseMechanism {
	t.Helper()
	d.hold()
	defer d.release()
	if d.closer == nil {
		t.Fatal("a target asks for close_established, but the daemon made no closer")
	}
	m := d.closer.Mechanism()
	t.Logf("close mechanism %s (%s)", m, d.closer.Reason())
	return m
}

// needCloseMechanism skips the test when the daemon has no way to close
// established connections on this kernel, and fails it in CI.
func needCloseMechanism(t *testing.T, d *Daemon) {
	t.Helper()
	if closeMechanism(t, d) == maps.CloseNone {
		if kerneltest.InCI() {
			t.Fatal("no close mechanism on this kernel")
		}
		t.Skip("no close mechanism on this kernel")
	}
}

// ports returns the local ports of "ok:STATUS:PORT" results (0 for others).
func ports(round []string) []int {
	out := make([]int, len(round))
	for i, r := range round {
		if f := strings.Split(r, ":"); len(f) == 3 && f[0] == "ok" {
			out[i], _ = strconv.Atoi(f[2])
		}
	}
	return out
}

func allOK(round []string) bool {
	return !slices.ContainsFunc(round, func(s string) bool { return !strings.HasPrefix(s, "ok:200:") })
}

// An http.client keep-alive pool against a close_established target: when
// the circuit is forced open its established connections are closed (the
// next request on each fails, the reconnect is rejected in connect());
// after release the pool works again on new connections. A pool to
// another target without the option keeps its connections, and so do a
// pool in a sibling cgroup outside the attach point and a pool to the
// same server on another port. Then the circuit opens by failures (new
// connects refused by the server) and closes the pool's connections
// again; the log line, the event and the metric say how many.
// It runs with the best mechanism of the kernel, and with the sock_diag
// fallback only.
func TestCloseEstablishedPoolForcedAndTripped(t *testing.T) {
	t.Run("best", func(t *testing.T) { testPoolForcedAndTripped(t, nil) })
	t.Run("sock_diag", func(t *testing.T) { testPoolForcedAndTripped(t, []maps.CloseMechanism{maps.CloseSockDiag}) })
}

func testPoolForcedAndTripped(t *testing.T, mechs []maps.CloseMechanism) {
	f := newFixture(t, closeConfig)
	f.closeMechs = mechs
	served := f.srv.ServeHTTP(t, 8601)
	f.srv.ServeHTTP(t, 8602)
	f.srv.ServeHold(t, 8603)
	d := f.start()
	needCloseMechanism(t, d)
	web := netip.AddrPortFrom(f.srv.IPv4, 8601)
	pool := f.topo.Client.StartHTTPPool(t, f.cg, web, 4)
	plain := f.topo.Client.StartHTTPPool(t, f.cg, netip.AddrPortFrom(f.srv.IPv4, 8602), 2)
	outside := f.topo.Client.StartPool(t, kerneltest.NewCgroup(t), []kerneltest.PoolTarget{{Addr: web, N: 2}}, 0)
	otherPort := f.topo.Client.StartPool(t, f.cg, []kerneltest.PoolTarget{{Addr: netip.AddrPortFrom(f.srv.IPv4, 8603), N: 2}}, 0)

	first := pool.Round(t)
	plainFirst := plain.Round(t)
	if !allOK(first) || !allOK(plainFirst) {
		t.Fatalf("before: %v %v", first, plainFirst)
	}
	if r := pool.Round(t); !slices.Equal(ports(r), ports(first)) {
		t.Fatalf("the pool does not reuse its connections: %v then %v", first, r)
	}

	if _, err := d.Force("web", "open"); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Force("plain", "open"); err != nil {
		t.Fatal(err)
	}
	waitLog(t, f, 1, "closed established connections", "circuit=web", "closed=4")
	before := served.Load()
	r := pool.Round(t)
	for _, s := range r {
		if strings.HasPrefix(s, "ok") || s == "TimeoutError" || s == "EAGAIN" {
			t.Fatalf("a request on a connection of the open circuit: %v (want each connection closed)", r)
		}
	}
	if r := pool.Round(t); !slices.Equal(r, []string{"ECONNREFUSED", "ECONNREFUSED", "ECONNREFUSED", "ECONNREFUSED"}) {
		t.Fatalf("reconnects to the open circuit: %v, want each rejected in connect()", r)
	}
	if n := served.Load() - before; n != 0 {
		t.Fatalf("%d requests reached the server of the open circuit", n)
	}
	if r := plain.Round(t); !slices.Equal(ports(r), ports(plainFirst)) || !allOK(r) {
		t.Fatalf("the pool of a target without close_established: %v, want its connections kept (%v)", r, plainFirst)
	}
	if got := outside.Check(t); !slices.Equal(got, []string{"open", "open"}) {
		t.Fatalf("a sibling cgroup's connections to the same destination: %v, want open", got)
	}
	if got := otherPort.Check(t); !slices.Equal(got, []string{"open", "open"}) {
		t.Fatalf("connections to another port of the same server: %v, want open", got)
	}
	if c, _ := f.d.Circuit("web"); c.ClosedEstablished != 4 || c.CloseMechanism == "" || c.Options["close_established"] != true {
		t.Fatalf("circuit web: closed %d, mechanism %q, options %v", c.ClosedEstablished, c.CloseMechanism, c.Options)
	}
	if c, _ := f.d.Circuit("plain"); c.ClosedEstablished != 0 || c.CloseMechanism != "" {
		t.Fatalf("circuit plain: closed %d, mechanism %q", c.ClosedEstablished, c.CloseMechanism)
	}
	if ev := lastEvent(f.d, "web"); ev.ClosedEstablished != 4 {
		t.Fatalf("the forced open's event says %d closed, want 4", ev.ClosedEstablished)
	}

	// Released (closed): the pool works again, on new connections.
	if _, err := d.Force("web", "release"); err != nil {
		t.Fatal(err)
	}
	f.waitState("web", "closed", time.Second)
	again := pool.Round(t)
	if !allOK(again) {
		t.Fatalf("after recovery: %v", again)
	}
	for i, p := range ports(again) {
		if p == ports(first)[i] {
			t.Fatalf("connection %d reused its old local port %d", i, p)
		}
	}

	// Tripped by failures: the server refuses new connections while the
	// pool's established ones go on; three refused connects open the
	// circuit, and the pool's connections are closed.
	f.srv.RefuseNewConnections(t, 8601)
	if got := errnos(f.dial(8601, 3, 0)); got[0] != 0 {
		t.Fatalf("refused connects: %v", got)
	}
	f.waitState("web", "open", 2*time.Second)
	waitLog(t, f, 2, "closed established connections", "circuit=web", "closed=4")
	before = served.Load()
	for _, s := range pool.Round(t) {
		if strings.HasPrefix(s, "ok") {
			t.Fatalf("a request got through on a connection of the tripped circuit")
		}
	}
	if n := served.Load() - before; n != 0 {
		t.Fatalf("%d requests reached the server of the tripped circuit", n)
	}
	if c, _ := f.d.Circuit("web"); c.ClosedEstablished != 8 {
		t.Fatalf("circuit web closed %d in all, want 8", c.ClosedEstablished)
	}
	if ev := lastEvent(f.d, "web"); ev.To != "open" || ev.ClosedEstablished != 4 {
		t.Fatalf("the trip's event %+v, want to=open with 4 closed", ev)
	}
	if got := testutil.ToFloat64(f.d.metrics.closed.WithLabelValues("web", "shared", "closed")); got != 8 {
		t.Fatalf("breakerd_established_closed_total{target=web,result=closed} %v, want 8", got)
	}
	if got := testutil.ToFloat64(f.d.metrics.closed.WithLabelValues("web", "shared", "failed")); got != 0 {
		t.Fatalf("failures to close: %v", got)
	}
	if got := outside.Check(t); !slices.Equal(got, []string{"open", "open"}) {
		t.Fatalf("the sibling cgroup's connections after the trip: %v", got)
	}
}

// A close job names the destinations its circuit had when it opened; one
// that has moved to another circuit since (a reload, a Service's
// endpoints) is not closed with it: a healthy circuit's connections stay.
func TestCloseJobSkipsDestinationsThatMoved(t *testing.T) {
	f := newFixture(t, closeConfig)
	f.srv.ServeHTTP(t, 8601)
	f.srv.ServeHTTP(t, 8602)
	d := f.start()
	needCloseMechanism(t, d)
	web := maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(f.srv.IPv4, 8601)}
	plain := maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(f.srv.IPv4, 8602)}
	pool := f.topo.Client.StartHTTPPool(t, f.cg, plain.Addr, 2)
	first := pool.Round(t)
	if !allOK(first) {
		t.Fatalf("before: %v", first)
	}
	if _, err := d.Force("web", "open"); err != nil {
		t.Fatal(err)
	}
	waitLog(t, f, 1, "closed established connections", "circuit=web", "closed=0")

	// web's job, as if plain's destination had been web's when it opened.
	d.hold()
	job := closeJob{circuit: "web", target: "web", workload: "shared", dests: []maps.Dest{web, plain}, workloads: closeWorkloads(d.cfg), at: time.Now()}
	d.release()
	d.runClose([]closeJob{job})
	waitLog(t, f, 2, "closed established connections", "circuit=web", "closed=0")
	if r := pool.Round(t); !slices.Equal(ports(r), ports(first)) || !allOK(r) {
		t.Fatalf("the pool of the healthy circuit: %v, want its connections kept (%v)", r, first)
	}
}

// waitLog waits for the n-th log line containing every part.
func waitLog(t *testing.T, f *fixture, n int, parts ...string) {
	t.Helper()
	ok := kerneltest.WaitFor(10*time.Second, func() bool {
		seen := 0
		for _, l := range strings.Split(f.logs.String(), "\n") {
			if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(l, p) }) {
				seen++
			}
		}
		return seen >= n
	})
	if !ok {
		t.Fatalf("no log line with %q:\n%s", parts, f.logs.String())
	}
}

func lastEvent(d *Daemon, circuit string) TransitionEvent {
	evs := d.Events()
	for i := len(evs) - 1; i >= 0; i-- {
		if evs[i].Circuit == circuit {
			return evs[i]
		}
	}
	return TransitionEvent{}
}

// curl fetching several URLs over one keep-alive connection and wrk's
// keep-alive connections, unmodified: once the circuit is forced open, the
// connection in use is closed, every later request fails in connect(),
// and no request reaches the server.
func TestCloseEstablishedCurlAndWrk(t *testing.T) {
	for _, tool := range []string{"curl", "wrk"} {
		if _, err := exec.LookPath(tool); err != nil {
			if kerneltest.Emulated() {
				t.Skipf("%s is not in vmtest's VM (TestCloseEstablishedPoolForcedAndTripped runs there; the host run covers %s)", tool, tool)
			}
			t.Fatalf("%s is needed (scripts/setup installs it): %v", tool, err)
		}
	}
	f := newFixture(t, closeConfig)
	served := f.srv.ServeHTTP(t, 8601)
	d := f.start()
	needCloseMechanism(t, d)
	base := fmt.Sprintf("http://%s:8601", f.srv.IPv4)

	// curl: six URLs, each answered after 400 ms, on one connection; the
	// circuit opens during the third.
	args := []string{"-s", "-w", "%{http_code} %{num_connects} %{errormsg}\\n"}
	for range 6 {
		args = append(args, "-o", "/dev/null", base+"/slow?ms=400")
	}
	cmd := f.topo.Client.Command(f.cg, "curl", args...)
	go func() {
		time.Sleep(1000 * time.Millisecond)
		if _, err := d.Force("web", "open"); err != nil {
			t.Error(err)
		}
	}()
	out, _ := cmd.Run(t)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	t.Logf("curl:\n%s", out)
	if len(lines) != 6 || !strings.HasPrefix(lines[0], "200 1") || !strings.HasPrefix(lines[1], "200 0") {
		t.Fatalf("curl: %q, want the first two transfers on one connection", lines)
	}
	failed := 0
	for _, l := range lines[2:] {
		if strings.HasPrefix(l, "200") {
			continue
		}
		failed++
	}
	if failed < 3 || !strings.Contains(lines[5], "onnect") {
		t.Fatalf("curl after the circuit opened: %q, want the last transfers failed in connect", lines[2:])
	}
	servedByCurl := served.Load()
	if servedByCurl > 3 {
		t.Fatalf("the server answered %d of curl's requests, want at most 3 (one in flight when the circuit opened)", servedByCurl)
	}

	// wrk: 4 keep-alive connections for 3 s; the circuit is closed until
	// they carry requests, then forced open.
	if _, err := d.Force("web", "release"); err != nil {
		t.Fatal(err)
	}
	f.waitState("web", "closed", time.Second)
	var atOpen atomic.Int64
	passes := strings.Count(f.logs.String(), "closed established connections")
	go func() {
		// Forced open once wrk's four connections carry requests (wrk
		// connects them all before its first request).
		start := served.Load()
		if !kerneltest.WaitFor(10*time.Second, func() bool { return served.Load() >= start+40 }) {
			t.Error("wrk's requests did not reach the server")
			return
		}
		if _, err := d.Force("web", "open"); err != nil {
			t.Error(err)
			return
		}
		if kerneltest.WaitFor(2*time.Second, func() bool {
			return strings.Count(f.logs.String(), "closed established connections") > passes
		}) {
			// Requests in flight when the pass ran may still be counted
			// for a moment; from then on nothing may arrive.
			time.Sleep(300 * time.Millisecond)
			atOpen.Store(served.Load())
		}
	}()
	wrk := f.topo.Client.Command(f.cg, "wrk", "-t1", "-c4", "-d3s", base+"/")
	out, err := wrk.Run(t)
	t.Logf("wrk:\n%s", out)
	if err != nil {
		t.Fatalf("wrk: %v", err)
	}
	if atOpen.Load() == 0 {
		t.Fatal("the circuit was not open (or its pass not done) while wrk ran")
	}
	if !strings.Contains(f.logs.String(), "closed=4") {
		t.Fatalf("the pass did not close wrk's 4 connections:\n%s", grepLines(f.logs.String(), "closed established"))
	}
	if n := served.Load() - atOpen.Load(); n != 0 {
		t.Fatalf("%d requests reached the server after the pass closed wrk's connections", n)
	}
	m := regexp.MustCompile(`Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)`).FindStringSubmatch(string(out))
	if m == nil {
		t.Fatalf("wrk reported no socket errors; its connections were not closed")
	}
	if connect, _ := strconv.Atoi(m[1]); connect == 0 {
		t.Fatalf("wrk saw no failed connect after its connections were closed: %s", m[0])
	}
}

const closeWorkloadsConfig = `
failsafe_timeout: 30s
workloads:
  - name: shop
    cgroups: [CGROUP/shop]
  - name: tenant
    cgroups: [CGROUP/tenant]
    isolate: true
targets:
  web:
    match: {cidrs: [SRV], ports: ["8611"]}
    close_established: true
    open_duration: 1m
`

// With workloads: an isolated workload's circuit closes only that
// workload's connections; the shared circuit closes the sharing
// workload's, never an isolated workload's nor those of a cgroup of no
// workload below the attach point.
func TestCloseEstablishedWorkloads(t *testing.T) {
	f := newScopedFixture(t, closeWorkloadsConfig)
	shop, tenant, none := f.cg.Child(t, "shop"), f.cg.Child(t, "tenant"), f.cg.Child(t, "none")
	f.srv.ServeHold(t, 8611)
	d := f.start()
	needCloseMechanism(t, d)
	web := []kerneltest.PoolTarget{{Addr: netip.AddrPortFrom(f.srv.IPv4, 8611), N: 2}}
	ps := f.topo.Client.StartPool(t, shop, web, 0)
	pt := f.topo.Client.StartPool(t, tenant, web, 0)
	pn := f.topo.Client.StartPool(t, none, web, 0)
	open, closed := []string{"open", "open"}, []string{"ECONNABORTED", "ECONNABORTED"}

	if _, err := d.Force("web@tenant", "open"); err != nil {
		t.Fatal(err)
	}
	waitLog(t, f, 1, "closed established connections", "circuit=web@tenant", "workload=tenant", "closed=2")
	if got := pt.Check(t); !slices.Equal(got, closed) {
		t.Fatalf("the isolated workload's pool after its circuit opened: %v", got)
	}
	if got := ps.Check(t); !slices.Equal(got, open) {
		t.Fatalf("the sharing workload's pool after the isolated circuit opened: %v", got)
	}

	if _, err := d.Force("web", "open"); err != nil {
		t.Fatal(err)
	}
	waitLog(t, f, 1, "closed established connections", "circuit=web ", "workload=shared", "closed=2")
	if got := ps.Check(t); !slices.Equal(got, closed) {
		t.Fatalf("the sharing workload's pool after the shared circuit opened: %v", got)
	}
	if got := pn.Check(t); !slices.Equal(got, open) {
		t.Fatalf("a cgroup of no workload (not protected): %v, want its connections open", got)
	}
	if got := testutil.ToFloat64(f.d.metrics.closed.WithLabelValues("web", "tenant", "closed")); got != 2 {
		t.Fatalf("closed for the isolated workload: %v, want 2", got)
	}
}

const closeProbeConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8621"]}
    close_established: true
    consecutive_failures: 3
    open_duration: 300ms
    jitter: 0
    half_open_probes: 2
    half_open_success_threshold: 2
    connect_timeout: 1s
    probe_timeout: 5s
    reject_errno: EHOSTUNREACH
  sentinel:
    match: {cidrs: [SRV], ports: ["8629"]}
    close_established: true
`

// A half-open circuit's probes are not closed while it is half-open; when
// a failed probe reopens it, the probe that got through is closed.
func TestCloseEstablishedProbes(t *testing.T) {
	f := newFixture(t, closeProbeConfig)
	d := f.start()
	needCloseMechanism(t, d)
	if got := errnos(f.dial(8621, 3, 0)); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("refused connects: %v", got)
	}
	f.waitState("web", "open", 2*time.Second)
	waitLog(t, f, 1, "closed established connections", "circuit=web", "closed=0")

	// The server is back; once due, the first probe gets through and
	// stays connected: one success of two, still half-open.
	f.srv.ServeHold(t, 8621)
	time.Sleep(400 * time.Millisecond)
	probe := f.topo.Client.StartPool(t, f.cg, []kerneltest.PoolTarget{{Addr: netip.AddrPortFrom(f.srv.IPv4, 8621), N: 1}}, 0)
	f.waitState("web", "half_open", 2*time.Second)
	// Passes run in the order they were queued: once a later one (another
	// circuit forced open) is done, one the half-open step queued would be.
	if _, err := d.Force("sentinel", "open"); err != nil {
		t.Fatal(err)
	}
	waitLog(t, f, 1, "closed established connections", "circuit=sentinel")
	if got := probe.Check(t); !slices.Equal(got, []string{"open"}) {
		t.Fatalf("the half-open circuit's probe: %v, want it left open", got)
	}
	if n := strings.Count(f.logs.String(), "closed established connections"); n != 2 {
		t.Fatalf("%d close passes, want only the first opening's and the sentinel's", n)
	}

	// The second probe is refused: the circuit reopens, and the first
	// probe's connection is closed.
	f.srv.RefuseNewConnections(t, 8621)
	if got := errnos(f.dial(8621, 1, 0)); got[unix.ECONNREFUSED] != 1 {
		t.Fatalf("second probe: %v, want admitted and refused by the server", got)
	}
	f.waitState("web", "open", 2*time.Second)
	waitLog(t, f, 1, "closed established connections", "circuit=web", "closed=1")
	if got := probe.Check(t); !slices.Equal(got, []string{"ECONNABORTED"}) {
		t.Fatalf("the probe after the circuit reopened: %v, want closed", got)
	}
}

// A reload that sets a target's state to forced_open opens its circuit
// anew: its pool's connections are closed.
func TestCloseEstablishedOnReloadForcedOpen(t *testing.T) {
	f := newFixture(t, closeConfig)
	f.srv.ServeHold(t, 8601)
	d := f.start()
	needCloseMechanism(t, d)
	pool := f.topo.Client.StartPool(t, f.cg, []kerneltest.PoolTarget{{Addr: netip.AddrPortFrom(f.srv.IPv4, 8601), N: 2}}, 0)
	f.writeConfig(strings.Replace(closeConfig, "    close_established: true\n", "    close_established: true\n    state: forced_open\n", 1))
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	f.waitState("web", "forced_open", time.Second)
	waitLog(t, f, 1, "closed established connections", "circuit=web", "closed=2")
	if got := pool.Check(t); !slices.Equal(got, []string{"ECONNABORTED", "ECONNABORTED"}) {
		t.Fatalf("the pool after the reload forced its circuit open: %v", got)
	}
}

// With no mechanism (a kernel with neither bpf_sock_destroy nor
// SOCK_DESTROY; here the choice is narrowed to none): start-up says so at
// error level, the metric and the circuit name it, an opening logs that
// the connections stay open, and they do; new connects are rejected all
// the same.
func TestCloseEstablishedNoMechanism(t *testing.T) {
	f := newFixture(t, closeConfig)
	f.closeMechs = []maps.CloseMechanism{maps.CloseNone}
	f.srv.ServeHold(t, 8601)
	d := f.start()
	if m := closeMechanism(t, d); m != maps.CloseNone {
		t.Fatalf("mechanism %s, want none", m)
	}
	if !strings.Contains(f.logs.String(), "level=ERROR msg=\"close_established is configured, but no way to close established connections is available") {
		t.Fatalf("no start-up error:\n%s", f.logs.String())
	}
	reach, _ := maps.ProbeCloseReach()
	if got := testutil.ToFloat64(d.metrics.closeMechanism.WithLabelValues("none", string(reach))); got != 1 {
		t.Fatalf("breakerd_close_established_mechanism{mechanism=none,namespaces=%s} %v, want 1", reach, got)
	}
	pool := f.topo.Client.StartPool(t, f.cg, []kerneltest.PoolTarget{{Addr: netip.AddrPortFrom(f.srv.IPv4, 8601), N: 2}}, 0)
	if _, err := d.Force("web", "open"); err != nil {
		t.Fatal(err)
	}
	waitLog(t, f, 1, "this kernel cannot close its established connections", "circuit=web")
	if c, _ := d.Circuit("web"); c.CloseMechanism != "none" || c.ClosedEstablished != 0 {
		t.Fatalf("circuit web: mechanism %q, closed %d", c.CloseMechanism, c.ClosedEstablished)
	}
	if got := pool.Check(t); !slices.Equal(got, []string{"open", "open"}) {
		t.Fatalf("the pool without a mechanism: %v, want open", got)
	}
	if got := errnos(f.dial(8601, 2, 0)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("new connects to the open circuit: %v, want rejected", got)
	}
}
