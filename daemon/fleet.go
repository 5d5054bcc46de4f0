package daemon

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/kube"
	"github.com/breakerd/breakerd/policy"
)

// The fleet (package fleet, reached through kube.Fleet): with a `fleet`
// block and Kubernetes API access, this node publishes the circuits it
// has open on its own evidence in its CircuitReport and follows the
// circuits a quorum of other nodes report (engine.Follower). The API is
// never in the path of protection: start-up and reload only make the
// link, whose goroutines (started by fleetLoop) do every API call; the
// daemon hands the writer a set without waiting, and reads the tally
// under its lock. With the API down, local breaking is unchanged, the
// writer backs off, and followed circuits close when their reporters'
// entries expire (a timer at the tally's next expiry, no polling).

// fleetWiring is the daemon's part of the fleet; its fields are the
// owner's (touched only in its steps).
type fleetWiring struct {
	// link is made by the first configuration with a fleet block (and
	// API access) and kept: a reload that drops every block leaves it
	// publishing an empty report and following nothing.
	link     *kube.Fleet
	follower *engine.Follower
	// wake wakes fleetLoop: a link made, or a fleet circuit moved
	// (publish says its report is to be rebuilt).
	wake    chan struct{}
	publish bool
	// published is the last set handed to the writer (none yet: the
	// first, even empty, replaces what a previous daemon left).
	published []engine.FleetEntry
	handed    bool
	// adoptedUntil: follows adopted from a previous daemon's verdicts are
	// kept until the watch has listed the reports, or until then.
	adoptedUntil time.Time
}

// fleetAdoptGrace bounds how long a restarted daemon keeps a follow its
// predecessor left in the kernel without a list of the reports to
// confirm it (the API down at start-up).
const fleetAdoptGrace = 10 * time.Second

// wires returns d.fleet with its channel made. Called in a step of the owner.
func (d *Daemon) wires() *fleetWiring {
	if d.fleet.wake == nil {
		d.fleet.wake = make(chan struct{}, 1)
	}
	return &d.fleet
}

func (w *fleetWiring) poke() {
	select {
	case w.wake <- struct{}{}:
	default: // one is pending
	}
}

// configureFleet makes the link when cfg first has a fleet block, and
// has a running link decide and publish again after a reload. It makes
// no API call. Called in a step of the owner.
func (d *Daemon) configureFleet(cfg, old *policy.Config) {
	w := d.wires()
	if w.link != nil {
		// Quorums or blocks may have changed (all of them gone: the
		// follows end, the report empties): decide and publish again.
		w.publish = true
		w.poke()
		return
	}
	if !fleetBlocks(cfg) {
		return
	}
	if d.opts.Cluster == nil {
		if old == nil || !fleetBlocks(old) {
			d.log.Warn("the configuration has a fleet block, and this breakerd has no Kubernetes API access (in a pod, or --kubeconfig): it shares nothing with other nodes; every circuit is decided by this node's own evidence")
		}
		return
	}
	link, err := d.opts.Cluster.NewFleet()
	if err != nil {
		d.log.Error("the fleet's reports cannot be reached; every circuit is decided by this node's own evidence", "err", err)
		return
	}
	w.link, w.follower = link, engine.NewFollower(d.eng)
	d.log.Info("sharing circuits with the fleet through CircuitReports")
	w.publish = true
	w.poke()
}

// fleetNoted is told of every transition (the engine's hooks).
func (d *Daemon) fleetNoted(c *circuit, t policy.Transition) {
	w := &d.fleet
	if w.follower == nil {
		return
	}
	w.follower.Noted(c, t)
	if c.Machine.Options().Fleet.Enabled && t.To != policy.FleetOpen && t.From != policy.FleetOpen {
		w.publish = true
		w.poke()
	}
}

// fleetLoop runs the link and decides what the fleet has open whenever
// the reports change, this node's own fleet circuits move, or an entry
// expires, until ctx ends.
func (d *Daemon) fleetLoop(ctx context.Context) {
	var w *fleetWiring
	d.do(func() { w = d.wires() })
	var link *kube.Fleet
	for link == nil {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		}
		d.do(func() {
			link = w.link
		})
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { link.Run(ctx) })
	expiry := time.NewTimer(time.Hour)
	expiry.Stop()
	defer expiry.Stop()
	for {
		var now, next time.Time
		var ok bool
		d.do(func() {
			now = d.now()
			d.fleetPublish(now)
			next, ok = d.fleetDecide(now)
		})
		expiry.Stop()
		if ok {
			// Just past it: an entry stops counting once its until is
			// not after now.
			expiry.Reset(next.Sub(now) + time.Millisecond)
		}
		select {
		case <-ctx.Done():
			return
		case <-link.Changed():
		case <-w.wake:
		case <-expiry.C:
		}
	}
}

// fleetPublish hands the writer this node's report if it changed. Called
// in a step of the owner.
func (d *Daemon) fleetPublish(now time.Time) {
	w := &d.fleet
	if !w.publish {
		return
	}
	w.publish = false
	open := w.follower.Reported(now)
	if w.handed && sameEntries(open, w.published) {
		return
	}
	w.published, w.handed = open, true
	out := make([]kube.FleetCircuit, len(open))
	for i, e := range open {
		out[i] = kube.FleetCircuit{Key: e.Key, Target: e.Target, Workload: e.Workload, Reason: e.Reason, Since: e.Since, OpenUntil: e.OpenUntil}
	}
	w.link.Publish(out)
}

