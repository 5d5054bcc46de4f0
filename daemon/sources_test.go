package daemon

import (
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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
