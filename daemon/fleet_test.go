package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/breakerd/breakerd/fleet"
	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/internal/kubeapitest"
	"github.com/breakerd/breakerd/kube"
	"github.com/breakerd/breakerd/maps"
)

// fleetConfig trips on three refused connects, stays open 3 s, and
// shares its circuits with a quorum of two other nodes.
const fleetConfig = `
all:
  consecutive_failures: 3
  open_duration: 3s
  jitter: 0
  connect_timeout: 1s
  probe_timeout: 1s
  reject_errno: EHOSTUNREACH
  fleet: {quorum: 2}
`

// fleetPort is the failing server's port on every node's server host
// (each node has one of its own, at the same address: one destination
// key fleet-wide).
const fleetPort = 9601

// fleetNode is one daemon acting as a node: its own cgroup, pins, admin
// socket, client network namespace and server host, and its own node
// name on the shared API server.
type fleetNode struct {
	*fixture
	name string
}

// newFleetNodes starts an API server with deploy/'s CircuitReport CRD,
// breakerd's service account and RBAC, and the admission policy that
// lets a node write only its own report, and n daemons on it, each with
// a token bound to a pod on its node (as a DaemonSet's pod has): the
// policy is in force for every write of the scenario.
func newFleetNodes(t *testing.T, n int, yaml string) (*kubeapitest.Server, []*fleetNode) {
	t.Helper()
	kerneltest.RequireKernel(t)
	api := kubeapitest.Start(t)
	api.InstallCRD(t, "fleet-crd.yaml")
	for _, file := range []string{"namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "fleet-policy.yaml"} {
		api.Apply(t, file)
	}
	var nodes []*fleetNode
	for i := range n {
		f := newFixture(t, yaml)
		name := fmt.Sprintf("node-%c-%s", 'a'+i, strings.ToLower(kerneltest.UniqueName()))
		token := api.NodeToken(t, "breakerd", "breakerd", name)
		if i == 0 {
			waitOwnReportOnly(t, api, token, name)
		}
		cl, err := kube.New(kube.Options{Config: api.TokenConfig(token), NodeName: name, ProbeInterval: 200 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(f.logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		f.cluster = cl
		nodes = append(nodes, &fleetNode{fixture: f, name: name})
	}
	for _, nd := range nodes {
		nd.start()
		if !kerneltest.WaitFor(10*time.Second, func() bool { return nd.link() != nil && nd.link().Synced() }) {
			t.Fatalf("%s: the fleet's reports were not listed (logs:\n%s)", nd.name, nd.logs.String())
		}
	}
	return api, nodes
}

// waitOwnReportOnly waits until the API server enforces the admission
// policy (it loads a new one within a second or so): node's token is
// refused writing another node's report.
func waitOwnReportOnly(t *testing.T, api *kubeapitest.Server, token, node string) {
	t.Helper()
	store, err := fleet.NewKubeStore(api.TokenConfig(token))
	if err != nil {
		t.Fatal(err)
	}
	other := &fleet.CircuitReport{Spec: fleet.ReportSpec{Circuits: []fleet.Circuit{}}}
	other.Name = "not-" + node
	var werr error
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		werr = store.Apply(context.Background(), other)
		return apierrors.IsForbidden(werr) && strings.Contains(werr.Error(), "may write only the CircuitReport named "+node)
	}) {
		t.Fatalf("the admission policy is not in force: %s writing another node's report: %v", node, werr)
	}
}

func (nd *fleetNode) link() *kube.Fleet {
	nd.d.hold()
	defer nd.d.release()
	return nd.d.fleet.link
}

// nodes is how many other nodes the node counts with key open.
func (nd *fleetNode) nodes(key string) int { return nd.link().Nodes(key, time.Now()) }

func (nd *fleetNode) key() string { return nd.dynName(fleetPort) }

// verdict returns the node's kernel verdict for the failing server.
func (nd *fleetNode) verdict() (maps.Verdict, bool) {
	nd.t.Helper()
	v, ok, err := nd.d.Kernel().Verdict(nd.dest(fleetPort))
	if err != nil {
		nd.t.Fatal(err)
	}
	return v, ok
}

// trip fails consecutive_failures connects to the refusing server and
// waits for the circuit to open.
func (nd *fleetNode) trip() {
	nd.t.Helper()
	if got := errnos(nd.dial(fleetPort, 3, time.Second)); got[unix.ECONNREFUSED] != 3 {
		nd.t.Fatalf("%s: connects %v, want 3 refused by the server", nd.name, got)
	}
	nd.waitState(nd.key(), "open", 3*time.Second)
}

// event returns the time of the node's latest transition of its circuit
// to state to (false: none).
func (nd *fleetNode) event(to string) (time.Time, bool) {
	evs := nd.d.Events()
	for i := len(evs) - 1; i >= 0; i-- {
		if evs[i].Circuit == nd.key() && evs[i].To == to {
			return evs[i].Time, true
		}
	}
	return time.Time{}, false
}

// TestFleetQuorumOpensFollowers runs three daemons as three nodes on one
// real kube-apiserver, each with a client in its own network namespace
// and a server that refuses connects. One node's report opens nothing
// elsewhere; once a second node trips, the third opens within a second
// of its transition with no failed connect of its own: its connects are
// refused in connect() (breakerd's errno, no SYN at its server), its
// circuit is fleet_open by 2 nodes of a quorum of 2, and its report
// stays empty. When the server recovers, only the reporters probe, and
// the follower closes within a second of the last reporter closing.
func TestFleetQuorumOpensFollowers(t *testing.T) {
	_, nodes := newFleetNodes(t, 3, fleetConfig)
	a, b, c := nodes[0], nodes[1], nodes[2]
	key := a.key()

	a.trip()
	if !kerneltest.WaitFor(5*time.Second, func() bool { return c.nodes(key) == 1 && b.nodes(key) == 1 }) {
		t.Fatalf("a's report was not seen: c counts %d, b counts %d (a's logs:\n%s)", c.nodes(key), b.nodes(key), a.logs.String())
	}
	// Seen by the others, and one node is below the quorum: nothing opens.
	if _, ok := c.verdict(); ok {
		t.Fatal("one node's report opened another node's circuit")
	}
	if ci, ok := b.circuit(key); ok && ci.State != "closed" {
		t.Fatalf("one node's report: b's circuit is %s", ci.State)
	}

	b.trip()
	bOpened, _ := b.event("open")
	if !kerneltest.WaitFor(3*time.Second, func() bool { _, ok := c.verdict(); return ok }) {
		t.Fatalf("a quorum of two reports did not open the third node's circuit (logs:\n%s)", c.logs.String())
	}
	cOpened, ok := c.event("fleet_open")
	if !ok {
		t.Fatalf("no fleet_open transition in %+v", c.d.Events())
	}
	lag := cOpened.Sub(bOpened)
	t.Logf("the follower opened %v after the second reporter's transition", lag)
	if lag > time.Second {
		t.Errorf("the follower opened %v after the quorum's second report, want within 1 s", lag)
	}
	if v, _ := c.verdict(); v.State != maps.ForcedOpen {
		t.Errorf("the follower's verdict %+v: want the forced-open shape (no probes)", v)
	}
	ci, _ := c.circuit(key)
	if ci.State != "fleet_open" || ci.FleetNodes != 2 || ci.FleetQuorum != 2 || ci.OpenUntil.IsZero() {
		t.Errorf("the follower's circuit: %s, fleet %d/%d nodes, until %v", ci.State, ci.FleetNodes, ci.FleetQuorum, ci.OpenUntil)
	}
	res := c.dial(fleetPort, 5, time.Second)
	if got := errnos(res); got[unix.EHOSTUNREACH] != 5 {
		t.Fatalf("the follower's connects: %v, want 5 refused by breakerd", got)
	}
	if syns := c.srv.SYNs(t); syns != 0 {
		t.Fatalf("%d SYNs reached the follower's server: its connects must be refused in connect()", syns)
	}
	if n := a.nodes(key); n != 1 {
		t.Errorf("a counts %d other nodes with the circuit open, want 1 (b; the follower reports nothing)", n)
	}
	// A reload that drops the fleet block ends the follow; one that
	// brings it back follows again, from the reports already seen.
	c.writeConfig(strings.Replace(fleetConfig, "  fleet: {quorum: 2}\n", "", 1))
	if err := c.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(2*time.Second, func() bool { _, ok := c.verdict(); return !ok }) {
		t.Fatal("a reload without the fleet block left the follow in place")
	}
	c.writeConfig(fleetConfig)
	if err := c.d.Reload(); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(2*time.Second, func() bool { _, ok := c.verdict(); return ok }) {
		t.Fatal("a reload that brought the fleet block back did not follow again")
	}
	paidA, paidB := a.srv.SYNs(t), b.srv.SYNs(t)
	t.Logf("failures paid before every node rejects: a %d, b %d, c 0 (without the fleet: 3 each)", paidA, paidB)

	// The server recovers; the reporters probe once they are due.
	for _, nd := range nodes {
		nd.srv.Listen(t, "tcp4", fleetPort)
	}
	for _, nd := range []*fleetNode{a, b} {
		if !kerneltest.WaitFor(6*time.Second, func() bool {
			nd.dial(fleetPort, 1, time.Second)
			ci, _ := nd.circuit(key)
			return ci.State == "closed"
		}) {
			t.Fatalf("%s did not close on its probe (logs:\n%s)", nd.name, nd.logs.String())
		}
	}
	bClosed, _ := b.event("closed")
	if !kerneltest.WaitFor(3*time.Second, func() bool { _, ok := c.verdict(); return !ok }) {
		t.Fatalf("the follower did not close after the reporters (logs:\n%s)", c.logs.String())
	}
	cClosed, _ := c.event("closed")
	t.Logf("the follower closed %v after the last reporter (negative: before it, once fewer than the quorum were left)", cClosed.Sub(bClosed))
	if cClosed.Sub(bClosed) > time.Second {
		t.Errorf("the follower closed %v after the last reporter closed, want within 1 s", cClosed.Sub(bClosed))
	}
	if syns := c.srv.SYNs(t); syns != 0 {
		t.Errorf("%d SYNs reached the follower's server while it followed: a follower must not probe", syns)
	}
	for _, ev := range c.d.Events() {
		if ev.Circuit == key && slices.Contains([]string{"half_open", "open"}, ev.To) {
			t.Errorf("the follower's circuit went %s: %+v", ev.To, ev)
		}
	}
	t.Logf("probes at recovery: a %d, b %d SYNs after its failures, c 0", a.srv.SYNs(t)-paidA, b.srv.SYNs(t)-paidB)
	if got := errnos(c.dial(fleetPort, 1, time.Second)); got[0] != 1 {
		t.Errorf("the closed follower's connect: %v, want it through", got)
	}
}

// TestFleetFollowAcrossRestartAndAPIOutage: a follower restarted as by
// SIGTERM keeps its follow through the restart (no connect through, no
// SYN at its server) and confirms it once it has listed the reports;
// then, with the API server gone, the reporters' local breaking is
// unchanged (they reject, trip again on their probes, and count their
// failed writes) and the follow ends at its open-until, when the
// reporters' entries expire, without any report to say so, and the
// follower counts its failed reads. Last, the API server is started
// again on the same store: the reporters write again, and the follower
// follows again.
func TestFleetFollowAcrossRestartAndAPIOutage(t *testing.T) {
	api, nodes := newFleetNodes(t, 3, fleetConfig)
	a, b, c := nodes[0], nodes[1], nodes[2]
	key := a.key()
	a.trip()
	b.trip()
	c.waitState(key, "fleet_open", 3*time.Second)

	c.restart()
	if v, ok := c.verdict(); !ok || v.State != maps.ForcedOpen {
		t.Fatalf("after the restart the follower's verdict is %+v (%v): its follow was not kept", v, ok)
	}
	if evs := c.d.Events(); len(evs) == 0 || evs[0].To != "fleet_open" || evs[0].Reason != "adopted_from_kernel" {
		t.Fatalf("the restarted follower's first transitions %+v: want its follow adopted from the kernel", evs)
	}
	if got := errnos(c.dial(fleetPort, 3, time.Second)); got[unix.EHOSTUNREACH] != 3 {
		t.Fatalf("the restarted follower's connects: %v, want 3 refused by breakerd", got)
	}
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		ci, _ := c.circuit(key)
		return c.link() != nil && c.link().Synced() && ci.State == "fleet_open" && ci.FleetNodes == 2
	}) {
		ci, _ := c.circuit(key)
		t.Fatalf("the restarted follower did not confirm its follow: %+v (logs:\n%s)", ci, c.logs.String())
	}
	if syns := c.srv.SYNs(t); syns != 0 {
		t.Fatalf("%d SYNs reached the follower's server across its restart", syns)
	}

	ci, _ := c.circuit(key)
	until := ci.OpenUntil
	api.Stop()
	// The reporters break as before: they reject while open, and their
	// probes (the server still refuses) reopen them.
	if got := errnos(a.dial(fleetPort, 1, time.Second)); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("a's connect with the API down: %v, want it refused by breakerd", got)
	}
	if !kerneltest.WaitFor(8*time.Second, func() bool {
		a.dial(fleetPort, 1, time.Second)
		_, ok := a.event("half_open")
		return ok && a.link().Stats().Errors > 0
	}) {
		t.Fatalf("a did not probe and fail to write with the API down: stats %+v (logs:\n%s)", a.link().Stats(), a.logs.String())
	}
	if ci, _ := a.circuit(key); ci.State != "open" {
		t.Errorf("a after its failed probe: %s, want open again", ci.State)
	}
	if !kerneltest.WaitFor(time.Until(until)+3*time.Second, func() bool { _, ok := c.event("closed"); return ok }) {
		t.Fatalf("the follow did not end with the API down (until %v; logs:\n%s)", until, c.logs.String())
	}
	closed, _ := c.event("closed")
	t.Logf("the follow ended %v after its open-until", closed.Sub(until))
	if closed.Before(until) || closed.Sub(until) > 500*time.Millisecond {
		t.Errorf("the follow ended at %v, want at its open-until %v", closed, until)
	}
	if _, ok := c.verdict(); ok {
		t.Error("the follower's verdict stayed after its follow ended")
	}
	// The follower counted its failed reads of the reports.
	if s := c.link().Stats(); s.ListErrors+s.WatchErrors == 0 {
		t.Errorf("the follower counted no failed list or watch with the API down: %+v", s)
	}

	// The API server comes back (same address, same store): the nodes
	// pick it up, the reporters' writes go through again (a and b, still
	// failing, probe and reopen), and a new quorum opens the follower.
	api.Restart(t)
	restarted := time.Now()
	if !kerneltest.WaitFor(30*time.Second, func() bool {
		a.dial(fleetPort, 1, time.Second)
		b.dial(fleetPort, 1, time.Second)
		ev, ok := c.event("fleet_open")
		return ok && ev.After(restarted)
	}) {
		t.Fatalf("the restarted API server was not picked up: c follows nothing (a %+v, b %+v, c %+v; c's logs:\n%s)",
			a.link().Stats(), b.link().Stats(), c.link().Stats(), c.logs.String())
	}
	followed, _ := c.event("fleet_open")
	t.Logf("the follower followed again %v after the API server restarted (read errors while it was down: %+v)",
		followed.Sub(restarted).Round(time.Millisecond), c.link().Stats())
	if v, ok := c.verdict(); !ok || v.State != maps.ForcedOpen {
		t.Errorf("the follower's verdict after the API server came back: %+v (%v)", v, ok)
	}
	if got := errnos(c.dial(fleetPort, 3, time.Second)); got[unix.EHOSTUNREACH] != 3 {
		t.Errorf("the follower's connects after the API server came back: %v, want 3 refused by breakerd", got)
	}
}
