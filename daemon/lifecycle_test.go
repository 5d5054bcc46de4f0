package daemon

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

// restart stops the running daemon as SIGTERM does and starts a new one on
// the same pins and configuration file.
func (f *fixture) restart() *Daemon {
	f.t.Helper()
	f.stop()
	return f.start()
}

func (f *fixture) hold(port uint16, n int) *kerneltest.Process {
	f.t.Helper()
	return f.topo.Client.StartDial(f.t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, port), Count: n, Parallel: n, Hold: time.Minute})
}

func (f *fixture) waitConnections(name string, want int64) {
	f.t.Helper()
	if !kerneltest.WaitFor(3*time.Second, func() bool { c, _ := f.circuit(name); return c.Connections == want }) {
		c, _ := f.circuit(name)
		f.t.Fatalf("circuit %s counts %d connections, want %d", name, c.Connections, want)
	}
}

func kill(p *kerneltest.Process) {
	p.Cmd.Process.Kill()
	p.Cmd.Wait()
}

const poolConfig = `
failsafe_timeout: 30s
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8400"]}
    max_connections: 3
`

// Connections counted by a bulkhead before a restart are released after
// it: the count equals the sockets open, and once they close new connects
// get in.
func TestBulkheadCountsAcrossRestart(t *testing.T) {
	f := newFixture(t, poolConfig)
	f.srv.ServeHold(t, 8400)
	f.start()
	holder := f.hold(8400, 3)
	f.waitConnections("pool", 3)
	before, _ := f.circuit("pool")

	f.restart()
	after, _ := f.circuit("pool")
	if after.CircuitID != before.CircuitID || after.Connections != 3 {
		t.Fatalf("after the restart: id %d (was %d), %d connections, want the same id counting 3", after.CircuitID, before.CircuitID, after.Connections)
	}
	if got := errnos(f.dial(8400, 1, 0)); got[unix.EAGAIN] != 1 {
		t.Fatalf("the bulkhead is full across the restart: %v, want EAGAIN", got)
	}
	kill(holder)
	f.waitConnections("pool", 0)
	if got := errnos(f.dial(8400, 3, 0)); got[0] != 3 {
		t.Fatalf("after the holders closed: %v, want every connect through", got)
	}
}

const twoPoolsConfig = `
failsafe_timeout: 30s
targets:
  a:
    match: {cidrs: [SRV], ports: ["8401"]}
    max_connections: 1
  b:
    match: {cidrs: [SRV], ports: ["8402"]}
    max_connections: 1
`

// The pinned limits map says what the configuration says after a restart
// and after a reload: a limit taken away is not enforced any more, one set
// again counts from what is open, one moved follows its target.
func TestLimitsFollowTheConfiguration(t *testing.T) {
	f := newFixture(t, twoPoolsConfig)
	f.srv.ServeHold(t, 8401)
	f.srv.ServeHold(t, 8402)
	f.start()
	holder := f.hold(8401, 1)
	f.waitConnections("a", 1)

	// Restart on a configuration where a has no limit (b keeps one, so
	// the kernel still looks limits up).
	f.writeConfig(strings.Replace(twoPoolsConfig, "    max_connections: 1\n  b:", "    consecutive_failures: 5\n  b:", 1))
	f.restart()
	if got := errnos(f.dial(8401, 2, 0)); got[0] != 2 {
		t.Fatalf("restarted without a's limit: %v, want no limit enforced", got)
	}
	f.checkLimits(map[string]int{"b": 1})

	// Reload: the limit comes back; what a still holds counts.
	f.writeConfig(twoPoolsConfig)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	f.checkLimits(map[string]int{"a": 1, "b": 1})
	kill(holder)
	f.waitConnections("a", 0)
	if got := errnos(f.dial(8401, 1, 0)); got[0] != 1 {
		t.Fatalf("limit set again, nothing open: %v, want through", got)
	}

	// Reload: b's limit goes, a keeps its own.
	f.writeConfig(`
failsafe_timeout: 30s
targets:
  a:
    match: {cidrs: [SRV], ports: ["8401"]}
    max_connections: 1
  b:
    match: {cidrs: [SRV], ports: ["8402"]}
`)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	f.checkLimits(map[string]int{"a": 1})
	if got := errnos(f.dial(8402, 2, 0)); got[0] != 2 {
		t.Fatalf("b without a limit: %v", got)
	}
}

