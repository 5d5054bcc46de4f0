package maps

import (
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// The fallback tests connect from the test cgroup of the client host with
// the harness's helper client (it runs in the vmtest VMs too, where curl
// and python3 are not: e2e's TestFallbackDestination drives those); server
// host 0 is the destination whose circuit is open, server host 1 its
// fallback.

// echoUDP answers every datagram to port of h with one of its own.
func echoUDP(t *testing.T, h *kerneltest.Host, port uint16) {
	t.Helper()
	pc := h.ListenPacket(t, "udp", port)
	go func() {
		buf := make([]byte, 512)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo([]byte("echo"), from)
		}
	}()
}

// openWithFallback opens the circuit of id over dst (epoch 7) and names fb
// its fallback.
func (e *env) openWithFallback(t *testing.T, id uint32, dst Dest, fb netip.AddrPort) {
	t.Helper()
	v := OpenVerdict(Now()+farFuture, 1, 1, 0, id)
	v.Epoch = 7
	if err := e.k.PutFallback(id, Fallback{Addr: fb, Proto: dst.Proto, Epoch: 7}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.PutVerdict(dst, v); err != nil {
		t.Fatal(err)
	}
}

// asked is the address a socket of network asks for to reach a: IPv4-mapped
// on a dual-stack (tcp6, udp6) socket.
func asked(network string, a netip.AddrPort) netip.AddrPort {
	if network[len(network)-1] == '6' && a.Addr().Is4() {
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr().As16()), a.Port())
	}
	return a
}

// peers checks that every result succeeded and saw want as its peer.
func peers(t *testing.T, step string, rs []kerneltest.DialResult, want netip.AddrPort) {
	t.Helper()
	for _, r := range rs {
		if r.Errno != 0 || r.Peer != want {
			t.Fatalf("%s: errno %v, peer %v; want success, and the peer asked for, %v", step, r.Errno, r.Peer, want)
		}
	}
}

func TestFallbackTakesTheOpenCircuitsConnects(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	dead.ServeHold(t, 80)
	fb.ServeHold(t, 8080)
	w := e.watch(t)
	cases := []struct {
		name    string
		network string
		dst, to netip.AddrPort
	}{
		{"ipv4", "tcp4", netip.AddrPortFrom(dead.IPv4, 80), netip.AddrPortFrom(fb.IPv4, 8080)},
		{"ipv6", "tcp6", netip.AddrPortFrom(dead.IPv6, 80), netip.AddrPortFrom(fb.IPv6, 8080)},
		{"dual-stack socket to ipv4", "tcp6", netip.AddrPortFrom(dead.IPv4, 80), netip.AddrPortFrom(fb.IPv4, 8080)},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id := uint32(i + 1)
			d := Dest{Proto: TCP, Addr: c.dst}
			e.openWithFallback(t, id, d, c.to)
			defer e.k.DeleteVerdict(d)
			synsDead, synsFb := dead.SYNs(t), fb.SYNs(t)
			const n = 3
			rs := e.dial(t, e.cg, kerneltest.DialSpec{Network: c.network, Op: "connect-peername", Addr: c.dst, Count: n})
			peers(t, "open", rs, asked(c.network, c.dst))
			if got := fb.SYNs(t) - synsFb; got != n {
				t.Fatalf("%d SYNs at the fallback, want %d", got, n)
			}
			if got := dead.SYNs(t) - synsDead; got != 0 {
				t.Fatalf("%d SYNs reached the destination whose circuit is open", got)
			}
			cnt, err := e.k.Counters(id)
			if err != nil {
				t.Fatal(err)
			}
			if cnt.Redirected != n || cnt.Rejected != 0 {
				t.Fatalf("counters %+v, want %d redirected and none rejected", cnt, n)
			}
			// The outcome is the fallback's: sockops reports the socket's
			// peer, never the dead destination.
			evs := w.wait(8080, n, 2*time.Second)
			if len(evs) != n {
				t.Fatalf("%d records for the fallback, want %d", len(evs), n)
			}
			for _, ev := range evs {
				if ev.Dest.Addr != c.to || ev.Outcome != Established {
					t.Fatalf("record %v %v, want established at the fallback %v", ev.Dest, ev.Outcome, c.to)
				}
			}
			w.mu.Lock()
			for _, ev := range w.events {
				if ev.Dest.Addr.Port() == 80 {
					t.Errorf("a record names the destination whose circuit is open: %+v", ev)
				}
			}
			w.events = nil
			w.mu.Unlock()
		})
	}
	t.Run("closed again, the destination itself", func(t *testing.T) {
		syns := dead.SYNs(t)
		dst := netip.AddrPortFrom(dead.IPv4, 80)
		peers(t, "closed", e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Op: "connect-peername", Addr: dst}), dst)
		if dead.SYNs(t)-syns != 1 {
			t.Fatal("the closed destination got no SYN")
		}
	})
}

