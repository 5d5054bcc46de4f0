package daemon

import (
	"sort"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/breakerd/breakerd/api"
	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/policy"
)

// AdaptiveLimit is api.AdaptiveLimit.
type AdaptiveLimit = api.AdaptiveLimit

// adaptiveLimits turns c's adaptive limits into the API's (nil: none).
func adaptiveLimits(c *circuit) []AdaptiveLimit {
	ls := c.AdaptiveLimits()
	if len(ls) == 0 {
		return nil
	}
	out := make([]AdaptiveLimit, len(ls))
	for i, l := range ls {
		out[i] = AdaptiveLimit{Kind: l.Kind, Algorithm: l.Algorithm, Limit: l.Limit, Min: l.Min, Max: l.Max,
			LatencySeconds: l.Latency.Seconds(), Changes: l.Changes}
	}
	return out
}

// limitCollector reports the current adaptive limits at scrape time, by
// target and kind, summed over a target's circuits (one in service
// scope); a configured adaptive limit with no circuit yet reports 0.
type limitCollector struct{ d *Daemon }

var descLimit = prometheus.NewDesc("breakerd_limit", "Current adaptive bulkhead limit (max_connections or max_connecting that follows latency), by target and kind, summed over the target's circuits.", []string{"target", "kind"}, nil)

// Describe sends the collector's descriptor.
func (limitCollector) Describe(ch chan<- *prometheus.Desc) { ch <- descLimit }

// Collect reads the limits from the engine's published Summary.
func (lc limitCollector) Collect(ch chan<- prometheus.Metric) {
	type key struct{ target, kind string }
	sums := map[key]int{}
	for name, ts := range lc.d.eng.Summary().Targets {
		for kind, v := range ts.Adaptive {
			sums[key{name, kind}] = v
		}
	}
	keys := make([]key, 0, len(sums))
	for k := range sums {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		return keys[i].target < keys[j].target || keys[i].target == keys[j].target && keys[i].kind < keys[j].kind
	})
	for _, k := range keys {
		ch <- prometheus.MustNewConstMetric(descLimit, prometheus.GaugeValue, float64(sums[k]), k.target, k.kind)
	}
}

// adaptiveKinds are the kinds of o's adaptive limits.
func adaptiveKinds(o *policy.Options) []string {
	var out []string
	if o.AdaptiveConnections.On() {
		out = append(out, engine.KindConnections)
	}
	if o.AdaptiveConnecting.On() {
		out = append(out, engine.KindConnecting)
	}
	return out
}

// presetLimitChanges makes the moves counter's series of cfg's adaptive
// limits, so each is scraped (as 0) before its first move.
func (m *metrics) presetLimitChanges(cfg *policy.Config) {
	for name, t := range cfg.Targets {
		for _, k := range adaptiveKinds(&t.Options) {
			m.limitChanges.WithLabelValues(name, k)
		}
	}
}
