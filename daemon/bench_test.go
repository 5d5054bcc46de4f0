package daemon

import (
	"net/netip"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/maps"
)

func dynamicDest(i int) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, byte(i >> 16), byte(i >> 8)}), uint16(1+i&0xff))}
}

// BenchmarkHandleOutcome is the daemon's cost per kernel record on one
// goroutine: decode is measured in maps; this is record → circuit lookup
// → state machine (and a verdict write when it transitions), over 1,000
// destinations, with every 50th record a failure.
func BenchmarkHandleOutcome(b *testing.B) {
	f := newFixture(b, "all:\n  consecutive_failures: 0\n  min_requests: 1000\n  window_size: 1000\n")
	d := f.start()
	ev := maps.Event{Outcome: maps.Established, Duration: 50 * time.Microsecond}
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		ev.Dest = dynamicDest(i % 1000)
		ev.Outcome = maps.Established
		if i%50 == 0 {
			ev.Outcome = maps.Refused
		}
		d.handle(&ev, now)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
}

// BenchmarkCircuitFootprint measures the daemon's heap per dynamic
// circuit (the kernel map's memory comes on top, and only for open ones).
func BenchmarkCircuitFootprint(b *testing.B) {
	for _, n := range []int{10_000, 100_000} {
		b.Run(strconv.Itoa(n/1000)+"k", func(b *testing.B) {
			for b.Loop() {
				f := newFixture(b, "max_circuits: 131072\n")
				d := f.start()
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				now := time.Now()
				d.mu.Lock()
				for i := 0; i < n; i++ {
					d.lookup(dynamicDest(i), now)
				}
				d.mu.Unlock()
				runtime.GC()
				runtime.ReadMemStats(&after)
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(n), "bytes/circuit")
				f.stop()
			}
		})
	}
}

// BenchmarkIdleCPU runs a daemon with nothing to do for a few seconds and
// reports the CPU it used (this whole process; nothing else runs).
func BenchmarkIdleCPU(b *testing.B) {
	f := newFixture(b, "mode: enforce\n")
	f.tick = 0 // the product's default tick
	f.start()
	for b.Loop() {
		var r0, r1 syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &r0)
		t0 := time.Now()
		time.Sleep(5 * time.Second)
		syscall.Getrusage(syscall.RUSAGE_SELF, &r1)
		cpu := time.Duration(r1.Utime.Nano()+r1.Stime.Nano()-r0.Utime.Nano()-r0.Stime.Nano()) * time.Nanosecond
		b.ReportMetric(100*cpu.Seconds()/time.Since(t0).Seconds(), "%core")
	}
}
