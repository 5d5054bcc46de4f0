package policy

import "fmt"

// Criticality says how a workload that shares circuits is treated when a
// circuit's bulkhead is full. Workloads with a criticality count together
// in one bulkhead per circuit (the circuit's criticality pool) instead of
// one each: a critical workload is admitted while the pool holds fewer
// connections than the limit, a sheddable one only while it holds fewer
// than its share of it, so under a full limit sheddable work is turned
// away first (the partitions of Netflix's concurrency-limits).
type Criticality string

// The criticalities ("": the workload has a bulkhead of its own).
const (
	Critical  Criticality = "critical"
	Sheddable Criticality = "sheddable"
)

// CriticalityPool is the workload label of a circuit's criticality pool
// (its bulkhead slot's, in the API's bulkheads).
const CriticalityPool = "criticality-pool"

// defaultShare is a sheddable workload's share when it sets none.
const defaultShare = 0.5

// share is the share of the limit a workload of criticality c with
// `share` s is admitted under.
func (c Criticality) share(s float64) float64 {
	if c == Critical {
		return 1
	}
	if s == 0 {
		return defaultShare
	}
	return s
}

// Share returns the share of each circuit's limit that the workload of
// bulkhead class k is admitted under, and whether it is in the
// criticality pool (false: it has a bulkhead of its own).
func (cl Classes) Share(k Class) (float64, bool) {
	s, ok := cl.shares[k]
	return s, ok
}

// SharedLimit is a limit's value for a workload admitted under share of
// it: at least 1 (0 turns a kernel limit off), never above the limit.
func SharedLimit(limit int, share float64) int {
	if limit == 0 || share >= 1 {
		return limit
	}
	return max(1, min(limit, int(float64(limit)*share)))
}

// checkCriticality reports a criticality where it cannot apply: on an
// isolated workload (its circuits are its own: there is no one to shed
// before), and a share without sheddable.
func (d *decoder) checkCriticality(p string, m map[string]any, w *Workload) {
	if w.Criticality != "" && w.Isolate {
		d.add(p+".criticality", "needs a workload that shares circuits (isolate: false): an isolated workload's bulkheads are its own")
	}
	if _, ok := m["share"]; ok && w.Criticality != Sheddable {
		d.add(p+".share", "only a sheddable workload has a share (criticality: sheddable)")
	}
}

// criticalityReference is the configuration reference's paragraph on
// criticality.
var criticalityReference = fmt.Sprintf("**Criticality.** A workload that shares circuits may set `criticality: critical` or `criticality: sheddable` (with `share`, its share of each circuit's limit, a ratio in (0, 1], default %v). "+
	"The workloads with a criticality count together in one bulkhead per circuit (shown as `%s` in the circuit's `bulkheads`) instead of one each: a critical workload's connect is admitted while that bulkhead holds fewer sockets than the circuit's `max_connections` (and `max_connecting`), a sheddable one's only while it holds fewer than its share of them (at least 1), "+
	"so under a full limit sheddable work is turned away first, with the bulkhead's errno, and critical work keeps the rest. The kernel decides it in `connect()` from the workload's bulkhead class, as for any bulkhead; an adaptive limit's share follows the limit. "+
	"Workloads without a criticality keep bulkheads of their own. It is an error on an isolated workload, and `share` is one without `criticality: sheddable`. "+
	"A workload named in a target's `source` has circuits of its own, where its criticality has no one to shed before and is ignored.\n\n", defaultShare, CriticalityPool)
