package daemon

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/policy"
)

// cgroupRel is the fixture cgroup's path relative to the cgroup v2 mount,
// what CGROUP in a test configuration stands for.
func (f *fixture) cgroupRel() string {
	root, err := kerneltest.CgroupV2Mount()
	if err != nil {
		f.t.Fatal(err)
	}
	rel, err := filepath.Rel(root, f.cg.Path)
	if err != nil {
		f.t.Fatal(err)
	}
	return rel
}

func (f *fixture) dialFrom(cg *kerneltest.Cgroup, port uint16, n int) map[unix.Errno]int {
	f.t.Helper()
	return errnos(f.topo.Client.Dial(f.t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, port), Count: n}))
}

func newScopedFixture(t *testing.T, yaml string) *fixture {
	f := newFixture(t, "mode: enforce\n")
	f.writeConfig(strings.ReplaceAll(yaml, "CGROUP", f.cgroupRel()))
	return f
}

// workloadEntries counts the kernel's workloads map.
func (f *fixture) workloadEntries() map[uint64]uint8 {
	f.t.Helper()
	m, err := f.d.k.Workloads()
	if err != nil {
		f.t.Fatal(err)
	}
	return m
}

const scopedConfig = `
failsafe_timeout: 5s
workloads:
  - name: sel
    cgroups: [CGROUP/sel, CGROUP/also-*]
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8400"]}
    consecutive_failures: 3
    open_duration: 1m
    reject_errno: EHOSTUNREACH
`

// A selected and an unselected process, in sibling cgroups of the attach
// point, connect to the same failing destination: only the selected one's
// failures count, and only it is rejected once the circuit opens. Two
// workloads that are not isolated share the circuit (the default).
func TestScopingSelectedOnly(t *testing.T) {
	f := newScopedFixture(t, scopedConfig)
	sel, also, unsel := f.cg.Child(t, "sel"), f.cg.Child(t, "also-1"), f.cg.Child(t, "unsel")
	f.start()
	if n := len(f.workloadEntries()); n != 2 {
		t.Fatalf("workloads map has %d entries, want 2 (sel and also-1)", n)
	}
	// Ten failures of the unselected process count for nothing.
	if got := f.dialFrom(unsel, 8400, 10); got[unix.ECONNREFUSED] != 10 {
		t.Fatalf("unselected: %v, want 10 refused by the server", got)
	}
	f.sentinel(sel, 8409) // a selected process's record, read after theirs would be
	if c, _ := f.circuit("svc"); c.State != "closed" || c.Calls != 0 {
		t.Fatalf("the unselected process's failures counted: %+v", c)
	}
	// Three of the selected one open the circuit.
	if got := f.dialFrom(sel, 8400, 3); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("selected: %v", got)
	}
	f.waitState("svc", "open", 2*time.Second)
	if c, _ := f.circuit("svc"); c.Workload != policy.SharedWorkload {
		t.Fatalf("circuit workload %q, want %q", c.Workload, policy.SharedWorkload)
	}
	syns := f.srv.SYNs(t)
	if got := f.dialFrom(sel, 8400, 5); got[unix.EHOSTUNREACH] != 5 {
		t.Fatalf("selected, open circuit: %v, want 5 rejected", got)
	}
	if got := f.dialFrom(also, 8400, 5); got[unix.EHOSTUNREACH] != 5 {
		t.Fatalf("another shared workload, open circuit: %v, want 5 rejected (the circuit is shared)", got)
	}
	if n := f.srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs of selected processes reached an open circuit's host", n)
	}
	if got := f.dialFrom(unsel, 8400, 5); got[unix.ECONNREFUSED] != 5 {
		t.Fatalf("unselected, open circuit: %v, want 5 refused by the server (never rejected)", got)
	}
	if !strings.Contains(f.logs.String(), "circuit=svc target=svc from=closed to=open reason=consecutive_failures") || !strings.Contains(f.logs.String(), "calls=3 workload=shared") {
		t.Fatalf("transition log line without the workload:\n%s", f.logs.String())
	}
}

