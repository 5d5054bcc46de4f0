package main

import (
	"errors"
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

func TestMain(m *testing.M) { kerneltest.Main(m) }

// proc is a breakerd process started by the test.
type proc struct {
	cmd  *exec.Cmd
	logs *kerneltest.LogBuffer
}

type harness struct {
	t      *testing.T
	bin    string
	args   []string
	cg     *kerneltest.Cgroup
	topo   *kerneltest.Topology
	bpffs  string
	socket string
}

func newHarness(t *testing.T, config string) *harness {
	kerneltest.RequireKernel(t)
	return newHarnessOf(t, buildBreakerd(t), config)
}

// buildBreakerd builds the binary for the test.
func buildBreakerd(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "breakerd")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	return bin
}

// newHarnessOf is newHarness with a binary already built (several
// daemons of one test).
func newHarnessOf(t *testing.T, bin, config string) *harness {
	dir := t.TempDir()
	h := &harness{t: t, bin: bin, cg: kerneltest.NewCgroup(t), topo: kerneltest.NewTopology(t, 1),
		bpffs: filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName()), socket: filepath.Join(dir, "admin.sock")}
	t.Cleanup(func() { os.RemoveAll(h.bpffs) })
	cfg := filepath.Join(dir, "b.yaml")
	os.WriteFile(cfg, []byte(strings.ReplaceAll(config, "SRV", h.topo.Servers[0].IPv4.String())), 0o644)
	h.args = []string{"--config", cfg, "--cgroup", h.cg.Path, "--bpffs", h.bpffs, "--admin-addr", "", "--admin-socket", h.socket}
	return h
}

// start runs breakerd and waits until its socket answers.
func (h *harness) start() *proc {
	h.t.Helper()
	return h.startWithin(5 * time.Second)
}

// startWithin is start for a start-up that may take up to ready (a large
// adoption).
func (h *harness) startWithin(ready time.Duration) *proc {
	h.t.Helper()
	os.Remove(h.socket)
	p := &proc{cmd: exec.Command(h.bin, h.args...), logs: &kerneltest.LogBuffer{}}
	p.cmd.Stderr = p.logs
	if err := p.cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			p.cmd.Process.Kill()
			p.cmd.Wait()
		}
	})
	if !kerneltest.WaitFor(ready, func() bool { return strings.Contains(p.logs.String(), "breakerd ready") }) {
		h.t.Fatalf("breakerd not ready:\n%s", p.logs.String())
	}
	return p
}

func (h *harness) dial(n int) map[unix.Errno]int {
	res := h.topo.Client.Dial(h.t, h.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(h.topo.Servers[0].IPv4, 8080), Count: n})
	m := map[unix.Errno]int{}
	for _, r := range res {
		m[r.Errno]++
	}
	return m
}

const config = `
failsafe_timeout: 1s
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8080"]}
    consecutive_failures: 2
    open_duration: 1m
    reject_errno: EHOSTUNREACH
`

func TestSIGKILLFailsOpenAndRestartAdopts(t *testing.T) {
	h := newHarness(t, config)
	srv := h.topo.Servers[0]
	srv.StartCounting(t)
	p := h.start()
	// Nothing listens: two refusals trip the circuit.
	if got := h.dial(2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("no listener: %v", got)
	}
	if !kerneltest.WaitFor(2*time.Second, func() bool { return h.dial(1)[unix.EHOSTUNREACH] == 1 }) {
		t.Fatalf("circuit did not open:\n%s", p.logs.String())
	}
	syns := srv.SYNs(t)

	// SIGKILL: no clean-up runs. The pinned verdict stays, the heartbeat
	// stops, and after the fail-safe timeout (1 s) traffic flows again:
	// the SYNs reach the host, which refuses them for real.
	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
	time.Sleep(1300 * time.Millisecond)
	if got := h.dial(3); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("after SIGKILL and the fail-safe timeout: %v, want the host's own refusals", got)
	}
	if n := srv.SYNs(t) - syns; n != 3 {
		t.Fatalf("%d SYNs reached the host after the daemon died, want 3", n)
	}
	v, err := maps.OpenPinned(h.bpffs)
	if err != nil {
		t.Fatal(err)
	}
	all, _ := v.AllVerdicts()
	v.Close()
	if len(all) != 1 {
		t.Fatalf("pinned verdicts after SIGKILL: %v", all)
	}

	// A new daemon adopts the pinned open circuit and enforces it again.
	p2 := h.start()
	if got := h.dial(3); got[unix.EHOSTUNREACH] != 3 {
		t.Fatalf("after the restart: %v\n%s", got, p2.logs.String())
	}
	if !strings.Contains(p2.logs.String(), "adopted open circuit") {
		t.Fatalf("no adoption:\n%s", p2.logs.String())
	}
}

