package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/daemon"
	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

var (
	full = flag.Bool("bench.full", false, "full runs (scripts/bench); the default quick mode only keeps the suite from rotting")
	out  = flag.String("bench.out", "", "write the markdown tables to this file")
)

func TestMain(m *testing.M) { kerneltest.Main(m) }

// httpServer is a tiny HTTP server on a server host that can be killed
// (listener closed: the host refuses) and started again. Each connection
// gets one answer, 200 "ok", unless serve is set.
type httpServer struct {
	host *kerneltest.Host
	port uint16
	// serve, when set, answers each accepted connection (on its own
	// goroutine) instead, and closes it.
	serve func(net.Conn)
	// accepted, when set, runs for each connection as it is accepted.
	accepted func()
	mu       sync.Mutex
	l        net.Listener
}

func (s *httpServer) start(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var l net.Listener
	err := s.host.Do(func() (err error) {
		l, err = net.Listen("tcp", fmt.Sprintf(":%d", s.port))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	s.l = l
	serve := s.serve
	if serve == nil {
		serve = answerOK
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if s.accepted != nil {
				s.accepted()
			}
			go serve(c)
		}
	}()
}

// answerOK reads a request and answers 200 "ok".
func answerOK(c net.Conn) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 1024)
	c.Read(buf)
	io.WriteString(c, "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
}

func (s *httpServer) stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.l != nil {
		s.l.Close()
		s.l = nil
	}
}

type rig struct {
	t       *testing.T
	topo    *kerneltest.Topology
	srv     *kerneltest.Host
	plain   *kerneltest.Cgroup // no breakerd
	guarded *kerneltest.Cgroup // breakerd attached
	stats   string             // HAProxy's stats socket
	d       *daemon.Daemon
}

const breakerConfig = `
failsafe_timeout: 30s
max_circuits: 100000
all:
  consecutive_failures: 10
  min_requests: 1000
  window_size: 1000
  connect_timeout: 1s
  open_duration: 2s
  jitter: 0
  probe_timeout: 3s
  reject_errno: EHOSTUNREACH
`

func newRig(t *testing.T, ports []uint16) *rig {
	kerneltest.RequireKernel(t)
	for _, p := range []string{"haproxy"} {
		if _, err := exec.LookPath(p); err != nil {
			if kerneltest.InCI() {
				t.Fatalf("%s is not installed (scripts/setup installs it)", p)
			}
			t.Skipf("%s not installed", p)
		}
	}
	r := &rig{t: t, topo: kerneltest.NewTopology(t, 1), plain: kerneltest.NewCgroup(t), guarded: kerneltest.NewCgroup(t)}
	r.srv = r.topo.Servers[0]
	r.srv.StartCounting(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "breakerd.yaml")
	os.WriteFile(cfg, []byte(breakerConfig), 0o644)
	bpffs := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(bpffs) })
	d, err := daemon.New(daemon.Options{ConfigPath: cfg, Cgroup: r.guarded.Path, BPFFS: bpffs, TickInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { d.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	r.d = d

	// HAProxy as the usual node-local breaker: passive health (observe
	// layer4, error-limit, mark-down) on top of active checks.
	var backends strings.Builder
	for _, p := range ports {
		fmt.Fprintf(&backends, `
frontend fe%[1]d
  bind 127.0.0.1:%[2]d
  default_backend be%[1]d
backend be%[1]d
  server s %[3]s:%[1]d check inter 2s fall 3 rise 2 observe layer4 error-limit 10 on-error mark-down
`, p, p+10000, r.srv.IPv4)
	}
	hcfg := filepath.Join(dir, "haproxy.cfg")
	r.stats = filepath.Join(dir, "haproxy.sock")
	os.WriteFile(hcfg, []byte(`global
  maxconn 4096
  stats socket `+r.stats+` level operator
defaults
  mode http
  timeout connect 1s
  timeout client 10s
  timeout server 10s
  retries 3
`+backends.String()), 0o644)
	hp := r.topo.Client.Command(r.plain, "haproxy", "-db", "-f", hcfg)
	hp.Cmd.Stdout, hp.Cmd.Stderr = io.Discard, io.Discard
	if err := hp.Start(t); err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *rig) waitHAProxy(port uint16) {
	ok := kerneltest.WaitFor(5*time.Second, func() bool {
		var up bool
		r.topo.Client.Do(func() error {
			c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port+10000), 100*time.Millisecond)
			if err == nil {
				c.Close()
				up = true
			}
			return nil
		})
		return up
	})
	if !ok {
		r.t.Fatal("haproxy did not start")
	}
}

