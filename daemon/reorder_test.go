package daemon

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// reorder lists workload b before a in a configuration that lists a, then
// b (each entry two lines, with an optional `isolate: true` third).
func reorder(t *testing.T, cfg string, isolate bool) string {
	t.Helper()
	a := "  - name: a\n    cgroups: [CGROUP/a]\n"
	b := "  - name: b\n    cgroups: [CGROUP/b]\n"
	if isolate {
		a += "    isolate: true\n"
		b += "    isolate: true\n"
	}
	if !strings.Contains(cfg, a+b) {
		t.Fatalf("no workloads a, b in %s", cfg)
	}
	return strings.Replace(cfg, a+b, b+a, 1)
}

// A reordered workloads list moves the sharing workloads' bulkhead
// classes. Across a reload, and a restart with the file as it is, each
// workload keeps counting in its own bulkhead, with the sockets it holds:
// a holding its whole limit never takes b's room. A restart with the order
// changed again cannot tell from the pinned limits whose slot was whose
// (classes are positions): its bulkheads start counting afresh (the
// fail-open direction) rather than each workload inheriting the other's
// sockets.
func TestBulkheadsFollowReorderedWorkloads(t *testing.T) {
	f := newScopedFixture(t, sharedBulkheadConfig)
	a, b := f.cg.Child(t, "a"), f.cg.Child(t, "b")
	f.srv.ServeHold(t, 8440)
	f.start()
	dst := netip.AddrPortFrom(f.srv.IPv4, 8440)
	ha := f.topo.Client.StartDial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 3, Parallel: 3, Hold: time.Minute})
	defer kill(ha)
	hb := f.topo.Client.StartDial(t, b, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 1, Hold: time.Minute})
	defer kill(hb)
	counts := func(step string, ca, cb int64) {
		t.Helper()
		var c CircuitInfo
		if !kerneltest.WaitFor(5*time.Second, func() bool {
			c, _ = f.circuit("pool")
			return c.Bulkheads["a"].Connections == ca && c.Bulkheads["b"].Connections == cb
		}) {
			t.Fatalf("%s: pool %+v, want a counting %d and b %d", step, c, ca, cb)
		}
	}
	check := func(step string) {
		t.Helper()
		counts(step, 3, 1)
		if got := f.dialFrom(a, 8440, 1); got[unix.EAGAIN] != 1 {
			t.Fatalf("%s: a, its bulkhead full: %v, want EAGAIN", step, got)
		}
		if got := f.dialFrom(b, 8440, 1); got[0] != 1 {
			t.Fatalf("%s: b, 1 of its 3 taken: %v, want connected", step, got)
		}
	}
	check("start")
	swapped := reorder(t, sharedBulkheadConfig, false)
	f.writeConfig(strings.ReplaceAll(swapped, "CGROUP", f.cgroupRel()))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	check("reload with b first")
	f.restart()
	check("restart with b first")
	f.stop()
	f.writeConfig(strings.ReplaceAll(sharedBulkheadConfig, "CGROUP", f.cgroupRel()))
	f.start()
	counts("restart with a first again", 0, 0)
	if got := f.dialFrom(b, 8440, 1); got[0] != 1 {
		t.Fatalf("restart with a first again: b: %v, want connected", got)
	}
}

// Isolated workloads' classes are their positions too: a restart with the
// list reordered must not give b the circuit a opened (b's healthy
// connects rejected, a's failing destination let through). The moved
// classes' pinned verdicts are not adopted: both start closed (the
// fail-open direction, as a reload that changes classes drops their
// circuits).
func TestRestartReorderedIsolatedWorkloads(t *testing.T) {
	f := newScopedFixture(t, isolatedTwoConfig)
	a, b := f.cg.Child(t, "a"), f.cg.Child(t, "b")
	f.start()
	if got := f.dialFrom(a, 8430, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("a: %v", got)
	}
	f.waitState("svc@a", "open", 2*time.Second)
	syns := f.srv.SYNs(t)
	if got := f.dialFrom(a, 8430, 1); got[unix.ECONNREFUSED] != 1 || f.srv.SYNs(t) != syns {
		t.Fatalf("a, its circuit open: %v, want rejected by the kernel", got)
	}
	f.stop()
	f.writeConfig(strings.ReplaceAll(reorder(t, isolatedTwoConfig, true), "CGROUP", f.cgroupRel()))
	f.start()
	for _, name := range []string{"svc@a", "svc@b"} {
		if c, ok := f.circuit(name); ok && c.State != "closed" {
			t.Errorf("%s after the restart: %s, want closed", name, c.State)
		}
	}
	syns = f.srv.SYNs(t)
	got := f.dialFrom(b, 8430, 2)
	if n := f.srv.SYNs(t) - syns; n != 2 {
		t.Fatalf("b, healthy, after a restart with the list reordered: %v with %d SYNs sent, want both sent", got, n)
	}
}