// checkLimits asserts that the kernel's limits map holds exactly one entry
// per destination of the named circuits, in their slots.
func (f *fixture) checkLimits(want map[string]int) {
	f.t.Helper()
	all, err := f.d.k.AllLimits()
	if err != nil {
		f.t.Fatal(err)
	}
	total := 0
	for name, n := range want {
		c, ok := f.circuit(name)
		if !ok {
			f.t.Fatalf("no circuit %s", name)
		}
		for _, s := range c.Destinations {
			d := maps.Dest{Proto: maps.TCP, Addr: netip.MustParseAddrPort(strings.TrimPrefix(s, "tcp/"))}
			if l, ok := all[d]; !ok || l.Slot != c.CircuitID {
				f.t.Fatalf("limit of %s: %+v (present %v), want slot %d", s, l, ok, c.CircuitID)
			}
		}
		total += n
	}
	if len(all) != total {
		f.t.Fatalf("limits map holds %d entries, want %d: %v", len(all), total, all)
	}
}

// The kernel's rejection counters of a circuit carry on across a restart:
// the metric counts rejections made before, during and after it.
func TestRejectionCountersAcrossRestart(t *testing.T) {
	f := newFixture(t, strings.Replace(strings.Replace(svcConfig, "open_duration: 1s", "open_duration: 1m", 1), "failsafe_timeout: 2s", "failsafe_timeout: 30s", 1))
	f.start()
	f.dial(8080, 3, 0)
	f.waitState("svc", "open", 2*time.Second)
	f.dial(8080, 5, 0)
	f.stop()
	f.dial(8080, 4, 0) // no daemon: the pinned programs reject (heartbeat fresh)
	f.start()
	f.dial(8080, 2, 0)
	rec := httptest.NewRecorder()
	f.d.handler(exposeAll, nil).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if want := `breakerd_kernel_rejections_total{target="svc"} 11`; !strings.Contains(rec.Body.String(), want) {
		t.Fatalf("scrape lacks %s:\n%s", want, grepLines(rec.Body.String(), "kernel_rejections"))
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// 100,000 pinned open verdicts and max_circuits 1000: the new daemon adopts
// every one (none deleted), in one pass.
func TestAdoptionKeepsEveryOpenVerdict(t *testing.T) {
	f := newFixture(t, `
max_circuits: 1000
failsafe_timeout: 30s
all:
  open_duration: 1m
`)
	f.start()
	f.stop()
	// What a previous daemon with a larger max_circuits left.
	k, err := maps.Load(maps.Options{Dir: f.bpffs})
	if err != nil {
		t.Fatal(err)
	}
	// 100,000 on the host, where the registry's scale is the point. In the
	// emulated guest the kernel's part (the pinned map read in batches and
	// counted, past max_circuits) is the same at 10,000, and seating
	// 100,000 circuits there takes 27 s of user-space work.
	n := 100000
	if kerneltest.Emulated() {
		n = 10000
	}
	due := maps.Now() + time.Hour
	for i := 0; i < n; i += 1000 {
		dests := make([]maps.Dest, 0, 1000)
		for j := i; j < i+1000; j++ {
			dests = append(dests, maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 99, byte(j >> 8), byte(j)}), uint16(1000+j>>16))})
		}
		if _, err := k.PutVerdicts(dests, maps.OpenVerdict(due, 1, 0, 0, uint32(i/1000+1))); err != nil {
			t.Fatal(err)
		}
	}
	if err := k.SetSettings(maps.Settings{Heartbeat: maps.Now(), FailSafe: 30 * time.Second}); err != nil {
		t.Fatal(err)
	}
	k.Close()

	start := time.Now()
	f.start()
	t.Logf("start-up with %d pinned verdicts: %v", n, time.Since(start))
	cnt, _ := f.d.k.VerdictCount()
	if cnt != n {
		t.Fatalf("%d verdicts after adoption, want all %d", cnt, n)
	}
	f.d.hold()
	circuits := f.d.eng.Count()
	f.d.release()
	if circuits != n {
		t.Fatalf("%d circuits adopted, want %d", circuits, n)
	}
}

