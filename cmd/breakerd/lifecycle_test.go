package main

import (
	"context"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

// The lifecycle suite: a client loop runs against a healthy destination and
// an open circuit for the whole test while breakerd is restarted, reloaded,
// killed, started wrongly, doubled, uninstalled and has its pins removed
// (TestLifecycle), and while its cgroup is removed and made again, 70,000
// destinations are reached and 100,000 pinned verdicts are adopted
// (TestLifecycleAtScale).
// After every step the invariants are checked:
//
//   - no connect to the healthy destination was rejected;
//   - no connect to the open circuit got through;
//   - each bulkhead slot counts exactly the sockets the test holds open;
//   - the pinned verdict and limits maps hold exactly what the running
//     configuration says (nothing leaked, nothing missing), and the verdict
//     mask has exactly the bits of the verdicts held.
const lifecycleConfig = `
failsafe_timeout: 30s
all:
  consecutive_failures: 1000
  open_duration: 1h
  max_open_duration: 2h
  reject_errno: EHOSTUNREACH
targets:
  down:
    match: {cidrs: [SRV], ports: ["8500"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
  pool:
    match: {cidrs: [SRV], ports: ["8501"]}
    consecutive_failures: 1000
    max_connections: 3
  web:
    match: {cidrs: [SRV], ports: ["8502"]}
    consecutive_failures: 1000
`

// The same, with the bulkhead moved from pool to web.
var movedConfig = strings.Replace(strings.Replace(lifecycleConfig,
	"    max_connections: 3\n  web:", "  web:", 1),
	`ports: ["8502"]}`+"\n", `ports: ["8502"]}`+"\n    max_connections: 50\n", 1)

type lifecycle struct {
	*harness
	cfg             string
	down, pool, web maps.Dest
	// dyn is a dynamic circuit (of all) the client loop dials once dynOn
	// is set: TestLifecycle opens it by real failures, so it takes its
	// kernel id when it first rejects.
	dyn                 maps.Dest
	dynOn               atomic.Bool
	healthyRejected     atomic.Int64
	openAdmitted        atomic.Int64
	healthyOK, openSeen atomic.Int64
	stop                atomic.Bool
	wg                  sync.WaitGroup
	// open are the destinations whose pinned verdicts must be Open
	// besides down's forced-open one (adopted ones).
	open map[maps.Dest]bool
}

func newLifecycle(t *testing.T) *lifecycle {
	h := newHarness(t, lifecycleConfig)
	srv := h.topo.Servers[0]
	for _, p := range []uint16{8500, 8501, 8502} {
		srv.ServeHold(t, p) // a connect that gets through succeeds
	}
	d := func(port uint16) maps.Dest {
		return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(srv.IPv4, port)}
	}
	l := &lifecycle{harness: h, cfg: h.args[1], down: d(8500), pool: d(8501), web: d(8502), dyn: d(8503)}
	return l
}

func (l *lifecycle) writeConfig(yaml string) {
	l.t.Helper()
	yaml = strings.ReplaceAll(yaml, "SRV", l.topo.Servers[0].IPv4.String())
	if err := os.WriteFile(l.cfg+".tmp", []byte(yaml), 0o644); err != nil {
		l.t.Fatal(err)
	}
	if err := os.Rename(l.cfg+".tmp", l.cfg); err != nil {
		l.t.Fatal(err)
	}
}

// clientLoop connects to the healthy destination (web) and to the open
// circuit (down), one after the other, until the test ends.
func (l *lifecycle) clientLoop() {
	l.wg.Go(func() {
		for !l.stop.Load() {
			for _, r := range l.topo.Client.Dial(l.t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.web.Addr, Count: 20}) {
				if r.Errno != 0 {
					l.healthyRejected.Add(1)
				} else {
					l.healthyOK.Add(1)
				}
			}
			open := []netip.AddrPort{l.down.Addr}
			if l.dynOn.Load() {
				open = append(open, l.dyn.Addr)
			}
			for _, a := range open {
				for _, r := range l.topo.Client.Dial(l.t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: a, Count: 20}) {
					l.openSeen.Add(1)
					if r.Errno != unix.EHOSTUNREACH {
						l.openAdmitted.Add(1)
					}
				}
			}
		}
	})
	l.t.Cleanup(func() { l.stop.Store(true); l.wg.Wait() })
}

