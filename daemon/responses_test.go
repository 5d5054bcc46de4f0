package daemon

import (
	"bufio"
	"fmt"
	"io"
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
	f.d.hold()
	defer f.d.release()
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
	// The client's close wrote its no_response record; a later record
	// counted means it has been read.
	f.sentinel(f.cg, 9190)
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

const orderConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8090", "8091"]}
    protocol: http
    consecutive_failures: 2
    window_size: 100
    min_requests: 100
    open_duration: 4m
`

// TestCountedSuccessesKeepTheOrder: the kernel counts ordinary successes
// without a record each (RespBatch), and the daemon still sees every
// success in its place among the failures, across connections: a 503, a
// success on another connection, a 503 on a third is never two
// consecutive failures. The tick (which would write the counts out too) is
// kept out of the way, so only the kernel's writing them out before each
// failure's record can keep the order.
func TestCountedSuccessesKeepTheOrder(t *testing.T) {
	f := newFixture(t, orderConfig)
	f.tick = time.Hour
	f.srv.ServeHTTPCases(t, 8090)
	f.start()
	for i, paths := range [][]string{{"/503"}, {"/ok", "/404"}, {"/503"}, {"/ok"}, {"/503", "/ok"}, {"/503"}} {
		for _, r := range f.keepAlive(8090, 5*time.Second, paths...) {
			if r.Errno != 0 {
				t.Fatalf("connection %d: %+v", i, r)
			}
		}
	}
	f.waitOutcomes("response_status", "web", 4)
	f.waitOutcomes("response", "web", 4)
	c, _ := f.circuit("web")
	if c.State != "closed" || c.ConsecutiveFailures != 1 || c.Calls != 8 {
		t.Fatalf("after 503s each with a success before it: %+v", c)
	}
	// Failures of other kinds, each after a success on another
	// connection: a reset before the answer (the connection's end), and a
	// refused connect to the target's other port (sockops' record).
	f.keepAlive(8090, 5*time.Second, "/ok")
	if r := f.keepAlive(8090, 5*time.Second, "/reset-before"); r[0].Errno == 0 {
		t.Fatalf("reset-before answered: %+v", r)
	}
	f.keepAlive(8090, 5*time.Second, "/ok")
	if got := errnos(f.dial(8091, 1, time.Second)); got[unix.ECONNREFUSED] != 1 {
		t.Fatalf("connect to the closed port: %v", got)
	}
	f.waitOutcomes("response_dropped", "web", 1)
	f.waitOutcomes("refused", "web", 1)
	if c, _ := f.circuit("web"); c.State != "closed" || c.ConsecutiveFailures != 1 || c.Calls != 12 {
		t.Fatalf("after a reset and a refused connect each with a success before it: %+v", c)
	}
	f.d.hold()
	batched := f.d.eng.Counting()
	f.d.release()
	if batched != 1 {
		t.Fatalf("%d circuits count their successes in the kernel, want 1 (web)", batched)
	}
	// Two 503s with nothing between them open it.
	f.keepAlive(8090, 5*time.Second, "/503")
	f.waitState("web", "open", 3*time.Second)
	evs := f.d.Events()
	if last := evs[len(evs)-1]; last.Reason != "consecutive_failures" || last.Calls != 13 {
		t.Fatalf("transition %+v", last)
	}
}

// TestCountedSuccessesReachTheDaemon: successes with no failure after them
// are written out at the next tick, so a quiet circuit's window and
// metrics are at most a tick behind; a custom failure list the kernel
// cannot apply (404 a failure) has every response recorded.
func TestCountedSuccessesReachTheDaemon(t *testing.T) {
	f := newFixture(t, httpConfig)
	f.srv.ServeHTTPCases(t, 8090)
	f.start()
	f.keepAlive(8090, 5*time.Second, "/ok", "/ok", "/404")
	f.waitOutcomes("response", "web", 3)
	if c, _ := f.circuit("web"); c.Calls != 3 {
		t.Fatalf("calls %d, want 3", c.Calls)
	}
	f.writeConfig(strings.Replace(httpConfig, "protocol: http", "protocol: http\n    failure_statuses: [\"5xx\", \"404\"]", 1))
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		f.d.hold()
		defer f.d.release()
		return f.d.eng.Counting() == 0
	}) {
		t.Fatal("a target whose failures include 404 still has its successes counted in the kernel")
	}
	f.keepAlive(8090, 5*time.Second, "/404", "/404", "/404")
	f.waitState("web", "open", 3*time.Second)
}

// pooledClient is one Python http.client connection, kept open across
// whatever the test does in between, that makes a request for each path
// it is given.
type pooledClient struct {
	in  io.WriteCloser
	out *bufio.Scanner
}

func (f *fixture) pooled(port uint16) *pooledClient {
	f.t.Helper()
	py := filepath.Join(f.t.TempDir(), "pooled.py")
	src := `import http.client, sys
c = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=10)
for line in sys.stdin:
    c.request("GET", line.strip())
    r = c.getresponse()
    r.read()
    print(r.status, flush=True)
