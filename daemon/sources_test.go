package daemon

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/policy"
)

const sourcePatternConfig = `
failsafe_timeout: 5s
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8430"]}
    consecutive_failures: 2
    open_duration: 1m
    reject_errno: EHOSTUNREACH
  svc-p:
    source: ["cgroup:CGROUP/p-*"]
    match: {cidrs: [SRV], ports: ["8430"]}
    consecutive_failures: 3
    open_duration: 1m
    reject_errno: ENETUNREACH
`

// A cgroup pattern in a source, with no workloads listed: the pattern's
// cgroups get the target's own circuit (named with the derived workload),
// every other process stays protected by the shared circuit, and the
// kernel is told Classes, not Scoped. A configuration without patterns or
// workloads sets neither flag and writes no workload entry.
func TestScopingSourcePattern(t *testing.T) {
	f := newScopedFixture(t, sourcePatternConfig)
	p, other := f.cg.Child(t, "p-1"), f.cg.Child(t, "other")
	pID, _ := p.ID()
	f.start()
	s, err := f.d.k.Settings()
	if err != nil || s.Scoped || !s.Classes {
		t.Fatalf("settings %+v (%v): want Classes without Scoped", s, err)
	}
	w := policy.SourceWorkload(f.cgroupRel() + "/p-*")
	if m := f.workloadEntries(); len(m) != 1 || m[pID] != 1 {
		t.Fatalf("workloads map %v, want only p-1 in class 1", m)
	}
	// The other process's failures open the shared circuit; it is then
	// rejected, and p-1's connections are not.
	if got := f.dialFrom(other, 8430, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("other: %v", got)
	}
	f.waitState("svc", "open", 2*time.Second)
	if got := f.dialFrom(other, 8430, 2); got[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("other with the shared circuit open: %v, want EHOSTUNREACH (a process of no pattern stays protected)", got)
	}
	syns := f.srv.SYNs(t)
	if got := f.dialFrom(p, 8430, 3); got[unix.ECONNREFUSED] != 3 || f.srv.SYNs(t)-syns != 3 {
		t.Fatalf("p-1 with the shared circuit open: %v, want its 3 SYNs sent (refused by the server)", got)
	}
	name := "svc-p@" + w
	f.waitState(name, "open", 2*time.Second)
	c, _ := f.circuit(name)
	if c.Workload != w || c.Target != "svc-p" {
		t.Fatalf("p's circuit %+v, want workload %s", c, w)
	}
	if got := f.dialFrom(p, 8430, 2); got[unix.ENETUNREACH] != 2 {
		t.Fatalf("p-1 with its own circuit open: %v, want ENETUNREACH", got)
	}
	if !strings.Contains(f.logs.String(), "workload="+w) {
		t.Fatalf("no transition line names %s:\n%s", w, f.logs.String())
	}
	// A cgroup made later that matches the pattern joins it.
	p2 := f.cg.Child(t, "p-2")
	if got := f.dialFrom(p2, 8430, 1); got[unix.ENETUNREACH] != 1 {
		t.Fatalf("p-2, made after start: %v, want its pattern's open circuit", got)
	}

	// Without the pattern (no workloads, no patterns): nothing is looked
	// up, as before workloads existed.
	f.writeConfig(strings.ReplaceAll(strings.Split(sourcePatternConfig, "  svc-p:")[0], "CGROUP", f.cgroupRel()))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	s, _ = f.d.k.Settings()
	if s.Scoped || s.Classes {
		t.Fatalf("settings of an unscoped configuration %+v: want neither flag", s)
	}
	if m := f.workloadEntries(); len(m) != 0 {
		t.Fatalf("workloads map of an unscoped configuration: %v", m)
	}
	if got := f.dialFrom(p, 8430, 1); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("p-1, pattern gone: %v, want the shared circuit's rejection", got)
	}
}

const sharedBulkheadConfig = `
failsafe_timeout: 5s
workloads:
  - name: a
    cgroups: [CGROUP/a]
  - name: b
    cgroups: [CGROUP/b]
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8440"]}
    max_connections: 3
  svc:
    match: {cidrs: [SRV], ports: ["8441"]}
    consecutive_failures: 2
    open_duration: 1m
    reject_errno: EHOSTUNREACH
`

// Workloads that share circuits (the default) have bulkheads of their
// own: two processes in sibling cgroups each get the whole limit, counted
// apart, while one circuit per destination still sees both workloads'
// failures. The counts carry across a restart (each workload's slot is
// adopted with its sockets) and a reload.
func TestScopingBulkheadsPerWorkload(t *testing.T) {
	f := newScopedFixture(t, sharedBulkheadConfig)
	a, b := f.cg.Child(t, "a"), f.cg.Child(t, "b")
	f.srv.ServeHold(t, 8440)
	f.start()
	dst := netip.AddrPortFrom(f.srv.IPv4, 8440)
	ha := f.topo.Client.StartDial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 5, Parallel: 5, Hold: time.Minute})
	hb := f.topo.Client.StartDial(t, b, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 5, Parallel: 5, Hold: time.Minute})
	defer kill(ha)
	defer kill(hb)
	want := func(step string, ca, cb int64) {
		t.Helper()
		var c CircuitInfo
		if !kerneltest.WaitFor(5*time.Second, func() bool {
			c, _ = f.circuit("pool")
			return c.Bulkheads["a"].Connections == ca && c.Bulkheads["b"].Connections == cb && c.Connections == ca+cb
		}) {
			t.Fatalf("%s: pool %+v, want a holding %d and b %d, each in its own bulkhead", step, c, ca, cb)
		}
		if c.Workload != policy.SharedWorkload || len(c.Bulkheads) != 2 {
			t.Fatalf("%s: pool %+v, want one shared circuit with two bulkheads", step, c)
		}
	}
	want("start", 3, 3)
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		c, _ := f.circuit("pool")
		return c.Bulkheads["a"].BulkheadRejected == 2 && c.Bulkheads["b"].BulkheadRejected == 2 && c.BulkheadRejected == 4
	}) {
		c, _ := f.circuit("pool")
		t.Fatalf("pool %+v, want 2 rejected in each workload's bulkhead", c)
	}
	// The circuit is still shared: a's failures open it for b too.
	if got := f.dialFrom(a, 8441, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("a: %v", got)
	}
	f.waitState("svc", "open", 2*time.Second)
	if got := f.dialFrom(b, 8441, 1); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("b with the shared circuit open: %v, want rejected", got)
	}

	f.restart()
	want("restart", 3, 3)
	for _, cg := range []*kerneltest.Cgroup{a, b} {
		if got := f.dialFrom(cg, 8440, 1); got[unix.EAGAIN] != 1 {
			t.Fatalf("%s over its bulkhead after the restart: %v, want EAGAIN", cg.Path, got)
		}
	}
	kill(ha)
	want("a's holder gone", 0, 3)
	if got := f.dialFrom(a, 8440, 2); got[0] != 2 {
		t.Fatalf("a, its bulkhead empty, b's full: %v, want 2 connected", got)
	}
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	want("reload", 0, 3)
	if got := f.dialFrom(b, 8440, 1); got[unix.EAGAIN] != 1 {
		t.Fatalf("b over its bulkhead after the reload: %v, want EAGAIN", got)
	}
	// The kernel holds one limits entry per workload, and none of class 0
	// (no process outside the workloads is protected).
	all, err := f.d.k.AllLimits()
	if err != nil || len(all) != 2 {
		t.Fatalf("limits %v (%v), want one entry per workload", all, err)
	}
}
