package kerneltest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// PoolTarget is one destination of a Pool and how many connections it
// holds to it.
type PoolTarget struct {
	Addr netip.AddrPort
	N    int
}

// Pool is a real process in a cgroup holding established connections
// (poolhelper.go).
type Pool struct {
	proc *Process
	in   io.WriteCloser
	out  *bufio.Reader
}

// StartPool starts a process in h and cg (helperBinary: a re-exec of the
// test binary, so it runs where python does not, as in vmtest's VM) that connects N
// times to every target and holds the connections; with listen it also
// listens on that port (Accept takes one connection).
func (h *Host) StartPool(tb testing.TB, cg *Cgroup, targets []PoolTarget, listen uint16) *Pool {
	tb.Helper()
	return h.startPool(tb, cg, poolSpec{Mode: "hold", Targets: targets, Listen: listen})
}

// startPool starts the pool helper with spec.
func (h *Host) startPool(tb testing.TB, cg *Cgroup, spec poolSpec) *Pool {
	tb.Helper()
	js, _ := json.Marshal(spec)
	p := &Pool{proc: h.Command(cg, helperBinary(tb))}
	p.proc.Cmd.Env = append(os.Environ(), poolEnv+"="+string(js), "GODEBUG=asyncpreemptoff=1") // as helperEnviron
	return p.start(tb)
}

func (p *Pool) start(tb testing.TB) *Pool {
	tb.Helper()
	var err error
	if p.in, err = p.proc.Cmd.StdinPipe(); err != nil {
		tb.Fatal(err)
	}
	stdout, err := p.proc.Cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	var stderr strings.Builder
	p.proc.Cmd.Stderr = &stderr
	p.out = bufio.NewReader(stdout)
	if err := p.proc.Start(tb); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.in.Close() })
	if line, err := p.line(20 * time.Second); err != nil || line != "ready" {
		tb.Fatalf("pool did not start: %q %v: %s", line, err, stderr.String())
	}
	return p
}

// PID is the pool process's id.
func (p *Pool) PID() int { return p.proc.Cmd.Process.Pid }

func (p *Pool) line(timeout time.Duration) (string, error) {
	type res struct {
		s   string
		err error
	}
	ch := make(chan res, 1)
	go func() {
		s, err := p.out.ReadString('\n')
		ch <- res{strings.TrimSpace(s), err}
	}()
	select {
	case r := <-ch:
		return r.s, r.err
	case <-time.After(timeout):
		return "", fmt.Errorf("no answer from the pool within %v", timeout)
	}
}

// Accept makes the pool accept one connection on its listening port.
func (p *Pool) Accept(tb testing.TB) {
	tb.Helper()
	fmt.Fprintln(p.in, "accept")
	if l, err := p.line(10 * time.Second); err != nil || l != "ok" {
		tb.Fatalf("pool accept: %q %v", l, err)
	}
}

// CloseListener makes the pool close its listening socket, as a draining
// server does, keeping the connections it accepted.
func (p *Pool) CloseListener(tb testing.TB) {
	tb.Helper()
	fmt.Fprintln(p.in, "close-listener")
	if l, err := p.line(10 * time.Second); err != nil || l != "ok" {
		tb.Fatalf("pool close-listener: %q %v", l, err)
	}
}

// Check returns each connection's state, in the order of the targets
// (then the accepted ones): "open", or what reading it gave ("ECONNABORTED",
// "eof", …).
func (p *Pool) Check(tb testing.TB) []string {
	tb.Helper()
	fmt.Fprintln(p.in, "check")
	l, err := p.line(10 * time.Second)
	if err != nil {
		tb.Fatalf("pool check: %v", err)
	}
	var out []string
	if err := json.Unmarshal([]byte(l), &out); err != nil {
		tb.Fatalf("pool check: %q: %v", l, err)
	}
	return out
}

// httpPoolScript keeps N keep-alive http.client connections to one server
// and on "round" makes one GET on each: "ok:STATUS:LOCALPORT" (the local
// port tells a reused connection from a new one), or the error's errno
// name (the connection is then closed, and the next round reconnects).
const httpPoolScript = `
import errno, http.client, json, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conns = [http.client.HTTPConnection(host, port, timeout=3) for _ in range(n)]
def get(c):
    try:
        c.request("GET", "/")
        r = c.getresponse()
        r.read()
        return "ok:%d:%d" % (r.status, c.sock.getsockname()[1])
    except OSError as e:
        c.close()
        return errno.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__
    except http.client.HTTPException as e:
        c.close()
        return type(e).__name__
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "round":
        print(json.dumps([get(c) for c in conns]), flush=True)
`

// StartHTTPPool starts an HTTP/1.1 pool of n keep-alive connections to
// addr in h and cg (Round makes one request on each): python3's
// http.client where python3 is installed, else the test binary's own
// client of the same behaviour (vmtest's VM has no python).
func (h *Host) StartHTTPPool(tb testing.TB, cg *Cgroup, addr netip.AddrPort, n int) *Pool {
	tb.Helper()
	if _, err := exec.LookPath("python3"); err != nil {
		tb.Logf("no python3: the http pool is the test binary's own keep-alive client")
		return h.startPool(tb, cg, poolSpec{Mode: "http", Targets: []PoolTarget{{Addr: addr, N: n}}})
	}
	p := &Pool{proc: h.Command(cg, "python3", "-c", httpPoolScript, addr.Addr().String(), fmt.Sprint(addr.Port()), fmt.Sprint(n))}
	return p.start(tb)
}

// Round makes one request on every connection of an http pool.
func (p *Pool) Round(tb testing.TB) []string {
	tb.Helper()
	fmt.Fprintln(p.in, "round")
	l, err := p.line(15 * time.Second)
	if err != nil {
		tb.Fatalf("http pool round: %v", err)
	}
	var out []string
	if err := json.Unmarshal([]byte(l), &out); err != nil {
		tb.Fatalf("http pool round: %q: %v", l, err)
	}
	return out
}

// RefuseNewConnections makes the host answer every new connection's SYN
// to port with a reset, while connections already established go on.
func (h *Host) RefuseNewConnections(tb testing.TB, port uint16) {
	tb.Helper()
	h.addRule(tb, port, "tcp flags & (syn|ack) == syn reject with tcp reset")
}

// ServeHTTP serves HTTP/1.1 with keep-alive on port in the host until the
// test ends: 200 "ok" at once, or after the delay a "/slow?ms=N" path asks
// for. It returns the count of requests served.
func (h *Host) ServeHTTP(tb testing.TB, port uint16) *atomic.Int64 {
	tb.Helper()
	var n atomic.Int64
	l := h.Listen(tb, "tcp", port)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if ms, err := strconv.Atoi(r.URL.Query().Get("ms")); err == nil && r.URL.Path == "/slow" {
			time.Sleep(time.Duration(ms) * time.Millisecond)
		}
		n.Add(1)
		io.WriteString(w, "ok\n")
	})}
	go srv.Serve(l)
	tb.Cleanup(func() { srv.Close() })
	return &n
}
