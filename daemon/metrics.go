package daemon

import (
	"errors"
	"runtime/debug"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// metrics are the daemon's Prometheus series. Label values come from
// bounded sets: target names from the configuration (plus "all" for the
// dynamic circuits), states, reasons and outcomes.
type metrics struct {
	reg                *prometheus.Registry
	collectors         []prometheus.Collector // everything registered in reg (MetricFamilies describes them)
	transitions        *prometheus.CounterVec
	outcomes           *prometheus.CounterVec
	handshake          *prometheus.HistogramVec
	reloadOK           prometheus.Gauge
	reloadTime         prometheus.Gauge
	verdictWriteErrors prometheus.Counter
	circuitsEvicted    prometheus.Counter
	circuitsRefused    *prometheus.CounterVec
	protected          prometheus.Gauge
	groundProblems     *prometheus.CounterVec
	closed             *prometheus.CounterVec // close_established: connections closed or not, by target and workload
	closeMechanism     *prometheus.GaugeVec
	limitChanges       *prometheus.CounterVec // adaptive limits' moves, by target and kind
}

// Outcome is the series of outcome of target's circuits of workload
// (engine.Metrics).
func (m *metrics) Outcome(outcome, target, workload string) engine.Counter {
	return m.outcomes.WithLabelValues(outcome, target, workload)
}

// Handshake is the series of target's handshake durations
// (engine.Metrics).
func (m *metrics) Handshake(target string) engine.Observer {
	return m.handshake.WithLabelValues(target)
}

// Transition is the count of transitions (engine.Metrics).
func (m *metrics) Transition(from, to, reason, workload string) engine.Counter {
	return m.transitions.WithLabelValues(from, to, reason, workload)
}

// Refused is the count of target's destinations refused (engine.Metrics).
func (m *metrics) Refused(target string) engine.Counter {
	return m.circuitsRefused.WithLabelValues(target)
}

// Evicted is the count of circuits evicted (engine.Metrics).
func (m *metrics) Evicted() engine.Counter { return m.circuitsEvicted }

// VerdictWriteErrors is the count of failed verdict and limits writes
// (engine.Metrics).
func (m *metrics) VerdictWriteErrors() engine.Counter { return m.verdictWriteErrors }

// LimitChanges is the count of the moves of target's adaptive limits of
// kind (engine.Metrics).
func (m *metrics) LimitChanges(target, kind string) engine.Counter {
	return m.limitChanges.WithLabelValues(target, kind)
}

func newMetrics(d *Daemon) *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.transitions = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "breakerd_transitions_total", Help: "Circuit state transitions, by from, to, reason and the circuit's workload (shared, or an isolated workload's name)."}, []string{"from", "to", "reason", "workload"})
	m.outcomes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "breakerd_connection_outcomes_total", Help: "Outbound connection outcomes seen by the kernel, by outcome, target (all for unnamed destinations) and the circuit's workload."}, []string{"outcome", "target", "workload"})
	m.handshake = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "breakerd_handshake_duration_seconds", Help: "TCP handshake duration of established connections, by target.",
		Buckets: []float64{0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5}}, []string{"target"})
	m.reloadOK = prometheus.NewGauge(prometheus.GaugeOpts{Name: "breakerd_config_last_reload_successful", Help: "1 when the last configuration load or reload succeeded, 0 when it was refused."})
	m.reloadTime = prometheus.NewGauge(prometheus.GaugeOpts{Name: "breakerd_config_last_reload_success_timestamp_seconds", Help: "Time of the last successful configuration load."})
	m.verdictWriteErrors = prometheus.NewCounter(prometheus.CounterOpts{Name: "breakerd_verdict_write_errors_total", Help: "Verdict map writes that failed (that destination stays unenforced: fail-open)."})
	m.circuitsEvicted = prometheus.NewCounter(prometheus.CounterOpts{Name: "breakerd_circuits_evicted_total", Help: "Idle closed dynamic circuits evicted to stay within max_circuits."})
	m.circuitsRefused = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "breakerd_circuits_refused_total", Help: "New destinations left unprotected because max_circuits was reached with nothing to evict (or no circuit id was free), by target (all for unnamed destinations)."}, []string{"target"})
	m.limitChanges = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "breakerd_limit_changes_total", Help: "Moves of adaptive bulkhead limits (max_connections or max_connecting that follow latency), by target and kind."}, []string{"target", "kind"})
	m.protected = prometheus.NewGauge(prometheus.GaugeOpts{Name: "breakerd_protection_intact", Help: "1 while the protected cgroup, the bpf filesystem and every pin are as attached; 0 while something moved (see breakerd_protection_problems_total and the error log)."})
	m.groundProblems = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "breakerd_protection_problems_total", Help: "Times a problem under the daemon was found: cgroup_removed, cgroup_recreated, pins_removed, bpffs_unmounted."}, []string{"problem"})
	for _, p := range []maps.Problem{maps.CgroupRemoved, maps.CgroupRecreated, maps.PinsRemoved, maps.BPFFSUnmounted} {
		m.groundProblems.WithLabelValues(string(p))
	}
	m.closed = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "breakerd_established_closed_total", Help: "Established connections closed when a circuit with close_established opened (result closed), or, when one with a fallback closed, that had been redirected to the fallback (result returned), or that the kernel refused to close (result failed), by target and workload."}, []string{"target", "workload", "result"})
	m.closeMechanism = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "breakerd_close_established_mechanism", Help: "1 for how this kernel closes established connections for close_established (bpf_sock_destroy, sock_diag, or none: they stay open) and which network namespaces a close pass can enter with breakerd's privileges (namespaces: all, some: without CAP_SYS_PTRACE, own: only breakerd's own); no series until a target asks for it."}, []string{"mechanism", "namespaces"})
	version := "devel"
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		version = bi.Main.Version
	}
	build := prometheus.NewGauge(prometheus.GaugeOpts{Name: "breakerd_build_info", Help: "Build information.", ConstLabels: prometheus.Labels{"version": version}})
	build.Set(1)
	m.collectors = []prometheus.Collector{m.transitions, m.outcomes, m.handshake, m.reloadOK, m.reloadTime, m.verdictWriteErrors,
		m.circuitsEvicted, m.circuitsRefused, m.protected, m.groundProblems, m.closed, m.closeMechanism, build, &stateCollector{d: d}, &workloadCollector{d: d}, &programCollector{d: d}, fleetCollector{d}, m.limitChanges, limitCollector{d},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})}
	if d.opts.Cluster != nil {
		m.collectors = append(m.collectors, d.opts.Cluster)
	}
	m.reg.MustRegister(m.collectors...)
	return m
}

