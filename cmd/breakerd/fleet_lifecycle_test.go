package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/breakerd/breakerd/api"
	"github.com/breakerd/breakerd/fleet"
	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/internal/kubeapitest"
	"github.com/breakerd/breakerd/maps"
)

// fleetNodeConfig trips a dynamic circuit on three refused connects and
// shares it with a quorum of two other nodes; OPEN is the node's open
// duration. web is the healthy destination, with a bulkhead whose count
// the test checks.
const fleetNodeConfig = `
failsafe_timeout: 30s
all:
  consecutive_failures: 3
  open_duration: OPEN
  open_duration_multiplier: 1
  max_open_duration: 2h
  jitter: 0
  connect_timeout: 1s
  probe_timeout: 1s
  reject_errno: EHOSTUNREACH
  fleet: {quorum: 2}
targets:
  web:
    match: {cidrs: [SRV], ports: ["8502"]}
    consecutive_failures: 1000
    max_connections: 3
`

// Ports on every node's server host: nothing listens on the fleet's
// (the failing dependency, one destination key fleet-wide: every node's
// server has the same address); web's accepts and holds.
const (
	fleetFailing = 9601
	fleetWeb     = 8502
)

// fleetProc is a breakerd binary acting as a node: its own cgroup, pins,
// admin socket, client network namespace and server host, and a token
// bound to a pod on its node.
type fleetProc struct {
	*harness
	name  string
	token string
	p     *proc
	// The client loop's counts (loop).
	healthyRejected, openAdmitted, healthyOK, openSeen atomic.Int64
}

func (n *fleetProc) dest(port uint16) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(n.topo.Servers[0].IPv4, port)}
}

func (n *fleetProc) key() string { return fmt.Sprintf("tcp/%s", n.dest(fleetFailing).Addr) }

func (n *fleetProc) dial(port uint16, count int) map[unix.Errno]int {
	return errnos(n.topo.Client.Dial(n.t, n.cg, kerneltest.DialSpec{Network: "tcp4", Addr: n.dest(port).Addr, Count: count, Timeout: time.Second}))
}