// A second daemon on the same pins is refused before it touches anything,
// and so is one given a path that is not cgroup v2: the running daemon's
// forced-open verdict keeps rejecting.
func TestSecondStartTouchesNothing(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.srv.ServeHold(t, 8080)
	f.start()
	if _, err := f.d.Force("svc", "open"); err != nil {
		t.Fatal(err)
	}
	other := kerneltest.NewCgroup(t)
	logs := &kerneltest.LogBuffer{}
	for _, o := range []Options{
		{ConfigPath: f.config, Cgroup: other.Path, BPFFS: f.bpffs},
		{ConfigPath: f.config, Cgroup: t.TempDir(), BPFFS: f.bpffs},
		{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs, AdminSocket: f.socket},
	} {
		o.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(logs), nil))
		if _, err := New(o); err == nil {
			t.Fatalf("a second daemon started with %+v", o)
		} else {
			t.Logf("refused: %v", err)
		}
	}
	if got := errnos(f.dial(8080, 3, 0)); got[unix.EHOSTUNREACH] != 3 {
		t.Fatalf("forced open after the refused starts: %v", got)
	}
	if _, err := os.Stat(f.socket); err != nil {
		t.Fatalf("the running daemon's socket: %v", err)
	}
}

// A start that fails on a bad admin input leaves nothing behind: no pins,
// no attached program.
func TestFailedStartLeavesNothing(t *testing.T) {
	f := newFixture(t, svcConfig)
	bad := []Options{
		{AdminAddr: "127.0.0.1:notaport"},
		{TokenFile: filepath.Join(t.TempDir(), "missing")},
		{AdminSocket: "/proc/breakerd-cannot-be-here/admin.sock"},
	}
	for _, o := range bad {
		o.ConfigPath, o.Cgroup, o.BPFFS = f.config, f.cg.Path, f.bpffs
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		if _, err := New(o); err == nil {
			t.Fatalf("started with %+v", o)
		}
		if entries, _ := os.ReadDir(f.bpffs); len(entries) != 0 {
			t.Fatalf("a failed start (%+v) left %v in %s", o, entries, f.bpffs)
		}
	}
}

// The protected cgroup removed and made again, pins removed: readiness
// drops, the problem is logged and counted, what can be is repaired, and
// the recreated cgroup is protected again.
func TestGroundMoving(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.srv.ServeHold(t, 8080)
	cg := kerneltest.NewCgroup(t)
	f.cg = cg
	f.checkEvery = -1 // checks run by hand below
	f.start()
	if _, err := f.d.Force("svc", "open"); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(cg.Path); err != nil {
		t.Fatal(err)
	}
	f.d.checkGround(t.Context())
	if f.ready() {
		t.Fatal("ready with the protected cgroup gone")
	}
	if v := testutil.ToFloat64(f.d.metrics.groundProblems.WithLabelValues(string(maps.CgroupRemoved))); v != 1 {
		t.Fatalf("cgroup_removed counted %v times", v)
	}
	if !strings.Contains(f.logs.String(), "level=ERROR") || !strings.Contains(f.logs.String(), "cgroup_removed") {
		t.Fatalf("no error log:\n%s", f.logs.String())
	}
	if err := os.Mkdir(cg.Path, 0o755); err != nil {
		t.Fatal(err)
	}
	f.d.checkGround(t.Context())
	if !f.ready() {
		t.Fatalf("not ready once the cgroup is back and repaired:\n%s", f.logs.String())
	}
	if got := errnos(f.dial(8080, 2, 0)); got[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("the recreated cgroup: %v, want the forced-open circuit enforced", got)
	}

	for _, name := range []string{"verdicts", "link_connect4", "socks"} {
		if err := os.Remove(filepath.Join(f.d.k.PinDir(), name)); err != nil {
			t.Fatal(err)
		}
	}
	f.d.checkGround(t.Context())
	if v := testutil.ToFloat64(f.d.metrics.groundProblems.WithLabelValues(string(maps.PinsRemoved))); v != 1 {
		t.Fatalf("pins_removed counted %v times", v)
	}
	if p := f.d.k.Check(); p != nil || !f.ready() {
		t.Fatalf("pins not put back: %v", p)
	}
	f.stop()
	if !strings.Contains(f.logs.String(), "links and maps stay pinned") {
		t.Fatalf("shutdown message:\n%s", f.logs.String())
	}
	// After the daemon: the verdict was pinned again, so it still rejects.
	if got := errnos(f.dial(8080, 2, 0)); got[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("after shutdown: %v", got)
	}
}

func (f *fixture) ready() bool {
	f.d.hold()
	defer f.d.release()
	return f.d.ready.Load()
}

