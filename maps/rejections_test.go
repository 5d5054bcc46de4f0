package maps

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

// rejectionsOf returns the rejections map's entries by key.
func rejectionsOf(t *testing.T, k *Kernel) map[RejectionKey]Rejection {
	t.Helper()
	rs, err := k.Rejections()
	if err != nil {
		t.Fatal(err)
	}
	out := map[RejectionKey]Rejection{}
	for _, r := range rs {
		out[r.RejectionKey] = r
	}
	return out
}

// idOf is cg's cgroup id.
func idOf(t *testing.T, cg *kerneltest.Cgroup) uint64 {
	t.Helper()
	id, err := cg.ID()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// Two processes in sibling cgroups are rejected by one open verdict: the
// rejections map counts each cgroup's rejections exactly, under the
// verdict's circuit id and epoch; a verdict without an epoch records
// nothing (and still rejects); shadow rejections are counted apart; a
// connect that is allowed (a destination without a verdict) writes no
// entry.
func TestRejectionsByCgroup(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8090)
	a, b := e.cg.Child(t, "pod-a"), e.cg.Child(t, "pod-b")
	idA, idB := idOf(t, a), idOf(t, b)
	want := unix.ECONNREFUSED
	if !e.k.Features().SetRetval {
		want = unix.EPERM
	}
	d := e.dest(8090, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 7, Epoch: 41}); err != nil {
		t.Fatal(err)
	}
	dial := func(cg *kerneltest.Cgroup, network string, n int) {
		t.Helper()
		if got := errnos(e.dial(t, cg, kerneltest.DialSpec{Network: network, Addr: d.Addr, Count: n})); got[want] != n {
			t.Fatalf("errnos %v, want %d × %v", got, n, want)
		}
	}
	dial(a, "tcp4", 5)
	dial(b, "tcp4", 3)
	dial(b, "tcp6", 2) // a dual-stack socket to the IPv4 address: same verdict
	got := rejectionsOf(t, e.k)
	wantMap := map[RejectionKey]Rejection{
		{idA, 7, 41}: {RejectionKey: RejectionKey{idA, 7, 41}, Rejected: 5},
		{idB, 7, 41}: {RejectionKey: RejectionKey{idB, 7, 41}, Rejected: 5},
	}
	if len(got) != len(wantMap) || got[RejectionKey{idA, 7, 41}] != wantMap[RejectionKey{idA, 7, 41}] || got[RejectionKey{idB, 7, 41}] != wantMap[RejectionKey{idB, 7, 41}] {
		t.Fatalf("rejections %+v, want %+v", got, wantMap)
	}
	if cnt, _ := e.k.Counters(7); cnt.Rejected != 10 {
		t.Fatalf("circuit counters %+v, want 10 rejections (the sum)", cnt)
	}
	// Another circuit on the same id (epoch 42): entries of its own.
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 7, Epoch: 42}); err != nil {
		t.Fatal(err)
	}
	dial(a, "tcp4", 1)
	if r := rejectionsOf(t, e.k)[RejectionKey{idA, 7, 42}]; r.Rejected != 1 {
		t.Fatalf("the new epoch's entry %+v, want 1 rejection", r)
	}
	if r := rejectionsOf(t, e.k)[RejectionKey{idA, 7, 41}]; r.Rejected != 5 {
		t.Fatalf("the old epoch's entry %+v changed", r)
	}
	// No epoch: rejected, not recorded.
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 7}); err != nil {
		t.Fatal(err)
	}
	dial(a, "tcp4", 2)
	if n := len(rejectionsOf(t, e.k)); n != 3 {
		t.Fatalf("%d entries after rejections under a verdict without epoch, want 3", n)
	}
	// Shadow mode: would-be rejections, apart.
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 7, Epoch: 42}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Shadow: true}); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, b, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 4})); got[0] != 4 {
		t.Fatalf("shadow mode: %v, want 4 connected", got)
	}
	if r := rejectionsOf(t, e.k)[RejectionKey{idB, 7, 42}]; r.Rejected != 0 || r.ShadowRejected != 4 {
		t.Fatalf("shadow entry %+v, want 4 shadow rejections", r)
	}
	// An allowed connect writes nothing.
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.DeleteVerdict(d); err != nil {
		t.Fatal(err)
	}
	before := len(rejectionsOf(t, e.k))
	if got := errnos(e.dial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})); got[0] != 3 {
		t.Fatalf("no verdict: %v, want 3 connected", got)
	}
	if n := len(rejectionsOf(t, e.k)); n != before {
		t.Fatalf("allowed connects wrote %d entries", n-before)
	}
	// Delete removes exactly the keys given.
	if err := e.k.DeleteRejections([]RejectionKey{{idA, 7, 41}, {idA, 7, 99}}); err != nil {
		t.Fatal(err)
	}
	if _, ok := rejectionsOf(t, e.k)[RejectionKey{idA, 7, 41}]; ok {
		t.Fatal("deleted entry still there")
	}
}