// get decodes GET path of the node's admin socket into out.
func (n *fleetProc) get(path string, out any) error {
	c := http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", n.socket)
	}}}
	resp, err := c.Get("http://breakerd" + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

func (n *fleetProc) circuit() api.CircuitInfo {
	var ci api.CircuitInfo
	_ = n.get("/v1/circuits/"+n.key(), &ci)
	return ci
}

// event returns the latest transition of the node's circuit to state to
// in the running daemon's events.
func (n *fleetProc) event(to string) (api.TransitionEvent, bool) {
	var evs []api.TransitionEvent
	if err := n.get("/v1/events", &evs); err != nil {
		return api.TransitionEvent{}, false
	}
	for i := len(evs) - 1; i >= 0; i-- {
		if evs[i].Circuit == n.key() && evs[i].To == to {
			return evs[i], true
		}
	}
	return api.TransitionEvent{}, false
}

func (n *fleetProc) waitState(state string, within time.Duration) {
	n.t.Helper()
	if !kerneltest.WaitFor(within, func() bool { return n.circuit().State == state }) {
		n.t.Fatalf("%s: the circuit is %q, want %s (logs:\n%s)", n.name, n.circuit().State, state, n.p.logs.String())
	}
}

func (n *fleetProc) sigterm() {
	n.t.Helper()
	n.p.cmd.Process.Signal(syscall.SIGTERM)
	if err := n.p.cmd.Wait(); err != nil {
		n.t.Fatalf("%s on SIGTERM: %v\n%s", n.name, err, n.p.logs.String())
	}
}

// reload rewrites the node's configuration with one change (a threshold
// its open circuit does not depend on) and sends SIGHUP.
func (n *fleetProc) reload(open string) {
	n.t.Helper()
	before := strings.Count(n.p.logs.String(), "configuration reloaded")
	cfg := strings.Replace(strings.ReplaceAll(fleetNodeConfig, "OPEN", open), "consecutive_failures: 1000", "consecutive_failures: 999", 1)
	if err := os.WriteFile(n.args[1], []byte(strings.ReplaceAll(cfg, "SRV", n.topo.Servers[0].IPv4.String())), 0o644); err != nil {
		n.t.Fatal(err)
	}
	n.p.cmd.Process.Signal(syscall.SIGHUP)
	if !kerneltest.WaitFor(5*time.Second, func() bool { return strings.Count(n.p.logs.String(), "configuration reloaded") > before }) {
		n.t.Fatalf("%s: no reload:\n%s", n.name, n.p.logs.String())
	}
}

// secondStart runs a second breakerd on the node's pins and cgroup, with
// its node name and credentials: it must be refused, and change nothing.
func (n *fleetProc) secondStart() {
	n.t.Helper()
	args := slices.Clone(n.args)
	args[slices.Index(args, "--admin-socket")+1] = ""
	ctx, cancel := context.WithTimeout(n.t.Context(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, n.bin, args...).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "another breakerd") {
		n.t.Fatalf("%s: a second breakerd on the same pins: %v\n%s", n.name, err, out)
	}
}

// loop connects to the healthy destination and to the failing one, one
// after the other, until stop is set.
func (n *fleetProc) loop(stop *atomic.Bool, wg *sync.WaitGroup) {
	wg.Go(func() {
		for !stop.Load() {
			for e, c := range n.dial(fleetWeb, 10) {
				if e != 0 {
					n.healthyRejected.Add(int64(c))
				} else {
					n.healthyOK.Add(int64(c))
				}
			}
			// Many: rejected connects take microseconds, and a gap in
			// enforcement across a restart lasts milliseconds.
			for e, c := range n.dial(fleetFailing, 2000) {
				n.openSeen.Add(int64(c))
				if e != unix.EHOSTUNREACH {
					n.openAdmitted.Add(int64(c))
				}
			}
		}
	})
}

// check asserts the lifecycle's invariants on the node after step: no
// healthy connect rejected, no connect to the open circuit through, the
// pinned verdicts exactly the open circuit's (state want), the bulkhead
// counting the held sockets.
func (n *fleetProc) check(step string, want maps.State, held int64) {
	n.t.Helper()
	before := n.healthyOK.Load() + n.openSeen.Load()
	if !kerneltest.WaitFor(10*time.Second, func() bool { return n.healthyOK.Load()+n.openSeen.Load() >= before+2040 }) {
		n.t.Fatalf("%s: %s: the client loop made no progress", step, n.name)
	}
	if c := n.healthyRejected.Load(); c != 0 {
		n.t.Fatalf("%s: %s: %d connects to the healthy destination were rejected", step, n.name, c)
	}
	if c := n.openAdmitted.Load(); c != 0 {
		n.t.Fatalf("%s: %s: %d connects to the open circuit got through (logs:\n%s)", step, n.name, c, n.p.logs.String())
	}
	v, err := maps.OpenPinned(n.bpffs)
	if err != nil {
		n.t.Fatalf("%s: %s: %v", step, n.name, err)
	}
	defer v.Close()
	verdicts, err := v.AllVerdicts()
	failing := n.dest(fleetFailing)
	if err != nil || len(verdicts) != 1 || verdicts[failing].State != want {
		n.t.Fatalf("%s: %s: pinned verdicts %v (%v), want exactly %s's in state %v", step, n.name, verdicts, err, failing, want)
	}
	if m, err := v.VerdictMask(); err != nil || m != maps.MaskOf([]maps.Dest{failing}) {
		n.t.Fatalf("%s: %s: the pinned verdict mask is %#x (%v), want the one verdict's bits", step, n.name, m, err)
	}
	limits, err := v.AllLimits()
	lim, ok := limits[n.dest(fleetWeb)]
	if err != nil || len(limits) != 1 || !ok {
		n.t.Fatalf("%s: %s: pinned limits %v (%v), want web's alone", step, n.name, limits, err)
	}
	var got maps.BulkCount
	if !kerneltest.WaitFor(3*time.Second, func() bool { got, _ = v.BulkCount(lim.Slot); return got.Connections == held }) {
		n.t.Fatalf("%s: %s: web's slot counts %+v, the test holds %d sockets", step, n.name, got, held)
	}
}

// reportLog records every version of every report the API server
// serves, as a watch delivers them.
type reportLog struct {
	mu       sync.Mutex
	versions map[string][][]string // node → the keys of each version
	deleted  []string
}

func (l *reportLog) observe(r *fleet.CircuitReport) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var keys []string
	for _, c := range r.Spec.Circuits {
		keys = append(keys, c.Key)
	}
	l.versions[r.Name] = append(l.versions[r.Name], keys)
}

func (l *reportLog) of(node string) [][]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.versions[node])
}

