package daemon

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/admin"
	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

// makeCircuits makes n dynamic circuits directly (no traffic), in batches
// so the lock is not held for long.
func makeCircuits(t *testing.T, d *Daemon, n int) {
	t.Helper()
	for i := 0; i < n; {
		d.hold()
		now := d.now()
		for end := min(i+5000, n); i < end; i++ {
			dst := maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 9000)}
			if c, _ := d.eng.Lookup(dst, now); c == nil {
				d.release()
				t.Fatalf("circuit %d refused", i)
			}
		}
		d.release()
	}
}

// rssBytes is this process's resident set (VmRSS).
func rssBytes(t *testing.T) uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb uint64
			fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &kb)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

func openFDs(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

// TestAdminUnprivilegedClientsCannotStall is the load test of the hostile
// input issue: with 100,000 circuits, an unprivileged user (uid 65534)
// holds hundreds of idle keep-alive connections and 300 slow clients that
// pipeline requests for the biggest responses (circuits, metrics) without
// ever reading them, and a 10 MB configuration file is reloaded.
// Throughout, a forced-open destination is rejected on every connect and
// the heartbeat in the kernel is never older than the fail-safe timeout,
// the root-only socket answers, the daemon's descriptors stay within the
// connection limits, its heap does not balloon and the resident set of the
// whole test process (daemon, circuits and test together) stays under the
// DaemonSet's 256 MiB limit.
func TestAdminUnprivilegedClientsCannotStall(t *testing.T) {
	f := newFixture(t, `
failsafe_timeout: 2s
targets:
  guard:
    match: {cidrs: [SRV], ports: ["8080"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
`)
	f.admin = "127.0.0.1:0"
	d := f.start()
	const n = 100000
	makeCircuits(t, d, n-1) // and guard
	d.hold()
	addr := d.admin.String()
	total := d.eng.Count()
	d.release()
	if total != n {
		t.Fatalf("%d circuits, want %d", total, n)
	}

	// One page is bounded and names the next.
	resp, err := http.Get("http://" + addr + "/v1/circuits")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var page []CircuitInfo
	if err := json.Unmarshal(body, &page); err != nil || len(page) != PageSize || !strings.Contains(resp.Header.Get("Link"), `rel="next"`) {
		t.Fatalf("first page: %d circuits, Link %q, %v", len(page), resp.Header.Get("Link"), err)
	}
	t.Logf("one page of %d circuits: %d bytes", PageSize, len(body))
	if len(body) > 2<<20 {
		t.Fatalf("a page is %d bytes", len(body))
	}

	t0 := time.Now()
	rec := httptest.NewRecorder()
	d.handler(exposeAll, nil).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	t.Logf("one scrape of /metrics with %d circuits: %v", n, time.Since(t0))

	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	baseHeap := ms.HeapInuse
	baseFDs := openFDs(t)

	// The attack, and meanwhile a client of the protected cgroup that
	// connects to the forced-open destination every 20 ms.
	var res []kerneltest.DialResult
	var loop sync.WaitGroup
	loop.Go(func() {
		res = f.topo.Client.Dial(t, f.cg, kerneltest.DialSpec{Op: "loop", Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8080), Interval: 20 * time.Millisecond, For: 8 * time.Second, Timeout: time.Second})
	})
	var peakHeap, peakFDs, peakRSS, peakBeatAge atomic.Uint64
	stopSampling := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stopSampling:
				return
			case <-time.After(100 * time.Millisecond):
			}
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			if ms.HeapInuse > peakHeap.Load() {
				peakHeap.Store(ms.HeapInuse)
			}
			if fds := uint64(openFDs(t)); fds > peakFDs.Load() {
				peakFDs.Store(fds)
			}
			if rss := rssBytes(t); rss > peakRSS.Load() {
				peakRSS.Store(rss)
			}
			if st, err := d.k.Settings(); err == nil {
				if age := uint64(maps.Now() - st.Heartbeat); age > peakBeatAge.Load() {
					peakBeatAge.Store(age)
				}
			}
		}
	})
	held, idle, stop := unprivileged(t, hostileSpec{Network: "tcp", Addr: addr, Idle: 300, Unread: 200, Requests: 5, Path: "/v1/circuits"})
	_, _, stop2 := unprivileged(t, hostileSpec{Network: "tcp", Addr: addr, Unread: 100, Requests: 5, Path: "/metrics"})
	t.Logf("uid 65534 holds %d connections (%d answered once, then idle)", held, idle)

	// A 10 MB configuration file is refused without reading it all; the
	// running configuration stays.
	big := "targets:\n  guard:\n    match: {cidrs: [SRV], ports: [\"8080\"]}\n    state: forced_open\n" + strings.Repeat("# padding padding padding padding padding padding padding padding\n", 10<<20/66)
	f.writeConfig(big)
	if err := d.Reload(); err == nil || !strings.Contains(err.Error(), "too large") {
		t.Errorf("reloading a 10 MB file: %v", err)
	}

	// The socket answers root while all that goes on.
	sock := unixClient(f.socket)
	sock.Timeout = 10 * time.Second
	for _, p := range []string{"/readyz", "/v1/circuits/guard", "/v1/circuits?limit=10"} {
		resp, err := sock.Get("http://breakerd" + p)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("socket GET %s during the attack: %v %v", p, resp, err)
		}
		resp.Body.Close()
	}

	loop.Wait()
	stop()
	stop2()
	close(stopSampling)
	wg.Wait()
	bad := map[unix.Errno]int{}
	for _, r := range res {
		if r.Errno != unix.EHOSTUNREACH {
			bad[r.Errno]++
		}
	}
	if len(res) == 0 || len(bad) > 0 {
		t.Fatalf("of %d connects to the forced-open destination during the attack, not rejected: %v", len(res), bad)
	}
	t.Logf("%d connects, all rejected; heartbeat at most %v old; descriptors %d -> peak %d; heap %d MiB -> peak %d MiB; process RSS peak %d MiB",
		len(res), time.Duration(peakBeatAge.Load()), baseFDs, peakFDs.Load(), baseHeap>>20, peakHeap.Load()>>20, peakRSS.Load()>>20)
	if age := time.Duration(peakBeatAge.Load()); age >= 2*time.Second {
		t.Errorf("the heartbeat grew %v old, past the fail-safe timeout", age)
	}
	if rss := peakRSS.Load(); rss > 256<<20 {
		t.Errorf("resident set %d MiB, over the DaemonSet's 256 MiB limit", rss>>20)
	}
	if limit := uint64(baseFDs + admin.MaxConns + 16); peakFDs.Load() > limit {
		t.Errorf("the daemon held %d descriptors, over %d", peakFDs.Load(), limit)
	}
}