func TestFallbacksOwnOpenCircuitRejects(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	fb.ServeHold(t, 8080)
	d := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 80)}
	to := netip.AddrPortFrom(fb.IPv4, 8080)
	e.openWithFallback(t, 1, d, to)
	peers(t, "fallback closed", e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Op: "connect-peername", Addr: d.Addr}), d.Addr)
	// The fallback's own circuit opens: redirects become rejections.
	if err := e.k.PutVerdict(Dest{Proto: TCP, Addr: to}, OpenVerdict(Now()+farFuture, 1, 1, unix.EHOSTUNREACH, 2)); err != nil {
		t.Fatal(err)
	}
	before := fb.SYNs(t)
	want := unix.ECONNREFUSED // the destination's reject_errno, as without a fallback
	if !e.k.Features().SetRetval {
		want = unix.EPERM
	}
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})
	if got := errnos(res); got[want] != 3 {
		t.Fatalf("errnos %v, want 3 × %v", got, want)
	}
	if n := fb.SYNs(t) - before; n != 0 {
		t.Fatalf("%d SYNs at the fallback whose circuit is open", n)
	}
	cnt, err := e.k.Counters(1)
	if err != nil {
		t.Fatal(err)
	}
	if cnt.Redirected != 1 || cnt.Rejected != 3 {
		t.Fatalf("counters %+v, want 1 redirected, 3 rejected", cnt)
	}
	// The fallback half-open: a connect may be its probe, and goes there.
	if err := e.k.PutVerdict(Dest{Proto: TCP, Addr: to}, OpenVerdict(Now(), 2, 1, 0, 2)); err != nil {
		t.Fatal(err)
	}
	peers(t, "fallback half-open", e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Op: "connect-peername", Addr: d.Addr}), d.Addr)
	if c2, _ := e.k.Counters(2); c2.Probes != 1 {
		t.Fatalf("fallback's probes %d, want 1", c2.Probes)
	}
}

func TestFallbackOfAnotherEpochIsNotFollowed(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	fb.ServeHold(t, 8080)
	d := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 80)}
	e.openWithFallback(t, 1, d, netip.AddrPortFrom(fb.IPv4, 8080))
	peers(t, "followed", e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Op: "connect-peername", Addr: d.Addr}), d.Addr)
	want := unix.ECONNREFUSED
	if !e.k.Features().SetRetval {
		want = unix.EPERM
	}
	rejected := func(step string) {
		t.Helper()
		before := fb.SYNs(t)
		cnt, err := e.k.Counters(1)
		if err != nil {
			t.Fatal(err)
		}
		if r := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr}); r[0].Errno != want {
			t.Fatalf("%s: errno %v, want the circuit's rejection %v", step, r[0].Errno, want)
		}
		if fb.SYNs(t) != before {
			t.Fatalf("%s: a SYN reached the fallback", step)
		}
		if after, _ := e.k.Counters(1); after.Rejected != cnt.Rejected+1 || after.Redirected != cnt.Redirected {
			t.Fatalf("%s: counters %+v after %+v, want one more rejected, none redirected", step, after, cnt)
		}
	}
	// Another holder of id 1 (epoch 8) has no fallback: its verdict rejects.
	v := OpenVerdict(Now()+farFuture, 1, 1, 0, 1)
	v.Epoch = 8
	if err := e.k.PutVerdict(d, v); err != nil {
		t.Fatal(err)
	}
	rejected("another epoch")
	// An IPv4 connect is never sent to an IPv6 fallback.
	if err := e.k.PutFallback(1, Fallback{Addr: netip.AddrPortFrom(fb.IPv6, 8080), Proto: TCP, Epoch: 8}); err != nil {
		t.Fatal(err)
	}
	rejected("an IPv6 fallback")
	// Nor a TCP connect to a UDP-only fallback.
	if err := e.k.PutFallback(1, Fallback{Addr: netip.AddrPortFrom(fb.IPv4, 8080), Proto: UDP, Epoch: 8}); err != nil {
		t.Fatal(err)
	}
	rejected("a UDP fallback")
}