// A full rejections map: a new (circuit, cgroup) pair is not recorded and
// counted in the stats, and the connect is rejected all the same, by an
// open circuit or a bulkhead.
func TestRejectionsMapFull(t *testing.T) {
	e := newEnv(t, Options{})
	for i := range uint64(MaxRejections) {
		k := bpf.BreakerRejectionKey{CgroupId: 1 << 40, CircuitId: 3, Epoch: uint32(i + 1)}
		if err := e.k.objs.Rejections.Put(&k, &bpf.BreakerRejectionCount{}); err != nil {
			t.Fatalf("filling entry %d: %v", i, err)
		}
	}
	d := e.dest(8091, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 7, Epoch: 1}); err != nil {
		t.Fatal(err)
	}
	want := unix.ECONNREFUSED
	if !e.k.Features().SetRetval {
		want = unix.EPERM
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})); got[want] != 3 {
		t.Fatalf("errnos %v, want 3 × %v", got, want)
	}
	st, err := e.k.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.RejectionsFull != 3 {
		t.Fatalf("stats %+v, want 3 rejections not recorded", st)
	}
	if cnt, _ := e.k.Counters(7); cnt.Rejected != 3 {
		t.Fatalf("circuit counters %+v, want 3", cnt)
	}
	if n := len(rejectionsOf(t, e.k)); n != MaxRejections {
		t.Fatalf("%d entries, want %d", n, MaxRejections)
	}

	// A bulkhead's rejection of a new pair: not recorded either, counted.
	e.srv.ServeHold(t, 8093)
	ld := e.limit(t, 8093, Limit{Slot: 8, MaxConnections: 1, Epoch: 1})
	holder := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: ld.Addr, Hold: time.Minute})
	t.Cleanup(func() { holder.Cmd.Process.Kill(); holder.Cmd.Wait() })
	e.waitCount(t, 8, BulkCount{Connections: 1})
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: ld.Addr, Count: 2})); got[unix.EAGAIN] != 2 {
		t.Fatalf("errnos %v, want 2 × EAGAIN", got)
	}
	if st, err := e.k.Stats(); err != nil || st.RejectionsFull != 5 {
		t.Fatalf("stats %+v (%v), want 5 rejections not recorded", st, err)
	}
	if cnt, _ := e.k.Counters(8); cnt.BulkheadRejected != 2 {
		t.Fatalf("slot counters %+v, want 2 bulkhead rejections", cnt)
	}
}

