package maps

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

// maskDests are destinations, IPv4 and IPv6, until every bit of the mask
// stands for at least one of each family.
func maskDests(e *env) (v4, v6 []Dest) {
	var seen4, seen6 uint64
	for port := uint16(20000); seen4 != ^uint64(0) || seen6 != ^uint64(0); port++ {
		d := e.dest(port, false)
		if m := MaskOf([]Dest{d}); seen4&m == 0 {
			seen4 |= m
			v4 = append(v4, d)
		}
		d = e.dest(port, true)
		if m := MaskOf([]Dest{d}); seen6&m == 0 {
			seen6 |= m
			v6 = append(v6, d)
		}
	}
	return v4, v6
}

// TestVerdictMaskBucketsAgreeWithKernel rejects a connect to one
// destination under each bit of the mask, of both families, with only that
// destination's verdict (and so only its bit) in the maps: a connect
// whose bucket the kernel computed otherwise would find its bit clear and
// reach the server.
func TestVerdictMaskBucketsAgreeWithKernel(t *testing.T) {
	e := newEnv(t, Options{})
	v4, v6 := maskDests(e)
	want := unix.EPERM
	errno := unix.Errno(0)
	if e.k.Features().SetRetval {
		want, errno = unix.EHOSTDOWN, unix.EHOSTDOWN
	}
	before := e.srv.SYNs(t)
	for _, set := range []struct {
		network string
		dests   []Dest
	}{{"tcp4", v4}, {"tcp6", v6}} {
		// One helper process makes the family's connects, each when asked.
		dialer := e.topo.Client.StartDialer(t, e.cg, kerneltest.DialSpec{Network: set.network})
		for i, d := range set.dests {
			if err := e.k.PutVerdict(d, OpenVerdict(Now()+farFuture, 1, 0, errno, uint32(i+1))); err != nil {
				t.Fatal(err)
			}
			if m, err := e.k.VerdictMask(); err != nil || m != MaskOf([]Dest{d}) {
				t.Fatalf("%s: mask %#x (%v), want %#x", d, m, err, MaskOf([]Dest{d}))
			}
			r, err := dialer.Dial(d.Addr)
			if err != nil {
				t.Fatal(err)
			}
			if r.Errno != want {
				t.Fatalf("%s (bit %d): errno %v, want %v: the kernel looked elsewhere in the mask", d, verdictBucket(ptr(d.Key())), r.Errno, want)
			}
			if err := e.k.DeleteVerdict(d); err != nil {
				t.Fatal(err)
			}
		}
		if err := dialer.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n := e.srv.SYNs(t) - before; n != 0 {
		t.Fatalf("%d SYNs reached the server", n)
	}
	if m, err := e.k.VerdictMask(); err != nil || m != 0 {
		t.Fatalf("mask after every delete: %#x (%v), want 0", m, err)
	}
}

func ptr[T any](v T) *T { return &v }

// TestVerdictMaskFollowsEntries writes, replaces and deletes verdicts,
// one at a time and in a batch, while a heartbeat rewrites the settings
// as fast as it can: the mask always ends as exactly the bits of the
// entries present.
func TestVerdictMaskFollowsEntries(t *testing.T) {
	e := newEnv(t, Options{})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour}); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	defer func() { close(stop); wg.Wait() }()

	check := func(what string, present map[Dest]bool) {
		t.Helper()
		var ds []Dest
		for d := range present {
			ds = append(ds, d)
		}
		if m, err := e.k.VerdictMask(); err != nil || m != MaskOf(ds) {
			t.Fatalf("%s: mask %#x (%v), want %#x for %d entries", what, m, err, MaskOf(ds), len(ds))
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	present := map[Dest]bool{}
	var all []Dest
	for i := range 300 {
		all = append(all, e.dest(uint16(30000+i), i%3 == 0))
	}
	for range 3000 {
		d := all[rng.IntN(len(all))]
		if rng.IntN(2) == 0 {
			if err := e.k.PutVerdict(d, OpenVerdict(Now()+farFuture, 1, 0, 0, 1)); err != nil {
				t.Fatal(err)
			}
			present[d] = true
		} else {
			if err := e.k.DeleteVerdict(d); err != nil {
				t.Fatal(err)
			}
			delete(present, d)
		}
	}
	check("after 3000 puts and deletes", present)
	for d := range present {
		if err := e.k.DeleteVerdict(d); err != nil {
			t.Fatal(err)
		}
	}
	check("after deleting all", nil)
	batch := all[:40]
	if n, err := e.k.PutVerdicts(batch, OpenVerdict(Now()+farFuture, 1, 0, 0, 1)); err != nil || n != len(batch) {
		t.Fatalf("PutVerdicts: %d, %v", n, err)
	}
	present = map[Dest]bool{}
	for _, d := range batch {
		present[d] = true
	}
	check("after a batch", present)
	// The same batch again replaces: the counts stay, and deleting each
	// once clears them.
	if _, err := e.k.PutVerdicts(batch, OpenVerdict(Now()+farFuture, 2, 0, 0, 1)); err != nil {
		t.Fatal(err)
	}
	for _, d := range batch {
		if err := e.k.DeleteVerdict(d); err != nil {
			t.Fatal(err)
		}
	}
	check("after deleting the batch", nil)
}

// TestVerdictMaskAdoption: a Kernel loading pinned maps counts their
// entries before it writes any settings. A bit the previous daemon left
// set with no entry (killed between the two writes) is cleared; a bit
// missing under an entry (only a writer outside maps could leave that)
// is set, so the adopted verdict is enforced from the load on. And the
// mask is what the kernel reads: an entry written behind its back, with
// its bit clear, is not looked up.
func TestVerdictMaskAdoption(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8089)
	open := e.dest(8089, false)
	if err := e.k.PutVerdict(open, OpenVerdict(Now()+farFuture, 1, 0, 0, 3)); err != nil {
		t.Fatal(err)
	}
	if err := e.k.Close(); err != nil {
		t.Fatal(err)
	}

	// Behind the daemon's back: the entry's bit cleared, another set.
	cfg, err := ebpf.LoadPinnedMap(PinDir(e.opts.Dir)+"/config", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cfg.Close()
	var raw bpf.BreakerSettings
	if err := cfg.Lookup(uint32(0), &raw); err != nil {
		t.Fatal(err)
	}
	own := MaskOf([]Dest{open})
	stray := own << 1
	if stray == 0 {
		stray = 1
	}
	raw.VerdictMask = stray
	if err := cfg.Put(uint32(0), &raw); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: open.Addr})); got[0] != 1 {
		t.Fatalf("with the entry's bit clear: errnos %v, want the connect let through (the kernel skips the lookup)", got)
	}

	e.k = e.load(t)
	if m, err := e.k.VerdictMask(); err != nil || m != own {
		t.Fatalf("mask after adoption %#x (%v), want %#x", m, err, own)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: open.Addr})); got[0] != 0 {
		t.Fatalf("adopted verdict not enforced: errnos %v", got)
	}
	// The heartbeat keeps it.
	if err := e.k.Heartbeat(); err != nil {
		t.Fatal(err)
	}
	if m, err := e.k.VerdictMask(); err != nil || m != own {
		t.Fatalf("mask after a heartbeat %#x (%v), want %#x", m, err, own)
	}
	// A destination with no entry under a set bit is looked up and let
	// through.
	var other Dest
	for p := uint16(8100); ; p++ {
		if d := e.dest(p, false); MaskOf([]Dest{d}) == own {
			other = d
			break
		}
	}
	e.srv.ServeHold(t, other.Addr.Port())
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(other.Addr.Addr(), other.Addr.Port())})); got[0] != 1 {
		t.Fatalf("healthy destination under the open one's bit: errnos %v, want success", got)
	}
}

