package maps

import (
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

func TestMain(m *testing.M) {
	ShareKernelBTF()
	kerneltest.Main(m)
}

type env struct {
	k    *Kernel
	cg   *kerneltest.Cgroup
	topo *kerneltest.Topology
	srv  *kerneltest.Host
	opts Options
}

func newEnv(t testing.TB, opts Options) *env {
	t.Helper()
	return newEnvHosts(t, opts, 1)
}

// newEnvHosts is newEnv with n server hosts (e.srv is the first).
func newEnvHosts(t testing.TB, opts Options, n int) *env {
	t.Helper()
	kerneltest.RequireKernel(t)
	e := &env{cg: kerneltest.NewCgroup(t), topo: kerneltest.NewTopology(t, n)}
	e.srv = e.topo.Servers[0]
	if opts.Dir == "" {
		opts.Dir = filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	}
	opts.Cgroup = e.cg.Path
	e.opts = opts
	t.Cleanup(func() { os.RemoveAll(opts.Dir) })
	e.k = e.load(t)
	t.Cleanup(func() {
		if err := e.k.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour}); err != nil {
		t.Fatal(err)
	}
	e.srv.StartCounting(t)
	return e
}

func (e *env) load(t testing.TB) *Kernel {
	t.Helper()
	k, err := Load(e.opts)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	return k
}

func (e *env) dial(t *testing.T, cg *kerneltest.Cgroup, spec kerneltest.DialSpec) []kerneltest.DialResult {
	t.Helper()
	return e.topo.Client.Dial(t, cg, spec)
}

func (e *env) dest(port uint16, v6 bool) Dest {
	a := e.srv.IPv4
	if v6 {
		a = e.srv.IPv6
	}
	return Dest{Proto: TCP, Addr: netip.AddrPortFrom(a, port)}
}

func errnos(rs []kerneltest.DialResult) map[unix.Errno]int {
	m := map[unix.Errno]int{}
	for _, r := range rs {
		m[r.Errno]++
	}
	return m
}

const farFuture = time.Hour * 24

func TestOpenCircuitRejectsBeforeAnyPacket(t *testing.T) {
	e := newEnv(t, Options{})
	if !e.k.Features().SetRetval {
		if kerneltest.InCI() {
			t.Fatal("this kernel has no bpf_set_retval; the errno tests need it")
		}
		t.Skip("no bpf_set_retval: rejections are EPERM")
	}
	e.srv.ServeHold(t, 8080)
	cases := []struct {
		name    string
		network string
		v6      bool
		errno   syscall.Errno
	}{
		{"ipv4", "tcp4", false, 0},
		{"ipv4 configured errno", "tcp4", false, unix.ETIMEDOUT},
		{"ipv6", "tcp6", true, 0},
		{"dual-stack socket to ipv4", "tcp6", false, unix.EHOSTUNREACH},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := e.dest(8080, c.v6)
			if err := e.k.PutVerdict(d, OpenVerdict(Now()+farFuture, 1, 1, c.errno, uint32(i+1))); err != nil {
				t.Fatal(err)
			}
			defer e.k.DeleteVerdict(d)
			want := c.errno
			if want == 0 {
				want = unix.ECONNREFUSED
			}
			before := e.srv.SYNs(t)
			res := e.dial(t, e.cg, kerneltest.DialSpec{Network: c.network, Addr: d.Addr, Count: 5})
			if got := errnos(res); got[want] != 5 {
				t.Fatalf("errnos %v, want 5 × %v", got, want)
			}
			if n := e.srv.SYNs(t) - before; n != 0 {
				t.Fatalf("%d SYNs reached the server of an open circuit", n)
			}
			cnt, err := e.k.Counters(uint32(i + 1))
			if err != nil {
				t.Fatal(err)
			}
			if cnt.Rejected != 5 {
				t.Fatalf("rejected counter %d, want 5", cnt.Rejected)
			}
			// Closed again: the same client gets through.
			if err := e.k.DeleteVerdict(d); err != nil {
				t.Fatal(err)
			}
			if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: c.network, Addr: d.Addr})); got[0] != 1 {
				t.Fatalf("after delete: errnos %v, want success", got)
			}
		})
	}
}

