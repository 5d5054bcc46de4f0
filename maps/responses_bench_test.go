package maps

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// BenchmarkResponsePrograms measures the response programs' run time per
// packet (BPF run-time statistics) for sockets they do not follow and for
// sockets they follow (timing, HTTP status and response_timeout), with the
// same keep-alive client and server: Go's net/http making small requests
// over one connection. Run it alone (-bench ResponsePrograms -benchtime 1x);
// BREAKERD_BENCH_OUT writes the table to a file.
func BenchmarkResponsePrograms(b *testing.B) {
	e := newEnv(b, Options{Responses: true})
	e.watch(b) // a reader, as the daemon is: the ring never fills
	e.srv.ServeHTTPCases(b, 8085)
	e.srv.ServeHTTPCases(b, 8086)
	if err := e.k.PutLimit(e.dest(8085, false), Limit{Slot: 7, Responses: RespTimed | RespHTTP | RespInflight}); err != nil {
		b.Fatal(err)
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
	measure := func(port uint16) (egress, ingress string) {
		before, err := e.k.ProgramStats()
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range e.topo.Client.Dial(b, e.cg, kerneltest.DialSpec{Op: "keepalive", Addr: e.dest(port, false).Addr, Timeout: 5 * time.Second, Count: requests, Requests: []kerneltest.HTTPRequest{{Path: "/404"}}}) {
			if r.Errno != 0 || r.Status != 404 {
				b.Fatalf("request: %+v", r)
			}
		}
		after, err := e.k.ProgramStats()
		if err != nil {
			b.Fatal(err)
		}
		per := func(name string) string {
			n := after[name].RunCount - before[name].RunCount
			if n == 0 {
				return "no runs"
			}
			return fmt.Sprintf("%d ns (%d packets)", (after[name].Runtime-before[name].Runtime).Nanoseconds()/int64(n), n)
		}
		return per("resp_egress"), per("resp_ingress")
	}
	b.ResetTimer()
	var out strings.Builder
	kv, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	fmt.Fprintf(&out, "kernel %s; %d keep-alive requests per line (Go net/http, one connection, 404 answers)\n\n", strings.TrimSpace(string(kv)), requests)
	fmt.Fprintf(&out, "| socket | resp_egress per packet | resp_ingress per packet |\n|---|---|---|\n")
	for _, c := range []struct {
		name string
		port uint16
	}{{"not followed (no response options)", 8086}, {"followed (timing, protocol: http, response_timeout)", 8085}} {
		eg, in := measure(c.port)
		fmt.Fprintf(&out, "| %s | %s | %s |\n", c.name, eg, in)
	}
	b.Log("\n" + out.String())
	if path := os.Getenv("BREAKERD_BENCH_OUT"); path != "" {
		if err := os.WriteFile(path, []byte(out.String()), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}
