package maps

import (
	"errors"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

func (e *env) putWorkload(t *testing.T, cg *kerneltest.Cgroup, class, bulkhead uint8) uint64 {
	t.Helper()
	id, err := cg.ID()
	if err != nil {
		t.Fatal(err)
	}
	if err := e.k.PutWorkload(id, class, bulkhead); err != nil {
		t.Fatal(err)
	}
	return id
}

// With Classes on and Scoped off (patterns in a source, no workloads
// listed), a cgroup with an entry is keyed by its class and a cgroup
// without one is still protected, in class 0: nothing is left unprotected.
func TestClassesWithoutScoping(t *testing.T) {
	e := newEnv(t, Options{})
	a, other := e.cg.Child(t, "a"), e.cg.Child(t, "other")
	e.putWorkload(t, a, 3, 3)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Classes: true}); err != nil {
		t.Fatal(err)
	}
	if s, err := e.k.Settings(); err != nil || !s.Classes || s.Scoped {
		t.Fatalf("settings read back %+v (%v)", s, err)
	}
	w := e.watch(t)
	const port = 8230
	e.srv.ServeHold(t, port)
	shared := e.dest(port, false)
	if err := e.k.PutVerdict(shared, Verdict{State: ForcedOpen, CircuitID: 31}); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, other, kerneltest.DialSpec{Network: "tcp4", Addr: shared.Addr, Count: 2})); got[0] != 0 {
		t.Fatalf("a cgroup of no workload, class-0 verdict open: errnos %v, want rejected (protected in class 0)", got)
	}
	if got := errnos(e.dial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: shared.Addr, Count: 2})); got[0] != 2 {
		t.Fatalf("class 3, class-0 verdict open: errnos %v, want 2 successes", got)
	}
	if err := e.k.DeleteVerdict(shared); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, other, kerneltest.DialSpec{Network: "tcp4", Addr: shared.Addr})); got[0] != 1 {
		t.Fatalf("a cgroup of no workload, no verdict: errnos %v, want success", got)
	}
	evs := w.wait(port, 3, 2*time.Second)
	classes := map[uint8]int{}
	for _, ev := range evs {
		if ev.Outcome == Established {
			classes[ev.Dest.Class]++
		}
	}
	if classes[3] != 2 || classes[0] != 1 || len(classes) != 2 {
		t.Fatalf("established records by class %v, want 2 of class 3 and 1 of class 0 (no workload: reported, class 0)", classes)
	}
}

// Two workloads that share a circuit (class 0) have bulkheads of their
// own (bulkhead classes 1 and 2): each gets its own limit, counted in its
// own slot, while the shared verdict still rejects both.
func TestBulkheadClassPerWorkload(t *testing.T) {
	e := newEnv(t, Options{})
	a, b := e.cg.Child(t, "a"), e.cg.Child(t, "b")
	e.putWorkload(t, a, 0, 1)
	e.putWorkload(t, b, 0, 2)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Scoped: true, Limits: true}); err != nil {
		t.Fatal(err)
	}
	const port = 8232
	e.srv.ServeHold(t, port)
	d := e.dest(port, false)
	da, db := d, d
	da.Class, db.Class = 1, 2
	if err := e.k.PutLimit(da, Limit{Slot: 41, MaxConnections: 2}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.PutLimit(db, Limit{Slot: 42, MaxConnections: 3}); err != nil {
		t.Fatal(err)
	}
	ha := e.topo.Client.StartDial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 5, Parallel: 5, Hold: time.Minute})
	hb := e.topo.Client.StartDial(t, b, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 5, Parallel: 5, Hold: time.Minute})
	var ca, cb BulkCount
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		ca, _ = e.k.BulkCount(41)
		cb, _ = e.k.BulkCount(42)
		ra, _ := e.k.Counters(41)
		rb, _ := e.k.Counters(42)
		return ca.Connections == 2 && cb.Connections == 3 && ra.BulkheadRejected == 3 && rb.BulkheadRejected == 2
	}) {
		ra, _ := e.k.Counters(41)
		rb, _ := e.k.Counters(42)
		t.Fatalf("slot of a: %+v (rejected %d), of b: %+v (rejected %d); want 2 (3 rejected) and 3 (2 rejected)", ca, ra.BulkheadRejected, cb, rb.BulkheadRejected)
	}
	if c, _ := e.k.BulkCount(0); c.Connections != 0 {
		t.Fatalf("slot 0 counts %+v", c)
	}
	// The circuit is shared: a class-0 verdict rejects both.
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 43}); err != nil {
		t.Fatal(err)
	}
	for _, cg := range []*kerneltest.Cgroup{a, b} {
		if got := errnos(e.dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[0] != 0 {
			t.Fatalf("%s with the shared verdict open: %v, want rejected", cg.Path, got)
		}
	}
	for _, h := range []*kerneltest.Process{ha, hb} {
		h.Cmd.Process.Kill()
		h.Cmd.Wait()
	}
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		ca, _ = e.k.BulkCount(41)
		cb, _ = e.k.BulkCount(42)
		return ca == (BulkCount{}) && cb == (BulkCount{})
	}) {
		t.Fatalf("after the holders died: a %+v, b %+v, want both 0", ca, cb)
	}
}

