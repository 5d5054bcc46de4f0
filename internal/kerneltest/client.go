package kerneltest

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const helperEnv = "BREAKERD_KERNELTEST_HELPER"

// HelperBinaryEnv names a binary built from internal/kerneltest/helper that
// runs the client and pool helpers instead of a re-exec of the test binary.
// vmtest sets it in its VM: there a test binary that links the daemon and
// client-go takes about 0.3 s to start (TCG), the small helper a fraction of
// that, and some tests start a hundred helpers.
const HelperBinaryEnv = "BREAKERD_KERNELTEST_HELPER_BIN"

// Main is the TestMain of every package with kernel tests. In a helper
// process (a re-exec of the test binary that Host.Dial starts inside the
// test cgroup and namespace) it runs the helper and exits. Otherwise it runs
// the tests and then fails the run if anything the harness made in this
// process (cgroups, namespaces, pins, all named by Prefix) was left behind.
func Main(m *testing.M) {
	if code, ok := RunHelper(); ok {
		os.Exit(code)
	}
	code := m.Run()
	if left := Leftovers(); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: kernel test harness left behind: %s\n", strings.Join(left, ", "))
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// Leftovers lists what this test process made and has not removed: child
// cgroups, named network namespaces and bpffs entries whose names start with
// Prefix.
func Leftovers() []string {
	p := Prefix()
	left := append(leftoverCgroups(p), leftoverNetns(p)...)
	entries, _ := os.ReadDir(BPFFSRoot)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), p) {
			left = append(left, filepath.Join(BPFFSRoot, e.Name()))
		}
	}
	return left
}

// DialSpec says what a client helper process does.
type DialSpec struct {
	// Network is tcp4, tcp6, udp4 or udp6: the socket's family and type.
	Network string
	// Addr is the destination. For a tcp6/udp6 socket to an IPv4 address
	// the helper uses the IPv4-mapped form (a dual-stack socket).
	Addr netip.AddrPort
	// Op is "connect" (default), "rate" (connect and close, Rate connects a
	// second — 0: as fast as Parallel workers go — for For, spread over
	// Ports; the result is one entry per errno seen, with the count in
	// Nanos), "dialer" (a connect to each address the test sends:
	// StartDialer), "hammer" (connect and close back to back until told to
	// stop, reporting counts by errno: StartHammer), "connect-read" (connect, then read once:
	// reports the read's errno), "sendto" (unconnected UDP datagram) or
	// "abandon" (non-blocking connect, close after Hold) or
	// "connect-send" (connect, wait Hold, write, wait Linger, close) or
	// "connect-abort" (connect, wait Hold, close with SO_LINGER 0: the
	// client resets the connection itself) or "goodbye" (connect, write,
	// shut the write side, read until the server closes, close: a last
	// request with no answer, as libmemcached's quit when the client's FIN
	// goes first) or "fastopen" (a TCP_FASTOPEN_CONNECT socket: connect,
	// which sends nothing, then write, which sends the SYN; reports
	// connect's errno, or the write's) or "fastopen-nowrite" (the same
	// connect, no write: nothing is sent) or "sendto-fastopen" (sendto with
	// MSG_FASTOPEN on an unconnected TCP socket: the connect and the SYN
	// in one call) or "connect-peername" (connect, then getpeername, both
	// timed; Peer is what it says) or "reconnect-peername" (connect to
	// Addr, then the same socket to Then, then getpeername: a UDP socket
	// that changes its peer; Peer is what it says) or "sendto-recv" (an
	// unconnected UDP datagram and its reply; Peer is the reply's source)
	// or "stream" (connect and close every Interval, each
	// result reported as it happens, until told to stop: StartStream).
	Op string
	// Count connects are made, Parallel at a time (default 1 and 1).
	Count, Parallel int
	// Ports, when above 1, spreads the connects over that many
	// consecutive ports from Addr's: connect i goes to port
	// Addr.Port()+i%Ports (many distinct destinations from one helper).
	Ports int
	// Timeout bounds each connect (default 3 s).
	Timeout time.Duration
	// Hold keeps each socket open this long after its connect.
	Hold time.Duration
	// Linger is how long "connect-send" keeps the socket after writing.
	Linger time.Duration
	// Then is the second destination of "reconnect-peername".
	Then netip.AddrPort `json:",omitzero"`
	// Barrier makes all Parallel workers start their first connect at the
	// same instant.
	Barrier bool

	// "http" makes Count HTTP/1.0 GET requests, one connection each, and
	// times each whole request; "http-paced" makes one such request each
	// time it is asked (StartPaced). "loop" makes one every Interval for For,
	// optionally through an in-process library breaker (Breaker
	// "gobreaker", opening after BreakerFailures consecutive failures for
	// BreakerOpen).
	Interval, For   time.Duration
	Rate            int
	Breaker         string
	BreakerFailures uint32
	BreakerOpen     time.Duration

	// "keepalive" makes Requests in order, Count times over, with Go's
	// net/http client over its keep-alive pool (one connection while each
	// is answered), each result with its status; Timeout bounds each
	// request.
	Requests []HTTPRequest
}

