package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// Server 0 is the target (web on 8080, api on 9090), dead at first;
// server 1 its fallback (house, 8080 and 8081: one circuit).
const fallbackConfig = `
targets:
  web:
    match: {cidrs: [SRV0], ports: ["8080"]}
    consecutive_failures: 3
    open_duration: 1m
    jitter: 0
    connect_timeout: 1s
    fallback: SRV1:8080
  api:
    match: {cidrs: [SRV0], ports: ["9090"]}
    consecutive_failures: 3
    open_duration: 2s
    open_duration_multiplier: 1
    jitter: 0
    connect_timeout: 1s
    probe_timeout: 1s
    fallback: SRV1:8080
  house:
    match: {cidrs: [SRV1], ports: ["8080", "8081"]}
    consecutive_failures: 3
    open_duration: 1m
    jitter: 0
    connect_timeout: 1s
`

// httpAnswer serves one-shot HTTP/1.0 answering body on host i's port
// until stop is called (then connects there are refused) or the test ends.
func (w *world) httpAnswer(i int, port uint16, body string) (stop func()) {
	w.t.Helper()
	l := w.topo.Servers[i].Listen(w.t, "tcp", port)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil || strings.TrimSpace(line) == "" {
						break
					}
				}
				fmt.Fprintf(c, "HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			})
		}
	})
	var once sync.Once
	stop = func() { once.Do(func() { l.Close(); wg.Wait() }) }
	w.t.Cleanup(stop)
	return stop
}

// fetch runs curl in the protected cgroup and returns the body, or curl's
// exit code (7: could not connect).
func (w *world) fetch(url string) (string, int) {
	w.t.Helper()
	out, err := w.topo.Client.Command(w.cg, "curl", "-sS", "--max-time", "3", url).Run(w.t)
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(out), ee.ExitCode()
	}
	if err != nil {
		w.t.Fatal(err)
	}
	return string(out), 0
}

