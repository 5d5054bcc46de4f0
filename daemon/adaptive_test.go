package daemon

import (
	"bufio"
	"net"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// queueServer is an HTTP/1.0 server with a queue: it handles workers
// requests at a time, each taking took, and the others wait their turn in
// order, so its latency rises with the load once more than workers are in
// flight. setWorkers stands for other load taking workers away and
// giving them back.
type queueServer struct {
	mu      sync.Mutex
	workers int
	active  int
	waiting []chan struct{} // first come, first served
}

func serveQueue(t *testing.T, h *kerneltest.Host, port uint16, workers int, took time.Duration) *queueServer {
	q := &queueServer{workers: workers}
	h.Serve(t, port, func(c *net.TCPConn) {
		defer c.Close()
		r := bufio.NewReader(c)
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				return
			}
			if line == "\r\n" {
				break
			}
		}
		q.acquire()
		time.Sleep(took)
		q.release()
		c.Write([]byte("HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"))
	})
	return q
}

func (q *queueServer) acquire() {
	q.mu.Lock()
	if q.active < q.workers {
		q.active++
		q.mu.Unlock()
		return
	}
	turn := make(chan struct{})
	q.waiting = append(q.waiting, turn)
	q.mu.Unlock()
	<-turn // the releaser counted it active
}

func (q *queueServer) release() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.active--
	q.admit()
}

// admit hands free workers to the first waiting requests. Called with mu.
func (q *queueServer) admit() {
	for q.active < q.workers && len(q.waiting) > 0 {
		close(q.waiting[0])
		q.waiting = q.waiting[1:]
		q.active++
	}
}

func (q *queueServer) setWorkers(n int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.workers = n
	q.admit()
}

const adaptiveE2EConfig = `
failsafe_timeout: 30s
targets:
  adaptive:
    match: {cidrs: [SRV], ports: ["8510"]}
    protocol: http
    max_connections: {adaptive: vegas, min: 2, initial: 20, max: 64}
  static:
    match: {cidrs: [SRV], ports: ["8511"]}
    protocol: http
    max_connections: 20
`

// limit is the adaptive limit /v1/circuits shows for target (0: none).
func (f *fixture) limit(target string) int {
	c, _ := f.circuit(target)
	for _, a := range c.AdaptiveLimits {
		if a.Kind == "max_connections" {
			return a.Limit
		}
	}
	return 0
}

// waitLimit waits up to d for target's limit to satisfy ok and returns
// how long it took; it fails the test if it never does.
func (f *fixture) waitLimit(target string, d time.Duration, what string, ok func(int) bool) time.Duration {
	f.t.Helper()
	t0 := time.Now()
	if !kerneltest.WaitFor(d, func() bool { return ok(f.limit(target)) }) {
		c, _ := f.circuit(target)
		f.t.Fatalf("%s: limit %d after %v (%+v)", what, f.limit(target), d, c.AdaptiveLimits)
	}
	return time.Since(t0)
}

// medianOK is the median time of the answered requests (status 200) that
// began at or after from.
func medianOK(res []kerneltest.DialResult, from time.Time) (time.Duration, int) {
	var ns []int64
	for _, r := range res {
		if r.Status == 200 && r.Start >= from.UnixNano() {
			ns = append(ns, r.Nanos)
		}
	}
	if len(ns) == 0 {
		return 0, 0
	}
	slices.Sort(ns)
	return time.Duration(ns[len(ns)/2]), len(ns)
}

