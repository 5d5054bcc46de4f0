package daemon

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

const lazyConfig = `
max_circuits: 1048576
all:
  consecutive_failures: 2
  open_duration: 1s
  jitter: 0
  half_open_probes: 1
  connect_timeout: 1s
  probe_timeout: 2s
  reject_errno: EHOSTUNREACH
`

// lazyLongConfig is lazyConfig with an open duration no test outlasts:
// for tests that assert rejections and ask for probes with expire, which
// a slow (emulated) machine must not admit early.
var lazyLongConfig = strings.Replace(lazyConfig, "open_duration: 1s", "open_duration: 1m", 1)

// counter reads one series of a counter from the daemon's registry (-1:
// none).
func (f *fixture) counter(name string, labels map[string]string) float64 {
	f.t.Helper()
	if m := f.series(name, labels); m != nil {
		return m.GetCounter().GetValue()
	}
	return -1
}

func (f *fixture) dest(port uint16) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(f.srv.IPv4, port)}
}

func (f *fixture) dynName(port uint16) string { return fmt.Sprintf("tcp/%s:%d", f.srv.IPv4, port) }

// waitEnforced dials port until a connect is rejected with the configured
// errno (a probe the open circuit admits may reach the closed port first).
func (f *fixture) waitEnforced(port uint16) {
	f.t.Helper()
	if !kerneltest.WaitFor(5*time.Second, func() bool { return errnos(f.dial(port, 1, 0))[unix.EHOSTUNREACH] == 1 }) {
		f.t.Fatalf("port %d: no connect rejected by breakerd (logs:\n%s)", port, f.logs.String())
	}
}

// A dynamic circuit takes a kernel circuit id only when it first rejects:
// closed ones cost the kernel nothing, so max_circuits can be a million.
// The id it takes then is its own (counters from zero) and its half-open
// round begins in it; it keeps it while ids are plentiful, and across a
// restart.
func TestDynamicCircuitTakesItsIDWhenItOpens(t *testing.T) {
	f := newFixture(t, lazyLongConfig)
	f.srv.ServeHold(t, 9401)
	f.start()
	if got := errnos(f.dial(9401, 3, 0)); got[0] != 3 {
		t.Fatalf("healthy: %v", got)
	}
	var c CircuitInfo
	ok := kerneltest.WaitFor(2*time.Second, func() bool { // healthy records are read on the tick
		var found bool
		c, found = f.circuit(f.dynName(9401))
		return found
	})
	if !ok || c.CircuitID != 0 || c.State != "closed" {
		t.Fatalf("a healthy dynamic circuit: %+v (found %v), want closed with no kernel id", c, ok)
	}
	f.d.hold()
	held := f.d.eng.IDs().Held()
	f.d.release()
	if held != 0 {
		t.Fatalf("%d ids held with only healthy dynamic circuits", held)
	}
	if !strings.Contains(f.logs.String(), "max_circuits is above the number of circuits that can all reject at once") {
		t.Fatalf("no warning for max_circuits above %d:\n%s", 1<<17, f.logs.String())
	}

	if got := errnos(f.dial(9402, 2, 0)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("no listener: %v", got)
	}
	f.waitState(f.dynName(9402), "open", 2*time.Second)
	if got := errnos(f.dial(9402, 5, 0)); got[unix.EHOSTUNREACH] != 5 {
		t.Fatalf("open: %v, want 5 rejected", got)
	}
	c, _ = f.circuit(f.dynName(9402))
	v, ok, err := f.d.k.Verdict(f.dest(9402))
	if c.CircuitID == 0 || err != nil || !ok || v.CircuitID != c.CircuitID || c.Rejected != 5 {
		t.Fatalf("open circuit %+v, verdict %+v (%v, %v): want its own id in the verdict, 5 rejections", c, v, ok, err)
	}

	// The half-open round begins in that id: one probe is let through and
	// closes the circuit; the id stays (ids are plentiful).
	ln := f.srv.Listen(t, "tcp4", 9402) // the kernel completes handshakes into its backlog
	f.expire(9402)
	if got := errnos(f.dial(9402, 1, 0)); got[0] != 1 {
		t.Fatalf("probe: %v", got)
	}
	f.waitState(f.dynName(9402), "closed", 2*time.Second)
	if c2, _ := f.circuit(f.dynName(9402)); c2.CircuitID != c.CircuitID {
		t.Fatalf("closed again: id %d, want it kept (%d)", c2.CircuitID, c.CircuitID)
	}

	// Opened again, then restarted: the new daemon adopts it with its id.
	ln.Close()
	f.dial(9402, 2, 0)
	f.waitState(f.dynName(9402), "open", 2*time.Second)
	f.restart()
	f.waitState(f.dynName(9402), "open", 2*time.Second)
	if c3, _ := f.circuit(f.dynName(9402)); c3.CircuitID != c.CircuitID {
		t.Fatalf("adopted: id %d, want %d", c3.CircuitID, c.CircuitID)
	}
	if got := errnos(f.dial(9402, 3, 0)); got[unix.EHOSTUNREACH] != 3 {
		t.Fatalf("adopted open circuit: %v, want 3 rejected", got)
	}
}