func TestSIGTERMRestartHasNoGap(t *testing.T) {
	// The fail-safe must outlast the restart, or the kernel rightly lets
	// traffic through while no daemon runs.
	h := newHarness(t, strings.Replace(config, "failsafe_timeout: 1s", "failsafe_timeout: 30s", 1))
	p := h.start()
	if got := h.dial(2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("no listener: %v", got)
	}
	if !kerneltest.WaitFor(2*time.Second, func() bool { return h.dial(1)[unix.EHOSTUNREACH] == 1 }) {
		t.Fatalf("circuit did not open:\n%s", p.logs.String())
	}
	var wg sync.WaitGroup
	var done atomic.Bool
	var res map[unix.Errno]int
	wg.Go(func() {
		r := h.topo.Client.Dial(t, h.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(h.topo.Servers[0].IPv4, 8080), Count: 400000, Parallel: 2})
		res = map[unix.Errno]int{}
		for _, x := range r {
			res[x.Errno]++
		}
		done.Store(true)
	})
	time.Sleep(100 * time.Millisecond)
	p.cmd.Process.Signal(syscall.SIGTERM)
	if err := p.cmd.Wait(); err != nil {
		t.Fatalf("breakerd on SIGTERM: %v\n%s", err, p.logs.String())
	}
	p2 := h.start()
	if done.Load() {
		t.Fatal("the client finished before the restart; the test proves nothing (raise Count)")
	}
	wg.Wait()
	if res[unix.EHOSTUNREACH] != 400000 {
		t.Fatalf("during SIGTERM + start: %v, want every connect rejected", res)
	}
	if !strings.Contains(p2.logs.String(), "adopted open circuit") {
		t.Fatalf("no adoption:\n%s", p2.logs.String())
	}
	if got := h.dial(3); got[unix.EHOSTUNREACH] != 3 {
		t.Fatalf("after the restart: %v", got)
	}
}

// TestFIFOConfigNeverHangs: the real binary, with a FIFO as its
// configuration. At start it exits 1 at once naming the FIFO; running, a
// configuration swapped for a FIFO is refused on SIGHUP (and by the file
// watch), the forced-open target keeps rejecting, and SIGTERM still ends
// the daemon.
func TestFIFOConfigNeverHangs(t *testing.T) {
	h := newHarness(t, `
failsafe_timeout: 2s
targets:
  guard:
    match: {cidrs: [SRV], ports: ["8080"]}
    state: forced_open
`)
	h.topo.Servers[0].ServeHold(t, 8080)
	cfg := h.args[1]
	guard := func(what string) {
		t.Helper()
		if got := h.dial(3); got[unix.ECONNREFUSED] != 3 {
			t.Fatalf("%s: forced-open guard: %v", what, got)
		}
	}
	within := func(what string, fn func()) {
		t.Helper()
		done := make(chan struct{})
		go func() { fn(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s blocked", what)
		}
	}

	fifo := filepath.Join(filepath.Dir(cfg), "fifo.yaml")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	args := append([]string{}, h.args...)
	args[1] = fifo
	var out []byte
	var err error
	within("starting with a FIFO", func() { out, err = exec.Command(h.bin, args...).CombinedOutput() })
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), "not a regular file (it is a FIFO)") {
		t.Fatalf("start with a FIFO: %v\n%s", err, out)
	}

	p := h.start()
	guard("started")
	if err := os.Rename(fifo, cfg); err != nil {
		t.Fatal(err)
	}
	p.cmd.Process.Signal(syscall.SIGHUP)
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		return strings.Contains(p.logs.String(), "configuration reload refused") && strings.Contains(p.logs.String(), "FIFO")
	}) {
		t.Fatalf("no refused reload:\n%s", p.logs.String())
	}
	guard("after the FIFO reload")
	p.cmd.Process.Signal(syscall.SIGTERM)
	within("SIGTERM with a FIFO configuration", func() { err = p.cmd.Wait() })
	if err != nil {
		t.Fatalf("breakerd on SIGTERM: %v\n%s", err, p.logs.String())
	}
}
