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
	idA, err := a.ID()
	if err != nil {
		t.Fatal(err)
	}
	idB, err := b.ID()
	if err != nil {
		t.Fatal(err)
	}
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
// counted in the stats, and the connect is rejected all the same.
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
}