// HTTPRequest is one request of a "keepalive" helper.
type HTTPRequest struct {
	// Method is GET (default), HEAD or POST.
	Method string
	// Path is the request's path.
	Path string
	// Body is a POST's body; with Expect100 the client sends
	// "Expect: 100-continue" and waits for the 100 before the body.
	Body      string
	Expect100 bool
}

// DialResult is the outcome of one operation in a helper process.
type DialResult struct {
	// Errno is 0 on success, the system call's errno otherwise;
	// EINPROGRESS means the connect did not finish within Timeout.
	Errno unix.Errno
	// Nanos is how long the connect (or sendto) system call took; for
	// "http" and "loop", the whole request.
	Nanos int64
	// Start is when the operation began, in Unix nanoseconds ("loop").
	Start int64
	// Status is the HTTP status ("http", "loop"); 0 when there was none.
	Status int
	// Peer is the address the application sees: getpeername's
	// ("connect-peername") or the source of the reply ("sendto-recv").
	Peer netip.AddrPort `json:",omitzero"`
}

// RunHelper runs the client or pool helper its environment asks for, if
// it asks for one, and returns its exit code and true; otherwise 0 and
// false. Main calls it, and so does internal/kerneltest/helper.
func RunHelper() (code int, ok bool) {
	if spec := os.Getenv(helperEnv); spec != "" {
		return runHelper(spec), true
	}
	if spec := os.Getenv(poolEnv); spec != "" {
		return runPool(spec), true
	}
	return 0, false
}

// helperBinary is the program a helper process runs: HelperBinaryEnv's
// when set, the test binary itself otherwise.
func helperBinary(tb testing.TB) string {
	tb.Helper()
	if p := os.Getenv(HelperBinaryEnv); p != "" {
		return p
	}
	self, err := os.Executable()
	if err != nil {
		tb.Fatalf("finding test binary: %v", err)
	}
	return self
}

// helperCommand prepares a client helper process (helperBinary) inside cg
// and the host.
func (h *Host) helperCommand(tb testing.TB, cg *Cgroup, spec DialSpec) *Process {
	tb.Helper()
	js, _ := json.Marshal(spec)
	p := h.Command(cg, helperBinary(tb))
	p.Cmd.Env = helperEnviron(js)
	return p
}

// Dial runs a client helper process inside cg and the host, waits for it
// and returns one result per operation.
func (h *Host) Dial(tb testing.TB, cg *Cgroup, spec DialSpec) []DialResult {
	tb.Helper()
	res, err := h.DialLater(tb, cg, spec)()
	if err != nil {
		tb.Fatal(err)
	}
	return res
}

