package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// Responses with the real binary, across a SIGKILL and a restart on the
// same pins: unmodified curl, keep-alive over several URLs, opens the
// circuit with 503s; once breakerd is killed, the pinned verdict keeps
// rejecting (no SYN gets out) and a new breakerd adopts it; a request that
// awaits its answer across the kill is counted by no daemon twice (the new
// one counts no turn begun before it started); 404s count as successes.
func TestResponsesAcrossSIGKILL(t *testing.T) {
	w := newWorld(t, 1, `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV0], ports: ["8097"]}
    protocol: http
    response_timeout: 500ms
    consecutive_failures: 3
    open_duration: 4m
  slow:
    match: {cidrs: [SRV0], ports: ["8098"]}
    protocol: http
    response_timeout: 500ms
    consecutive_failures: 100
  sentinel:
    match: {cidrs: [SRV0], ports: ["8099"]}
    protocol: http
    response_timeout: 500ms
    consecutive_failures: 100
`)
	srv := w.topo.Servers[0]
	web := srv.ServeHTTPCases(t, 8097)
	srv.ServeHTTPCases(t, 8098)
	srv.ServeHTTPCases(t, 8099)
	w.start()
	base := fmt.Sprintf("http://%s:8097", srv.IPv4)
	if r := w.curl(w.cg, base+"/404", "-o", "/dev/null", base+"/404"); r.exit != 0 {
		t.Fatalf("curl: %+v", r)
	}
	web.FailWith(503)
	if r := w.curl(w.cg, base+"/a", "-o", "/dev/null", base+"/b", "-o", "/dev/null", base+"/c"); r.exit != 0 {
		t.Fatalf("curl: %+v", r)
	}
	w.waitState("web", "open", 3*time.Second)
	if m := w.metrics(); !strings.Contains(m, `breakerd_connection_outcomes_total{outcome="response_status",target="web",workload="shared"} 3`) ||
		!strings.Contains(m, `breakerd_connection_outcomes_total{outcome="response",target="web",workload="shared"} 2`) {
		t.Fatalf("metrics:\n%s", grep(m, "outcome=\"response"))
	}

	// A request that waits across the kill: counted once, by the first
	// daemon, at response_timeout.
	hold := w.topo.Client.StartDial(t, w.cg, kerneltest.DialSpec{Op: "keepalive", Addr: netip.AddrPortFrom(srv.IPv4, 8098), Timeout: 20 * time.Second,
		Requests: []kerneltest.HTTPRequest{{Path: "/never"}}})
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		return strings.Contains(w.metrics(), `breakerd_connection_outcomes_total{outcome="response_timeout",target="slow",workload="shared"} 1`)
	}) {
		t.Fatalf("no response_timeout counted:\n%s", grep(w.metrics(), "outcome=\"response"))
	}
	w.signal(syscall.SIGKILL)
	syns := srv.SYNs(t)
	if r := w.curl(w.cg, base+"/d"); r.exit != 7 {
		t.Fatalf("with breakerd killed, curl to the open circuit: %+v", r)
	}
	w.start()
	w.waitState("web", "open", 3*time.Second)
	if r := w.curl(w.cg, base+"/e"); r.exit != 7 {
		t.Fatalf("after the restart, curl to the open circuit: %+v", r)
	}
	if n := srv.SYNs(t); n != syns {
		t.Fatalf("%d SYNs reached the open destination across the SIGKILL", n-syns)
	}
	// A request begun after the restart is counted at its timeout by a
	// pass over every request in flight, the older one's too: that one
	// must not be counted again.
	awaitSentinelTimeout(t, w, srv.IPv4)
	if m := w.metrics(); strings.Contains(m, `outcome="response_timeout",target="slow"`) {
		t.Fatalf("the new daemon counted the request begun before it:\n%s", grep(m, "outcome=\"response"))
	}
	if c := w.circuits()["slow"]; c.Calls != 0 {
		t.Fatalf("slow's window after the restart: %+v", c)
	}
	hold.Cmd.Process.Kill()
	hold.Cmd.Wait()
}

