package daemon

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// benchTargets is how many targets BenchmarkAdaptiveLimits configures.
const benchTargets = 100

// limitsConfig is benchTargets targets on ports 20000 and up of SRV, each
// with max_connections limit (a number, or an adaptive mapping), and
// circuits that never open.
func limitsConfig(limit string) string {
	var b strings.Builder
	b.WriteString("targets:\n")
	for i := range benchTargets {
		fmt.Fprintf(&b, "  t%d:\n    match: {cidrs: [SRV], ports: [\"%d\"]}\n    max_connections: %s\n", i, 20000+i, limit)
		// Timed-out connects never open the circuit.
		b.WriteString("    consecutive_failures: 0\n    window_duration: 1h\n    min_requests: 100000\n")
	}
	return b.String()
}

// BenchmarkAdaptiveLimits is what an adaptive limit costs the daemon
// beside a static one, on the real kernel: per handshake record handled
// (record), and per tick per target whose window is full, when the limit
// stays (tick-still: a bulkhead read and the algorithm) and when it moves
// (tick-move: also the limits entry rewritten), against a tick of the
// same targets with static limits (the tick's other work). The kernel's
// per-connection path is the same for both: it reads the limits entry,
// whatever wrote it.
func BenchmarkAdaptiveLimits(b *testing.B) {
	for _, tc := range []struct{ name, limit string }{
		{"static", "1000000"},
		{"adaptive", "{adaptive: vegas, min: 1, initial: 1000000, max: 1000000}"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			f := newFixture(b, limitsConfig(tc.limit))
			d := f.start()
			dest := func(i int) maps.Dest {
				return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(f.srv.IPv4, uint16(20000+i%benchTargets))}
			}
			d.hold()
			defer d.release()
			d.eng.HoldChecks(time.Now().Add(time.Hour)) // the tick's once-a-second work stays out
			evs := make([]maps.Event, 0, benchTargets*policy.LimitWindow)
			window := func(out maps.Outcome) {
				evs = evs[:0]
				for i := range benchTargets * policy.LimitWindow {
					evs = append(evs, maps.Event{Outcome: out, Dest: dest(i), Duration: 2 * time.Millisecond, Cookie: uint64(i) + 1})
				}
				d.eng.HandleBatch(evs, time.Now())
			}
			b.Run("record", func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					window(maps.Established)
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(evs)), "ns/record")
			})
			tick := func(b *testing.B, out maps.Outcome) {
				window(maps.Established) // Vegas' first window: its no-load latency
				d.eng.Tick(time.Now())
				var spent time.Duration
				for b.Loop() {
					b.StopTimer()
					window(out)
					b.StartTimer()
					t0 := time.Now()
					d.eng.Tick(t0)
					spent += time.Since(t0)
				}
				b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N*benchTargets), "ns/target/tick")
			}
			// Handshakes with nothing in flight: the limit holds nothing
			// back and stays.
			b.Run("tick-still", func(b *testing.B) { tick(b, maps.Established) })
			// Connects timed out: Vegas takes a step off each tick.
			b.Run("tick-move", func(b *testing.B) { tick(b, maps.TimedOut) })
		})
	}
}
