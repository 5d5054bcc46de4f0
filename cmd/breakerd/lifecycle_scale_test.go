package main

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

// scaleConfig is lifecycleConfig with a bulkhead on every destination no
// target names, and room for 100,000 adopted circuits.
var scaleConfig = strings.Replace(lifecycleConfig,
	"all:\n  consecutive_failures: 1000\n",
	"max_circuits: 131072\nall:\n  consecutive_failures: 1000\n  max_connections: 2\n", 1)

// pause stops the client loop and waits for its last helper to end (a
// cgroup with a process in it cannot be removed); resume starts it again.
func (l *lifecycle) pause() {
	l.stop.Store(true)
	l.wg.Wait()
}

func (l *lifecycle) resume() {
	l.stop.Store(false)
	l.clientLoop()
}

// busySlots asserts that the only bulkhead slots counting sockets are
// those of want, with want's counts: no count leaked to another slot.
func (l *lifecycle) busySlots(step string, want map[maps.Dest]int64) {
	l.t.Helper()
	v, err := maps.OpenPinned(l.bpffs)
	if err != nil {
		l.t.Fatalf("%s: %v", step, err)
	}
	defer v.Close()
	all, err := v.AllLimits()
	if err != nil {
		l.t.Fatalf("%s: %v", step, err)
	}
	slots := map[uint32]int64{}
	for d, n := range want {
		if n > 0 {
			slots[all[d].Slot] = n
		}
	}
	busy, err := v.BusySlots()
	if err != nil {
		l.t.Fatalf("%s: %v", step, err)
	}
	if len(busy) != len(slots) {
		l.t.Fatalf("%s: busy bulkhead slots %v, want only %v", step, busy, slots)
	}
	for slot, b := range busy {
		if slots[slot] != b.Connections || b.Connecting != 0 {
			l.t.Fatalf("%s: slot %d counts %+v, want %d connections", step, slot, b, slots[slot])
		}
	}
}

