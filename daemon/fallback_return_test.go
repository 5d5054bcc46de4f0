package daemon

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/maps"
)

// "web" (port 8601, nothing listening at first) opens after two refusals
// and sends its connects to "house" (port 8602). "sentinel" (port 8603,
// nothing listening) has close_established, so that a test without it on
// web still has a close goroutine whose passes run in order.
const fallbackReturnConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8601"]}
    consecutive_failures: 2
    open_duration: 1m
    jitter: 0
    fallback: SRV:8602
    CLOSE
  house:
    match: {cidrs: [SRV], ports: ["8602"]}
  sentinel:
    match: {cidrs: [SRV], ports: ["8603"]}
    close_established: true
`

// A keep-alive pool that asked for a dead target was redirected to its
// fallback; when the target recovers and its circuit closes, a target
// with close_established closes exactly the pool's connections still on
// the fallback: the next request on each fails, the reconnects reach the
// real server, and a pool that connected to the fallback's address itself
// keeps its connections. So too when the pools were redirected by a
// daemon that was then restarted (SIGTERM), refused a second start on its
// pins and reloaded: the redirects are remembered in pinned socket
// storage. Without close_established, and with a mechanism that cannot
// read the sockets' origins (sock_diag), the redirected pool stays on the
// fallback.
func TestCloseEstablishedReturnsFromFallback(t *testing.T) {
	t.Run("close_established", func(t *testing.T) { testReturnFromFallback(t, true, nil, false) })
	t.Run("restart", func(t *testing.T) { testReturnFromFallback(t, true, nil, true) })
	t.Run("without", func(t *testing.T) { testReturnFromFallback(t, false, nil, false) })
	t.Run("sock_diag", func(t *testing.T) {
		testReturnFromFallback(t, true, []maps.CloseMechanism{maps.CloseSockDiag}, false)
	})
}

func testReturnFromFallback(t *testing.T, closeOn bool, mechs []maps.CloseMechanism, lifecycle bool) {
	yaml := strings.ReplaceAll(fallbackReturnConfig, "CLOSE", "")
	if closeOn {
		yaml = strings.ReplaceAll(fallbackReturnConfig, "CLOSE", "close_established: true")
	}
	f := newFixture(t, yaml)
	f.closeMechs = mechs
	house := f.srv.ServeHTTP(t, 8602)
	d := f.start()
	needCloseMechanism(t, d)
	// Only the iterator can tell redirected sockets: a kernel without
	// bpf_sock_destroy (6.1) shows what sock_diag does.
	d.hold()
	mech := d.closer.Mechanism()
	d.release()
	returns := closeOn && mech == maps.CloseIterator
	if got := errnos(f.dial(8601, 2, 0)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("connects to the dead target: %v", got)
	}
	f.waitState("web", "open", 2*time.Second)

	redirected := f.topo.Client.StartHTTPPool(t, f.cg, netip.AddrPortFrom(f.srv.IPv4, 8601), 3)
	direct := f.topo.Client.StartHTTPPool(t, f.cg, netip.AddrPortFrom(f.srv.IPv4, 8602), 2)
	first, directFirst := redirected.Round(t), direct.Round(t)
	if !allOK(first) || !allOK(directFirst) {
		t.Fatalf("pools on the fallback: %v %v", first, directFirst)
	}
	if n := house.Load(); n != 5 {
		t.Fatalf("the fallback served %d requests, want the 5 of both pools", n)
	}
	if lifecycle {
		f.restart()
		if _, err := New(Options{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs}); err == nil {
			t.Fatal("a second daemon started on the same pins")
		}
		if err := f.d.Reload(); err != nil {
			t.Fatal(err)
		}
		f.waitState("web", "open", 2*time.Second)
	}

	// The target recovers; at the end of the open duration one probe
	// closes its circuit.
	web := f.srv.ServeHTTP(t, 8601)
	f.expire(8601)
	if got := errnos(f.dial(8601, 1, 0)); got[0] != 1 {
		t.Fatalf("probe: %v", got)
	}
	f.waitState("web", "closed", 2*time.Second)

	switch {
	case returns:
		waitLog(t, f, 1, "closed connections redirected to the fallback", "circuit=web", "closed=3", "failed=0")
	case closeOn:
		waitLog(t, f, 1, "connections redirected to its fallback stay there", "circuit=web", "mechanism="+string(mech))
		fallthrough
	default:
		// The close goroutine takes jobs in order: once the sentinel's
		// pass is logged, a pass web's closing had queued has run.
		if _, err := f.d.Force("sentinel", "open"); err != nil {
			t.Fatal(err)
		}
		waitLog(t, f, 1, "closed established connections", "circuit=sentinel", "closed=0")
		if r := redirected.Round(t); !allOK(r) || !slices.Equal(ports(r), ports(first)) {
			t.Fatalf("the redirected pool: %v, want its connections kept on the fallback (%v)", r, first)
		}
		if n := web.Load(); n != 0 {
			t.Fatalf("%d requests reached the recovered target, want none", n)
		}
		if strings.Contains(f.logs.String(), "closed connections redirected to the fallback") {
			t.Fatalf("a returning pass ran:\n%s", f.logs.String())
		}
		return
	}

	before := house.Load()
	r := redirected.Round(t)
	for _, s := range r {
		if strings.HasPrefix(s, "ok") {
			t.Fatalf("a request on a connection left on the fallback: %v (want each closed)", r)
		}
	}
	if r := redirected.Round(t); !allOK(r) {
		t.Fatalf("the redirected pool's reconnects: %v", r)
	}
	if n := web.Load(); n != 3 {
		t.Fatalf("the recovered target served %d requests, want the redirected pool's 3", n)
	}
	if r := direct.Round(t); !allOK(r) || !slices.Equal(ports(r), ports(directFirst)) {
		t.Fatalf("the pool that connected to the fallback itself: %v, want its connections kept (%v)", r, directFirst)
	}
	if n := house.Load() - before; n != 2 {
		t.Fatalf("the fallback served %d requests after the return, want the direct pool's 2", n)
	}
	if got := testutil.ToFloat64(f.d.metrics.closed.WithLabelValues("web", "shared", "returned")); got != 3 {
		t.Fatalf("breakerd_established_closed_total{target=web,result=returned} %v, want 3", got)
	}
	if ev := lastEvent(f.d, "web"); ev.To != "closed" || ev.ClosedEstablished != 3 {
		t.Fatalf("web's last event %+v, want its closing with 3 connections closed", ev)
	}
}