// udpFallbackHosts is an environment with UDP on and two server hosts
// echoing datagrams: dead on port 53 (the target) and fb, counted, on
// 5353 (its fallback).
func udpFallbackHosts(t *testing.T) (e *env, dead, fb *kerneltest.Host) {
	t.Helper()
	e = newEnvHosts(t, Options{}, 2)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, UDP: true}); err != nil {
		t.Fatal(err)
	}
	dead, fb = e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	echoUDP(t, dead, 53)
	echoUDP(t, fb, 5353)
	return e, dead, fb
}

func TestFallbackTakesUDP(t *testing.T) {
	e, dead, fb := udpFallbackHosts(t)
	for i, network := range []string{"udp4", "udp6"} {
		a, to := dead.IPv4, fb.IPv4
		if network == "udp6" {
			a, to = dead.IPv6, fb.IPv6
		}
		d := Dest{Proto: UDP, Addr: netip.AddrPortFrom(a, 53)}
		id := uint32(i + 1)
		e.openWithFallback(t, id, d, netip.AddrPortFrom(to, 5353))
		deadBefore, fbBefore := dead.UDPDatagrams(t), fb.UDPDatagrams(t)
		// A connected socket's peer, and an unconnected one's reply.
		peers(t, network+" connected", e.dial(t, e.cg, kerneltest.DialSpec{Network: network, Op: "connect-peername", Addr: d.Addr}), d.Addr)
		peers(t, network+" reply", e.dial(t, e.cg, kerneltest.DialSpec{Network: network, Op: "sendto-recv", Addr: d.Addr}), d.Addr)
		if n := dead.UDPDatagrams(t) - deadBefore; n != 0 {
			t.Fatalf("%s: %d datagrams reached the destination whose circuit is open", network, n)
		}
		if n := fb.UDPDatagrams(t) - fbBefore; n != 1 {
			t.Fatalf("%s: %d datagrams at the fallback, want 1", network, n)
		}
		if cnt, _ := e.k.Counters(id); cnt.Redirected != 2 {
			t.Fatalf("%s: redirected %d, want 2 (a connect and a sendto)", network, cnt.Redirected)
		}
		if err := e.k.DeleteVerdict(d); err != nil {
			t.Fatal(err)
		}
		peers(t, network+" closed", e.dial(t, e.cg, kerneltest.DialSpec{Network: network, Op: "sendto-recv", Addr: d.Addr}), d.Addr)
		if dead.UDPDatagrams(t) != deadBefore+1 {
			t.Fatalf("%s: closed, the datagram did not reach the destination", network)
		}
	}
}

