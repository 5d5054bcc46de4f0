package daemon

import (
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

const criticalityConfig = `
failsafe_timeout: 30s
workloads:
  - name: web
    cgroups: [CGROUP/web]
    criticality: critical
  - name: batch
    cgroups: [CGROUP/batch]
    criticality: sheddable
    share: 0.5
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8450"]}
    max_connections: 4
`

// Two workloads' clients share one bulkhead of 4: the sheddable one is
// turned away once it and the critical one hold 2 (its half), the
// critical one only at 4, so under a full limit the sheddable work goes
// first; the pool's count and its limits hold across a SIGTERM restart,
// a refused second start on the same pins and a reload.
func TestCriticalitySheddableTurnedAwayFirst(t *testing.T) {
	f := newScopedFixture(t, criticalityConfig)
	web, batch := f.cg.Child(t, "web"), f.cg.Child(t, "batch")
	f.srv.ServeHold(t, 8450)
	f.start()
	dst := netip.AddrPortFrom(f.srv.IPv4, 8450)
	hold := func(cg *kerneltest.Cgroup, n int) *kerneltest.Process {
		return f.topo.Client.StartDial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: n, Parallel: n, Hold: time.Minute})
	}
	pool := func(want int64) {
		t.Helper()
		var c CircuitInfo
		if !kerneltest.WaitFor(5*time.Second, func() bool {
			c, _ = f.circuit("pool")
			return c.Bulkheads[policy.CriticalityPool].Connections == want && len(c.Bulkheads) == 1
		}) {
			t.Fatalf("pool %+v, want the criticality pool holding %d", c, want)
		}
	}
	check := func(step string, webWant, batchWant unix.Errno) {
		t.Helper()
		if got := f.dialFrom(batch, 8450, 1); got[batchWant] != 1 {
			t.Fatalf("%s: batch (sheddable) %v, want %v", step, got, batchWant)
		}
		if got := f.dialFrom(web, 8450, 1); got[webWant] != 1 {
			t.Fatalf("%s: web (critical) %v, want %v", step, got, webWant)
		}
	}
	check("empty", 0, 0)
	hw := hold(web, 2)
	defer kill(hw)
	pool(2)
	// Half the limit in use, by critical work: sheddable work is turned
	// away, critical work still gets in.
	check("two held by web", 0, unix.EAGAIN)
	hw2 := hold(web, 2)
	defer kill(hw2)
	pool(4)
	check("full", unix.EAGAIN, unix.EAGAIN)

	f.restart()
	pool(4)
	check("full after a restart", unix.EAGAIN, unix.EAGAIN)
	if _, err := New(Options{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs}); err == nil {
		t.Fatal("a second daemon started on the same pins")
	}
	pool(4)
	check("full after a second start was refused", unix.EAGAIN, unix.EAGAIN)
	kill(hw2)
	pool(2)
	check("two held after a restart", 0, unix.EAGAIN)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	pool(2)
	check("two held after a reload", 0, unix.EAGAIN)
	kill(hw)
	pool(0)
	hb := hold(batch, 3) // one over its share
	defer kill(hb)
	pool(2)
	check("batch at its share", 0, unix.EAGAIN)
	c, _ := f.circuit("pool")
	if c.Bulkheads[policy.CriticalityPool].BulkheadRejected == 0 {
		t.Fatalf("pool %+v: no rejections counted", c)
	}
}

const criticalityProbeConfig = `
failsafe_timeout: 30s
workloads:
  - name: web
    cgroups: [CGROUP/web]
    criticality: critical
  - name: batch
    cgroups: [CGROUP/batch]
    criticality: sheddable
    share: 0.5
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8460"]}
    max_connections: 4
    consecutive_failures: 2
    open_duration: 200ms
    open_duration_multiplier: 1
    jitter: 0
`

