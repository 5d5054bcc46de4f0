package bench

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

var healthyBin = flag.String("bench.breakerd", "", "breakerd binary TestHealthyPathCost and TestCompare's latency lines measure (default: a build of ../cmd/breakerd)")

// healthyConfig trips a dynamic circuit on one refusal, so the latency
// probe's single refused connect opens its circuit.
const healthyConfig = `
failsafe_timeout: 30s
all:
  consecutive_failures: 1
  open_duration: 5m
  reject_errno: EHOSTUNREACH
`

// TestHealthyPathCost measures what a healthy connection costs breakerd's
// daemon, end to end: the real binary protects a child cgroup whose client
// process connects (and closes) to a listener on a test host over veth at
// a paced rate — 1,000/s, 10,000/s and as fast as the machine goes —
// spread over 64 destinations; the daemon's CPU comes from the kernel's
// per-thread run time (/proc/PID/task/*/schedstat, in nanoseconds), less
// an idle stretch of the same length measured just before. Midway through
// each load, one connect to a refusing port of the same host opens its
// circuit (consecutive_failures 1), and the time from the test seeing that
// connect refused (its client helper has reported it) to the verdict being
// in the pinned map is the failure-to-verdict time under that load. The
// daemon may have begun before that clock starts, so it understates the
// time from the kernel's record by as long as the helper takes to report;
// the pinned maps are opened before it starts (up to 5174510 their opening
// was counted: 130–220 µs in the runs before and after). It also reports records the kernel dropped.
func TestHealthyPathCost(t *testing.T) {
	kerneltest.RequireKernel(t)
	dur := 5 * time.Second
	if !*full {
		dur = time.Second
	}
	bin := *healthyBin
	if bin == "" {
		bin = buildBreakerd(t)
	}
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	const base, ports, refusing = 20000, 64, 21000
	for p := uint16(base); p < base+ports; p++ {
		serveAndClose(t, srv, p)
	}
	// Many 4-tuples a second from one client address: let connect reuse
	// TIME_WAIT ports (the client closes first).
	if err := topo.Client.Sysctl("net/ipv4/tcp_tw_reuse", "1"); err != nil {
		t.Fatal(err)
	}
	cg := kerneltest.NewCgroup(t)
	d := startBreakerd(t, bin, healthyConfig, cg)
	admin, bpffs, pid := d.admin, d.bpffs, d.pid

	var tab strings.Builder
	fmt.Fprintf(&tab, "%s per rate, 64 destinations, connect + close from one client process; daemon CPU from the kernel's per-thread run time, less an idle stretch of the same length\n\n", dur)
	fmt.Fprintf(&tab, "| target rate | connects/s done | daemon CPU | daemon CPU per connection (less idle) | all daemon CPU per connection | records lost | failure → open circuit |\n|---|---|---|---|---|---|---|\n")
	// Warm up: the 64 destinations' circuits exist before the first
	// measured stretch, so it measures connections, not circuits made.
	topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(srv.IPv4, base), Op: "rate", Rate: 1000, For: 500 * time.Millisecond, Ports: ports, Parallel: 2})
	time.Sleep(200 * time.Millisecond)
	lost0 := metric(t, admin, "breakerd_events_lost_total")
	for i, rate := range []int{1000, 10000, 0} {
		idle0 := cpuNanos(t, pid)
		time.Sleep(dur)
		idle := cpuNanos(t, pid) - idle0

		spec := kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(srv.IPv4, base), Op: "rate", Rate: rate, For: dur, Ports: ports, Parallel: 2}
		if rate == 0 {
			spec.Parallel = 4
		}
		c0 := cpuNanos(t, pid)
		t0 := time.Now()
		done := make(chan []kerneltest.DialResult, 1)
		go func() { done <- topo.Client.Dial(t, cg, spec) }()
		// Midway: one refused connect, and how long until its circuit is open.
		time.Sleep(dur / 2)
		dst := netip.AddrPortFrom(srv.IPv4, uint16(refusing+i))
		// The pinned maps are opened before the clock starts.
		view, _ := maps.OpenPinned(bpffs)
		r := topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst})
		refusedAt := time.Now()
		if r[0].Errno != unix.ECONNREFUSED {
			t.Fatalf("the refusing port answered %v", r[0].Errno)
		}
		toOpen := untilOpen(admin, view, dst, refusedAt)
		if view != nil {
			view.Close()
		}
		if toOpen < 0 {
			t.Errorf("rate %d: the circuit of %s did not open", rate, dst)
		}
		res := <-done
		el := time.Since(t0)
		cpu := cpuNanos(t, pid) - c0
		var ok, failed int64
		for _, x := range res {
			if x.Errno == 0 {
				ok += x.Nanos
			} else {
				failed += x.Nanos
				t.Logf("rate %d: %d connects failed with %v", rate, x.Nanos, x.Errno)
			}
		}
		if failed > ok/100 {
			t.Errorf("rate %d: %d of %d healthy connects failed", rate, failed, ok+failed)
		}
		lost := metric(t, admin, "breakerd_events_lost_total")
		extra := cpu - idle*el.Nanoseconds()/dur.Nanoseconds()
		label := strconv.Itoa(rate) + "/s"
		if rate == 0 {
			label = "as fast as it goes"
		}
		fmt.Fprintf(&tab, "| %s | %.0f | %.2f%% of a core | %d ns | %d ns | %.0f | %s |\n", label, float64(ok)/el.Seconds(),
			100*float64(cpu)/float64(el.Nanoseconds()), extra/max(ok, 1), cpu/max(ok, 1), lost-lost0, toOpen.Round(10*time.Microsecond))
		lost0 = lost
	}
	report(t, tab.String())
}

