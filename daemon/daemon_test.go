package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/kube"
	"github.com/breakerd/breakerd/maps"
)

func TestMain(m *testing.M) {
	maps.ShareKernelBTF() // hundreds of loads in this process
	kerneltest.Main(m)
}

type fixture struct {
	t      testing.TB
	cg     *kerneltest.Cgroup
	topo   *kerneltest.Topology
	srv    *kerneltest.Host
	config string
	bpffs  string
	socket string
	logs   *kerneltest.LogBuffer
	d      *Daemon
	stop   func()
	tick   time.Duration // the daemon's tick (default 20ms; 0 in benchmarks that want the product's default)
	admin  string        // the admin API's TCP address (default none)
	probe  string        // the probe listener's address (default none)
	// resolver and resolveEvery replace the daemon's resolver and
	// resolve interval when set.
	resolver     Resolver
	resolveEvery time.Duration
	// checkEvery replaces the daemon's ground-check interval when set
	// (negative: the test runs the checks itself).
	checkEvery time.Duration
	// cluster is the Kubernetes client the daemon gets (kube_test.go).
	cluster *kube.Client
	// maxWorkloadCgroups sizes the kernel's workloads map when set.
	maxWorkloadCgroups uint32
	// closeMechs narrows close_established's mechanisms (closer_test.go).
	closeMechs []maps.CloseMechanism
}

// newFixture makes the cgroup, the hosts and a configuration file whose
// text has SRV replaced by the server host's IPv4 address.
func newFixture(t testing.TB, yaml string) *fixture {
	t.Helper()
	kerneltest.RequireKernel(t)
	f := &fixture{t: t, cg: kerneltest.NewCgroup(t), topo: kerneltest.NewTopology(t, 1), logs: &kerneltest.LogBuffer{}, tick: 20 * time.Millisecond}
	f.srv = f.topo.Servers[0]
	f.srv.StartCounting(t)
	dir := t.TempDir()
	f.config = filepath.Join(dir, "breakerd.yaml")
	f.socket = filepath.Join(dir, "admin.sock")
	f.bpffs = filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(f.bpffs) })
	f.writeConfig(yaml)
	return f
}

func (f *fixture) writeConfig(yaml string) {
	f.t.Helper()
	yaml = strings.ReplaceAll(yaml, "SRV", f.srv.IPv4.String())
	if err := os.WriteFile(f.config+".tmp", []byte(yaml), 0o644); err != nil {
		f.t.Fatal(err)
	}
	if err := os.Rename(f.config+".tmp", f.config); err != nil {
		f.t.Fatal(err)
	}
}

// start runs a daemon in this process until the test ends (or stop).
func (f *fixture) start() *Daemon {
	f.t.Helper()
	d, err := New(f.options())
	if err != nil {
		f.t.Fatalf("New: %v", err)
	}
	return f.run(d)
}

// options are the daemon's options for the fixture.
func (f *fixture) options() Options {
	return Options{
		ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs, AdminSocket: f.socket, AdminAddr: f.admin, ProbeAddr: f.probe,
		Logger: slog.New(slog.NewTextHandler(io.MultiWriter(f.logs), nil)), TickInterval: f.tick,
		Resolver: f.resolver, ResolveInterval: f.resolveEvery, CheckInterval: f.checkEvery, Cluster: f.cluster,
		CloseMechanisms:    f.closeMechs,
		MaxWorkloadCgroups: f.maxWorkloadCgroups,
	}
}

// run runs d until the test ends (or stop), once it is ready.
func (f *fixture) run(d *Daemon) *Daemon {
	f.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	var once sync.Once
	f.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				f.t.Errorf("Run: %v", err)
			}
		})
	}
	f.t.Cleanup(f.stop)
	f.d = d
	if !kerneltest.WaitFor(2*time.Second, d.ready.Load) {
		f.t.Fatal("daemon not ready")
	}
	return d
}

func (f *fixture) dial(port uint16, n int, timeout time.Duration) []kerneltest.DialResult {
	f.t.Helper()
	return f.topo.Client.Dial(f.t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, port), Count: n, Timeout: timeout})
}

