package engine_test

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/fleet"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// fleetOptions are options() with a fleet block of quorum 2 and a probe
// timeout of 2 s.
func fleetOptions() *policy.Options {
	o := options()
	o.Fleet = policy.FleetOptions{Enabled: true, Quorum: 2}
	o.ProbeTimeout = 2 * time.Second
	return o
}

// follow applies verdicts, making port circuits by key.
func (c *core) follow(f *engine.Follower, o *policy.Options, vs ...engine.FleetVerdict) (opened, closed int) {
	c.t.Helper()
	return f.Apply(vs, c.clk.Now(), func(key string) *engine.Circuit {
		d, ok := engine.ParseDynamicName(key)
		if !ok {
			return nil
		}
		return c.circuit(d.Addr.Port(), o)
	})
}

func (c *core) lastTransition() policy.Transition {
	c.t.Helper()
	if len(c.hooks.transitions) == 0 {
		c.t.Fatal("no transition")
	}
	return c.hooks.transitions[len(c.hooks.transitions)-1]
}

// A quorum's verdict opens a circuit this node never sent traffic to, at
// once: fleet_open, reason fleet_quorum, a forced-open-shaped verdict
// (which never probes) and nothing in the pinned overrides map; it is
// not in the node's own report. Once the verdict is gone it closes
// (fleet_quorum_lost) and its verdict goes.
func TestFollowOpensWithoutProbesAndCloses(t *testing.T) {
	c := newCore(t, 8, nil)
	o := fleetOptions()
	f := engine.NewFollower(c.e)
	key := engine.DynamicName(dest(9501))
	until := c.clk.Now().Add(5 * time.Second)
	if opened, _ := c.follow(f, o, engine.FleetVerdict{Key: key, Nodes: 2, Quorum: 2, Until: until}); opened != 1 {
		t.Fatalf("opened %d, want 1", opened)
	}
	x, _ := c.e.At(dest(9501))
	tr := c.lastTransition()
	if x.Machine.State() != policy.FleetOpen || tr.To != policy.FleetOpen || tr.Reason != policy.ReasonFleetQuorum || !tr.OpenUntil.Equal(until) {
		t.Fatalf("state %s, transition %+v", x.Machine.State(), tr)
	}
	v := c.verdict(dest(9501))
	if v.State != maps.ForcedOpen || v.CircuitID == 0 || v.CircuitID != x.ID {
		t.Fatalf("verdict %+v (circuit id %d): want the forced-open shape, which never probes", v, x.ID)
	}
	if c.k.Calls("PutOverride") != 0 {
		t.Fatal("an override was kept: a follow is no operator override")
	}
	if fv, ok := f.Of(x); !ok || fv.Nodes != 2 || fv.Quorum != 2 || f.Count() != 1 {
		t.Fatalf("Of: %+v %v, count %d", fv, ok, f.Count())
	}
	if st := x.Machine.Status(c.clk.Now()); !st.OpenUntil.Equal(until) {
		t.Fatalf("status open until %v, want %v", st.OpenUntil, until)
	}
	if r := f.Reported(c.clk.Now()); len(r) != 0 {
		t.Fatalf("reported %+v: a follow is not own evidence", r)
	}
	// Renewed: no transition, a later until.
	n := len(c.hooks.transitions)
	later := until.Add(3 * time.Second)
	c.follow(f, o, engine.FleetVerdict{Key: key, Nodes: 3, Quorum: 2, Until: later})
	if len(c.hooks.transitions) != n || !x.Machine.Status(c.clk.Now()).OpenUntil.Equal(later) {
		t.Fatalf("renewal: %d transitions (want %d), until %v", len(c.hooks.transitions), n, x.Machine.Status(c.clk.Now()).OpenUntil)
	}
	if _, closed := c.follow(f, o); closed != 1 {
		t.Fatalf("closed %d, want 1", closed)
	}
	if tr := c.lastTransition(); x.Machine.State() != policy.Closed || tr.Reason != policy.ReasonFleetQuorumLost || c.hasVerdict(dest(9501)) || f.Count() != 0 {
		t.Fatalf("after the quorum went: %s, %+v, verdict %v", x.Machine.State(), tr, c.hasVerdict(dest(9501)))
	}
}