// readyz returns the status of GET /readyz on breakerd's admin socket.
func (l *lifecycle) readyz() int {
	l.t.Helper()
	c := http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", l.socket)
	}}}
	resp, err := c.Get("http://breakerd/readyz")
	if err != nil {
		l.t.Fatalf("GET /readyz: %v", err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestLifecycleAtScale runs the lifecycle suite's client loop and
// invariants (see lifecycleConfig) through the steps that move the ground
// or scale up: the protected cgroup removed and made again while breakerd
// runs, 70,000 distinct destinations reached by real connects with
// all.max_connections set, and 100,000 pinned open verdicts adopted by the
// real binary across a restart.
func TestLifecycleAtScale(t *testing.T) {
	l := newLifecycle(t)
	l.writeConfig(scaleConfig)
	p := l.start()
	l.clientLoop()
	l.check("start", map[maps.Dest]int64{l.pool: 0})

	// The protected cgroup removed and made again: noticed at error
	// level, protection attached again to the new directory.
	l.pause()
	if err := os.Remove(l.cg.Path); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { return strings.Contains(p.logs.String(), "cgroup_removed") }) {
		t.Fatalf("the removed cgroup was not noticed:\n%s", p.logs.String())
	}
	if code := l.readyz(); code == http.StatusOK {
		t.Fatal("/readyz answers 200 with the protected cgroup gone")
	}
	if err := os.Mkdir(l.cg.Path, 0o755); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { return strings.Contains(p.logs.String(), "protection in place again") }) {
		t.Fatalf("the recreated cgroup was not protected again:\n%s", p.logs.String())
	}
	if !strings.Contains(p.logs.String(), "level=ERROR") {
		t.Fatalf("no error log for the removed cgroup:\n%s", p.logs.String())
	}
	if code := l.readyz(); code != http.StatusOK {
		t.Fatalf("/readyz answers %d once the cgroup is back and protected", code)
	}
	l.resume()
	holder := l.hold(l.pool, 3)
	l.check("cgroup removed and made again, 3 held", map[maps.Dest]int64{l.pool: 3})
	if got := errnos(l.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.pool.Addr})); got[unix.EAGAIN] != 1 {
		t.Fatalf("pool full in the recreated cgroup: %v, want EAGAIN", got)
	}

	// 70,000 distinct destinations by real connects (35,000 ports over
	// IPv4 and over IPv6 of the test host: the first 10 accepted, then
	// closed by the client, the others refused, nothing listening): each
	// becomes a circuit of all with its own bulkhead, and no slot counts a
	// socket once they are closed.
	srv := l.topo.Servers[0]
	const perFamily, accepted = 35000, 10
	for port := range uint16(accepted) {
		srv.ServeHold(t, 20000+port)
	}
	want := map[maps.Dest]int64{l.pool: 3}
	start := time.Now()
	for _, a := range []struct {
		network string
		addr    netip.Addr
	}{{"tcp4", srv.IPv4}, {"tcp6", srv.IPv6}} {
		res := l.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Network: a.network, Addr: netip.AddrPortFrom(a.addr, 20000), Count: perFamily, Ports: perFamily, Parallel: 2})
		if got := errnos(res); got[0] != accepted || got[unix.ECONNREFUSED] != perFamily-accepted {
			t.Fatalf("%d connects to distinct ports of %s: %v, want %d accepted and the others refused", perFamily, a.addr, got, accepted)
		}
		for i := range perFamily {
			want[maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(a.addr, uint16(20000+i))}] = 0
		}
	}
	t.Logf("%d connects to distinct destinations: %v", 2*perFamily, time.Since(start))
	if !kerneltest.WaitFor(60*time.Second, func() bool {
		v, err := maps.OpenPinned(l.bpffs)
		if err != nil {
			return false
		}
		defer v.Close()
		all, _ := v.AllLimits()
		return len(all) >= len(want)
	}) {
		t.Fatalf("the limits map never held the %d destinations' bulkheads:\n%s", len(want), p.logs.String())
	}
	t.Logf("bulkheads of %d destinations written: %v", len(want), time.Since(start))
	l.check("70,000 destinations", want)
	l.busySlots("70,000 destinations", want)

	// 100,000 open verdicts pinned while breakerd is stopped (what a
	// previous daemon left), adopted by the real binary: every one kept.
	// The restart also makes a circuit again for every destination with a
	// pinned limit (the 70,000 of all's), and the adopted circuits are
	// all's too, so each gets a bulkhead: the limits map then holds the
	// 70,001 entries and one per adopted verdict, every slot at 0 but
	// pool's.
	l.sigterm(p)
	k, err := maps.Load(maps.Options{Dir: l.bpffs})
	if err != nil {
		t.Fatal(err)
	}
	const n = 100000
	due := maps.Now() + time.Hour
	l.open = map[maps.Dest]bool{}
	for i := 0; i < n; i += 1000 {
		dests := make([]maps.Dest, 0, 1000)
		for j := i; j < i+1000; j++ {
			d := maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 98, byte(j >> 8), byte(j)}), uint16(1000+j>>16))}
			dests = append(dests, d)
			l.open[d] = true
		}
		if _, err := k.PutVerdicts(dests, maps.OpenVerdict(due, 1, 0, unix.EHOSTDOWN, uint32(140000+i/1000))); err != nil {
			t.Fatal(err)
		}
	}
	k.Close()
	// A helper the client loop forked while this process held the pin
	// directory's lock holds the lock (flock follows the open file) until
	// it execs, which can take a while on a loaded machine: wait until it
	// is free before starting breakerd.
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		lk, err := maps.LockDir(l.bpffs)
		lk.Close()
		return err == nil
	}) {
		t.Fatal("the pin directory stays locked")
	}
	start = time.Now()
	p = l.startWithin(time.Minute)
	t.Logf("restart adopting %d pinned open verdicts: ready after %v", n, time.Since(start))
	if !strings.Contains(p.logs.String(), `msg="adopted open circuit(s) from the pinned verdict map" count=100000`) {
		t.Fatalf("the adoption of all %d verdicts not logged:\n%s", n, p.logs.String())
	}
	for d := range l.open {
		want[d] = 0
	}
	l.check("100,000 verdicts adopted", want)
	// The adopted verdicts reject in connect() with their errno (without
	// them the client, which has no route to 10.98.0.0/16, would get
	// ENETUNREACH).
	for _, d := range []maps.Dest{{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 98, 0, 0}), 1000)}, {Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 98, 0x86, 0x9f}), 1001)}} {
		if !l.open[d] {
			t.Fatalf("%s is not one of the adopted destinations", d)
		}
		if got := errnos(l.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[unix.EHOSTDOWN] != 1 {
			t.Fatalf("connect to adopted open %s: %v, want EHOSTDOWN", d, got)
		}
	}
	l.busySlots("100,000 verdicts adopted", want)

	holder.Cmd.Process.Kill()
	holder.Cmd.Wait()
	want[l.pool] = 0
	l.check("held connections closed", want)
	l.busySlots("held connections closed", nil)
	l.pause()
	l.sigterm(p)
}
