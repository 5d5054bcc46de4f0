package daemon

import (
	"io"
	"log/slog"
	"maps"
	"net/netip"
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
// rejections by the open circuit; none by a bulkhead).
func (f *fixture) waitRejectedBy(name string, want map[string]uint64) {
	f.t.Helper()
	kw := map[string]kinds{}
	for l, n := range want {
		kw[l] = kinds{open: n}
	}
	f.waitRejectedKinds(name, kw)
}

// rejectFrom makes n connects from cg to the server's port and fails the
// test unless every one is rejected (EHOSTUNREACH, the tests' errno).
func (f *fixture) rejectFrom(cg *kerneltest.Cgroup, port uint16, n int) {
	f.t.Helper()
	if got := f.dialFrom(cg, port, n); got[unix.EHOSTUNREACH] != n {
		f.t.Fatalf("connects from %s to port %d: %v, want %d rejected", cg.Path, port, got, n)
	}
}

// dropAndRemake drops circuit name by a reload to without (the circuit's
// target gone), checks that its entries leave the kernel map, makes it
// again by a reload to with, and checks that it lists nothing under the
// id it had (the last one freed, so reused).
func (f *fixture) dropAndRemake(name, without, with string) {
	f.t.Helper()
	c, _ := f.circuit(name)
	firstID := c.CircuitID
	f.writeConfig(without)
	if err := f.d.Reload(); err != nil {
		f.t.Fatal(err)
	}
	if !kerneltest.WaitFor(5*time.Second, func() bool { return f.rejectionEntries() == 0 }) {
		f.t.Fatalf("%d rejection entries after circuit %s went, want 0", f.rejectionEntries(), name)
	}
	f.writeConfig(with)
	if err := f.d.Reload(); err != nil {
		f.t.Fatal(err)
	}
	f.d.sweepRejections() // a sweep after the remake, whatever the loop's timing
	c, _ = f.circuit(name)
	if len(c.RejectedBy) != 0 {
		f.t.Fatalf("circuit %s made again lists %+v", name, c.RejectedBy)
	}
	if c.CircuitID != firstID {
		f.t.Fatalf("circuit %s made again has id %d, not the reused %d: the test does not show what it claims", name, c.CircuitID, firstID)
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

	f.dropAndRemake("down", "failsafe_timeout: 30s\ntargets:\n  other:\n    match: {cidrs: [SRV], ports: [\"8406\"]}\n", withOther)
	reject(a, 2)
	f.waitRejectedBy("down", map[string]uint64{la: 2})
}

const bulkRejectedConfig = `
failsafe_timeout: 30s
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8407"]}
    max_connections: 1
    consecutive_failures: 1000
    reject_errno: EHOSTUNREACH
`

// kinds is one pod's or cgroup's rejections by a circuit: open, and by
// its bulkhead.
type kinds struct{ open, bulkhead uint64 }

// waitRejectedKinds waits until circuit name lists exactly want (label →
// rejections of each kind).
func (f *fixture) waitRejectedKinds(name string, want map[string]kinds) {
	f.t.Helper()
	var c CircuitInfo
	ok := kerneltest.WaitFor(5*time.Second, func() bool {
		c, _ = f.circuit(name)
		got := map[string]kinds{}
		for _, r := range c.RejectedBy {
			got[r.Label()] = kinds{r.Rejected, r.BulkheadRejected}
		}
		return c.RejectedByTotal == len(want) && maps.Equal(got, want)
	})
	if !ok {
		f.t.Fatalf("circuit %s rejected_by %+v (total %d), want %v", name, c.RejectedBy, c.RejectedByTotal, want)
	}
}

// overFrom makes n connects from cg to the bulkheaded port and fails the
// test unless the bulkhead turns every one away (EAGAIN).
func (f *fixture) overFrom(cg *kerneltest.Cgroup, port uint16, n int) {
	f.t.Helper()
	if got := f.dialFrom(cg, port, n); got[unix.EAGAIN] != n {
		f.t.Fatalf("connects from %s to port %d: %v, want %d turned away by the bulkhead", cg.Path, port, got, n)
	}
}

// Two processes in sibling cgroups are turned away by a full bulkhead
// (max_connections 1, held by a third cgroup): the circuit names both
// with their exact bulkhead counts, apart from what the same circuit
// rejects while open, across a SIGTERM restart (rejections in the gap
// included), a reload that keeps the circuit and a refused second start;
// the holder's admitted connect writes no entry; a removed cgroup's entry
// and a dropped circuit's entries leave the kernel map; the circuit made
// again under the same (reused) id starts from nothing.
func TestBulkheadRejectedCgroups(t *testing.T) {
	f := newFixture(t, bulkRejectedConfig)
	f.srv.ServeHold(t, 8407)
	a, b, h := f.cg.Child(t, "pod-a"), f.cg.Child(t, "pod-b"), f.cg.Child(t, "pod-h")
	la, lb := f.cgroupRel()+"/pod-a", f.cgroupRel()+"/pod-b"
	f.start()
	hold := func() *kerneltest.Process {
		p := f.topo.Client.StartDial(t, h, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8407), Hold: time.Minute})
		t.Cleanup(func() { kill(p) })
		// The bulkhead of a named target applies from start-up: the
		// holder's connect is counted at once.
		f.waitConnections("pool", 1)
		return p
	}
	holder := hold()
	over := func(cg *kerneltest.Cgroup, n int) { f.overFrom(cg, 8407, n) }
	over(a, 4)
	over(b, 3)
	f.waitRejectedKinds("pool", map[string]kinds{la: {0, 4}, lb: {0, 3}})
	if c, _ := f.circuit("pool"); c.BulkheadRejected != 7 || c.Rejected != 0 {
		t.Fatalf("circuit %+v, want 7 bulkhead rejections and no other", c)
	}
	if n := f.rejectionEntries(); n != 2 {
		t.Fatalf("%d rejection entries (the holder's admitted connect wrote one?), want 2", n)
	}

	// SIGTERM restart: the pinned programs turn connects away (and count
	// them) meanwhile.
	f.stop()
	over(b, 2)
	f.start()
	over(a, 1)
	f.waitRejectedKinds("pool", map[string]kinds{la: {0, 5}, lb: {0, 5}})

	// A reload that keeps the circuit keeps its counts.
	withOther := bulkRejectedConfig + "  other:\n    match: {cidrs: [SRV], ports: [\"8409\"]}\n"
	f.writeConfig(withOther)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	over(a, 1)
	f.waitRejectedKinds("pool", map[string]kinds{la: {0, 6}, lb: {0, 5}})

	// A second daemon on the same pins is refused and changes nothing.
	if _, err := New(Options{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}); err == nil {
		t.Fatal("a second daemon started on the same pins")
	}
	over(b, 1)
	f.waitRejectedKinds("pool", map[string]kinds{la: {0, 6}, lb: {0, 6}})

	// Open, the same circuit rejects before its bulkhead: counted apart,
	// in the same cgroup's line.
	if _, err := f.d.Force("pool", "open"); err != nil {
		t.Fatal(err)
	}
	f.rejectFrom(a, 8407, 2)
	f.waitRejectedKinds("pool", map[string]kinds{la: {2, 6}, lb: {0, 6}})
	if _, err := f.d.Force("pool", "release"); err != nil {
		t.Fatal(err)
	}
	over(a, 1)
	f.waitRejectedKinds("pool", map[string]kinds{la: {2, 7}, lb: {0, 6}})

	// A removed cgroup's entry goes (two sweeps).
	if err := os.Remove(b.Path); err != nil {
		t.Fatal(err)
	}
	f.waitRejectedKinds("pool", map[string]kinds{la: {2, 7}})
	if !kerneltest.WaitFor(5*time.Second, func() bool { return f.rejectionEntries() == 1 }) {
		t.Fatalf("%d rejection entries after the cgroup went, want 1", f.rejectionEntries())
	}

	// (Its id is held back while the holder's socket counts in its
	// slot: the holder goes first, so the circuit made again can reuse
	// it.)
	kill(holder)
	f.waitConnections("pool", 0)
	f.dropAndRemake("pool", "failsafe_timeout: 30s\ntargets:\n  other:\n    match: {cidrs: [SRV], ports: [\"8409\"]}\n", withOther)
	hold()
	over(a, 2)
	f.waitRejectedKinds("pool", map[string]kinds{la: {0, 2}})
}
