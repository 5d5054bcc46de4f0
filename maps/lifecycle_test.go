package maps

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

// restart closes e.k as a stopping daemon does (pins stay) and loads a
// new Kernel on the same pins, with a fresh heartbeat.
func (e *env) restart(t *testing.T) {
	t.Helper()
	if err := e.k.Close(); err != nil {
		t.Fatal(err)
	}
	e.k = e.load(t)
	s, err := e.k.Settings()
	if err != nil {
		t.Fatal(err)
	}
	s.Heartbeat = Now()
	if err := e.k.SetSettings(s); err != nil {
		t.Fatal(err)
	}
}

func linkID(t *testing.T, path string) link.ID {
	t.Helper()
	l, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		t.Fatalf("pinned link %s: %v", path, err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		t.Fatal(err)
	}
	return info.ID
}

// Sockets counted in a bulkhead before a restart are released into the same
// slot after it: the socket storage is pinned with the other maps.
func TestBulkheadCountsSurviveRestart(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8210)
	d := e.limit(t, 8210, Limit{Slot: 30, MaxConnections: 3})
	holder := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3, Parallel: 3, Hold: time.Minute})
	e.waitCount(t, 30, BulkCount{Connections: 3})

	e.restart(t)
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[unix.EAGAIN] != 1 {
		t.Fatalf("bulkhead full across the restart: %v, want EAGAIN", got)
	}
	holder.Cmd.Process.Kill()
	holder.Cmd.Wait()
	e.waitCount(t, 30, BulkCount{})
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3, Parallel: 3, Barrier: true, Hold: 200 * time.Millisecond})); got[0] != 3 {
		t.Fatalf("after the holders closed: %v, want 3 through", got)
	}
	e.waitCount(t, 30, BulkCount{})
}

// Kernel counters live in the pinned maps: a restart keeps them.
func TestCountersSurviveRestart(t *testing.T) {
	e := newEnv(t, Options{})
	d := e.dest(8211, false)
	if err := e.k.PutVerdict(d, OpenVerdict(Now()+farFuture, 1, 0, 0, 31)); err != nil {
		t.Fatal(err)
	}
	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 4})
	e.restart(t)
	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})
	if c, err := e.k.Counters(31); err != nil || c.Rejected != 7 {
		t.Fatalf("counters after restart: %+v %v, want 7 rejections", c, err)
	}
}

// A second Load on the same pins is refused while the first holds them,
// before it changes anything.
func TestSecondLoadOnSamePinsRefused(t *testing.T) {
	e := newEnv(t, Options{})
	d := e.dest(8212, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 32}); err != nil {
		t.Fatal(err)
	}
	before := linkID(t, filepath.Join(e.k.PinDir(), "link_connect4"))
	other := kerneltest.NewCgroup(t)
	_, err := Load(Options{Dir: e.opts.Dir, Cgroup: other.Path})
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("second Load: %v, want ErrLocked", err)
	}
	if after := linkID(t, filepath.Join(e.k.PinDir(), "link_connect4")); after != before {
		t.Fatal("the refused Load replaced the pinned link")
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("forced open after the refused Load: %v", got)
	}
	if _, err := Uninstall(e.opts.Dir); !errors.Is(err, ErrLocked) {
		t.Fatalf("Uninstall under a live Kernel: %v, want ErrLocked", err)
	}
}

// A start on a path that is not cgroup v2 fails before touching the pins:
// the links stay where they are, attached and pinned.
func TestWrongCgroupTouchesNothing(t *testing.T) {
	e := newEnv(t, Options{})
	d := e.dest(8213, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 33}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.Close(); err != nil { // the daemon stopped; its pins stay
		t.Fatal(err)
	}
	before := linkID(t, filepath.Join(PinDir(e.opts.Dir), "link_connect4"))
	tmpfs := t.TempDir() // not a cgroup
	for _, cg := range []string{tmpfs, "/sys/fs/cgroup/memory", filepath.Join(tmpfs, "missing")} {
		if _, err := os.Stat(cg); err != nil && cg == "/sys/fs/cgroup/memory" {
			continue // no v1 controller mounted here
		}
		_, err := Load(Options{Dir: e.opts.Dir, Cgroup: cg})
		if err == nil || !strings.Contains(err.Error(), cg) {
			t.Fatalf("Load with --cgroup %s: %v, want an error naming it", cg, err)
		}
		if after := linkID(t, filepath.Join(PinDir(e.opts.Dir), "link_connect4")); after != before {
			t.Fatalf("the Load on %s replaced the pinned link", cg)
		}
	}
	e.k = e.load(t) // adopts, for the cleanup
	e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour})
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 2})); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("forced open after the refused starts: %v", got)
	}
}

