package daemon

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// Response timing with no parsing, against real PostgreSQL and memcached
// servers and their unmodified clients (psql, pgbench; libmemcached's
// memccat, memcping, memcslap), as TestSlowRedisOpensOnSlowCalls does for
// Redis. Each test starts its own server on the server host of its
// topology (a network namespace of its own), stops it by PID and removes
// its files when it ends, also when it fails.

// psql runs psql in the protected cgroup, one query message per sql on
// one connection.
func (f *fixture) psql(pg *kerneltest.Postgres, sqls ...string) (string, error) {
	f.t.Helper()
	return pg.PSQL(f.t, f.topo.Client, f.cg, sqls...)
}

// pgStart is how many calls the start of a libpq connection is here (see
// kerneltest.PostgresStartTurns: the SSLRequest, the startup message and
// SCRAM's two messages, each answered). The Terminate message a client
// sends as it closes has no answer: the client closes its side first and
// it counts as nothing (response_abandoned), or, when the backend closes
// first, it is a peer's close before any answer (response_dropped), a
// failure unless count_dropped is false.
const pgStart = kerneltest.PostgresStartTurns

const postgresConfig = `
failsafe_timeout: 30s
targets:
  pg:
    match: {cidrs: [SRV], ports: ["5491"]}
    count_dropped: false  # the Terminate a client sends as it closes (see pgStart)
    slow_response_duration: 200ms
    slow_call_rate_threshold: 1
    window_size: 3
    min_requests: 3
    consecutive_failures: 3
    open_duration: 2s
    jitter: 0
    reject_errno: EHOSTUNREACH
`