// isolatedTwoWorkloads are two isolated workloads, a and b, in that
// order (reorder swaps them).
const isolatedTwoWorkloads = `
failsafe_timeout: 5s
workloads:
  - name: a
    cgroups: [CGROUP/a]
    isolate: true
  - name: b
    cgroups: [CGROUP/b]
    isolate: true
`

const isolatedTwoConfig = isolatedTwoWorkloads + `targets:
  svc:
    match: {cidrs: [SRV], ports: ["8430"]}
    consecutive_failures: 2
    open_duration: 1m
`

// A reordered workloads list moves the sharing workloads' bulkhead
// classes; each workload keeps its slot, and with it the cgroups its
// bulkhead turned away, also when its slot counts no socket at the reload
// (given back and taken again, two idle slots could change hands: each
// workload then got a new epoch and the pool listed no one).
func TestBulkheadRejectionsFollowReorderedIdleWorkloads(t *testing.T) {
	f := newScopedFixture(t, sharedBulkheadConfig)
	a, b := f.cg.Child(t, "a"), f.cg.Child(t, "b")
	la, lb := f.cgroupRel()+"/a", f.cgroupRel()+"/b"
	f.srv.ServeHold(t, 8440)
	f.start()
	dst := netip.AddrPortFrom(f.srv.IPv4, 8440)
	for _, x := range []struct {
		cg *kerneltest.Cgroup
		w  string
		n  int
	}{{a, "a", 2}, {b, "b", 1}} {
		h := f.topo.Client.StartDial(t, x.cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 3, Parallel: 3, Hold: time.Minute})
		if !kerneltest.WaitFor(5*time.Second, func() bool {
			c, _ := f.circuit("pool")
			return c.Bulkheads[x.w].Connections == 3
		}) {
			kill(h)
			t.Fatalf("%s's holder did not fill its bulkhead", x.w)
		}
		f.overFrom(x.cg, 8440, x.n)
		kill(h)
	}
	f.waitConnections("pool", 0) // both slots idle
	want := map[string]kinds{la: {0, 2}, lb: {0, 1}}
	f.waitRejectedKinds("pool", want)
	swapped := reorder(t, sharedBulkheadConfig, false)
	for i := range 20 {
		cfg := swapped
		if i%2 == 1 {
			cfg = sharedBulkheadConfig
		}
		f.writeConfig(strings.ReplaceAll(cfg, "CGROUP", f.cgroupRel()))
		if err := f.d.Reload(); err != nil {
			t.Fatal(err)
		}
		f.waitRejectedKinds("pool", want)
	}
	// Each workload still counts in its own bulkhead.
	h := f.topo.Client.StartDial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 3, Parallel: 3, Hold: time.Minute})
	defer kill(h)
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		c, _ := f.circuit("pool")
		return c.Bulkheads["a"].Connections == 3 && c.Bulkheads["b"].Connections == 0
	}) {
		c, _ := f.circuit("pool")
		t.Fatalf("pool %+v, want a counting 3 and b 0", c.Bulkheads)
	}
	f.overFrom(a, 8440, 1)
	if got := f.dialFrom(b, 8440, 1); got[0] != 1 {
		t.Fatalf("b, its bulkhead empty: %v, want connected", got)
	}
	f.waitRejectedKinds("pool", map[string]kinds{la: {0, 3}, lb: {0, 1}})
}

// A restart that moves isolated workloads' classes drops their pinned
// limits entries; an entry that only marks sockets for the response
// programs (no bulkhead) turned no connect away, so dropping it loses no
// protection and is not reported at Warn as a dropped bulkhead.
func TestRestartMovedResponseOnlyLimitsNotWarned(t *testing.T) {
	f := newScopedFixture(t, isolatedResponsesConfig)
	f.cg.Child(t, "a")
	f.cg.Child(t, "b")
	f.start()
	all, err := f.d.k.AllLimits()
	if err != nil {
		t.Fatal(err)
	}
	marks := 0
	for _, l := range all {
		if l.Responses != 0 && l.MaxConnections == 0 && l.MaxConnecting == 0 {
			marks++
		}
	}
	if marks == 0 {
		t.Fatalf("limits %v: want response-only entries before the restart", all)
	}
	f.stop()
	f.writeConfig(strings.ReplaceAll(reorder(t, isolatedResponsesConfig, true), "CGROUP", f.cgroupRel()))
	f.start()
	var line string
	for _, l := range strings.Split(f.logs.String(), "\n") {
		if strings.Contains(l, "workload classes changed since the previous daemon") {
			line = l
		}
	}
	if line == "" {
		t.Fatalf("the moved classes were not logged:\n%s", f.logs.String())
	}
	if !strings.Contains(line, "level=INFO") || !strings.Contains(line, "bulkhead_limits_dropped=0") {
		t.Fatalf("moved response-only entries reported as lost protection: %s", line)
	}
}

const isolatedResponsesConfig = isolatedTwoWorkloads + `targets:
  web:
    match: {cidrs: [SRV], ports: ["8450"]}
    protocol: http
    consecutive_failures: 2
`