// A Load that fails leaves no pin it made; pins it found stay.
func TestFailedFreshLoadLeavesNothing(t *testing.T) {
	kerneltest.RequireKernel(t)
	dir := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(dir) })
	// The cgroup disappears between the checks and the attach.
	gone := filepath.Join(t.TempDir(), "nothing")
	if _, err := Load(Options{Dir: dir, Cgroup: gone}); err == nil {
		t.Fatal("Load on a missing cgroup succeeded")
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("a failed start left %v in %s", entries, dir)
	}
}

// Uninstall needs no configuration and no cgroup: it detaches the programs
// and removes the pins of every layout version breakerd made, and nothing
// else.
func TestUninstallRemovesOnlyBreakerdPins(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8214)
	d := e.dest(8214, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 34}); err != nil {
		t.Fatal(err)
	}
	// Someone else's pins next to ours, named like a layout.
	foreign := filepath.Join(e.opts.Dir, "v99")
	if err := os.Mkdir(foreign, 0o700); err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Pin(filepath.Join(foreign, "theirs")); err != nil {
		t.Fatal(err)
	}
	m.Close()
	if err := e.k.Close(); err != nil {
		t.Fatal(err)
	}
	removed, err := Uninstall(e.opts.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0] != PinDir(e.opts.Dir) {
		t.Fatalf("removed %v", removed)
	}
	if _, err := os.Stat(filepath.Join(foreign, "theirs")); err != nil {
		t.Fatalf("uninstall touched another program's pins: %v", err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 2})); got[0] != 2 {
		t.Fatalf("after uninstall: %v, want traffic to flow", got)
	}
	// The cleanup of newEnv uninstalls e.k again: give it a fresh one.
	e.k = e.load(t)
}

// Ground moving under a running Kernel: removed pins are noticed and pinned
// again; a removed cgroup is noticed; one made again at the same path gets
// the programs.
func TestCheckAndRepair(t *testing.T) {
	e := newEnv(t, Options{})
	if p := e.k.Check(); p != nil {
		t.Fatalf("fresh load: %v", p)
	}
	for _, name := range []string{"verdicts", "socks", "link_connect4"} {
		if err := os.Remove(filepath.Join(e.k.PinDir(), name)); err != nil {
			t.Fatal(err)
		}
	}
	p := e.k.Check()
	if _, ok := p[PinsRemoved]; !ok {
		t.Fatalf("removed pins not noticed: %v", p)
	}
	if err := e.k.Repair(); err != nil {
		t.Fatal(err)
	}
	if p := e.k.Check(); p != nil {
		t.Fatalf("after repair: %v", p)
	}

	// The protected cgroup goes away and comes back at the same path.
	cg := kerneltest.NewCgroup(t)
	e2 := &env{cg: cg, topo: e.topo, srv: e.srv, opts: Options{Dir: filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName()), Cgroup: cg.Path}}
	t.Cleanup(func() { os.RemoveAll(e2.opts.Dir) })
	e2.k = e2.load(t)
	t.Cleanup(func() { e2.k.Uninstall() })
	e2.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour})
	e.srv.ServeHold(t, 8215)
	d := e.dest(8215, false)
	if err := e2.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 35}); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(cg.Path); err != nil {
		t.Fatal(err)
	}
	if _, ok := e2.k.Check()[CgroupRemoved]; !ok {
		t.Fatal("removed cgroup not noticed")
	}
	if err := os.Mkdir(cg.Path, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, ok := e2.k.Check()[CgroupRecreated]; !ok {
		t.Fatal("recreated cgroup not noticed")
	}
	if got := errnos(e.dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[0] != 1 {
		t.Fatalf("the recreated cgroup before repair: %v, want unprotected (else the test proves nothing)", got)
	}
	if err := e2.k.Repair(); err != nil {
		t.Fatal(err)
	}
	if p := e2.k.Check(); p != nil {
		t.Fatalf("after repair: %v", p)
	}
	if got := errnos(e.dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 2})); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("recreated cgroup after repair: %v, want rejected", got)
	}
}