// PostgreSQL with no parsing: every message a libpq client sends and the
// server answers is a call (the connection's start is four of them). Quick
// queries from psql and pgbench are successes and keep the circuit closed;
// three `SELECT pg_sleep(0.25)` in a row on one connection are slow calls
// that open it (slow-call rate 1 in a window of 3); then psql is refused
// in connect() with the configured EHOSTUNREACH and no SYN reaches the
// server; once due, psql's next connection is the probe, judged by its
// first response (the SSLRequest's), and closes the circuit. Each
// connection's Terminate counts as nothing (count_dropped false, for the
// runs where the backend closes before the client).
func TestPostgresSlowQueriesOpenTheCircuit(t *testing.T) {
	f := newFixture(t, postgresConfig)
	needPrograms(t, "psql", "pgbench")
	pg := f.srv.StartPostgres(t, 5491)
	f.start()
	if out, err := f.psql(pg, "SELECT 40 + 2"); err != nil || strings.TrimSpace(out) != "42" {
		t.Fatalf("psql: %v %s", err, out)
	}
	responses := float64(pgStart + 1)
	f.waitOutcomes("response", "pg", responses)
	f.waitGoodbyes("pg", 1) // its Terminate

	// pgbench: a connection to set up, then two clients of ten
	// transactions of two queries each.
	script := filepath.Join(t.TempDir(), "quick.sql")
	if err := os.WriteFile(script, []byte("SELECT 1;\nSELECT now();\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := pg.Client(f.topo.Client, f.cg, "pgbench", "-n", "-f", script, "-c", "2", "-t", "10").Run(t)
	if err != nil || !strings.Contains(string(out), "number of failed transactions: 0") {
		t.Fatalf("pgbench: %v\n%s", err, out)
	}
	responses += 3*pgStart + 2*10*2
	f.waitOutcomes("response", "pg", responses)
	f.waitGoodbyes("pg", 1+3)
	if n := f.outcomeCount("response_timeout", "pg"); n != 0 {
		t.Fatalf("%v response timeouts after quick queries", n)
	}
	if c, _ := f.circuit("pg"); c.State != "closed" || c.Failures != 0 || c.Slow != 0 {
		t.Fatalf("after quick queries: %+v", c)
	}

	// Slow queries on one connection: its start rolls out of the window.
	out2, err := f.psql(pg, "SELECT pg_sleep(0.25)", "SELECT pg_sleep(0.25)", "SELECT pg_sleep(0.25)")
	if err != nil {
		t.Fatalf("psql: %v %s", err, out2)
	}
	f.waitState("pg", "open", 3*time.Second)
	evs := f.d.Events()
	if last := evs[len(evs)-1]; last.Reason != "slow_call_rate" || last.SlowRate != 1 || last.Calls != 3 {
		t.Fatalf("transition %+v", last)
	}
	if c, _ := f.circuit("pg"); c.Slow != 3 || c.Failures != 0 {
		t.Fatalf("after three slow queries: %+v", c)
	}
	responses += pgStart + 3
	f.waitOutcomes("response", "pg", responses)

	syns := f.srv.SYNs(t)
	if out, err := f.psql(pg, "SELECT 1"); err == nil || !strings.Contains(out, "No route to host") {
		t.Fatalf("psql against the open circuit: %v %s", err, out)
	}
	if n := f.srv.SYNs(t); n != syns {
		t.Fatalf("%d SYNs reached the open destination", n-syns)
	}
	if c, _ := f.circuit("pg"); c.Rejected != 1 {
		t.Fatalf("rejected %d connects, want psql's one: %+v", c.Rejected, c)
	}

	c, _ := f.circuit("pg")
	time.Sleep(time.Until(c.OpenUntil) + 50*time.Millisecond)
	if out, err := f.psql(pg, "SELECT 1"); err != nil || strings.TrimSpace(out) != "1" {
		t.Fatalf("psql as the probe: %v %s", err, out)
	}
	f.waitState("pg", "closed", 3*time.Second)
	responses += pgStart + 1
	f.waitOutcomes("response", "pg", responses)
	f.waitGoodbyes("pg", 1+3+1+1)
	for _, o := range []string{"response_timeout", "response_status"} {
		if n := f.outcomeCount(o, "pg"); n != 0 {
			t.Fatalf("%v %s", n, o)
		}
	}
	if c, _ := f.circuit("pg"); c.Failures != 0 {
		t.Fatalf("failures in the window: %+v", c)
	}
}

const postgresTimeoutConfig = `
failsafe_timeout: 30s
targets:
  pg:
    match: {cidrs: [SRV], ports: ["5492"]}
    response_timeout: 500ms
    consecutive_failures: 1
    open_duration: 4m
    reject_errno: EHOSTUNREACH
`

// A query whose answer does not come in time (`SELECT pg_sleep(30)`): the
// connection's start is four quick calls; the query is a failure at
// response_timeout while psql still waits, which opens the circuit
// (consecutive_failures 1) and a second psql is refused in connect();
// psql giving up afterwards counts nothing more.
func TestPostgresResponseTimeout(t *testing.T) {
	f := newFixture(t, postgresTimeoutConfig)
	needPrograms(t, "psql")
	pg := f.srv.StartPostgres(t, 5492)
	f.start()
	t0 := time.Now()
	p := pg.Client(f.topo.Client, f.cg, "psql", "-X", "-At", "-c", "SELECT pg_sleep(30)")
	if err := p.Start(t); err != nil {
		t.Fatal(err)
	}
	f.waitState("pg", "open", 5*time.Second)
	took := time.Since(t0)
	if took < 500*time.Millisecond || took > 2500*time.Millisecond {
		t.Fatalf("opened %v after psql started, want about response_timeout (500ms)", took)
	}
	if p.Cmd.ProcessState != nil {
		t.Fatal("psql is gone already: the timeout was not the daemon's")
	}
	if n := f.outcomeCount("response_timeout", "pg"); n != 1 {
		t.Fatalf("%v response timeouts", n)
	}
	if n := f.outcomeCount("response", "pg"); n != pgStart {
		t.Fatalf("%v responses, want the connection's start (%d)", n, pgStart)
	}
	syns := f.srv.SYNs(t)
	if out, err := f.psql(pg, "SELECT 1"); err == nil || !strings.Contains(out, "No route to host") {
		t.Fatalf("psql against the open circuit: %v %s", err, out)
	}
	if n := f.srv.SYNs(t); n != syns {
		t.Fatalf("%d SYNs reached the open destination", n-syns)
	}
	// Killed: on SIGINT psql would send a CancelRequest on a new
	// connection (rejected too) and go on waiting.
	_ = p.Cmd.Process.Kill()
	_ = p.Cmd.Wait()
	f.sentinel(f.cg, 9190) // read after its connection's end
	for o, want := range map[string]float64{"response_timeout": 1, "response_dropped": 0, "response": pgStart} {
		if n := f.outcomeCount(o, "pg"); n != want {
			t.Fatalf("%v %s after psql gave up, want %v", n, o, want)
		}
	}
	if c, _ := f.circuit("pg"); c.Calls != pgStart+1 || c.Failures != 1 || c.Rejected != 1 {
		t.Fatalf("after psql gave up: %+v", c)
	}
}

// memc runs a libmemcached tool in the protected cgroup.
func (f *fixture) memc(m *kerneltest.Memcached, name string, args ...string) (string, error) {
	f.t.Helper()
	out, err := m.Client(f.topo.Client, f.cg, name, args...).Run(f.t)
	return string(out), err
}

// waitAwaiting waits until n requests to the server await their first
// response byte in the kernel's inflight map.
func (f *fixture) waitAwaiting(n int) {
	f.t.Helper()
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		a, err := f.d.Kernel().Awaiting(nil)
		return err == nil && len(a) == n
	}) {
		a, _ := f.d.Kernel().Awaiting(nil)
		f.t.Fatalf("%d requests await their response, want %d: %+v", len(a), n, a)
	}
}