// TestVerdictMaskOrder looks at the maps between a verdict write's two
// steps: a new entry's bit is set before the entry exists, and a deleted
// entry is gone before its bit is cleared.
func TestVerdictMaskOrder(t *testing.T) {
	e := newEnv(t, Options{})
	d := e.dest(8090, false)
	bit := MaskOf([]Dest{d})
	var step string
	e.k.vm.between = func() {
		m, err := e.k.VerdictMask()
		_, ok, err2 := e.k.Verdict(d)
		if err != nil || err2 != nil {
			t.Errorf("%s: %v %v", step, err, err2)
			return
		}
		switch step {
		case "put":
			if m&bit == 0 || ok {
				t.Errorf("between the put's steps: bit set %v, entry present %v; want the bit set and no entry yet", m&bit != 0, ok)
			}
		case "delete":
			if m&bit == 0 || ok {
				t.Errorf("between the delete's steps: bit set %v, entry present %v; want the entry gone and the bit still set", m&bit != 0, ok)
			}
		}
	}
	step = "put"
	if err := e.k.PutVerdict(d, OpenVerdict(Now()+farFuture, 1, 0, 0, 1)); err != nil {
		t.Fatal(err)
	}
	step = "delete"
	if err := e.k.DeleteVerdict(d); err != nil {
		t.Fatal(err)
	}
	if m, err := e.k.VerdictMask(); err != nil || m != 0 {
		t.Fatalf("after the delete: mask %#x (%v)", m, err)
	}
}

