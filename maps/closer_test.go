package maps

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// closers returns the mechanisms this kernel offers, each as a Closer of
// its own: the iterator (6.5+) and the sock_diag fallback. On a kernel
// without bpf_sock_destroy, NewCloser must not pick the iterator.
func closers(t *testing.T, k *Kernel) map[CloseMechanism]*Closer {
	t.Helper()
	best := k.NewCloser()
	t.Cleanup(func() { best.Release() })
	t.Logf("close mechanism %s (%s)", best.Mechanism(), best.Reason())
	out := map[CloseMechanism]*Closer{}
	switch best.Mechanism() {
	case CloseIterator:
		out[CloseIterator] = best
		if sd := k.NewCloser(CloseSockDiag); sd.Mechanism() == CloseSockDiag {
			out[CloseSockDiag] = sd
		} else {
			t.Logf("no sock_diag fallback here: %s", sd.Reason())
		}
	case CloseSockDiag:
		if !strings.Contains(best.Reason(), "bpf_sock_destroy") {
			t.Fatalf("reason %q does not say why the iterator is not used", best.Reason())
		}
		out[CloseSockDiag] = best
	default:
		// Neither: Close must close nothing (and say so).
		if !strings.Contains(best.Reason(), "sock_diag") {
			t.Fatalf("reason %q does not say why sock_diag is not used", best.Reason())
		}
	}
	if hasSockDestroy() && best.Mechanism() != CloseIterator {
		t.Fatalf("this kernel has bpf_sock_destroy, but the mechanism is %s: %s", best.Mechanism(), best.Reason())
	}
	if kerneltest.InCI() && len(out) == 0 {
		t.Fatalf("no close mechanism on this kernel: %s", best.Reason())
	}
	return out
}

// eachCloser runs f as a subtest for each mechanism this kernel offers,
// with a port offset of its own.
func eachCloser(t *testing.T, e *env, f func(t *testing.T, mech CloseMechanism, c *Closer, offset uint16)) {
	t.Helper()
	mechs := closers(t, e.k)
	for i, mech := range []CloseMechanism{CloseIterator, CloseSockDiag} {
		if c := mechs[mech]; c != nil {
			t.Run(string(mech), func(t *testing.T) { f(t, mech, c, uint16(10*i)) })
		}
	}
}

// hasSockDestroy reports whether the kernel's BTF names bpf_sock_destroy.
func hasSockDestroy() bool {
	b, err := os.ReadFile("/proc/kallsyms")
	return err == nil && strings.Contains(string(b), " bpf_sock_destroy\n")
}