func (f *fixture) circuit(name string) (CircuitInfo, bool) {
	for _, c := range f.d.Circuits() {
		if c.Name == name {
			return c, true
		}
	}
	return CircuitInfo{}, false
}

func (f *fixture) waitState(name, state string, timeout time.Duration) {
	f.t.Helper()
	ok := kerneltest.WaitFor(timeout, func() bool {
		c, ok := f.circuit(name)
		return ok && c.State == state
	})
	if !ok {
		c, _ := f.circuit(name)
		f.t.Fatalf("circuit %s is %q, want %q within %v (logs:\n%s)", name, c.State, state, timeout, f.logs.String())
	}
}

// sentinel makes one connect from cg to port, which nothing listens on
// and no target matches (a dynamic circuit of all), and waits until the
// daemon has counted its refusal. The ring keeps the kernel's order, so
// every record written before the connect has been handled by then: a
// test asserts that something was not counted after this, not after a
// sleep.
func (f *fixture) sentinel(cg *kerneltest.Cgroup, port uint16) {
	f.t.Helper()
	before := f.refusedOfAll()
	res := f.topo.Client.Dial(f.t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, port), Count: 1})
	if got := errnos(res); got[unix.ECONNREFUSED] != 1 {
		f.t.Fatalf("sentinel connect to port %d: %v, want refused by the server", port, got)
	}
	if !kerneltest.WaitFor(3*time.Second, func() bool { return f.refusedOfAll() > before }) {
		f.t.Fatalf("the sentinel's refusal (port %d) was not counted (logs:\n%s)", port, f.logs.String())
	}
}

// refusedOfAll sums the refusals counted for the dynamic circuits of all,
// of every workload (an isolated workload's have their own series).
func (f *fixture) refusedOfAll() float64 {
	f.t.Helper()
	f.d.hold()
	defer f.d.release()
	mfs, err := f.d.metrics.reg.Gather()
	if err != nil {
		f.t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "breakerd_connection_outcomes_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			if labels["outcome"] == "refused" && labels["target"] == allTarget {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

func errnos(rs []kerneltest.DialResult) map[unix.Errno]int {
	m := map[unix.Errno]int{}
	for _, r := range rs {
		m[r.Errno]++
	}
	return m
}

const svcConfig = `
failsafe_timeout: 2s
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8080"]}
    consecutive_failures: 3
    open_duration: 1s
    jitter: 0
    connect_timeout: 1s
    probe_timeout: 2s
    reject_errno: EHOSTUNREACH
`

func TestRefusedTripsRejectsFastAndRecovers(t *testing.T) {
	// An open duration no dialling outlasts, however slow the machine:
	// the test asks for the probe (expire).
	f := newFixture(t, strings.Replace(svcConfig, "open_duration: 1s", "open_duration: 1m", 1))
	f.start()
	// The target names one address and port: its circuit and verdict
	// coverage exist before any traffic.
	f.waitState("svc", "closed", time.Second)

	res := f.dial(8080, 3, 0)
	if got := errnos(res); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("no listener: %v", got)
	}
	f.waitState("svc", "open", 2*time.Second)

	syns := f.srv.SYNs(t)
	res = f.dial(8080, 20, 0)
	for _, r := range res {
		if r.Errno != unix.EHOSTUNREACH {
			t.Fatalf("open circuit: errno %v, want the configured EHOSTUNREACH", r.Errno)
		}
	}
	// Rejected inside connect(): no SYN left. How fast is the connect-cost
	// benchmark's to show (scripts/bench), not a bound a loaded machine
	// can break.
	if n := f.srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs reached the host of an open circuit", n)
	}
	if !strings.Contains(f.logs.String(), "circuit=svc target=svc from=closed to=open reason=consecutive_failures") {
		t.Fatalf("no transition log line:\n%s", f.logs.String())
	}

	// The server comes back; at the end of the open duration one probe
	// closes it.
	f.srv.ServeHold(t, 8080)
	f.expire(8080)
	if got := errnos(f.dial(8080, 1, 0)); got[0] != 1 {
		t.Fatalf("probe: %v", got)
	}
	f.waitState("svc", "closed", 2*time.Second)
	if got := errnos(f.dial(8080, 5, 0)); got[0] != 5 {
		t.Fatalf("after recovery: %v", got)
	}
	var reasons []string
	for _, e := range f.d.Events() {
		reasons = append(reasons, e.From+">"+e.To+":"+e.Reason)
	}
	want := "closed>open:consecutive_failures open>half_open:open_duration_elapsed half_open>closed:probes_succeeded"
	if strings.Join(reasons, " ") != want {
		t.Fatalf("events %v, want %s", reasons, want)
	}
}

