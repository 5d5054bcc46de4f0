package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// probeClient makes one request per connection (as the kubelet does) and
// gives up after timeout.
func probeClient(timeout time.Duration) *http.Client {
	return &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true}}
}

// getTimed GETs url and reads the whole body.
func getTimed(c *http.Client, url string) (code int, body []byte, took time.Duration, err error) {
	start := time.Now()
	resp, err := c.Get(url)
	if err != nil {
		return 0, nil, time.Since(start), err
	}
	defer resp.Body.Close()
	body, err = io.ReadAll(resp.Body)
	return resp.StatusCode, body, time.Since(start), err
}

// probeBound is how soon a probe must be answered whatever other clients
// do. Answers take well under a millisecond on the host (issue 32's goal
// is 100 ms; BENCHMARKS.md has the figures); the bound leaves room for a
// CI host running other tests beside this one, and is still far below
// the 14.8 s the first probe waited before the fix. Under qemu, whose
// emulated CPU is many times slower, it is a second.
func probeBound() time.Duration {
	if kerneltest.Emulated() {
		return time.Second
	}
	return 500 * time.Millisecond
}

// spread is the fastest, median and slowest of ds.
func spread(ds []time.Duration) string {
	if len(ds) == 0 {
		return "none"
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	r := func(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }
	return fmt.Sprintf("min %v median %v max %v", r(s[0]), r(s[len(s)/2]), r(s[len(s)-1]))
}

// TestProbesAnswerBehindSilentConnections: uid 65534 opens 500
// connections to the admin port and 500 to the probe port and never sends
// a byte. Each port holds 128 (32) connections; before, a silent one kept
// its slot until the 5 s header timeout and a probe waited behind
// hundreds of them in the kernel's accept queue (10 s and more). Now the
// listener closes the oldest connection that has sent no request to make
// room, and every probe on either port is answered within probeBound
// (the timing figures are logged).
func TestProbesAnswerBehindSilentConnections(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.admin, f.probe = "127.0.0.1:0", "127.0.0.1:0"
	d := f.start()
	admin, probe := d.servers.TCPAddr().String(), d.servers.ProbeAddr().String()

	held, _, _ := unprivileged(t, hostileSpec{Network: "tcp", Addr: admin, Silent: 500})
	heldProbe, _, _ := unprivileged(t, hostileSpec{Network: "tcp", Addr: probe, Silent: 500})
	if held != 500 || heldProbe != 500 {
		t.Fatalf("uid 65534 holds %d and %d silent connections, want 500 each", held, heldProbe)
	}
	c := probeClient(2 * time.Second)
	took := map[string][]time.Duration{}
	for range 10 {
		for _, addr := range []string{admin, probe} {
			for _, path := range []string{"/healthz", "/readyz"} {
				code, body, d, err := getTimed(c, "http://"+addr+path)
				if err != nil || code != http.StatusOK || d > probeBound() {
					t.Fatalf("GET %s%s behind 500 silent connections: %d %s %v (after %v, want within %v)", addr, path, code, body, err, d, probeBound())
				}
				took[addr] = append(took[addr], d)
			}
		}
	}
	t.Logf("probes behind 500 silent connections of uid 65534: admin port %s; probe port %s", spread(took[admin]), spread(took[probe]))
}

// stalledSenders counts this network namespace's TCP sockets on local
// port whose send queue is not empty: responses their peers do not read.
func stalledSenders(t *testing.T, port uint16) int {
	n := 0
	for _, file := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for line := range strings.Lines(string(b)) {
			fields := strings.Fields(line)
			if len(fields) < 5 || fields[0] == "sl" {
				continue
			}
			_, lport, _ := strings.Cut(fields[1], ":")
			p, _ := strconv.ParseUint(lport, 16, 16)
			tx, _, _ := strings.Cut(fields[4], ":")
			q, _ := strconv.ParseUint(tx, 16, 64)
			if uint16(p) == port && fields[3] == "01" && q > 0 { // 01: ESTABLISHED
				n++
			}
		}
	}
	return n
}

