package bench

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/daemon"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

var recovery = flag.Bool("bench.recovery", false, "run TestRecoveryComparison (about two minutes; run it under flock /tmp/breakerd-heavy.lock)")

// The recovery comparison's timing: the offered load runs throughout; the
// server is refused for recoveryDown, then comes back cold and is watched
// for recoveryWatch.
const (
	recoveryInterval = 5 * time.Millisecond // 200 requests a second, open loop
	recoveryBefore   = 2 * time.Second
	recoveryDown     = 3 * time.Second
	recoveryWatch    = 30 * time.Second
	// A cold server serves coldRate requests a second when it comes back,
	// warming linearly to warmRate over warmUp; requests over that get a
	// 503 at once. Each request it serves takes serveTime.
	coldRate  = 20
	warmRate  = 250
	warmUp    = 20 * time.Second
	serveTime = 20 * time.Millisecond
)

// coldServer is an HTTP server on a server host that can be stopped
// (refused) and started again cold: its capacity grows from coldRate to
// warmRate requests a second over warmUp after each start. It counts the
// connections it accepts, by second since its last start.
type coldServer struct {
	httpServer
	cold    sync.Mutex // the fields below
	started time.Time
	tokens  float64
	last    time.Time
	accepts [64]atomic.Int64
}

func (s *coldServer) start(t *testing.T) {
	t.Helper()
	s.cold.Lock()
	s.started, s.tokens, s.last = time.Now(), 0, time.Now()
	for i := range s.accepts {
		s.accepts[i].Store(0)
	}
	s.cold.Unlock()
	s.httpServer.serve, s.httpServer.accepted = s.serveCold, s.countAccept
	s.httpServer.start(t)
}

// countAccept counts a connection accepted in its second since the start.
func (s *coldServer) countAccept() {
	s.cold.Lock()
	started := s.started
	s.cold.Unlock()
	if sec := int(time.Since(started) / time.Second); sec < len(s.accepts) {
		s.accepts[sec].Add(1)
	}
}

// admit takes one request's worth of the server's capacity now.
func (s *coldServer) admit() bool {
	s.cold.Lock()
	defer s.cold.Unlock()
	now := time.Now()
	warm := min(float64(now.Sub(s.started))/float64(warmUp), 1)
	rate := coldRate + (warmRate-coldRate)*warm
	s.tokens = min(s.tokens+rate*now.Sub(s.last).Seconds(), rate/10) // a tenth of a second of burst
	s.last = now
	if s.tokens < 1 {
		return false
	}
	s.tokens--
	return true
}

