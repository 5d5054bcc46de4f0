package daemon

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/admin/admintest"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// The hostile helper: a re-exec of the test binary as an unprivileged
// user (see unprivileged).
const hostileEnv = "BREAKERD_ADMIN_HOSTILE"

func init() {
	if spec := os.Getenv(hostileEnv); spec != "" {
		os.Exit(runHostile(spec))
	}
}

// hostileSpec says what the helper does against the admin API.
type hostileSpec struct {
	// Network and Addr are where the API is ("tcp" or "unix").
	Network, Addr string
	// Idle connections each make one request, read the answer and then
	// stay open doing nothing (keep-alive).
	Idle int
	// Unread connections each send Requests pipelined requests for Path
	// and never read.
	Unread, Requests int
	Path             string
	// Silent connections are opened and never sent a byte.
	Silent int
	// ChurnEvery > 0: after "ready", another Unread connection every
	// ChurnEvery until stdin closes (an attacker that reconnects as its
	// stalled connections are cut).
	ChurnEvery time.Duration
}

// runHostile opens the connections, prints how many it holds and
// "ready", then holds them until stdin closes.
func runHostile(js string) int {
	var spec hostileSpec
	if err := json.Unmarshal([]byte(js), &spec); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var held []net.Conn
	open := func() net.Conn {
		c, err := net.DialTimeout(spec.Network, spec.Addr, 2*time.Second)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dial:", err)
			return nil
		}
		held = append(held, c)
		return c
	}
	idle := 0
	for range spec.Idle {
		c := open()
		if c == nil {
			continue
		}
		c.SetDeadline(time.Now().Add(2 * time.Second))
		fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: b\r\n\r\n")
		if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			idle++
		}
		c.SetDeadline(time.Time{})
	}
	unread := func() {
		c := open()
		if c == nil {
			return
		}
		c.SetWriteDeadline(time.Now().Add(time.Second))
		for range spec.Requests {
			if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: b\r\n\r\n", spec.Path); err != nil {
				break
			}
		}
	}
	for range spec.Unread {
		unread()
	}
	for range spec.Silent {
		open()
	}
	fmt.Printf("%d %d\nready\n", len(held), idle)
	done := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(done) }()
	if spec.ChurnEvery > 0 {
		t := time.NewTicker(spec.ChurnEvery)
		defer t.Stop()
		for {
			select {
			case <-done:
				return 0
			case <-t.C:
				unread()
			}
		}
	}
	<-done
	return 0
}

// unprivileged starts the hostile helper as uid and gid 65534 (nobody),
// from a copy of the test binary that user can run.
func unprivileged(t *testing.T, spec hostileSpec) (held, idle int, stop func()) {
	t.Helper()
	dir := kerneltest.SocketDir(t)
	os.Chmod(dir, 0o755)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "helper")
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal(spec)
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), hostileEnv+"="+string(js))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	var errOut strings.Builder
	cmd.Stderr = &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop = func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	}
	t.Cleanup(stop)
	sc := bufio.NewScanner(stdout)
	var lines []string
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if sc.Text() == "ready" {
			break
		}
	}
	if len(lines) != 2 {
		t.Fatalf("hostile helper: %q (stderr: %s)", lines, errOut.String())
	}
	fmt.Sscan(lines[0], &held, &idle)
	return held, idle, stop
}

// TestAdminSocketPeerMustBeRoot: even with the socket's mode widened by
// mistake, a connection from another user is closed unanswered.
func TestAdminSocketPeerMustBeRoot(t *testing.T) {
	kerneltest.RequireKernel(t)
	dir := kerneltest.SocketDir(t)
	os.Chmod(dir, 0o755)
	f := newFixture(t, svcConfig)
	f.socket = filepath.Join(dir, "admin.sock")
	f.start()
	os.Chmod(f.socket, 0o666)
	// The helper's one idle request over the socket gets no answer.
	held, idle, _ := unprivileged(t, hostileSpec{Network: "unix", Addr: f.socket, Idle: 1})
	if held != 1 || idle != 0 {
		t.Fatalf("uid 65534 on the socket: %d connections, %d answered; want 1 and 0", held, idle)
	}
	if !strings.Contains(f.logs.String(), "peer uid 65534") {
		t.Fatalf("refusal not logged:\n%s", f.logs.String())
	}
	// Root still gets answers.
	resp, err := unixClient(f.socket).Get("http://breakerd/healthz")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("root on the socket: %v %v", resp, err)
	}
	resp.Body.Close()
}

// do serves one request through h, from remote if given.
var do = admintest.Do

