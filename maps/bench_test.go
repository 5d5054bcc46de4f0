package maps

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// BenchmarkConnectCost measures the connect() system call alone (the
// socket is created before the clock starts and closed after it stops) from
// a client namespace to a listener on a test host, side by side in one run
// with interleaved rounds: no program; breakerd attached with an (almost)
// empty verdict map, with 100,000 entries and with a full one (MaxDestinations);
// with workloads selected, from a process of no workload and from a
// selected one (its cgroup in the workloads map); empty programs on the
// same hooks (the floor of a program call here), once with the callbacks
// every connect makes and once with breakerd's (see emptyPrograms); a connect
// rejected by breakerd; and one rejected by an nftables `reject with tcp
// reset` rule in the client's output hook. It reports medians and p99,
// measured with the kernel's BPF statistics off (as in production), and,
// from a second pass with them on, each program's own run time (connect4
// per call, sockops and sock_release per connection). A reader drains
// each ring buffer as the daemon does.
//
// Run it with scripts/bench (go test -bench ConnectCost
// -benchtime 1x ./maps); it prints the table BENCHMARKS.md records.
func BenchmarkConnectCost(b *testing.B) {
	kerneltest.RequireKernel(b)
	topo := kerneltest.NewTopology(b, 1)
	srv := topo.Servers[0]
	const healthy, breakerRejected, nftRejected = 7000, 7001, 7002
	srv.ServeHold(b, healthy)
	topo.Client.RejectOutgoing(b, nftRejected)
	// Two passes of every line's connects from one address to one port:
	// room for their TIME_WAIT sockets.
	if err := topo.Client.Sysctl("net/ipv4/ip_local_port_range", "1024 65000"); err != nil {
		b.Fatal(err)
	}

	type config struct {
		name    string
		cg      *kerneltest.Cgroup
		k       *Kernel
		port    uint16
		entries int
		want    unix.Errno
		// alsoOK is a second errno the line's connects may see (a
		// slow-start ramp turns some away); counted in also.
		alsoOK unix.Errno
		also   int
		nanos  []int64
		rounds []progRound // each round's program run times, from the statistics pass
		// noReset counts the nftables line's connects that got no reset
		// within the dial's 3 s (seen once in thousands: the reject's
		// reset lost); they are left out of its latencies, and shown.
		noReset int
		// stats reads the line's program statistics (k's programs
		// when nil).
		stats func() (map[string]*ebpf.ProgramStats, error)
	}
	load := func(entries int) (*kerneltest.Cgroup, *Kernel) {
		cg := kerneltest.NewCgroup(b)
		dir := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
		k, err := Load(Options{Dir: dir, Cgroup: cg.Path})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { k.Uninstall(); os.RemoveAll(dir) })
		if err := k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour}); err != nil {
			b.Fatal(err)
		}
		// Records are read as the daemon reads them (in batches, at
		// wake-ups or every 100 ms), so the ring never fills.
		rd, err := k.NewEventReader()
		if err != nil {
			b.Fatal(err)
		}
		drained := make(chan struct{})
		go func() {
			defer close(drained)
			batch := make([]Event, 2048)
			for {
				if _, err := rd.ReadBatch(batch, 100*time.Millisecond); errors.Is(err, ErrReaderClosed) {
					return
				}
			}
		}()
		b.Cleanup(func() { rd.Close(); <-drained })
		if entries > 0 {
			dests := make([]Dest, entries)
			for i := range dests {
				dests[i] = Dest{Proto: TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, byte(i >> 16), byte(i >> 8)}), uint16(1+i&0xff))}
			}
			if n, err := k.PutVerdicts(dests, Verdict{State: ForcedOpen}); err != nil || n != entries {
				b.Fatalf("filling %d verdicts: %d written: %v", entries, n, err)
			}
		}
		return cg, k
	}
	none := kerneltest.NewCgroup(b)
	cgEmpty, kEmpty := load(0)
	cg100k, k100k := load(100_000)
	cg1M, k1M := load(MaxDestinations)
	cgRej, kRej := load(0)
	cgBulk, kBulk := load(0)
	if err := kBulk.PutLimit(Dest{Proto: TCP, Addr: netip.AddrPortFrom(srv.IPv4, healthy)}, Limit{Slot: 1, MaxConnections: 1 << 20, MaxConnecting: 1 << 20}); err != nil {
		b.Fatal(err)
	}
	if err := kBulk.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		b.Fatal(err)
	}
	d := Dest{Proto: TCP, Addr: netip.AddrPortFrom(srv.IPv4, breakerRejected)}
	if err := kRej.PutVerdict(d, Verdict{State: ForcedOpen}); err != nil {
		b.Fatal(err)
	}
	// Workloads selected (#21): the programs at a parent cgroup, one
	// child in the workloads map and a sibling that is not. One kernel
	// side per line, so each line's program statistics are its own.
	scopedLoad := func(measureSelected bool) (*kerneltest.Cgroup, *Kernel) {
		parent, k := load(0)
		sel, unsel := parent.Child(b, "sel"), parent.Child(b, "unsel")
		id, err := sel.ID()
		if err != nil {
			b.Fatal(err)
		}
		if err := k.PutWorkload(id, 0, 0); err != nil {
			b.Fatal(err)
		}
		if err := k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Scoped: true}); err != nil {
			b.Fatal(err)
		}
		if measureSelected {
			return sel, k
		}
		return unsel, k
	}
	// Slow start (#36): a ramp in progress that admits 255 connects in
	// 256 (the verdict lookup, the share's interpolation and the atomic
	// add on every connect), and one that is over but not yet deleted
	// (the lookup and a comparison).
	healthyDest := Dest{Proto: TCP, Addr: netip.AddrPortFrom(srv.IPv4, healthy)}
	cgRamp, kRamp := load(0)
	ramping := Verdict{State: Ramp, Due: Now() - time.Second, RampLen: time.Hour, Errno: unix.EAGAIN, CircuitID: 1}
	for i := range ramping.Curve {
		ramping.Curve[i] = uint8(RampUnit - 1)
	}
	if err := kRamp.PutVerdict(healthyDest, ramping); err != nil {
		b.Fatal(err)
	}
	cgRampOver, kRampOver := load(0)
	over := ramping
	over.Due, over.RampLen = Now()-2*time.Second, time.Second
	if err := kRampOver.PutVerdict(healthyDest, over); err != nil {
		b.Fatal(err)
	}
	cgUnsel, kUnsel := scopedLoad(false)
	cgSel, kSel := scopedLoad(true)
	cgFloor, floor := emptyPrograms(b, false)
	cgFloor6, floor6 := emptyPrograms(b, true)
	configs := []*config{
		{name: "no program", cg: none, port: healthy},
		{name: "empty programs (connect4 and sockops returning at once)", cg: cgFloor, stats: floor, port: healthy},
		{name: "empty programs, breakerd's callbacks (sockops sets and clears its flags, nothing else)", cg: cgFloor6, stats: floor6, port: healthy},
		{name: "breakerd, empty map", cg: cgEmpty, k: kEmpty, port: healthy},
		{name: "breakerd, 100k entries", cg: cg100k, k: k100k, port: healthy, entries: 100_000},
		{name: "breakerd, full map (262,144 entries)", cg: cg1M, k: k1M, port: healthy, entries: MaxDestinations},
		{name: "breakerd, bulkhead set, not reached", cg: cgBulk, k: kBulk, port: healthy},
		{name: "breakerd, slow start ramping (255 in 256 admitted)", cg: cgRamp, k: kRamp, port: healthy, alsoOK: unix.EAGAIN},
		{name: "breakerd, slow start over, verdict not yet deleted", cg: cgRampOver, k: kRampOver, port: healthy},
		{name: "breakerd, workloads: unselected process", cg: cgUnsel, k: kUnsel, port: healthy},
		{name: "breakerd, workloads: selected process", cg: cgSel, k: kSel, port: healthy},
		{name: "rejected by breakerd", cg: cgRej, k: kRej, port: breakerRejected, want: unix.ECONNREFUSED},
		{name: "rejected by nftables", cg: none, port: nftRejected, want: unix.ECONNREFUSED},
	}
	rounds, perRound := 12, 200
	if testing.Short() {
		rounds, perRound = 2, 50
	}
	unanswered := func(c *config, x kerneltest.DialResult) bool {
		if c.port == nftRejected && x.Errno == unix.EINPROGRESS {
			c.noReset++
			return true
		}
		return false
	}
	rng := rand.New(rand.NewPCG(1, 2))
	// dialRounds runs every line's connects in interleaved rounds.
	dialRounds := func(each func(c *config, x kerneltest.DialResult)) {
		for r := 0; r < rounds; r++ {
			for _, i := range rng.Perm(len(configs)) {
				c := configs[i]
				for _, x := range topo.Client.Dial(b, c.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(srv.IPv4, c.port), Count: perRound}) {
					if unanswered(c, x) {
						continue
					}
					if c.alsoOK != 0 && x.Errno == c.alsoOK {
						c.also++
						continue
					}
					if x.Errno != c.want {
						b.Fatalf("%s: errno %v, want %v", c.name, x.Errno, c.want)
					}
					each(c, x)
				}
			}
		}
	}
	// The latencies, with the kernel's BPF statistics off as in
	// production (with them on, each program call also reads the clock
	// twice, which a connect with seven calls feels).
	statsOn := bpfStatsOn()
	dialRounds(func(c *config, x kerneltest.DialResult) { c.nanos = append(c.nanos, x.Nanos) })
	// Then the programs' own run times, from a second pass with the
	// statistics on, read before and after each line's round: each line
	// reports the median over its rounds of the round's mean, so a round
	// the host slowed down (these VMs share their cores) moves it little.
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatalf("enabling BPF stats: %v", err)
	}
	for _, c := range configs {
		if c.k != nil && c.stats == nil {
			c.stats = c.k.ProgramStats
		}
	}
	read := func(c *config) map[string]*ebpf.ProgramStats {
		st, err := c.stats()
		if err != nil {
			b.Fatal(err)
		}
		return st
	}
	for r := 0; r < rounds; r++ {
		for _, i := range rng.Perm(len(configs)) {
			c := configs[i]
			var before map[string]*ebpf.ProgramStats
			if c.stats != nil {
				before = read(c)
			}
			xs := topo.Client.Dial(b, c.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(srv.IPv4, c.port), Count: perRound})
			for _, x := range xs {
				if unanswered(c, x) || (c.alsoOK != 0 && x.Errno == c.alsoOK) {
					continue
				}
				if x.Errno != c.want {
					b.Fatalf("%s: errno %v, want %v", c.name, x.Errno, c.want)
				}
			}
			if c.stats != nil {
				c.rounds = append(c.rounds, progRoundOf(before, read(c), len(xs)))
			}
		}
	}
	stats.Close()

	base := median(configs[0].nanos)
	var out strings.Builder
	kv, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	fmt.Fprintf(&out, "kernel %s, %d rounds × %d connects per line, interleaved; latencies with BPF statistics %s; program run times from a second pass with them on, the median over the rounds of each round's mean\n\n", strings.TrimSpace(string(kv)), rounds, perRound, map[bool]string{false: "off", true: "on (another process had them on)"}[statsOn])
	fmt.Fprintf(&out, "| connect() to a listener over veth | median | p99 | median vs no program | connect4 run time per call | sockops run time per connection | sock_release per connection | all three per connection |\n|---|---|---|---|---|---|---|---|\n")
	for _, c := range configs {
		prog, obs, rel, total := "–", "–", "–", "–"
		if len(c.rounds) > 0 {
			med := func(f func(progRound) float64) float64 {
				xs := make([]float64, len(c.rounds))
				for i, r := range c.rounds {
					xs[i] = f(r)
				}
				slices.Sort(xs)
				return xs[len(xs)/2]
			}
			if n := med(func(r progRound) float64 { return r.connectRuns }); n > 0 {
				prog = fmt.Sprintf("%.0f ns", med(func(r progRound) float64 { return r.connect }))
			}
			// sockops runs several times per connection (connect,
			// established, state changes): its time per connection.
			if n := med(func(r progRound) float64 { return r.sockopsRuns }); n > 0 {
				obs = fmt.Sprintf("%.0f ns (%.1f runs)", med(func(r progRound) float64 { return r.sockops }), n)
			}
			if med(func(r progRound) float64 { return r.releaseRuns }) > 0 {
				rel = fmt.Sprintf("%.0f ns", med(func(r progRound) float64 { return r.release }))
			}
			total = fmt.Sprintf("%.0f ns", med(func(r progRound) float64 { return r.all }))
		}
		m := median(c.nanos)
		name := c.name
		if c.noReset > 0 {
			name += fmt.Sprintf(" (%d connects got no reset in 3 s, left out)", c.noReset)
		}
		if c.also > 0 {
			name += fmt.Sprintf(" (%d connects turned away with %v, left out)", c.also, c.alsoOK)
		}
		fmt.Fprintf(&out, "| %s | %.2f µs | %.2f µs | %.3f× | %s | %s | %s | %s |\n", name, float64(m)/1e3, float64(kerneltest.Percentile(c.nanos, 99))/1e3, float64(m)/float64(base), prog, obs, rel, total)
	}
	udpCost(b, topo, &out, none, cgEmpty, kEmpty, rounds, perRound, rng)
	b.Log("\n" + out.String())
	if path := os.Getenv("BREAKERD_BENCH_OUT"); path != "" {
		if err := os.WriteFile(path, []byte(out.String()), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	for _, c := range configs {
		if c.name == "rejected by breakerd" {
			b.ReportMetric(float64(median(c.nanos)), "reject-ns")
		}
	}
	b.ReportMetric(float64(base), "healthy-ns")
}

func median(xs []int64) int64 { return kerneltest.Percentile(xs, 50) }

// progRound is one round's program run times: connect4 per call, sockops
// and sock_release per connection and all three per connection, and how
// many times each ran per call or connection.
type progRound struct {
	connect, sockops, release, all        float64
	connectRuns, sockopsRuns, releaseRuns float64
}

// progRoundOf is the round between two readings of the programs'
// statistics, over conns connects.
func progRoundOf(before, after map[string]*ebpf.ProgramStats, conns int) progRound {
	d := func(name string) (time.Duration, float64) {
		a, b := after[name], before[name]
		if a == nil || b == nil {
			return 0, 0
		}
		return a.Runtime - b.Runtime, float64(a.RunCount - b.RunCount)
	}
	var r progRound
	ct, cn := d("connect4")
	st, sn := d("sockops")
	rt, rn := d("sock_release")
	if cn > 0 {
		r.connect = float64(ct.Nanoseconds()) / cn
	}
	r.connectRuns = cn / float64(conns)
	r.sockops, r.sockopsRuns = float64(st.Nanoseconds())/float64(conns), sn/float64(conns)
	r.release, r.releaseRuns = float64(rt.Nanoseconds())/float64(conns), rn/float64(conns)
	r.all = float64((ct + st + rt).Nanoseconds()) / float64(conns)
	return r
}

// emptyPrograms attaches kerneltest's empty programs (EmptyPrograms) at a
// cgroup of their own and returns it and a reader of the two programs'
// statistics (sock_release's empty: breakerd attaches it only with
// bulkheads).
func emptyPrograms(b *testing.B, callbacks bool) (*kerneltest.Cgroup, func() (map[string]*ebpf.ProgramStats, error)) {
	cg := kerneltest.NewCgroup(b)
	progs := kerneltest.EmptyPrograms(b, cg, callbacks)
	return cg, func() (map[string]*ebpf.ProgramStats, error) {
		out := map[string]*ebpf.ProgramStats{"sock_release": {}}
		for name, p := range progs {
			st, err := p.Stats()
			if err != nil {
				return nil, fmt.Errorf("reading stats of the empty %s: %w", name, err)
			}
			out[name] = st
		}
		return out, nil
	}
}

// bpfStatsOn reports whether the kernel keeps BPF run-time statistics now
// (kernel.bpf_stats_enabled, or a process holding them on).
func bpfStatsOn() bool {
	v, err := os.ReadFile("/proc/sys/kernel/bpf_stats_enabled")
	return err == nil && strings.TrimSpace(string(v)) != "0"
}

// udpCost adds the cost of an unconnected UDP datagram (sendto) to out:
// with no program, with breakerd attached and no target covering UDP (no
// verdict lookup), and with one that does (one lookup); sendmsg4's run
// time per call from the kernel's BPF statistics.
func udpCost(b *testing.B, topo *kerneltest.Topology, out *strings.Builder, none, cg *kerneltest.Cgroup, k *Kernel, rounds, perRound int, rng *rand.Rand) {
	const port = 7010
	topo.Servers[0].ListenPacket(b, "udp", port)
	cgUDP := kerneltest.NewCgroup(b)
	dir := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	kUDP, err := Load(Options{Dir: dir, Cgroup: cgUDP.Path})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { kUDP.Uninstall(); os.RemoveAll(dir) })
	if err := kUDP.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, UDP: true}); err != nil {
		b.Fatal(err)
	}
	type line struct {
		name  string
		cg    *kerneltest.Cgroup
		k     *Kernel
		run0  *ebpf.ProgramStats
		nanos []int64
	}
	lines := []*line{{name: "no program", cg: none}, {name: "breakerd, no target covers UDP", cg: cg, k: k}, {name: "breakerd, a target covers UDP", cg: cgUDP, k: kUDP}}
	dialRounds := func(each func(l *line, x kerneltest.DialResult)) {
		for range rounds {
			for _, i := range rng.Perm(len(lines)) {
				l := lines[i]
				for _, x := range topo.Client.Dial(b, l.cg, kerneltest.DialSpec{Network: "udp4", Op: "sendto", Addr: netip.AddrPortFrom(topo.Servers[0].IPv4, port), Count: perRound}) {
					if x.Errno != 0 {
						b.Fatalf("%s: sendto %v", l.name, x.Errno)
					}
					each(l, x)
				}
			}
		}
	}
	// Latencies with the statistics off, run times from a second pass
	// with them on (as for connect).
	dialRounds(func(l *line, x kerneltest.DialResult) { l.nanos = append(l.nanos, x.Nanos) })
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatalf("enabling BPF stats: %v", err)
	}
	defer stats.Close()
	for _, l := range lines {
		if l.k != nil {
			st, err := l.k.ProgramStats()
			if err != nil {
				b.Fatal(err)
			}
			l.run0 = st["sendmsg4"]
		}
	}
	dialRounds(func(*line, kerneltest.DialResult) {})
	base := median(lines[0].nanos)
	fmt.Fprintf(out, "\n| sendto() of one datagram | median | median vs no program | sendmsg4 run time per call |\n|---|---|---|---|\n")
	for _, l := range lines {
		prog := "–"
		if l.k != nil {
			st, err := l.k.ProgramStats()
			if err != nil {
				b.Fatal(err)
			}
			s := st["sendmsg4"]
			if n := s.RunCount - l.run0.RunCount; n > 0 {
				prog = fmt.Sprintf("%d ns (%d runs)", (s.Runtime-l.run0.Runtime).Nanoseconds()/int64(n), n)
			}
		}
		m := median(l.nanos)
		fmt.Fprintf(out, "| %s | %.2f µs | %.3f× | %s |\n", l.name, float64(m)/1e3, float64(m)/float64(base), prog)
	}
}