// A half-open circuit's probe is a connect its limits admit: a sheddable
// workload at its share of the bulkhead (connections it held from before
// the circuit opened) that connects first when the circuit is due is
// turned away by the bulkhead without spending the round's probe, and the
// critical workload's connect that follows is the probe, which closes the
// circuit. Spent on the turned-away connect, the probe would leave the
// round without one, and a sheddable client retrying would keep a
// recovered destination's circuit open for everyone.
func TestCriticalityProbeNotSpentOnAShedConnect(t *testing.T) {
	f := newScopedFixture(t, criticalityProbeConfig)
	web, batch := f.cg.Child(t, "web"), f.cg.Child(t, "batch")
	l := f.srv.Listen(t, "tcp", 8460)
	var held []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	})
	f.start()
	hb := f.topo.Client.StartDial(t, batch, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8460), Count: 2, Parallel: 2, Hold: time.Minute})
	defer kill(hb)
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		c, _ := f.circuit("pool")
		return c.Bulkheads[policy.CriticalityPool].Connections == 2
	}) {
		t.Fatal("batch's two connections are not counted")
	}
	// The server stops accepting (batch keeps its connections, once
	// accepted: closing the listener resets those still in its backlog):
	// web's connects are refused and open the circuit; then it serves
	// again.
	if !kerneltest.WaitFor(5*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(held) == 2 }) {
		t.Fatal("the server did not accept batch's two connections")
	}
	l.Close()
	if got := f.dialFrom(web, 8460, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("web to a server that stopped listening: %v", got)
	}
	f.waitState("pool", "open", 2*time.Second)
	f.srv.ServeHold(t, 8460)
	v, ok, err := f.d.Kernel().Verdict(f.dest(8460))
	if err != nil || !ok {
		t.Fatalf("no open verdict: %v", err)
	}
	if !kerneltest.WaitFor(2*time.Second, func() bool { return maps.Now() >= v.Due }) {
		t.Fatal("the circuit never became due")
	}
	if got := f.dialFrom(batch, 8460, 1); got[unix.EAGAIN] != 1 {
		t.Fatalf("batch, at its share, when the circuit is due: %v, want EAGAIN", got)
	}
	if got := f.dialFrom(web, 8460, 1); got[0] != 1 {
		t.Fatalf("web after batch was turned away: %v, want its connect admitted as the probe", got)
	}
	f.waitState("pool", "closed", 3*time.Second)
}

const criticalityAdaptiveConfig = `
failsafe_timeout: 30s
workloads:WEB
  - name: batch
    cgroups: [CGROUP/batch]
    criticality: sheddable
    share: 0.3
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8470"]}
    max_connections: {adaptive: vegas, min: 2, initial: INITIAL, max: 64}
`

// An adaptive limit shared by criticality resumes after a restart at the
// limit the kernel held (20, not the 30 the configuration now starts
// at), never at a sheddable workload's share of it, the entry the
// sheddable class is enforced with (6): with a critical workload beside
// it, and with the sheddable workload the circuit's only sharer with
// a criticality.
func TestCriticalityAdaptiveLimitSurvivesRestarts(t *testing.T) {
	for _, c := range []struct {
		name, web string
		want      []uint32 // the limits entries of port 8470
	}{
		{"critical and sheddable", "\n  - name: web\n    cgroups: [CGROUP/web]\n    criticality: critical", []uint32{6, 20}},
		{"sheddable only", "", []uint32{6}},
	} {
		t.Run(c.name, func(t *testing.T) {
			config := strings.ReplaceAll(criticalityAdaptiveConfig, "WEB", c.web)
			f := newScopedFixture(t, strings.ReplaceAll(config, "INITIAL", "20"))
			f.start()
			f.writeConfig(strings.ReplaceAll(strings.ReplaceAll(config, "INITIAL", "30"), "CGROUP", f.cgroupRel()))
			for i := range 6 {
				if l := f.limit("pool"); l != 20 {
					t.Fatalf("after %d restarts the limit is %d, want 20", i, l)
				}
				f.restart()
			}
			limits, err := f.d.Kernel().AllLimits()
			if err != nil {
				t.Fatal(err)
			}
			var got []uint32
			for dst, l := range limits {
				if dst.Addr.Port() == 8470 {
					got = append(got, l.MaxConnections)
				}
			}
			slices.Sort(got)
			if !slices.Equal(got, c.want) {
				t.Fatalf("limits entries %v, want %v", got, c.want)
			}
		})
	}
}