// 70,000 distinct destinations with all.max_connections set: each gets its
// own circuit id (past the 65,536 of the previous layout), none shares a
// bulkhead slot, the limits map holds one entry each, and a bulkhead with a
// high id enforces exactly.
func TestSeventyThousandDestinationsWithBulkheads(t *testing.T) {
	f := newFixture(t, `
max_circuits: 131072
failsafe_timeout: 30s
all:
  max_connections: 2
`)
	f.srv.ServeHold(t, 8600)
	f.start()
	const n = 70000
	f.d.hold()
	now := f.d.now()
	for i := range n {
		dst := maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 77, byte(i >> 8), byte(i)}), uint16(1000+i>>16))}
		if c, _ := f.d.eng.Lookup(dst, now); c == nil {
			f.d.release()
			t.Fatalf("destination %d refused", i)
		}
	}
	ids := map[uint32]string{}
	for c := range f.d.eng.All() {
		if c.ID == 0 {
			t.Errorf("circuit %s has id 0", c.Name())
		}
		if other, dup := ids[c.ID]; dup {
			t.Errorf("circuits %s and %s share id %d", c.Name(), other, c.ID)
		}
		ids[c.ID] = c.Name()
	}
	f.d.release()
	if len(ids) != n {
		t.Fatalf("%d circuits, want %d", len(ids), n)
	}
	// The real destination comes after them: its id is past 65,536. A
	// dynamic circuit's bulkhead applies from the first time the daemon
	// sees the destination (its first outcome record).
	name := fmt.Sprintf("tcp/%s:8600", f.srv.IPv4)
	f.dial(8600, 1, 0)
	var id uint32
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		f.d.hold()
		defer f.d.release()
		if c, _ := f.d.eng.Get(name); c != nil {
			id = c.ID
		}
		return id != 0
	}) {
		t.Fatal("no circuit for the real destination")
	}
	if id < 1<<16 {
		t.Fatalf("circuit id %d: the test wants one past 65,536", id)
	}
	holder := f.topo.Client.StartDial(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8600), Count: 2, Parallel: 2, Hold: time.Minute})
	count := func(want int64) {
		t.Helper()
		var b maps.BulkCount
		if !kerneltest.WaitFor(3*time.Second, func() bool { b, _ = f.d.k.BulkCount(id); return b.Connections == want }) {
			t.Fatalf("slot %d counts %+v, want %d connections", id, b, want)
		}
	}
	count(2)
	if got := errnos(f.dial(8600, 1, 0)); got[unix.EAGAIN] != 1 {
		t.Fatalf("third connect to a 2-connection bulkhead with id %d: %v", id, got)
	}
	all, err := f.d.k.AllLimits()
	if err != nil || len(all) != n+1 {
		t.Fatalf("limits map: %d entries (%v), want %d", len(all), err, n+1)
	}
	kill(holder)
	count(0)
}

// max_circuits bounds the destinations of targets too: an endpoint-scope
// target over a wide CIDR and a service-scope one collecting destinations
// stop at the bound, and the refusals are counted by target.
func TestMaxCircuitsBoundsTargets(t *testing.T) {
	f := newFixture(t, `
max_circuits: 10
targets:
  pay:
    match: {cidrs: [10.20.0.0/16], ports: ["443"]}
    scope: endpoint
  svc:
    match: {cidrs: [10.30.0.0/16], ports: ["443"]}
`)
	f.start()
	f.d.hold()
	now := f.d.now()
	for i := range 50 {
		for _, net := range []byte{20, 30} {
			f.d.eng.Lookup(maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, net, 0, byte(i)}), 443)}, now)
		}
	}
	dests, circuits := f.d.eng.Destinations(), f.d.eng.Count()
	f.d.release()
	if dests != 10 {
		t.Fatalf("%d destinations tracked (%d circuits), want max_circuits = 10", dests, circuits)
	}
	pay := testutil.ToFloat64(f.d.metrics.circuitsRefused.WithLabelValues("pay"))
	svc := testutil.ToFloat64(f.d.metrics.circuitsRefused.WithLabelValues("svc"))
	if pay+svc != 90 || pay == 0 || svc == 0 {
		t.Fatalf("refused: pay %v, svc %v; want 90 in all, by target", pay, svc)
	}
}