// expire ends the open duration of the open circuit of port now, as the
// daemon's clock and the kernel's verdict see it: the kernel admits the
// probes of its round from the next connect. Tests that need a probe use
// it instead of sleeping out open_duration, which a slow (emulated)
// machine can outrun before the test has dialled.
func (f *fixture) expire(port uint16) {
	f.t.Helper()
	d := f.d
	d.hold()
	defer d.release()
	c, ok := d.eng.At(f.dest(port))
	if !ok || c.Machine.State() != policy.Open {
		f.t.Fatalf("port %d: no open circuit to expire (%v)", port, c)
	}
	now := d.now()
	round := c.Machine.Round()
	c.Machine.Restore(now, now, round, false)
	d.eng.WriteVerdicts(c, policy.Transition{To: policy.Open, At: now, OpenUntil: now, Round: round})
}

// With ids scarce, what only the kernel shows (the decisions are the
// engine's TestRecordsScarceIDsAreGivenBackAndWaitedFor's, on a fake
// clock): an open circuit with no id is not enforced, its connects reach
// the host; once an id comes free the circuit takes it and the kernel
// rejects for it; and the kernel admits its probes in that id, whose
// budget the previous holder's probe spent.
func TestScarceIDsAreGivenBackAndWaitedFor(t *testing.T) {
	f := newFixture(t, lazyLongConfig)
	d := f.start()
	d.hold()
	d.eng.IDs().SetLimit(3) // ids 1 and 2; scarce from one held
	d.release()

	for _, p := range []uint16{9411, 9412} {
		f.dial(p, 2, 0)
		f.waitState(f.dynName(p), "open", 2*time.Second)
		if got := errnos(f.dial(p, 2, 0)); got[unix.EHOSTUNREACH] != 2 {
			t.Fatalf("port %d open: %v, want both rejected", p, got)
		}
	}
	errsBefore := testutil.ToFloat64(d.metrics.verdictWriteErrors)
	f.dial(9413, 2, 0)
	f.waitState(f.dynName(9413), "open", 2*time.Second)
	if c, _ := f.circuit(f.dynName(9413)); c.CircuitID != 0 {
		t.Fatalf("a third open circuit with two ids: %+v", c)
	}
	if got := errnos(f.dial(9413, 2, 0)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("an open circuit with no id is not enforced: %v, want both connects to reach the host", got)
	}
	if n := testutil.ToFloat64(d.metrics.verdictWriteErrors); n <= errsBefore {
		t.Fatalf("verdict write errors %v, want it counted", n)
	}
	if !strings.Contains(f.logs.String(), "no circuit id free") {
		t.Fatalf("not logged:\n%s", f.logs.String())
	}
	rejectedBefore := f.counter("breakerd_kernel_rejections_total", map[string]string{"target": allTarget})
	if rejectedBefore < 4 {
		t.Fatalf("kernel rejections of all: %v, want at least 4", rejectedBefore)
	}

	// 9411 recovers: the kernel admits its probe, which closes it and,
	// ids being scarce, its id goes back; the per-target count does not
	// go down.
	c11, _ := f.circuit(f.dynName(9411))
	f.srv.ServeHold(t, 9411)
	f.expire(9411)
	if got := errnos(f.dial(9411, 1, 0)); got[0] != 1 {
		t.Fatalf("probe of 9411: %v", got)
	}
	f.waitState(f.dynName(9411), "closed", 2*time.Second)
	if c, _ := f.circuit(f.dynName(9411)); c.CircuitID != 0 {
		t.Fatalf("closed with ids scarce: %+v, want its id given back", c)
	}
	if n := f.counter("breakerd_kernel_rejections_total", map[string]string{"target": allTarget}); n < rejectedBefore {
		t.Fatalf("kernel rejections of all went from %v to %v", rejectedBefore, n)
	}

	// 9413 takes the freed id within the tick's second, and is enforced.
	if !kerneltest.WaitFor(3*time.Second, func() bool { c, _ := f.circuit(f.dynName(9413)); return c.CircuitID == c11.CircuitID }) {
		c, _ := f.circuit(f.dynName(9413))
		t.Fatalf("9413 after an id was freed: %+v, want id %d (logs:\n%s)", c, c11.CircuitID, f.logs.String())
	}
	if got := errnos(f.dial(9413, 2, 0)); got[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("9413 with an id: %v, want both rejected", got)
	}
	// Its probe is admitted in the slot whose budget 9411's probe spent.
	f.srv.ServeHold(t, 9413)
	f.expire(9413)
	if got := errnos(f.dial(9413, 1, 0)); got[0] != 1 {
		t.Fatalf("probe of 9413 in 9411's old id: %v (logs:\n%s)", got, f.logs.String())
	}
	f.waitState(f.dynName(9413), "closed", 2*time.Second)
	if got := errnos(f.dial(9413, 3, 0)); got[0] != 3 {
		t.Fatalf("9413 closed: %v", got)
	}
	// The other open circuit kept its id and its verdict throughout.
	c12, _ := f.circuit(f.dynName(9412))
	if v, ok, err := d.k.Verdict(f.dest(9412)); err != nil || !ok || c12.CircuitID == 0 || v.CircuitID != c12.CircuitID || c12.CircuitID == c11.CircuitID {
		t.Fatalf("9412: %+v, verdict %+v (%v, %v)", c12, v, ok, err)
	}
}