// A cgroup made after start-up is protected within 100 ms of its mkdir,
// measured as the time until its entry is in the kernel map (and then
// shown by a rejection); removed cgroups leave no entry.
func TestScopingNewCgroupsAndNoLeak(t *testing.T) {
	f := newScopedFixture(t, scopedConfig+"    state: forced_open\n")
	f.start()
	base := len(f.workloadEntries())
	var worst time.Duration
	for i := range 20 {
		path := filepath.Join(f.cg.Path, "also-"+string(rune('a'+i)))
		start := time.Now()
		if err := os.Mkdir(path, 0o755); err != nil {
			t.Fatal(err)
		}
		id, err := cgroupID(path)
		if err != nil {
			t.Fatal(err)
		}
		// Polled every 200 µs (one map lookup), so the figure is the
		// daemon's latency, not the poll's.
		var took time.Duration
		ok := false
		for time.Since(start) < time.Second {
			if _, in, err := f.d.k.Workload(id); err != nil {
				t.Fatal(err)
			} else if in {
				ok = true
				took = time.Since(start)
				break
			}
			time.Sleep(200 * time.Microsecond)
		}
		if !ok {
			os.Remove(path)
			t.Fatalf("cgroup %s not in the workloads map a second after its creation", path)
		}
		worst = max(worst, took)
		if i == 0 {
			cg := &kerneltest.Cgroup{Path: path}
			if got := f.dialFrom(cg, 8400, 2); got[unix.EHOSTUNREACH] != 2 {
				os.Remove(path)
				t.Fatalf("a process in the new cgroup: %v, want rejected", got)
			}
		}
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		if !kerneltest.WaitFor(time.Second, func() bool { _, in := f.workloadEntries()[id]; return !in }) {
			t.Fatalf("removed cgroup %s still in the workloads map", path)
		}
	}
	t.Logf("new cgroups in the workloads map within %v of their mkdir (worst of 20; 200 µs polls)", worst)
	bound := 100 * time.Millisecond
	if kerneltest.Emulated() {
		bound = time.Second
	}
	if worst > bound {
		t.Fatalf("a new cgroup took %v to be protected, want within %v", worst, bound)
	}
	// Nested cgroups made in one go (mkdir -p): the child is made before
	// the watch on its parent exists, and is still found.
	deep := filepath.Join(f.cg.Path, "also-deep", "x", "y")
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(time.Second, func() bool { return len(f.workloadEntries()) == base+1 }) {
		t.Fatalf("workloads map has %d entries, want %d (also-deep only: its children match no pattern)", len(f.workloadEntries()), base+1)
	}
	for _, p := range []string{deep, filepath.Dir(deep), filepath.Dir(filepath.Dir(deep))} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	if !kerneltest.WaitFor(time.Second, func() bool { return len(f.workloadEntries()) == base }) {
		t.Fatalf("after removing every cgroup made: %d entries, want %d", len(f.workloadEntries()), base)
	}
	if n := len(f.d.scope.counts()); base == 0 && n != 0 {
		t.Fatalf("the daemon still counts %d workloads' cgroups", n)
	}
}

const perWorkloadConfig = `
failsafe_timeout: 5s
workloads:
  - name: a
    cgroups: [CGROUP/a]
  - name: b
    cgroups: [CGROUP/b]
targets:
  svc-a:
    source: [a]
    match: {cidrs: [SRV], ports: ["8410", "8411"]}
    consecutive_failures: 2
    open_duration: 1m
    max_connections: 3
  svc-b:
    source: [b]
    match: {cidrs: [SRV], ports: ["8410", "8411"]}
    consecutive_failures: 50
    max_connections: 5
`

// Two workloads with their own options for the same destinations have
// their own circuits, which trip independently, and their own bulkheads,
// which do not count each other's connections.
func TestScopingPerWorkloadPolicies(t *testing.T) {
	f := newScopedFixture(t, perWorkloadConfig)
	a, b := f.cg.Child(t, "a"), f.cg.Child(t, "b")
	f.start()
	// Bulkheads: the server holds every connection.
	f.srv.ServeHold(t, 8411)
	dst := netip.AddrPortFrom(f.srv.IPv4, 8411)
	ha := f.topo.Client.StartDial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 10, Parallel: 10, Hold: time.Minute})
	hb := f.topo.Client.StartDial(t, b, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 10, Parallel: 10, Hold: time.Minute})
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		ca, _ := f.circuit("svc-a@a")
		cb, _ := f.circuit("svc-b@b")
		return ca.Connections == 3 && ca.BulkheadRejected == 7 && cb.Connections == 5 && cb.BulkheadRejected == 5
	}) {
		ca, _ := f.circuit("svc-a@a")
		cb, _ := f.circuit("svc-b@b")
		t.Fatalf("bulkheads: a %+v\nb %+v", ca, cb)
	}
	ha.Cmd.Process.Kill()
	ha.Cmd.Wait()
	hb.Cmd.Process.Kill()
	hb.Cmd.Wait()

	// Circuits: two failures of a open a's circuit only.
	if got := f.dialFrom(a, 8410, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("a: %v", got)
	}
	f.waitState("svc-a@a", "open", 2*time.Second)
	if got := f.dialFrom(a, 8410, 3); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("a, open circuit: %v, want 3 rejected (ECONNREFUSED from the kernel)", got)
	}
	syns := f.srv.SYNs(t)
	if got := f.dialFrom(b, 8410, 4); got[unix.ECONNREFUSED] != 4 {
		t.Fatalf("b: %v", got)
	}
	if n := f.srv.SYNs(t) - syns; n != 4 {
		t.Fatalf("%d of b's 4 SYNs reached the server, want all: a's open circuit must not reject b", n)
	}
	cb, _ := f.circuit("svc-b@b")
	if cb.State != "closed" || cb.Failures != 4 || cb.Workload != "b" || cb.Target != "svc-b" {
		t.Fatalf("b's circuit: %+v, want closed with b's 4 failures", cb)
	}
	if ca, _ := f.circuit("svc-a@a"); ca.Workload != "a" || ca.Rejected != 3 {
		t.Fatalf("a's circuit: %+v, want workload a and 3 rejections", ca)
	}
	if c, ok := f.circuit("svc-a"); ok {
		t.Fatalf("a shared circuit exists for a sourced target: %+v", c)
	}
}