// stateCollector reads circuit states and the kernel's counters at scrape
// time (ebpf_exporter style). Its per-target counters never go down: a
// circuit's id can be given back (its counts moved into retired) and
// given to another circuit (its counters zeroed) between the Summary and
// the kernel read, so a scrape during which an id was given
// back repeats the values of the one before, and every counter reports
// at least what it reported before (last).
type stateCollector struct {
	d    *Daemon
	mu   sync.Mutex
	last map[string][6]uint64 // per target: rejections, shadow, probes, bulkhead and slow-start rejections, redirects
}

var (
	descState      = prometheus.NewDesc("breakerd_circuit_state", "1 for the state each named target's circuit is in (endpoint scope: count of endpoints in it).", []string{"target", "state"}, nil)
	descDynamic    = prometheus.NewDesc("breakerd_dynamic_circuits", "Dynamic circuits (destinations no target names), by state.", []string{"state"}, nil)
	descRejected   = prometheus.NewDesc("breakerd_kernel_rejections_total", "Connections and datagrams the kernel turned away, by target.", []string{"target"}, nil)
	descShadow     = prometheus.NewDesc("breakerd_kernel_shadow_rejections_total", "Connections the kernel would have turned away in shadow mode, by target.", []string{"target"}, nil)
	descProbes     = prometheus.NewDesc("breakerd_kernel_probes_total", "Half-open probes the kernel admitted, by target.", []string{"target"}, nil)
	descBulkRej    = prometheus.NewDesc("breakerd_bulkhead_rejections_total", "Connects the kernel turned away because a bulkhead (max_connections, max_connecting) was full, by target.", []string{"target"}, nil)
	descRedirected = prometheus.NewDesc("breakerd_redirected_total", "Connections and datagrams the kernel sent to their target's fallback instead of rejecting them, by target.", []string{"target"}, nil)
	descSlowRej    = prometheus.NewDesc("breakerd_slow_start_rejections_total", "Connects the kernel turned away because a circuit that recovered was still ramping up (slow_start), by target.", []string{"target"}, nil)
	descRamping    = prometheus.NewDesc("breakerd_slow_start_circuits", "Closed circuits whose slow start (slow_start) is in progress: the kernel admits only a share of their new connects.", nil, nil)
	descBulkConns  = prometheus.NewDesc("breakerd_bulkhead_connections", "Connecting plus established sockets counted by the bulkheads, by target.", []string{"target"}, nil)
	descLost       = prometheus.NewDesc("breakerd_events_lost_total", "Outcome records the kernel dropped because the ring buffer was full.", nil, nil)
	descFailsafe   = prometheus.NewDesc("breakerd_kernel_failsafe_allowed_total", "Verdicts the kernel ignored because the daemon's heartbeat was stale.", nil, nil)
	descUnrecorded = prometheus.NewDesc("breakerd_kernel_rejections_unrecorded_total", "Rejections whose cgroup the kernel could not record because its rejections map was full (the circuit's own counters still count them).", nil, nil)
	descEntries    = prometheus.NewDesc("breakerd_verdict_map_entries", "Entries in the kernel's verdict map.", nil, nil)
	descCapacity   = prometheus.NewDesc("breakerd_verdict_map_capacity", "Capacity of the kernel's verdict map.", nil, nil)
	descUnenforced = prometheus.NewDesc("breakerd_circuits_unenforced", "Rejecting circuits whose verdicts are not all in the kernel (no circuit id free, or no room in the verdict map): destinations without one are not rejected until the tick writes them (unenforced in /v1/circuits).", nil, nil)
	allStates      = []policy.State{policy.Closed, policy.Open, policy.HalfOpen, policy.ForcedOpen, policy.ForcedClosed, policy.Disabled, policy.FleetOpen}
)