// The close pass closes exactly the protected cgroup's established client
// connections to the given destinations, in the client's own network
// namespace: not those to another port, not a sibling cgroup's (outside
// the attach point), not a server-side socket whose peer is the
// destination; and a new connect after it works (no verdict here).
func TestCloseEstablishedFilters(t *testing.T) {
	e := newEnv(t, Options{})
	eachCloser(t, e, func(t *testing.T, mech CloseMechanism, c *Closer, offset uint16) {
		const a, b, srvSide = 8301, 8302, 8303
		base := offset
		pa, pb, ps := a+base, b+base, srvSide+base
		e.srv.ServeHold(t, pa)
		e.srv.ServeHold(t, pb)
		protected := e.cg.Child(t, "pool-"+string(mech[:4]))
		outside := kerneltest.NewCgroup(t) // a sibling of the attach point
		da, db := e.dest(pa, false), e.dest(pb, false)
		da6 := e.dest(pa, true)
		pool := e.topo.Client.StartPool(t, protected, []kerneltest.PoolTarget{
			{Addr: da.Addr, N: 3}, {Addr: da6.Addr, N: 2}, {Addr: db.Addr, N: 2}}, ps)
		other := e.topo.Client.StartPool(t, outside, []kerneltest.PoolTarget{{Addr: da.Addr, N: 2}}, 0)

		// A server-side socket of the protected process whose peer
		// is the destination (ps on the server, connecting from
		// port ps to the pool's listener on ps).
		var peer net.Conn
		err := e.srv.Do(func() error {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: e.srv.IPv4.AsSlice(), Port: int(ps)}, Timeout: 3 * time.Second}
			var err error
			peer, err = d.Dial("tcp4", netip.AddrPortFrom(e.topo.Client.IPv4, ps).String())
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		defer peer.Close()
		pool.Accept(t)
		dsrv := e.dest(ps, false)

		if got := pool.Check(t); slices.ContainsFunc(got, func(s string) bool { return s != "open" }) {
			t.Fatalf("before the pass: %v", got)
		}
		counts, st, err := c.Close([]Dest{da, da6, dsrv}, CloseUnclassed)
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
		t.Logf("pass: %+v, counts %v", st, counts)
		if got := counts[da]; got.Closed != 3 || got.Failed != 0 {
			t.Errorf("closed to %s: %+v, want 3", da, got)
		}
		if got := counts[da6]; got.Closed != 2 || got.Failed != 0 {
			t.Errorf("closed to %s: %+v, want 2", da6, got)
		}
		if got := counts[dsrv]; got != (CloseCount{}) {
			t.Errorf("server-side socket counted: %+v", got)
		}
		want := []string{"ECONNABORTED", "ECONNABORTED", "ECONNABORTED", "ECONNABORTED", "ECONNABORTED", "open", "open", "open"}
		if got := pool.Check(t); !slices.Equal(got, want) {
			t.Errorf("pool after the pass: %v, want %v (the pool's 5 to %d closed; 2 to %d and the accepted one open)", got, want, pa, pb)
		}
		if got := other.Check(t); !slices.Equal(got, []string{"open", "open"}) {
			t.Errorf("the sibling cgroup's connections: %v, want open", got)
		}
		// A second pass finds nothing left to close.
		counts, _, err = c.Close([]Dest{da, da6}, CloseUnclassed)
		if err != nil || len(counts) != 0 {
			t.Errorf("second pass: %v %v, want nothing closed", counts, err)
		}
		// Nothing is blocked: the pool's destination takes new
		// connections.
		if got := errnos(e.dial(t, protected, kerneltest.DialSpec{Network: "tcp4", Addr: da.Addr, Count: 2})); got[0] != 2 {
			t.Errorf("connects after the pass: %v", got)
		}
	})
}