func TestBlackHoleTripsOnConnectTimeout(t *testing.T) {
	f := newFixture(t, `
all:
  consecutive_failures: 2
  connect_timeout: 1s
  open_duration: 1m
`)
	f.srv.DropSYNs(t, 9090)
	f.start()
	name := fmt.Sprintf("tcp/%s:9090", f.srv.IPv4)
	// Two clients that would wait for 4 s each; the daemon counts them as
	// timed out after connect_timeout, so the circuit opens while they
	// still wait.
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { f.dial(9090, 1, 4*time.Second) })
	}
	clientsDone := make(chan struct{})
	go func() { wg.Wait(); close(clientsDone) }()
	f.waitState(name, "open", 4*time.Second)
	select {
	case <-clientsDone:
		t.Fatal("the circuit opened only after the clients gave up, not at connect_timeout")
	default:
	}
	for _, r := range f.dial(9090, 3, 5*time.Second) {
		if r.Errno != unix.ECONNREFUSED {
			t.Fatalf("after the trip: errno %v, want the verdict's ECONNREFUSED", r.Errno)
		}
	}
	<-clientsDone
}

func TestReload(t *testing.T) {
	// Open for longer than the test takes (in a TCG VM, seconds), so no
	// half-open probe is let through between its checks.
	svcConfig := strings.Replace(svcConfig, "open_duration: 1s", "open_duration: 1m", 1)
	f := newFixture(t, svcConfig)
	f.start()
	f.dial(8080, 3, 0)
	f.waitState("svc", "open", 2*time.Second)

	f.writeConfig(strings.Replace(svcConfig, "consecutive_failures: 3", "consecutive_failures: 3\n    min_requests: 200\n    window_size: 100\n    failure_rate_treshold: 0.5", 1))
	err := f.d.Reload()
	if err == nil || !strings.Contains(err.Error(), "targets.svc.min_requests: 200 exceeds window_size 100") || !strings.Contains(err.Error(), "targets.svc.failure_rate_treshold: unknown key") {
		t.Fatalf("bad reload: %v", err)
	}
	if c, _ := f.circuit("svc"); c.State != "open" {
		t.Fatalf("bad reload changed the circuit: %+v", c)
	}
	if v := testutil.ToFloat64(f.d.metrics.reloadOK); v != 0 {
		t.Fatalf("reload_successful %v after a refused reload", v)
	}
	if got := errnos(f.dial(8080, 2, 0)); got[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("enforcement after a refused reload: %v", got)
	}

	// A good reload that leaves svc unchanged (only `all` moves) keeps it.
	f.writeConfig(svcConfig + "all:\n  open_duration: 30s\n")
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if c, _ := f.circuit("svc"); c.State != "open" {
		t.Fatalf("good reload reset an unchanged target: %+v", c)
	}
	if v := testutil.ToFloat64(f.d.metrics.reloadOK); v != 1 {
		t.Fatalf("reload_successful %v", v)
	}
	// A change of svc's options keeps its state; the new options apply
	// from its next transition.
	f.writeConfig(strings.Replace(svcConfig, "open_duration: 1m", "open_duration: 2m", 1))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if c, _ := f.circuit("svc"); c.State != "open" || c.Options["open_duration"] != "2m0s" {
		t.Fatalf("a changed target lost its state or kept its old options: %+v", c)
	}
	if got := errnos(f.dial(8080, 1, 0)); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("after a changed target the verdict went: %v", got)
	}
	// A changed state key applies at once.
	f.writeConfig(svcConfig + "    state: forced_closed\n")
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	f.waitState("svc", "forced_closed", time.Second)
	if got := errnos(f.dial(8080, 1, 0)); got[unix.ECONNREFUSED] != 1 {
		t.Fatalf("forced_closed by a reload still rejects: %v", got)
	}
}

