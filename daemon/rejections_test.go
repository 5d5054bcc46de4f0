package daemon

import (
	"io"
	"log/slog"
	"maps"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

const rejectedConfig = `
failsafe_timeout: 30s
targets:
  down:
    match: {cidrs: [SRV], ports: ["8403"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
`

// waitRejectedBy waits until circuit name lists exactly want (label →
// rejections).
func (f *fixture) waitRejectedBy(name string, want map[string]uint64) {
	f.t.Helper()
	var c CircuitInfo
	ok := kerneltest.WaitFor(5*time.Second, func() bool {
		c, _ = f.circuit(name)
		got := map[string]uint64{}
		for _, r := range c.RejectedBy {
			got[r.Label()] = r.Rejected
		}
		return c.RejectedByTotal == len(want) && maps.Equal(got, want)
	})
	if !ok {
		f.t.Fatalf("circuit %s rejected_by %+v (total %d), want %v", name, c.RejectedBy, c.RejectedByTotal, want)
	}
}

// rejectFrom makes n connects from cg to the server's port and fails the
// test unless every one is rejected (EHOSTUNREACH, the tests' errno).
func (f *fixture) rejectFrom(cg *kerneltest.Cgroup, port uint16, n int) {
	f.t.Helper()
	if got := f.dialFrom(cg, port, n); got[unix.EHOSTUNREACH] != n {
		f.t.Fatalf("connects from %s to port %d: %v, want %d rejected", cg.Path, port, got, n)
	}
}

// rejectionEntries counts the kernel's rejections map.
func (f *fixture) rejectionEntries() int {
	f.t.Helper()
	rs, err := f.d.k.Rejections()
	if err != nil {
		f.t.Fatal(err)
	}
	return len(rs)
}

// Two processes in sibling cgroups are rejected by one forced-open
// circuit: the circuit names both cgroups with their exact counts, which
// carry on across a SIGTERM restart (rejections in the gap, by the pinned
// programs, included), a reload that keeps the circuit and a refused
// second start; a removed cgroup's entry and a dropped circuit's entries
// leave the kernel map; the circuit made again under the same (reused) id
// starts from nothing; connects that are allowed write no entry.
func TestRejectedCgroups(t *testing.T) {
	f := newFixture(t, rejectedConfig)
	f.srv.Listen(t, "tcp4", 8403) // healthy: only the verdict rejects
	f.srv.Listen(t, "tcp4", 8405)
	a, b := f.cg.Child(t, "pod-a"), f.cg.Child(t, "pod-b")
	la, lb := f.cgroupRel()+"/pod-a", f.cgroupRel()+"/pod-b"
	f.start()
	reject := func(cg *kerneltest.Cgroup, n int) { f.rejectFrom(cg, 8403, n) }
	reject(a, 5)
	reject(b, 3)
	f.waitRejectedBy("down", map[string]uint64{la: 5, lb: 3})
	if c, _ := f.circuit("down"); c.Rejected != 8 {
		t.Fatalf("circuit rejected %d, want 8", c.Rejected)
	}
	if got := f.dialFrom(a, 8405, 4); got[0] != 4 {
		t.Fatalf("connects with no verdict: %v", got)
	}
	if n := f.rejectionEntries(); n != 2 {
		t.Fatalf("%d rejection entries after allowed connects, want 2", n)
	}

	// SIGTERM restart: the pinned programs reject (and count) meanwhile.
	f.stop()
	reject(a, 2)
	f.start()
	reject(b, 1)
	f.waitRejectedBy("down", map[string]uint64{la: 7, lb: 4})

	// A reload that keeps the circuit keeps its counts.
	withOther := rejectedConfig + "  other:\n    match: {cidrs: [SRV], ports: [\"8406\"]}\n"
	f.writeConfig(withOther)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	reject(a, 1)
	f.waitRejectedBy("down", map[string]uint64{la: 8, lb: 4})

	// A second daemon on the same pins is refused and changes nothing.
	if _, err := New(Options{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}); err == nil {
		t.Fatal("a second daemon started on the same pins")
	}
	reject(b, 1)
	f.waitRejectedBy("down", map[string]uint64{la: 8, lb: 5})

	// A removed cgroup's entry goes (two sweeps).
	if err := os.Remove(b.Path); err != nil {
		t.Fatal(err)
	}
	f.waitRejectedBy("down", map[string]uint64{la: 8})
	if !kerneltest.WaitFor(5*time.Second, func() bool { return f.rejectionEntries() == 1 }) {
		t.Fatalf("%d rejection entries after the cgroup went, want 1", f.rejectionEntries())
	}

	// The circuit dropped by a reload: its entries go.
	c, _ := f.circuit("down")
	firstID := c.CircuitID
	f.writeConfig("failsafe_timeout: 30s\ntargets:\n  other:\n    match: {cidrs: [SRV], ports: [\"8406\"]}\n")
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(5*time.Second, func() bool { return f.rejectionEntries() == 0 }) {
		t.Fatalf("%d rejection entries after the circuit went, want 0", f.rejectionEntries())
	}
	// Made again, under the id it had (the last one freed): it starts
	// from nothing.
	f.writeConfig(withOther)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * rejectionsEvery)
	if c, _ := f.circuit("down"); len(c.RejectedBy) != 0 {
		t.Fatalf("the circuit made again lists %+v", c.RejectedBy)
	}
	if c, _ := f.circuit("down"); c.CircuitID != firstID {
		t.Fatalf("the circuit made again has id %d, not the reused %d: the test does not show what it claims", c.CircuitID, firstID)
	}
	reject(a, 2)
	f.waitRejectedBy("down", map[string]uint64{la: 2})
}