// Paced is an "http-paced" client helper: one request, on a new
// connection, each time Next asks for one.
type Paced struct {
	p   *Process
	in  io.WriteCloser
	out *json.Decoder
	err *LogBuffer // its standard error, read while it may still run
}

// StartPaced starts an "http-paced" client helper inside cg and the host,
// to make requests to spec.Addr one at a time (Next); it ends with the test
// or at Close.
func (h *Host) StartPaced(tb testing.TB, cg *Cgroup, spec DialSpec) *Paced {
	tb.Helper()
	spec.Op = "http-paced"
	p, in, out, errOut := h.startPiped(tb, cg, spec)
	return &Paced{p: p, in: in, out: json.NewDecoder(bufio.NewReader(out)), err: errOut}
}

// startPiped starts a client helper whose standard input and output the
// test talks to, its standard error kept in a LogBuffer.
func (h *Host) startPiped(tb testing.TB, cg *Cgroup, spec DialSpec) (*Process, io.WriteCloser, io.Reader, *LogBuffer) {
	tb.Helper()
	p := h.helperCommand(tb, cg, spec)
	errOut := &LogBuffer{}
	p.Cmd.Stderr = errOut
	in, err := p.Cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	out, err := p.Cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := p.Start(tb); err != nil {
		tb.Fatal(err)
	}
	return p, in, out, errOut
}

// Next makes one request and returns its result.
func (c *Paced) Next() (DialResult, error) {
	var r DialResult
	if _, err := c.in.Write([]byte{1}); err != nil {
		return r, fmt.Errorf("asking the paced helper for a request: %w (stderr: %s)", err, c.err.String())
	}
	if err := c.out.Decode(&r); err != nil {
		return r, fmt.Errorf("reading the paced helper's result: %w (stderr: %s)", err, c.err.String())
	}
	return r, nil
}

// Close ends the helper and waits for it.
func (c *Paced) Close() error {
	c.in.Close()
	if err := c.p.Cmd.Wait(); err != nil {
		return fmt.Errorf("paced helper: %w (stderr: %s)", err, c.err.String())
	}
	return nil
}

// StartDial starts a client helper process inside cg and the host and
// returns without waiting, so a test can kill it while it holds its
// sockets (it is killed at the end of the test anyway).
func (h *Host) StartDial(tb testing.TB, cg *Cgroup, spec DialSpec) *Process {
	tb.Helper()
	p := h.helperCommand(tb, cg, spec)
	if err := p.Start(tb); err != nil {
		tb.Fatal(err)
	}
	return p
}

// helperEnviron is a helper process's environment. Asynchronous
// preemption is off: its SIGURG would interrupt a connect() on a socket
// with SO_SNDTIMEO, which the kernel never restarts (EINTR).
func helperEnviron(spec []byte) []string {
	return append(os.Environ(), helperEnv+"="+string(spec), "GODEBUG=asyncpreemptoff=1")
}

func runHelper(js string) int {
	var spec DialSpec
	if err := json.Unmarshal([]byte(js), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "bad helper spec:", err)
		return 2
	}
	if spec.Count == 0 {
		spec.Count = 1
	}
	if spec.Parallel == 0 {
		spec.Parallel = 1
	}
	if spec.Timeout == 0 {
		spec.Timeout = 3 * time.Second
	}
	if spec.Ports > 1 && int(spec.Addr.Port())+spec.Ports-1 > 65535 {
		fmt.Fprintf(os.Stderr, "bad helper spec: %d ports from %d pass 65535\n", spec.Ports, spec.Addr.Port())
		return 2
	}
	switch spec.Op {
	case "keepalive":
		return encodeResults(runKeepAlive(spec))
	case "http":
		return encodeResults(runHTTP(spec))
	case "http-paced":
		return runPaced(spec)
	case "loop":
		return encodeResults(runLoop(spec))
	case "rate":
		return encodeResults(runRate(spec))
	case "stream":
		return runStream(spec)
	case "dialer":
		return runDialer(spec)
	case "hammer":
		return runHammer(spec)
	}
	res := make([]DialResult, spec.Count)
	var wg sync.WaitGroup
	start := make(chan struct{})
	next := make(chan int, spec.Count)
	for i := range spec.Count {
		next <- i
	}
	close(next)
	var ready sync.WaitGroup
	ready.Add(spec.Parallel)
	for range spec.Parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ready.Done()
			if spec.Barrier {
				<-start
			}
			for i := range next {
				s := spec
				if spec.Ports > 1 {
					s.Addr = netip.AddrPortFrom(spec.Addr.Addr(), spec.Addr.Port()+uint16(i%spec.Ports))
				}
				res[i] = dialOnce(s)
			}
		}()
	}
	ready.Wait()
	close(start)
	wg.Wait()
	return encodeResults(res)
}