// TestVerdictMaskFullMap: a verdict the full map refuses leaves its bit
// as it was (clear when nothing else is under it).
func TestVerdictMaskFullMap(t *testing.T) {
	e := newEnv(t, Options{MaxVerdicts: 1})
	a := e.dest(8091, false)
	var b Dest
	for p := uint16(8092); ; p++ {
		if b = e.dest(p, false); MaskOf([]Dest{b}) != MaskOf([]Dest{a}) {
			break
		}
	}
	if err := e.k.PutVerdict(a, OpenVerdict(Now()+farFuture, 1, 0, 0, 1)); err != nil {
		t.Fatal(err)
	}
	if err := e.k.PutVerdict(b, OpenVerdict(Now()+farFuture, 1, 0, 0, 2)); !errors.Is(err, ErrVerdictsFull) {
		t.Fatalf("second verdict in a map of one: %v, want ErrVerdictsFull", err)
	}
	if m, err := e.k.VerdictMask(); err != nil || m != MaskOf([]Dest{a}) {
		t.Fatalf("mask %#x (%v), want only the written entry's %#x", m, err, MaskOf([]Dest{a}))
	}
}

// TestVerdictMaskAdoptsManyAndDeletesDown adopts more entries than one
// batched read carries, then deletes them down to one under each bit, and
// then those: each bit clears with the last entry under it, from several
// goroutines at once.
func TestVerdictMaskAdoptsManyAndDeletesDown(t *testing.T) {
	e := newEnv(t, Options{})
	var dests []Dest
	for i := range 5000 {
		a := netip.AddrFrom4([4]byte{10, 77, byte(i >> 8), byte(i)})
		dests = append(dests, Dest{Proto: TCP, Addr: netip.AddrPortFrom(a, 443)})
	}
	if n, err := e.k.PutVerdicts(dests, OpenVerdict(Now()+farFuture, 1, 0, 0, 1)); err != nil || n != len(dests) {
		t.Fatalf("PutVerdicts: %d %v", n, err)
	}
	if err := e.k.Close(); err != nil {
		t.Fatal(err)
	}
	e.k = e.load(t)
	if m, err := e.k.VerdictMask(); err != nil || m != ^uint64(0) {
		t.Fatalf("adopted 5000: mask %#x (%v)", m, err)
	}
	last := map[uint64]Dest{}
	var rest []Dest
	for _, d := range dests {
		m := MaskOf([]Dest{d})
		if _, ok := last[m]; !ok {
			last[m] = d
			continue
		}
		rest = append(rest, d)
	}
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < len(rest); i += 4 {
				if err := e.k.DeleteVerdict(rest[i]); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if m, err := e.k.VerdictMask(); err != nil || m != ^uint64(0) {
		t.Fatalf("one entry left under each bit: mask %#x (%v), want every bit", m, err)
	}
	want := ^uint64(0)
	for m, d := range last {
		if err := e.k.DeleteVerdict(d); err != nil {
			t.Fatal(err)
		}
		want &^= m
		if got, err := e.k.VerdictMask(); err != nil || got != want {
			t.Fatalf("after deleting the last entry under %#x: mask %#x (%v), want %#x", m, got, err, want)
		}
	}
}