const memcachedConfig = `
failsafe_timeout: 30s
targets:
  cache:
    match: {cidrs: [SRV], ports: ["11291"]}
    count_dropped: false
    slow_response_duration: 200ms
    response_timeout: 1500ms
    slow_call_rate_threshold: 1
    window_size: 3
    min_requests: 3
    consecutive_failures: 2
    open_duration: 2s
    jitter: 0
    reject_errno: EHOSTUNREACH
`

// memcached with no parsing, made slow and then silent by stopping the
// server (SIGSTOP: the kernel still completes the handshakes and queues
// the requests). Quick sets and gets (memccp, memccat, memcslap) are
// successes; three gets answered 300 ms late are slow calls that open the
// circuit (a window of 3, all slow); memcping is then refused in connect()
// with EHOSTUNREACH and no SYN reaches the server; once due, memcping's
// connection is the probe, and its answer closes the circuit; two gets
// that are never answered are failures at response_timeout, while the
// clients still wait, and open it again (consecutive_failures 2). Every
// libmemcached connection ends with quit, which memcached answers by
// closing: with count_dropped false never a failure, whoever closes first.
func TestMemcachedSlowAndSilentServer(t *testing.T) {
	f := newFixture(t, memcachedConfig)
	needPrograms(t, "memcached", "memccat", "memccp", "memcping", "memcslap")
	m := f.srv.StartMemcached(t, 11291)
	f.start()
	value := filepath.Join(t.TempDir(), "k1")
	if err := os.WriteFile(value, []byte("v1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := f.memc(m, "memccp", value); err != nil {
		t.Fatalf("memccp: %v %s", err, out)
	}
	if out, err := f.memc(m, "memccat", "k1", "k1", "k1"); err != nil || out != "v1\nv1\nv1\n" {
		t.Fatalf("memccat: %v %q", err, out)
	}
	f.waitOutcomes("response", "cache", 1+3)
	if out, err := f.memc(m, "memcslap", "--concurrency=2", "--execute-number=50", "--test=get"); err != nil {
		t.Fatalf("memcslap: %v %s", err, out)
	}
	// memcslap: 50 sets to load, then 50 gets on each of its two
	// connections.
	f.waitOutcomes("response", "cache", 1+3+50+2*50)
	// Each of the four connections ended with libmemcached's quit, which
	// memcached answers by closing: before the client shut its side
	// (response_dropped, not a call with count_dropped false) or after it
	// (response_abandoned), as the race between them goes.
	f.waitGoodbyes("cache", 4)
	if n := f.outcomeCount("response_timeout", "cache"); n != 0 {
		t.Fatalf("%v response timeouts after quick commands", n)
	}
	if c, _ := f.circuit("cache"); c.State != "closed" || c.Failures != 0 || c.Slow != 0 {
		t.Fatalf("after quick commands: %+v", c)
	}
	quick := f.outcomeCount("response", "cache")

	// Slow: three gets wait while the server is stopped, then get their
	// answers 300 ms later.
	m.Signal(t, syscall.SIGSTOP)
	var gets []*kerneltest.Process
	for range 3 {
		p := m.Client(f.topo.Client, f.cg, "memccat", "k1")
		if err := p.Start(t); err != nil {
			t.Fatal(err)
		}
		gets = append(gets, p)
	}
	f.waitAwaiting(3)
	time.Sleep(300 * time.Millisecond)
	m.Signal(t, syscall.SIGCONT)
	for _, p := range gets {
		if err := p.Cmd.Wait(); err != nil {
			t.Fatalf("memccat against the slow server: %v", err)
		}
	}
	f.waitState("cache", "open", 3*time.Second)
	evs := f.d.Events()
	if last := evs[len(evs)-1]; last.Reason != "slow_call_rate" || last.SlowRate != 1 {
		t.Fatalf("transition %+v", last)
	}
	if c, _ := f.circuit("cache"); c.Slow != 3 || c.Failures != 0 {
		t.Fatalf("after three slow gets: %+v", c)
	}
	f.waitOutcomes("response", "cache", quick+3)

	syns := f.srv.SYNs(t)
	if out, err := f.memc(m, "memcping"); err == nil {
		t.Fatalf("memcping against the open circuit succeeded: %s", out)
	}
	if n := f.srv.SYNs(t); n != syns {
		t.Fatalf("%d SYNs reached the open destination", n-syns)
	}
	c, _ := f.circuit("cache")
	if c.Rejected == 0 {
		t.Fatalf("no connect rejected: %+v", c)
	}

	time.Sleep(time.Until(c.OpenUntil) + 50*time.Millisecond)
	if out, err := f.memc(m, "memcping"); err != nil {
		t.Fatalf("memcping as the probe: %v %s", err, out)
	}
	f.waitState("cache", "closed", 3*time.Second)

	// Silent: two gets never answered.
	m.Signal(t, syscall.SIGSTOP)
	t0 := time.Now()
	gets = gets[:0]
	for range 2 {
		p := m.Client(f.topo.Client, f.cg, "memccat", "k1")
		if err := p.Start(t); err != nil {
			t.Fatal(err)
		}
		gets = append(gets, p)
	}
	f.waitState("cache", "open", 5*time.Second)
	if took := time.Since(t0); took < 1500*time.Millisecond || took > 3500*time.Millisecond {
		t.Fatalf("opened %v after the gets, want about response_timeout (1.5s)", took)
	}
	for _, p := range gets {
		if p.Cmd.ProcessState != nil {
			t.Fatal("memccat is gone already: the timeout was not the daemon's")
		}
	}
	if n := f.outcomeCount("response_timeout", "cache"); n != 2 {
		t.Fatalf("%v response timeouts, want 2", n)
	}
	if evs := f.d.Events(); evs[len(evs)-1].Reason != "consecutive_failures" {
		t.Fatalf("transition %+v", evs[len(evs)-1])
	}
	if r := errnos(f.dial(11291, 2, 0)); r[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("connects to the open circuit: %v", r)
	}
	for _, p := range gets {
		_ = p.Cmd.Process.Kill()
		_ = p.Cmd.Wait()
	}
	m.Signal(t, syscall.SIGCONT)
	f.sentinel(f.cg, 9190) // read after the connections' ends
	if n := f.outcomeCount("response_timeout", "cache"); n != 2 {
		t.Fatalf("%v response timeouts after the clients gave up, want still 2", n)
	}
	// The three slow gets' and the probe's connections ended with quit
	// too; the two killed while waiting were counted at the timeout.
	f.waitGoodbyes("cache", 4+3+1)
	if c, _ := f.circuit("cache"); c.Failures != 2 {
		t.Fatalf("failures in the window: %+v, want the two timeouts", c)
	}
}

// waitGoodbyes waits until target's connections that ended while a
// request awaited its answer (the peer's close first, or the client's)
// add up to n.
func (f *fixture) waitGoodbyes(target string, n float64) {
	f.t.Helper()
	ends := func() float64 {
		return f.outcomeCount("response_dropped", target) + f.outcomeCount("response_abandoned", target)
	}
	if !kerneltest.WaitFor(3*time.Second, func() bool { return ends() == n }) {
		f.t.Fatalf("%v connections of %s ended awaiting an answer (dropped %v, abandoned %v), want %v", ends(), target,
			f.outcomeCount("response_dropped", target), f.outcomeCount("response_abandoned", target), n)
	}
}

const countDroppedConfig = `
failsafe_timeout: 30s
targets:
  counted:
    match: {cidrs: [SRV], ports: ["8102"]}
    response_timeout: 2s
    consecutive_failures: 100
    count_dropped: true
  ignored:
    match: {cidrs: [SRV], ports: ["8103"]}
    response_timeout: 2s
    consecutive_failures: 100
    count_dropped: false
`

// count_dropped: a server that closes the connection (FIN) before any
// byte of its answer fails the request with count_dropped true and counts
// as nothing with count_dropped false, the default without protocol http
// (in response_dropped all the same); a reset
// before any byte fails it either way.
func TestCountDropped(t *testing.T) {
	f := newFixture(t, countDroppedConfig)
	f.srv.ServeHTTPCases(t, 8102)
	f.srv.ServeHTTPCases(t, 8103)
	f.start()
	for _, port := range []uint16{8102, 8103} {
		f.keepAlive(port, 5*time.Second, "/close-before")
		f.keepAlive(port, 5*time.Second, "/close-before")
		f.keepAlive(port, 5*time.Second, "/reset-before")
		f.keepAlive(port, 5*time.Second, "/ok")
	}
	f.waitOutcomes("response_dropped", "counted", 3)
	f.waitOutcomes("response_dropped", "ignored", 3)
	f.waitOutcomes("response", "ignored", 1)
	if c, _ := f.circuit("counted"); c.Calls != 4 || c.Failures != 3 {
		t.Fatalf("counted: %+v, want 4 calls, 3 failed", c)
	}
	if c, _ := f.circuit("ignored"); c.Calls != 2 || c.Failures != 1 {
		t.Fatalf("ignored: %+v, want 2 calls (the reset and the answer), 1 failed", c)
	}
	if info, _ := f.circuit("ignored"); info.Options["count_dropped"] != false {
		t.Fatalf("options in the API: %v", info.Options)
	}
}

const countDroppedReloadConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8104"]}
    response_timeout: 2s
    consecutive_failures: 100
    count_dropped: COUNT
`

// count_dropped changed by a reload applies from the next request, and the
// circuit keeps its window; a restart reads it from the file like the rest.
func TestCountDroppedFollowsReloadAndRestart(t *testing.T) {
	config := func(on bool) string {
		return strings.ReplaceAll(countDroppedReloadConfig, "COUNT", fmt.Sprint(on))
	}
	f := newFixture(t, config(true))
	f.srv.ServeHTTPCases(t, 8104)
	f.start()
	window := func(when string, calls, failures int) {
		t.Helper()
		if !kerneltest.WaitFor(3*time.Second, func() bool {
			c, _ := f.circuit("web")
			return c.Calls == calls && c.Failures == failures
		}) {
			c, _ := f.circuit("web")
			t.Fatalf("%s: %+v, want %d calls, %d failed", when, c, calls, failures)
		}
	}
	f.keepAlive(8104, 5*time.Second, "/close-before")
	f.keepAlive(8104, 5*time.Second, "/close-before")
	f.waitOutcomes("response_dropped", "web", 2)
	window("counted", 2, 2)

	f.writeConfig(config(false))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if c, _ := f.circuit("web"); c.Options["count_dropped"] != false {
		t.Fatalf("options after the reload: %v", c.Options)
	}
	f.keepAlive(8104, 5*time.Second, "/close-before")
	f.keepAlive(8104, 5*time.Second, "/ok")
	f.waitOutcomes("response_dropped", "web", 3)
	window("after the reload", 3, 2) // the answer counted, the dropped request not

	f.restart()
	if c, _ := f.circuit("web"); c.Options["count_dropped"] != false {
		t.Fatalf("options after the restart: %v", c.Options)
	}
	f.keepAlive(8104, 5*time.Second, "/close-before")
	f.waitOutcomes("response_dropped", "web", 1)
	window("after the restart", 0, 0)

	f.writeConfig(config(true))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	f.keepAlive(8104, 5*time.Second, "/close-before")
	f.waitOutcomes("response_dropped", "web", 2)
	window("after a reload turning it on", 1, 1)
	f.waitAwaiting(0)
}

const informationalConfig = `
failsafe_timeout: 30s
targets:
  expect:
    match: {cidrs: [SRV], ports: ["8110"]}
    protocol: http
    consecutive_failures: 3
    window_size: 100
    min_requests: 100
    open_duration: 4m
  continue:
    match: {cidrs: [SRV], ports: ["8111"]}
    protocol: http
    consecutive_failures: 3
    window_size: 100
    min_requests: 100
    open_duration: 4m
  hints:
    match: {cidrs: [SRV], ports: ["8112"]}
    protocol: http
    consecutive_failures: 3
    window_size: 100
    min_requests: 100
    open_duration: 4m
  segments:
    match: {cidrs: [SRV], ports: ["8113"]}
    protocol: http
    consecutive_failures: 3
    window_size: 100
    min_requests: 100
    open_duration: 4m
`

// Informational responses are no calls: against servers that answer 1xx
// before their final status, each request is one call judged by the final
// status, and three 503s in a row open the circuit. curl POSTs a body with
// "Expect: 100-continue" (the 100 before the body, the 503 after it);
// Python's http.client gets an unsolicited 100 Continue, then the 503; Go's
// net/http gets 103 Early Hints with Link headers, then the 503 100 ms
// later, and 100, 103 and the status in one segment or split across
// segments inside the 103's blank line. Before any 503, each request is
// one success and the 1xx none.
func TestInformationalResponsesOpenTheCircuit(t *testing.T) {
	needPrograms(t, "curl", "python3")
	f := newFixture(t, informationalConfig)
	srvs := map[string]*kerneltest.HTTPServer{}
	for name, port := range map[string]uint16{"expect": 8110, "continue": 8111, "hints": 8112, "segments": 8113} {
		srvs[name] = f.srv.ServeHTTPCases(t, port)
	}
	f.start()
	body := filepath.Join(t.TempDir(), "body")
	if err := os.WriteFile(body, []byte(strings.Repeat("x", 3000)), 0o644); err != nil {
		t.Fatal(err)
	}
	// curlExpect POSTs the body n times over one keep-alive connection,
	// each with Expect: 100-continue, and returns the statuses.
	curlExpect := func(n int) string {
		t.Helper()
		args := []string{"-sS", "--max-time", "10", "-w", "%{http_code} ", "-H", "Expect: 100-continue", "--data-binary", "@" + body}
		for range n {
			args = append(args, "-o", "/dev/null", fmt.Sprintf("http://%s:8110/404", f.srv.IPv4))
		}
		out, err := f.topo.Client.Command(f.cg, "curl", args...).Run(t)
		if err != nil {
			t.Fatalf("curl: %v %s", err, out)
		}
		return strings.TrimSpace(string(out))
	}
	const py = `import http.client, sys
c = http.client.HTTPConnection(sys.argv[1], 8111, timeout=5)
for _ in range(int(sys.argv[2])):
    c.request("GET", "/continue"); r = c.getresponse(); r.read(); print(r.status, end=" ")
`
	python := func(n int) string {
		t.Helper()
		out, err := f.topo.Client.Command(f.cg, "python3", "-c", py, f.srv.IPv4.String(), fmt.Sprint(n)).Run(t)
		if err != nil {
			t.Fatalf("python: %v %s", err, out)
		}
		return strings.TrimSpace(string(out))
	}
	goClient := func(port uint16, paths ...string) string {
		t.Helper()
		var got []string
		for _, r := range f.keepAlive(port, 5*time.Second, paths...) {
			if r.Errno != 0 {
				t.Fatalf("net/http to %d: %+v", port, r)
			}
			got = append(got, fmt.Sprint(r.Status))
		}
		return strings.Join(got, " ")
	}
	check := func(when, target, got, want string, calls, failures int) {
		t.Helper()
		if got != want {
			t.Fatalf("%s: %s saw %q, want %q", when, target, got, want)
		}
		f.waitOutcomes("response", target, 2)
		f.waitOutcomes("response_status", target, float64(failures))
		if failures > 0 {
			f.waitState(target, "open", 3*time.Second)
			evs := f.d.Events()
			if last := evs[len(evs)-1]; last.Target != target || last.Reason != "consecutive_failures" || last.Calls != calls {
				t.Fatalf("%s: %s's transition %+v, want consecutive_failures at call %d", when, target, last, calls)
			}
		} else if c, _ := f.circuit(target); c.State != "closed" || c.Calls != calls || c.Failures != 0 {
			t.Fatalf("%s: %s %+v, want %d calls, none failed", when, target, c, calls)
		}
	}

	check("healthy", "expect", curlExpect(2), "404 404", 2, 0)
	check("healthy", "continue", python(2), "200 200", 2, 0)
	check("healthy", "hints", goClient(8112, "/early-hints", "/early-hints"), "200 200", 2, 0)
	check("healthy", "segments", goClient(8113, "/one-segment", "/split-hints"), "200 200", 2, 0)

	for _, s := range srvs {
		s.FailWith(503)
	}
	check("failing", "expect", curlExpect(3), "503 503 503", 5, 3)
	check("failing", "continue", python(3), "503 503 503", 5, 3)
	check("failing", "hints", goClient(8112, "/early-hints", "/early-hints", "/early-hints"), "503 503 503", 5, 3)
	check("failing", "segments", goClient(8113, "/one-segment", "/split-hints", "/one-segment"), "503 503 503", 5, 3)
	if _, code := f.curl(fmt.Sprintf("http://%s:8110/404", f.srv.IPv4)); code != 7 {
		t.Fatalf("curl to the open circuit exits %d, want 7 (connection refused)", code)
	}
}

const informationalTimeoutConfig = `
failsafe_timeout: 30s
targets:
  hints:
    match: {cidrs: [SRV], ports: ["8114"]}
    protocol: http
    response_timeout: 300ms
    consecutive_failures: 100
`

// response_timeout runs until the final status, not the first 1xx: a 103
// Early Hints at once and the answer 600 ms later is a response_timeout
// (counted while the client waits), and the late answer is not counted
// again; a quick answer after a 103 is a response.
func TestInformationalResponsesKeepTheTimeout(t *testing.T) {
	f := newFixture(t, informationalTimeoutConfig)
	f.srv.ServeHTTPCases(t, 8114)
	f.start()
	for _, r := range f.keepAlive(8114, 5*time.Second, "/hints-slow", "/one-segment") {
		if r.Errno != 0 || r.Status != 200 {
			t.Fatalf("requests: %+v", r)
		}
	}
	// A 503 on a new connection is the sentinel: once it is counted,
	// every record before it in the ring is too.
	f.keepAlive(8114, 5*time.Second, "/503")
	f.waitOutcomes("response_status", "hints", 1)
	if r, to := f.outcomeCount("response", "hints"), f.outcomeCount("response_timeout", "hints"); r != 1 || to != 1 {
		t.Fatalf("%v responses and %v timeouts, want 1 of each (the late answer not counted again)", r, to)
	}
	if c, _ := f.circuit("hints"); c.Calls != 3 || c.Failures != 2 {
		t.Fatalf("%+v, want 3 calls, 2 failed (the timeout and the 503)", c)
	}
}