func TestUDPRejected(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ListenPacket(t, "udp", 5353)
	d := Dest{Proto: UDP, Addr: netip.AddrPortFrom(e.srv.IPv4, 5353)}
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 9}); err != nil {
		t.Fatal(err)
	}
	// Without the UDP flag (no target covers UDP) datagrams are not
	// looked up at all: the verdict is not seen.
	if res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "udp4", Addr: d.Addr, Op: "sendto"}); res[0].Errno != 0 {
		t.Fatalf("UDP flag off: sendto %v, want success", res[0].Errno)
	}
	if !kerneltest.WaitFor(time.Second, func() bool { return e.srv.UDPDatagrams(t) == 1 }) {
		t.Fatalf("UDP flag off: datagram not counted: %d", e.srv.UDPDatagrams(t))
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, UDP: true}); err != nil {
		t.Fatal(err)
	}
	want := unix.ECONNREFUSED
	if !e.k.Features().SetRetval {
		want = unix.EPERM
	}
	for _, op := range []string{"sendto", "connect"} {
		for _, network := range []string{"udp4", "udp6"} {
			res := e.dial(t, e.cg, kerneltest.DialSpec{Network: network, Addr: d.Addr, Op: op, Count: 3})
			if got := errnos(res); got[want] != 3 {
				t.Errorf("%s %s: errnos %v, want 3 × %v", op, network, got, want)
			}
		}
	}
	if n := e.srv.UDPDatagrams(t); n != 1 {
		t.Fatalf("%d datagrams reached a forced-open UDP destination", n-1)
	}
	// A datagram to another port of the same host goes through.
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "udp4", Addr: netip.AddrPortFrom(e.srv.IPv4, 5354), Op: "sendto"})
	if res[0].Errno != 0 {
		t.Fatalf("unrelated datagram: %v", res[0].Errno)
	}
	if !kerneltest.WaitFor(time.Second, func() bool { return e.srv.UDPDatagrams(t) == 2 }) {
		t.Fatalf("unrelated datagram not counted: %d", e.srv.UDPDatagrams(t)-1)
	}
}

func TestExactlyNProbesWhenManyRace(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8081)
	const probes, racers = 3, 64
	d := e.dest(8081, false)
	v := OpenVerdict(Now()-time.Millisecond, 1, probes, 0, 7)
	if err := e.k.PutVerdict(d, v); err != nil {
		t.Fatal(err)
	}
	before := e.srv.SYNs(t)
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: racers, Parallel: racers, Barrier: true, Hold: 100 * time.Millisecond})
	got := errnos(res)
	if got[0] != probes {
		t.Fatalf("%d connects got through (errnos %v), want exactly %d probes", got[0], got, probes)
	}
	if n := e.srv.SYNs(t) - before; n != probes {
		t.Fatalf("%d SYNs reached the server, want %d", n, probes)
	}
	if b, err := e.k.Budget(7); err != nil || b != (Budget{Round: 1, Tokens: 0}) {
		t.Fatalf("budget after the race: %+v %v, want round 1 with no tokens left", b, err)
	}
	cnt, _ := e.k.Counters(7)
	if cnt.Probes != probes || cnt.Rejected != racers-probes || cnt.Rounds != 1 {
		t.Fatalf("counters %+v, want %d probes, %d rejected, 1 round", cnt, probes, racers-probes)
	}
	// Without a new round nothing more gets through, however long.
	time.Sleep(100 * time.Millisecond)
	if res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr}); res[0].Errno == 0 {
		t.Fatal("a connect got through with no token left")
	}
}