// report logs a table and appends it to the -bench.out file, if any.
func report(t *testing.T, table string) {
	t.Helper()
	t.Log("\n" + table)
	if *out == "" {
		return
	}
	f, err := os.OpenFile(*out, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := fmt.Fprintln(f, table); err != nil {
		t.Fatal(err)
	}
}

// untilOpen returns how long after since dst's verdict is in the kernel:
// read from the pinned verdict map (v, opened by the caller) every 20 µs
// (no work for the daemon), or, for a binary of another layout (v nil),
// from the admin API every 10 ms. -1 when it does not come within 5 s.
func untilOpen(admin string, v *maps.View, dst netip.AddrPort, since time.Time) time.Duration {
	d := maps.Dest{Proto: maps.TCP, Addr: dst}
	if v != nil {
		for time.Since(since) < 5*time.Second {
			if _, ok, _ := v.Verdict(d); ok {
				return time.Since(since)
			}
			time.Sleep(20 * time.Microsecond)
		}
		return -1
	}
	if kerneltest.WaitFor(5*time.Second, func() bool { return circuitState(admin, d.String()) == "open" }) {
		return time.Since(since)
	}
	return -1
}

// cpuNanos is the CPU time all of pid's threads have run, from the
// scheduler's statistics (nanoseconds, unlike /proc/PID/stat's ticks).
func cpuNanos(t *testing.T, pid int) int64 {
	t.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	var sum int64
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, task.Name()))
		if err != nil {
			continue // a thread that just exited
		}
		f := strings.Fields(string(b))
		if len(f) > 0 {
			n, _ := strconv.ParseInt(f[0], 10, 64)
			sum += n
		}
	}
	return sum
}

func get(addr, path string) int {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get("http://" + addr + path)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func circuitState(addr, name string) string {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get("http://" + addr + "/v1/circuits/" + strings.ReplaceAll(name, "/", "%2F"))
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	var ci struct {
		State string `json:"state"`
	}
	json.NewDecoder(resp.Body).Decode(&ci)
	return ci.State
}

// metric reads one unlabelled series from the daemon's /metrics.
func metric(t *testing.T, addr, name string) float64 {
	t.Helper()
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == name {
			v, _ := strconv.ParseFloat(f[1], 64)
			return v
		}
	}
	return 0
}
