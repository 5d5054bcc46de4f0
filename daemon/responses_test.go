package daemon

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// needPrograms fails the test when a client it drives is missing, except
// in vmtest's VM, which carries none of them (it skips there; the kernel
// side is tested in the VM by the tests with Go's client).
func needPrograms(t *testing.T, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			if kerneltest.Emulated() {
				t.Skipf("%s is not in the VM", n)
			}
			t.Fatalf("%s is not installed (scripts/setup installs it)", n)
		}
	}
}

func (f *fixture) outcomeCount(outcome, target string) float64 {
	f.d.mu.Lock()
	defer f.d.mu.Unlock()
	return testutil.ToFloat64(f.d.metrics.outcomes.WithLabelValues(outcome, target, "shared"))
}

func (f *fixture) waitOutcomes(outcome, target string, want float64) {
	f.t.Helper()
	if !kerneltest.WaitFor(3*time.Second, func() bool { return f.outcomeCount(outcome, target) == want }) {
		f.t.Fatalf("%s outcomes of %s: %v, want %v (logs:\n%s)", outcome, target, f.outcomeCount(outcome, target), want, f.logs.String())
	}
}

// keepAlive makes requests with Go's net/http client over one keep-alive
// connection, from a process in the protected cgroup.
func (f *fixture) keepAlive(port uint16, timeout time.Duration, paths ...string) []kerneltest.DialResult {
	f.t.Helper()
	var reqs []kerneltest.HTTPRequest
	for _, p := range paths {
		reqs = append(reqs, kerneltest.HTTPRequest{Path: p})
	}
	return f.topo.Client.Dial(f.t, f.cg, kerneltest.DialSpec{Op: "keepalive", Addr: netip.AddrPortFrom(f.srv.IPv4, port), Timeout: timeout, Requests: reqs})
}

func (f *fixture) curl(args ...string) (string, int) {
	f.t.Helper()
	out, err := f.topo.Client.Command(f.cg, "curl", append([]string{"-sS", "--max-time", "10", "-o", "/dev/null"}, args...)...).Run(f.t)
	if ee, ok := err.(*exec.ExitError); ok {
		return string(out), ee.ExitCode()
	} else if err != nil {
		f.t.Fatal(err)
	}
	return string(out), 0
}

const httpConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8090"]}
    protocol: http
    consecutive_failures: 3
    window_size: 100
    min_requests: 100
    open_duration: 4m
`

// A keep-alive client whose server starts answering 503: 404s and 200s
// are successes, and the circuit opens at the third 503 (the configured
// count of consecutive failures), however many connections they came on
// (the handshake is not a call); then new connects are rejected in
// connect(), with no SYN sent.
func TestHTTPStatusesOpenTheCircuit(t *testing.T) {
	f := newFixture(t, httpConfig)
	srv := f.srv.ServeHTTPCases(t, 8090)
	f.start()
	for _, r := range f.keepAlive(8090, 5*time.Second, "/404", "/ok", "/404", "/404", "/ok") {
		if r.Errno != 0 {
			t.Fatalf("healthy requests: %+v", r)
		}
	}
	f.waitOutcomes("response", "web", 5)
	srv.FailWith(503)
	f.keepAlive(8090, 5*time.Second, "/ok", "/ok")
	f.waitOutcomes("response_status", "web", 2)
	if c, _ := f.circuit("web"); c.State != "closed" || c.ConsecutiveFailures != 2 || c.Calls != 7 {
		t.Fatalf("after two 503s: %+v", c)
	}
	f.keepAlive(8090, 5*time.Second, "/ok") // a new connection: its 503 is the third
	f.waitState("web", "open", 3*time.Second)
	evs := f.d.Events()
	if last := evs[len(evs)-1]; last.Reason != "consecutive_failures" || last.Calls != 8 {
		t.Fatalf("transition %+v", last)
	}
	syns := f.srv.SYNs(t)
	if got := errnos(f.dial(8090, 3, 0)); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("connects to the open circuit: %v", got)
	}
	if n := f.srv.SYNs(t); n != syns {
		t.Fatalf("%d SYNs reached the open destination", n-syns)
	}
	info, _ := f.circuit("web")
	if info.Options["protocol"] != "http" || info.Options["failure_statuses"] != "[5xx, 429]" {
		t.Fatalf("options in the API: %v", info.Options)
	}
}

// The same with unmodified clients: curl keep-alive over several URLs in
// one process, a Python http.client connection, ab -k.
func TestHTTPStatusesWithRealClients(t *testing.T) {
	needPrograms(t, "curl", "python3", "ab")
	f := newFixture(t, httpConfig)
	srv := f.srv.ServeHTTPCases(t, 8090)
	f.start()
	base := fmt.Sprintf("http://%s:8090", f.srv.IPv4)
	// ab -k: 40 requests over keep-alive connections, all 404: successes.
	out, err := f.topo.Client.Command(f.cg, "ab", "-k", "-n", "40", "-c", "2", base+"/404").Run(t)
	if err != nil || !strings.Contains(string(out), "Keep-Alive requests:    40") {
		t.Fatalf("ab: %v\n%s", err, out)
	}
	f.waitOutcomes("response", "web", 40)
	// Python's http.client, one connection: 429s are failures.
	py := filepath.Join(t.TempDir(), "pool.py")
	script := `import http.client, sys
