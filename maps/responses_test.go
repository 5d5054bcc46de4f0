package maps

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/breakerd/breakerd/bpf"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

// waitResponses returns the Response and NoResponse records for port
// once there are n of them (or after the timeout, whatever there is).
func (w *watcher) waitResponses(port uint16, n int, timeout time.Duration) []Event {
	var out []Event
	kerneltest.WaitFor(timeout, func() bool {
		out = responses(w.wait(port, 0, 0))
		return len(out) >= n
	})
	return out
}

// responses are the Response and NoResponse records among evs.
func responses(evs []Event) []Event {
	var out []Event
	for _, e := range evs {
		if e.Outcome == Response || e.Outcome == NoResponse {
			out = append(out, e)
		}
	}
	return out
}

func statuses(evs []Event) []string {
	var out []string
	for _, e := range evs {
		switch {
		case e.Outcome == NoResponse:
			out = append(out, fmt.Sprintf("no_response(peer=%v,%v)", e.PeerClosed, e.Err))
		case e.HTTP:
			out = append(out, fmt.Sprint(e.Status))
		default:
			out = append(out, "-")
		}
	}
	return out
}

func (e *env) followResponses(t *testing.T, port uint16, f ResponseFlags) {
	t.Helper()
	if err := e.k.PutLimit(e.dest(port, false), Limit{Slot: 7, Responses: f}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
}

// requests runs a keep-alive client (Go's net/http, in a helper process
// in the cgroup) that makes reqs in order, and returns its statuses.
func (e *env) requests(t *testing.T, port uint16, timeout time.Duration, reqs ...kerneltest.HTTPRequest) []kerneltest.DialResult {
	t.Helper()
	return e.dial(t, e.cg, kerneltest.DialSpec{Op: "keepalive", Addr: e.dest(port, false).Addr, Timeout: timeout, Requests: reqs})
}

func gets(paths ...string) []kerneltest.HTTPRequest {
	var out []kerneltest.HTTPRequest
	for _, p := range paths {
		out = append(out, kerneltest.HTTPRequest{Path: p})
	}
	return out
}

// TestHTTPStatusFromTheKernel: a keep-alive client (Go's net/http) makes
// several requests over one connection, and the kernel reports one
// response per request with its status, whatever the segments: a status
// line split in two, a body (plain, chunked, many segments) holding status
// lines, HEAD, 100 Continue; a slow answer is timed from its request.
func TestHTTPStatusFromTheKernel(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8080)
	e.followResponses(t, 8080, RespTimed|RespHTTP)
	reqs := gets("/ok", "/503", "/split", "/429", "/404", "/chunked", "/big", "/slow")
	reqs = append(reqs, kerneltest.HTTPRequest{Method: "HEAD", Path: "/404"},
		kerneltest.HTTPRequest{Method: "POST", Path: "/503", Body: strings.Repeat("x", 2000), Expect100: true})
	for i, r := range e.requests(t, 8080, 5*time.Second, reqs...) {
		if r.Errno != 0 {
			t.Fatalf("request %d (%s): %v", i, reqs[i].Path, r.Errno)
		}
	}
	// The 100 Continue is no response: the final status after the body is.
	want := []string{"200", "503", "503", "429", "404", "200", "200", "200", "404", "503"}
	evs := w.waitResponses(8080, len(want), 5*time.Second)
	if got := statuses(evs); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("statuses %v, want %v", got, want)
	}
	cookie := evs[0].Cookie
	for i, ev := range evs {
		if ev.Cookie != cookie || ev.Count != uint32(i+1) {
			t.Errorf("response %d: cookie %d turn %d, want one connection (cookie %d) and turn %d", i, ev.Cookie, ev.Count, cookie, i+1)
		}
	}
	if d := evs[7].Duration; d < 150*time.Millisecond || d > 2*time.Second {
		t.Errorf("slow answer timed %v, want about 150ms", d)
	}
	if d := evs[0].Duration; d > 100*time.Millisecond {
		t.Errorf("quick answer timed %v", d)
	}

}

