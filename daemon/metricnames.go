package daemon

import (
	"github.com/breakerd/breakerd/kube"

	"regexp"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// descName picks the metric name out of a Desc's String(), the only place
// client_golang shows it.
var descName = regexp.MustCompile(`fqName: "([^"]+)"`)

// MetricFamily is one metric family the daemon's registry exports.
type MetricFamily struct {
	Name string
	// Histogram is set for breakerd's histograms, whose series are
	// Name_bucket, Name_sum and Name_count.
	Histogram bool
}

// MetricFamilies returns every metric family the daemon's registry
// exports, sorted by name: breakerd's own (breakerd_*) and the Go and
// process collectors' (go_*, process_*), whether or not a family has a
// series yet. It is read from the collectors' descriptions, with no kernel
// and no daemon running; the Grafana dashboard's test checks its queries
// against it.
func MetricFamilies() []MetricFamily {
	m := newMetrics(&Daemon{})
	var out []MetricFamily
	// With API access the daemon exports the Kubernetes client's too.
	for _, c := range append(m.collectors, kube.MetricsCollector()) {
		_, histVec := c.(*prometheus.HistogramVec)
		_, hist := c.(prometheus.Histogram)
		ch := make(chan *prometheus.Desc)
		go func() {
			c.Describe(ch)
			close(ch)
		}()
		for d := range ch {
			if sm := descName.FindStringSubmatch(d.String()); sm != nil {
				out = append(out, MetricFamily{Name: sm[1], Histogram: histVec || hist})
			}
		}
	}
	slices.SortFunc(out, func(a, b MetricFamily) int { return strings.Compare(a.Name, b.Name) })
	return slices.CompactFunc(out, func(a, b MetricFamily) bool { return a.Name == b.Name })
}