func (l *reportLog) nodes() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var names []string
	for n := range l.versions {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// TestFleetLifecycle runs three breakerd binaries as three nodes of one
// fleet on a real kube-apiserver, each with a token bound to a pod on its
// node (the admission policy in force), a client in its own network
// namespace and a server that refuses connects. Nodes a and b trip; c
// follows. Then, with client loops on a (a reporter, open for an hour)
// and c (the follower), each of them is restarted by SIGTERM, reloaded
// and started a second time on the same pins, and after every step the
// lifecycle's invariants hold on both: no healthy connect rejected, no
// connect to the open circuit through, the pinned verdicts and the
// bulkhead's count exact; c's follow never ends and a's report never
// loses its circuit nor lists it twice. Last, b (whose circuit, open 2 s
// at a time, it keeps reopening by probing) is killed by SIGKILL: its
// report stays as it was, and c's follow ends at its entry's open-until,
// while a still reports the circuit open: nothing b wrote counts after
// it.
func TestFleetLifecycle(t *testing.T) {
	kerneltest.RequireKernel(t)
	kapi := kubeapitest.Start(t)
	kapi.InstallCRD(t, "fleet-crd.yaml")
	for _, file := range []string{"namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "fleet-policy.yaml"} {
		kapi.Apply(t, file)
	}
	bin := buildBreakerd(t)
	suffix := strings.ToLower(kerneltest.UniqueName())
	var nodes []*fleetProc
	for i, open := range []string{"1h", "2s", "1h"} {
		n := &fleetProc{harness: newHarnessOf(t, bin, strings.ReplaceAll(fleetNodeConfig, "OPEN", open)), name: fmt.Sprintf("node-%c-%s", 'a'+i, suffix)}
		n.topo.Servers[0].ServeHold(t, fleetWeb)
		n.token = kapi.NodeToken(t, "breakerd", "breakerd", n.name)
		n.args = append(n.args, "--kubeconfig", kapi.TokenKubeconfig(t, n.token), "--node-name", n.name)
		nodes = append(nodes, n)
	}
	a, b, c := nodes[0], nodes[1], nodes[2]
	// The admission policy is in force before any daemon writes: a's
	// token is refused writing b's report.
	storeA, err := fleet.NewKubeStore(kapi.TokenConfig(a.token))
	if err != nil {
		t.Fatal(err)
	}
	var werr error
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		werr = storeA.Apply(context.Background(), &fleet.CircuitReport{
			ObjectMeta: metav1.ObjectMeta{Name: b.name}, Spec: fleet.ReportSpec{Circuits: []fleet.Circuit{}}})
		return apierrors.IsForbidden(werr) && strings.Contains(werr.Error(), "may write only the CircuitReport named "+a.name)
	}) {
		t.Fatalf("the admission policy is not in force: a writing b's report: %v", werr)
	}

	// Every version of every report, from here on.
	reports := &reportLog{versions: map[string][][]string{}}
	ctx, cancel := context.WithCancel(context.Background())
	w, err := fleet.NewWatcher(kapi.Admin, reports.observe, func(node string) {
		reports.mu.Lock()
		reports.deleted = append(reports.deleted, node)
		reports.mu.Unlock()
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	watched := make(chan struct{})
	go func() { w.Run(ctx); close(watched) }()
	t.Cleanup(func() { cancel(); <-watched })

	for _, n := range nodes {
		n.p = n.start()
	}
	names := []string{a.name, b.name, c.name}
	if !kerneltest.WaitFor(10*time.Second, func() bool { return slices.Equal(reports.nodes(), names) }) {
		t.Fatalf("reports %v, want one of each node %v (a's logs:\n%s)", reports.nodes(), names, a.p.logs.String())
	}

	// a and b trip; b keeps probing (a connect every 100 ms), so that its
	// circuit, open 2 s at a time, stays open and reported.
	for _, n := range []*fleetProc{a, b} {
		if got := n.dial(fleetFailing, 3); got[unix.ECONNREFUSED] != 3 {
			t.Fatalf("%s: connects %v, want 3 refused by the server", n.name, got)
		}
		n.waitState("open", 3*time.Second)
	}
	var stopB atomic.Bool
	var wgB sync.WaitGroup
	wgB.Go(func() {
		for !stopB.Load() {
			b.dial(fleetFailing, 1)
			time.Sleep(100 * time.Millisecond)
		}
	})
	t.Cleanup(func() { stopB.Store(true); wgB.Wait() })
	c.waitState("fleet_open", 5*time.Second)
	bOpened, _ := b.event("open")
	cOpened, _ := c.event("fleet_open")
	t.Logf("c followed %v after b's transition made the quorum", cOpened.Time.Sub(bOpened.Time).Round(time.Millisecond))

	// The lifecycle, with client loops on the reporter a and the
	// follower c, and two sockets held to web on each.
	var stop atomic.Bool
	var wg sync.WaitGroup
	for _, n := range []*fleetProc{a, c} {
		holder := n.topo.Client.StartDial(t, n.cg, kerneltest.DialSpec{Network: "tcp4", Addr: n.dest(fleetWeb).Addr, Count: 2, Parallel: 2, Hold: time.Minute})
		t.Cleanup(func() { holder.Cmd.Process.Kill(); holder.Cmd.Wait() })
		n.loop(&stop, &wg)
	}
	t.Cleanup(func() { stop.Store(true); wg.Wait() })
	check := func(step string) {
		t.Helper()
		a.check(step, maps.Open, 2)
		c.check(step, maps.ForcedOpen, 2)
		if ci := c.circuit(); ci.State != "fleet_open" {
			t.Fatalf("%s: c's circuit is %s, want fleet_open", step, ci.State)
		}
		if !kerneltest.WaitFor(5*time.Second, func() bool { ci := c.circuit(); return ci.State == "fleet_open" && ci.FleetNodes == 2 }) {
			t.Fatalf("%s: c does not count a and b: %+v", step, c.circuit())
		}
		var evs []api.TransitionEvent
		if err := c.get("/v1/events", &evs); err != nil {
			t.Fatalf("%s: c's events: %v", step, err)
		}
		for _, ev := range evs {
			if ev.Circuit == c.key() && ev.To != "fleet_open" {
				t.Fatalf("%s: c's circuit went %s: %+v", step, ev.To, ev)
			}
		}
		// Every version a wrote since it tripped lists the circuit once.
		vs := reports.of(a.name)
		first := slices.IndexFunc(vs, func(keys []string) bool { return len(keys) > 0 })
		if first < 0 {
			t.Fatalf("%s: a's report never listed its circuit: %v", step, vs)
		}
		for _, keys := range vs[first:] {
			if !slices.Equal(keys, []string{a.key()}) {
				t.Fatalf("%s: a's report went %v after listing its circuit (every version: %v)", step, keys, vs)
			}
		}
		reports.mu.Lock()
		deleted := slices.Clone(reports.deleted)
		reports.mu.Unlock()
		if got := reports.nodes(); !slices.Equal(got, names) || len(deleted) > 0 {
			t.Fatalf("%s: reports %v (deleted %v), want one of each node %v", step, got, deleted, names)
		}
	}
	check("c follows")

	c.sigterm()
	c.p = c.start()
	check("the follower restarted by SIGTERM")
	// It kept the follow its predecessor left in the kernel, and
	// confirmed it from the reports: no new transition.
	var evs []api.TransitionEvent
	if err := c.get("/v1/events", &evs); err != nil || len(evs) != 1 || evs[0].Reason != "adopted_from_kernel" {
		t.Fatalf("the restarted follower's transitions %+v (%v): want its follow adopted from the kernel alone", evs, err)
	}
	c.reload("1h")
	check("the follower reloaded")
	c.secondStart()
	check("a second start on the follower's pins")

	aWrites := len(reports.of(a.name))
	a.sigterm()
	a.p = a.start()
	check("the reporter restarted by SIGTERM")
	a.reload("1h")
	check("the reporter reloaded")
	before := len(reports.of(a.name))
	a.secondStart()
	check("a second start on the reporter's pins")
	if n := len(reports.of(a.name)); n != before {
		t.Fatalf("a second start on a's pins wrote a's report: %v", reports.of(a.name)[before:])
	}
	t.Logf("a's report: %d versions written across its restart, reload and second start", len(reports.of(a.name))-aWrites)
	stop.Store(true)
	wg.Wait()

	// SIGKILL b: no clean-up; its report stays as it was, and counts
	// until its entry's open-until.
	stopB.Store(true)
	wgB.Wait()
	b.p.cmd.Process.Signal(syscall.SIGKILL)
	b.p.cmd.Wait()
	store, err := fleet.NewKubeStore(kapi.Admin)
	if err != nil {
		t.Fatal(err)
	}
	left, err := store.Get(context.Background(), b.name)
	if err != nil || len(left.Spec.Circuits) != 1 || left.Spec.Circuits[0].Key != b.key() {
		t.Fatalf("b's report after SIGKILL: %+v, %v: want its circuit still listed", left, err)
	}
	until := left.Spec.Circuits[0].OpenUntil.Time
	if !kerneltest.WaitFor(time.Until(until)+3*time.Second, func() bool { _, ok := c.event("closed"); return ok }) {
		t.Fatalf("c's follow did not end after b's entry expired at %v (logs:\n%s)", until, c.p.logs.String())
	}
	closed, _ := c.event("closed")
	t.Logf("c's follow ended %v after the killed node's open-until", closed.Time.Sub(until).Round(time.Millisecond))
	if closed.Time.Before(until) || closed.Time.Sub(until) > 500*time.Millisecond {
		t.Errorf("c's follow ended at %v, want at b's open-until %v", closed.Time, until)
	}
	if ci := a.circuit(); ci.State != "open" {
		t.Errorf("a's circuit is %s, want open (reported)", ci.State)
	}
	if ci := c.circuit(); ci.State != "closed" || ci.FleetNodes != 0 {
		t.Errorf("c's circuit after b's entry expired: %+v", ci)
	}
	if got := c.dial(fleetFailing, 1); got[unix.ECONNREFUSED] != 1 {
		t.Errorf("c's connect after its follow ended: %v, want it through to the server", got)
	}
}