// A slow-start ramp is no open circuit: the connects a recovering target's
// ramp turns away see the overload errno and never go to its fallback; a
// fallback that is ramping itself takes redirects by its own ramp's share
// (here none), and the connect is then rejected as without a fallback.
func TestFallbackBesideSlowStart(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	if !e.k.Features().SetRetval {
		if kerneltest.InCI() {
			t.Fatal("this kernel has no bpf_set_retval; the errno tests need it")
		}
		t.Skip("no bpf_set_retval: rejections are EPERM")
	}
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	fb.ServeHold(t, 8080)
	d := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 80)}
	to := netip.AddrPortFrom(fb.IPv4, 8080)
	none := func(float64) float64 { return 0 }
	// The target ramping from nothing, a fallback of its epoch written.
	if err := e.k.PutFallback(1, Fallback{Addr: to, Proto: TCP, Epoch: 7}); err != nil {
		t.Fatal(err)
	}
	ramp := RampVerdict(Now(), farFuture, none, unix.EAGAIN, 1)
	ramp.Epoch = 7
	if err := e.k.PutVerdict(d, ramp); err != nil {
		t.Fatal(err)
	}
	before := fb.SYNs(t)
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})); got[unix.EAGAIN] != 3 {
		t.Fatalf("ramping target: errnos %v, want 3 × EAGAIN", got)
	}
	if fb.SYNs(t) != before {
		t.Fatal("a connect the ramp turned away went to the fallback")
	}
	// The target open, its fallback ramping from nothing.
	e.openWithFallback(t, 1, d, to)
	if err := e.k.PutVerdict(Dest{Proto: TCP, Addr: to}, RampVerdict(Now(), farFuture, none, unix.EAGAIN, 2)); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("ramping fallback: errnos %v, want 3 × ECONNREFUSED (the target's rejection)", got)
	}
	if fb.SYNs(t) != before {
		t.Fatal("a redirect went past the fallback's ramp")
	}
	// Its ramp over: redirects go through.
	if err := e.k.PutVerdict(Dest{Proto: TCP, Addr: to}, RampVerdict(Now()-time.Second, time.Millisecond, none, unix.EAGAIN, 2)); err != nil {
		t.Fatal(err)
	}
	peers(t, "fallback ramp over", e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Op: "connect-peername", Addr: d.Addr}), d.Addr)
	if cnt, _ := e.k.Counters(1); cnt.Redirected != 1 || cnt.Rejected != 3 {
		t.Fatalf("counters %+v, want 1 redirected, 3 rejected", cnt)
	}
}

// What the application sees is the truth about its socket's peer, also
// where a redirect came before: a UDP socket redirected to the fallback
// that then connects to the fallback's own address (asked for, not
// redirected) sees that address as its peer, not the one it asked for
// first; a socket never redirected sees the fallback's replies as they
// come, while the circuit is open; and a dual-stack UDP socket asking
// for the IPv4 destination sees its reply from the mapped address it
// asked for.
func TestFallbackPeerAfterReconnect(t *testing.T) {
	e, dead, fb := udpFallbackHosts(t)
	d := Dest{Proto: UDP, Addr: netip.AddrPortFrom(dead.IPv4, 53)}
	to := netip.AddrPortFrom(fb.IPv4, 5353)
	e.openWithFallback(t, 1, d, to)
	peers(t, "redirected, then connected to the fallback itself", e.dial(t, e.cg,
		kerneltest.DialSpec{Network: "udp4", Op: "reconnect-peername", Addr: d.Addr, Then: to}), to)
	peers(t, "connected to the fallback, then redirected", e.dial(t, e.cg,
		kerneltest.DialSpec{Network: "udp4", Op: "reconnect-peername", Addr: to, Then: d.Addr}), d.Addr)
	peers(t, "never redirected", e.dial(t, e.cg, kerneltest.DialSpec{Network: "udp4", Op: "sendto-recv", Addr: to}), to)
	for _, op := range []string{"sendto-recv", "connect-peername"} {
		peers(t, "dual-stack "+op, e.dial(t, e.cg, kerneltest.DialSpec{Network: "udp6", Op: op, Addr: d.Addr}), asked("udp6", d.Addr))
	}
	// Datagrams from the two sendto-recv; redirects of three connects and
	// a sendto.
	if n := fb.UDPDatagrams(t); n != 2 {
		t.Fatalf("%d datagrams at the fallback, want 2", n)
	}
	if cnt, _ := e.k.Counters(1); cnt.Redirected != 4 {
		t.Fatalf("redirected %d, want 4", cnt.Redirected)
	}
}

// A redirect the fallback's own bulkhead turns away is no redirect: the
// connect sees the bulkhead's errno, and the target counts it neither as
// redirected (that number says how much traffic the fallback took) nor as
// rejected by its own circuit; the fallback's bulkhead counts it.
func TestFallbackBulkheadFullIsNoRedirect(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.ServeHold(t, 8080)
	d := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 80)}
	to := netip.AddrPortFrom(fb.IPv4, 8080)
	if err := e.k.PutLimit(Dest{Proto: TCP, Addr: to}, Limit{Slot: 5, MaxConnections: 1}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
	e.openWithFallback(t, 1, d, to)
	held := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Hold: time.Minute})
	defer func() { held.Cmd.Process.Kill(); held.Cmd.Wait() }()
	e.waitCount(t, 5, BulkCount{Connections: 1})
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 2})); got[unix.EAGAIN] != 2 {
		t.Fatalf("errnos %v, want 2 × EAGAIN (the fallback's bulkhead is full)", got)
	}
	if cnt, _ := e.k.Counters(1); cnt.Redirected != 1 || cnt.Rejected != 0 {
		t.Fatalf("target's counters %+v, want the 1 connect the fallback took redirected, none rejected", cnt)
	}
	if cnt, _ := e.k.Counters(5); cnt.BulkheadRejected != 2 {
		t.Fatalf("fallback's bulkhead counters %+v, want 2 turned away", cnt)
	}
}