// Own evidence wins: a circuit open on this node's own failures is not
// followed, and the fleet does not close it; it is what the node
// reports, counting until its open duration ends plus a probe_timeout
// (and the write margin), through a round that begins soon after, and
// from a later round's beginning.
func TestOwnEvidenceWinsAndIsReported(t *testing.T) {
	c := newCore(t, 8, nil)
	o := fleetOptions()
	o.HalfOpenSuccessThreshold = 2
	f := engine.NewFollower(c.e)
	x := c.circuit(9502, o)
	c.fail(x, 2)
	f.Noted(x, c.lastTransition())
	opened := c.clk.Now()
	key := engine.DynamicName(dest(9502))
	if n, _ := c.follow(f, o, engine.FleetVerdict{Key: key, Nodes: 4, Quorum: 2, Until: opened.Add(time.Hour)}); n != 0 || x.Machine.State() != policy.Open {
		t.Fatalf("followed %d; state %s", n, x.Machine.State())
	}
	if _, closed := c.follow(f, o); closed != 0 || x.Machine.State() != policy.Open {
		t.Fatalf("the fleet closed %d; state %s", closed, x.Machine.State())
	}
	r := f.Reported(c.clk.Now())
	want := opened.Add(time.Second + o.ProbeTimeout + engine.FleetMargin)
	if len(r) != 1 || r[0].Key != key || r[0].Reason != string(policy.ReasonConsecutive) || !r[0].Since.Equal(opened) || !r[0].OpenUntil.Equal(want) || r[0].Target != engine.AllTarget {
		t.Fatalf("reported %+v, want %s open until %v", r, key, want)
	}
	c.clk.Advance(1500 * time.Millisecond)
	c.probe(x) // half-open: one success of two
	if s := x.Machine.State(); s != policy.HalfOpen {
		t.Fatalf("after a probe: %s", s)
	}
	f.Noted(x, c.lastTransition())
	// Its round began half a second after its due time: the open entry
	// still covers it, unchanged (no write).
	if r2 := f.Reported(c.clk.Now()); len(r2) != 1 || r2[0] != r[0] {
		t.Fatalf("half-open within the margin: reported %+v, want %+v", r2, r)
	}
	// A new round probe_timeout later begins well past the due time: it
	// counts from then.
	c.clk.Advance(o.ProbeTimeout)
	if tr, moved := x.Machine.Tick(c.clk.Now()); !moved || tr.Reason != policy.ReasonNewRound {
		t.Fatalf("tick: %+v %v, want a new round", tr, moved)
	}
	r = f.Reported(c.clk.Now())
	if want := c.clk.Now().Add(o.ProbeTimeout + engine.FleetMargin); len(r) != 1 || !r[0].OpenUntil.Equal(want) || !r[0].Since.Equal(opened) {
		t.Fatalf("a late round: reported %+v, want until %v", r, want)
	}
	// Without a fleet block nothing is reported.
	y := c.circuit(9503, options())
	c.fail(y, 2)
	for _, e := range f.Reported(c.clk.Now()) {
		if e.Key == engine.DynamicName(dest(9503)) {
			t.Fatalf("a circuit without a fleet block reported: %+v", e)
		}
	}
}

// An operator's override is never overridden by the fleet, in either
// direction: a forced_closed circuit is not followed, and a followed
// circuit the operator forces open is no longer the fleet's to close;
// forced_open is not reported.
func TestFollowNeverOverridesOperator(t *testing.T) {
	c := newCore(t, 8, nil)
	o := fleetOptions()
	f := engine.NewFollower(c.e)
	a, b := c.circuit(9504, o), c.circuit(9505, o)
	c.e.Apply(a, a.Machine.Override(c.clk.Now(), policy.ForceClosed))
	until := c.clk.Now().Add(time.Minute)
	vs := []engine.FleetVerdict{{Key: a.Name(), Nodes: 2, Quorum: 2, Until: until}, {Key: b.Name(), Nodes: 2, Quorum: 2, Until: until}}
	if n, _ := c.follow(f, o, vs...); n != 1 || a.Machine.State() != policy.ForcedClosed || b.Machine.State() != policy.FleetOpen {
		t.Fatalf("opened %d: %s, %s", n, a.Machine.State(), b.Machine.State())
	}
	c.e.Apply(b, b.Machine.Override(c.clk.Now(), policy.ForceOpen))
	if _, closed := c.follow(f, o); closed != 0 || b.Machine.State() != policy.ForcedOpen || f.Count() != 0 {
		t.Fatalf("closed %d: %s, followed %d", closed, b.Machine.State(), f.Count())
	}
	if r := f.Reported(c.clk.Now()); len(r) != 0 {
		t.Fatalf("reported %+v: forced_open is no own evidence", r)
	}
}