`
	if err := os.WriteFile(py, []byte(src), 0o644); err != nil {
		f.t.Fatal(err)
	}
	p := f.topo.Client.Command(f.cg, "python3", py, f.srv.IPv4.String(), fmt.Sprint(port))
	in, err := p.Cmd.StdinPipe()
	if err != nil {
		f.t.Fatal(err)
	}
	out, err := p.Cmd.StdoutPipe()
	if err != nil {
		f.t.Fatal(err)
	}
	if err := p.Start(f.t); err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { in.Close() })
	return &pooledClient{in: in, out: bufio.NewScanner(out)}
}

func (c *pooledClient) get(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		fmt.Fprintln(c.in, p)
		if !c.out.Scan() {
			t.Fatalf("pooled client: no answer to %s (%v)", p, c.out.Err())
		}
	}
}

// TestCountedSuccessesAcrossRestarts: a restart gives the circuit's
// answered word a new epoch, so a connection pooled across it records
// each response (counted exactly once, by the new daemon) while new
// connections count theirs again; successes counted and not yet written
// out when the daemon stopped are not credited to the new one, as no turn
// begun before a start is.
func TestCountedSuccessesAcrossRestarts(t *testing.T) {
	needPrograms(t, "python3")
	f := newFixture(t, httpConfig)
	f.tick = time.Hour // only the kernel writes counts out, before records
	f.srv.ServeHTTPCases(t, 8090)
	f.start()
	pool := f.pooled(8090)
	pool.get(t, "/ok", "/404", "/ok")
	c, _ := f.circuit("web")
	id := c.CircuitID
	epoch1, n, err := f.d.Kernel().Answered(id)
	if err != nil || n != 3 {
		t.Fatalf("answered word of circuit id %d: epoch %d count %d (%v), want 3 counted", id, epoch1, n, err)
	}
	f.restart()
	epoch2, n, _ := f.d.Kernel().Answered(id)
	if epoch2 == epoch1 || n != 0 {
		t.Fatalf("after the restart: epoch %d count %d, want a new epoch (not %d) and 0", epoch2, n, epoch1)
	}
	pool.get(t, "/ok", "/404") // recorded one by one (read with the 503's wake-up below)
	if _, n, _ := f.d.Kernel().Answered(id); n != 0 {
		t.Fatalf("the pooled connection of the daemon before counted %d in the new epoch", n)
	}
	f.keepAlive(8090, 5*time.Second, "/ok", "/ok", "/503")
	f.waitOutcomes("response_status", "web", 1)
	f.waitOutcomes("response", "web", 4)
	if c, _ := f.circuit("web"); c.Calls != 5 || c.ConsecutiveFailures != 1 {
		t.Fatalf("after the restart: %+v", c)
	}
}

// Review findings on counted successes, each a sequence that once lost a
// failure or put a success on the wrong side of one.
func TestCountedSuccessesReviewCases(t *testing.T) {
	needPrograms(t, "python3")
	custom := strings.Replace(orderConfig, "protocol: http", "protocol: http\n    failure_statuses: [\"5xx\", \"404\"]", 1)
	waitBatched := func(t *testing.T, f *fixture, want int) {
		t.Helper()
		if !kerneltest.WaitFor(5*time.Second, func() bool {
			f.d.hold()
			defer f.d.release()
			return f.d.eng.Counting() == want
		}) {
			t.Fatalf("circuits counting successes in the kernel: want %d", want)
		}
	}
	// A restart into a list the kernel cannot apply: sockets the old
	// daemon marked must not go on counting 404s (failures now) as
	// successes nobody reads.
	t.Run("restart to a custom list", func(t *testing.T) {
		f := newFixture(t, orderConfig)
		f.srv.ServeHTTPCases(t, 8090)
		f.start()
		pool := f.pooled(8090)
		pool.get(t, "/ok")
		f.writeConfig(custom)
		f.restart()
		pool.get(t, "/404", "/404")
		f.waitState("web", "open", 3*time.Second)
	})
	// A socket marked while its circuit did not count successes writes
	// its failure after the successes counted since by other sockets.
	t.Run("a socket marked before counting", func(t *testing.T) {
		f := newFixture(t, custom)
		f.tick = time.Hour
		f.srv.ServeHTTPCases(t, 8090)
		f.start()
		pool := f.pooled(8090)
		pool.get(t, "/ok")
		f.writeConfig(orderConfig)
		if err := f.d.Reload(); err != nil {
			t.Fatal(err)
		}
		waitBatched(t, f, 1)
		pool.get(t, "/503")
		f.keepAlive(8090, 5*time.Second, "/ok")
		pool.get(t, "/503")
		f.waitOutcomes("response_status", "web", 2)
		if c, _ := f.circuit("web"); c.State != "closed" || c.ConsecutiveFailures != 1 {
			t.Fatalf("a 503, a success, a 503: %+v", c)
		}
	})
	// A reload that changes the bound keeps what was counted before it.
	t.Run("a reload with another bound", func(t *testing.T) {
		f := newFixture(t, orderConfig)
		f.tick = time.Hour
		f.srv.ServeHTTPCases(t, 8090)
		f.start()
		f.keepAlive(8090, 5*time.Second, "/503")
		f.keepAlive(8090, 5*time.Second, "/ok")
		f.writeConfig(strings.Replace(orderConfig, "protocol: http", "protocol: http\n    slow_response_duration: 5s", 1))
		if err := f.d.Reload(); err != nil {
			t.Fatal(err)
		}
		f.keepAlive(8090, 5*time.Second, "/503")
		f.waitOutcomes("response_status", "web", 2)
		if c, _ := f.circuit("web"); c.State != "closed" || c.ConsecutiveFailures != 1 || c.Calls != 3 {
			t.Fatalf("a 503, a success, a reload, a 503: %+v", c)
		}
	})
	// A target that stops following responses is credited no success its
	// old sockets count.
	t.Run("a target that stops following", func(t *testing.T) {
		both := orderConfig + "  other:\n    match: {cidrs: [SRV], ports: [\"8092\"]}\n    protocol: http\n"
		f := newFixture(t, both)
		f.srv.ServeHTTPCases(t, 8090)
		f.start()
		pool := f.pooled(8090)
		pool.get(t, "/ok")
		f.waitOutcomes("response", "web", 1)
		f.writeConfig(strings.Replace(both, "    protocol: http\n    consecutive_failures: 2", "    consecutive_failures: 2", 1))
		if err := f.d.Reload(); err != nil {
			t.Fatal(err)
		}
		before, _ := f.circuit("web")
		pool.get(t, "/ok", "/ok", "/ok")
		// What the kernel counted for them is written out (as a tick
		// does) and read before a later record is.
		f.d.flushAnswered()
		f.sentinel(f.cg, 9190)
		if c, _ := f.circuit("web"); c.Calls != before.Calls {
			t.Fatalf("calls %d after the target stopped following responses, %d before", c.Calls, before.Calls)
		}
	})
}
