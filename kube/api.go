// Package kube is breakerd's view of the Kubernetes API: it resolves
// Service targets (`match: {service: NAMESPACE/NAME}`) from Services and
// EndpointSlices kept by client-go informers, and posts Events when
// circuits open and close. Nothing here blocks the daemon: the informers
// have their own goroutines, resolution reads only their caches, and
// Events are queued to client-go's broadcaster, which drops when its queue
// is full, combines similar Events (same object and reason) past the tenth
// in 10 minutes into one, and rate-limits per object with its spam filter
// (a burst of 25, then one every 5 minutes).
//
// What counts as an endpoint of a Service: an EndpointSlice endpoint whose
// `serving` condition is true (ready, or terminating and still serving:
// kube-proxy still sends to those when no ready endpoint is left, and
// connections to them still work), or, from producers that do not set
// `serving`, whose `ready` is not false. Endpoints that are not serving
// (failing readiness while starting, or terminated) are not the target's:
// the kubelet has already taken them out, and counting them would let
// max_ejection_percent eject more of the serving ones.
//
// The API server unreachable keeps the last known state (the informers'
// caches): breakerd_kubernetes_api_reachable drops to 0, and
// breakerd_kubernetes_watch_errors_total counts the failed lists and
// watches, which client-go retries with a growing backoff (up to 30 s), so
// an RBAC denial is logged and counted, not retried in a hot loop. A watch
// refused a connection (an API server that is down) client-go retries
// without reporting it: only api_reachable shows that.
//
// A build with the nokube tag leaves the Kubernetes client out
// (nokube.go stands in for it): scripts/demo builds breakerd so, since
// client-go and the API types are most of what a first build compiles.
// This file holds what the daemon uses in both builds.
package kube

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the client's Prometheus series.
type metrics struct {
	reachable   prometheus.Gauge
	watchErrors *prometheus.CounterVec
	events      *prometheus.CounterVec
}

func newMetrics() metrics {
	m := metrics{
		reachable: prometheus.NewGauge(prometheus.GaugeOpts{Name: "breakerd_kubernetes_api_reachable",
			Help: "1 while the Kubernetes API server answers; 0 while it does not (Service targets keep their last known addresses)."}),
		watchErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "breakerd_kubernetes_watch_errors_total",
			Help: "Failed lists and watches of the Kubernetes API, by resource (services, endpointslices, pods) and reason (forbidden: RBAC denies it; other: failing otherwise; a watch refused a connection by an API server that is down is retried without being counted, see breakerd_kubernetes_api_reachable)."}, []string{"resource", "reason"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "breakerd_kubernetes_events_total",
			Help: "Kubernetes Events breakerd queued, by reason (client-go's spam filter may still drop some)."}, []string{"reason"}),
	}
	for _, r := range []string{"services", "endpointslices", "pods"} {
		for _, why := range []string{"forbidden", "other"} {
			m.watchErrors.WithLabelValues(r, why)
		}
	}
	return m
}

// MetricsCollector returns a collector of the client's metric families
// with no client behind it, for listing what the daemon can export.
func MetricsCollector() prometheus.Collector { m := newMetrics(); return &m }

// Describe implements prometheus.Collector.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	m.reachable.Describe(ch)
	m.watchErrors.Describe(ch)
	m.events.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	m.reachable.Collect(ch)
	m.watchErrors.Collect(ch)
	m.events.Collect(ch)
}

// ParseRef splits "namespace/name".
func ParseRef(ref string) (namespace, name string) {
	namespace, name, _ = strings.Cut(ref, "/")
	return namespace, name
}

// Event reasons.
const (
	ReasonCircuitOpened   = "CircuitOpened"
	ReasonCircuitClosed   = "CircuitClosed"
	ReasonServiceNotFound = "ServiceNotFound"
)

// Transition is what an Event about a circuit says.
type Transition struct {
	// Circuit and Target name the circuit and its target.
	Circuit, Target string
	// Service is the target's Service ("namespace/name"), or empty: the
	// Event is then posted on the Node.
	Service string
	// Opened is true for an opening (to open or forced open), false for a
	// closing.
	Opened bool
	// Reason is the state machine's reason (failure_rate, probe_success …).
	Reason string
	// FailureRatio, SlowRatio and Calls are the window's at the transition.
	FailureRatio, SlowRatio float64
	Calls                   int
	// Workload is the circuit's workload (shared, or an isolated one).
	Workload string
	// Pods names the pods ("namespace/name") whose connections failed,
	// where known.
	Pods []string
	// Rejected names the pods the circuit rejected, with how often
	// ("namespace/name (N)"), most first.
	Rejected []string
}

// PodSelector selects pods: by namespace (none listed: every namespace)
// and by labels (every label listed must match; none: every pod).
type PodSelector struct {
	Namespaces []string
	Labels     map[string]string
}