// serveCold answers 200 "ok" after serveTime while the capacity lasts,
// and 503 at once beyond it.
func (s *coldServer) serveCold(c net.Conn) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 1024)
	c.Read(buf)
	if !s.admit() {
		io.WriteString(c, "HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
		return
	}
	time.Sleep(serveTime)
	io.WriteString(c, "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
}

const recoveryConfig = `
failsafe_timeout: 30s
targets:
  plain:
    match: {cidrs: [SRV], ports: ["8301"]}
    consecutive_failures: 5
    open_duration: 1s
    jitter: 0
  ramped:
    match: {cidrs: [SRV], ports: ["8302"]}
    consecutive_failures: 5
    open_duration: 1s
    jitter: 0
    slow_start: {duration: 30s, floor: 0.1}
`

// TestRecoveryComparison compares, in one run, what a cold server sees
// and what its clients get in the first 30 s after it comes back: behind
// breakerd without slow start, breakerd with slow_start {duration: 30s,
// floor: 0.1}, and HAProxy 2.6 with `slowstart 30s` on the server (whose
// only effect on a backend of one server is its dynamic maxconn, 8 when
// warm). One open-loop client makes 200 HTTP requests a second, one
// connection each, throughout; the server (see coldServer) is refused for
// 3 s, then serves 20 requests a second when it comes back, warming
// linearly to 250 over 20 s, and answers 503 to what is over that.
// Opt-in (-bench.recovery): it takes about two minutes.
//
//	flock /tmp/breakerd-heavy.lock go test -run TestRecoveryComparison -count 1 -timeout 10m ./bench -args -bench.recovery -bench.out /tmp/recovery.md
func TestRecoveryComparison(t *testing.T) {
	if !*recovery {
		t.Skip("opt-in: -bench.recovery")
	}
	kerneltest.RequireKernel(t)
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	plain, guarded := kerneltest.NewCgroup(t), kerneltest.NewCgroup(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "breakerd.yaml")
	os.WriteFile(cfg, []byte(strings.ReplaceAll(recoveryConfig, "SRV", srv.IPv4.String())), 0o644)
	bpffs := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(bpffs) })
	d, err := daemon.New(daemon.Options{ConfigPath: cfg, Cgroup: guarded.Path, BPFFS: bpffs, TickInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { d.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	const haPort = 8303
	hcfg := filepath.Join(dir, "haproxy.cfg")
	stats := filepath.Join(dir, "haproxy.sock")
	os.WriteFile(hcfg, []byte(fmt.Sprintf(`global
  maxconn 4096
  stats socket %s level operator
defaults
  mode http
  timeout connect 1s
  timeout client 10s
  timeout server 10s
  timeout queue 1s
  retries 3
frontend fe
  bind 127.0.0.1:%d
  default_backend be
backend be
  server s %s:%d check inter 500ms fall 2 rise 1 maxconn 8 slowstart 30s observe layer4 error-limit 5 on-error mark-down
`, stats, haPort+10000, srv.IPv4, haPort)), 0o644)
	hp := topo.Client.Command(plain, "haproxy", "-db", "-f", hcfg)
	hp.Cmd.Stdout, hp.Cmd.Stderr = io.Discard, io.Discard
	if err := hp.Start(t); err != nil {
		t.Fatal(err)
	}

	var report strings.Builder
	kv, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	fmt.Fprintf(&report, "kernel %s; 200 requests/s open loop, one connection each; the server refused for %v, then cold: %d requests/s warming to %d over %v, 503 over that, %v a request served\n\n",
		strings.TrimSpace(string(kv)), recoveryDown, coldRate, warmRate, warmUp, serveTime)
	fmt.Fprintf(&report, "| first 30 s after the server's return | requests | failed | of them turned away by the breaker | 503 from the server | other errors | first 200 after | server accepts/s in s 1, 2, 5, 10, 20, 30 | most accepts in a second |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, line := range []struct {
		name     string
		cg       *kerneltest.Cgroup
		port     uint16
		addr     netip.AddrPort
		breakerE unix.Errno
	}{
		{"breakerd, no slow start", guarded, 8301, netip.AddrPortFrom(srv.IPv4, 8301), unix.ECONNREFUSED},
		{"breakerd, slow_start 30s from 0.1", guarded, 8302, netip.AddrPortFrom(srv.IPv4, 8302), unix.EAGAIN},
		{"HAProxy, slowstart 30s (maxconn 8)", plain, haPort, netip.MustParseAddrPort(fmt.Sprintf("127.0.0.1:%d", haPort+10000)), 0},
	} {
		s := &coldServer{httpServer: httpServer{host: srv, port: line.port}}
		s.start(t)
		if line.port == haPort {
			if !kerneltest.WaitFor(15*time.Second, func() bool { return haproxyStatus(stats) == "UP" }) {
				t.Fatalf("HAProxy never marked the server up (%q)", haproxyStatus(stats))
			}
		}
		spec := kerneltest.DialSpec{Op: "loop", Interval: recoveryInterval, For: recoveryBefore + recoveryDown + recoveryWatch + time.Second, Timeout: 2 * time.Second, Addr: line.addr}
		var res []kerneltest.DialResult
		var wg sync.WaitGroup
		wg.Go(func() { res = topo.Client.Dial(t, line.cg, spec) })
		time.Sleep(recoveryBefore)
		s.stop()
		time.Sleep(recoveryDown)
		s.start(t)
		back := s.started
		wg.Wait()
		s.stop()

		var n, failed, byBreaker, unavailable, other int
		otherErrnos := map[string]int{}
		first := "none"
		for _, x := range res {
			at := time.Unix(0, x.Start).Sub(back)
			if at < 0 || at >= recoveryWatch {
				continue
			}
			n++
			switch {
			case x.Status == 200:
				if first == "none" {
					first = at.Round(time.Millisecond).String()
				}
			case x.Status == 503: // the server's, or HAProxy's own (queue timeout)
				failed++
				unavailable++
			case line.breakerE != 0 && x.Errno == line.breakerE:
				failed++
				byBreaker++
			default:
				failed++
				other++
				otherErrnos[unix.ErrnoName(x.Errno)+fmt.Sprintf("/%d", x.Status)]++
			}
		}
		var secs []string
		most := int64(0)
		for i := 0; i < int(recoveryWatch/time.Second); i++ {
			most = max(most, s.accepts[i].Load())
		}
		for _, sec := range []int{1, 2, 5, 10, 20, 30} {
			secs = append(secs, fmt.Sprint(s.accepts[sec-1].Load()))
		}
		breaker := fmt.Sprint(byBreaker)
		if line.breakerE == 0 {
			breaker = "– (its 503s are in the next column)"
		}
		others := fmt.Sprint(other)
		if other > 0 {
			others += fmt.Sprintf(" (errno/status: %v)", otherErrnos)
		}
		fmt.Fprintf(&report, "| %s | %d | %d | %s | %d | %s | %s | %s | %d |\n", line.name, n, failed, breaker, unavailable, others, first, strings.Join(secs, ", "), most)
	}
	t.Log("\n" + report.String())
	if *out != "" {
		if err := os.WriteFile(*out, []byte(report.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// haproxyStatus is the status of HAProxy's backend be's server s.
func haproxyStatus(sock string) string {
	c, err := net.DialTimeout("unix", sock, time.Second)
	if err != nil {
		return ""
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	io.WriteString(c, "show stat\n")
	b, _ := io.ReadAll(c)
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Split(line, ",")
		if len(f) > 17 && f[0] == "be" && f[1] == "s" {
			return f[17]
		}
	}
	return ""
}