func TestReloadOnFileChange(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.start()
	// A ConfigMap-style swap: the file is replaced by a rename.
	f.writeConfig(svcConfig + "mode: shadow\n")
	ok := kerneltest.WaitFor(3*time.Second, func() bool {
		f.d.hold()
		defer f.d.release()
		return f.d.cfg.Mode == "shadow"
	})
	if !ok {
		t.Fatalf("the file change was not picked up:\n%s", f.logs.String())
	}
	s, err := f.d.k.Settings()
	if err != nil || !s.Shadow {
		t.Fatalf("shadow not written to the kernel: %+v %v", s, err)
	}
}

// Of two reloads, one that began reading the file after the other is
// never undone by it: the file watcher's reload, having read an older
// file, must not replace an explicit reload of the newer one.
func TestReloadsApplyInTheOrderTheyRead(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.start()
	read := make(chan struct{})
	resume := make(chan struct{})
	hook := func() {
		close(read)
		<-resume
	}
	f.d.reloadRead.Store(&hook)
	f.writeConfig(svcConfig + "mode: shadow\n")
	older := make(chan error, 1)
	go func() { older <- f.d.Reload() }()
	<-read
	f.writeConfig(svcConfig)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	close(resume)
	if err := <-older; err != nil {
		t.Fatal(err)
	}
	f.d.hold()
	mode := f.d.cfg.Mode
	f.d.release()
	if mode == "shadow" {
		t.Fatal("the reload that read the older file was applied last")
	}
	if s, err := f.d.k.Settings(); err != nil || s.Shadow {
		t.Fatalf("the kernel was left in shadow mode by the older file: %+v %v", s, err)
	}
	if !strings.Contains(f.logs.String(), "configuration reload skipped") {
		t.Fatalf("the older reload was not reported as skipped:\n%s", f.logs.String())
	}
}

func TestRestartAdoptsWithoutGap(t *testing.T) {
	// The fail-safe must outlast the restart (in a TCG VM it takes seconds),
	// and so must the open state.
	f := newFixture(t, strings.Replace(strings.Replace(svcConfig, "open_duration: 1s", "open_duration: 4m", 1), "failsafe_timeout: 2s", "failsafe_timeout: 30s", 1))
	f.start()
	f.dial(8080, 3, 0)
	f.waitState("svc", "open", 2*time.Second)
	before, _ := f.circuit("svc")

	// Two clients hammer the open destination, back to back, from before
	// the daemon stops until thousands of connects after the new one is
	// ready: it must be rejected throughout.
	h := f.topo.Client.StartHammer(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8080)}, 2)
	if !h.Await(500, 30*time.Second) {
		t.Fatal("the clients did not connect 500 times each before the restart")
	}
	f.stop()
	f.start()
	// A second or so of connects after it on the host; a few seconds'
	// worth in the emulated guest.
	after := 50000
	if kerneltest.Emulated() {
		after = 5000
	}
	if !h.Await(after, time.Minute) {
		t.Fatalf("the clients did not connect %d times each after the restart", after)
	}
	if got := h.Stop(t); len(got) != 1 || got[unix.EHOSTUNREACH] == 0 {
		st, _ := f.d.k.Stats()
		t.Fatalf("during the restart: %v (verdicts ignored for a stale heartbeat: %d)\nlogs:\n%s", got, st.FailsafeAllowed, f.logs.String())
	}
	c, _ := f.circuit("svc")
	if d := c.OpenUntil.Sub(before.OpenUntil); c.State != "open" || d < -time.Second || d > time.Second {
		t.Fatalf("adopted circuit %+v, want open until %v as before the restart", c, before.OpenUntil)
	}
	if !strings.Contains(f.logs.String(), "adopted open circuit") {
		t.Fatal("no adoption log line")
	}
}

