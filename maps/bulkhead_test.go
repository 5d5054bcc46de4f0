package maps

import (
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

func (e *env) limit(t *testing.T, port uint16, l Limit) Dest {
	t.Helper()
	d := e.dest(port, false)
	if err := e.k.PutLimit(d, l); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
	return d
}

func (e *env) waitCount(t *testing.T, slot uint32, want BulkCount) {
	t.Helper()
	var got BulkCount
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		got, _ = e.k.BulkCount(slot)
		return got == want
	}) {
		t.Fatalf("bulkhead slot %d: %+v, want %+v", slot, got, want)
	}
}

func TestBulkheadMaxConnections(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8200)
	d := e.limit(t, 8200, Limit{Slot: 20, MaxConnections: 10})

	// 50 threads race to hold a connection: exactly 10 get one, the rest
	// are turned away at once with EAGAIN.
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 50, Parallel: 50, Barrier: true, Hold: 500 * time.Millisecond})
	got := errnos(res)
	if got[0] != 10 || got[unix.EAGAIN] != 40 {
		t.Fatalf("errnos %v, want 10 through and 40 EAGAIN", got)
	}
	e.waitCount(t, 20, BulkCount{})
	cnt, _ := e.k.Counters(20)
	if cnt.BulkheadRejected != 40 || cnt.Rejected != 0 {
		t.Fatalf("counters %+v", cnt)
	}

	// Nine long holders and one short one fill the bulkhead; when the
	// short one closes, exactly one more gets in.
	long := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 9, Parallel: 9, Hold: time.Minute})
	e.waitCount(t, 20, BulkCount{Connections: 9})
	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Hold: 200 * time.Millisecond})
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3, Parallel: 3, Barrier: true, Hold: 300 * time.Millisecond})); got[0] != 1 || got[unix.EAGAIN] != 2 {
		t.Fatalf("after one closed: %v, want exactly one more in", got)
	}

	// SIGKILL of the holder returns the count to zero.
	e.waitCount(t, 20, BulkCount{Connections: 9})
	long.Cmd.Process.Signal(syscall.SIGKILL)
	long.Cmd.Wait()
	e.waitCount(t, 20, BulkCount{})
}

func TestBulkheadFailedConnectsRelease(t *testing.T) {
	e := newEnv(t, Options{})
	if err := e.topo.Client.Sysctl("net/ipv4/tcp_syn_retries", "1"); err != nil {
		t.Fatal(err)
	}
	e.srv.DropSYNs(t, 8202)
	refused := e.limit(t, 8201, Limit{Slot: 21, MaxConnections: 2})
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: refused.Addr, Count: 20})
	if got := errnos(res); got[unix.ECONNREFUSED] != 20 {
		t.Fatalf("refused connects: %v, want each to release its slot", got)
	}
	e.waitCount(t, 21, BulkCount{})

	timedOut := e.limit(t, 8202, Limit{Slot: 22, MaxConnections: 1, MaxConnecting: 1})
	res = e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: timedOut.Addr, Timeout: 5 * time.Second})
	if res[0].Errno != unix.ETIMEDOUT {
		t.Fatalf("black hole: %v", res[0].Errno)
	}
	e.waitCount(t, 22, BulkCount{})
	// An abandoned connect releases too.
	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: timedOut.Addr, Op: "abandon", Hold: 100 * time.Millisecond})
	e.waitCount(t, 22, BulkCount{})
}

func TestBulkheadMaxConnecting(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.DropSYNs(t, 8203)
	d := e.limit(t, 8203, Limit{Slot: 23, MaxConnecting: 3, Errno: unix.EBUSY})
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: "abandon", Count: 10, Parallel: 10, Barrier: true, Hold: 500 * time.Millisecond})
	if got := errnos(res); got[0] != 3 || got[unix.EBUSY] != 7 {
		t.Fatalf("errnos %v, want 3 connecting and 7 EBUSY", got)
	}
	e.waitCount(t, 23, BulkCount{})
}

func TestBulkheadScope(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8204)
	e.srv.ServeHold(t, 8205)
	// Two destinations share one slot (a service-scoped target).
	a := e.limit(t, 8204, Limit{Slot: 24, MaxConnections: 2})
	b := e.limit(t, 8205, Limit{Slot: 24, MaxConnections: 2})
	holder := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: a.Addr, Count: 2, Parallel: 2, Hold: time.Minute})
	e.waitCount(t, 24, BulkCount{Connections: 2})
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: b.Addr})); got[unix.EAGAIN] != 1 {
		t.Fatalf("the shared slot is full: %v", got)
	}
	// Outside the cgroup: neither counted nor limited.
	if got := errnos(e.dial(t, nil, kerneltest.DialSpec{Network: "tcp4", Addr: b.Addr, Count: 3, Parallel: 3, Hold: 200 * time.Millisecond})); got[0] != 3 {
		t.Fatalf("outside the cgroup: %v", got)
	}
	if c, _ := e.k.BulkCount(24); c.Connections != 2 {
		t.Fatalf("outside connections counted: %+v", c)
	}
	// A dead daemon (stale heartbeat) enforces no limit.
	if err := e.k.SetSettings(Settings{Heartbeat: Now() - 2*time.Second, FailSafe: time.Second, Limits: true}); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: b.Addr})); got[0] != 1 {
		t.Fatalf("stale heartbeat: %v", got)
	}
	holder.Cmd.Process.Kill()
	holder.Cmd.Wait()
	e.waitCount(t, 24, BulkCount{})
}

// sock_release, which every connection of the cgroup would pay for, is
// attached only once a bulkhead limit is written, and from then on kept
// under these pins; with it, a connect that fails before sending any SYN
// (no route: sockops never sees the socket) still gives its slot back.
func TestReleaseHookOnlyWithLimits(t *testing.T) {
	e := newEnv(t, Options{})
	pin := filepath.Join(e.k.PinDir(), "link_sock_release")
	if _, err := os.Lstat(pin); err == nil {
		t.Fatal("sock_release attached with no bulkhead limit")
	}
	e.restart(t)
	if _, err := os.Lstat(pin); err == nil {
		t.Fatal("sock_release attached by a second start with no bulkhead limit")
	}

	// No route to this address in the client's namespace: connect fails
	// in the kernel before a packet could leave.
	d := Dest{Proto: TCP, Addr: netip.MustParseAddrPort("203.0.113.9:8203")}
	if err := e.k.PutLimit(d, Limit{Slot: 23, MaxConnections: 1}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
	id := linkID(t, pin)
	for i := range 3 {
		res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})
		if res[0].Errno != unix.ENETUNREACH {
			t.Fatalf("connect %d to %s: %v, want ENETUNREACH (its slot given back)", i, d.Addr, res[0].Errno)
		}
	}
	e.waitCount(t, 23, BulkCount{})

	// Kept: a second start adopts it, also once the limits are gone.
	if err := e.k.DeleteLimit(d); err != nil {
		t.Fatal(err)
	}
	e.restart(t)
	if got := linkID(t, pin); got != id {
		t.Fatalf("sock_release's link %d after a restart, want %d adopted", got, id)
	}
	if p := e.k.Check(); p != nil {
		t.Fatalf("ground check after the restart: %v", p)
	}
}