// Processes in two sibling cgroups are turned away by a full bulkhead:
// the rejections map counts each cgroup's bulkhead rejections exactly,
// under the limit's slot and epoch, apart from an open circuit's
// rejections of the same circuit (one entry, two counts); a limit without
// an epoch records nothing (and still rejects); shadow mode counts apart;
// connects the bulkhead admits write no entry.
func TestBulkheadRejectionsByCgroup(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8092)
	a, b := e.cg.Child(t, "pod-a"), e.cg.Child(t, "pod-b")
	idA, idB := idOf(t, a), idOf(t, b)
	d := e.limit(t, 8092, Limit{Slot: 30, MaxConnections: 2, Epoch: 51})
	// a holds both connections the bulkhead allows: admitted, so no entry.
	holder := e.topo.Client.StartDial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 2, Parallel: 2, Hold: time.Minute})
	t.Cleanup(func() { holder.Cmd.Process.Kill(); holder.Cmd.Wait() })
	e.waitCount(t, 30, BulkCount{Connections: 2})
	if n := len(rejectionsOf(t, e.k)); n != 0 {
		t.Fatalf("admitted connects wrote %d entries", n)
	}
	over := func(cg *kerneltest.Cgroup, n int, want unix.Errno) {
		t.Helper()
		if got := errnos(e.dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: n})); got[want] != n {
			t.Fatalf("errnos %v, want %d × %v", got, n, want)
		}
	}
	over(a, 4, unix.EAGAIN)
	over(b, 3, unix.EAGAIN)
	want := map[RejectionKey]Rejection{
		{idA, 30, 51}: {RejectionKey: RejectionKey{idA, 30, 51}, BulkheadRejected: 4},
		{idB, 30, 51}: {RejectionKey: RejectionKey{idB, 30, 51}, BulkheadRejected: 3},
	}
	check := func(step string) {
		t.Helper()
		got := rejectionsOf(t, e.k)
		if len(got) != len(want) {
			t.Fatalf("%s: rejections %+v, want %+v", step, got, want)
		}
		for k, w := range want {
			if got[k] != w {
				t.Fatalf("%s: rejections %+v, want %+v", step, got, want)
			}
		}
	}
	check("over the limit")
	if cnt, _ := e.k.Counters(30); cnt.BulkheadRejected != 7 || cnt.Rejected != 0 {
		t.Fatalf("slot counters %+v, want 7 bulkhead rejections (the sum) and no other", cnt)
	}

	// The same circuit's open verdict (its id and epoch): the verdict
	// rejects first, counted in the same entry's open-circuit count.
	verdictErrno := unix.ECONNREFUSED
	if !e.k.Features().SetRetval {
		verdictErrno = unix.EPERM
	}
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 30, Epoch: 51}); err != nil {
		t.Fatal(err)
	}
	over(a, 2, verdictErrno)
	want[RejectionKey{idA, 30, 51}] = Rejection{RejectionKey: RejectionKey{idA, 30, 51}, Rejected: 2, BulkheadRejected: 4}
	check("open verdict")
	if err := e.k.DeleteVerdict(d); err != nil {
		t.Fatal(err)
	}

	// A limit without an epoch: rejected, not recorded.
	if err := e.k.PutLimit(d, Limit{Slot: 30, MaxConnections: 2}); err != nil {
		t.Fatal(err)
	}
	over(b, 2, unix.EAGAIN)
	check("no epoch")

	// Another holder of the slot (epoch 52): entries of its own.
	if err := e.k.PutLimit(d, Limit{Slot: 30, MaxConnections: 2, Epoch: 52}); err != nil {
		t.Fatal(err)
	}
	over(b, 1, unix.EAGAIN)
	want[RejectionKey{idB, 30, 52}] = Rejection{RejectionKey: RejectionKey{idB, 30, 52}, BulkheadRejected: 1}
	check("another epoch")

	// Shadow mode: would-be rejections, apart; the connects go through.
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true, Shadow: true}); err != nil {
		t.Fatal(err)
	}
	over(a, 3, 0)
	want[RejectionKey{idA, 30, 52}] = Rejection{RejectionKey: RejectionKey{idA, 30, 52}, BulkheadShadowRejected: 3}
	check("shadow")
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}

	// Room in the bulkhead again: admitted connects write nothing.
	holder.Cmd.Process.Kill()
	holder.Cmd.Wait()
	e.waitCount(t, 30, BulkCount{})
	over(a, 3, 0)
	over(b, 3, 0)
	check("admitted")
}