// BenchmarkReaderDrain fills the ring buffer with real records (refused
// connects from the test cgroup, nobody reading) and times how fast one
// EventReader drains and decodes them on one goroutine.
func BenchmarkReaderDrain(b *testing.B) {
	kerneltest.RequireKernel(b)
	cg := kerneltest.NewCgroup(b)
	topo := kerneltest.NewTopology(b, 1)
	dir := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	k, err := Load(Options{Dir: dir, Cgroup: cg.Path})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { k.Uninstall(); os.RemoveAll(dir) }()
	rd, err := k.NewEventReader()
	if err != nil {
		b.Fatal(err)
	}
	defer rd.Close()
	const n = 60000
	topo.Client.Dial(b, cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(topo.Servers[0].IPv4, 9), Count: n, Parallel: 2})
	var ev Event
	read := 0
	t0 := time.Now()
	for {
		rd.SetDeadline(time.Now().Add(100 * time.Millisecond))
		if err := rd.Read(&ev); err != nil {
			break
		}
		read++
	}
	el := time.Since(t0) - 100*time.Millisecond
	st, _ := k.Stats()
	b.Logf("drained %d records (lost %d) in %v: %.0f records/s on one goroutine", read, st.EventsLost, el, float64(read)/el.Seconds())
	b.ReportMetric(float64(read)/el.Seconds(), "records/s")
}