// An unmounted bpffs under a running daemon is noticed, cannot be repaired
// (nothing is made on the filesystem underneath, which is not bpffs), and
// the shutdown says protection is not kept.
func TestBPFFSUnmounted(t *testing.T) {
	f := newFixture(t, svcConfig)
	mnt := filepath.Join(t.TempDir(), "bpffs")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("bpffs", mnt, "bpf", 0, ""); err != nil {
		t.Fatalf("mounting a private bpffs: %v", err)
	}
	unmounted := false
	t.Cleanup(func() {
		if !unmounted {
			unix.Unmount(mnt, unix.MNT_DETACH)
		}
	})
	f.bpffs = filepath.Join(mnt, "breakerd")
	f.start()
	if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	unmounted = true
	f.d.checkGround(t.Context())
	if f.ready() {
		t.Fatal("ready with the bpffs gone")
	}
	if v := testutil.ToFloat64(f.d.metrics.groundProblems.WithLabelValues(string(maps.BPFFSUnmounted))); v != 1 {
		t.Fatalf("bpffs_unmounted counted %v times", v)
	}
	if _, err := os.Lstat(f.bpffs); err == nil {
		t.Fatalf("%s made on the filesystem underneath the unmounted bpffs", f.bpffs)
	}
	f.stop()
	if !strings.Contains(f.logs.String(), "shutting down with protection not in place") {
		t.Fatalf("the shutdown claims protection:\n%s", f.logs.String())
	}
}

// A slot that still counts sockets of a circuit the new configuration no
// longer has is not handed to another circuit: the new circuit's bulkhead
// starts from what it holds itself.
func TestBusySlotNotGivenToAnotherCircuit(t *testing.T) {
	f := newFixture(t, twoPoolsConfig)
	f.srv.ServeHold(t, 8401)
	f.srv.ServeHold(t, 8403)
	f.start()
	holder := f.hold(8401, 1)
	f.waitConnections("a", 1)
	old, _ := f.circuit("a")

	f.writeConfig(`
failsafe_timeout: 30s
targets:
  c:
    match: {cidrs: [SRV], ports: ["8403"]}
    max_connections: 1
`)
	f.restart()
	c, _ := f.circuit("c")
	if c.CircuitID == old.CircuitID || c.Connections != 0 {
		t.Fatalf("circuit c got id %d counting %d; a's slot %d still counts a's socket", c.CircuitID, c.Connections, old.CircuitID)
	}
	if got := errnos(f.topo.Client.Dial(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8403), Count: 2, Parallel: 2, Barrier: true, Hold: 300 * time.Millisecond})); got[0] != 1 || got[unix.EAGAIN] != 1 {
		t.Fatalf("c's bulkhead of 1: %v, want one through and one EAGAIN", got)
	}
	kill(holder)
	if !kerneltest.WaitFor(3*time.Second, func() bool { b, _ := f.d.k.BulkCount(old.CircuitID); return b.Connections == 0 }) {
		t.Fatal("a's old slot did not drain")
	}
}

// enforcing asserts the lifecycle invariants of svcConfig with svc forced
// open: its connects are rejected, those to the healthy port 8081 (served
// by the test) get through.
func (f *fixture) enforcing(step string) {
	f.t.Helper()
	if got := errnos(f.dial(8080, 2, 0)); got[unix.EHOSTUNREACH] != 2 {
		f.t.Fatalf("%s: the forced-open circuit: %v, want every connect rejected", step, got)
	}
	if got := errnos(f.dial(8081, 2, time.Second)); got[0] != 2 {
		f.t.Fatalf("%s: the healthy destination: %v, want every connect through", step, got)
	}
}

