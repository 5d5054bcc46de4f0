package e2e

import (
	"fmt"
	"net/netip"
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
`)
	srv := w.topo.Servers[0]
	web := srv.ServeHTTPCases(t, 8097)
	srv.ServeHTTPCases(t, 8098)
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
	time.Sleep(time.Second) // ticks of the new daemon while the request still waits
	if m := w.metrics(); strings.Contains(m, `outcome="response_timeout",target="slow"`) {
		t.Fatalf("the new daemon counted the request begun before it:\n%s", grep(m, "outcome=\"response"))
	}
	if c := w.circuits()["slow"]; c.Calls != 0 {
		t.Fatalf("slow's window after the restart: %+v", c)
	}
	hold.Cmd.Process.Kill()
	hold.Cmd.Wait()
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