c = http.client.HTTPConnection(sys.argv[1], 8090, timeout=5)
for _ in range(2):
    c.request("GET", "/429"); r = c.getresponse(); r.read(); print(r.status)
`
	if err := os.WriteFile(py, []byte(script), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := f.topo.Client.Command(f.cg, "python3", py, f.srv.IPv4.String()).Run(t); err != nil || strings.Fields(string(out))[0] != "429" {
		t.Fatalf("python: %v %s", err, out)
	}
	f.waitOutcomes("response_status", "web", 2)
	// curl keep-alive: a 200 (a success, ending the run), then 503s.
	srv.FailWith(503)
	if out, code := f.curl(base+"/a", base+"/b", base+"/c"); code != 0 {
		t.Fatalf("curl: %d %s", code, out)
	}
	f.waitState("web", "open", 3*time.Second)
	if _, code := f.curl(base + "/d"); code != 7 {
		t.Fatalf("curl to the open circuit exits %d, want 7 (connection refused)", code)
	}
}

const timeoutConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8091"]}
    protocol: http
    response_timeout: 400ms
    consecutive_failures: 1
    open_duration: 4m
`

// The handshake is fast and the answer never comes: the request is a
// failure at response_timeout, while the client still waits (it gives up
// only after 6 s), and the client giving up later counts nothing more.
// The time is taken from when the kernel shows the request awaiting its
// answer, not from the client's start (slow in an emulated VM).
func TestResponseTimeoutCountedAtTimeout(t *testing.T) {
	f := newFixture(t, timeoutConfig)
	f.srv.ServeHTTPCases(t, 8091)
	f.start()
	p := f.topo.Client.StartDial(t, f.cg, kerneltest.DialSpec{Op: "keepalive", Addr: netip.AddrPortFrom(f.srv.IPv4, 8091), Timeout: 6 * time.Second,
		Requests: []kerneltest.HTTPRequest{{Path: "/never"}}})
	f.waitAwaiting(1)
	t0 := time.Now()
	f.waitState("web", "open", 5*time.Second)
	// Not before response_timeout (less the poll that saw the request), and
	// long before the client gives up.
	if took := time.Since(t0); took < 300*time.Millisecond || took > 4*time.Second {
		t.Fatalf("opened %v after the request was seen awaiting, want about response_timeout (400ms)", took)
	}
	if n := f.outcomeCount("response_timeout", "web"); n != 1 {
		t.Fatalf("%v response timeouts", n)
	}
	if n := f.outcomeCount("response_abandoned", "web"); n != 0 {
		t.Fatalf("%v abandoned requests before the client's timeout: the timeout was not the daemon's", n)
	}
	if err := p.Cmd.Wait(); err != nil {
		t.Logf("client: %v", err)
	}
	time.Sleep(300 * time.Millisecond) // its no_response record is read
	if n := f.outcomeCount("response_timeout", "web"); n != 1 {
		t.Fatalf("%v response timeouts after the client gave up, want still 1", n)
	}
	if c, _ := f.circuit("web"); c.Calls != 1 {
		t.Fatalf("window after the client gave up: %+v", c)
	}
}