func TestBusySlotsAndAllLimits(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8216)
	d := e.limit(t, 8216, Limit{Slot: MaxCircuitIDs - 1, MaxConnections: 5})
	holder := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 2, Parallel: 2, Hold: time.Minute})
	e.waitCount(t, MaxCircuitIDs-1, BulkCount{Connections: 2})
	busy, err := e.k.BusySlots()
	if err != nil || len(busy) != 1 || busy[MaxCircuitIDs-1].Connections != 2 {
		t.Fatalf("busy slots %v %v", busy, err)
	}
	all, err := e.k.AllLimits()
	if err != nil || len(all) != 1 || all[d].Slot != MaxCircuitIDs-1 || all[d].MaxConnections != 5 {
		t.Fatalf("limits %v %v", all, err)
	}
	holder.Cmd.Process.Kill()
	holder.Cmd.Wait()
	e.waitCount(t, MaxCircuitIDs-1, BulkCount{})
}

// Map pins removed while no daemon ran, the link pins left: the next
// start makes those maps anew, and the pinned tracing link, which runs
// the same instructions on the old maps (a program's tag leaves its maps
// out), must not be adopted: a reset of an established connection still
// reaches the new ring.
func TestResetSeenAfterMapPinsRemoved(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeReset(t, 9130)
	e.srv.ServeHold(t, 9199)
	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(9199, false).Addr})
	dir := e.k.PinDir()
	if err := e.k.Close(); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{bpf.BreakerMapEvents, bpf.BreakerMapConfig} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	e.k = e.load(t)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour}); err != nil {
		t.Fatal(err)
	}
	w := e.watch(t)
	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(9130, false).Addr, Op: "connect-read"})
	expectOutcomes(t, w.wait(9130, 2, 2*time.Second), Established, Reset)
}

// Every map the object pins by name is watched: its pin removed under a
// running Kernel is reported (naming it) and pinned again by Repair, so the
// next start adopts the same map. A map missing from that watch is made
// anew, empty, at the next start while the other pins live: for
// resp_ports, the followed sockets of before would then lose their turns
// (a request sent before the restart, its response missed after it, is a
// no_response at close).
func TestCheckAndRepairEveryMapPin(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	e.srv.ServeHTTPCases(t, 8097)
	e.followResponses(t, 8097, RespTimed)
	for i, r := range e.requests(t, 8097, 5*time.Second, gets("/ok")...) {
		if r.Errno != 0 {
			t.Fatalf("request %d: %v", i, r.Errno)
		}
	}
	if ports, err := e.k.RespPorts(); err != nil || fmt.Sprint(ports) != "[8097]" {
		t.Fatalf("resp_ports %v (%v), want [8097]", ports, err)
	}
	spec, err := bpf.LoadBreaker()
	if err != nil {
		t.Fatal(err)
	}
	var pinned []string
	for name, m := range spec.Maps {
		if m.Pinning == ebpf.PinByName {
			pinned = append(pinned, name)
		}
	}
	if len(pinned) < 2 {
		t.Fatalf("pinned maps in the object: %v", pinned)
	}
	for _, name := range pinned {
		if err := os.Remove(filepath.Join(e.k.PinDir(), name)); err != nil {
			t.Fatal(err)
		}
	}
	msg := e.k.Check()[PinsRemoved]
	for _, name := range pinned {
		if !strings.Contains(msg, name+" ") && !strings.Contains(msg, name+"]") {
			t.Errorf("removed pin %s not reported: %q", name, msg)
		}
	}
	if err := e.k.Repair(); err != nil {
		t.Fatal(err)
	}
	if p := e.k.Check(); p != nil {
		t.Fatalf("after repair: %v", p)
	}
	for _, name := range pinned {
		if _, err := os.Lstat(filepath.Join(e.k.PinDir(), name)); err != nil {
			t.Errorf("after repair: %v", err)
		}
	}
	e.restart(t)
	if ports, err := e.k.RespPorts(); err != nil || fmt.Sprint(ports) != "[8097]" {
		t.Fatalf("resp_ports after repair and restart: %v (%v), want [8097] (the same map adopted)", ports, err)
	}
}

