package daemon

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// A reset soon after connect is a failure; one after reset_failure_window
// (an idle timeout's reset of a pooled connection) counts as nothing.
func TestResetCountsOnlySoonAfterConnect(t *testing.T) {
	f := newFixture(t, `
targets:
  early:
    match: {cidrs: [SRV], ports: ["8090"]}
    consecutive_failures: 0
    min_requests: 6
    failure_rate_threshold: 0.5
    reset_failure_window: 400ms
  late:
    match: {cidrs: [SRV], ports: ["8091"]}
    consecutive_failures: 0
    min_requests: 6
    failure_rate_threshold: 0.5
    reset_failure_window: 400ms
`)
	f.srv.ServeReset(t, 8090)
	f.srv.ServeResetAfter(t, 8091, 900*time.Millisecond)
	f.start()
	for _, port := range []uint16{8090, 8091} {
		res := f.topo.Client.Dial(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, port), Count: 3, Parallel: 3, Hold: 1500 * time.Millisecond})
		// Established, then reset: connect() itself may already see the
		// reset when the server is quicker than the client.
		if got := errnos(res); got[0]+got[unix.ECONNRESET] != 3 {
			t.Fatalf("port %d: connects %v", port, got)
		}
	}
	f.waitState("early", "open", 2*time.Second)
	// Three established (successes) and three resets.
	if !kerneltest.WaitFor(2*time.Second, func() bool { c, _ := f.circuit("late"); return c.Calls == 3 }) {
		c, _ := f.circuit("late")
		t.Fatalf("late: %+v", c)
	}
	f.waitOutcomes("reset", "late", 3) // the resets were handled
	if c, _ := f.circuit("late"); c.State != "closed" || c.Failures != 0 || c.Calls != 3 {
		t.Fatalf("resets after reset_failure_window counted: %+v", c)
	}
}

// A reload that changes `all` keeps the dynamic circuits: 50 open ones
// still reject, with no SYN reaching the host.
func TestReloadKeepsOpenDynamicCircuits(t *testing.T) {
	const n = 50
	cfg := `
all:
  consecutive_failures: 1
  open_duration: 121s
  reject_errno: EHOSTUNREACH
`
	f := newFixture(t, cfg)
	f.start()
	// One helper for the n ports (Ports: connect i goes to 9000+i), not n
	// helpers: each start of one costs a third of a second in the VM.
	dialAll := func() []kerneltest.DialResult {
		return f.topo.Client.Dial(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 9000), Count: n, Ports: n})
	}
	for i, r := range dialAll() {
		if r.Errno != unix.ECONNREFUSED {
			t.Fatalf("port %d: %v", 9000+i, r.Errno)
		}
	}
	ip := f.srv.IPv4.String()
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		open := 0
		for _, c := range f.d.Circuits() {
			if c.State == "open" {
				open++
			}
		}
		return open == n
	}) {
		t.Fatalf("not all %d circuits opened: %v", n, f.d.Circuits())
	}
	before, _ := f.circuit("tcp/" + ip + ":9000")

	f.writeConfig(strings.Replace(cfg, "121s", "122s", 1))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	syns := f.srv.SYNs(t)
	for i, r := range dialAll() {
		if r.Errno != unix.EHOSTUNREACH {
			t.Fatalf("port %d after the reload: %v, want rejected", 9000+i, r.Errno)
		}
	}
	if d := f.srv.SYNs(t) - syns; d != 0 {
		t.Fatalf("%d SYNs reached the host after the reload", d)
	}
	after, _ := f.circuit("tcp/" + ip + ":9000")
	if after.State != "open" || !after.OpenUntil.Equal(before.OpenUntil) {
		t.Fatalf("circuit %+v before, %+v after: the open time must stay", before, after)
	}
	if after.Options["open_duration"] != "2m2s" {
		t.Fatalf("new options not applied: %v", after.Options["open_duration"])
	}
}