const redisConfig = `
failsafe_timeout: 30s
targets:
  cache:
    match: {cidrs: [SRV], ports: ["6390"]}
    slow_response_duration: 200ms
    slow_call_rate_threshold: 1
    window_size: 3
    min_requests: 3
    open_duration: 4m
`

// Redis made slow with DEBUG SLEEP: without any parsing, each command is
// a call, slow when its reply's first byte took 200 ms; three slow replies
// open the circuit and redis-benchmark is then refused in connect().
func TestSlowRedisOpensOnSlowCalls(t *testing.T) {
	needPrograms(t, "redis-server", "redis-cli", "redis-benchmark")
	f := newFixture(t, redisConfig)
	srv := f.srv.Command(nil, "redis-server", "--port", "6390", "--save", "", "--appendonly", "no", "--enable-debug-command", "yes", "--protected-mode", "no")
	if err := srv.Start(t); err != nil {
		t.Fatal(err)
	}
	f.start()
	cli := func(args ...string) (string, error) {
		out, err := f.topo.Client.Command(f.cg, "redis-cli", append([]string{"-h", f.srv.IPv4.String(), "-p", "6390"}, args...)...).Run(t)
		return string(out), err
	}
	if !kerneltest.WaitFor(5*time.Second, func() bool { out, _ := cli("PING"); return strings.Contains(out, "PONG") }) {
		t.Fatal("redis did not start")
	}
	out, err := f.topo.Client.Command(f.cg, "redis-benchmark", "-h", f.srv.IPv4.String(), "-p", "6390", "-n", "200", "-c", "2", "-t", "ping", "-q").Run(t)
	if err != nil {
		t.Fatalf("redis-benchmark: %v %s", err, out)
	}
	if c, _ := f.circuit("cache"); c.State != "closed" {
		t.Fatalf("quick commands: %+v", c)
	}
	if out, err := cli("-r", "3", "DEBUG", "SLEEP", "0.25"); err != nil {
		t.Fatalf("DEBUG SLEEP: %v %s", err, out)
	}
	f.waitState("cache", "open", 3*time.Second)
	if evs := f.d.Events(); evs[len(evs)-1].Reason != "slow_call_rate" {
		t.Fatalf("transition %+v", evs[len(evs)-1])
	}
	if out, _ := cli("PING"); !strings.Contains(out, "Connection refused") {
		t.Fatalf("redis-cli against the open circuit: %s", out)
	}
}

const probeConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8092"]}
    protocol: http
    consecutive_failures: 2
    open_duration: 300ms
    jitter: 0
    probe_timeout: 5s
`

// A half-open probe's result is its first response, not its handshake:
// while the server answers 503, a probe that connects fine reopens the
// circuit; once it answers 200, the probe's first response closes it.
func TestProbeJudgedByItsFirstResponse(t *testing.T) {
	f := newFixture(t, probeConfig)
	srv := f.srv.ServeHTTPCases(t, 8092)
	f.start()
	srv.FailWith(503)
	f.keepAlive(8092, 5*time.Second, "/a", "/b")
	f.waitState("web", "open", 3*time.Second)
	time.Sleep(400 * time.Millisecond) // due
	if r := f.keepAlive(8092, 5*time.Second, "/probe"); r[0].Errno != 0 || r[0].Status != 503 {
		t.Fatalf("probe: %+v", r)
	}
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		evs := f.d.Events()
		last := evs[len(evs)-1]
		return last.From == "half_open" && last.To == "open"
	}) {
		t.Fatalf("a probe answered 503 did not reopen: %+v", f.d.Events())
	}
	srv.FailWith(0)
	time.Sleep(700 * time.Millisecond) // due again (open_duration doubled)
	if r := f.keepAlive(8092, 5*time.Second, "/404"); r[0].Errno != 0 || r[0].Status != 404 {
		t.Fatalf("probe: %+v", r)
	}
	f.waitState("web", "closed", 3*time.Second)
}

const lifecycleResponsesConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8095"]}
    protocol: http
    consecutive_failures: 3
    open_duration: 4m
  plain:
    match: {cidrs: [SRV], ports: ["8096"]}
`

const lifecycleNoResponsesConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8095"]}
    consecutive_failures: 3
    open_duration: 4m
  plain:
    match: {cidrs: [SRV], ports: ["8096"]}