// A connect that takes a half-open circuit's probe token and is then
// turned away by the limits it meets gives the token back: the round's
// probe is the next connect that goes out, for a destination's own probe
// and for a fallback taking a redirected connect as its probe alike.
func TestProbeTurnedAwayByItsLimitsKeepsTheToken(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.ServeHold(t, 8080)
	fb.ServeHold(t, 8081)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		// ask is where the client connects; probed the destination whose
		// half-open circuit (id 2) and full bulkhead (slot 5) it meets.
		ask, probed netip.AddrPort
	}{
		{"its own probe", netip.AddrPortFrom(fb.IPv4, 8081), netip.AddrPortFrom(fb.IPv4, 8081)},
		{"the fallback's probe", netip.AddrPortFrom(dead.IPv4, 80), netip.AddrPortFrom(fb.IPv4, 8080)},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			slot := uint32(5 + i)
			p := Dest{Proto: TCP, Addr: c.probed}
			if err := e.k.PutLimit(p, Limit{Slot: slot, MaxConnections: 1}); err != nil {
				t.Fatal(err)
			}
			held := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: c.probed, Hold: time.Minute})
			e.waitCount(t, slot, BulkCount{Connections: 1})
			if c.ask != c.probed {
				e.openWithFallback(t, 1, Dest{Proto: TCP, Addr: c.ask}, c.probed)
			}
			id := uint32(10 + i)
			if err := e.k.PutVerdict(p, OpenVerdict(Now()-time.Millisecond, 1, 1, 0, id)); err != nil {
				t.Fatal(err)
			}
			if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: c.ask})); got[unix.EAGAIN] != 1 {
				t.Fatalf("over the limit: %v, want EAGAIN", got)
			}
			if b, err := e.k.Budget(id); err != nil || b != (Budget{Round: 1, Tokens: 1}) {
				t.Fatalf("budget after the turned-away probe: %+v %v, want round 1 with its token", b, err)
			}
			held.Cmd.Process.Kill()
			held.Cmd.Wait()
			e.waitCount(t, slot, BulkCount{})
			if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: c.ask, Count: 2})); got[0] != 1 {
				t.Fatalf("with room: %v, want exactly one connect through, the probe", got)
			}
			if cnt, _ := e.k.Counters(id); cnt.Probes != 1 || cnt.Rounds != 1 {
				t.Fatalf("counters %+v, want the 1 probe admitted in 1 round", cnt)
			}
		})
	}
}

// A TCP Fast Open connect is redirected as any other: a
// TCP_FASTOPEN_CONNECT socket's connect() and a sendto with MSG_FASTOPEN
// (whose connect and SYN are one call) reach the fallback, with no SYN
// at the destination whose circuit is open.
func TestFallbackTakesFastOpen(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	fb.ServeHold(t, 8080)
	d := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 80)}
	e.openWithFallback(t, 1, d, netip.AddrPortFrom(fb.IPv4, 8080))
	synsDead, synsFb := dead.SYNs(t), fb.SYNs(t)
	for _, op := range []string{"fastopen", "sendto-fastopen"} {
		if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Op: op, Addr: d.Addr})); got[0] != 1 {
			t.Fatalf("%s: errnos %v, want the fallback's connection", op, got)
		}
	}
	if n := fb.SYNs(t) - synsFb; n != 2 {
		t.Fatalf("%d SYNs at the fallback, want 2", n)
	}
	if n := dead.SYNs(t) - synsDead; n != 0 {
		t.Fatalf("%d SYNs at the destination whose circuit is open", n)
	}
	if cnt, _ := e.k.Counters(1); cnt.Redirected != 2 {
		t.Fatalf("redirected %d, want 2", cnt.Redirected)
	}
}