// Limits entries are never written in slot 0: when a reload gives all a
// bulkhead and no id is free for a closed dynamic circuit, its destination
// gets no bulkhead (logged and counted), and no two destinations share one
// count.
func TestNoIDNoSharedBulkhead(t *testing.T) {
	f := newFixture(t, lazyConfig)
	d := f.start()
	ports := []uint16{9431, 9432, 9433, 9434}
	d.hold()
	d.eng.IDs().SetLimit(3) // ids 1 and 2
	now := d.now()
	for _, p := range ports {
		if c, _ := d.eng.Lookup(f.dest(p), now); c == nil || c.ID != 0 {
			d.release()
			t.Fatalf("port %d: %v, want a circuit with no id", p, c)
		}
	}
	d.release()
	f.writeConfig(lazyConfig + "  max_connections: 1\n")
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	limits, err := d.k.AllLimits()
	if err != nil {
		t.Fatal(err)
	}
	var limited, unlimited []uint16
	for _, p := range ports {
		l, ok := limits[f.dest(p)]
		if ok && l.Slot == 0 {
			t.Fatalf("port %d: a limit in slot 0: %+v", p, l)
		}
		if ok {
			limited = append(limited, p)
		} else {
			unlimited = append(unlimited, p)
		}
	}
	if len(limited) != 2 || len(unlimited) != 2 {
		t.Fatalf("limited %v, unlimited %v: want the two ids' circuits limited", limited, unlimited)
	}
	a, b := unlimited[0], unlimited[1]
	f.srv.ServeHold(t, a)
	f.srv.ServeHold(t, b)
	h := f.hold(a, 1)
	defer kill(h)
	if got := errnos(f.dial(b, 1, 0)); got[0] != 1 {
		t.Fatalf("a connect to %d with one held to %d (neither has a bulkhead): %v", b, a, got)
	}
	if !strings.Contains(f.logs.String(), "bulkhead and response options are not enforced for a circuit until one is") {
		t.Fatalf("not logged:\n%s", f.logs.String())
	}
	// Ids come free: the tick writes the two missing limits, each in a
	// slot of its own.
	d.hold()
	d.eng.IDs().SetLimit(5)
	d.release()
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		limits, err := d.k.AllLimits()
		la, oka := limits[f.dest(a)]
		lb, okb := limits[f.dest(b)]
		return err == nil && oka && okb && la.Slot != 0 && lb.Slot != 0 && la.Slot != lb.Slot
	}) {
		limits, _ := d.k.AllLimits()
		t.Fatalf("limits once ids are free: %v", limits)
	}
}