`

func (f *fixture) responseLinks() (egress, ingress bool) {
	_, e := os.Lstat(filepath.Join(f.d.Kernel().PinDir(), "link_resp_egress"))
	_, i := os.Lstat(filepath.Join(f.d.Kernel().PinDir(), "link_resp_ingress"))
	return e == nil, i == nil
}

// A circuit opened by 503s stays open across a SIGTERM restart and a
// second start on the same pins (refused), with no SYN let through, while
// a healthy target's connects all succeed; a reload that removes the
// response options detaches the response programs (and a reload that adds
// them back attaches them), keeping the circuit's state, and only the
// responses of the new turns count.
func TestLifecycleResponses(t *testing.T) {
	f := newFixture(t, lifecycleResponsesConfig)
	srv := f.srv.ServeHTTPCases(t, 8095)
	f.srv.ServeHold(t, 8096)
	f.start()
	if e, i := f.responseLinks(); !e || !i {
		t.Fatalf("response programs not pinned: egress %v ingress %v", e, i)
	}
	srv.FailWith(503)
	f.keepAlive(8095, 5*time.Second, "/a", "/b", "/c")
	f.waitState("web", "open", 3*time.Second)
	check := func(when string) {
		t.Helper()
		syns := f.srv.SYNs(t)
		if got := errnos(f.dial(8095, 5, 0)); got[unix.ECONNREFUSED] != 5 {
			t.Fatalf("%s: connects to the open circuit: %v", when, got)
		}
		if n := f.srv.SYNs(t); n != syns {
			t.Fatalf("%s: %d SYNs reached the open destination", when, n-syns)
		}
		if got := errnos(f.dial(8096, 5, 0)); got[0] != 5 {
			t.Fatalf("%s: healthy connects: %v", when, got)
		}
	}
	check("before the restart")
	f.restart()
	f.waitState("web", "open", time.Second)
	check("after the restart")
	if e, i := f.responseLinks(); !e || !i {
		t.Fatalf("response programs not pinned after the restart: egress %v ingress %v", e, i)
	}
	if _, err := New(Options{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs}); err == nil {
		t.Fatal("a second daemon started on the same pins")
	}
	check("after a second start was refused")

	f.writeConfig(lifecycleNoResponsesConfig)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if e, i := f.responseLinks(); e || i || f.d.Kernel().Responses() {
		t.Fatalf("response programs still pinned after a reload without response options: egress %v ingress %v", e, i)
	}
	f.waitState("web", "open", time.Second)
	check("after a reload without response options")
	if lim, err := f.d.Kernel().AllLimits(); err != nil || len(lim) != 0 {
		t.Fatalf("limits after the reload: %v %v", lim, err)
	}

	f.writeConfig(lifecycleResponsesConfig)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if e, i := f.responseLinks(); !e || !i {
		t.Fatalf("response programs not pinned after a reload adding the options: egress %v ingress %v", e, i)
	}
	check("after a reload with response options")
	if _, err := f.d.Force("web", "close"); err != nil {
		t.Fatal(err)
	}
	srv.FailWith(0)
	if r := f.keepAlive(8095, 5*time.Second, "/404", "/ok"); r[1].Status != 200 {
		t.Fatalf("after the forced close: %+v", r)
	}
	f.waitOutcomes("response", "web", 2)
}

const workloadResponsesConfig = `
failsafe_timeout: 30s
workloads:
  - name: a
    cgroups: [CGROUP/a]
  - name: b
    cgroups: [CGROUP/b]
  - name: c
    cgroups: [CGROUP/c]
    isolate: true
targets:
  web:
    match: {cidrs: [SRV], ports: ["8099"]}
    protocol: http
    consecutive_failures: 3
    open_duration: 4m
