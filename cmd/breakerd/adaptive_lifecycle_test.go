package main

import (
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

// adaptiveLifecycleConfig: a target whose connects time out at 100 ms
// (drops for its adaptive limit) and never open its circuit.
const adaptiveLifecycleConfig = `
failsafe_timeout: 30s
targets:
  slow:
    match: {cidrs: [SRV], ports: ["8520"]}
    consecutive_failures: 0
    window_duration: 1m
    min_requests: 100000
    connect_timeout: 100ms
    max_connections: {adaptive: vegas, min: 2, initial: 20, max: 40}
`

// An adaptive limit moved by the real daemon (ten connects to a
// destination that drops SYNs: ten drops, ten steps of Vegas) is kept
// across a SIGKILL, and a second breakerd on the same pins, refused,
// changes nothing of it.
func TestAdaptiveLimitAcrossSIGKILL(t *testing.T) {
	h := newHarness(t, adaptiveLifecycleConfig)
	srv := h.topo.Servers[0]
	srv.DropSYNs(t, 8520)
	dst := maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(srv.IPv4, 8520)}
	pinned := func() uint32 {
		v, err := maps.OpenPinned(h.bpffs)
		if err != nil {
			return 0
		}
		defer v.Close()
		all, _ := v.AllLimits()
		return all[dst].MaxConnections
	}
	p := h.start()
	if got := pinned(); got != 20 {
		t.Fatalf("pinned limit %d, want initial 20", got)
	}
	// Each connect is seen retransmitting its SYN after a second, and
	// counted timed out then.
	h.topo.Client.Dial(t, h.cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst.Addr, Count: 10, Parallel: 10, Timeout: 1500 * time.Millisecond})
	if !kerneltest.WaitFor(3*time.Second, func() bool { return pinned() == 10 }) {
		t.Fatalf("pinned limit %d after ten timed-out connects, want 10:\n%s", pinned(), p.logs.String())
	}

	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
	p = h.start()
	if got := pinned(); got != 10 {
		t.Fatalf("after SIGKILL and a restart: pinned limit %d, want the 10 held:\n%s", got, p.logs.String())
	}
	second := exec.Command(h.bin, h.args...)
	if out, err := second.CombinedOutput(); err == nil || !strings.Contains(string(out), "another breakerd") {
		t.Fatalf("a second breakerd on the same pins: %v\n%s", err, out)
	}
	if got := pinned(); got != 10 {
		t.Fatalf("after a refused second start: pinned limit %d, want 10", got)
	}
}