// TestScrapeServedBehindStalledReaders: with 3,000 circuits (a page is
// larger than the socket buffers), uid 65534 sends ten GETs for pages and
// never reads them, and opens another such connection every 100 ms as
// they are cut. Before, the stalled writers held all four request slots
// until the 30 s write timeout and every scrape got 503. Now one client
// holds at most two request slots, and a write that makes no progress for
// writeStall loses its connection: six scrapes and six pages of a
// well-behaved client are all served, in full.
func TestScrapeServedBehindStalledReaders(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.admin = "127.0.0.1:0"
	d := f.start()
	makeCircuits(t, d, 3000)
	admin := d.servers.TCPAddr().String()
	port := uint16(d.servers.TCPAddr().(*net.TCPAddr).Port)
	c := probeClient(10 * time.Second)
	code, body, _, err := getTimed(c, "http://"+admin+"/v1/circuits")
	if err != nil || code != http.StatusOK {
		t.Fatalf("a page before the attack: %d %v", code, err)
	}
	t.Logf("a page of %d circuits is %d bytes", PageSize, len(body))

	_, _, stop := unprivileged(t, hostileSpec{Network: "tcp", Addr: admin, Unread: 10, Requests: 1, Path: "/v1/circuits", ChurnEvery: 100 * time.Millisecond})
	defer stop()
	// The attack is in place once the daemon's sockets hold responses
	// the attacker does not read.
	if !kerneltest.WaitFor(5*time.Second, func() bool { return stalledSenders(t, port) >= 2 }) {
		t.Fatalf("no stalled responses to the attacker (%d)", stalledSenders(t, port))
	}
	var scrapes, pages []time.Duration
	for i := range 6 {
		code, body, took, err := getTimed(c, "http://"+admin+"/metrics")
		if err != nil || code != http.StatusOK || !strings.Contains(string(body), "breakerd_circuits") {
			t.Fatalf("scrape %d of 6 under the attack: %d %.200s %v", i+1, code, body, err)
		}
		scrapes = append(scrapes, took)
		code, body, took, err = getTimed(c, "http://"+admin+"/v1/circuits")
		var page []CircuitInfo
		if err != nil || code != http.StatusOK || json.Unmarshal(body, &page) != nil || len(page) != PageSize {
			t.Fatalf("page %d of 6 under the attack: %d %.200s %v", i+1, code, body, err)
		}
		pages = append(pages, took)
		time.Sleep(200 * time.Millisecond) // spread over the attacker's reconnects
	}
	t.Logf("under ten stalled readers of uid 65534 (reconnecting every 100 ms): 6 of 6 scrapes (%s) and 6 of 6 pages (%s) served; %d responses stalled at the end",
		spread(scrapes), spread(pages), stalledSenders(t, port))
}

// gateResolver answers every lookup once open is closed (or gives up at
// the lookup's deadline): DNS as slow as the test wants.
type gateResolver struct{ open chan struct{} }