// readyz returns /readyz's status code and body, from the admin socket.
func (f *fixture) readyz() (int, string) {
	f.t.Helper()
	resp, err := unixClient(f.socket).Get("http://breakerd/readyz")
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

func (f *fixture) problemCount(p maps.Problem) float64 {
	return testutil.ToFloat64(f.d.metrics.groundProblems.WithLabelValues(string(p)))
}

// The pin directory removed, then the whole --bpffs directory: each is
// counted as pins removed (not as an unmounted bpffs), pinned again, and
// the lock still keeps a second daemon off. A pin replaced by another map
// makes /readyz fail with a log line that says it is not repaired and what
// to do; once the operator removes it, the daemon pins its own again.
func TestPinDirRemoved(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.srv.ServeHold(t, 8081)
	f.checkEvery = -1 // checks run by hand below
	f.start()
	if _, err := f.d.Force("svc", "open"); err != nil {
		t.Fatal(err)
	}
	f.enforcing("start")
	for i, dir := range []string{f.d.k.PinDir(), f.bpffs} {
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		f.d.checkGround(t.Context())
		if got, unmounted := f.problemCount(maps.PinsRemoved), f.problemCount(maps.BPFFSUnmounted); got != float64(i+1) || unmounted != 0 {
			t.Fatalf("%s removed: pins_removed counted %v times, bpffs_unmounted %v; want %d and 0", dir, got, unmounted, i+1)
		}
		if !f.ready() {
			t.Fatalf("%s removed: not ready after the repair:\n%s", dir, f.logs.String())
		}
		if lock, err := maps.LockDir(f.bpffs); !errors.Is(err, maps.ErrLocked) {
			lock.Close()
			t.Fatalf("%s removed and made again: LockDir %v, want ErrLocked", dir, err)
		}
		f.enforcing(dir + " removed and repaired")
	}
	if !strings.Contains(f.logs.String(), "the pin directory "+f.d.k.PinDir()+" was removed") {
		t.Fatalf("no log of the removed directory:\n%s", f.logs.String())
	}

	foreign, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer foreign.Close()
	verdicts := filepath.Join(f.d.k.PinDir(), "verdicts")
	if err := os.Remove(verdicts); err != nil {
		t.Fatal(err)
	}
	if err := foreign.Pin(verdicts); err != nil {
		t.Fatal(err)
	}
	f.d.checkGround(t.Context())
	if code, body := f.readyz(); code != http.StatusServiceUnavailable || !strings.Contains(body, "pins_removed") {
		t.Fatalf("readyz with a pin replaced: %d %s", code, body)
	}
	if line := grepLines(f.logs.String(), "replaced in"); !strings.Contains(line, "level=ERROR") || !strings.Contains(line, "never removes or repairs") || !strings.Contains(line, "rm "+verdicts) {
		t.Fatalf("the log line of a replaced pin does not say it is left and what to do: %q", line)
	}
	f.enforcing("a pin replaced (the daemon's handles hold the verdicts)")
	if err := os.Remove(verdicts); err != nil {
		t.Fatal(err)
	}
	f.d.checkGround(t.Context())
	if !f.ready() {
		t.Fatalf("not ready once the other map's pin is removed:\n%s", f.logs.String())
	}
	f.restart()
	f.enforcing("restart on the repaired pins")
}

// After an unmount of the bpffs holding the pins, over another bpffs, the
// daemon pins nothing on the one underneath (a mount again would hide
// those pins and their links): the unmount is logged once, counted as
// bpffs_unmounted, and /readyz says so until a bpffs is mounted there
// again, which gets the pins; a restart then adopts them.
func TestBPFFSUnmountedOverAnother(t *testing.T) {
	f := newFixture(t, svcConfig)
	f.srv.ServeHold(t, 8081)
	inner := kerneltest.MountBPFFS(t, kerneltest.MountBPFFS(t, t.TempDir()))
	f.bpffs = filepath.Join(inner, "breakerd")
	f.checkEvery = -1 // checks run by hand below
	f.start()
	if _, err := f.d.Force("svc", "open"); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unmount(inner, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		f.d.checkGround(t.Context())
	}
	if f.ready() {
		t.Fatal("ready with the pins' bpffs unmounted")
	}
	if got, removed := f.problemCount(maps.BPFFSUnmounted), f.problemCount(maps.PinsRemoved); got != 1 || removed != 0 {
		t.Fatalf("bpffs_unmounted counted %v times, pins_removed %v; want 1 and 0", got, removed)
	}
	if _, err := os.Lstat(f.bpffs); err == nil {
		t.Fatalf("pins made on the bpffs underneath %s", inner)
	}
	if code, body := f.readyz(); code != http.StatusServiceUnavailable || !strings.Contains(body, "bpffs_unmounted") {
		t.Fatalf("readyz with the bpffs unmounted: %d %s", code, body)
	}
	logs := f.logs.String()
	if !strings.Contains(grepLines(logs, "bpffs_unmounted"), "mount bpffs at "+inner+" again") || strings.Count(logs, "repairing protection") != 1 {
		t.Fatalf("want one problem line saying what to do and one repair error:\n%s", logs)
	}
	f.enforcing("unmounted (the daemon's handles hold the links)")

	if err := unix.Mount("bpffs", inner, "bpf", 0, ""); err != nil {
		t.Fatal(err)
	}
	f.d.checkGround(t.Context())
	if !f.ready() {
		t.Fatalf("not ready once a bpffs is mounted again where it was:\n%s", f.logs.String())
	}
	f.restart()
	f.enforcing("restart on the bpffs mounted again")
	if strings.Count(f.logs.String(), "adopted=true") != 1 {
		t.Fatalf("the restart did not adopt the pins:\n%s", f.logs.String())
	}
}
