package daemon

import (
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
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

// The attach point removed and made again (with a selected child made at
// once, before breakerd looks): the ground check re-attaches and rescans,
// so the workloads map holds the new cgroup (the old entry is gone) and
// its process is protected; a child made after that is found by the watch
// on the new directory.
func TestScopingAttachPointRecreated(t *testing.T) {
	f := newScopedFixture(t, scopedConfig+"    state: forced_open\n")
	f.checkEvery = -1 // checks run by hand below
	sel := f.cg.Child(t, "sel")
	oldID, _ := sel.ID()
	f.start()
	if m := f.workloadEntries(); len(m) != 1 || m[oldID] != 0 {
		t.Fatalf("workloads map %v, want sel only", m)
	}
	if err := os.Remove(sel.Path); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(f.cg.Path); err != nil {
		t.Fatal(err)
	}
	f.d.checkGround(t.Context())
	if f.ready() {
		t.Fatal("ready with the attach point gone")
	}
	if !kerneltest.WaitFor(time.Second, func() bool { return len(f.workloadEntries()) == 0 }) {
		t.Fatalf("entries of removed cgroups left: %v", f.workloadEntries())
	}
	if err := os.Mkdir(f.cg.Path, 0o755); err != nil {
		t.Fatal(err)
	}
	sel = f.cg.Child(t, "sel")
	newID, _ := sel.ID()
	if _, in := f.workloadEntries()[newID]; in {
		t.Fatal("the new sel is in the map before any check: the test shows nothing")
	}
	f.d.checkGround(t.Context())
	if !f.ready() {
		t.Fatalf("not ready once the attach point is back:\n%s", f.logs.String())
	}
	if m := f.workloadEntries(); len(m) != 1 || m[newID] != 0 {
		t.Fatalf("workloads map after the rescan %v, want the new sel (%d) only", m, newID)
	}
	if got := f.dialFrom(sel, 8400, 2); got[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("a process in the recreated sel: %v, want the forced-open circuit's EHOSTUNREACH", got)
	}
	late := f.cg.Child(t, "also-late")
	lateID, _ := late.ID()
	if !kerneltest.WaitFor(time.Second, func() bool { _, in := f.workloadEntries()[lateID]; return in }) {
		t.Fatalf("a cgroup made in the recreated attach point is not in the map: %v", f.workloadEntries())
	}
	if got := f.dialFrom(late, 8400, 1); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("a process in also-late: %v, want rejected", got)
	}
	if got := f.dialFrom(f.cg.Child(t, "unsel"), 8400, 1); got[unix.ECONNREFUSED] != 1 {
		t.Fatalf("an unselected process in the recreated attach point: %v, want refused by the server", got)
	}
}

// gauge reads one series of a gauge from the daemon's registry (-1: none).
func (f *fixture) gauge(name string, labels map[string]string) float64 {
	f.t.Helper()
	if m := f.series(name, labels); m != nil {
		return m.GetGauge().GetValue()
	}
	return -1
}

// series finds one series of a metric in the daemon's registry: the
// first whose labels include labels (nil: none).
func (f *fixture) series(name string, labels map[string]string) *dto.Metric {
	f.t.Helper()
	mfs, err := f.d.metrics.reg.Gather()
	if err != nil {
		f.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					continue next
				}
			}
			return m
		}
	}
	return nil
}

// A workloads map that is full (sized 2 here; 65,536 in production): a new
// cgroup of a workload is not protected, which an error line and
// breakerd_workload_cgroups_unprotected say, and it is protected as soon as
// a removed cgroup makes room, without waiting for a rescan.
func TestScopingWorkloadsMapFull(t *testing.T) {
	f := newScopedFixture(t, scopedConfig+"    state: forced_open\n")
	f.maxWorkloadCgroups = 2
	f.cg.Child(t, "sel")
	first := f.cg.Child(t, "also-1")
	f.start()
	sel := map[string]string{"workload": "sel"}
	if n := len(f.workloadEntries()); n != 2 || f.gauge("breakerd_workload_cgroups_capacity", nil) != 2 || f.gauge("breakerd_workload_cgroups_unprotected", sel) != 0 {
		t.Fatalf("%d entries, capacity %v, unprotected %v: want 2, 2, 0", n, f.gauge("breakerd_workload_cgroups_capacity", nil), f.gauge("breakerd_workload_cgroups_unprotected", sel))
	}
	late := f.cg.Child(t, "also-2")
	lateID, _ := late.ID()
	if !kerneltest.WaitFor(time.Second, func() bool { return f.gauge("breakerd_workload_cgroups_unprotected", sel) == 1 }) {
		t.Fatalf("unprotected %v, want 1 (also-2)", f.gauge("breakerd_workload_cgroups_unprotected", sel))
	}
	if !strings.Contains(f.logs.String(), "cgroup not protected: writing its workload") || !strings.Contains(f.logs.String(), "workloads map is full") {
		t.Fatalf("no error line for the full map:\n%s", f.logs.String())
	}
	if got := f.dialFrom(late, 8400, 1); got[unix.ECONNREFUSED] != 1 {
		t.Fatalf("also-2, not in the full map: %v, want through (refused by the server)", got)
	}
	// A restart on the same pins finds the same: two entries, also-2 left
	// out and said so.
	f.restart()
	if n := len(f.workloadEntries()); n != 2 || f.gauge("breakerd_workload_cgroups_unprotected", sel) != 1 {
		t.Fatalf("after a restart: %d entries, unprotected %v; want 2 and 1", n, f.gauge("breakerd_workload_cgroups_unprotected", sel))
	}
	if err := os.Remove(first.Path); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(time.Second, func() bool { _, in := f.workloadEntries()[lateID]; return in }) {
		t.Fatalf("also-2 not written within a second of also-1's removal: %v", f.workloadEntries())
	}
	if v := f.gauge("breakerd_workload_cgroups_unprotected", sel); v != 0 {
		t.Fatalf("unprotected %v once there was room, want 0", v)
	}
	if got := f.dialFrom(late, 8400, 1); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("also-2, protected: %v, want rejected", got)
	}
	if n := strings.Count(f.logs.String(), "cgroup not protected: writing its workload"); n != 2 {
		t.Fatalf("%d error lines for one cgroup over two daemons, want 2 (one each)", n)
	}
}
