package daemon

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

const bridgeConfig = `
failsafe_timeout: 30s
workloads:
  - name: shop
    cgroups: [CGROUP/shop]
  - name: web
    cgroups: [CGROUP/web]
targets:
  down:
    source: [shop]
    match: {cidrs: [SRV], ports: ["8408"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
`

// Reloads that insert a workload before an isolated one, and remove it
// again, move the isolated workload's cgroups between classes: a client
// of it hammering its forced-open destination is rejected throughout
// (its verdicts are bridged to the new class before the workloads map
// moves it), a client of a sibling workload reaching the same destination
// is never rejected, and after the last reload the verdict map holds only
// the circuit's own verdict (no bridging verdict left).
func TestReloadMovingClassesLetsNothingThrough(t *testing.T) {
	f := newScopedFixture(t, bridgeConfig)
	f.srv.Listen(t, "tcp4", 8408) // healthy: only the verdict rejects
	shop, web := f.cg.Child(t, "shop"), f.cg.Child(t, "web")
	conf := strings.ReplaceAll(bridgeConfig, "CGROUP", f.cgroupRel())
	moved := strings.Replace(conf, "workloads:\n", "workloads:\n  - name: other\n    cgroups: [CGROUP/other]\n", 1)
	moved = strings.ReplaceAll(moved, "CGROUP", f.cgroupRel())
	f.start()
	f.rejectFrom(shop, 8408, 1)
	addr := netip.AddrPortFrom(f.srv.IPv4, 8408)
	shopDone, webDone := make(chan []kerneltest.DialResult, 1), make(chan []kerneltest.DialResult, 1)
	go func() {
		shopDone <- f.topo.Client.Dial(t, shop, kerneltest.DialSpec{Network: "tcp4", Addr: addr, Op: "rate", Rate: 500, For: 4 * time.Second, Timeout: time.Second})
	}()
	go func() {
		webDone <- f.topo.Client.Dial(t, web, kerneltest.DialSpec{Network: "tcp4", Addr: addr, Op: "rate", Rate: 100, For: 4 * time.Second, Timeout: time.Second})
	}()
	for i := range 30 {
		c := conf
		if i%2 == 0 {
			c = moved
		}
		f.writeConfig(c)
		if err := f.d.Reload(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	count := func(rs []kerneltest.DialResult) map[unix.Errno]int64 {
		out := map[unix.Errno]int64{}
		for _, r := range rs {
			out[r.Errno] += r.Nanos // Op rate: the count of each errno
		}
		return out
	}
	if got := count(<-shopDone); len(got) != 1 || got[unix.EHOSTUNREACH] < 1000 {
		t.Fatalf("the isolated workload's connects across 30 class-moving reloads: %v, want only EHOSTUNREACH", got)
	}
	if got := count(<-webDone); len(got) != 1 || got[0] < 200 {
		t.Fatalf("the sibling workload's connects: %v, want every one connected", got)
	}
	all, err := f.d.k.AllVerdicts()
	if err != nil {
		t.Fatal(err)
	}
	want := maps.Dest{Proto: maps.TCP, Addr: addr, Class: 1} // shop is first again
	if _, ok := all[want]; len(all) != 1 || !ok {
		t.Fatalf("verdicts after the reloads %v, want only %v", all, want)
	}
}