// A rejecting circuit seated by something other than its own verdict (a
// reload's limits, here) has its verdicts written at once.
func TestSeatedByReloadIsEnforced(t *testing.T) {
	f := newFixture(t, lazyConfig)
	d := f.start()
	d.hold()
	d.eng.IDs().SetLimit(3)
	d.release()
	for _, p := range []uint16{9441, 9442, 9443} {
		f.dial(p, 2, 0)
		f.waitState(f.dynName(p), "open", 2*time.Second)
	}
	d.hold()
	d.eng.HoldChecks(d.now().Add(time.Hour)) // no retry from the tick
	d.eng.IDs().SetLimit(4)                  // id 3 comes free
	d.release()
	f.writeConfig(lazyConfig + "  max_connections: 100\n")
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	c, _ := f.circuit(f.dynName(9443))
	if v, ok, err := d.k.Verdict(f.dest(9443)); err != nil || !ok || c.CircuitID == 0 || v.CircuitID != c.CircuitID {
		t.Fatalf("seated by the reload: %+v, verdict %+v (%v, %v)", c, v, ok, err)
	}
	if got := errnos(f.dial(9443, 2, 0)); got[unix.EHOSTUNREACH] == 0 {
		t.Fatalf("9443 after the reload: %v, want rejected", got)
	}
}

// An adopted open verdict whose circuit finds no id (its id went to
// another destination of the same former circuit) is not left pointing at
// that id: it is deleted, the circuit is open here, logged, and enforced
// with an id of its own once one is free.
func TestAdoptedWithoutIDIsEnforcedLater(t *testing.T) {
	named := lazyConfig + `targets:
  svc:
    match: {cidrs: [SRV], ports: ["9451", "9452"]}
    consecutive_failures: 2
    open_duration: 1h
    max_open_duration: 2h
    reject_errno: EHOSTUNREACH
`
	f := newFixture(t, named)
	f.start()
	f.dial(9451, 2, 0)
	f.waitState("svc", "open", 2*time.Second)
	svc, _ := f.circuit("svc")
	f.stop()
	// Without the target both destinations are dynamic; one inherits
	// svc's id, the other finds none (ids 1 to svc's only).
	f.writeConfig(lazyConfig)
	idLimitForTest = svc.CircuitID + 1
	t.Cleanup(func() { idLimitForTest = 0 })
	d := f.start()
	idLimitForTest = 0
	var kept, orphan uint16 = 9451, 9452
	if c, _ := f.circuit(f.dynName(kept)); c.CircuitID != svc.CircuitID {
		kept, orphan = orphan, kept
	}
	if c, _ := f.circuit(f.dynName(kept)); c.CircuitID != svc.CircuitID || c.State != "open" {
		t.Fatalf("the inheriting circuit: %+v, want open with id %d", c, svc.CircuitID)
	}
	c, _ := f.circuit(f.dynName(orphan))
	if c.State != "open" || c.CircuitID != 0 {
		t.Fatalf("the orphan: %+v, want open with no id", c)
	}
	if _, ok, err := d.k.Verdict(f.dest(orphan)); err != nil || ok {
		t.Fatalf("the orphan's verdict is still there (%v, %v): it would spend another circuit's probes", ok, err)
	}
	if !strings.Contains(f.logs.String(), "no circuit id free for an adopted open circuit") {
		t.Fatalf("not logged:\n%s", f.logs.String())
	}
	d.hold()
	d.eng.IDs().SetLimit(svc.CircuitID + 2)
	d.release()
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		v, ok, err := d.k.Verdict(f.dest(orphan))
		return err == nil && ok && v.CircuitID == svc.CircuitID+1
	}) {
		t.Fatalf("the orphan was not enforced once an id was free (logs:\n%s)", f.logs.String())
	}
	if got := errnos(f.dial(orphan, 2, 0)); got[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("the orphan once enforced: %v", got)
	}
}

