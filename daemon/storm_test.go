package daemon

import (
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

const stormConfig = `
failsafe_timeout: 5s
workloads:
  - name: sel
    cgroups: [CGROUP/sel-*]
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8430"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
`

// stormSize is how many sibling cgroups a storm makes and removes:
// BREAKERD_STORM_CGROUPS, else 3,000 (1,000 under qemu).
func stormSize(t *testing.T) int {
	if s := os.Getenv("BREAKERD_STORM_CGROUPS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 2 {
			t.Fatalf("BREAKERD_STORM_CGROUPS=%q: want a count of at least 2", s)
		}
		return n
	}
	if kerneltest.Emulated() {
		return 1000
	}
	return 3000
}

// stormBound is how soon after its mkdir a new cgroup of a workload must
// be protected during a storm. Issue 32 asks for 50 ms and the daemon's
// share stays well within it (BENCHMARKS.md: 10 to 25 ms from the mkdir to
// the first rejection, at 3,000 and at 10,000 cgroups), but the figure
// also holds the kernel's cgroup lock waits for the mkdir and the move,
// and CI runs other tests beside this one: the bound is three times the
// goal, still below what the code before the batched watch took in this
// test (200 to 720 ms at 3,000). Under qemu it is 2 s.
func stormBound() time.Duration {
	if kerneltest.Emulated() {
		return 2 * time.Second
	}
	return 150 * time.Millisecond
}

// drain drops the results a stream has reported so far.
func drain(s *kerneltest.Stream) {
	for {
		select {
		case <-s.Results:
		default:
			return
		}
	}
}

// protection follows a stream that was moved into a new cgroup at moved
// (the cgroup was made at made): it returns how long after made the first
// connect the kernel rejected began, and how many connects that began
// after moved got through before it. Once one is rejected, the next 20
// must be too.
func protection(t *testing.T, s *kerneltest.Stream, made, moved time.Time, bound time.Duration) (time.Duration, int) {
	t.Helper()
	through := 0
	deadline := time.After(bound)
	var first time.Time
	for rejected := 0; rejected < 21; {
		select {
		case r, ok := <-s.Results:
			if !ok {
				t.Fatal("the stream helper ended")
			}
			start := time.Unix(0, r.Start)
			if start.Before(moved) {
				continue
			}
			switch {
			case r.Errno == unix.EHOSTUNREACH:
				if rejected == 0 {
					first = start
				}
				rejected++
			case r.Errno == unix.ECONNREFUSED && rejected == 0:
				through++
			default:
				t.Fatalf("a connect from the new cgroup, %d after its first rejection: %v, want EHOSTUNREACH (rejected by the kernel) once protected", rejected, r.Errno)
			}
		case <-deadline:
			t.Fatalf("the new cgroup is not protected %v after its mkdir: %d connects got through", bound, through)
		}
	}
	return first.Sub(made), through
}

