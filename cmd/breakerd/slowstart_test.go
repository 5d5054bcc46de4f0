package main

import (
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

const slowStartConfig = `
failsafe_timeout: 10s
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8080"]}
    consecutive_failures: 2
    open_duration: 300ms
    jitter: 0
    slow_start: {duration: 4s, floor: 0.1}
`

// pinnedVerdicts reads the verdicts a daemon left in the pins.
func (h *harness) pinnedVerdicts() map[maps.Dest]maps.Verdict {
	h.t.Helper()
	v, err := maps.OpenPinned(h.bpffs)
	if err != nil {
		h.t.Fatal(err)
	}
	defer v.Close()
	all, err := v.AllVerdicts()
	if err != nil {
		h.t.Fatal(err)
	}
	return all
}

// A slow start in progress survives SIGKILL: the kernel goes on ramping
// under the pinned verdict (its heartbeat is still fresh), and the next
// daemon adopts the ramp as it finds it: same start, length and curve,
// connects still turned away in part with EAGAIN, and its verdict deleted
// once it is over.
func TestSlowStartSurvivesSIGKILL(t *testing.T) {
	h := newHarness(t, slowStartConfig)
	p := h.start()
	if got := h.dial(2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("no listener: %v", got)
	}
	h.topo.Servers[0].Serve(t, 8080, func(c *net.TCPConn) { c.Close() })
	var ramp maps.Verdict
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		h.dial(1) // refused while open, then the probe that closes it
		for _, v := range h.pinnedVerdicts() {
			ramp = v
			return v.State == maps.Ramp
		}
		return false
	}) {
		t.Fatalf("no ramp after recovery:\n%s", p.logs.String())
	}
	ramping := func(step string) {
		t.Helper()
		got := h.dial(20)
		if got[unix.EAGAIN] == 0 || got[0] == 0 || got[0]+got[unix.EAGAIN] != 20 {
			t.Fatalf("%s: 20 connects during the ramp: %v, want some admitted and some EAGAIN", step, got)
		}
	}
	ramping("before SIGKILL")
	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
	ramping("after SIGKILL, no daemon")
	p2 := h.start()
	if all := h.pinnedVerdicts(); len(all) != 1 {
		t.Fatalf("verdicts after the restart: %v\n%s", all, p2.logs.String())
	} else {
		for _, v := range all {
			if v != ramp {
				t.Fatalf("the restart changed the ramp: %+v, was %+v", v, ramp)
			}
		}
	}
	ramping("after the restart")
	if !kerneltest.WaitFor(5*time.Second, func() bool { return len(h.pinnedVerdicts()) == 0 }) {
		t.Fatalf("the adopted ramp outlived its end:\n%s", p2.logs.String())
	}
	if got := h.dial(20); got[0] != 20 {
		t.Fatalf("after the ramp: %v, want all admitted", got)
	}
}