// Describe sends the collector's descriptors.
func (s *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descBulkRej, descSlowRej, descRamping, descRedirected, descBulkConns, descState, descDynamic, descRejected, descShadow, descProbes, descLost, descFailsafe, descUnrecorded, descEntries, descCapacity, descUnenforced} {
		ch <- d
	}
}

// Collect reads the current values: the states and the owners of the
// kernel's circuit ids from the engine's published Summary (no lock, no
// walk of the circuits), the kernel's counters in batches (one system
// call per 4096 circuit ids, up to the highest id handed out), so a
// scrape of many circuits never holds up the event loop or the heartbeat
// and costs a few dozen system calls. A circuit dropped during a scrape
// may be missed by that one scrape.
func (s *stateCollector) Collect(ch chan<- prometheus.Metric) {
	d := s.d
	sum := d.eng.Summary()
	states := map[string]policy.Tally{}
	var dynamic policy.Tally
	type sums struct {
		rej, shadow, probes, bulkRej, slowRej, redirected uint64
		conns                                             int64
	}
	perTarget := map[string]*sums{}
	for t, ts := range sum.Targets {
		r := ts.Retired
		perTarget[t] = &sums{rej: r.Rejected, shadow: r.ShadowRejected, probes: r.Probes, bulkRej: r.BulkheadRejected, slowRej: r.SlowStartRejected, redirected: r.Redirected}
		if t == allTarget {
			dynamic = ts.States
		} else {
			states[t] = ts.States
		}
	}
	counters, cerr := d.k.CountersUpTo(sum.NextID)
	bulk, berr := d.k.BulkCountsUpTo(sum.NextID)
	if cerr != nil || berr != nil {
		d.log.Warn("reading kernel counters for metrics", "err", errors.Join(cerr, berr))
	}
	// An id given back since the summary may be another circuit's now.
	moved := d.eng.ReleasesNow() != sum.Releases
	for id := uint32(1); id < sum.NextID; id++ {
		o, ok := sum.Owner(id)
		if !ok {
			continue
		}
		acc := perTarget[o.Target]
		if acc == nil {
			continue // a target removed by a reload, its circuits not yet dropped
		}
		if int(id) < len(counters) {
			cnt := counters[id]
			acc.rej += cnt.Rejected
			acc.shadow += cnt.ShadowRejected
			acc.probes += cnt.Probes
			acc.bulkRej += cnt.BulkheadRejected
			acc.slowRej += cnt.SlowStartRejected
			acc.redirected += cnt.Redirected
		}
		if (o.Bulk || sum.Targets[o.Target].Limits) && int(id) < len(bulk) {
			acc.conns += bulk[id].Connections
		}
	}
	for t, m := range states {
		for _, st := range allStates {
			ch <- prometheus.MustNewConstMetric(descState, prometheus.GaugeValue, float64(m[st]), t, st.String())
		}
	}
	for _, st := range allStates {
		ch <- prometheus.MustNewConstMetric(descDynamic, prometheus.GaugeValue, float64(dynamic[st]), st.String())
	}
	s.mu.Lock()
	if s.last == nil {
		s.last = map[string][6]uint64{}
	}
	for t, sm := range perTarget {
		l, seen := s.last[t]
		if moved && seen {
			// The slots' owners may have changed under the read: this
			// scrape repeats the last values.
			sm.rej, sm.shadow, sm.probes, sm.bulkRej, sm.slowRej, sm.redirected = l[0], l[1], l[2], l[3], l[4], l[5]
			continue
		}
		sm.rej, sm.shadow, sm.probes, sm.bulkRej, sm.slowRej = max(sm.rej, l[0]), max(sm.shadow, l[1]), max(sm.probes, l[2]), max(sm.bulkRej, l[3]), max(sm.slowRej, l[4])
		sm.redirected = max(sm.redirected, l[5])
		s.last[t] = [6]uint64{sm.rej, sm.shadow, sm.probes, sm.bulkRej, sm.slowRej, sm.redirected}
	}
	s.mu.Unlock()
	for t, sm := range perTarget {
		ch <- prometheus.MustNewConstMetric(descRejected, prometheus.CounterValue, float64(sm.rej), t)
		ch <- prometheus.MustNewConstMetric(descShadow, prometheus.CounterValue, float64(sm.shadow), t)
		ch <- prometheus.MustNewConstMetric(descProbes, prometheus.CounterValue, float64(sm.probes), t)
		ch <- prometheus.MustNewConstMetric(descBulkRej, prometheus.CounterValue, float64(sm.bulkRej), t)
		ch <- prometheus.MustNewConstMetric(descSlowRej, prometheus.CounterValue, float64(sm.slowRej), t)
		ch <- prometheus.MustNewConstMetric(descRedirected, prometheus.CounterValue, float64(sm.redirected), t)
		ch <- prometheus.MustNewConstMetric(descBulkConns, prometheus.GaugeValue, float64(sm.conns), t)
	}
	if st, err := d.k.Stats(); err == nil {
		ch <- prometheus.MustNewConstMetric(descLost, prometheus.CounterValue, float64(st.EventsLost))
		ch <- prometheus.MustNewConstMetric(descFailsafe, prometheus.CounterValue, float64(st.FailsafeAllowed))
		ch <- prometheus.MustNewConstMetric(descUnrecorded, prometheus.CounterValue, float64(st.RejectionsFull))
	}
	n, capacity := d.k.VerdictCount()
	ch <- prometheus.MustNewConstMetric(descEntries, prometheus.GaugeValue, float64(n))
	ch <- prometheus.MustNewConstMetric(descCapacity, prometheus.GaugeValue, float64(capacity))
	ch <- prometheus.MustNewConstMetric(descUnenforced, prometheus.GaugeValue, float64(sum.Unenforced))
	ch <- prometheus.MustNewConstMetric(descRamping, prometheus.GaugeValue, float64(sum.Ramping))
}