// check asserts the invariants after step. limits maps each limited
// destination to the sockets the test holds open to it.
func (l *lifecycle) check(step string, limits map[maps.Dest]int64) {
	l.t.Helper()
	before := l.healthyOK.Load() + l.openSeen.Load()
	// Let the loop run through the state the step left.
	if !kerneltest.WaitFor(10*time.Second, func() bool { return l.healthyOK.Load()+l.openSeen.Load() >= before+40 }) {
		l.t.Fatalf("%s: the client loop made no progress", step)
	}
	if n := l.healthyRejected.Load(); n != 0 {
		l.t.Fatalf("%s: %d connects to the healthy destination were rejected", step, n)
	}
	if n := l.openAdmitted.Load(); n != 0 {
		l.t.Fatalf("%s: %d connects to the open circuit got through", step, n)
	}
	v, err := maps.OpenPinned(l.bpffs)
	if err != nil {
		l.t.Fatalf("%s: %v", step, err)
	}
	defer v.Close()
	verdicts, err := v.AllVerdicts()
	if err != nil || len(verdicts) != 1+len(l.open) || verdicts[l.down].State != maps.ForcedOpen {
		if len(verdicts) > 10 {
			l.t.Fatalf("%s: %d pinned verdicts (%v), want the forced-open one and %d open", step, len(verdicts), err, len(l.open))
		}
		l.t.Fatalf("%s: pinned verdicts %v (%v), want exactly the forced-open one and %d open", step, verdicts, err, len(l.open))
	}
	for d := range l.open {
		if verdicts[d].State != maps.Open {
			l.t.Fatalf("%s: the verdict of %s is %+v, want open", step, d, verdicts[d])
		}
	}
	var dests []maps.Dest
	for d := range verdicts {
		dests = append(dests, d)
	}
	if m, err := v.VerdictMask(); err != nil || m != maps.MaskOf(dests) {
		l.t.Fatalf("%s: the pinned verdict mask is %#x (%v), want exactly the %d verdicts' bits %#x", step, m, err, len(dests), maps.MaskOf(dests))
	}
	all, err := v.AllLimits()
	if err != nil || len(all) != len(limits) {
		if len(all) > 10 || len(limits) > 10 {
			l.t.Fatalf("%s: %d pinned limits (%v), want %d", step, len(all), err, len(limits))
		}
		l.t.Fatalf("%s: pinned limits %v (%v), want one for each of %v", step, all, err, limits)
	}
	for d, held := range limits {
		lim, ok := all[d]
		if !ok {
			l.t.Fatalf("%s: no limit for %s", step, d)
		}
		var got maps.BulkCount
		if !kerneltest.WaitFor(3*time.Second, func() bool { got, _ = v.BulkCount(lim.Slot); return got.Connections == held }) {
			l.t.Fatalf("%s: slot %d of %s counts %+v, the test holds %d sockets", step, lim.Slot, d, got, held)
		}
	}
}

func (l *lifecycle) hold(d maps.Dest, n int) *kerneltest.Process {
	return l.topo.Client.StartDial(l.t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: n, Parallel: n, Hold: time.Minute})
}

func (l *lifecycle) sigterm(p *proc) {
	l.t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	if err := p.cmd.Wait(); err != nil {
		l.t.Fatalf("breakerd on SIGTERM: %v\n%s", err, p.logs.String())
	}
}

// reload sends p a SIGHUP and waits until a reload after it is applied
// (its log line), so the step checked next comes after it.
func (l *lifecycle) reload(p *proc) {
	l.t.Helper()
	reloaded := func() int { return strings.Count(p.logs.String(), "configuration reloaded") }
	before := reloaded()
	p.cmd.Process.Signal(syscall.SIGHUP)
	if !kerneltest.WaitFor(5*time.Second, func() bool { return reloaded() > before }) {
		l.t.Fatalf("no reload after SIGHUP:\n%s", p.logs.String())
	}
}

