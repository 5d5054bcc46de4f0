package maps

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// BenchmarkFallbackCost measures what fallbacks add to a healthy
// connection: connect() and then getpeername() (both timed) from a client
// namespace to a listener on a test host, in interleaved rounds of one
// run: no program; main's programs (the object BREAKERD_MAIN_OBJECT names,
// e.g. `git show main:bpf/breaker_x86_bpfel.o`, loaded unpinned, connect4
// and sockops attached: what main attaches without bulkheads); this
// branch's with no fallback written (the getpeername and recvmsg hooks
// not attached); and this branch's with a fallback written for another
// destination (they are). A last line times a connect an open circuit
// redirects to its fallback (a listener on the same host), for the cost of
// the redirect itself. From a second pass with the kernel's BPF
// statistics on: connect4, sockops and getpeername4 run time per
// connection (the median over the rounds of each round's mean).
//
//	git show main:bpf/breaker_x86_bpfel.o >/tmp/main.o
//	BREAKERD_MAIN_OBJECT=/tmp/main.o go test -run XXX -bench FallbackCost -benchtime 1x ./maps
func BenchmarkFallbackCost(b *testing.B) {
	kerneltest.RequireKernel(b)
	mainObj := os.Getenv("BREAKERD_MAIN_OBJECT")
	if mainObj == "" {
		b.Skip("BREAKERD_MAIN_OBJECT names no object of main to compare with")
	}
	topo := kerneltest.NewTopology(b, 1)
	srv := topo.Servers[0]
	const healthy, dead, fallback = 7100, 7101, 7102
	srv.ServeHold(b, healthy)
	srv.ServeHold(b, fallback)
	if err := topo.Client.Sysctl("net/ipv4/ip_local_port_range", "1024 65000"); err != nil {
		b.Fatal(err)
	}
	load := func() (*kerneltest.Cgroup, *Kernel) {
		cg := kerneltest.NewCgroup(b)
		pins := fmt.Sprintf("%s/%s", kerneltest.BPFFSRoot, kerneltest.UniqueName())
		k, err := Load(Options{Dir: pins, Cgroup: cg.Path})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { k.Uninstall(); os.RemoveAll(pins) })
		if err := k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour}); err != nil {
			b.Fatal(err)
		}
		return cg, k
	}
	cgPlain, kPlain := load()
	cgHooks, kHooks := load()
	other := Dest{Proto: TCP, Addr: netip.AddrPortFrom(netip.MustParseAddr("198.19.0.1"), 80)}
	if err := kHooks.PutFallback(1, Fallback{Addr: netip.AddrPortFrom(srv.IPv4, fallback), Proto: TCP, Epoch: 1}); err != nil {
		b.Fatal(err)
	}
	v := OpenVerdict(Now()+time.Hour, 1, 1, 0, 1)
	v.Epoch = 1
	if err := kHooks.PutVerdict(other, v); err != nil {
		b.Fatal(err)
	}
	cgRedir, kRedir := load()
	if err := kRedir.PutFallback(1, Fallback{Addr: netip.AddrPortFrom(srv.IPv4, fallback), Proto: TCP, Epoch: 1}); err != nil {
		b.Fatal(err)
	}
	if err := kRedir.PutVerdict(Dest{Proto: TCP, Addr: netip.AddrPortFrom(srv.IPv4, dead)}, v); err != nil {
		b.Fatal(err)
	}
	cgMain, mainStats := loadMainObject(b, mainObj)

	type line struct {
		name   string
		cg     *kerneltest.Cgroup
		port   uint16
		stats  func() (map[string]*ebpf.ProgramStats, error)
		nanos  []int64
		rounds [][4]float64 // per round, per connection: connect4, sockops, getpeername4, their sum
	}
	none := kerneltest.NewCgroup(b)
	lines := []*line{
		{name: "no program", cg: none, port: healthy},
		{name: "main's programs", cg: cgMain, port: healthy, stats: mainStats},
		{name: "branch, no fallback written (getpeername, recvmsg hooks not attached)", cg: cgPlain, port: healthy, stats: kPlain.ProgramStats},
		{name: "branch, a fallback written for another destination (hooks attached)", cg: cgHooks, port: healthy, stats: kHooks.ProgramStats},
		{name: "branch, redirected: an open circuit's connect sent to its fallback", cg: cgRedir, port: dead, stats: kRedir.ProgramStats},
	}
	rounds, perRound := 12, 200
	if testing.Short() {
		rounds, perRound = 2, 50
	}
	rng := rand.New(rand.NewPCG(3, 4))
	pass := func(each func(l *line, xs []kerneltest.DialResult)) {
		for range rounds {
			for _, i := range rng.Perm(len(lines)) {
				l := lines[i]
				xs := topo.Client.Dial(b, l.cg, kerneltest.DialSpec{Network: "tcp4", Op: "connect-peername", Addr: netip.AddrPortFrom(srv.IPv4, l.port), Count: perRound})
				for _, x := range xs {
					if x.Errno != 0 {
						b.Fatalf("%s: errno %v", l.name, x.Errno)
					}
				}
				each(l, xs)
			}
		}
	}
	statsOn := bpfStatsOn()
	pass(func(l *line, xs []kerneltest.DialResult) {
		for _, x := range xs {
			l.nanos = append(l.nanos, x.Nanos)
		}
	})
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatalf("enabling BPF stats: %v", err)
	}
	before := map[*line]map[string]*ebpf.ProgramStats{}
	read := func(l *line) map[string]*ebpf.ProgramStats {
		st, err := l.stats()
		if err != nil {
			b.Fatal(err)
		}
		return st
	}
	for _, l := range lines {
		if l.stats != nil {
			before[l] = read(l)
		}
	}
	pass(func(l *line, xs []kerneltest.DialResult) {
		if l.stats == nil {
			return
		}
		after := read(l)
		var r [4]float64
		for i, name := range []string{"connect4", "sockops", "getpeername4"} {
			if a, p := after[name], before[l][name]; a != nil && p != nil {
				r[i] = float64((a.Runtime - p.Runtime).Nanoseconds()) / float64(len(xs))
				r[3] += r[i]
			}
		}
		l.rounds = append(l.rounds, r)
		before[l] = after
	})
	stats.Close()

	base, mainMed := median(lines[0].nanos), median(lines[1].nanos)
	var mainRun float64
	var out strings.Builder
	kv, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	fmt.Fprintf(&out, "kernel %s, %d rounds × %d connects per line, interleaved; connect() + getpeername() timed together, with BPF statistics %s; program run times from a second pass with them on, the median over the rounds of each round's mean\n\n",
		strings.TrimSpace(string(kv)), rounds, perRound, map[bool]string{false: "off", true: "on (another process had them on)"}[statsOn])
	fmt.Fprintf(&out, "| connect() + getpeername() to a listener over veth | median | p99 | median vs no program | median vs main's | connect4 | sockops | getpeername4 | the three per connection | vs main's |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for i, l := range lines {
		cols := []string{"–", "–", "–", "–", "–"}
		if len(l.rounds) > 0 {
			var med [4]float64
			for j := range med {
				xs := make([]float64, len(l.rounds))
				for k, r := range l.rounds {
					xs[k] = r[j]
				}
				slices.Sort(xs)
				med[j] = xs[len(xs)/2]
				cols[j] = fmt.Sprintf("%.0f ns", med[j])
			}
			if i == 1 {
				mainRun = med[3]
			}
			if mainRun > 0 {
				cols[4] = fmt.Sprintf("%.3f×", med[3]/mainRun)
			}
		}
		m := median(l.nanos)
		fmt.Fprintf(&out, "| %s | %.2f µs | %.2f µs | %.3f× | %.3f× | %s |\n", l.name, float64(m)/1e3, float64(kerneltest.Percentile(l.nanos, 99))/1e3,
			float64(m)/float64(base), float64(m)/float64(mainMed), strings.Join(cols, " | "))
	}
	b.Log("\n" + out.String())
	if path := os.Getenv("BREAKERD_BENCH_OUT"); path != "" {
		if err := os.WriteFile(path, []byte(out.String()), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}

// loadMainObject loads another build's object (main's) unpinned and
// attaches its connect4 and sockops programs at a cgroup of their own; it
// returns the cgroup and a reader of the two programs' statistics.
func loadMainObject(b *testing.B, path string) (*kerneltest.Cgroup, func() (map[string]*ebpf.ProgramStats, error)) {
	spec, err := ebpf.LoadCollectionSpec(path)
	if err != nil {
		b.Fatalf("main's object: %v", err)
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinNone
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		b.Fatalf("loading main's object: %v", err)
	}
	b.Cleanup(func() { coll.Close() })
	cg := kerneltest.NewCgroup(b)
	progs := map[string]*ebpf.Program{"connect4": coll.Programs["connect4"], "sockops": coll.Programs["observe"]}
	for name, attach := range map[string]ebpf.AttachType{"connect4": ebpf.AttachCGroupInet4Connect, "sockops": ebpf.AttachCGroupSockOps} {
		if progs[name] == nil {
			b.Fatalf("main's object has no %s program", name)
		}
		l, err := link.AttachCgroup(link.CgroupOptions{Path: cg.Path, Attach: attach, Program: progs[name]})
		if err != nil {
			b.Fatalf("attaching main's %s: %v", name, err)
		}
		b.Cleanup(func() { l.Close() })
	}
	return cg, func() (map[string]*ebpf.ProgramStats, error) {
		out := map[string]*ebpf.ProgramStats{}
		for name, p := range progs {
			st, err := p.Stats()
			if err != nil {
				return nil, err
			}
			out[name] = st
		}
		return out, nil
	}
}
