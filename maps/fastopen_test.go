package maps

import (
	"fmt"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// TCP Fast Open connects are judged and followed like any other. connect4/6
// run in the connect() of a TCP_FASTOPEN_CONNECT socket before the kernel
// defers its SYN to the first write, and in a sendto with MSG_FASTOPEN
// before the SYN it sends: an open circuit rejects both with no SYN sent.
// The handshake the first write starts is followed as any other, in its
// workload's class: sockops' connect callback then runs in the write, after
// the connect4 call whose handoff it looks for. A deferred connect closed
// before any write gives its bulkhead count back (sock_release) and
// reports nothing: it sent nothing. Both kinds of handoff are tested where
// the kernel has both (see TestHandoffLostFallsBackToSocketCgroup).
func TestFastOpen(t *testing.T) {
	if !ProbeFeatures().SockOpsCurrent {
		testFastOpen(t, Options{})
		return
	}
	t.Run("thread", func(t *testing.T) { testFastOpen(t, Options{}) })
	t.Run("cookie", func(t *testing.T) { testFastOpen(t, Options{handoff: true}) })
}

func testFastOpen(t *testing.T, opts Options) {
	e := newEnv(t, opts)
	sel, unsel := e.cg.Child(t, "sel"), e.cg.Child(t, "unsel")
	e.putWorkload(t, sel, 2, 2)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Scoped: true, Limits: true}); err != nil {
		t.Fatal(err)
	}
	w := e.watch(t)
	cgID, err := sel.ID()
	if err != nil {
		t.Fatal(err)
	}
	ops := []string{"fastopen", "sendto-fastopen"}
	// The host answers fast opens without the listener asking
	// (TFO_SERVER_ENABLE | TFO_SERVER_WO_SOCKOPT1, before any listen), so
	// the client gets a cookie at its first fast open and defers the SYN
	// of every later TCP_FASTOPEN_CONNECT connect() to its first write.
	if err := e.srv.Sysctl("net/ipv4/tcp_fastopen", "1027"); err != nil {
		t.Fatal(err)
	}
	// Resolve the neighbours both ways first (unobserved), so no first
	// SYN waits on them and no retransmit record muddies a case; being
	// fast opens, these also get the client a cookie for either address.
	e.srv.ServeHold(t, 8259)
	for _, network := range []string{"tcp4", "tcp6"} {
		if got := errnos(e.dial(t, unsel, kerneltest.DialSpec{Network: network, Addr: e.dest(8259, network == "tcp6").Addr, Op: "fastopen"})); got[0] != 1 {
			t.Fatalf("%s warm-up: errnos %v", network, got)
		}
	}

	// The handoff of a deferred connect is found at its write. The test
	// process connects from sel (class 2) and writes from unsel, on one
	// thread and CPU, with the socket made where the fallback would leave
	// the connection unobserved: where the handoff names the thread, the
	// fallback is the cgroup it writes from (unsel), so the socket is made
	// in sel (a record of a socket without storage carries its own
	// cgroup's class: 2); where it names the socket (6.1), the fallback is
	// the socket's own cgroup, so the socket is made in unsel (its record
	// then carries class 0, the documented case of a socket made before
	// its process moved).
	t.Run("handoff", func(t *testing.T) {
		made, class := sel, uint8(2)
		if !e.k.Features().SockOpsCurrent || opts.handoff {
			made, class = unsel, 0
		}
		const port = 8254
		e.srv.ServeHold(t, port)
		home := selfCgroup(t)
		defer moveSelfTo(t, home)
		for _, v6 := range []bool{false, true} {
			d := e.dest(port, v6)
			family := unix.AF_INET6
			var sa unix.Sockaddr = &unix.SockaddrInet6{Addr: d.Addr.Addr().As16(), Port: int(port)}
			if !v6 {
				family, sa = unix.AF_INET, &unix.SockaddrInet4{Addr: d.Addr.Addr().As4(), Port: int(port)}
			}
			var deferred bool
			moveSelfTo(t, made.Path)
			err := e.topo.Client.Do(func() error {
				unpin, err := pinToCPU0()
				if err != nil {
					return err
				}
				defer unpin()
				fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					return err
				}
				defer unix.Close(fd)
				if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_FASTOPEN_CONNECT, 1); err != nil {
					return err
				}
				moveSelfTo(t, sel.Path)
				before := e.srv.SYNs(t)
				if err := unix.Connect(fd, sa); err != nil {
					return fmt.Errorf("connect: %w", err)
				}
				deferred = e.srv.SYNs(t) == before
				moveSelfTo(t, unsel.Path)
				if _, err := unix.Write(fd, []byte("breakerd")); err != nil {
					return fmt.Errorf("write: %w", err)
				}
				return nil
			})
			moveSelfTo(t, home)
			if err != nil {
				t.Fatalf("v6 %v: %v", v6, err)
			}
			if !deferred {
				t.Fatalf("v6 %v: the fast-open connect() sent its SYN (no cookie?): the deferred case is not tested", v6)
			}
		}
		evs := w.wait(port, 2, 3*time.Second)
		if len(evs) != 2 {
			t.Fatalf("records %v, want 2 established: the write's connect callback did not find its handoff", outcomes(evs))
		}
		for _, ev := range evs {
			if ev.Outcome != Established || ev.Dest.Class != class {
				t.Fatalf("record %+v, want established in class %d", ev, class)
			}
		}
	})

	t.Run("healthy", func(t *testing.T) {
		const port = 8250
		e.srv.ServeHold(t, port)
		n := 0
		for _, v6 := range []bool{false, true} {
			network := "tcp4"
			if v6 {
				network = "tcp6"
			}
			for _, op := range ops {
				d := e.dest(port, v6)
				if got := errnos(e.dial(t, sel, kerneltest.DialSpec{Network: network, Addr: d.Addr, Op: op, Count: 2})); got[0] != 2 {
					t.Fatalf("%s %s from the selected cgroup: errnos %v, want 2 successes", network, op, got)
				}
				if got := errnos(e.dial(t, unsel, kerneltest.DialSpec{Network: network, Addr: d.Addr, Op: op})); got[0] != 1 {
					t.Fatalf("%s %s from the unselected cgroup: errnos %v, want success", network, op, got)
				}
				n += 2
			}
		}
		evs := w.wait(port, n, 3*time.Second)
		if len(evs) != n {
			t.Fatalf("%d records, want %d (the selected cgroup's only): %v", len(evs), n, outcomes(evs))
		}
		for _, ev := range evs {
			if ev.Outcome != Established || ev.Dest.Class != 2 || ev.CgroupID != cgID {
				t.Fatalf("record %+v, want established in class 2 from the selected cgroup", ev)
			}
		}
	})

	t.Run("refused", func(t *testing.T) {
		const port = 8251 // no listener
		for _, op := range ops {
			d := e.dest(port, false)
			if got := errnos(e.dial(t, sel, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: op})); got[unix.ECONNREFUSED] != 1 {
				t.Fatalf("%s: errnos %v, want refused by the server", op, got)
			}
		}
		evs := w.wait(port, 2, 3*time.Second)
		expectOutcomes(t, evs, Refused, Refused)
	})

	t.Run("open circuit", func(t *testing.T) {
		const port = 8252
		e.srv.ServeHold(t, port)
		d := e.dest(port, false)
		d.Class = 2
		if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 61}); err != nil {
			t.Fatal(err)
		}
		before := e.srv.SYNs(t)
		for _, op := range ops {
			if got := errnos(e.dial(t, sel, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: op, Count: 2})); got[0] != 0 {
				t.Fatalf("%s with the circuit open: errnos %v, want every connect rejected", op, got)
			}
		}
		if n := e.srv.SYNs(t) - before; n != 0 {
			t.Fatalf("%d SYNs reached the host of an open circuit", n)
		}
		if c, _ := e.k.Counters(61); c.Rejected != 4 {
			t.Fatalf("rejected counter %d, want 4", c.Rejected)
		}
		if got := errnos(e.dial(t, unsel, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: "fastopen"})); got[0] != 1 {
			t.Fatalf("the unselected cgroup: errnos %v, want success", got)
		}
		if evs := w.wait(port, 1, 300*time.Millisecond); len(evs) != 0 {
			t.Fatalf("records for the open destination: %v, want none", outcomes(evs))
		}
	})

	t.Run("bulkhead", func(t *testing.T) {
		const port = 8253
		e.srv.ServeHold(t, port)
		d := e.dest(port, false)
		d.Class = 2
		if err := e.k.PutLimit(d, Limit{Slot: 62, MaxConnections: 1, MaxConnecting: 1}); err != nil {
			t.Fatal(err)
		}
		slot := func(want BulkCount, what string) {
			t.Helper()
			var c BulkCount
			if !kerneltest.WaitFor(3*time.Second, func() bool { c, _ = e.k.BulkCount(62); return c == want }) {
				t.Fatalf("%s: slot %+v, want %+v", what, c, want)
			}
		}
		// A deferred connect never written holds its connecting count
		// until it is closed, and sends nothing; the limit of one turns
		// either kind of fast open away meanwhile.
		before := e.srv.SYNs(t)
		h := e.topo.Client.StartDial(t, sel, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: "fastopen-nowrite", Hold: time.Minute})
		slot(BulkCount{Connections: 1, Connecting: 1}, "a deferred connect held")
		if n := e.srv.SYNs(t) - before; n != 0 {
			t.Fatalf("the fast-open connect() sent %d SYNs: not deferred (no cookie?), the case is not tested", n)
		}
		for _, op := range ops {
			if got := errnos(e.dial(t, sel, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: op})); got[0] != 0 {
				t.Fatalf("%s past max_connecting 1: errnos %v, want rejected", op, got)
			}
		}
		h.Cmd.Process.Kill()
		h.Cmd.Wait()
		slot(BulkCount{}, "after the deferred connect's process died (a count leaked?)")
		// Written, it becomes a counted connection, released at close.
		h = e.topo.Client.StartDial(t, sel, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: "fastopen", Hold: time.Minute})
		slot(BulkCount{Connections: 1}, "a written fast-open connection held")
		h.Cmd.Process.Kill()
		h.Cmd.Wait()
		slot(BulkCount{}, "after the written connection's process died")
		if evs := w.wait(port, 1, 2*time.Second); len(evs) != 1 || evs[0].Outcome != Established {
			t.Fatalf("records %v, want one established (the deferred connect never written sent nothing)", outcomes(evs))
		}
	})
}
