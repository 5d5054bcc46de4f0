package bench

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// TestResponsesDaemonCost measures what following responses costs the
// daemon per request, end to end: wrk (Debian's, in the protected cgroup)
// makes keep-alive requests as fast as it goes to a target with
// protocol: http, and the daemon's CPU time (the real binary's threads,
// from the scheduler), less its idle CPU measured just before, is divided
// by the requests wrk completed. It runs
// twice on the same rig: with the default failure statuses, whose
// ordinary successes the kernel counts (one record for many), and with a
// list the kernel cannot apply (418 added, which these 404s never are), so
// every response is a record. Both must credit every response exactly
// once: the daemon's response outcomes equal wrk's completed requests.
func TestResponsesDaemonCost(t *testing.T) {
	kerneltest.RequireKernel(t)
	if _, err := os.Stat("/usr/bin/wrk"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("wrk is missing (scripts/setup installs it)")
		}
		t.Skip("wrk is missing")
	}
	dur := 2 * time.Second
	if *full {
		dur = 10 * time.Second
	}
	bin := buildBreakerd(t)
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	srv.ServeHTTPCases(t, 8080)
	requests := regexp.MustCompile(`(\d+) requests in`)
	var tab strings.Builder
	fmt.Fprintf(&tab, "wrk -t1 -c8 for %v, keep-alive GETs answered 404 (a success)\n\n", dur)
	fmt.Fprintf(&tab, "| failure statuses | responses | requests/s | daemon CPU | per request, over idle | per request, all | records lost |\n|---|---|---|---|---|---|---|\n")
	for _, mode := range []struct{ name, statuses string }{
		{"[5xx, 429]: successes counted in the kernel", `["5xx", "429"]`},
		{"[5xx, 429, 418]: every response a record", `["5xx", "429", "418"]`},
	} {
		cg := kerneltest.NewCgroup(t)
		config := fmt.Sprintf("failsafe_timeout: 30s\ntargets:\n  web:\n    match: {cidrs: [%s], ports: [\"8080\"]}\n    protocol: http\n    failure_statuses: %s\n", srv.IPv4, mode.statuses)
		d := startBreakerd(t, bin, config, cg)
		// Its idle CPU first (the heartbeat, the tick), over a stretch
		// of a fifth of the load's length.
		i0 := cpuNanos(t, d.pid)
		time.Sleep(dur / 5)
		idle := float64(cpuNanos(t, d.pid)-i0) / float64(dur/5)
		c0 := cpuNanos(t, d.pid)
		t0 := time.Now()
		out, err := topo.Client.Command(cg, "wrk", "-t1", "-c8", "-d"+strconv.Itoa(int(dur.Seconds()))+"s", fmt.Sprintf("http://%s:8080/404", srv.IPv4)).Run(t)
		if err != nil {
			t.Fatalf("wrk: %v\n%s", err, out)
		}
		m := requests.FindSubmatch(out)
		if m == nil {
			t.Fatalf("wrk's output has no request count:\n%s", out)
		}
		n, _ := strconv.ParseFloat(string(m[1]), 64)
		series := `breakerd_connection_outcomes_total{outcome="response",target="web",workload="shared"}`
		// Every completed request is credited (wrk may have left up to one
		// answer per connection unread when it stopped).
		var got float64
		if !kerneltest.WaitFor(5*time.Second, func() bool { got = metric(t, d.admin, series); return got >= n && got <= n+8 }) {
			t.Errorf("%s: the daemon counted %.0f responses, wrk completed %.0f requests", mode.name, got, n)
		}
		el := time.Since(t0)
		cpu := cpuNanos(t, d.pid) - c0
		extra := float64(cpu) - idle*float64(el)
		fmt.Fprintf(&tab, "| %s | %.0f | %.0f | %.2f%% of a core (idle %.2f%%) | %.0f ns | %.0f ns | %.0f |\n", mode.name, got, n/dur.Seconds(),
			100*float64(cpu)/float64(el.Nanoseconds()), 100*idle, extra/max(n, 1), float64(cpu)/max(n, 1), metric(t, d.admin, "breakerd_events_lost_total"))
	}
	report(t, tab.String())
}