// A server-side socket is one that was accepted, whether or not its
// listener is still open: a draining server that closed its listener keeps
// the connection it accepted from a circuit's destination (its peer is
// exactly the destination), while the pool's own connection to another
// destination of the pass is closed. Each mechanism judges by how the
// socket was made (sock_diag with list_accepted's list).
func TestCloseEstablishedLeavesAcceptedAfterListenerCloses(t *testing.T) {
	e := newEnv(t, Options{})
	eachCloser(t, e, func(t *testing.T, mech CloseMechanism, c *Closer, offset uint16) {
		if mech == CloseSockDiag && c.lister == nil {
			t.Fatal("sock_diag without list_accepted")
		}
		a, srvSide := 8321+offset, 8322+offset
		e.srv.ServeHold(t, a)
		da, dsrv := e.dest(a, false), e.dest(srvSide, false)
		pool := e.topo.Client.StartPool(t, e.cg, []kerneltest.PoolTarget{{Addr: da.Addr, N: 1}}, srvSide)
		// The server connects from dsrv's address and port to the
		// pool's listener: the accepted socket's peer is dsrv.
		var peer net.Conn
		err := e.srv.Do(func() error {
			dl := net.Dialer{LocalAddr: &net.TCPAddr{IP: e.srv.IPv4.AsSlice(), Port: int(srvSide)}, Timeout: 3 * time.Second}
			var err error
			peer, err = dl.Dial("tcp4", netip.AddrPortFrom(e.topo.Client.IPv4, srvSide).String())
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		defer peer.Close()
		pool.Accept(t)
		pool.CloseListener(t)
		if got := pool.Check(t); !slices.Equal(got, []string{"open", "open"}) {
			t.Fatalf("before the pass: %v", got)
		}
		counts, st, err := c.Close([]Dest{da, dsrv}, CloseUnclassed)
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
		t.Logf("pass: %+v, counts %v", st, counts)
		if got := counts[da]; got.Closed != 1 || got.Failed != 0 {
			t.Errorf("closed to %s: %+v, want the pool's connection", da, got)
		}
		if got := counts[dsrv]; got != (CloseCount{}) {
			t.Errorf("the accepted socket counted: %+v", got)
		}
		if got := pool.Check(t); !slices.Equal(got, []string{"ECONNABORTED", "open"}) {
			t.Errorf("pool after the pass: %v, want its connection to %s closed and the accepted one open", got, da)
		}
	})
}

// With workloads, only sockets of cgroups in the workloads map are
// closed, by class: the shared class's destination closes the shared
// workload's sockets, not an isolated workload's nor an unselected
// cgroup's. With classes only (no scoping), a cgroup of no workload is of
// class 0.
func TestCloseEstablishedScoped(t *testing.T) {
	e := newEnv(t, Options{})
	eachCloser(t, e, func(t *testing.T, mech CloseMechanism, c *Closer, offset uint16) {
		port := 8321 + offset
		e.srv.ServeHold(t, port)
		tag := string(mech[:4])
		shared, isolated, unsel := e.cg.Child(t, "sh-"+tag), e.cg.Child(t, "iso-"+tag), e.cg.Child(t, "un-"+tag)
		e.selectCgroup(t, shared, 0)
		e.selectCgroup(t, isolated, 2)
		d := e.dest(port, false)
		ps := e.topo.Client.StartPool(t, shared, []kerneltest.PoolTarget{{Addr: d.Addr, N: 2}}, 0)
		pi := e.topo.Client.StartPool(t, isolated, []kerneltest.PoolTarget{{Addr: d.Addr, N: 2}}, 0)
		pu := e.topo.Client.StartPool(t, unsel, []kerneltest.PoolTarget{{Addr: d.Addr, N: 2}}, 0)

		counts, _, err := c.Close([]Dest{d}, CloseScoped)
		if err != nil {
			t.Fatal(err)
		}
		if got := counts[d]; got.Closed != 2 {
			t.Errorf("shared class: %+v, want 2 closed", got)
		}
		closed := []string{"ECONNABORTED", "ECONNABORTED"}
		open := []string{"open", "open"}
		if got := ps.Check(t); !slices.Equal(got, closed) {
			t.Errorf("shared workload: %v", got)
		}
		if got := pi.Check(t); !slices.Equal(got, open) {
			t.Errorf("isolated workload after the shared class's pass: %v", got)
		}
		if got := pu.Check(t); !slices.Equal(got, open) {
			t.Errorf("unselected cgroup: %v", got)
		}
		iso := d
		iso.Class = 2
		counts, _, err = c.Close([]Dest{iso}, CloseScoped)
		if err != nil {
			t.Fatal(err)
		}
		if got := counts[iso]; got.Closed != 2 {
			t.Errorf("isolated class: %+v, want 2 closed", got)
		}
		if got := pi.Check(t); !slices.Equal(got, closed) {
			t.Errorf("isolated workload after its own pass: %v", got)
		}
		if got := pu.Check(t); !slices.Equal(got, open) {
			t.Errorf("unselected cgroup: %v", got)
		}
		// Classes without scoping (a source pattern's workload): a
		// cgroup of no workload is protected in class 0, so class 0's
		// pass closes its connections too.
		counts, _, err = c.Close([]Dest{d}, CloseClassed)
		if err != nil {
			t.Fatal(err)
		}
		if got := counts[d]; got.Closed != 2 {
			t.Errorf("class 0 with classes only: %+v, want the unselected cgroup's 2 closed", got)
		}
		if got := pu.Check(t); !slices.Equal(got, closed) {
			t.Errorf("cgroup of no workload after class 0's pass (classes only): %v", got)
		}
	})
}

// One pass over 1,000 established sockets to the opening destination and
// 1,000 to another one (plus the listeners and the rest of the client's
// namespace): every one of the first closed, none of the others; the
// pass's time is logged (BENCHMARKS.md, "Closing established
// connections").
func TestClosePassThousandSockets(t *testing.T) {
	e := newEnv(t, Options{})
	eachCloser(t, e, func(t *testing.T, mech CloseMechanism, c *Closer, offset uint16) {
		const n = 1000
		port := 8341 + offset
		e.srv.ServeHold(t, port)
		e.srv.ServeHold(t, port+1)
		d, other := e.dest(port, false), e.dest(port+1, false)
		cg := e.cg.Child(t, "many-"+string(mech[:4]))
		pool := e.topo.Client.StartPool(t, cg, []kerneltest.PoolTarget{{Addr: d.Addr, N: n}, {Addr: other.Addr, N: n}}, 0)
		counts, st, err := c.Close([]Dest{d}, CloseUnclassed)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: one pass over %d sockets to close and %d to keep: %v (%d namespace)", mech, n, n, st.Duration, st.Namespaces)
		if got := counts[d]; got.Closed != n || got.Failed != 0 {
			t.Fatalf("closed %+v, want %d", got, n)
		}
		if _, st2, err := c.Close([]Dest{d}, CloseUnclassed); err == nil {
			t.Logf("%s: a second pass, nothing left to close among the %d kept: %v", mech, n, st2.Duration)
		}
		states := pool.Check(t)
		for i, s := range states {
			if want := i >= n; (s == "open") != want {
				t.Fatalf("socket %d is %s after the pass (the first %d go to the opening destination)", i, s, n)
			}
		}
	})
}

// breakerd probe's answer is the mechanism a loaded Kernel picks, also
// with the choice narrowed (--close-mechanism).
func TestProbeCloseAgreesWithNewCloser(t *testing.T) {
	e := newEnv(t, Options{})
	for _, allowed := range [][]CloseMechanism{nil, {CloseSockDiag}, {CloseNone}} {
		c := e.k.NewCloser(allowed...)
		mech, why := ProbeClose(allowed...)
		if mech != c.Mechanism() || why != c.Reason() {
			t.Errorf("allowed %v: ProbeClose: %s (%s); NewCloser: %s (%s)", allowed, mech, why, c.Mechanism(), c.Reason())
		}
		if (mech == CloseIterator) != (why == "") {
			t.Errorf("allowed %v: ProbeClose: %s with reason %q", allowed, mech, why)
		}
		if len(allowed) == 1 && mech != allowed[0] && !(mech == CloseNone && allowed[0] == CloseSockDiag) {
			t.Errorf("allowed %v: ProbeClose chose %s", allowed, mech)
		}
		c.Release()
	}
}

// A returning pass (a circuit with a fallback closed) closes exactly the
// established connections that asked for the circuit's destinations and
// were redirected to the fallback, IPv4 and IPv6, counted by the
// destination asked for; a connection made to the fallback's own address
// stays, and so does one redirected from another destination. sock_diag
// cannot tell redirected sockets: it closes nothing and says why.
func TestCloseEstablishedReturning(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.ServeHold(t, 8342)
	d4 := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 8341)}
	d6 := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv6, 8341)}
	other := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 8343)}
	fb4, fb6 := netip.AddrPortFrom(fb.IPv4, 8342), netip.AddrPortFrom(fb.IPv6, 8342)
	e.openWithFallback(t, 1, d4, fb4)
	e.openWithFallback(t, 2, d6, fb6)
	e.openWithFallback(t, 3, other, fb4)
	eachCloser(t, e, func(t *testing.T, mech CloseMechanism, c *Closer, _ uint16) {
		pool := e.topo.Client.StartPool(t, e.cg, []kerneltest.PoolTarget{
			{Addr: d4.Addr, N: 2}, {Addr: d6.Addr, N: 2}, {Addr: fb4, N: 1}, {Addr: fb6, N: 1}, {Addr: other.Addr, N: 1}}, 0)
		if got := pool.Check(t); slices.ContainsFunc(got, func(s string) bool { return s != "open" }) {
			t.Fatalf("before the pass: %v", got)
		}
		counts, _, err := c.CloseReturning([]Dest{d4, d6}, CloseUnclassed)
		if mech != CloseIterator {
			if !errors.Is(err, ErrCannotReturn) || len(counts) != 0 {
				t.Fatalf("%s: %v %v, want ErrCannotReturn and nothing closed", mech, counts, err)
			}
			if got := pool.Check(t); slices.ContainsFunc(got, func(s string) bool { return s != "open" }) {
				t.Fatalf("%s closed: %v", mech, got)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		if counts[d4].Closed != 2 || counts[d6].Closed != 2 || len(counts) != 2 {
			t.Fatalf("counts %v, want 2 closed for each destination asked for", counts)
		}
		want := []string{"ECONNABORTED", "ECONNABORTED", "ECONNABORTED", "ECONNABORTED", "open", "open", "open"}
		if got := pool.Check(t); !slices.Equal(got, want) {
			t.Fatalf("after the pass: %v, want %v", got, want)
		}
		// A pass by peer for the fallback is no returning pass: it closes
		// what is connected there, redirected or not.
		counts, _, err = c.Close([]Dest{{Proto: TCP, Addr: fb4}}, CloseUnclassed)
		if err != nil || counts[Dest{Proto: TCP, Addr: fb4}].Closed != 2 {
			t.Fatalf("the fallback's own pass: %v %v, want the 2 connections there", counts, err)
		}
	})
}