// TestInformationalResponsesFromTheKernel: a 1xx response is read past to
// the turn's final status, whatever the segments: an unsolicited 100
// Continue, 103 Early Hints with Link headers (the response timed to the
// final status, 100 ms later), 100, 103 and the final status in one
// segment, a 103 whose blank line and the final status line are split
// across segments, a 103 of 2.5 KB with the final status in one segment,
// a 100 the client asked for. A 100 and then the peer's
// close is the peer's no_response. 101 Switching Protocols is the
// response, and the bytes of the protocol switched to begin no more turns;
// so is a CONNECT's 200, and the tunnel's bytes.
func TestInformationalResponsesFromTheKernel(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8083)
	e.followResponses(t, 8083, RespTimed|RespHTTP|RespInflight)
	reqs := gets("/continue", "/early-hints", "/one-segment", "/split-hints", "/long-hints")
	reqs = append(reqs, kerneltest.HTTPRequest{Method: "POST", Path: "/404", Body: strings.Repeat("x", 2000), Expect100: true},
		kerneltest.HTTPRequest{Path: "/503"})
	for i, r := range e.requests(t, 8083, 5*time.Second, reqs...) {
		if r.Errno != 0 {
			t.Fatalf("request %d (%s): %v", i, reqs[i].Path, r.Errno)
		}
	}
	want := []string{"200", "200", "200", "200", "200", "404", "503"}
	evs := w.waitResponses(8083, len(want), 5*time.Second)
	if got := statuses(evs); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("statuses %v, want %v", got, want)
	}
	for i, ev := range evs {
		if ev.Cookie != evs[0].Cookie || ev.Count != uint32(i+1) {
			t.Errorf("response %d: cookie %d turn %d, want one connection (cookie %d) and turn %d", i, ev.Cookie, ev.Count, evs[0].Cookie, i+1)
		}
	}
	if d := evs[1].Duration; d < 100*time.Millisecond || d > 2*time.Second {
		t.Errorf("the answer after 103 Early Hints timed %v, want about 100ms (to the final status)", d)
	}

	// A 100 Continue, then the server closes: no answer.
	e.requests(t, 8083, 5*time.Second, gets("/continue-close")...)
	evs = w.waitResponses(8083, len(want)+1, 5*time.Second)
	if got := statuses(evs[len(want):]); len(got) == 0 || got[0] != "no_response(peer=true,errno 0)" {
		t.Fatalf("after a 100 and the peer's close: %v, want the peer's no_response", got)
	}
	n := len(evs)

	// 101 and a CONNECT's 200: the response; then the bytes of the
	// protocol switched to, or of the tunnel, begin no turns.
	if _, err := exec.LookPath("python3"); err != nil {
		if kerneltest.Emulated() {
			t.Log("python3 is not in the VM: 101 Switching Protocols and CONNECT are checked on the host only")
			return
		}
		t.Fatal("python3 is not installed (scripts/setup installs it)")
	}
	// Each case opens the connection with its request, then echoes
	// status lines and a message never answered through what it opened.
	// A later request on a new connection is the sentinel.
	const client = `import socket, sys
s = socket.create_connection((sys.argv[1], 8083), timeout=5)
s.sendall(sys.argv[2].encode().replace(b"|", b"\r\n"))
got = b""
while b"\r\n\r\n" not in got:
    got += s.recv(4096)
assert got.startswith(sys.argv[3].encode()), got
for m in (b"HTTP/1.1 503 x\r\n", b"ping", b"HTTP/1.1 500 y\r\n"):
    s.sendall(m)
    back = b""
    while len(back) < len(m):
        back += s.recv(4096)
s.shutdown(socket.SHUT_RD)
s.sendall(b"unanswered")
s.close()
`
	for _, c := range []struct{ name, request, status string }{
		{"101 Switching Protocols", "GET /upgrade HTTP/1.1|Host: x|Connection: Upgrade|Upgrade: echo||", "101"},
		{"a CONNECT's 200", "CONNECT db.internal:5432 HTTP/1.1|Host: db.internal:5432||", "200"},
	} {
		out, err := e.topo.Client.Command(e.cg, "python3", "-c", client, e.srv.IPv4.String(), c.request, "HTTP/1.1 "+c.status+" ").Run(t)
		if err != nil {
			t.Fatalf("%s: client: %v %s", c.name, err, out)
		}
		e.requests(t, 8083, 5*time.Second, gets("/503")...)
		evs = w.waitResponses(8083, n+2, 5*time.Second)
		if got, want := strings.Join(statuses(evs[n:]), " "), c.status+" 503"; got != want {
			t.Fatalf("after %s and messages echoed, then a 503: %v, want %s", c.name, got, want)
		}
		n = len(evs)
	}
}