func encodeResults(res []DialResult) int {
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		return 2
	}
	return 0
}

func dialOnce(spec DialSpec) DialResult {
	family, typ := unix.AF_INET, unix.SOCK_STREAM
	if strings.HasSuffix(spec.Network, "6") {
		family = unix.AF_INET6
	}
	if strings.HasPrefix(spec.Network, "udp") {
		typ = unix.SOCK_DGRAM
	}
	flags := unix.SOCK_CLOEXEC
	if spec.Op == "abandon" {
		flags |= unix.SOCK_NONBLOCK
	}
	fd, err := unix.Socket(family, typ|flags, 0)
	if err != nil {
		return DialResult{Errno: errnoOf(err)}
	}
	defer unix.Close(fd)
	tv := unix.NsecToTimeval(spec.Timeout.Nanoseconds())
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	sa := sockaddr(family, spec.Addr)
	var peer netip.AddrPort
	t0 := time.Now()
	switch spec.Op {
	case "sendto":
		err = unix.Sendto(fd, []byte("breakerd"), 0, sa)
	case "sendto-fastopen":
		err = unix.Sendto(fd, []byte("breakerd"), unix.MSG_FASTOPEN, sa)
	case "fastopen-nowrite":
		if err = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_FASTOPEN_CONNECT, 1); err == nil {
			err = unix.Connect(fd, sa)
		}
	case "fastopen":
		if err = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_FASTOPEN_CONNECT, 1); err == nil {
			if err = unix.Connect(fd, sa); err == nil {
				_, err = unix.Write(fd, []byte("breakerd"))
			}
		}
	case "connect-peername":
		if err = unix.Connect(fd, sa); err == nil {
			var p unix.Sockaddr
			if p, err = unix.Getpeername(fd); err == nil {
				peer = addrPortOf(p)
			}
		}
	case "reconnect-peername":
		if err = unix.Connect(fd, sa); err == nil {
			if err = unix.Connect(fd, sockaddr(family, spec.Then)); err == nil {
				var p unix.Sockaddr
				if p, err = unix.Getpeername(fd); err == nil {
					peer = addrPortOf(p)
				}
			}
		}
	case "sendto-recv":
		if err = unix.Sendto(fd, []byte("breakerd"), 0, sa); err == nil {
			var p unix.Sockaddr
			if _, p, err = unix.Recvfrom(fd, make([]byte, 512), 0); err == nil {
				peer = addrPortOf(p)
			}
		}
	default:
		err = unix.Connect(fd, sa)
	}
	r := DialResult{Nanos: time.Since(t0).Nanoseconds(), Errno: errnoOf(err), Peer: peer}
	switch spec.Op {
	case "connect-read":
		if err == nil {
			_, rerr := unix.Read(fd, make([]byte, 16))
			r.Errno = errnoOf(rerr)
		}
	case "abandon":
		if r.Errno == unix.EINPROGRESS {
			r.Errno = 0
		}
	case "connect-abort":
		if err == nil {
			time.Sleep(spec.Hold)
			_ = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
			return r
		}
	case "goodbye":
		if err == nil {
			_, werr := unix.Write(fd, []byte("quit\r\n"))
			if werr == nil {
				werr = unix.Shutdown(fd, unix.SHUT_WR)
			}
			for buf := make([]byte, 512); werr == nil; {
				var n int
				if n, werr = unix.Read(fd, buf); n == 0 && werr == nil {
					break
				}
			}
			r.Errno = errnoOf(werr)
			return r
		}
	case "connect-send":
		if err == nil {
			time.Sleep(spec.Hold)
			_, werr := unix.Write(fd, make([]byte, 1000))
			r.Errno = errnoOf(werr)
			time.Sleep(spec.Linger)
			return r
		}
	}
	if spec.Hold > 0 {
		time.Sleep(spec.Hold)
	}
	return r
}