// clobberHandoff attaches, after breakerd's connect4 at the same cgroup,
// a connect4 program that zeroes the handoff's cookie: sockops then never
// finds its connect there, as when the connecting task was preempted and
// another connect on its CPU overwrote the handoff. It returns the link.
func (e *env) clobberHandoff(t *testing.T) link.Link {
	return e.tamperHandoff(t, 0, asm.DWord, 0)
}

// tamperHandoff is clobberHandoff storing val at off (of size) in the
// handoff entry instead.
func (e *env) tamperHandoff(t *testing.T, off int16, size asm.Size, val int64) link.Link {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:       ebpf.CGroupSockAddr,
		AttachType: ebpf.AttachCGroupInet4Connect,
		License:    "GPL",
		Instructions: asm.Instructions{
			asm.StoreImm(asm.RFP, -4, 0, asm.Word),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -4),
			asm.LoadMapPtr(asm.R1, e.k.objs.Handoff.FD()),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, "out"),
			asm.LoadImm(asm.R1, val, asm.DWord),
			asm.StoreMem(asm.R0, off, asm.R1, size),
			asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("loading the handoff tamper: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	l, err := link.AttachCgroup(link.CgroupOptions{Path: e.cg.Path, Attach: ebpf.AttachCGroupInet4Connect, Program: prog})
	if err != nil {
		t.Fatalf("attaching the handoff tamper: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// pinToCPU0 pins the calling thread (locked to it by the caller) to CPU 0,
// so the handoff its connects leave is that CPU's; unpin restores its
// affinity.
func pinToCPU0() (unpin func(), err error) {
	var was, one unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err != nil {
		return nil, err
	}
	one.Set(0)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		return nil, err
	}
	return func() { unix.SchedSetaffinity(0, &was) }, nil
}

// When sockops does not find its socket in the handoff, the socket's own
// cgroup decides whether it is observed and in which class, and a
// bulkhead count connect took is given back all the same. Provoked
// deterministically: a second connect4 program, run after breakerd's,
// clears the handoff. The test process makes each socket in one cgroup
// and connects from another, so the two decisions differ and the records
// show which one was taken.
//
// Where sockops reads the current thread (Features.SockOpsCurrent), the
// handoff names the thread: sockops takes it (a handoff saying another
// class is obeyed), clears it, and when it is lost decides by the cgroup
// the process connects from, as connect4 did.
func TestHandoffLostFallsBackToSocketCgroup(t *testing.T) {
	if !ProbeFeatures().SockOpsCurrent {
		t.Log("this kernel's sockops cannot read the current thread: the handoff names the socket")
		testHandoffLost(t, false)
		return
	}
	t.Run("cookie", func(t *testing.T) { testHandoffLost(t, false) })
	t.Run("thread", func(t *testing.T) { testHandoffLost(t, true) })
}

func testHandoffLost(t *testing.T, thread bool) {
	e := newEnv(t, Options{handoff: !thread})
	if e.k.Features().SockOpsCurrent != thread {
		t.Fatalf("loaded with SockOpsCurrent %v, want %v", e.k.Features().SockOpsCurrent, thread)
	}
	sel, made, unsel := e.cg.Child(t, "sel"), e.cg.Child(t, "made"), e.cg.Child(t, "unsel")
	e.putWorkload(t, sel, 2, 2)
	e.putWorkload(t, made, 3, 3)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Scoped: true, Limits: true}); err != nil {
		t.Fatal(err)
	}
	w := e.watch(t)
	const port = 8234
	e.srv.ServeHold(t, port)
	d := e.dest(port, false)
	d.Class = 2
	if err := e.k.PutLimit(d, Limit{Slot: 51, MaxConnections: 10, MaxConnecting: 10}); err != nil {
		t.Fatal(err)
	}
	home := selfCgroup(t)
	moveSelf := func(dir string) { t.Helper(); moveSelfTo(t, dir) }
	defer moveSelf(home)
	// try makes a socket in from and connects it from sel (class 2,
	// bulkhead counted in slot 51) on one CPU (so the handoff it leaves
	// is that CPU's), and closes it.
	try := func(from *kerneltest.Cgroup) (held BulkCount, cerr error) {
		t.Helper()
		moveSelf(from.Path)
		err := e.topo.Client.Do(func() error {
			unpin, err := pinToCPU0()
			if err != nil {
				return err
			}
			defer unpin()
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			moveSelf(sel.Path)
			cerr = unix.Connect(fd, &unix.SockaddrInet4{Addr: d.Addr.Addr().As4(), Port: int(d.Addr.Port())})
			held, _ = e.k.BulkCount(51)
			return nil
		})
		moveSelf(home)
		if err != nil {
			t.Fatalf("connect: %v", err)
		}
		return held, cerr
	}
	// connect is try, connected, checking the count.
	connect := func(from *kerneltest.Cgroup) {
		t.Helper()
		held, cerr := try(from)
		if cerr != nil {
			t.Fatalf("connect: %v", cerr)
		}
		if held.Connections != 1 || held.Connecting != 0 {
			t.Fatalf("an established socket counted from sel: slot %+v, want 1 connection and none connecting", held)
		}
		var got BulkCount
		if !kerneltest.WaitFor(2*time.Second, func() bool { got, _ = e.k.BulkCount(51); return got == (BulkCount{}) }) {
			t.Fatalf("after close: slot %+v, want nothing (a count leaked)", got)
		}
	}
	established := func(n int) map[uint8]int {
		t.Helper()
		evs := w.wait(port, n, 2*time.Second)
		out := map[uint8]int{}
		for _, ev := range evs {
			if ev.Outcome == Established {
				out[ev.Dest.Class]++
			}
		}
		return out
	}

	// The handoff intact: connect-time cgroup (sel, class 2) decides.
	connect(unsel)
	connect(made)
	if got := established(2); got[2] != 2 || len(got) != 1 {
		t.Fatalf("records with the handoff intact by class %v, want 2 of class 2", got)
	}
	if thread {
		cleared := func(after string) {
			t.Helper()
			var hs []bpf.BreakerConnectHandoff
			if err := e.k.objs.Handoff.Lookup(uint32(0), &hs); err != nil {
				t.Fatal(err)
			}
			for cpu, h := range hs {
				if h.Cookie != 0 {
					t.Fatalf("CPU %d's handoff after %s: %+v, want cleared", cpu, after, h)
				}
			}
		}
		cleared("the connects (taken)")
		// A rejected connect leaves no handoff either.
		if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 52}); err != nil {
			t.Fatal(err)
		}
		if _, err := try(made); !errors.Is(err, unix.ECONNREFUSED) {
			t.Fatalf("connect with the circuit forced open: %v, want rejected", err)
		}
		cleared("a rejected connect")
		if err := e.k.DeleteVerdict(d); err != nil {
			t.Fatal(err)
		}
		// A handoff naming this thread and class 3 (plus one, in the
		// lower half) is what sockops goes by.
		class := e.tamperHandoff(t, 0, asm.Word, 4)
		connect(unsel)
		connect(made)
		if got := established(4); got[2] != 2 || got[3] != 2 || len(got) != 2 {
			t.Fatalf("records with the handoff saying class 3, by class %v, want 2 more of class 3", got)
		}
		// One naming another thread (upper half; no thread id is that
		// high) is not: the cgroup the process connects from decides
		// (sel, class 2).
		other := e.tamperHandoff(t, 4, asm.Word, 0x7fffffff)
		connect(unsel)
		connect(made)
		if got := established(6); got[2] != 4 || got[3] != 2 || len(got) != 2 {
			t.Fatalf("records with the handoff naming another thread, by class %v, want 2 more of class 2", got)
		}
		class.Close()
		other.Close()
		// Lost (cleared): the same.
		e.clobberHandoff(t)
		connect(unsel)
		connect(made)
		if got := established(8); got[2] != 6 || got[3] != 2 || len(got) != 2 {
			t.Fatalf("records with the handoff lost, by class %v, want 2 more of class 2", got)
		}
		return
	}
	e.clobberHandoff(t)
	// The handoff lost: the socket's cgroup decides. Made in unsel (no
	// workload): not observed, no record, count still given back. Made in
	// made (class 3): observed, its records carry class 3.
	connect(unsel)
	connect(made)
	if got := established(3); got[2] != 2 || got[3] != 1 || len(got) != 2 {
		t.Fatalf("records with the handoff lost by class %v, want still 2 of class 2 and 1 of class 3 (none for the socket made in unsel)", got)
	}
	w.sentinel(t, e, made, 9198) // a late record would be read before it
	if got := established(3); got[2] != 2 || got[3] != 1 || len(got) != 2 {
		t.Fatalf("late records: by class %v", got)
	}
}