// enforcing asserts that the forced-open destination open is rejected and
// the healthy one ok gets through, from e's cgroup.
func (e *env) enforcing(t *testing.T, step string, open, ok Dest) {
	t.Helper()
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: open.Addr, Count: 2})); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("%s: the open circuit: %v, want every connect rejected", step, got)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: ok.Addr, Count: 2, Hold: 10 * time.Millisecond})); got[0] != 2 {
		t.Fatalf("%s: the healthy destination: %v, want every connect through", step, got)
	}
}

// Pin directories never nest: a second Load or Uninstall on a directory
// inside a running Kernel's (its layout directory, the same spelled through
// a symbolic link, a bpffs mounted inside it) or around it is refused
// before it changes anything; a sibling directory is free.
func TestNestedPinDirsRefused(t *testing.T) {
	kerneltest.RequireKernel(t)
	outer := kerneltest.MountBPFFS(t, t.TempDir())
	e := newEnv(t, Options{Dir: filepath.Join(outer, "a")})
	e.srv.ServeHold(t, 8216)
	open, ok := e.dest(8217, false), e.dest(8216, false)
	if err := e.k.PutVerdict(open, Verdict{State: ForcedOpen, CircuitID: 36}); err != nil {
		t.Fatal(err)
	}
	before := linkID(t, filepath.Join(e.k.PinDir(), "link_connect4"))
	if err := os.Symlink("a", filepath.Join(outer, "alias")); err != nil {
		t.Fatal(err)
	}
	inner := kerneltest.MountBPFFS(t, e.k.PinDir())
	for _, dir := range []string{
		e.k.PinDir(),                         // inside: pins at a/v13/v13
		filepath.Join(outer, "alias", "v13"), // the same, through a link
		filepath.Join(inner, "x"),            // on a bpffs mounted inside
		inner,                                // the mount itself
		outer,                                // around
	} {
		if k, err := Load(Options{Dir: dir, Cgroup: e.cg.Path}); !errors.Is(err, ErrLocked) {
			if err == nil {
				k.Uninstall()
			}
			t.Fatalf("Load on %s beside a Kernel on %s: %v, want ErrLocked", dir, e.opts.Dir, err)
		} else {
			t.Logf("refused: %v", err)
		}
		if _, err := os.Stat(dir); err != nil {
			continue // Uninstall has nothing to do there
		}
		if _, err := Uninstall(dir); !errors.Is(err, ErrLocked) {
			t.Fatalf("Uninstall of %s beside a Kernel on %s: %v, want ErrLocked", dir, e.opts.Dir, err)
		}
	}
	for _, name := range []string{"x", fmt.Sprintf("v%d", LayoutVersion)} {
		if _, err := os.Lstat(filepath.Join(inner, name)); err == nil {
			t.Fatalf("the refused Loads left %s in %s", name, inner)
		}
	}
	if pinned(filepath.Join(e.k.PinDir(), fmt.Sprintf("v%d", LayoutVersion)), "verdicts") {
		t.Fatal("a refused Load pinned maps inside the running Kernel's pin directory")
	}
	if after := linkID(t, filepath.Join(e.k.PinDir(), "link_connect4")); after != before {
		t.Fatal("a refused Load replaced the pinned link")
	}
	e.enforcing(t, "after the refused Loads", open, ok)

	// A sibling is another daemon's own directory.
	other := kerneltest.NewCgroup(t)
	k, err := Load(Options{Dir: filepath.Join(outer, "b"), Cgroup: other.Path})
	if err != nil {
		t.Fatalf("Load beside, on a sibling directory: %v", err)
	}
	if err := k.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unmount(inner, 0); err != nil {
		t.Fatal(err)
	}
	e.restart(t)
	e.enforcing(t, "after a restart", open, ok)
}