// TestReissuedRoundsAreExact races many threads connecting to a half-open
// destination while the daemon's side writes new rounds: every round
// admits exactly `probes` connections (counted at the server and by the
// rounds the probes' outcome records carry), never more, however the
// connects interleave with the re-issue.
func TestReissuedRoundsAreExact(t *testing.T) {
	e := newEnv(t, Options{})
	w := e.watch(t)
	e.srv.ServeHold(t, 8084)
	const probes, rounds = 2, 100
	d := e.dest(8084, false)
	// A second destination of the same circuit (service scope) shares the
	// budget: together they admit `probes` per round, not twice that.
	d2 := e.dest(8085, false)
	e.srv.ServeHold(t, 8085)
	before := e.srv.SYNs(t)
	for _, dst := range []Dest{d, d2} {
		if err := e.k.PutVerdict(dst, OpenVerdict(Now()+time.Hour, 1, probes, 0, 12)); err != nil {
			t.Fatal(err)
		}
	}
	// 32 clients connect in a tight loop from the protected cgroup for the
	// whole test, to both destinations, so connects race each round's
	// first take. (The earlier exchange-and-give-back shape let 212 to 215
	// probes through in 100 rounds of 2 here.)
	var clients []*kerneltest.Process
	for _, dst := range []Dest{d, d2} {
		clients = append(clients, e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst.Addr, Count: 1 << 20, Parallel: 16}))
	}
	for r := uint32(1); r <= rounds; r++ {
		// The daemon's side: a new round, written while the clients race.
		for _, dst := range []Dest{d, d2} {
			if err := e.k.PutVerdict(dst, OpenVerdict(Now()-time.Millisecond, r, probes, 0, 12)); err != nil {
				t.Fatal(err)
			}
		}
		// A positive signal, so the bound is generous: the first round
		// also waits for the clients to start, which two emulated guests
		// side by side on two cores take seconds to do.
		if !kerneltest.WaitFor(20*time.Second, func() bool { b, _ := e.k.Budget(12); return b.Round == r && b.Tokens == 0 }) {
			b, _ := e.k.Budget(12)
			t.Fatalf("round %d not used up: %+v (did the clients run out of connects?)", r, b)
		}
	}
	for _, dst := range []Dest{d, d2} {
		if err := e.k.PutVerdict(dst, Verdict{State: ForcedOpen, CircuitID: 12}); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range clients {
		_ = c.Cmd.Process.Kill()
		_ = c.Cmd.Wait()
	}
	// Read after the clients' last records; its SYN is not a probe's.
	w.sentinel(t, e, e.cg, 9198)
	if n := e.srv.SYNs(t) - before - 1; n != probes*rounds {
		t.Fatalf("%d SYNs reached the server over %d rounds, want exactly %d", n, rounds, probes*rounds)
	}
	perRound := map[uint32]int{}
	began := map[uint32]int{}
	for _, p := range []uint16{8084, 8085} {
		for _, ev := range w.wait(p, 0, 0) {
			switch {
			case ev.Outcome == ProbeRound:
				began[ev.Round]++
			case ev.Outcome == Established && ev.Probe:
				perRound[ev.Round]++
			}
		}
	}
	for r := uint32(1); r <= rounds; r++ {
		if perRound[r] != probes || began[r] != 1 {
			t.Fatalf("round %d: %d probes established, %d round records (all rounds %v, records %v); want %d and 1", r, perRound[r], began[r], perRound, began, probes)
		}
	}
	if cnt, _ := e.k.Counters(12); cnt.Probes != probes*rounds || cnt.Rounds != rounds {
		t.Fatalf("counters %+v", cnt)
	}
}