func TestDeadDaemonFailsOpen(t *testing.T) {
	f := newFixture(t, strings.Replace(svcConfig, "failsafe_timeout: 2s", "failsafe_timeout: 1s", 1))
	f.srv.ServeHold(t, 8080)
	f.start()
	if _, err := f.d.Force("svc", "open"); err != nil {
		t.Fatal(err)
	}
	if got := errnos(f.dial(8080, 1, 0)); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("forced open: %v", got)
	}
	// The daemon goes away (its heartbeat stops); the verdict stays pinned.
	f.stop()
	time.Sleep(1200 * time.Millisecond)
	if got := errnos(f.dial(8080, 3, 0)); got[0] != 3 {
		t.Fatalf("after the fail-safe timeout: %v, want traffic to flow", got)
	}
}

func unixClient(path string) *http.Client {
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", path)
	}}}
}

func TestAdminAPI(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.start()
	tcp := httptest.NewServer(f.d.handler(exposeTCP, nil))
	defer tcp.Close()
	post := func(c *http.Client, url, body string, hdr ...string) (int, string) {
		req, _ := http.NewRequest("POST", url, strings.NewReader(body))
		if len(hdr) > 0 {
			req.Header.Set("Authorization", hdr[0])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := post(tcp.Client(), tcp.URL+"/v1/circuits/svc", `{"action":"open"}`); code != http.StatusForbidden || !strings.Contains(body, "unix socket") {
		t.Fatalf("mutating over TCP without a token: %d %s", code, body)
	}
	withToken := httptest.NewServer(f.d.handler(exposeTCP, []byte("s3cret")))
	defer withToken.Close()
	if code, _ := post(withToken.Client(), withToken.URL+"/v1/circuits/svc", `{"action":"open"}`, "Bearer wrong"); code != http.StatusUnauthorized {
		t.Fatalf("wrong token: %d", code)
	}
	sock := unixClient(f.socket)
	code, body := post(sock, "http://breakerd/v1/circuits/svc", `{"action":"open"}`)
	if code != http.StatusOK || !strings.Contains(body, `"state": "forced_open"`) {
		t.Fatalf("force open over the socket: %d %s", code, body)
	}
	if got := errnos(f.dial(8080, 1, 0)); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("forced open not enforced: %v", got)
	}
	if !strings.Contains(f.logs.String(), "circuit changed by hand") {
		t.Fatal("the change is not logged")
	}
	for _, bad := range []struct{ url, body, want string }{
		{"/v1/circuits/svc", `{"action":"explode"}`, "unknown action"},
		{"/v1/circuits/svc", `{"verb":"open"}`, "unknown field"},
		{"/v1/circuits/nope", `{"action":"open"}`, "no such circuit"},
	} {
		code, body := post(sock, "http://breakerd"+bad.url, bad.body)
		var e apiError
		if code/100 != 4 || json.Unmarshal([]byte(body), &e) != nil || !strings.Contains(e.Error, bad.want) {
			t.Errorf("%s %s: %d %s", bad.url, bad.body, code, body)
		}
	}
	if code, body := post(sock, "http://breakerd/v1/circuits/svc", `{"action":"release"}`); code != http.StatusOK || !strings.Contains(body, `"state": "closed"`) {
		t.Fatalf("release: %d %s", code, body)
	}
	resp, err := sock.Get("http://breakerd/readyz")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("readyz: %v %v", resp, err)
	}
	resp.Body.Close()
}