// The whole pin directory removed, then the whole --bpffs directory: both
// are pins removed (the bpffs is there), pinned again, and the lock is
// taken again on the directory made anew, so a second Load is still
// refused. A pin replaced by another map is reported, with what the
// operator must do, and left alone until removed.
func TestPinDirRemovedAndPinReplaced(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8218)
	open, ok := e.dest(8219, false), e.dest(8218, false)
	if err := e.k.PutVerdict(open, Verdict{State: ForcedOpen, CircuitID: 37}); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{e.k.PinDir(), e.opts.Dir} {
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		p := e.k.Check()
		if _, ok := p[PinsRemoved]; !ok || len(p) != 1 || !strings.Contains(p[PinsRemoved], "pin directory") {
			t.Fatalf("%s removed: %v, want pins_removed (the pin directory) alone", dir, p)
		}
		if err := e.k.Repair(); err != nil {
			t.Fatalf("repairing with %s removed: %v", dir, err)
		}
		if p := e.k.Check(); p != nil {
			t.Fatalf("after repairing %s: %v", dir, p)
		}
		if _, err := Load(Options{Dir: e.opts.Dir, Cgroup: e.cg.Path}); !errors.Is(err, ErrLocked) {
			t.Fatalf("a second Load once %s was made again: %v, want ErrLocked", dir, err)
		}
		e.enforcing(t, dir+" removed and repaired", open, ok)
	}

	foreign, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer foreign.Close()
	verdicts := filepath.Join(e.k.PinDir(), bpf.BreakerMapVerdicts)
	if err := os.Remove(verdicts); err != nil {
		t.Fatal(err)
	}
	if err := foreign.Pin(verdicts); err != nil {
		t.Fatal(err)
	}
	p := e.k.Check()
	if msg := p[PinsRemoved]; !strings.Contains(msg, "never removes or repairs") || !strings.Contains(msg, "rm "+verdicts) {
		t.Fatalf("a pin replaced by another map: %v, want it named, with the operator's step", p)
	}
	if err := e.k.Repair(); err != nil {
		t.Fatal(err)
	}
	if !samePinnedMap(verdicts, foreign) {
		t.Fatal("Repair removed the other map's pin")
	}
	if err := os.Remove(verdicts); err != nil {
		t.Fatal(err)
	}
	if err := e.k.Repair(); err != nil {
		t.Fatal(err)
	}
	if p := e.k.Check(); p != nil {
		t.Fatalf("once the other map's pin is removed: %v", p)
	}
	e.restart(t)
	e.enforcing(t, "restart on the repaired pins", open, ok)
}