// With the Tally on the same fake clock: one node's report opens nothing
// (quorum 2), a second's opens the circuit; with no further report
// (the API down) the follow ends at the verdict's Until, the tally's
// next expiry, when the quorum's earlier entry expires.
func TestFollowExpiresAtUntil(t *testing.T) {
	c := newCore(t, 8, nil)
	o := fleetOptions()
	f := engine.NewFollower(c.e)
	tally := fleet.NewTally("self")
	key := engine.DynamicName(dest(9506))
	quorum := func(string) int { return 2 }
	decide := func() (opened, closed int) {
		var vs []engine.FleetVerdict
		for _, v := range tally.Open(c.clk.Now(), quorum) {
			vs = append(vs, engine.FleetVerdict{Key: v.Key, Nodes: v.Nodes, Quorum: v.Quorum, Until: v.Until})
		}
		return c.follow(f, o, vs...)
	}
	report := func(node string, until time.Time) {
		r := &fleet.CircuitReport{Spec: fleet.ReportSpec{Open: 1, Circuits: []fleet.Circuit{{Key: key, Target: "all", Workload: "shared",
			Since: metav1.NewMicroTime(c.clk.Now()), OpenUntil: metav1.NewMicroTime(until), Reason: "consecutive_failures"}}}}
		r.Name = node
		tally.Observe(r)
	}
	t0 := c.clk.Now()
	report("a", t0.Add(4*time.Second))
	if n, _ := decide(); n != 0 {
		t.Fatal("one node's report opened a circuit")
	}
	report("self", t0.Add(time.Hour)) // its own report does not count
	if n, _ := decide(); n != 0 {
		t.Fatal("the node's own report counted toward the quorum")
	}
	report("b", t0.Add(6*time.Second))
	if n, _ := decide(); n != 1 {
		t.Fatal("a quorum of two reports opened nothing")
	}
	x, _ := c.e.At(dest(9506))
	next, ok := tally.NextExpiry(c.clk.Now())
	if !ok || !next.Equal(t0.Add(4*time.Second)) || !x.Machine.Status(c.clk.Now()).OpenUntil.Equal(next) {
		t.Fatalf("next expiry %v %v, follow until %v", next, ok, x.Machine.Status(c.clk.Now()).OpenUntil)
	}
	c.clk.Advance(next.Sub(c.clk.Now()) - time.Millisecond)
	if _, closed := decide(); closed != 0 {
		t.Fatal("closed before its until")
	}
	c.clk.Advance(time.Millisecond)
	if _, closed := decide(); closed != 1 || x.Machine.State() != policy.Closed {
		t.Fatalf("at its until: %s", x.Machine.State())
	}
}

// A fleet key names the same circuit on every node with the same
// configuration: a dynamic key is made here on its first verdict, and
// gets all's quorum; an endpoint key its target's, made from its
// address; a service-scope target's key its circuit; a key this node's
// configuration puts under another target, or whose circuit has no
// fleet block, names nothing the fleet may open here.
func TestFleetKeysNameCircuits(t *testing.T) {
	f := newFed(t, `
all:
  fleet: {quorum: 3}
targets:
  pay:
    match: {cidrs: [SRV], ports: ["443"]}
    fleet: {quorum: 4}
  eps:
    match: {cidrs: [198.51.100.0/24], ports: ["80"]}
    scope: endpoint
    fleet: {}
  quiet:
    match: {cidrs: [203.0.113.0/24]}
`, nil)
	now := f.clk.Now()
	cases := []struct {
		key    string
		quorum int
		made   bool
	}{
		{"tcp/192.0.2.10:9701", 3, true},
		{"pay", 4, true},
		{"eps/198.51.100.7:80", 2, true},
		{"tcp/192.0.2.10:443", 0, false},  // pay's destination here
		{"eps/198.51.100.7:81", 0, false}, // not eps's port
		{"quiet/203.0.113.1:80", 0, false},
		{"tcp/203.0.113.1:80", 0, false}, // quiet's, no fleet block
		{"nonsense", 0, false},
	}
	for _, tc := range cases {
		if q := f.e.FleetQuorum(tc.key); q != tc.quorum {
			t.Errorf("%s: quorum %d, want %d", tc.key, q, tc.quorum)
		}
		c := f.e.FleetCircuit(tc.key, now)
		if made := c != nil && c.Name() == tc.key; made != tc.made {
			t.Errorf("%s: circuit %v, want one named so: %v", tc.key, c, tc.made)
		}
	}
}