// A target whose configured state changes across a restart does not keep
// the open verdict the previous daemon left: disabled, its connects pass;
// forced open, its forced-open verdict is not overwritten by the adopted
// one (which would admit probes).
func TestAdoptedVerdictFollowsConfiguredState(t *testing.T) {
	named := `
targets:
  svc:
    match: {cidrs: [SRV], ports: ["9461"]}
    consecutive_failures: 2
    open_duration: 1s
    reject_errno: EHOSTUNREACH
`
	f := newFixture(t, named)
	f.start()
	f.dial(9461, 2, 0)
	f.waitState("svc", "open", 2*time.Second)
	f.stop()
	f.writeConfig(strings.Replace(named, "    consecutive_failures: 2\n", "    consecutive_failures: 2\n    state: disabled\n", 1))
	d := f.start()
	f.waitState("svc", "disabled", 2*time.Second)
	if _, ok, err := d.k.Verdict(f.dest(9461)); err != nil || ok {
		t.Fatalf("disabled after the restart, the open verdict is still there (%v, %v)", ok, err)
	}
	if got := errnos(f.dial(9461, 2, 0)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("disabled: %v, want both connects to reach the host", got)
	}

	f.writeConfig(named)
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	f.dial(9461, 2, 0)
	f.waitState("svc", "open", 2*time.Second)
	f.stop()
	f.writeConfig(strings.Replace(named, "    consecutive_failures: 2\n", "    consecutive_failures: 2\n    state: forced_open\n", 1))
	d = f.start()
	f.waitState("svc", "forced_open", 2*time.Second)
	time.Sleep(1100 * time.Millisecond) // past the adopted verdict's due time
	// A tick after it, with its once-a-second pass, whatever the loop's
	// timing: neither may rewrite the forced verdict.
	d.hold()
	d.eng.Tick(d.now())
	d.eng.RetryUnenforced()
	d.release()
	if v, ok, err := d.k.Verdict(f.dest(9461)); err != nil || !ok || v.State != maps.ForcedOpen {
		t.Fatalf("forced open after the restart: verdict %+v (%v, %v), want forced open", v, ok, err)
	}
	if got := errnos(f.dial(9461, 3, 0)); got[unix.EHOSTUNREACH] != 3 {
		t.Fatalf("forced open: %v, want every connect rejected (no probe)", got)
	}
}

// A reload that takes the limits away takes the circuits that waited for
// an id for them out of the wait: the tick gives them none, and the id
// that comes free goes to the circuit that opens next (review finding).
func TestLimitsReloadedAwayNeedNoID(t *testing.T) {
	f := newFixture(t, lazyConfig)
	d := f.start()
	ports := []uint16{9461, 9462, 9463, 9464}
	d.hold()
	d.eng.IDs().SetLimit(3) // ids 1 and 2
	now := d.now()
	for _, p := range ports {
		d.eng.Lookup(f.dest(p), now)
	}
	d.release()
	f.writeConfig(lazyConfig + "  max_connections: 1\n")
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	d.hold()
	waiting := d.eng.UnlimitedCount()
	d.release()
	if waiting != 2 {
		t.Fatalf("%d circuits wait for an id for their limits, want 2", waiting)
	}
	f.writeConfig(lazyConfig)
	if err := d.Reload(); err != nil {
		t.Fatal(err)
	}
	// The file watcher may apply the earlier file's reload after this one
	// on a slow machine; it then reloads the file as written, so wait.
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		d.hold()
		defer d.release()
		waiting = d.eng.UnlimitedCount()
		return waiting == 0
	}) {
		t.Fatalf("%d circuits still wait for an id after the limits went", waiting)
	}
	d.hold()
	d.eng.IDs().SetLimit(4) // id 3 comes free
	d.eng.RetryUnenforced() // the tick's retry pass gives it to none of them
	d.release()
	f.dial(9466, 2, 0) // refused twice: it opens, and takes id 3
	f.waitState(f.dynName(9466), "open", 2*time.Second)
	f.waitEnforced(9466)
}