// UDP never takes a probe token: while half-open, a datagram is rejected
// and the circuit's TCP probes keep their budget.
func TestUDPNeverProbes(t *testing.T) {
	e := newEnv(t, Options{})
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, UDP: true}); err != nil {
		t.Fatal(err)
	}
	e.srv.ServeHold(t, 5360)
	tcp, udp := e.dest(5360, false), e.dest(5360, false)
	udp.Proto = UDP
	for _, dst := range []Dest{tcp, udp} {
		if err := e.k.PutVerdict(dst, OpenVerdict(Now()-time.Millisecond, 1, 1, 0, 13)); err != nil {
			t.Fatal(err)
		}
	}
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "udp4", Addr: udp.Addr, Op: "sendto", Count: 5})
	if got := errnos(res); got[0] != 0 {
		t.Fatalf("a datagram to a half-open destination got through: %v", got)
	}
	if b, _ := e.k.Budget(13); b.Round != 0 {
		t.Fatalf("UDP began a round: %+v", b)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: tcp.Addr, Count: 2})); got[0] != 1 {
		t.Fatalf("TCP probes after the datagrams: %v, want exactly one through", got)
	}
}

func TestForcedOpenNeverProbes(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8082)
	d := e.dest(8082, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, Due: 1, Round: 1, Probes: 5, CircuitID: 3}); err != nil {
		t.Fatal(err)
	}
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 20, Parallel: 4})
	if got := errnos(res); got[0] != 0 {
		t.Fatalf("forced open let %d through", got[0])
	}
	if n := e.srv.SYNs(t); n != 0 {
		t.Fatalf("%d SYNs reached a forced-open destination", n)
	}
}

func TestShadowModeRejectsNothing(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8083)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Shadow: true}); err != nil {
		t.Fatal(err)
	}
	d := e.dest(8083, false)
	if err := e.k.PutVerdict(d, OpenVerdict(Now()+farFuture, 1, 1, 0, 4)); err != nil {
		t.Fatal(err)
	}
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 6})
	if got := errnos(res); got[0] != 6 {
		t.Fatalf("shadow mode: errnos %v, want 6 successes", got)
	}
	cnt, _ := e.k.Counters(4)
	if cnt.ShadowRejected != 6 || cnt.Rejected != 0 {
		t.Fatalf("counters %+v, want 6 shadow rejections and no rejection", cnt)
	}
}

func TestStaleHeartbeatFailsOpen(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8084)
	d := e.dest(8084, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen, CircuitID: 5}); err != nil {
		t.Fatal(err)
	}
	if res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr}); res[0].Errno == 0 {
		t.Fatal("fresh heartbeat: connect not rejected")
	}
	// The daemon "died" 2 s ago with a 1 s fail-safe.
	if err := e.k.SetSettings(Settings{Heartbeat: Now() - 2*time.Second, FailSafe: time.Second}); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})); got[0] != 3 {
		t.Fatalf("stale heartbeat: errnos %v, want 3 successes", got)
	}
	st, err := e.k.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.FailsafeAllowed < 3 {
		t.Fatalf("failsafe_allowed %d, want 3", st.FailsafeAllowed)
	}
	// A heartbeat from the future (a clock mix-up) is not trusted either.
	if err := e.k.SetSettings(Settings{Heartbeat: Now() + time.Hour, FailSafe: time.Second}); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[0] != 1 {
		t.Fatalf("heartbeat from the future: errnos %v, want success", got)
	}
	// Never written (a fresh load): also open.
	if err := e.k.SetSettings(Settings{}); err != nil {
		t.Fatal(err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[0] != 1 {
		t.Fatalf("no heartbeat ever: errnos %v, want success", got)
	}
}

func TestFullVerdictMapBlocksNothingElse(t *testing.T) {
	e := newEnv(t, Options{MaxVerdicts: 16})
	e.srv.ServeHold(t, 8085)
	var err error
	for i := 0; err == nil && i < 100; i++ {
		err = e.k.PutVerdict(Dest{Proto: TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, 0, byte(i)}), 80)}, Verdict{State: ForcedOpen})
	}
	if !errors.Is(err, ErrVerdictsFull) {
		t.Fatalf("filling the map: %v, want ErrVerdictsFull", err)
	}
	d := e.dest(8085, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen}); !errors.Is(err, ErrVerdictsFull) {
		t.Fatalf("put into a full map: %v", err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})); got[0] != 3 {
		t.Fatalf("full map: errnos %v, want 3 successes", got)
	}
}

