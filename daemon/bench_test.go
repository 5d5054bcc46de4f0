package daemon

import (
	"flag"
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
// → state machine (and a verdict write when it transitions), with every
// 50th record a failure, handled as the reader does, in batches of up to
// 1024 records with increasing socket cookies, over 1,000 destinations
// (the default run) and, with -bench.circuits, 1,000, 100,000, 106,496,
// 131,072 and 1,048,576 (max_circuits' largest value) existing circuits
// visited in a scattered order, so the larger ones miss the CPU caches as
// a node's daemon would. max_circuits is the number of circuits, so the
// destination index is as full as it is on a node at that max_circuits:
// at 106,496 it is at its load bound (13/16 of 131,072 slots), the
// fullest it gets.
func BenchmarkHandleOutcome(b *testing.B) {
	sizes := []int{1000}
	if *benchCircuits {
		sizes = []int{1000, 100_000, 106_496, 131_072, 1 << 20}
	}
	for _, n := range sizes {
		name := ""
		if *benchCircuits {
			name = strconv.Itoa(n)
		}
		run := func(b *testing.B) {
			f := newFixture(b, "max_circuits: "+strconv.Itoa(n)+"\n")
			d := f.start()
			ev := maps.Event{Outcome: maps.Established, Duration: 50 * time.Microsecond}
			now := time.Now()
			d.hold()
			defer d.release()
			for i := range n {
				ev.Dest = dynamicDest(i)
				d.eng.HandleBatch([]maps.Event{ev}, now)
			}
			const batch = 1024
			evs := make([]maps.Event, batch)
			var i uint32
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				for j := range evs {
					e := &evs[j]
					e.Dest = dynamicDest(int(i * 2654435761 % uint32(n)))
					e.Outcome = maps.Established
					if i%50 == 0 {
						e.Outcome = maps.Refused
					}
					e.Duration = 50 * time.Microsecond
					e.Cookie = uint64(i) + 1
					e.Time = time.Duration(i) * time.Microsecond
					i++
				}
				d.eng.HandleBatch(evs, now)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/record")
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "records/s")
		}
		if name == "" {
			run(b)
			continue
		}
		b.Run(name, run)
	}
}

var benchCircuits = flag.Bool("bench.circuits", false, "BenchmarkHandleOutcome at 1k, 100k, 106,496, 131,072 and 1,048,576 circuits, BenchmarkCircuitFootprint also at 1,048,576, BenchmarkIdleCPU at none, 100k and 1,048,576, BenchmarkControlPlane also at 1M")

// BenchmarkCircuitFootprint measures the daemon's heap per dynamic
// circuit at max_circuits circuits: what filling it adds, plus its share
// of the destination index reserved for them (the kernel map's memory
// comes on top, and only for open ones).
func BenchmarkCircuitFootprint(b *testing.B) {
	sizes := []int{10_000, 100_000}
	if *benchCircuits {
		sizes = append(sizes, 1<<20)
	}
	for _, n := range sizes {
		b.Run(strconv.Itoa(n/1000)+"k", func(b *testing.B) {
			for b.Loop() {
				// max_circuits n: the destination index, reserved for
				// that many when the configuration is applied (before
				// the heap is read), is counted below.
				f := newFixture(b, "max_circuits: "+strconv.Itoa(n)+"\n")
				d := f.start()
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				now := time.Now()
				d.hold()
				for i := 0; i < n; i++ {
					d.eng.Lookup(dynamicDest(i), now)
				}
				d.release()
				runtime.GC()
				runtime.ReadMemStats(&after)
				index := d.eng.IndexBytes()
				b.ReportMetric((float64(after.HeapAlloc-before.HeapAlloc)+float64(index))/float64(n), "bytes/circuit")
				f.stop()
			}
		})
	}
}

// BenchmarkIdleCPU runs a daemon with nothing to do for a few seconds and
// reports the CPU it used (this whole process; nothing else runs); with
// -bench.circuits also holding 100,000 and 1,048,576 closed circuits,
// which the idle work must not visit.
func BenchmarkIdleCPU(b *testing.B) {
	sizes := []int{0}
	if *benchCircuits {
		sizes = []int{0, 100_000, 1 << 20}
	}
	for _, n := range sizes {
		b.Run(strconv.Itoa(n)+"-circuits", func(b *testing.B) { idleCPU(b, n) })
	}
}

func idleCPU(b *testing.B, circuits int) {
	f := newFixture(b, "max_circuits: "+strconv.Itoa(max(circuits, 131072))+"\n")
	f.tick = 0 // the product's default tick
	d := f.start()
	d.hold()
	for i := range circuits {
		d.eng.Lookup(dynamicDest(i), time.Now())
	}
	d.release()
	runtime.GC()
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

// BenchmarkControlPlane reloads a daemon holding n closed dynamic circuits: once with all's options changed (every circuit is given
// them) and once with a target added (every circuit is matched again), and
// then lists every circuit through the API's pages and gathers its
// metrics as a scrape does. n is 100,000, and with -bench.circuits also
// 1,000,000.
func BenchmarkControlPlane(b *testing.B) {
	sizes := []int{100_000}
	if *benchCircuits {
		sizes = append(sizes, 1_000_000)
	}
	for _, n := range sizes {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			// One more than n: the added target's circuit evicts none.
			base := "max_circuits: " + strconv.Itoa(n+1) + "\n"
			f := newFixture(b, base)
			d := f.start()
			now := time.Now()
			d.hold()
			for i := range n {
				d.eng.Lookup(dynamicDest(i), now)
			}
			d.release()
			configs := []string{base + "all:\n  consecutive_failures: 7\n", base + "targets:\n  x:\n    match: {cidrs: [10.1.2.3/32], ports: [\"80\"]}\n"}
			var all, target, list, scrape time.Duration
			for b.Loop() {
				for i, y := range configs {
					f.writeConfig(y)
					t0 := time.Now()
					if err := d.Reload(); err != nil {
						b.Fatal(err)
					}
					if i == 0 {
						all += time.Since(t0)
					} else {
						target += time.Since(t0)
					}
				}
				f.writeConfig(base)
				if err := d.Reload(); err != nil {
					b.Fatal(err)
				}
				t0 := time.Now()
				if got := len(d.Circuits()); got != n {
					b.Fatalf("listed %d circuits, want %d", got, n)
				}
				list += time.Since(t0)
				t0 = time.Now()
				if _, err := d.metrics.reg.Gather(); err != nil {
					b.Fatal(err)
				}
				scrape += time.Since(t0)
			}
			b.ReportMetric(float64(all.Milliseconds())/float64(b.N), "ms/reload-all")
			b.ReportMetric(float64(target.Milliseconds())/float64(b.N), "ms/reload-target")
			b.ReportMetric(list.Seconds()/float64(b.N), "s/list-all")
			b.ReportMetric(float64(scrape.Milliseconds())/float64(b.N), "ms/scrape")
		})
	}
}