func sockaddr(family int, ap netip.AddrPort) unix.Sockaddr {
	if family == unix.AF_INET {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().Unmap().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

// addrPortOf is sa's address and port (IPv4-mapped addresses stay mapped:
// what a dual-stack socket's application sees).
func addrPortOf(sa unix.Sockaddr) netip.AddrPort {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port))
	}
	return netip.AddrPort{}
}

func errnoOf(err error) unix.Errno {
	if err == nil {
		return 0
	}
	var e unix.Errno
	if errors.As(err, &e) {
		return e
	}
	return unix.EIO
}

// runRate connects (and closes) at spec.Rate a second in all (0: as fast as
// the workers go) for spec.For, from spec.Parallel workers, and returns one
// DialResult per errno seen with its count in Nanos.
func runRate(spec DialSpec) []DialResult {
	counts := make([]map[unix.Errno]int64, spec.Parallel)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range spec.Parallel {
		counts[w] = map[unix.Errno]int64{}
		wg.Go(func() {
			var gap time.Duration
			if spec.Rate > 0 {
				gap = time.Second * time.Duration(spec.Parallel) / time.Duration(spec.Rate)
			}
			s := spec
			s.Op, s.Hold = "connect", 0
			for i := 0; ; i++ {
				due := start.Add(time.Duration(i) * gap)
				if gap > 0 {
					due = due.Add(gap * time.Duration(w) / time.Duration(spec.Parallel))
				}
				if due.Sub(start) >= spec.For || time.Since(start) >= spec.For {
					return
				}
				if d := time.Until(due); d > 0 {
					time.Sleep(d)
				}
				if spec.Ports > 1 {
					s.Addr = netip.AddrPortFrom(spec.Addr.Addr(), spec.Addr.Port()+uint16((i*spec.Parallel+w)%spec.Ports))
				}
				counts[w][dialOnce(s).Errno]++
			}
		})
	}
	wg.Wait()
	total := map[unix.Errno]int64{}
	for _, c := range counts {
		for e, n := range c {
			total[e] += n
		}
	}
	var out []DialResult
	for e, n := range total {
		out = append(out, DialResult{Errno: e, Nanos: n})
	}
	return out
}

// DialLater starts a client helper process as Dial does and returns a
// function that waits for it and returns its results. Call DialLater from
// the test's goroutine; the function it returns may be called from any
// (it returns what went wrong rather than failing the test), so several
// helpers can run at once.
func (h *Host) DialLater(tb testing.TB, cg *Cgroup, spec DialSpec) func() ([]DialResult, error) {
	tb.Helper()
	p := h.helperCommand(tb, cg, spec)
	var errOut LogBuffer
	p.Cmd.Stderr = &errOut
	stdout, err := p.Cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := p.Start(tb); err != nil {
		tb.Fatal(err)
	}
	return func() ([]DialResult, error) {
		var res []DialResult
		dec := json.NewDecoder(bufio.NewReader(stdout))
		if err := dec.Decode(&res); err != nil && !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("reading helper output: %w (stderr: %s)", err, errOut.String())
		}
		if err := p.Cmd.Wait(); err != nil {
			return nil, fmt.Errorf("helper %+v: %w (stderr: %s)", spec, err, errOut.String())
		}
		return res, nil
	}
}
