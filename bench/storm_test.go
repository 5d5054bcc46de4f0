package bench

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

const stormBenchConfig = `
failsafe_timeout: 5s
workloads:
  - name: sel
    cgroups: [CGROUP/sel-*]
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8440"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
`

// TestCgroupStormCost measures how soon the real binary protects a new
// cgroup of a workload made in the middle of a storm of sibling cgroups
// made, then removed, one goroutine as fast as it goes, below the attach
// point: a client process connecting every millisecond is moved into the
// new cgroup right after its mkdir, and the time from the mkdir to its
// first connect the kernel rejects, and the connects that got through
// before, are recorded; also with no storm. RSS is sampled every 10 ms
// during the storms; CPU is the daemon's over the storms' wall time.
// Quick: 3,000 cgroups, one storm each way; full: 3,000 and 10,000, five
// each. BREAKERD_BIN measures another build of breakerd.
func TestCgroupStormCost(t *testing.T) {
	kerneltest.RequireKernel(t)
	sizes, rounds := []int{3000}, 1
	if *full {
		sizes, rounds = []int{3000, 10000}, 5
	}
	bin := os.Getenv("BREAKERD_BIN")
	if bin == "" {
		bin = buildBreakerd(t)
	}
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	cg := kerneltest.NewCgroup(t)
	var storms sync.WaitGroup
	t.Cleanup(func() {
		storms.Wait()
		if err := kerneltest.RemoveCgroupStorm(cg.Path); err != nil {
			t.Errorf("removing the storm's cgroups: %v", err)
		}
	})
	hold := cg.Child(t, "hold")
	root, err := kerneltest.CgroupV2Mount()
	if err != nil {
		t.Fatal(err)
	}
	rel, _ := filepath.Rel(root, cg.Path)
	config := strings.ReplaceAll(strings.ReplaceAll(stormBenchConfig, "CGROUP", rel), "SRV", srv.IPv4.String())
	d := startBreakerd(t, bin, config, cg)
	s := topo.Client.StartStream(t, hold, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(srv.IPv4, 8440), Interval: time.Millisecond, Timeout: time.Second})
	defer s.Close()
	if r := <-s.Results; r.Errno != unix.ECONNREFUSED {
		t.Fatalf("a connect from an unselected cgroup: %v, want refused by the server", r.Errno)
	}
	idleRSS := rssBytes(t, d.pid)

	v, err := maps.OpenPinned(d.bpffs)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	made := 0
	var entries []time.Duration // mkdir → entry in the workloads map
	// protect makes a new selected cgroup, moves the client into it and
	// returns how long after the mkdir its first connect was rejected, and
	// how many got through; then moves it back. It also records when the
	// cgroup's entry was in the map (polled every 100 µs).
	protect := func() (time.Duration, int) {
		made++
		mkdir := time.Now()
		sel := cg.Child(t, fmt.Sprintf("sel-%d", made))
		id, err := sel.ID()
		if err != nil {
			t.Fatal(err)
		}
		entry := make(chan time.Duration, 1)
		go func() {
			for time.Since(mkdir) < 10*time.Second {
				if _, ok, err := v.Workload(id); err == nil && ok {
					entry <- time.Since(mkdir)
					return
				}
				time.Sleep(100 * time.Microsecond)
			}
			entry <- -1
		}()
		if err := sel.AddProc(s.PID()); err != nil {
			t.Fatal(err)
		}
		delay, through := firstRejection(t, s, mkdir, time.Now())
		entries = append(entries, <-entry)
		if err := hold.AddProc(s.PID()); err != nil {
			t.Fatal(err)
		}
		return delay, through
	}

	var tab strings.Builder
	fmt.Fprintf(&tab, "| sibling cgroups | storm | storms | storm's time (median) | entry in the map after (p50 / max) | first rejection after (p50 / max) | connects through (max) | daemon CPU during the storms (peak over 50 ms) | peak RSS (idle before: %.1f MiB) |\n|---|---|---|---|---|---|---|---|---|\n", float64(idleRSS)/(1<<20))
	var calm []time.Duration
	calmThrough := 0
	entries = nil
	for range 5 * rounds {
		dl, th := protect()
		calm = append(calm, dl)
		calmThrough = max(calmThrough, th)
		time.Sleep(20 * time.Millisecond)
	}
	fmt.Fprintf(&tab, "| 0 | none | %d | – | %s | %s | %d | – | – |\n", len(calm), p50max(entries), p50max(calm), calmThrough)
	// One round is a storm of mkdirs, then one of rmdirs of the same
	// cgroups.
	type figures struct {
		delays, took, entries []time.Duration
		through               int
		busy, wall            int64
		peak, cpu             atomic.Int64 // RSS bytes; CPU ns per 50 ms
	}
	for _, n := range sizes {
		var each [2]figures // mkdir, rmdir
		for range rounds {
			for i, remove := range []bool{false, true} {
				f := &each[i]
				stop := make(chan struct{})
				sampled := make(chan struct{})
				go func() {
					defer close(sampled)
					c0, w0 := cpuNanos(t, d.pid), time.Now()
					for {
						f.peak.Store(max(f.peak.Load(), rssBytes(t, d.pid)))
						if el := time.Since(w0); el >= 50*time.Millisecond {
							c := cpuNanos(t, d.pid)
							f.cpu.Store(max(f.cpu.Load(), (c-c0)*int64(50*time.Millisecond)/int64(el)))
							c0, w0 = c, time.Now()
						}
						select {
						case <-stop:
							return
						case <-time.After(10 * time.Millisecond):
						}
					}
				}()
				cpu0, t0 := cpuNanos(t, d.pid), time.Now()
				half := make(chan struct{})
				done := kerneltest.CgroupStorm(&storms, cg.Path, n, remove, half)
				<-half
				entries = nil
				dl, th := protect()
				f.entries = append(f.entries, entries...)
				if err := <-done; err != nil {
					t.Fatalf("storm: %v", err)
				}
				f.took = append(f.took, time.Since(t0))
				// The daemon's share: until it has caught up (its CPU
				// stops moving) or a second after the storm.
				for last, until := cpuNanos(t, d.pid), time.Now().Add(time.Second); time.Now().Before(until); {
					time.Sleep(20 * time.Millisecond)
					c := cpuNanos(t, d.pid)
					if c-last < int64(time.Millisecond) {
						break
					}
					last = c
				}
				f.busy += cpuNanos(t, d.pid) - cpu0
				f.wall += int64(time.Since(t0))
				close(stop)
				<-sampled
				f.delays = append(f.delays, dl)
				f.through = max(f.through, th)
			}
		}
		for i, what := range []string{"mkdir", "rmdir"} {
			f := &each[i]
			slices.Sort(f.took)
			fmt.Fprintf(&tab, "| %d | %s | %d | %v | %s | %s | %d | %.0f%% of a core (%.0f%%) | %.1f MiB |\n", n, what, rounds, f.took[len(f.took)/2].Round(time.Millisecond),
				p50max(f.entries), p50max(f.delays), f.through, 100*float64(f.busy)/float64(f.wall), 100*float64(f.cpu.Load())/float64(50*time.Millisecond), float64(f.peak.Load())/(1<<20))
		}
	}
	report(t, tab.String())
}

// p50max formats the median and the largest of ds.
func p50max(ds []time.Duration) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	return fmt.Sprintf("%.1f / %.1f ms", float64(s[len(s)/2])/1e6, float64(s[len(s)-1])/1e6)
}

// firstRejection reads a stream moved into a new selected cgroup at moved
// (made at made): how long after made its first connect the kernel
// rejected began, and how many that began after moved got through.
func firstRejection(t *testing.T, s *kerneltest.Stream, made, moved time.Time) (time.Duration, int) {
	t.Helper()
	through := 0
	deadline := time.After(10 * time.Second)
	for {
		select {
		case r, ok := <-s.Results:
			if !ok {
				t.Fatal("the stream helper ended")
			}
			start := time.Unix(0, r.Start)
			if start.Before(moved) {
				continue
			}
			switch r.Errno {
			case unix.EHOSTUNREACH:
				return start.Sub(made), through
			case unix.ECONNREFUSED:
				through++
			default:
				t.Fatalf("a connect from the new cgroup: %v", r.Errno)
			}
		case <-deadline:
			t.Fatalf("a new selected cgroup not protected 10 s after its mkdir (%d connects through)", through)
		}
	}
}
