package maps

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

func (e *env) scope(t *testing.T, on bool) {
	t.Helper()
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Scoped: on}); err != nil {
		t.Fatal(err)
	}
}

func (e *env) selectCgroup(t *testing.T, cg *kerneltest.Cgroup, class uint8) uint64 {
	t.Helper()
	id, err := cg.ID()
	if err != nil {
		t.Fatal(err)
	}
	if err := e.k.PutWorkload(id, class, class); err != nil {
		t.Fatal(err)
	}
	return id
}

// With scoping on, only processes whose cgroup is in the workloads map are
// rejected, and only their outcomes are reported; a sibling cgroup of the
// same attach point connecting to the same failing destination is left
// alone and unreported.
func TestScopedSelectsByCgroup(t *testing.T) {
	e := newEnv(t, Options{})
	sel, unsel := e.cg.Child(t, "sel"), e.cg.Child(t, "unsel")
	e.selectCgroup(t, sel, 0)
	e.scope(t, true)
	w := e.watch(t)

	// Refused (no listener): 3 connects from the selected cgroup, 5 from
	// the other; only 3 records.
	const port = 8190
	d := e.dest(port, false)
	if got := errnos(e.dial(t, unsel, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 5})); got[unix.ECONNREFUSED] != 5 {
		t.Fatalf("unselected: errnos %v, want 5 refused by the server", got)
	}
	if got := errnos(e.dial(t, sel, kerneltest.DialSpec{Network: "tcp6", Addr: d.Addr, Count: 3})); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("selected: errnos %v, want 3 refused by the server", got)
	}
	evs := w.wait(port, 4, 2*time.Second)
	expectOutcomes(t, evs, Refused, Refused, Refused)

	// An open verdict rejects the selected process only; no SYN of the
	// selected one reaches the server.
	e.srv.ServeHold(t, port+1)
	open := e.dest(port+1, false)
	if err := e.k.PutVerdict(open, Verdict{State: ForcedOpen, CircuitID: 7}); err != nil {
		t.Fatal(err)
	}
	before := e.srv.SYNs(t)
	if got := errnos(e.dial(t, sel, kerneltest.DialSpec{Network: "tcp4", Addr: open.Addr, Count: 4})); got[0] != 0 {
		t.Fatalf("selected: errnos %v, want every connect rejected", got)
	}
	if n := e.srv.SYNs(t) - before; n != 0 {
		t.Fatalf("%d SYNs of the selected process reached the server of an open circuit", n)
	}
	if got := errnos(e.dial(t, unsel, kerneltest.DialSpec{Network: "tcp4", Addr: open.Addr, Count: 4})); got[0] != 4 {
		t.Fatalf("unselected: errnos %v, want 4 successes", got)
	}
	if got := errnos(e.dial(t, unsel, kerneltest.DialSpec{Network: "udp4", Op: "sendto", Addr: open.Addr})); got[0] != 1 {
		t.Fatalf("unselected UDP: errnos %v, want success", got)
	}
	if c, _ := e.k.Counters(7); c.Rejected != 4 {
		t.Fatalf("rejected counter %d, want 4 (the selected connects only)", c.Rejected)
	}
	// The records of the unselected process's established connections
	// are not reported either.
	if evs := w.wait(port+1, 1, 300*time.Millisecond); len(evs) != 0 {
		t.Fatalf("records of an unselected process: %v", outcomes(evs))
	}

	// Scoping off: everything below the attach point is protected again.
	e.scope(t, false)
	if got := errnos(e.dial(t, unsel, kerneltest.DialSpec{Network: "tcp4", Addr: open.Addr})); got[0] != 0 {
		t.Fatalf("unscoped: errnos %v, want a rejection", got)
	}
}

// A workload's class is part of the key: a verdict of class 2 rejects the
// cgroup of class 2 and not a class-0 one, and its records carry class 2.
func TestScopedClassKeysVerdictsAndRecords(t *testing.T) {
	e := newEnv(t, Options{})
	a, b := e.cg.Child(t, "a"), e.cg.Child(t, "b")
	e.selectCgroup(t, a, 2)
	e.selectCgroup(t, b, 0)
	e.scope(t, true)
	w := e.watch(t)
	const port = 8195
	e.srv.ServeHold(t, port)
	d := e.dest(port, false)
	d.Class = 2
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 9}); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 2})); got[0] != 0 {
		t.Fatalf("class 2: errnos %v, want rejections", got)
	}
	if got := errnos(e.dial(t, b, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 2})); got[0] != 2 {
		t.Fatalf("class 0: errnos %v, want 2 successes", got)
	}
	if err := e.k.DeleteVerdict(d); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, a, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[0] != 1 {
		t.Fatalf("class 2 after delete: errnos %v, want success", got)
	}
	evs := w.wait(port, 3, 2*time.Second)
	classes := map[uint8]int{}
	for _, ev := range evs {
		if ev.Outcome == Established {
			classes[ev.Dest.Class]++
		}
	}
	if classes[0] != 2 || classes[2] != 1 || len(classes) != 2 {
		t.Fatalf("established records by class %v, want 2 of class 0 and 1 of class 2", classes)
	}
}

// selfCgroup returns this process's cgroup v2 directory.
func selfCgroup(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			root, err := kerneltest.CgroupV2Mount()
			if err != nil {
				t.Fatal(err)
			}
			return filepath.Join(root, rest)
		}
	}
	t.Fatal("no cgroup v2 line in /proc/self/cgroup")
	return ""
}

// moveSelfTo moves the test process (every thread) to the cgroup dir.
func moveSelfTo(t *testing.T, dir string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		t.Fatalf("moving the test process to %s: %v", dir, err)
	}
}

// A process is judged by the cgroup it is in when it connects, not the one
// its socket was made in: the test process makes a socket in the
// unselected cgroup, moves to the selected one and is rejected; makes one
// there, moves out and is let through.
func TestScopedJudgedAtConnectTime(t *testing.T) {
	e := newEnv(t, Options{})
	sel, unsel := e.cg.Child(t, "sel"), e.cg.Child(t, "unsel")
	e.selectCgroup(t, sel, 0)
	e.scope(t, true)
	const port = 8197
	e.srv.ServeHold(t, port)
	d := e.dest(port, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 11}); err != nil {
		t.Fatal(err)
	}
	home := selfCgroup(t)
	moveSelf := func(dir string) { t.Helper(); moveSelfTo(t, dir) }
	defer moveSelf(home)
	connectAfterMove := func(from, to *kerneltest.Cgroup) error {
		moveSelf(from.Path)
		var cerr error
		err := e.topo.Client.Do(func() error {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			moveSelf(to.Path)
			cerr = unix.Connect(fd, &unix.SockaddrInet4{Addr: d.Addr.Addr().As4(), Port: int(d.Addr.Port())})
			return nil
		})
		moveSelf(home)
		if err != nil {
			t.Fatal(err)
		}
		return cerr
	}
	if err := connectAfterMove(unsel, sel); err != unix.ECONNREFUSED {
		t.Fatalf("socket made unselected, connect from the selected cgroup: %v, want ECONNREFUSED (rejected)", err)
	}
	if err := connectAfterMove(sel, unsel); err != nil {
		t.Fatalf("socket made selected, connect from the unselected cgroup: %v, want success", err)
	}
}