// After an unmount of the bpffs holding the pins, where another bpffs is
// underneath, nothing is pinned on the one underneath (a mount again would
// hide those pins and the links they keep): Check reports the unmount and
// Repair refuses. A bpffs mounted again where it was gets the pins, and a
// restart adopts them.
func TestNoPinsOnTheFilesystemUnderneath(t *testing.T) {
	kerneltest.RequireKernel(t)
	outer := kerneltest.MountBPFFS(t, t.TempDir())
	inner := kerneltest.MountBPFFS(t, outer)
	e := newEnv(t, Options{Dir: filepath.Join(inner, "breakerd")})
	e.srv.ServeHold(t, 8220)
	open, ok := e.dest(8221, false), e.dest(8220, false)
	if err := e.k.PutVerdict(open, Verdict{State: ForcedOpen, CircuitID: 38}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unmount(inner, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		p := e.k.Check()
		if _, ok := p[BPFFSUnmounted]; !ok || len(p) != 1 {
			t.Fatalf("after the unmount: %v, want bpffs_unmounted alone", p)
		}
		if err := e.k.Repair(); err == nil {
			t.Fatal("Repair with the pins' bpffs unmounted: nil error")
		}
		if _, err := os.Lstat(filepath.Join(inner, "breakerd")); err == nil {
			t.Fatal("pins made on the bpffs underneath")
		}
	}
	e.enforcing(t, "unmounted (the daemon's handles hold the links)", open, ok)

	if err := unix.Mount("bpffs", inner, "bpf", 0, ""); err != nil {
		t.Fatal(err)
	}
	if _, ok := e.k.Check()[BPFFSUnmounted]; !ok {
		t.Fatal("a bpffs mounted again without the pins: not reported")
	}
	if err := e.k.Repair(); err != nil {
		t.Fatalf("repairing on the bpffs mounted again: %v", err)
	}
	if p := e.k.Check(); p != nil {
		t.Fatalf("after repairing on the bpffs mounted again: %v", p)
	}
	if _, err := Load(Options{Dir: e.opts.Dir, Cgroup: e.cg.Path}); !errors.Is(err, ErrLocked) {
		t.Fatalf("a second Load on the bpffs mounted again: %v, want ErrLocked", err)
	}
	e.restart(t)
	if e.k.Fresh() {
		t.Fatal("the restart did not adopt the pins on the bpffs mounted again")
	}
	e.enforcing(t, "restart on the bpffs mounted again", open, ok)
}

// A second Kernel on the same cgroup with pins elsewhere (another bpffs
// mount) is refused before it makes anything: the cgroup keeps one set of
// programs. Once the first is closed, the cgroup is free.
func TestSecondKernelOnSameCgroupRefused(t *testing.T) {
	kerneltest.RequireKernel(t)
	other := kerneltest.MountBPFFS(t, t.TempDir())
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8222)
	open, ok := e.dest(8223, false), e.dest(8222, false)
	if err := e.k.PutVerdict(open, Verdict{State: ForcedOpen, CircuitID: 39}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(other, "breakerd")
	if k, err := Load(Options{Dir: dir, Cgroup: e.cg.Path}); !errors.Is(err, ErrCgroupLocked) {
		if err == nil {
			k.Uninstall()
		}
		t.Fatalf("a second Kernel on the same cgroup: %v, want ErrCgroupLocked", err)
	}
	if _, err := os.Lstat(dir); err == nil {
		t.Fatalf("the refused Load left %s", dir)
	}
	e.enforcing(t, "after the refused Load", open, ok)
	if err := e.k.Close(); err != nil {
		t.Fatal(err)
	}
	k, err := Load(Options{Dir: dir, Cgroup: e.cg.Path})
	if err != nil {
		t.Fatalf("a Kernel on the cgroup once the first is closed: %v", err)
	}
	if err := k.Uninstall(); err != nil {
		t.Fatal(err)
	}
	e.restart(t)
	e.enforcing(t, "restart", open, ok)
}

// A bpffs mounted over the pin directory's base hides the pins: reported
// as bpffs_unmounted, and nothing is pinned on the mount over them; once
// it is unmounted, the pins are there again.
func TestPinsHiddenByAMountOver(t *testing.T) {
	kerneltest.RequireKernel(t)
	fs := kerneltest.MountBPFFS(t, t.TempDir())
	e := newEnv(t, Options{Dir: filepath.Join(fs, "breakerd")})
	e.srv.ServeHold(t, 8224)
	open, ok := e.dest(8225, false), e.dest(8224, false)
	if err := e.k.PutVerdict(open, Verdict{State: ForcedOpen, CircuitID: 40}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("bpffs", e.opts.Dir, "bpf", 0, ""); err != nil {
		t.Fatal(err)
	}
	over := true
	t.Cleanup(func() {
		if over {
			_ = unix.Unmount(e.opts.Dir, unix.MNT_DETACH)
		}
	})
	if p := e.k.Check(); len(p) != 1 || !strings.Contains(p[BPFFSUnmounted], "hidden by another mount") {
		t.Fatalf("pins hidden by a mount over them: %v, want bpffs_unmounted alone", p)
	}
	if err := e.k.Repair(); err == nil {
		t.Fatal("Repair with the pins hidden: nil error")
	}
	if _, err := os.Lstat(e.k.PinDir()); err == nil {
		t.Fatal("pins made on the mount over the pins")
	}
	e.enforcing(t, "pins hidden", open, ok)
	if err := unix.Unmount(e.opts.Dir, 0); err != nil {
		t.Fatal(err)
	}
	over = false
	if p := e.k.Check(); p != nil {
		t.Fatalf("once the mount over them is gone: %v", p)
	}
	e.restart(t)
	e.enforcing(t, "restart", open, ok)
}