// run runs breakerd with args (not as a daemon: a command expected to end;
// one still running after 10 s, a daemon that started, is killed).
func (l *lifecycle) run(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(l.t.Context(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, l.bin, args...)
	cmd.WaitDelay = time.Second
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func TestLifecycle(t *testing.T) {
	l := newLifecycle(t)
	p := l.start()
	l.clientLoop()
	holder := l.hold(l.pool, 3)
	l.check("start, 3 connections held", map[maps.Dest]int64{l.pool: 3})

	// A dynamic circuit opened by refused connects (no listener on its
	// port; all's failure rate trips it): it takes its kernel id now, and
	// every step below must keep it open and enforced.
	// Dialled in rounds until one is rejected: refused connects take
	// microseconds, and a loaded machine's daemon may read their records
	// only after a round of them has ended.
	all := map[unix.Errno]int{}
	for round := 0; round < 50 && all[unix.EHOSTUNREACH] == 0; round++ {
		for e, n := range errnos(l.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.dyn.Addr, Count: 40})) {
			all[e] += n
		}
	}
	if len(all) > 2 || all[unix.EHOSTUNREACH] == 0 || all[unix.ECONNREFUSED] == 0 {
		t.Fatalf("connects to a port with no listener: %v, want refused until the circuit opens, rejected after", all)
	}
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		v, err := maps.OpenPinned(l.bpffs)
		if err != nil {
			return false
		}
		defer v.Close()
		vd, ok, err := v.Verdict(l.dyn)
		return err == nil && ok && vd.State == maps.Open && vd.CircuitID != 0
	}) {
		t.Fatalf("the dynamic circuit did not open:\n%s", p.logs.String())
	}
	l.open = map[maps.Dest]bool{l.dyn: true}
	l.dynOn.Store(true)
	l.check("a dynamic circuit opened", map[maps.Dest]int64{l.pool: 3})

	// SIGTERM restart with the connections held.
	l.sigterm(p)
	p = l.start()
	l.check("SIGTERM restart with 3 held", map[maps.Dest]int64{l.pool: 3})
	if got := errnos(l.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.pool.Addr})); got[unix.EAGAIN] != 1 {
		t.Fatalf("pool is full after the restart: %v, want EAGAIN", got)
	}
	holder.Cmd.Process.Kill()
	holder.Cmd.Wait()
	l.check("held connections closed", map[maps.Dest]int64{l.pool: 0})
	holder = l.hold(l.pool, 2)
	l.check("2 held again", map[maps.Dest]int64{l.pool: 2})

	// Restart on a changed configuration: the bulkhead moves to web.
	l.writeConfig(movedConfig)
	l.sigterm(p)
	p = l.start()
	l.check("restart with the limit moved", map[maps.Dest]int64{l.web: 0})
	if got := errnos(l.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.pool.Addr, Count: 4, Parallel: 4, Hold: 200 * time.Millisecond})); got[0] != 4 {
		t.Fatalf("pool without a limit: %v, want every connect through", got)
	}

	// A reload storm between the two configurations, ending on the first.
	for i := range 20 {
		cfg := movedConfig
		if i%2 == 1 {
			cfg = lifecycleConfig
		}
		l.writeConfig(cfg)
		p.cmd.Process.Signal(syscall.SIGHUP)
		time.Sleep(50 * time.Millisecond)
	}
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		v, err := maps.OpenPinned(l.bpffs)
		if err != nil {
			return false
		}
		defer v.Close()
		all, _ := v.AllLimits()
		_, ok := all[l.pool]
		return ok && len(all) == 1
	}) {
		t.Fatalf("after the reload storm the limits do not follow the last configuration:\n%s", p.logs.String())
	}
	l.check("reload storm", map[maps.Dest]int64{l.pool: 2})

	// SIGKILL and restart: nothing runs clean-up; the fail-safe (30 s)
	// outlasts the restart.
	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
	p = l.start()
	l.check("SIGKILL and restart", map[maps.Dest]int64{l.pool: 2})

	// A wrong second start (not a cgroup v2 path), a second daemon on
	// the same pins, on directories inside them and on the same cgroup
	// with pins on another bpffs: all refused, nothing changes.
	otherFS := filepath.Join(t.TempDir(), "bpffs")
	if err := os.Mkdir(otherFS, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("bpffs", otherFS, "bpf", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(otherFS, unix.MNT_DETACH) })
	for _, args := range [][]string{
		{"--config", l.cfg, "--cgroup", l.cg.Path, "--bpffs", filepath.Join(otherFS, "breakerd"), "--admin-addr", "", "--admin-socket", ""},
		{"--config", l.cfg, "--cgroup", t.TempDir(), "--bpffs", l.bpffs, "--admin-addr", "", "--admin-socket", ""},
		{"--config", l.cfg, "--cgroup", l.cg.Path, "--bpffs", l.bpffs, "--admin-addr", "", "--admin-socket", ""},
		{"--config", l.cfg, "--cgroup", l.cg.Path, "--bpffs", maps.PinDir(l.bpffs), "--admin-addr", "", "--admin-socket", ""},
		{"--config", l.cfg, "--cgroup", l.cg.Path, "--bpffs", filepath.Join(maps.PinDir(l.bpffs), "x"), "--admin-addr", "", "--admin-socket", ""},
	} {
		if out, err := l.run(args...); err == nil {
			t.Fatalf("a second breakerd %v started:\n%s", args, out)
		} else if !strings.Contains(out, "not a cgroup v2") && !strings.Contains(out, "another breakerd") {
			t.Fatalf("second start: %s", out)
		}
	}
	for _, name := range []string{filepath.Base(maps.PinDir(l.bpffs)), "x"} {
		if _, err := os.Lstat(filepath.Join(maps.PinDir(l.bpffs), name)); err == nil {
			t.Fatalf("a refused start left %s in the running daemon's pin directory", name)
		}
	}
	l.check("wrong second start, second daemons", map[maps.Dest]int64{l.pool: 2})

	// Uninstall while the daemon runs, of its pins or of a directory
	// inside them: refused.
	for _, dir := range []string{l.bpffs, maps.PinDir(l.bpffs)} {
		if out, err := l.run("uninstall", "--bpffs", dir); err == nil || !strings.Contains(out, "another breakerd") {
			t.Fatalf("uninstall of %s under a running daemon: %v\n%s", dir, err, out)
		}
	}
	l.check("uninstall refused", map[maps.Dest]int64{l.pool: 2})

	// Pins removed under the running daemon: noticed and pinned again.
	for _, name := range []string{"verdicts", "link_connect4"} {
		if err := os.Remove(filepath.Join(maps.PinDir(l.bpffs), name)); err != nil {
			t.Fatal(err)
		}
	}
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		_, err1 := os.Stat(filepath.Join(maps.PinDir(l.bpffs), "verdicts"))
		_, err2 := os.Stat(filepath.Join(maps.PinDir(l.bpffs), "link_connect4"))
		return err1 == nil && err2 == nil
	}) {
		t.Fatalf("removed pins not put back:\n%s", p.logs.String())
	}
	// The line comes through the daemon's stderr pipe, after the pins.
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		return strings.Contains(p.logs.String(), "level=ERROR") && strings.Contains(p.logs.String(), "pins_removed")
	}) {
		t.Fatalf("no error log for the removed pins:\n%s", p.logs.String())
	}
	l.check("pins removed and put back", map[maps.Dest]int64{l.pool: 2})

	// SIGTERM, then uninstall without a configuration.
	l.sigterm(p)
	l.check("stopped", map[maps.Dest]int64{l.pool: 2})
	l.stop.Store(true)
	l.wg.Wait()
	if out, err := l.run("uninstall", "--bpffs", l.bpffs); err != nil {
		t.Fatalf("uninstall: %v\n%s", err, out)
	}
	if entries, _ := os.ReadDir(l.bpffs); len(entries) != 0 {
		t.Fatalf("uninstall left %v", entries)
	}
	if got := errnos(l.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.down.Addr, Count: 2})); got[0] != 2 {
		t.Fatalf("after uninstall: %v, want nothing enforced", got)
	}
	// Again, with a configuration given (it is not read): nothing to do.
	if out, err := l.run("uninstall", "--bpffs", l.bpffs, "--config", "/nonexistent.yaml"); err != nil {
		t.Fatalf("uninstall with a config flag: %v\n%s", err, out)
	}
	holder.Cmd.Process.Kill()
	holder.Cmd.Wait()
}

func errnos(rs []kerneltest.DialResult) map[unix.Errno]int {
	m := map[unix.Errno]int{}
	for _, r := range rs {
		m[r.Errno]++
	}
	return m
}