// PostgreSQL and memcached with the real binary, across a SIGKILL and a
// restart on the same pins: quick pgbench and memccat calls are successes
// (counted exactly in /metrics, each libpq connection's start four of
// them); three slow queries from psql open one circuit, a get that a
// stopped memcached never answers opens the other at response_timeout
// while memccat waits; once breakerd is killed the pinned verdicts keep
// rejecting psql and memcping in connect() (no SYN gets out), a new
// breakerd adopts both circuits, and the get still waiting is counted by
// no daemon twice. Both targets have count_dropped false: each connection
// ends with a goodbye (Terminate, quit) the server answers by closing.
func TestPostgresAndMemcachedAcrossSIGKILL(t *testing.T) {
	need(t, "psql", "pgbench", "memcached", "memccat", "memccp", "memcping")
	w := newWorld(t, 1, `
failsafe_timeout: 30s
targets:
  pg:
    match: {cidrs: [SRV0], ports: ["5493"]}
    count_dropped: false  # the Terminate psql and pgbench send as they close
    slow_response_duration: 200ms
    slow_call_rate_threshold: 1
    window_size: 3
    min_requests: 3
    open_duration: 4m
    reject_errno: EHOSTUNREACH
  cache:
    match: {cidrs: [SRV0], ports: ["11293"]}
    count_dropped: false  # libmemcached's quit, which memcached answers by closing
    response_timeout: 500ms
    consecutive_failures: 1
    open_duration: 4m
    reject_errno: EHOSTUNREACH
  sentinel:
    match: {cidrs: [SRV0], ports: ["8099"]}
    protocol: http
    response_timeout: 500ms
    consecutive_failures: 100
`)
	srv := w.topo.Servers[0]
	pg := srv.StartPostgres(t, 5493)
	mc := srv.StartMemcached(t, 11293)
	srv.ServeHTTPCases(t, 8099)
	w.start()
	series := func(outcome, target string, n int) string {
		return fmt.Sprintf(`breakerd_connection_outcomes_total{outcome="%s",target="%s",workload="shared"} %d`, outcome, target, n)
	}
	waitMetric := func(want ...string) {
		t.Helper()
		if !kerneltest.WaitFor(3*time.Second, func() bool {
			m := w.metrics()
			for _, s := range want {
				if !strings.Contains(m, s+"\n") {
					return false
				}
			}
			return true
		}) {
			t.Fatalf("metrics lack %v:\n%s", want, grep(w.metrics(), "outcome=\"response"))
		}
	}

	script := filepath.Join(t.TempDir(), "quick.sql")
	if err := os.WriteFile(script, []byte("SELECT 1;\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := pg.Client(w.topo.Client, w.cg, "pgbench", "-n", "-f", script, "-c", "2", "-t", "5").Run(t); err != nil {
		t.Fatalf("pgbench: %v\n%s", err, out)
	}
	value := filepath.Join(t.TempDir(), "k1")
	if err := os.WriteFile(value, []byte("v1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := mc.Client(w.topo.Client, w.cg, "memccp", value).Run(t); err != nil {
		t.Fatalf("memccp: %v %s", err, out)
	}
	if out, err := mc.Client(w.topo.Client, w.cg, "memccat", "k1").Run(t); err != nil || string(out) != "v1\n" {
		t.Fatalf("memccat: %v %q", err, out)
	}
	// pgbench: a connection to set up and two clients, each connection's
	// start four calls, then five one-query transactions per client.
	waitMetric(series("response", "pg", 3*kerneltest.PostgresStartTurns+2*5), series("response", "cache", 2))
	if m := w.metrics(); strings.Contains(m, `outcome="response_timeout"`) {
		t.Fatalf("quick calls counted as failures:\n%s", grep(m, "outcome=\"response"))
	}
	for name, c := range w.circuits() {
		if c.Failures != 0 || c.Slow != 0 || c.State != "closed" {
			t.Fatalf("/v1/circuits %s after quick calls: %+v", name, c)
		}
	}

	if out, err := pg.PSQL(t, w.topo.Client, w.cg, "SELECT pg_sleep(0.25)", "SELECT pg_sleep(0.25)", "SELECT pg_sleep(0.25)"); err != nil {
		t.Fatalf("psql: %v %s", err, out)
	}
	w.waitState("pg", "open", 3*time.Second)
	if c := w.circuits()["pg"]; c.Slow != 3 || c.Failures != 0 {
		t.Fatalf("/v1/circuits after three slow queries: %+v", c)
	}
	mc.Signal(t, syscall.SIGSTOP)
	defer mc.Signal(t, syscall.SIGCONT)
	hold := mc.Client(w.topo.Client, w.cg, "memccat", "k1")
	if err := hold.Start(t); err != nil {
		t.Fatal(err)
	}
	w.waitState("cache", "open", 3*time.Second)
	if hold.Cmd.ProcessState != nil {
		t.Fatal("memccat is gone already: the timeout was not the daemon's")
	}
	waitMetric(series("response_timeout", "cache", 1))

	rejected := func(when string) {
		t.Helper()
		syns := srv.SYNs(t)
		if out, err := pg.PSQL(t, w.topo.Client, w.cg, "SELECT 1"); err == nil || !strings.Contains(out, "No route to host") {
			t.Fatalf("%s: psql to the open circuit: %v %s", when, err, out)
		}
		if out, err := mc.Client(w.topo.Client, w.cg, "memcping").Run(t); err == nil {
			t.Fatalf("%s: memcping to the open circuit: %s", when, out)
		}
		if n := srv.SYNs(t); n != syns {
			t.Fatalf("%s: %d SYNs reached the open destinations", when, n-syns)
		}
	}
	rejected("before the kill")
	w.signal(syscall.SIGKILL)
	rejected("with breakerd killed")
	w.start()
	w.waitState("pg", "open", 3*time.Second)
	w.waitState("cache", "open", 3*time.Second)
	rejected("after the restart")
	awaitSentinelTimeout(t, w, srv.IPv4) // a pass over the get as well
	if m := w.metrics(); strings.Contains(m, `outcome="response_timeout",target="cache"`) {
		t.Fatalf("the new daemon counted the get begun before it:\n%s", grep(m, "outcome=\"response"))
	}
	if c := w.circuits()["cache"]; c.Calls != 0 {
		t.Fatalf("cache's window after the restart: %+v", c)
	}
	hold.Cmd.Process.Kill()
	hold.Cmd.Wait()
}

// awaitSentinelTimeout makes a request to the target sentinel (port 8099
// of addr, never answered) and waits until the daemon counts it at
// response_timeout. The daemon counts timeouts in one pass over every
// request in flight, so a request that has waited longer was looked at
// by then.
func awaitSentinelTimeout(t *testing.T, w *world, addr netip.Addr) {
	t.Helper()
	p := w.topo.Client.StartDial(t, w.cg, kerneltest.DialSpec{Op: "keepalive", Addr: netip.AddrPortFrom(addr, 8099), Timeout: 20 * time.Second,
		Requests: []kerneltest.HTTPRequest{{Path: "/never"}}})
	defer func() {
		p.Cmd.Process.Kill()
		p.Cmd.Wait()
	}()
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		return strings.Contains(w.metrics(), `breakerd_connection_outcomes_total{outcome="response_timeout",target="sentinel",workload="shared"} 1`)
	}) {
		t.Fatalf("the sentinel request's timeout was not counted:\n%s", grep(w.metrics(), "outcome=\"response"))
	}
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
