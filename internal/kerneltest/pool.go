package kerneltest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// poolScript holds established connections open in a real process (a
// connection pool that sends nothing), and on "check" reports, per
// connection, whether it is still open: a non-blocking peek that would
// block means open; an error or end of file means the kernel closed it.
// With a listening port it also accepts connections ("accept"), reported
// after the pool's own.
const poolScript = `
import errno, json, resource, socket, sys
targets, listen = json.loads(sys.argv[1]), int(sys.argv[2])
want = sum(n for _, _, n in targets) + 64
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
socks, accepted = [], []
for host, port, n in targets:
    for _ in range(n):
        s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(3)
        s.connect((host, port))
        s.settimeout(None)  # blocking, so MSG_DONTWAIT answers at once
        socks.append(s)
if listen:
    l = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("0.0.0.0", listen))
    l.listen(16)
    l.settimeout(5)
print("ready", flush=True)
def state(s):
    try:
        b = s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
        return "open" if b else "eof"
    except BlockingIOError:
        return "open"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "accept":
        c, _ = l.accept()
        c.settimeout(None)
        accepted.append(c)
        print("ok", flush=True)
    elif cmd == "check":
        print(json.dumps([state(s) for s in socks + accepted]), flush=True)
`

// PoolTarget is one destination of a Pool and how many connections it
// holds to it.
type PoolTarget struct {
	Addr netip.AddrPort
	N    int
}

// Pool is a real process in a cgroup holding established connections.
type Pool struct {
	proc *Process
	in   io.WriteCloser
	out  *bufio.Reader
}

// StartPool starts a python3 process in h and cg that connects N times to
// every target and holds the connections; with listen it also listens on
// that port (Accept takes one connection).
func (h *Host) StartPool(tb testing.TB, cg *Cgroup, targets []PoolTarget, listen uint16) *Pool {
	tb.Helper()
	var ts [][]any
	for _, t := range targets {
		ts = append(ts, []any{t.Addr.Addr().String(), t.Addr.Port(), t.N})
	}
	js, _ := json.Marshal(ts)
	p := &Pool{proc: h.Command(cg, "python3", "-c", poolScript, string(js), fmt.Sprint(listen))}
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
	if line, err := p.line(10 * time.Second); err != nil || line != "ready" {
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

// StartHTTPPool starts a python3 http.client pool of n keep-alive
// connections to addr in h and cg (Round makes one request on each).
func (h *Host) StartHTTPPool(tb testing.TB, cg *Cgroup, addr netip.AddrPort, n int) *Pool {
	tb.Helper()
	p := &Pool{proc: h.Command(cg, "python3", "-c", httpPoolScript, addr.Addr().String(), fmt.Sprint(addr.Port()), fmt.Sprint(n))}
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
	if line, err := p.line(10 * time.Second); err != nil || line != "ready" {
		tb.Fatalf("http pool did not start: %q %v: %s", line, err, stderr.String())
	}
	return p
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