func TestProcessOutsideCgroupUnaffected(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8086)
	d := e.dest(8086, false)
	if err := e.k.PutVerdict(d, Verdict{State: ForcedOpen}); err != nil {
		t.Fatal(err)
	}
	// Same namespace, but born outside the test cgroup.
	if got := errnos(e.dial(t, nil, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})); got[0] != 3 {
		t.Fatalf("outside the cgroup: errnos %v, want 3 successes", got)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[0] != 0 {
		t.Fatalf("inside the cgroup: errnos %v, want a rejection", got)
	}
}

func TestBpftoolShowsNamedFields(t *testing.T) {
	e := newEnv(t, Options{})
	if _, err := exec.LookPath("bpftool"); err != nil {
		t.Fatalf("bpftool not installed (scripts/setup installs it): %v", err)
	}
	d := e.dest(443, false)
	if err := e.k.PutVerdict(d, OpenVerdict(12345, 7, 2, unix.ECONNREFUSED, 42)); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("bpftool", "map", "dump", "pinned", filepath.Join(e.k.PinDir(), "verdicts"), "-j").Output()
	if err != nil {
		t.Fatalf("bpftool: %v", err)
	}
	var dump []struct {
		Formatted struct {
			Key struct {
				Addr  []any `json:"addr"`
				Port  int   `json:"port"`
				Proto int   `json:"proto"`
			} `json:"key"`
			Value struct {
				DueNs       uint64 `json:"due_ns"`
				State       int    `json:"state"`
				Round       int    `json:"round"`
				Probes      int    `json:"probes"`
				CircuitID   int    `json:"circuit_id"`
				RejectErrno int    `json:"reject_errno"`
			} `json:"value"`
		} `json:"formatted"`
	}
	if err := json.Unmarshal(out, &dump); err != nil {
		t.Fatalf("parsing bpftool output: %v\n%s", err, out)
	}
	if len(dump) != 1 {
		t.Fatalf("%d entries in the dump, want 1:\n%s", len(dump), out)
	}
	f := dump[0].Formatted
	if f.Value.DueNs != 12345 || f.Value.State != int(Open) || f.Value.Round != 7 || f.Value.Probes != 2 || f.Value.CircuitID != 42 || f.Value.RejectErrno != int(unix.ECONNREFUSED) {
		t.Fatalf("dumped value %+v", f.Value)
	}
	if f.Key.Proto != int(TCP) || len(f.Key.Addr) != 16 || f.Key.Port != int(htons(443)) {
		t.Fatalf("dumped key %+v", f.Key)
	}
}

func TestReloadAdoptsPinsWithoutGap(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 8087)
	d := e.dest(8087, false)
	if err := e.k.PutVerdict(d, OpenVerdict(Now()+farFuture, 1, 1, 0, 8)); err != nil {
		t.Fatal(err)
	}
	// Two clients hammer the open destination, back to back, while the
	// first daemon goes away (its pinned links stay) and a second one
	// loads, adopts the pins and swaps its programs into the links, and
	// for thousands of connects after. (The pin directory's lock allows
	// one at a time.)
	h := e.topo.Client.StartHammer(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr}, 2)
	if !h.Await(500, 30*time.Second) {
		t.Fatal("the clients did not connect 500 times each before the reload")
	}
	if err := e.k.Close(); err != nil {
		t.Fatal(err)
	}
	e.k = e.load(t)
	// A second or so of connects after it on the host; a few seconds'
	// worth in the emulated guest.
	after := 50000
	if kerneltest.Emulated() {
		after = 5000
	}
	if !h.Await(after, time.Minute) {
		t.Fatalf("the clients did not connect %d times each after the reload", after)
	}
	if got := h.Stop(t); got[0] != 0 {
		t.Fatalf("%d connects got through while breakerd reloaded (errnos %v)", got[0], got)
	}
	if v, ok, err := e.k.Verdict(d); err != nil || !ok || v.State != Open {
		t.Fatalf("adopted verdict: %+v %v %v", v, ok, err)
	}
	if got := errnos(e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})); got[0] != 0 {
		t.Fatal("the adopted program does not enforce")
	}
	if p := e.k.Check(); p != nil {
		t.Fatalf("after adoption: %v", p)
	}
}