func TestMetrics(t *testing.T) {
	// An open duration the dials after it cannot outlast on a slow machine:
	// with 1 s, the emulated guest let a probe through before the four
	// connects were done (3 rejections, 4 refused).
	f := newFixture(t, strings.Replace(svcConfig, "open_duration: 1s", "open_duration: 1m", 1))
	f.start()
	f.dial(8080, 3, 0)
	f.waitState("svc", "open", 2*time.Second)
	f.dial(8080, 4, 0)
	problems, err := testutil.GatherAndLint(f.d.metrics.reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("metric lint: %s: %s", p.Metric, p.Text)
	}
	rec := httptest.NewRecorder()
	f.d.handler(exposeTCP, nil).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body := rec.Body.String()
	for _, want := range []string{
		`breakerd_transitions_total{from="closed",reason="consecutive_failures",to="open",workload="shared"} 1`,
		`breakerd_circuit_state{state="open",target="svc"} 1`,
		`breakerd_kernel_rejections_total{target="svc"} 4`,
		`breakerd_connection_outcomes_total{outcome="refused",target="svc",workload="shared"} 3`,
		`breakerd_config_last_reload_successful 1`,
		`breakerd_verdict_map_entries 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
}

// TestProgramMetrics: with BPF statistics on, the scrape shows the calls
// of breakerd's programs the test's connects made, and time spent in them.
func TestProgramMetrics(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.srv.Listen(t, "tcp4", 8080)
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		t.Fatalf("enabling BPF statistics: %v", err)
	}
	defer stats.Close()
	f.start()
	const n = 20
	for _, r := range f.dial(8080, n, time.Second) {
		if r.Errno != 0 {
			t.Fatalf("healthy connect failed: %v", r.Errno)
		}
	}
	rec := httptest.NewRecorder()
	f.d.handler(exposeTCP, nil).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	values := map[string]float64{}
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		if name, v, ok := strings.Cut(line, " "); ok && strings.HasPrefix(name, "breakerd_kernel_program_") {
			x, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			values[name] = x
		}
	}
	// Each connect calls connect4 once, and sockops at least at the
	// connect and at the handshake's end.
	if got := values[`breakerd_kernel_program_runs_total{program="connect4"}`]; got < n {
		t.Errorf("connect4 runs %v, want at least %d (scrape: %v)", got, n, values)
	}
	if got := values[`breakerd_kernel_program_runs_total{program="sockops"}`]; got < 2*n {
		t.Errorf("sockops runs %v, want at least %d (scrape: %v)", got, 2*n, values)
	}
	for _, p := range []string{"connect4", "sockops"} {
		if got := values[`breakerd_kernel_program_run_seconds_total{program="`+p+`"}`]; got <= 0 {
			t.Errorf("%s run time %v, want more than 0", p, got)
		}
	}
	if _, ok := values[`breakerd_kernel_program_runs_total{program="resp_ingress"}`]; !ok {
		t.Errorf("no series for resp_ingress (loaded, not attached: 0): %v", values)
	}
}

func TestShutdownLeavesNoGoroutine(t *testing.T) {
	f := newFixture(t, svcConfig)
	before := goleak.IgnoreCurrent()
	f.start()
	f.dial(8080, 1, 0)
	f.stop()
	goleak.VerifyNone(t, before, goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
}

func TestMaxCircuitsEvictsIdleClosedFirst(t *testing.T) {
	f := newFixture(t, `
max_circuits: 2
all:
  consecutive_failures: 1
  open_duration: 1m
`)
	f.srv.ServeHold(t, 7001)
	f.start()
	f.dial(7000, 1, 0) // refused: this circuit opens
	f.dial(7001, 1, 0) // established: closed
	f.dial(7002, 1, 0) // a third destination: the idle closed one goes
	ip := f.srv.IPv4.String()
	names := map[string]string{}
	// The refusal's record reaches the daemon just after connect returns.
	kerneltest.WaitFor(2*time.Second, func() bool {
		clear(names)
		for _, c := range f.d.Circuits() {
			names[c.Name] = c.State
		}
		return names["tcp/"+ip+":7002"] != ""
	})
	if len(names) != 2 || names["tcp/"+ip+":7000"] != "open" || names["tcp/"+ip+":7002"] != "open" {
		t.Fatalf("circuits %v: want the open one kept and the closed idle one evicted", names)
	}
	if v := testutil.ToFloat64(f.d.metrics.circuitsEvicted); v != 1 {
		t.Fatalf("evictions %v", v)
	}
}

func TestHostNamesResolveIntoTargets(t *testing.T) {
	f := newFixture(t, `
targets:
  local:
    match: {hosts: [localhost], ports: ["7444"], protocol: udp}
    state: forced_open
`)
	f.start()
	c, ok := f.circuit("local")
	if !ok || c.State != "forced_open" {
		t.Fatalf("circuit %+v", c)
	}
	if !strings.Contains(strings.Join(c.Destinations, " "), "udp/127.0.0.1:7444") {
		t.Fatalf("localhost did not resolve into the target: %v", c.Destinations)
	}
	// A forced-open UDP target is enforced before any traffic.
	res := f.topo.Client.Dial(t, f.cg, kerneltest.DialSpec{Network: "udp4", Addr: netip.MustParseAddrPort("127.0.0.1:7444"), Op: "sendto"})
	if res[0].Errno != unix.ECONNREFUSED {
		t.Fatalf("sendto a forced-open UDP target: %v", res[0].Errno)
	}
}

func TestBulkhead(t *testing.T) {
	cfg := `
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8300"]}
    max_connections: 5
    consecutive_failures: 1
`
	f := newFixture(t, cfg)
	f.srv.ServeHold(t, 8300) // a server that never answers: connections pile up
	f.start()
	dst := netip.AddrPortFrom(f.srv.IPv4, 8300)
	// A pool of 300 clients that would each hold a connection.
	holder := f.topo.Client.StartDial(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 300, Parallel: 300, Barrier: true, Hold: time.Minute})
	// (The five established records are read within a tick.)
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		c, _ := f.circuit("pool")
		return c.Connections == 5 && c.BulkheadRejected == 295 && c.Calls == 5
	}) {
		c, _ := f.circuit("pool")
		t.Fatalf("bulkhead: %+v", c)
	}
	c, _ := f.circuit("pool")
	if c.State != "closed" || c.Calls != 5 || c.Failures != 0 {
		t.Fatalf("bulkhead rejections fed the window: %+v", c)
	}
	// A lowered limit keeps the existing connections; new ones wait.
	f.writeConfig(strings.Replace(cfg, "max_connections: 5", "max_connections: 2", 1))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if got := errnos(f.dial(8300, 1, 0)); got[unix.EAGAIN] != 1 {
		t.Fatalf("after lowering the limit: %v", got)
	}
	if c, _ := f.circuit("pool"); c.Connections != 5 {
		t.Fatalf("lowering the limit dropped connections: %+v", c)
	}
	holder.Cmd.Process.Kill()
	holder.Cmd.Wait()
	if !kerneltest.WaitFor(3*time.Second, func() bool { c, _ := f.circuit("pool"); return c.Connections == 0 }) {
		t.Fatal("count did not return to zero")
	}
	if got := errnos(f.dial(8300, 1, 0)); got[0] != 1 {
		t.Fatalf("after the holder died: %v", got)
	}
	rec := httptest.NewRecorder()
	f.d.handler(exposeTCP, nil).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{`breakerd_bulkhead_rejections_total{target="pool"} 296`, `breakerd_bulkhead_connections{target="pool"} 0`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
}

func TestClientGivingUpAfterConnectTimeoutCountsAsTimedOut(t *testing.T) {
	f := newFixture(t, `
all:
  consecutive_failures: 2
  connect_timeout: 500ms
  open_duration: 1m
`)
	f.srv.DropSYNs(t, 9191)
	f.start()
	// Two clients that give up after 700 ms, before the kernel's first
	// SYN retransmission: no timed-out record, only abandoned ones.
	f.topo.Client.Dial(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 9191), Op: "abandon", Count: 2, Parallel: 2, Hold: 700 * time.Millisecond})
	f.waitState(fmt.Sprintf("tcp/%s:9191", f.srv.IPv4), "open", 2*time.Second)
}