`

// With workloads, responses follow the workloads' circuits: the 503s of
// two workloads that share the circuit add up and open it for both; an
// isolated workload's 503s open only its own circuit; a process of no
// workload is not followed.
func TestResponsesWithWorkloads(t *testing.T) {
	f := newScopedFixture(t, workloadResponsesConfig)
	a, b, c := f.cg.Child(t, "a"), f.cg.Child(t, "b"), f.cg.Child(t, "c")
	srv := f.srv.ServeHTTPCases(t, 8099)
	f.start()
	srv.FailWith(503)
	get := func(cg *kerneltest.Cgroup, n int) []kerneltest.DialResult {
		return f.topo.Client.Dial(t, cg, kerneltest.DialSpec{Op: "keepalive", Addr: netip.AddrPortFrom(f.srv.IPv4, 8099), Timeout: 5 * time.Second, Count: n,
			Requests: []kerneltest.HTTPRequest{{Path: "/x"}}})
	}
	get(f.cg, 5) // no workload's: not followed
	get(c, 2)
	get(a, 2)
	f.waitOutcomes("response_status", "web", 2)
	if s, _ := f.circuit("web"); s.State != "closed" || s.ConsecutiveFailures != 2 {
		t.Fatalf("after a's two 503s: %+v", s)
	}
	get(b, 1)
	f.waitState("web", "open", 3*time.Second)
	for _, cg := range []*kerneltest.Cgroup{a, b} {
		if r := get(cg, 1); r[0].Errno != unix.ECONNREFUSED {
			t.Fatalf("%s with the shared circuit open: %+v", cg.Path, r)
		}
	}
	if s, _ := f.circuit("web@c"); s.State != "closed" || s.ConsecutiveFailures != 2 {
		t.Fatalf("c's own circuit: %+v", s)
	}
	if r := get(c, 1); r[0].Errno != 0 || r[0].Status != 503 {
		t.Fatalf("c, its circuit closed: %+v", r)
	}
	f.waitState("web@c", "open", 3*time.Second)
}

const slowHTTPConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8100"]}
    protocol: http
    slow_response_duration: 100ms
    slow_call_rate_threshold: 0.8
    window_size: 10
    min_requests: 10
    consecutive_failures: 0
    open_duration: 4m
`

// wrk (keep-alive, two connections) against a server that answers after
// 150 ms: every response is slow, and the slow-call rate opens the circuit
// once the window holds min_requests responses; then wrk's new connections
// are refused.
func TestSlowResponsesWithWrk(t *testing.T) {
	needPrograms(t, "wrk")
	f := newFixture(t, slowHTTPConfig)
	f.srv.ServeHTTPCases(t, 8100)
	f.start()
	out, err := f.topo.Client.Command(f.cg, "wrk", "-t1", "-c2", "-d2s", fmt.Sprintf("http://%s:8100/slow", f.srv.IPv4)).Run(t)
	if err != nil {
		t.Fatalf("wrk: %v %s", err, out)
	}
	f.waitState("web", "open", 3*time.Second)
	evs := f.d.Events()
	if last := evs[len(evs)-1]; last.Reason != "slow_call_rate" || last.SlowRate < 0.8 {
		t.Fatalf("transition %+v", last)
	}
	if got := errnos(f.dial(8100, 2, 0)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("connects to the open circuit: %v", got)
	}
}

const dropConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8101"]}
    protocol: http
    consecutive_failures: 2
    reset_failure_window: 0s
    open_duration: 4m
`

// A server that closes or resets the connection before any byte of its
// answer fails the request (response_dropped) even with resets not counted by
// themselves (reset_failure_window 0); one that resets during its answer
// counts the answer's status and, with reset_failure_window 0, nothing
// more; a client that gives up first counts nothing.
func TestDroppedRequestsAreFailures(t *testing.T) {
	f := newFixture(t, dropConfig)
	f.srv.ServeHTTPCases(t, 8101)
	f.start()
	f.keepAlive(8101, 5*time.Second, "/reset-during")
	f.waitOutcomes("response", "web", 1)
	f.keepAlive(8101, 300*time.Millisecond, "/never")
	f.waitOutcomes("response_abandoned", "web", 1)
	if s, _ := f.circuit("web"); s.Calls != 1 || s.Failures != 0 {
		t.Fatalf("after an answer reset midway and a request given up: %+v", s)
	}
	f.keepAlive(8101, 5*time.Second, "/close-before")
	f.keepAlive(8101, 5*time.Second, "/reset-before")
	f.waitState("web", "open", 3*time.Second)
	if n := f.outcomeCount("response_dropped", "web"); n != 2 {
		t.Fatalf("%v dropped, want 2", n)
	}
}