func TestOtherLayoutVersionsAreRemoved(t *testing.T) {
	kerneltest.RequireKernel(t)
	cg := kerneltest.NewCgroup(t)
	dir := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(dir) })
	// An "older release" left pins in v0 (an empty map stands in for them).
	old, err := Load(Options{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(old.PinDir(), filepath.Join(dir, "v0")); err != nil {
		t.Fatal(err)
	}
	old.Close()
	// Someone else's directory named like a layout, with a pin in it.
	foreign := filepath.Join(dir, "v9")
	if err := os.Mkdir(foreign, 0o700); err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Pin(filepath.Join(foreign, "theirs")); err != nil {
		t.Fatal(err)
	}
	m.Close()
	k, err := Load(Options{Dir: dir, Cgroup: cg.Path})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Uninstall()
	if _, err := os.Stat(filepath.Join(dir, "v0")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the v0 pins are still there: %v", err)
	}
	if _, err := os.Stat(filepath.Join(k.PinDir(), "link_connect4")); err != nil {
		t.Fatalf("new link not pinned: %v", err)
	}
	if _, err := os.Stat(filepath.Join(foreign, "theirs")); err != nil {
		t.Fatalf("a directory breakerd did not make was touched: %v", err)
	}
}

// TestEveryProgramPassesTheVerifier loads each program on its own, so a
// kernel that refuses one says which, with the verifier's log. It logs
// the instructions the verifier processed for each and how long the load
// took: every collection load pays them, and under emulation (the CI's
// 6.1 and 6.12 VMs) they are most of the kernel suites' time.
func TestEveryProgramPassesTheVerifier(t *testing.T) {
	kerneltest.RequireKernel(t)
	spec, err := bpf.LoadBreaker()
	if err != nil {
		t.Fatal(err)
	}
	f := ProbeFeatures()
	// scripts/vmtest collects this line into the compatibility table.
	t.Logf("features: set_retval=%v", f.SetRetval)
	if err := setFeatureVars(spec, f); err != nil {
		t.Fatal(err)
	}
	var total uint32
	for name, ps := range spec.Programs {
		coll := spec.Copy()
		for other := range coll.Programs {
			if other != name {
				delete(coll.Programs, other)
			}
		}
		for m := range coll.Maps {
			coll.Maps[m].Pinning = ebpf.PinNone
		}
		start := time.Now()
		c, err := ebpf.NewCollection(coll)
		took := time.Since(start)
		if err != nil {
			// Again with the whole log, which a first load without one
			// does not pay for.
			if c, err2 := ebpf.NewCollectionWithOptions(coll, ebpf.CollectionOptions{Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelInstruction}}); err2 != nil {
				err = err2
			} else {
				c.Close()
			}
			var ve *ebpf.VerifierError
			if errors.As(err, &ve) {
				t.Errorf("%s (%s): %+v", name, ps.SectionName, ve)
			} else {
				t.Errorf("%s (%s): %v", name, ps.SectionName, err)
			}
			continue
		}
		info, err := c.Programs[name].Info()
		if err != nil {
			t.Errorf("%s: reading its info: %v", name, err)
		} else if n, ok := info.VerifiedInstructions(); ok {
			total += n
			t.Logf("verified %s: %d instructions, loaded in %v", name, n, took.Round(time.Millisecond))
		}
		c.Close()
	}
	t.Logf("verified in all: %d instructions", total)
}