func sameEntries(a, b []engine.FleetEntry) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := a[i], b[i]
		if x.Key != y.Key || x.Reason != y.Reason || !x.Since.Equal(y.Since) || !x.OpenUntil.Equal(y.OpenUntil) || x.Target != y.Target || x.Workload != y.Workload {
			return false
		}
	}
	return true
}

// fleetDecide applies what the fleet has open at now to the circuits and
// returns when to decide again (false: only when reports change). Called
// in a step of the owner.
func (d *Daemon) fleetDecide(now time.Time) (time.Time, bool) {
	w := &d.fleet
	if !w.link.Synced() && now.Before(w.adoptedUntil) {
		return w.adoptedUntil, true // adopted follows wait for the first list
	}
	w.adoptedUntil = time.Time{}
	open, next, ok := w.link.Open(now, d.eng.FleetQuorum)
	vs := make([]engine.FleetVerdict, len(open))
	for i, o := range open {
		vs[i] = engine.FleetVerdict{Key: o.Key, Nodes: o.Nodes, Quorum: o.Quorum, Until: o.Until}
	}
	opened, closed := w.follower.Apply(vs, now, func(key string) *circuit { return d.eng.FleetCircuit(key, now) })
	if opened > 0 || closed > 0 {
		d.log.Info("following the fleet", "opened", opened, "closed", closed, "followed", w.follower.Count())
	}
	return next, ok
}

// fleetAdopt keeps, at start-up, the follow a previous daemon left as a
// forced-open verdict of c, which no override forces open here: until
// the reports are listed, or fleetAdoptGrace. False: c does not follow
// the fleet here (its verdict goes). Called in a step of the owner.
func (d *Daemon) fleetAdopt(c *circuit, now time.Time) bool {
	w := &d.fleet
	if w.follower == nil || !c.Machine.Options().Fleet.Enabled {
		return false
	}
	until := now.Add(fleetAdoptGrace)
	if !w.follower.Adopt(c, until, now) {
		return false
	}
	w.adoptedUntil = until
	return true
}

// fleetInfo adds the fleet's verdict to a followed circuit's API view.
// Called in a step of the owner.
func (d *Daemon) fleetInfo(c *circuit, ci *CircuitInfo) {
	if d.fleet.follower == nil {
		return
	}
	if v, ok := d.fleet.follower.Of(c); ok {
		ci.FleetNodes, ci.FleetQuorum = v.Nodes, v.Quorum
	}
}

// fleetCollector exports the fleet's series.
type fleetCollector struct{ d *Daemon }

var (
	descFleetFollowed = prometheus.NewDesc("breakerd_fleet_followed_circuits", "Circuits open because a quorum of other nodes reports them open (state fleet_open).", nil, nil)
	descFleetWrites   = prometheus.NewDesc("breakerd_fleet_report_writes_total", "Writes of this node's CircuitReport.", nil, nil)
	descFleetErrors   = prometheus.NewDesc("breakerd_fleet_report_write_errors_total", "Failed writes of this node's CircuitReport (each is retried with the latest state, backed off up to 30 s).", nil, nil)
	descFleetReadErrs = prometheus.NewDesc("breakerd_fleet_report_read_errors_total", "Failed reads of the fleet's CircuitReports: op list (the first list, and each after a watch could not resume) or watch (a watch that could not be started); each is retried, backed off by client-go. While they fail, followed circuits end at their open-until.", []string{"op"}, nil)
	descFleetOmitted  = prometheus.NewDesc("breakerd_fleet_report_omitted_circuits", "Circuits open on this node's own evidence that its last report left out (past 128; the least recently opened go first).", nil, nil)
)

// Describe sends the collector's descriptors.
func (f fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descFleetFollowed, descFleetWrites, descFleetErrors, descFleetReadErrs, descFleetOmitted} {
		ch <- d
	}
}

// Collect reads the follower's count and the writer's counters (zero
// without a link).
func (f fleetCollector) Collect(ch chan<- prometheus.Metric) {
	d := f.d
	var followed int
	var s kube.FleetStats
	if sh := d.shown.Load(); sh != nil {
		followed = sh.followed
		if sh.link != nil {
			s = sh.link.Stats()
		}
	}
	ch <- prometheus.MustNewConstMetric(descFleetFollowed, prometheus.GaugeValue, float64(followed))
	ch <- prometheus.MustNewConstMetric(descFleetWrites, prometheus.CounterValue, float64(s.Writes))
	ch <- prometheus.MustNewConstMetric(descFleetErrors, prometheus.CounterValue, float64(s.Errors))
	ch <- prometheus.MustNewConstMetric(descFleetReadErrs, prometheus.CounterValue, float64(s.ListErrors), "list")
	ch <- prometheus.MustNewConstMetric(descFleetReadErrs, prometheus.CounterValue, float64(s.WatchErrors), "watch")
	ch <- prometheus.MustNewConstMetric(descFleetOmitted, prometheus.GaugeValue, float64(s.Omitted))
}