const sharedTwoConfig = `
failsafe_timeout: 5s
workloads:
  - name: a
    cgroups: [CGROUP/a]
  - name: b
    cgroups: [CGROUP/b]
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8420"]}
    consecutive_failures: 2
    open_duration: 1m
`

// A reload that isolates a workload gives it its own circuits at once (its
// cgroup's class in the kernel map changes first), leaves the shared one
// to the others, and one that stops isolating it drops them again.
func TestScopingReloadIsolates(t *testing.T) {
	f := newScopedFixture(t, sharedTwoConfig)
	a, b := f.cg.Child(t, "a"), f.cg.Child(t, "b")
	aID, _ := a.ID()
	bID, _ := b.ID()
	f.start()
	if got := f.dialFrom(a, 8420, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("a: %v", got)
	}
	f.waitState("svc", "open", 2*time.Second)
	syns := f.srv.SYNs(t)
	if got := f.dialFrom(b, 8420, 2); got[unix.ECONNREFUSED] != 2 || f.srv.SYNs(t) != syns {
		t.Fatalf("b, shared circuit open: %v (SYNs %d → %d), want rejected by the kernel", got, syns, f.srv.SYNs(t))
	}

	isolated := strings.Replace(sharedTwoConfig, "cgroups: [CGROUP/a]", "cgroups: [CGROUP/a]\n    isolate: true", 1)
	f.writeConfig(strings.ReplaceAll(isolated, "CGROUP", f.cgroupRel()))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if m := f.workloadEntries(); m[aID] != 1 || m[bID] != 0 || len(m) != 2 {
		t.Fatalf("workloads map after isolating a: %v, want a→1, b→0", m)
	}
	if c, ok := f.circuit("svc@a"); !ok || c.State != "closed" || c.Workload != "a" {
		t.Fatalf("a's own circuit after the reload: %+v (%v)", c, ok)
	}
	syns = f.srv.SYNs(t)
	if got := f.dialFrom(a, 8420, 1); got[unix.ECONNREFUSED] != 1 || f.srv.SYNs(t) == syns {
		t.Fatalf("a, isolated with a closed circuit: %v, want its SYN sent (refused by the server)", got)
	}
	if got := f.dialFrom(b, 8420, 1); got[unix.ECONNREFUSED] != 1 {
		t.Fatalf("b: %v", got)
	}
	if c, _ := f.circuit("svc"); c.State != "open" {
		t.Fatalf("the shared circuit after the reload: %+v, want still open", c)
	}

	f.writeConfig(strings.ReplaceAll(sharedTwoConfig, "CGROUP", f.cgroupRel()))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, ok := f.circuit("svc@a"); ok {
		t.Fatal("a's own circuit outlived its isolation")
	}
	if m := f.workloadEntries(); m[aID] != 0 || len(m) != 2 {
		t.Fatalf("workloads map after the second reload: %v, want a→0", m)
	}
	syns = f.srv.SYNs(t)
	if got := f.dialFrom(a, 8420, 2); got[unix.ECONNREFUSED] != 2 || f.srv.SYNs(t) != syns {
		t.Fatalf("a, shared again with the shared circuit open: %v, want rejected by the kernel", got)
	}
}