// TestResponseTimingWithoutParsing: a target without protocol http is
// timed, turn by turn, and nothing is read from its bytes.
func TestResponseTimingWithoutParsing(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8081)
	e.followResponses(t, 8081, RespTimed)
	e.requests(t, 8081, 5*time.Second, gets("/503", "/slow")...)
	evs := w.waitResponses(8081, 2, 5*time.Second)
	if got := statuses(evs); strings.Join(got, " ") != "- -" {
		t.Fatalf("records %v, want two responses without a status", got)
	}
	if evs[1].Duration < 150*time.Millisecond {
		t.Errorf("slow answer timed %v", evs[1].Duration)
	}
}

// TestAwaitingAndNoResponse: a request that never gets an answer is in
// the inflight map from its first byte, with its start; when the client
// gives up the connection's end reports it (not the peer's doing) and the
// entry goes. A reset before the first response byte is the peer's.
func TestAwaitingAndNoResponse(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8082)
	e.followResponses(t, 8082, RespTimed|RespHTTP|RespInflight)
	start := Now()
	e.requests(t, 8082, time.Second, gets("/never")...) // the client gives up after 1 s
	evs := w.waitResponses(8082, 1, 5*time.Second)
	if got := statuses(evs); strings.Join(got, " ") != "no_response(peer=false,errno 0)" {
		t.Fatalf("records %v, want one no_response the client caused", got)
	}
	if d := evs[0].Duration; d < 900*time.Millisecond || d > 3*time.Second {
		t.Errorf("no_response after %v, want about the client's 1s", d)
	}
	if a, err := e.k.Awaiting(nil); err != nil || len(a) != 0 {
		t.Errorf("inflight after the close: %v %v, want none", a, err)
	}

	// While it waits, the request is listed with its start.
	p := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Op: "keepalive", Addr: e.dest(8082, false).Addr, Timeout: 5 * time.Second, Requests: gets("/never")})
	var a []Awaiting
	kerneltest.WaitFor(3*time.Second, func() bool { a, _ = e.k.Awaiting(nil); return len(a) == 1 && a[0].Since != 0 })
	if len(a) != 1 || a[0].Dest != e.dest(8082, false) || a[0].Turn != 1 || a[0].Since < start || a[0].Probe {
		t.Fatalf("awaiting %+v, want one request to %v", a, e.dest(8082, false))
	}
	_ = p.Cmd.Process.Kill()
	_ = p.Cmd.Wait()
	if !kerneltest.WaitFor(3*time.Second, func() bool { a, _ = e.k.Awaiting(nil); return len(a) == 0 }) {
		t.Fatalf("inflight after the client was killed: %+v", a)
	}

	e.requests(t, 8082, 5*time.Second, gets("/reset-before")...)
	e.requests(t, 8082, 5*time.Second, gets("/reset-during")...)
	e.requests(t, 8082, 5*time.Second, gets("/close-before")...)
	evs = w.waitResponses(8082, 5, 5*time.Second)
	got := statuses(evs)
	if g := strings.Join(got[len(got)-4:], " "); g != fmt.Sprintf("no_response(peer=false,errno 0) no_response(peer=true,%v) 200 no_response(peer=true,errno 0)", syscall.ECONNRESET) {
		t.Fatalf("records %v: want the reset before any answer as the peer's no_response, then a 200, then the close before any answer as the peer's", got)
	}
	var resets int
	for _, ev := range w.wait(8082, 100, 200*time.Millisecond) {
		if ev.Outcome == Reset {
			resets++
		}
	}
	if resets != 1 {
		t.Errorf("%d reset records, want 1 (the reset during a response; the one before it is the no_response)", resets)
	}
}

