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