// A storm of thousands of sibling cgroups made, then removed, below the
// attach point (a node starting or draining many pods at once) does not
// hold up the protection of a new cgroup of a workload made in the middle
// of it: a real process moved into it is rejected by the open circuit
// within stormBound of the mkdir. The delays are logged (BENCHMARKS.md
// has the figures). Afterwards the daemon tracks just the cgroups that
// are left.
func TestScopingCgroupStorm(t *testing.T) {
	n := stormSize(t)
	f := newScopedFixture(t, stormConfig)
	// Removed before the fixture's cgroup, also when the test fails (once
	// a storm still going has ended).
	var storms sync.WaitGroup
	t.Cleanup(func() {
		storms.Wait()
		if err := kerneltest.RemoveCgroupStorm(f.cg.Path); err != nil {
			t.Errorf("removing the storm's cgroups: %v", err)
		}
	})
	hold := f.cg.Child(t, "hold")
	f.start()
	s := f.topo.Client.StartStream(t, hold, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8430), Interval: time.Millisecond, Timeout: time.Second})
	defer s.Close()
	if r := <-s.Results; r.Errno != unix.ECONNREFUSED {
		t.Fatalf("a connect from an unselected cgroup: %v, want refused by the server", r.Errno)
	}
	bound := 2 * time.Second
	if kerneltest.Emulated() {
		bound = 10 * time.Second
	}
	within := stormBound()
	for i, remove := range []bool{false, true} {
		what := "made"
		if remove {
			what = "removed"
		}
		half := make(chan struct{})
		t0 := time.Now()
		done := kerneltest.CgroupStorm(&storms, f.cg.Path, n, remove, half)
		<-half
		made := time.Now()
		sel := f.cg.Child(t, fmt.Sprintf("sel-%d", i))
		if err := sel.AddProc(s.PID()); err != nil {
			t.Fatal(err)
		}
		moved := time.Now()
		delay, through := protection(t, s, made, moved, bound)
		if err := <-done; err != nil {
			t.Fatalf("storm: %v", err)
		}
		t.Logf("%d cgroups %s in %v; a new selected cgroup made halfway protected %v after its mkdir, %d connects through", n, what, time.Since(t0).Round(time.Millisecond), delay.Round(100*time.Microsecond), through)
		if delay > within {
			t.Fatalf("a new selected cgroup made halfway through %d cgroups %s was protected %v after its mkdir, want within %v", n, what, delay.Round(100*time.Microsecond), within)
		}
		// Back to an unselected cgroup: its connects reach the server.
		if err := hold.AddProc(s.PID()); err != nil {
			t.Fatal(err)
		}
		back := time.Now()
		drain(s)
		for r := range s.Results {
			if time.Unix(0, r.Start).After(back) {
				if r.Errno != unix.ECONNREFUSED {
					t.Fatalf("a connect from the unselected cgroup again: %v, want refused by the server", r.Errno)
				}
				break
			}
		}
	}
	// Only the attach point, hold, sel-0 and sel-1 are left; the workloads
	// map holds sel-0 and sel-1.
	if !kerneltest.WaitFor(5*time.Second, func() bool { return len(f.d.scope.cgroupIDs()) == 4 }) {
		t.Fatalf("the daemon tracks %d cgroups after the storm, want 4", len(f.d.scope.cgroupIDs()))
	}
	if m := f.workloadEntries(); len(m) != 2 {
		t.Fatalf("workloads map after the storm: %v, want sel-0 and sel-1", m)
	}
}

const recreatedConfig = `
failsafe_timeout: 5s
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8431"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
`

// The protected cgroup removed and made again is re-attached when its
// parent's watch reports it, not at the next interval's check (a minute
// here): a real process moved into the new directory is rejected by the
// open circuit soon after. The delay is logged; the bound asserted is a
// generous one.
func TestRecreatedCgroupProtectedAtOnce(t *testing.T) {
	f := newFixture(t, recreatedConfig)
	f.checkEvery = time.Minute
	outside := kerneltest.NewCgroup(t)
	f.start()
	if got := errnos(f.dial(8431, 1, 0)); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("a connect from the protected cgroup: %v, want rejected", got)
	}
	s := f.topo.Client.StartStream(t, outside, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8431), Interval: time.Millisecond, Timeout: time.Second})
	defer s.Close()
	if r := <-s.Results; r.Errno != unix.ECONNREFUSED {
		t.Fatalf("a connect from an unprotected cgroup: %v, want refused by the server", r.Errno)
	}
	if err := os.Remove(f.cg.Path); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(2*time.Second, func() bool { return !f.ready() }) {
		t.Fatal("still ready 2 s after the protected cgroup was removed")
	}
	if err := os.Mkdir(f.cg.Path, 0o755); err != nil {
		t.Fatal(err)
	}
	made := time.Now()
	if err := f.cg.AddProc(s.PID()); err != nil {
		t.Fatal(err)
	}
	moved := time.Now()
	bound := 2 * time.Second
	if kerneltest.Emulated() {
		bound = 10 * time.Second
	}
	delay, through := protection(t, s, made, moved, bound)
	t.Logf("the protected cgroup made again: protected %v after its mkdir, %d connects through", delay.Round(100*time.Microsecond), through)
	if !kerneltest.WaitFor(2*time.Second, f.ready) {
		t.Fatalf("not ready once the cgroup is back:\n%s", f.logs.String())
	}
}