func (g gateResolver) LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error) {
	select {
	case <-g.open:
		return []netip.Addr{netip.MustParseAddr("192.0.2.1")}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// TestProbesAnswerDuringStartUp: while the start-up waits on DNS (host
// names whose lookups have not answered), the admin and probe ports are
// open and answer at once: /readyz 503 saying it waits on DNS, /healthz
// 200 "starting", the API's other endpoints 503. Before, the port
// accepted connections and answered nothing until the start-up was over.
// Once DNS answers, the daemon runs and /readyz is 200.
func TestProbesAnswerDuringStartUp(t *testing.T) {
	var hosts []string
	for i := range 20 {
		hosts = append(hosts, fmt.Sprintf("h%d.slow.test", i))
	}
	f := newFixture(t, `
targets:
  named:
    match: {hosts: [`+strings.Join(hosts, ", ")+`], ports: ["9"]}
`)
	gate := gateResolver{open: make(chan struct{})}
	var openOnce sync.Once
	openGate := func() { openOnce.Do(func() { close(gate.open) }) }
	f.resolver = gate
	f.admin, f.probe = kerneltest.FreeLoopbackAddr(t), kerneltest.FreeLoopbackAddr(t)
	start := startAsync(t, f, openGate)

	c := probeClient(2 * time.Second)
	for _, addr := range []string{f.admin, f.probe} {
		probesSayStarting(t, c, addr, "waiting on DNS")
	}
	code, body, _, err := getTimed(c, "http://"+f.admin+"/metrics")
	if err != nil || code != http.StatusServiceUnavailable || !strings.Contains(string(body), "starting") {
		t.Fatalf("GET /metrics while starting: %d %s %v", code, body, err)
	}
	if start.returned() {
		t.Fatal("the start-up did not wait on DNS: the test proves nothing")
	}
	d, err := start.wait()
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	f.run(d)
	for _, addr := range []string{f.admin, f.probe} {
		if code, body, _, err := getTimed(c, "http://"+addr+"/readyz"); err != nil || code != http.StatusOK {
			t.Fatalf("GET %s/readyz once running: %d %s %v", addr, code, body, err)
		}
	}
}

// asyncStart is New running on a goroutine of its own, for the tests of
// what the daemon answers while it starts.
type asyncStart struct {
	result  chan error
	d       *Daemon
	err     error
	done    bool
	release func() // lets a start-up the test holds up go on (nil: none)
}

// startAsync runs New(f.options()) on a goroutine; release, when not nil,
// lets a start-up the test holds up go on. The test's cleanup waits for
// New and runs (and so shuts down) a daemon the test did not run, so
// New's servers and kernel side never outlive the test.
func startAsync(t *testing.T, f *fixture, release func()) *asyncStart {
	a := &asyncStart{result: make(chan error, 1), release: release}
	go func() {
		var err error
		a.d, err = New(f.options())
		a.result <- err
	}()
	t.Cleanup(func() {
		if d, _ := a.wait(); d != nil && f.d == nil {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			d.Run(ctx)
		}
	})
	return a
}

// returned reports, without waiting, whether New has returned.
func (a *asyncStart) returned() bool {
	if !a.done {
		select {
		case a.err = <-a.result:
			a.done = true
		default:
		}
	}
	return a.done
}

// wait lets a held start-up go on and returns what New returned.
func (a *asyncStart) wait() (*Daemon, error) {
	if !a.done {
		if a.release != nil {
			a.release()
		}
		a.err, a.done = <-a.result, true
	}
	return a.d, a.err
}

// probesSayStarting waits for addr to open (New opens it a moment after
// it begins) and checks that every answer from then on is a 503 within
// probeBound, until /readyz says the start-up waits on what want names;
// /healthz then answers 200 "starting", as promptly.
func probesSayStarting(t *testing.T, c *http.Client, addr, want string) {
	t.Helper()
	var code int
	var body []byte
	var took time.Duration
	var err error
	if !kerneltest.WaitFor(30*time.Second, func() bool {
		code, body, took, err = getTimed(c, "http://"+addr+"/readyz")
		if isRefused(err) {
			return false
		}
		var st map[string]string
		if err != nil || code != http.StatusServiceUnavailable || json.Unmarshal(body, &st) != nil || took > probeBound() {
			t.Fatalf("GET %s/readyz during start-up: %d %s %v (after %v, want within %v)", addr, code, body, err, took, probeBound())
		}
		return strings.Contains(st["reason"], want)
	}) {
		t.Fatalf("GET %s/readyz never said the start-up is %s: %d %s %v", addr, want, code, body, err)
	}
	t.Logf("%s/readyz during start-up: %d %s in %v", addr, code, strings.Join(strings.Fields(string(body)), " "), took.Round(10*time.Microsecond))
	code, body, took, err = getTimed(c, "http://"+addr+"/healthz")
	if err != nil || code != http.StatusOK || !strings.Contains(string(body), "starting") || took > probeBound() {
		t.Fatalf("GET %s/healthz while %s: %d %s %v (after %v, want within %v)", addr, want, code, body, err, took, probeBound())
	}
	t.Logf("%s/healthz during start-up: %d in %v", addr, code, took.Round(10*time.Microsecond))
}

func isRefused(err error) bool {
	return err != nil && strings.Contains(err.Error(), "connection refused")
}