// With half_open_success_threshold 2 and one connection per round (little
// traffic) a circuit begins a new round at probe_timeout instead of
// reopening, and closes; and a service-scope target with two destinations
// has one probe budget: a round admits half_open_probes in total.
func TestServiceScopeOneBudgetAndLittleTrafficCloses(t *testing.T) {
	f := newFixture(t, `
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8086-8087"]}
    consecutive_failures: 2
    open_duration: 1s
    jitter: 0
    connect_timeout: 1s
    half_open_probes: 2
    half_open_success_threshold: 2
    probe_timeout: 1s
`)
	f.start()
	f.dial(8086, 2, 0)
	f.waitState("svc", "open", 2*time.Second)
	f.srv.ServeHold(t, 8086)
	f.srv.ServeHold(t, 8087)
	time.Sleep(1100 * time.Millisecond)
	// One connection in the round: it succeeds.
	if got := errnos(f.dial(8086, 1, 0)); got[0] != 1 {
		t.Fatalf("first probe: %v", got)
	}
	f.waitState("svc", "half_open", time.Second)
	// probe_timeout passes with every probe that came succeeded: a new
	// round begins, no reopen.
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		evs := f.d.Events()
		last := evs[len(evs)-1]
		return last.From == "half_open" && last.To == "half_open" && last.Reason == "probe_round"
	}) {
		t.Fatalf("no new round at probe_timeout: %+v", f.d.Events())
	}
	if c, _ := f.circuit("svc"); c.State != "half_open" || c.Trip != 0 {
		t.Fatalf("after a round whose every probe succeeded: %+v", c)
	}
	// The next round's one connection closes it.
	if got := errnos(f.dial(8087, 1, 0)); got[0] != 1 {
		t.Fatalf("second round's probe: %v", got)
	}
	f.waitState("svc", "closed", 2*time.Second)
	var reasons []string
	for _, e := range f.d.Events() {
		reasons = append(reasons, e.From+">"+e.To+":"+e.Reason)
	}
	want := "closed>open:consecutive_failures open>half_open:open_duration_elapsed half_open>half_open:probe_round half_open>closed:probes_succeeded"
	if strings.Join(reasons, " ") != want {
		t.Fatalf("events %v, want %s", reasons, want)
	}

	// Black-holed: two connect timeouts open it again; once due, 16
	// connects to each destination at once get exactly 2 probes through.
	f.srv.BlackHole(t, 8086, true)
	f.srv.BlackHole(t, 8087, true)
	f.topo.Client.Dial(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8086), Count: 2, Parallel: 2, Timeout: 1500 * time.Millisecond})
	f.waitState("svc", "open", 3*time.Second)
	time.Sleep(1100 * time.Millisecond)
	syns := f.srv.SYNs(t)
	done := make(chan []kerneltest.DialResult, 2)
	for _, p := range []uint16{8086, 8087} {
		go func() {
			done <- f.topo.Client.Dial(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, p), Count: 16, Parallel: 16, Barrier: true, Timeout: 300 * time.Millisecond})
		}()
	}
	got := errnos(append(<-done, <-done...))
	if got[unix.ECONNREFUSED] != 30 || f.srv.SYNs(t)-syns != 2 {
		t.Fatalf("a round of a two-destination circuit: errnos %v, %d SYNs; want 30 rejected and 2 SYNs", got, f.srv.SYNs(t)-syns)
	}
}

// Overrides set through the API survive a reload of their target (and of
// `all`) and a restart; releasing one survives a restart too.
func TestOverridesSurviveReloadAndRestart(t *testing.T) {
	cfg := svcConfig + `
all:
  reject_errno: ENETUNREACH
`
	f := newFixture(t, cfg)
	f.start()
	dyn := fmt.Sprintf("tcp/%s:8081", f.srv.IPv4)
	f.dial(8081, 1, 0) // a dynamic circuit, closed
	// A healthy record is read with the next batch (within a tick).
	if !kerneltest.WaitFor(2*time.Second, func() bool { _, ok := f.circuit(dyn); return ok }) {
		t.Fatalf("no circuit %s after a healthy connect", dyn)
	}
	if _, err := f.d.Force("svc", "close"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.d.Force(dyn, "open"); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		if c, _ := f.circuit("svc"); c.State != "forced_closed" {
			t.Fatalf("%s: svc is %s, want forced_closed", when, c.State)
		}
		if c, _ := f.circuit(dyn); c.State != "forced_open" {
			t.Fatalf("%s: %s is %s, want forced_open", when, dyn, c.State)
		}
		// forced_closed: three refused connects do not trip it.
		if got := errnos(f.dial(8080, 3, 0)); got[unix.ECONNREFUSED] != 3 {
			t.Fatalf("%s: svc connects %v, want 3 refused by the host", when, got)
		}
		if got := errnos(f.dial(8081, 2, 0)); got[unix.ENETUNREACH] != 2 {
			t.Fatalf("%s: forced-open connects %v, want rejected", when, got)
		}
	}
	check("before")
	f.writeConfig(strings.Replace(cfg, "consecutive_failures: 3", "consecutive_failures: 2", 1) + "  open_duration: 2m\n")
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	check("after a reload of both")
	f.stop()
	f.start()
	check("after a restart")
	if _, err := f.d.Force(dyn, "release"); err != nil {
		t.Fatal(err)
	}
	f.stop()
	f.start()
	if c, ok := f.circuit(dyn); ok && c.State != "closed" {
		t.Fatalf("a released override came back after a restart: %+v", c)
	}
	if got := errnos(f.dial(8081, 1, 0)); got[unix.ECONNREFUSED] != 1 {
		t.Fatalf("released: %v", got)
	}
}