// rewritePort attaches, after breakerd's connect4 at the same cgroup, a
// connect4 program that sends every connect to port from on to port to,
// as another agent's socket load balancing does after breakerd judged the
// connect.
func (e *env) rewritePort(t *testing.T, from, to uint16) {
	t.Helper()
	const userPort = 24 // offsetof(struct bpf_sock_addr, user_port)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:       ebpf.CGroupSockAddr,
		AttachType: ebpf.AttachCGroupInet4Connect,
		License:    "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R2, asm.R1, userPort, asm.Word),
			asm.JNE.Imm(asm.R2, int32(htons(from)), "out"),
			asm.Mov.Imm(asm.R2, int32(htons(to))),
			asm.StoreMem(asm.R1, userPort, asm.R2, asm.Word),
			asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("loading the port rewrite: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	l, err := link.AttachCgroup(link.CgroupOptions{Path: e.cg.Path, Attach: ebpf.AttachCGroupInet4Connect, Program: prog})
	if err != nil {
		t.Fatalf("attaching the port rewrite: %v", err)
	}
	t.Cleanup(func() { l.Close() })
}

// TestRespPortsFilter: the response programs look for storage only on
// sockets to a port in resp_ports, which sockops' connect callback sets
// from the socket's real remote port once connect marked it: a marked
// destination's responses are followed, also when a later connect program
// rewrote its port (as another agent's socket load balancing does), and a
// socket with storage but no mark (a bulkhead only) sets no bit. Bits stay
// when the entries go.
func TestRespPortsFilter(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8091)
	e.srv.ServeHTTPCases(t, 8093)
	e.srv.ServeHTTPCases(t, 8094)
	if ports, err := e.k.RespPorts(); err != nil || len(ports) != 0 {
		t.Fatalf("resp_ports before any connect: %v, %v; want none", ports, err)
	}
	e.followResponses(t, 8091, RespTimed)
	e.followResponses(t, 8092, RespTimed) // rewritten to 8093
	if err := e.k.PutLimit(e.dest(8094, false), Limit{Slot: 8, MaxConnections: 100}); err != nil {
		t.Fatal(err)
	}
	e.rewritePort(t, 8092, 8093)
	for _, port := range []uint16{8091, 8092, 8094} {
		for i, r := range e.requests(t, port, 5*time.Second, gets("/ok", "/404")...) {
			if r.Errno != 0 {
				t.Fatalf("port %d request %d: %v", port, i, r.Errno)
			}
		}
	}
	if got := statuses(w.waitResponses(8091, 2, 5*time.Second)); len(got) != 2 {
		t.Errorf("port 8091: %d responses, want 2", len(got))
	}
	if got := statuses(w.waitResponses(8093, 2, 5*time.Second)); len(got) != 2 {
		t.Errorf("port 8092 rewritten to 8093: %d responses, want 2", len(got))
	}
	if got := responses(w.wait(8094, 0, 0)); len(got) != 0 {
		t.Errorf("port 8094 (a bulkhead, no mark): %d responses, want none", len(got))
	}
	want := "[8091 8093]"
	ports, err := e.k.RespPorts()
	if err != nil || fmt.Sprint(ports) != want {
		t.Fatalf("resp_ports %v (%v), want %s", ports, err, want)
	}
	for _, port := range []uint16{8091, 8092} {
		if err := e.k.DeleteLimit(e.dest(port, false)); err != nil {
			t.Fatal(err)
		}
	}
	if ports, err := e.k.RespPorts(); err != nil || fmt.Sprint(ports) != want {
		t.Fatalf("resp_ports after the entries went: %v (%v), want %s still", ports, err, want)
	}
}