// peerName connects with python3 from the protected cgroup and returns
// what getpeername says and the answer: "host port body".
func (w *world) peerName(host string, port int) string {
	w.t.Helper()
	const script = `
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
p = s.getpeername()
s.sendall(b'GET / HTTP/1.0\r\n\r\n')
print(p[0], p[1], s.recv(200).split(b'\r\n\r\n')[-1].decode())
`
	out, err := w.topo.Client.Command(w.cg, "python3", "-c", script, host, fmt.Sprint(port)).Run(w.t)
	if err != nil {
		w.t.Fatalf("python3: %v: %s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// A dead server with a fallback: once its circuit opens, curl gets the
// fallback's answer with no SYN at the dead server and python's
// getpeername the address it asked for; the redirected connections count
// for the fallback's circuit, and so across a SIGTERM restart, a SIGKILL, a refused
// second start and a reload that moves the fallback. Recovery returns
// traffic to the real server; the fallback's own failure opens its
// circuit and turns the redirects into rejections.
func TestFallbackDestination(t *testing.T) {
	need(t, "python3")
	w := newWorld(t, 2, fallbackConfig)
	dead, fb := w.topo.Servers[0], w.topo.Servers[1]
	stopFallback := w.httpAnswer(1, 8080, "fallback")
	w.start()
	web := fmt.Sprintf("http://%s:8080/", dead.IPv4)
	for range 3 {
		if out, code := w.fetch(web); code != 7 {
			t.Fatalf("curl to a dead server: exit %d %s", code, out)
		}
	}
	w.waitState("web", "open", 3*time.Second)
	deadSYNs := dead.SYNs(t)
	redirected := 0
	onFallback := func(step, want string) {
		t.Helper()
		for range 3 {
			if body, code := w.fetch(web); code != 0 || body != want {
				t.Fatalf("%s: curl %q, exit %d; want the fallback's %q", step, body, code, want)
			}
			redirected++
		}
		if got := w.peerName(dead.IPv4.String(), 8080); got != dead.IPv4.String()+" 8080 "+want {
			t.Fatalf("%s: python3 saw %q: getpeername must show the address asked for", step, got)
		}
		redirected++
		if n := dead.SYNs(t) - deadSYNs; n != 0 {
			t.Fatalf("%s: %d SYNs reached the dead server", step, n)
		}
	}
	onFallback("open", "fallback")
	cs := w.circuits()
	if c := cs["web"]; c.State != "open" || c.Redirected != uint64(redirected) || c.Rejected != 0 || c.Failures != 3 || c.Fallback != fb.IPv4.String()+":8080" {
		t.Fatalf("web: %+v; want open, %d redirected, none rejected, its 3 failures only", c, redirected)
	}
	// The redirected connections are the fallback's calls, never web's.
	if !kerneltest.WaitFor(3*time.Second, func() bool { return w.circuits()["house"].Calls == redirected }) {
		t.Fatalf("house counted %d calls, want the %d redirected connections", w.circuits()["house"].Calls, redirected)
	}
	if m := w.metrics(); !strings.Contains(m, fmt.Sprintf(`breakerd_redirected_total{target="web"} %d`, redirected)) {
		t.Fatalf("/metrics lacks breakerd_redirected_total{target=\"web\"} %d", redirected)
	}

	// SIGTERM: the pinned verdict and fallback go on redirecting while no
	// daemon runs, and the next daemon adopts both.
	w.signal(syscall.SIGTERM)
	onFallback("no daemon", "fallback")
	w.start()
	w.waitState("web", "open", 3*time.Second)
	onFallback("restarted", "fallback")
	if c := w.circuits()["web"]; c.Redirected != uint64(redirected) {
		t.Fatalf("after the restart web counts %d redirects, want %d", c.Redirected, redirected)
	}

	// SIGKILL: nothing runs clean-up; the same holds.
	w.signal(syscall.SIGKILL)
	onFallback("killed", "fallback")
	w.start()
	w.waitState("web", "open", 3*time.Second)
	onFallback("restarted after SIGKILL", "fallback")

	// A second daemon on the same pins is refused and changes nothing.
	out, err := exec.Command(bin(t, "breakerd"), "--config", w.config, "--cgroup", w.cg.Path, "--bpffs", w.bpffs,
		"--admin-addr", "", "--admin-socket", "").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "another breakerd") {
		t.Fatalf("a second breakerd on the same pins: %v\n%s", err, out)
	}
	onFallback("second start refused", "fallback")

	// A reload that moves the fallback applies to the open circuit at once.
	w.httpAnswer(1, 8081, "fallback2")
	w.swapConfig(strings.Replace(fallbackConfig, "fallback: SRV1:8080\n  api", "fallback: SRV1:8081\n  api", 1))
	if !kerneltest.WaitFor(5*time.Second, func() bool { return strings.HasSuffix(w.circuits()["web"].Fallback, ":8081") }) {
		t.Fatalf("the reload did not move web's fallback: %+v\n%s", w.circuits()["web"], w.logs.String())
	}
	onFallback("reloaded", "fallback2")
	if c := w.circuits()["web"]; c.State != "open" || c.Redirected != uint64(redirected) {
		t.Fatalf("after the reload: %+v", c)
	}

	// Recovery: api's server comes back; its half-open probe goes to it,
	// not to the fallback, and once closed its traffic stays there.
	api := fmt.Sprintf("http://%s:9090/", dead.IPv4)
	for range 3 {
		w.fetch(api)
	}
	w.waitState("api", "open", 3*time.Second)
	if body, code := w.fetch(api); code != 0 || body != "fallback" {
		t.Fatalf("api open: curl %q, exit %d; want the fallback's answer", body, code)
	}
	w.httpAnswer(0, 9090, "real")
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		body, _ := w.fetch(api)
		return body == "real" && w.circuits()["api"].State == "closed"
	}) {
		t.Fatalf("api did not recover: %+v\n%s", w.circuits()["api"], w.logs.String())
	}
	syns := dead.SYNs(t)
	if body, code := w.fetch(api); code != 0 || body != "real" || dead.SYNs(t)-syns != 1 {
		t.Fatalf("api closed: curl %q, exit %d, %d SYNs at its server; want its real answer", body, code, dead.SYNs(t)-syns)
	}

	// The fallback fails: its own circuit opens on the redirected
	// connections' failures, and then web's connects are rejected as
	// without a fallback, with no SYN anywhere.
	stopFallback()
	w.swapConfig(fallbackConfig) // back to SRV1:8080, which now refuses
	if !kerneltest.WaitFor(5*time.Second, func() bool { return strings.HasSuffix(w.circuits()["web"].Fallback, ":8080") }) {
		t.Fatalf("the reload did not move web's fallback back")
	}
	for range 3 {
		if body, code := w.fetch(web); code != 7 {
			t.Fatalf("redirected to a dead fallback: curl %q, exit %d; want refused", body, code)
		}
	}
	w.waitState("house", "open", 3*time.Second)
	before := w.circuits()["web"]
	fbSYNs := fb.SYNs(t)
	for range 3 {
		if body, code := w.fetch(web); code != 7 || !strings.Contains(body, "Couldn't connect") {
			t.Fatalf("both open: curl %q, exit %d; want rejected", body, code)
		}
	}
	after := w.circuits()["web"]
	if after.Rejected != before.Rejected+3 || after.Redirected != before.Redirected || after.Failures != before.Failures {
		t.Fatalf("both open: web %+v (before %+v); want 3 more rejected, no more redirected, no failure of its own", after, before)
	}
	if n, m := fb.SYNs(t)-fbSYNs, dead.SYNs(t)-syns-1; n != 0 || m != 0 {
		t.Fatalf("both open: %d SYNs at the fallback, %d at the dead server", n, m)
	}
}
