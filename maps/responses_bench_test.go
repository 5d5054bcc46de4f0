package maps

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// BenchmarkResponsePrograms measures the response programs' run time per
// packet (BPF run-time statistics) for sockets they do not follow and for
// sockets they follow with each set of options (timing; and the HTTP
// status; and response_timeout; the last two also with their ordinary
// successes counted in the kernel, RespBatch, as breakerd does for a
// target with the default failure statuses), with the
// same keep-alive client and server: Go's net/http making small requests
// over one connection. Run it alone (-bench ResponsePrograms -benchtime 1x);
// BREAKERD_BENCH_OUT writes the table to a file.
func BenchmarkResponsePrograms(b *testing.B) {
	e := newEnv(b, Options{Responses: true})
	e.watch(b) // a reader, as the daemon is: the ring never fills
	// One port per line: a socket is followed with the options of its
	// destination's limits entry. 8086 has none (the port is in no
	// followed socket's bit of resp_ports); 8085 over IPv6 has none either,
	// but it is measured after the followed IPv4 line on 8085, whose
	// connect set the port's bit, so its packets pay the storage lookup
	// that finds nothing (checked before it is measured).
	type line struct {
		name string
		dest Dest
		resp ResponseFlags
		// portFollowed: a followed socket on another line has set the
		// port's bit in resp_ports (checked before the line runs).
		portFollowed bool
	}
	lines := []line{
		{"not followed, a port no followed socket uses", e.dest(8086, false), 0, false},
		{"followed: timing", e.dest(8087, false), RespTimed, false},
		{"followed: timing, protocol: http", e.dest(8088, false), RespTimed | RespHTTP, false},
		{"followed: timing, protocol: http, response_timeout", e.dest(8085, false), RespTimed | RespHTTP | RespInflight, false},
		{"followed: timing, protocol: http, successes counted in the kernel", e.dest(8089, false), RespTimed | RespHTTP | RespBatch, false},
		{"followed: timing, protocol: http, response_timeout, successes counted in the kernel", e.dest(8084, false), RespTimed | RespHTTP | RespInflight | RespBatch, false},
		{"not followed, a port a followed socket uses", e.dest(8085, true), 0, true},
	}
	for _, port := range []uint16{8084, 8085, 8086, 8087, 8088, 8089} {
		e.srv.ServeHTTPCases(b, port)
	}
	for i, l := range lines {
		if l.resp != 0 {
			lim := Limit{Slot: uint32(7 + i), Responses: l.resp}
			if l.resp&RespBatch != 0 {
				// Counted under the circuit id of the slot, every 404 an
				// ordinary success (none near the bound).
				lim.BatchID, lim.BatchEpoch, lim.FastBound = lim.Slot, 1, time.Second
				if err := e.k.SetAnswered(lim.BatchID, lim.BatchEpoch); err != nil {
					b.Fatal(err)
				}
			}
			if err := e.k.PutLimit(l.dest, lim); err != nil {
				b.Fatal(err)
			}
		}
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		b.Fatal(err)
	}
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatalf("enabling BPF stats: %v", err)
	}
	defer stats.Close()
	const requests = 3000
	// An empty program on each hook, beside breakerd's, sees the same
	// packets: the floor of a program call measured this way on this host.
	empty := map[string]*ebpf.Program{}
	for _, h := range []struct {
		name   string
		attach ebpf.AttachType
	}{{"empty_egress", ebpf.AttachCGroupInetEgress}, {"empty_ingress", ebpf.AttachCGroupInetIngress}} {
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.CGroupSKB, AttachType: h.attach, License: "GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}})
		if err != nil {
			b.Fatalf("loading %s: %v", h.name, err)
		}
		defer prog.Close()
		l, err := link.AttachCgroup(link.CgroupOptions{Path: e.cg.Path, Attach: h.attach, Program: prog})
		if err != nil {
			b.Fatalf("attaching %s: %v", h.name, err)
		}
		defer l.Close()
		empty[h.name] = prog
	}
	snapshot := func() map[string]*ebpf.ProgramStats {
		st, err := e.k.ProgramStats()
		if err != nil {
			b.Fatal(err)
		}
		for name, p := range empty {
			if st[name], err = p.Stats(); err != nil {
				b.Fatal(err)
			}
		}
		return st
	}
	measure := func(dest Dest) (egress, ingress, emptyEgress, emptyIngress string) {
		before := snapshot()
		for _, r := range e.topo.Client.Dial(b, e.cg, kerneltest.DialSpec{Op: "keepalive", Addr: dest.Addr, Timeout: 5 * time.Second, Count: requests, Requests: []kerneltest.HTTPRequest{{Path: "/404"}}}) {
			if r.Errno != 0 || r.Status != 404 {
				b.Fatalf("request: %+v", r)
			}
		}
		after := snapshot()
		per := func(name string) string {
			n := after[name].RunCount - before[name].RunCount
			if n == 0 {
				return "no runs"
			}
			return fmt.Sprintf("%d ns (%d packets)", (after[name].Runtime-before[name].Runtime).Nanoseconds()/int64(n), n)
		}
		return per("resp_egress"), per("resp_ingress"), per("empty_egress"), per("empty_ingress")
	}
	b.ResetTimer()
	var out strings.Builder
	kv, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	fmt.Fprintf(&out, "kernel %s; %d keep-alive requests per line (Go net/http, one connection, 404 answers)\n\n", strings.TrimSpace(string(kv)), requests)
	fmt.Fprintf(&out, "| socket | resp_egress per packet | resp_ingress per packet | an empty program beside it, egress | ingress |\n|---|---|---|---|---|\n")
	for _, l := range lines {
		if l.portFollowed {
			if ports, err := e.k.RespPorts(); err != nil || !slices.Contains(ports, l.dest.Addr.Port()) {
				b.Fatalf("%s: port %d is not in resp_ports (%v, %v)", l.name, l.dest.Addr.Port(), ports, err)
			}
		}
		eg, in, eeg, ein := measure(l.dest)
		fmt.Fprintf(&out, "| %s | %s | %s | %s | %s |\n", l.name, eg, in, eeg, ein)
	}
	b.Log("\n" + out.String())
	if path := os.Getenv("BREAKERD_BENCH_OUT"); path != "" {
		if err := os.WriteFile(path, []byte(out.String()), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}