// TestRespPortsFilterIPv6: an IPv6 socket's turns pass resp_ports as an
// IPv4 one's do (sockops and the response programs read the port of the
// same socket field for both families), and its bit is its own port's.
func TestRespPortsFilterIPv6(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8198)
	if err := e.k.PutLimit(e.dest(8198, true), Limit{Slot: 9, Responses: RespTimed | RespHTTP}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
	rs := e.dial(t, e.cg, kerneltest.DialSpec{Op: "keepalive", Addr: e.dest(8198, true).Addr, Timeout: 5 * time.Second, Requests: gets("/ok", "/404", "/ok")})
	for i, r := range rs {
		if r.Errno != 0 {
			t.Fatalf("request %d: %v", i, r.Errno)
		}
	}
	if got := fmt.Sprint(statuses(w.waitResponses(8198, 3, 5*time.Second))); got != "[200 404 200]" {
		t.Errorf("IPv6 responses %s, want [200 404 200]", got)
	}
	if ports, err := e.k.RespPorts(); err != nil || fmt.Sprint(ports) != "[8198]" {
		t.Fatalf("resp_ports %v (%v), want [8198]", ports, err)
	}
}

// TestClientClosesFirst: a last request that has no answer (memcached's
// quit, PostgreSQL's Terminate), after which the client shuts its side and
// waits for the server to close, and a server that closes once it has read
// the client's FIN. The peer's FIN comes after the client's own, to a
// socket the client still holds: the request is the client's to end, so
// the connection's end reports it as the client's (no_response, not the
// peer's), which the daemon counts as nothing.
func TestClientClosesFirst(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHold(t, 8083) // reads until the client's FIN, then closes
	e.followResponses(t, 8083, RespTimed|RespInflight)
	for _, r := range e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Op: "goodbye", Addr: e.dest(8083, false).Addr, Count: 3}) {
		if r.Errno != 0 {
			t.Fatalf("goodbye: %v", r.Errno)
		}
	}
	evs := w.waitResponses(8083, 3, 5*time.Second)
	want := "no_response(peer=false,errno 0)"
	if got := statuses(evs); strings.Join(got, " ") != strings.Join([]string{want, want, want}, " ") {
		t.Fatalf("records %v, want three no_response the client caused", got)
	}
	if a, err := e.k.Awaiting(nil); err != nil || len(a) != 0 {
		t.Errorf("inflight after the closes: %v %v, want none", a, err)
	}
}

// TestRespPortsMadeAnewBesideAdoptedSocks: resp_ports' pin removed while
// no daemon runs, the other pins left: the next start makes it anew,
// empty, beside the adopted socks map, whose marked sockets set their bits
// in the old one. Their turns after the start must still be followed
// (else responses on a pool kept from before go unseen, silently): the
// new map marks every port.
func TestRespPortsMadeAnewBesideAdoptedSocks(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	e.srv.Serve(t, 8196, func(c *net.TCPConn) {
		defer c.Close()
		buf := make([]byte, 4096)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			if n > 0 {
				if _, err := c.Write([]byte("pong")); err != nil {
					return
				}
			}
		}
	})
	e.followResponses(t, 8196, RespTimed)
	// Connected now, its request written after the restart.
	p := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Op: "connect-send", Addr: e.dest(8196, false).Addr, Hold: 3 * time.Second, Linger: 500 * time.Millisecond})
	t.Cleanup(func() { p.Cmd.Process.Kill(); p.Cmd.Wait() })
	if !kerneltest.WaitFor(2*time.Second, func() bool {
		ports, _ := e.k.RespPorts()
		return fmt.Sprint(ports) == "[8196]"
	}) {
		t.Fatal("the connect set no bit")
	}
	dir := e.k.PinDir()
	if err := e.k.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, bpf.BreakerMapRespPorts)); err != nil {
		t.Fatal(err)
	}
	e.k = e.load(t)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
	w := e.watch(t)
	if got := w.waitResponses(8196, 1, 6*time.Second); len(got) == 0 || got[0].Outcome != Response {
		t.Fatalf("the adopted socket's turn after the start: %+v, want its response", got)
	}
	if ports, err := e.k.RespPorts(); err != nil || len(ports) != 65536 {
		t.Fatalf("resp_ports made anew: %d ports marked (%v), want every one", len(ports), err)
	}
}