// An unmodified HTTP client (one request per connection, 200 a second,
// open loop) of two servers with a queue (16 workers, 40 ms a request):
// when other load takes all but 2 of their workers, the adaptive limit
// follows the response times down within a few dozen ticks while the
// static limit of 20 lets the same load queue, and the requests that get
// through wait far less; across a SIGTERM restart and a reload the limit
// the kernel held is kept and enforced; when the workers come back the
// limit rises with the load.
func TestAdaptiveLimitFollowsAQueueingServer(t *testing.T) {
	f := newFixture(t, adaptiveE2EConfig)
	const took = 40 * time.Millisecond
	adaptive := serveQueue(t, f.srv, 8510, 16, took)
	static := serveQueue(t, f.srv, 8511, 16, took)
	f.start()
	load := func(port uint16, d time.Duration) func() ([]kerneltest.DialResult, error) {
		return f.topo.Client.DialLater(t, f.cg, kerneltest.DialSpec{Op: "loop", Addr: netip.AddrPortFrom(f.srv.IPv4, port),
			Interval: 5 * time.Millisecond, For: d, Timeout: 5 * time.Second})
	}
	wait := func(done func() ([]kerneltest.DialResult, error)) []kerneltest.DialResult {
		t.Helper()
		res, err := done()
		if err != nil {
			t.Fatal(err)
		}
		return res
	}

	// Unloaded: every request is answered in 40 ms; the limit is not
	// what holds requests back and stays.
	a, s := load(8510, time.Second), load(8511, time.Second)
	wait(a)
	wait(s)
	if l := f.limit("adaptive"); l != 20 {
		t.Fatalf("unloaded, the limit moved to %d", l)
	}

	// Overloaded: 2 workers left.
	adaptive.setWorkers(2)
	static.setWorkers(2)
	start := time.Now()
	a, s = load(8510, 3*time.Second), load(8511, 3*time.Second)
	down := f.waitLimit("adaptive", 3*time.Second, "overloaded", func(l int) bool { return l <= 10 })
	ra, rs := wait(a), wait(s)
	from := start.Add(1500 * time.Millisecond)
	ma, na := medianOK(ra, from)
	ms, ns := medianOK(rs, from)
	rejected := 0
	for _, r := range ra {
		if r.Errno == unix.EAGAIN {
			rejected++
		}
	}
	t.Logf("overloaded: limit ≤ 10 after %v (%d ticks of %v); response median over the last 1.5 s: adaptive %v (%d answered, %d turned away), static %v (%d answered)",
		down.Round(time.Millisecond), int(down/f.tick), f.tick, ma.Round(time.Millisecond), na, rejected, ms.Round(time.Millisecond), ns)
	if ma == 0 || ms == 0 || ma > ms*3/4 || rejected == 0 {
		t.Fatalf("adaptive median %v (%d turned away), static %v: want the adaptive limit's answers well under the static limit's", ma, rejected, ms)
	}
	f.waitConnections("adaptive", 0)
	f.waitConnections("static", 0)
	held := f.limit("adaptive")

	// SIGTERM restart: the limit the kernel held is the limit, and the
	// kernel enforces it.
	f.restart()
	if l := f.limit("adaptive"); l != held {
		t.Fatalf("after a restart: limit %d, want the %d held before", l, held)
	}
	holder := f.hold(8510, held)
	f.waitConnections("adaptive", int64(held))
	if got := errnos(f.dial(8510, 1, 0)); got[unix.EAGAIN] != 1 {
		t.Fatalf("with %d held under the restarted limit: %v, want EAGAIN", held, got)
	}
	kill(holder)
	f.waitConnections("adaptive", 0)

	// A reload of other bounds that hold it keeps it.
	f.writeConfig(strings.Replace(adaptiveE2EConfig, "initial: 20, max: 64", "initial: 30, max: 48", 1))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if l := f.limit("adaptive"); l != held {
		t.Fatalf("after a reload: limit %d, want %d", l, held)
	}

	// The workers come back: the limit rises with the load it holds back.
	adaptive.setWorkers(16)
	a = load(8510, 2*time.Second)
	up := f.waitLimit("adaptive", 2*time.Second, "unloaded again", func(l int) bool { return l >= 14 })
	wait(a)
	t.Logf("unloaded again: limit from %d to ≥ 14 in %v (%d ticks)", held, up.Round(time.Millisecond), int(up/f.tick))
	// With the load over the limit stands still: the scrape shows it.
	if g, l := f.gauge("breakerd_limit", map[string]string{"target": "adaptive", "kind": "max_connections"}), f.limit("adaptive"); int(g) != l {
		t.Errorf("breakerd_limit %v, the circuit's limit %d", g, l)
	}
	rec := httptest.NewRecorder()
	f.d.handler(exposeTCP, nil).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{`breakerd_limit{kind="max_connections",target="adaptive"}`, `breakerd_limit_changes_total{kind="max_connections",target="adaptive"}`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
}