// serverDown reports whether HAProxy has marked backend be<port>'s server
// down, from its stats socket.
func (r *rig) serverDown(port uint16) bool { return strings.HasPrefix(r.serverStatus(port), "DOWN") }

// serverStatus is HAProxy's status of backend be<port>'s server (UP,
// DOWN, …), from its stats socket.
func (r *rig) serverStatus(port uint16) string {
	c, err := net.DialTimeout("unix", r.stats, time.Second)
	if err != nil {
		return ""
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	io.WriteString(c, "show stat\n")
	b, _ := io.ReadAll(c)
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Split(line, ",")
		if len(f) > 17 && f[0] == fmt.Sprintf("be%d", port) && f[1] == "s" {
			return f[17]
		}
	}
	return ""
}

// TestCompare runs the comparison with the alternatives operators would
// use: request latency, and time to trip and to recover, side by side in
// one run. Quick by default (it only has to run); scripts/bench runs it
// with -bench.full and records the tables in BENCHMARKS.md.
func TestCompare(t *testing.T) {
	const latencyPort = 8100
	tripPorts := []uint16{8201, 8202, 8203, 8211, 8212, 8213}
	r := newRig(t, append([]uint16{latencyPort}, tripPorts...))
	var report strings.Builder
	kv, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	fmt.Fprintf(&report, "kernel %s, full=%v\n\n", strings.TrimSpace(string(kv)), *full)

	// 1. Request latency: one new connection per request. breakerd here
	// is the real binary, as deployed (its default tick), on a cgroup of
	// its own; the trip runs below use the rig's in-process daemon.
	s := &httpServer{host: r.srv, port: latencyPort}
	s.start(t)
	defer s.stop()
	r.waitHAProxy(latencyPort)
	bin := *healthyBin
	if bin == "" {
		bin = buildBreakerd(t)
	}
	deployed := kerneltest.NewCgroup(t)
	startBreakerd(t, bin, breakerConfig, deployed)
	rounds, per := 3, 50
	if *full {
		rounds, per = 12, 200
	}
	type line struct {
		name  string
		cg    *kerneltest.Cgroup
		addr  netip.AddrPort
		nanos []int64
	}
	lines := []*line{
		{name: "direct", cg: r.plain, addr: netip.AddrPortFrom(r.srv.IPv4, latencyPort)},
		{name: "direct, breakerd attached", cg: deployed, addr: netip.AddrPortFrom(r.srv.IPv4, latencyPort)},
		{name: "through local HAProxy", cg: r.plain, addr: netip.MustParseAddrPort(fmt.Sprintf("127.0.0.1:%d", latencyPort+10000))},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range rounds {
		for _, i := range rng.Perm(len(lines)) { // each round in a new order
			l := lines[i]
			res := r.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Op: "http", Addr: l.addr, Count: per, Timeout: 2 * time.Second})
			for _, x := range res {
				if x.Status != 200 {
					t.Fatalf("%s: status %d errno %v", l.name, x.Status, x.Errno)
				}
				l.nanos = append(l.nanos, x.Nanos)
			}
		}
	}
	base50, base99 := kerneltest.Percentile(lines[0].nanos, 50), kerneltest.Percentile(lines[0].nanos, 99)
	fmt.Fprintf(&report, "| HTTP request on a new connection (%d rounds × %d, interleaved) | p50 | p99 | added at p50 | added at p99 |\n|---|---|---|---|---|\n", rounds, per)
	for _, l := range lines {
		p50, p99 := kerneltest.Percentile(l.nanos, 50), kerneltest.Percentile(l.nanos, 99)
		fmt.Fprintf(&report, "| %s | %.1f µs | %.1f µs | %+.1f µs | %+.1f µs |\n", l.name, float64(p50)/1e3, float64(p99)/1e3, float64(p50-base50)/1e3, float64(p99-base99)/1e3)
	}

	// 1b. The same comparison paired: one helper per line for the whole
	// run, asked for one request at a time, each set of one request a
	// line in a new order. The lines' requests interleave one by one, so
	// what drifts between rounds above (other processes, the CPUs' state)
	// falls on every line alike, and the differences within a set measure
	// what each line adds.
	sets := 300
	if *full {
		sets = 20000
	}
	fmt.Fprintf(&report, "\n%s", pairedLatency(t, r, rng, lines[0].addr, lines[2].addr, r.plain, deployed, sets))

	// 2. Time to trip and to recover, refused and black-holed.
	fmt.Fprintf(&report, "\n| failure | breaker | trip after the failure | requests slowed or failed before the trip | recovered after the server's return |\n|---|---|---|---|---|\n")
	i := 0
	for _, failure := range []string{"refused", "black hole"} {
		for _, who := range []string{"breakerd", "HAProxy", "gobreaker"} {
			port := tripPorts[i]
			i++
			row := r.tripRun(port, failure, who)
			fmt.Fprintf(&report, "| %s | %s | %s |\n", failure, who, row)
		}
	}
	t.Log("\n" + report.String())
	if *out != "" {
		if err := os.WriteFile(*out, []byte(report.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// tripRun drives one request every 5 ms at a server that fails at 1 s and
// comes back at 3 s, through one breaker, and describes the trip.
func (r *rig) tripRun(port uint16, failure, who string) string {
	t := r.t
	s := &httpServer{host: r.srv, port: port}
	s.start(t)
	defer s.stop()
	r.waitHAProxy(port)
	// HAProxy's checks saw no server until now: wait until it is UP.
	if !kerneltest.WaitFor(15*time.Second, func() bool { return r.serverStatus(port) == "UP" }) {
		t.Fatalf("HAProxy never marked the server of port %d up (status %q)", port, r.serverStatus(port))
	}
	spec := kerneltest.DialSpec{Op: "loop", Interval: 5 * time.Millisecond, For: 9 * time.Second, Timeout: time.Second,
		Addr: netip.AddrPortFrom(r.srv.IPv4, port)}
	cg := r.plain
	switch who {
	case "breakerd":
		cg = r.guarded
	case "HAProxy":
		spec.Addr = netip.MustParseAddrPort(fmt.Sprintf("127.0.0.1:%d", port+10000))
	case "gobreaker":
		spec.Breaker, spec.BreakerFailures, spec.BreakerOpen = "gobreaker", 10, 2*time.Second
	}
	var res []kerneltest.DialResult
	var wg sync.WaitGroup
	wg.Go(func() { res = r.topo.Client.Dial(t, cg, spec) })
	time.Sleep(time.Second)
	failAt := time.Now()
	// HAProxy's trip is when it marks the server down.
	var markedDown time.Time
	stopPoll := make(chan struct{})
	var poll sync.WaitGroup
	if who == "HAProxy" {
		poll.Go(func() {
			for {
				select {
				case <-stopPoll:
					return
				case <-time.After(5 * time.Millisecond):
				}
				if markedDown.IsZero() && r.serverDown(port) {
					markedDown = time.Now()
				}
			}
		})
	}
	if failure == "refused" {
		s.stop()
	} else {
		r.srv.BlackHole(t, port, true)
	}
	time.Sleep(2 * time.Second)
	backAt := time.Now()
	if failure == "refused" {
		s.start(t)
	} else {
		r.srv.BlackHole(t, port, false)
	}
	wg.Wait()
	close(stopPoll)
	poll.Wait()

	tripped := func(x kerneltest.DialResult) bool {
		switch who {
		case "breakerd":
			return x.Errno == unix.EHOSTUNREACH
		case "gobreaker":
			return x.Errno == kerneltest.ErrBreakerOpen
		default:
			return !markedDown.IsZero() && !time.Unix(0, x.Start).Before(markedDown)
		}
	}
	var trip, recovered time.Time
	affected := 0
	for _, x := range res {
		start := time.Unix(0, x.Start)
		if start.Before(failAt) {
			continue
		}
		if trip.IsZero() && start.Before(backAt) {
			if tripped(x) {
				trip = start
			} else if x.Status != 200 || x.Nanos > int64(100*time.Millisecond) {
				affected++
			}
		}
		if recovered.IsZero() && start.After(backAt) && x.Status == 200 {
			recovered = start
		}
	}
	tripText, recText := "did not trip", "did not recover"
	if !trip.IsZero() {
		tripText = trip.Sub(failAt).Round(time.Millisecond).String()
	}
	if !recovered.IsZero() {
		recText = recovered.Sub(backAt).Round(time.Millisecond).String()
	}
	return fmt.Sprintf("%s | %d | %s", tripText, affected, recText)
}

// pairedLatency makes sets of five HTTP requests on new connections,
// direct from plain, direct from a cgroup with empty programs, direct from
// one with breakerd's programs and no daemon, direct from deployed
// (breakerd attached) and through HAProxy at via from plain, one request
// at a time from five helpers alive for the whole run, each set
// in a random order, and tabulates each line's
// p50 and what it adds to the direct one: the difference of the p50s with
// a bootstrap 95% interval, and the median of the sets' differences
// with its distribution-free 95% interval (from the sign test's order
// statistics).
func pairedLatency(t *testing.T, r *rig, rng *rand.Rand, direct, via netip.AddrPort, plain, deployed *kerneltest.Cgroup, sets int) string {
	// The floor: programs that only return, on a cgroup of their own
	// (breakerd's call pattern: six sockops calls).
	empty := kerneltest.NewCgroup(t)
	kerneltest.EmptyPrograms(t, empty, true)
	// breakerd's programs without its daemon: loaded as the daemon loads
	// them, settings written once, records drained in batches as the
	// daemon reads them.
	progs := kerneltest.NewCgroup(t)
	dir := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(dir) })
	k, err := maps.Load(maps.Options{Dir: dir, Cgroup: progs.Path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := k.Uninstall(); err != nil {
			t.Errorf("uninstalling the kernel side without a daemon: %v", err)
		}
	})
	if err := k.SetSettings(maps.Settings{Heartbeat: maps.Now(), FailSafe: time.Hour}); err != nil {
		t.Fatal(err)
	}
	rd, err := k.NewEventReader()
	if err != nil {
		t.Fatal(err)
	}
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		batch := make([]maps.Event, 2048)
		for {
			_, err := rd.ReadBatch(batch, 100*time.Millisecond)
			if errors.Is(err, maps.ErrReaderClosed) {
				return
			}
			if err != nil {
				t.Errorf("reading records: %v", err)
				return
			}
		}
	}()
	defer func() { rd.Close(); <-drained }()
	names := []string{"direct", "direct, empty programs (connect4, sockops with breakerd's callbacks)", "direct, breakerd's programs without its daemon", "direct, breakerd attached", "through local HAProxy"}
	helpers := []*kerneltest.Paced{
		r.topo.Client.StartPaced(t, plain, kerneltest.DialSpec{Addr: direct, Timeout: 2 * time.Second}),
		r.topo.Client.StartPaced(t, empty, kerneltest.DialSpec{Addr: direct, Timeout: 2 * time.Second}),
		r.topo.Client.StartPaced(t, progs, kerneltest.DialSpec{Addr: direct, Timeout: 2 * time.Second}),
		r.topo.Client.StartPaced(t, deployed, kerneltest.DialSpec{Addr: direct, Timeout: 2 * time.Second}),
		r.topo.Client.StartPaced(t, plain, kerneltest.DialSpec{Addr: via, Timeout: 2 * time.Second}),
	}
	nanos := make([][]int64, len(helpers))
	for range sets {
		for _, i := range rng.Perm(len(helpers)) {
			res, err := helpers[i].Next()
			if err != nil {
				t.Fatalf("%s: %v", names[i], err)
			}
			if res.Status != 200 {
				t.Fatalf("%s: status %d errno %v", names[i], res.Status, res.Errno)
			}
			nanos[i] = append(nanos[i], res.Nanos)
		}
	}
	for i, h := range helpers {
		if err := h.Close(); err != nil {
			t.Fatalf("%s: %v", names[i], err)
		}
	}
	us := func(n float64) string { return fmt.Sprintf("%+.1f µs", n/1e3) }
	var b strings.Builder
	fmt.Fprintf(&b, "| HTTP request on a new connection, paired (%d sets of one request a line, one at a time) | p50 | added at p50 | its 95%% interval (bootstrap) | median of the paired differences | its 95%% interval |\n|---|---|---|---|---|---|\n", sets)
	p50 := func(xs []int64) float64 { return float64(kerneltest.Percentile(xs, 50)) }
	for i := range helpers {
		if i == 0 {
			fmt.Fprintf(&b, "| %s | %.1f µs | – | – | – | – |\n", names[i], p50(nanos[0])/1e3)
			continue
		}
		// Bootstrap: resample the sets, 1000 times.
		boot := make([]float64, 1000)
		a, c := make([]int64, sets), make([]int64, sets)
		for k := range boot {
			for j := range sets {
				x := rng.IntN(sets)
				a[j], c[j] = nanos[0][x], nanos[i][x]
			}
			boot[k] = p50(c) - p50(a)
		}
		slices.Sort(boot)
		d := make([]int64, sets)
		for j := range d {
			d[j] = nanos[i][j] - nanos[0][j]
		}
		slices.Sort(d)
		// The median's interval: the differences at 0-based ranks k and
		// n-1-k, with k+1 the sign test's 1-based rank at 95% (about
		// (n - 1.96 sqrt n) / 2).
		k := max(0, int((float64(sets)-1.96*math.Sqrt(float64(sets)))/2)-1)
		fmt.Fprintf(&b, "| %s | %.1f µs | %s | %s to %s | %s | %s to %s |\n", names[i], p50(nanos[i])/1e3,
			us(p50(nanos[i])-p50(nanos[0])), us(boot[25]), us(boot[974]),
			us(float64(d[sets/2])), us(float64(d[k])), us(float64(d[sets-1-k])))
	}
	return b.String()
}