// TestAdminAPIHostileRequests: a refused request changes no circuit of
// the daemon, its pages are served, and the event ring stays at its
// capacity through changes by hand.
func TestAdminAPIHostileRequests(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.start()
	sock := f.d.handler(exposeAll, nil)
	tcp := f.d.handler(exposeTCP, nil)

	// Trailing data: nothing is applied.
	if rec := do(t, sock, "POST", "/v1/circuits/svc", `{"action":"open"}{"action":"close"}`); rec.Code != http.StatusBadRequest || !strings.Contains(rec.Body.String(), "trailing data") {
		t.Fatalf("trailing data: %d %s", rec.Code, rec.Body.String())
	}
	// Keys are exact-case.
	if rec := do(t, sock, "POST", "/v1/circuits/svc", `{"Action":"open"}`); rec.Code != http.StatusBadRequest {
		t.Fatalf("\"Action\": %d %s", rec.Code, rec.Body.String())
	}
	if c, _ := f.circuit("svc"); c.State != "closed" {
		t.Fatalf("a refused request changed the circuit: %s", c.State)
	}

	// The daemon's pages through the TCP server, for a loopback client
	// (admin's TestHandlerHostileRequests has the servers' other rules).
	for _, p := range []string{"/v1/circuits", "/v1/circuits/svc", "/v1/events", "/metrics", "/healthz", "/readyz"} {
		if rec := do(t, tcp, "GET", p, "", "127.0.0.1:40000"); rec.Code != http.StatusOK {
			t.Errorf("loopback GET %s: %d", p, rec.Code)
		}
	}

	// The event ring stays at its capacity through changes by hand.
	for i := range maxEvents + 5 {
		if _, err := f.d.Force("svc", []string{"open", "close"}[i%2]); err != nil {
			t.Fatal(err)
		}
	}
	if evs := f.d.Events(); len(evs) != maxEvents || evs[len(evs)-1].To != "forced_open" {
		t.Fatalf("%d events after %d changes, want %d", len(evs), maxEvents+5, maxEvents)
	}
}

func TestAdminCircuitsEmptyIsArray(t *testing.T) {
	f := newFixture(t, "all:\n  consecutive_failures: 3\n")
	f.start()
	rec := do(t, f.d.handler(exposeAll, nil), "GET", "/v1/circuits", "")
	if rec.Code != http.StatusOK || strings.TrimSpace(rec.Body.String()) != "[]" {
		t.Fatalf("no circuits: %d %q", rec.Code, rec.Body.String())
	}
	rec = do(t, f.d.handler(exposeAll, nil), "GET", "/v1/events", "")
	if rec.Code != http.StatusOK || strings.TrimSpace(rec.Body.String()) != "[]" {
		t.Fatalf("no events: %d %q", rec.Code, rec.Body.String())
	}
}

// TestSecondDaemonLeavesTheSocket: a second daemon given a running one's
// socket stops before touching the kernel, and the first keeps answering.
func TestSecondDaemonLeavesTheSocket(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.start()
	g := newFixture(t, svcConfig)
	_, err := New(Options{ConfigPath: g.config, Cgroup: g.cg.Path, BPFFS: g.bpffs, AdminSocket: f.socket})
	if err == nil || !strings.Contains(err.Error(), "another process listens") {
		t.Fatalf("second daemon on the same socket: %v", err)
	}
	if _, err := os.Stat(g.bpffs); !os.IsNotExist(err) {
		t.Fatalf("the refused daemon made its pins: %v", err)
	}
	resp, err := unixClient(f.socket).Get("http://breakerd/readyz")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("the first daemon's socket: %v %v", resp, err)
	}
	resp.Body.Close()
}

// TestAdminSlowClientsCut: a client that starts a request and never
// finishes its headers loses the connection (ReadHeaderTimeout), and a
// client that sends a body it never finishes does too (ReadTimeout).
func TestAdminSlowClientsCut(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.admin = "127.0.0.1:0"
	d := f.start()
	d.hold()
	addr := d.admin.String()
	d.release()
	for _, partial := range []string{
		"GET /v1/circuits HTTP/1.1\r\nHost: b\r\n",
		"POST /v1/circuits/svc HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer x\r\nContent-Length: 100\r\n\r\n{\"act",
	} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		io.WriteString(c, partial)
		c.SetReadDeadline(time.Now().Add(time.Minute)) // far past the server's timeouts
		start := time.Now()
		_, err = io.ReadAll(c)
		if err != nil {
			t.Fatalf("%q: the server did not close the connection: %v", partial, err)
		}
		t.Logf("%q: closed after %v", partial[:20], time.Since(start).Round(100*time.Millisecond))
	}
}
