package maps

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// flatRamp is a ramp verdict of circuit id and epoch that began a second
// ago, lasts an hour and admits share (in 1/RampUnit) of new connects all
// along: the kernel's admission at a known share, on any kernel and at
// any speed.
func flatRamp(share uint8, id, epoch uint32) Verdict {
	v := Verdict{State: Ramp, Due: Now() - time.Second, RampLen: time.Hour, Errno: unix.EAGAIN, CircuitID: id, Epoch: epoch}
	for i := range v.Curve {
		v.Curve[i] = share
	}
	return v
}

// A ramp admits its share of new TCP connects exactly (error diffusion:
// 100 connects at a quarter admit 25, give or take the one the running
// sum began part way to), turns the rest away with its errno, counted as
// slow-start rejections only, in the circuit's counters and against the
// client's cgroup in the rejections map (under the verdict's id and
// epoch; a verdict without an epoch records no cgroup); a finished ramp
// admits every connect and counts nothing; UDP sends are never held
// back; a stale heartbeat lets everything through; and in shadow mode the
// ramp's would-be rejections are counted (the cgroup's as slow-start
// shadow rejections) and admitted.
func TestRampAdmitsItsShare(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8090)
	d := e.dest(8090, false)
	cg := RejectionKey{CgroupID: idOf(t, e.cg), CircuitID: 9, Epoch: 61}
	if err := e.k.PutVerdict(d, flatRamp(uint8(RampUnit/4), 9, 61)); err != nil {
		t.Fatal(err)
	}
	// Sequential connects, each closed at once: the admitted share does
	// not depend on timing.
	got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 100}))
	if got[0] < 24 || got[0] > 26 || got[0]+got[unix.EAGAIN] != 100 {
		t.Fatalf("100 connects at a quarter: %v, want 25 ± 1 admitted and the rest EAGAIN", got)
	}
	cnt, _ := e.k.Counters(9)
	if cnt.SlowStartRejected != uint64(got[unix.EAGAIN]) || cnt.Rejected != 0 || cnt.BulkheadRejected != 0 || cnt.ShadowRejected != 0 {
		t.Fatalf("counters %+v, want %d slow-start rejections and nothing else", cnt, got[unix.EAGAIN])
	}
	rejections := rejectionsOf(t, e.k)
	if r := rejections[cg]; len(rejections) != 1 || r != (Rejection{RejectionKey: cg, SlowStartRejected: uint64(got[unix.EAGAIN])}) {
		t.Fatalf("rejections %+v, want the client's cgroup under %+v with %d slow-start rejections and nothing else", rejections, cg, got[unix.EAGAIN])
	}

	// IPv6 to the same host under its own verdict: the same program path.
	// Without an epoch, no cgroup is recorded.
	d6 := e.dest(8090, true)
	if err := e.k.PutVerdict(d6, flatRamp(uint8(RampUnit/2), 10, 0)); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp6", Addr: d6.Addr, Count: 40})); got[0] < 19 || got[0] > 21 || got[0]+got[unix.EAGAIN] != 40 {
		t.Fatalf("40 IPv6 connects at a half: %v", got)
	}
	if after := rejectionsOf(t, e.k); len(after) != 1 || after[cg] != rejections[cg] {
		t.Fatalf("rejections %+v after a ramp without an epoch, want only %+v", after, rejections[cg])
	}

	// Over: every connect admitted, nothing counted.
	over := flatRamp(uint8(RampUnit/4), 9, 61)
	over.Due, over.RampLen = Now()-2*time.Second, time.Second
	if err := e.k.PutVerdict(d, over); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 20})); got[0] != 20 {
		t.Fatalf("a finished ramp: %v, want all 20 admitted", got)
	}
	if after, _ := e.k.Counters(9); after != cnt {
		t.Fatalf("a finished ramp counted: %+v, was %+v", after, cnt)
	}
	if r := rejectionsOf(t, e.k)[cg]; r != rejections[cg] {
		t.Fatalf("a finished ramp counted the cgroup: %+v, was %+v", r, rejections[cg])
	}

	// UDP: a ramp on a UDP destination holds no datagram back.
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, UDP: true}); err != nil {
		t.Fatal(err)
	}
	u := Dest{Proto: UDP, Addr: d.Addr}
	if err := e.k.PutVerdict(u, flatRamp(0, 11, 62)); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "udp4", Op: "sendto", Addr: u.Addr, Count: 10})); got[0] != 10 {
		t.Fatalf("datagrams under a ramp admitting nothing: %v, want all sent", got)
	}

	// A stale heartbeat: the ramp is ignored (fail open).
	if err := e.k.PutVerdict(d, flatRamp(0, 9, 61)); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now() - time.Minute, FailSafe: time.Second}); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 5})); got[0] != 5 {
		t.Fatalf("a ramp admitting nothing under a stale heartbeat: %v, want all admitted", got)
	}

	// Shadow mode: counted as shadow rejections, admitted.
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Shadow: true}); err != nil {
		t.Fatal(err)
	}
	before, _ := e.k.Counters(9)
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 5})); got[0] != 5 {
		t.Fatalf("shadow mode under a ramp admitting nothing: %v, want all admitted", got)
	}
	if c, _ := e.k.Counters(9); c.ShadowRejected != before.ShadowRejected+5 || c.SlowStartRejected != before.SlowStartRejected {
		t.Fatalf("shadow mode counters %+v, were %+v: want 5 more shadow rejections", c, before)
	}
	want := rejections[cg]
	want.SlowStartShadowRejected = 5
	if r := rejectionsOf(t, e.k)[cg]; r != want {
		t.Fatalf("shadow mode: the cgroup's entry %+v, want %+v (5 slow-start shadow rejections)", r, want)
	}
}

// A ramp begins at its floor, in the kernel as in RampShare:
// a verdict whose curve rises from 0 to all admits none of 20 connects at
// its start and all of them past its end.
func TestRampBeginsAtItsFloor(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8091)
	d := e.dest(8091, false)
	v := RampVerdict(Now(), time.Hour, func(x float64) float64 { return x }, unix.EAGAIN, 12)
	if s := v.RampShare(v.Due); s != 0 {
		t.Fatalf("RampShare at the start = %v, want 0", s)
	}
	if err := e.k.PutVerdict(d, v); err != nil {
		t.Fatal(err)
	}
	// Within the first 1/8 of an hour the share stays under 1/8 · 1/256
	// of the way per second: none of 20 connects is admitted.
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 20})); got[unix.EAGAIN] != 20 {
		t.Fatalf("at a ramp's start from 0: %v, want all 20 turned away", got)
	}
	if s := v.RampShare(v.RampEnd()); s != 1 {
		t.Fatalf("RampShare at the end = %v, want 1", s)
	}
}
