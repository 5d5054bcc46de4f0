package maps

import (
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

// maskDests are destinations (with their v6 and classed forms) until
// every bit of the mask stands for at least one of each family.
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
		for i, d := range set.dests {
			if err := e.k.PutVerdict(d, OpenVerdict(Now()+farFuture, 1, 0, errno, uint32(i+1))); err != nil {
				t.Fatal(err)
			}
			if m, err := e.k.VerdictMask(); err != nil || m != MaskOf([]Dest{d}) {
				t.Fatalf("%s: mask %#x (%v), want %#x", d, m, err, MaskOf([]Dest{d}))
			}
			if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: set.network, Addr: d.Addr})); got[want] != 1 {
				t.Fatalf("%s (bit %d): errnos %v, want %v: the kernel looked elsewhere in the mask", d, verdictBucket(ptr(d.Key())), got, want)
			}
			if err := e.k.DeleteVerdict(d); err != nil {
				t.Fatal(err)
			}
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