// programCollector reads the run counts and run times the kernel keeps for
// each of breakerd's cgroup programs, at scrape time: what breakerd costs
// the protected processes, per call. The kernel counts both only while
// BPF statistics are on (sysctl kernel.bpf_stats_enabled=1, or a process
// holding BPF_ENABLE_STATS open), which adds about two clock reads to
// every program run on the host; while they are off, both stand still.
// The counts are of the programs this daemon loaded: they start at 0 with
// every start.
type programCollector struct{ d *Daemon }

var (
	descProgRuns    = prometheus.NewDesc("breakerd_kernel_program_runs_total", "Runs of each of breakerd's kernel programs while BPF statistics were on (kernel.bpf_stats_enabled); 0 while they were never on.", []string{"program"}, nil)
	descProgSeconds = prometheus.NewDesc("breakerd_kernel_program_run_seconds_total", "Time spent in each of breakerd's kernel programs while BPF statistics were on (kernel.bpf_stats_enabled): divided by breakerd_kernel_program_runs_total, the cost of one call.", []string{"program"}, nil)
)

// Describe sends the collector's descriptors.
func (p *programCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descProgRuns
	ch <- descProgSeconds
}

// Collect reads every program's statistics (one system call each).
func (p *programCollector) Collect(ch chan<- prometheus.Metric) {
	stats, err := p.d.k.ProgramStats()
	if err != nil {
		p.d.log.Warn("reading kernel program statistics for metrics", "err", err)
		return
	}
	for name, st := range stats {
		ch <- prometheus.MustNewConstMetric(descProgRuns, prometheus.CounterValue, float64(st.RunCount), name)
		ch <- prometheus.MustNewConstMetric(descProgSeconds, prometheus.CounterValue, st.Runtime.Seconds(), name)
	}
}
