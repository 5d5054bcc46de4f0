// Package api holds the JSON types of breakerd's admin API, shared by the
// daemon that serves them and the clients that read them (breakerctl), so
// a client links neither the daemon nor its Kubernetes client.
package api

import "time"

// CircuitInfo is one circuit as /v1/circuits reports it.
type CircuitInfo struct {
	Name                string    `json:"name"`
	Target              string    `json:"target"`
	Workload            string    `json:"workload"`
	Scope               string    `json:"scope"`
	State               string    `json:"state"`
	FailureRate         float64   `json:"failure_rate"`
	SlowRate            float64   `json:"slow_rate"`
	Calls               int       `json:"calls"`
	Failures            int       `json:"failures"`
	Slow                int       `json:"slow"`
	ConsecutiveFailures int       `json:"consecutive_failures"`
	OpenUntil           time.Time `json:"open_until,omitzero"`
	ProbesLeft          *int32    `json:"probes_left,omitempty"`
	Trip                int       `json:"trip"`
	// Destinations lists up to 32 of the destinations the circuit's
	// verdict covers (sorted); DestinationsTotal counts them all.
	Destinations      []string `json:"destinations"`
	DestinationsTotal int      `json:"destinations_total"`
	CircuitID         uint32   `json:"circuit_id"`
	// Unenforced is set on a rejecting circuit whose verdicts are not all
	// in the kernel (no circuit id free, or no room in the verdict map):
	// the destinations without one are not rejected until the tick
	// writes them (breakerd_circuits_unenforced counts such circuits).
	Unenforced       bool   `json:"unenforced,omitempty"`
	Rejected         uint64 `json:"rejected"`
	ShadowRejected   uint64 `json:"shadow_rejected"`
	BulkheadRejected uint64 `json:"bulkhead_rejected"`
	// Fallback is where the circuit's connects go while it rejects them
	// (its target's fallback option), and Redirected counts the connects
	// and datagrams the kernel sent there instead of rejecting them.
	Fallback    string         `json:"fallback,omitempty"`
	Redirected  uint64         `json:"redirected,omitempty"`
	Connections int64          `json:"connections"`
	Connecting  int64          `json:"connecting"`
	Options     map[string]any `json:"options"`
	// FailedPods are the pods ("namespace/name") whose connections to the
	// circuit failed most recently (at most 8), where breakerd knows the
	// cgroup's pod (Kubernetes API access and the kubelet's cgroup
	// layout).
	FailedPods []string `json:"failed_pods,omitempty"`
	// Bulkheads are the bulkheads of the workloads sharing the circuit,
	// by workload: each workload's connections are counted and limited
	// apart (connections, connecting and bulkhead_rejected above include
	// them). Absent for an isolated workload's circuit and without a
	// workloads list.
	Bulkheads map[string]BulkheadCount `json:"bulkheads,omitempty"`
	// AdaptiveLimits are its bulkhead limits that follow latency
	// (max_connections or max_connecting given as {adaptive: …}); the
	// kernel enforces each one's Limit. Absent when its limits are static.
	AdaptiveLimits []AdaptiveLimit `json:"adaptive_limits,omitempty"`
	// With close_established: how this kernel closes the circuit's
	// established connections when it opens (bpf_sock_destroy, sock_diag,
	// or none: they stay open), and how many its passes closed since the
	// daemon started (with a fallback, also those redirected there that
	// its closing sent back).
	CloseMechanism    string `json:"close_mechanism,omitempty"`
	ClosedEstablished uint64 `json:"closed_established,omitempty"`
	// RejectedBy are the pods (or, for cgroups that are no known pod's,
	// the cgroups) the circuit turned away and how often, open
	// (rejected), by its bulkhead (bulkhead_rejected) or by its slow
	// start (slow_start_rejected), most first, at most 32;
	// RejectedByTotal counts them all. Counted by the kernel per
	// cgroup as it rejects, read every second.
	RejectedBy      []RejectedBy `json:"rejected_by,omitempty"`
	RejectedByTotal int          `json:"rejected_by_total,omitempty"`
	// FleetNodes is set on a circuit open by the fleet (state
	// fleet_open): how many other nodes report it open on their own
	// evidence, against FleetQuorum, its quorum.
	FleetNodes  int `json:"fleet_nodes,omitempty"`
	FleetQuorum int `json:"fleet_quorum,omitempty"`
	// SlowStart is set on a closed circuit whose slow start (slow_start)
	// is in progress: the kernel admits only a share of its new connects.
	SlowStart *SlowStart `json:"slow_start,omitempty"`
	// SlowStartRejected counts the connects its slow starts turned away
	// with the overload errno (since its kernel id was given).
	SlowStartRejected uint64 `json:"slow_start_rejected,omitempty"`
}

// SlowStart is a circuit's ramp after recovery, as /v1/circuits reports
// it.
type SlowStart struct {
	// Share is the share of new connects the kernel admits now (0..1).
	Share float64 `json:"share"`
	// Until is when the ramp ends: from then on every connect is admitted.
	Until time.Time `json:"until"`
}

// TransitionEvent is one transition as the admin API reports it.
type TransitionEvent struct {
	Time        time.Time `json:"time"`
	Circuit     string    `json:"circuit"`
	Target      string    `json:"target"`
	Workload    string    `json:"workload"`
	From        string    `json:"from"`
	To          string    `json:"to"`
	Reason      string    `json:"reason"`
	FailureRate float64   `json:"failure_rate"`
	SlowRate    float64   `json:"slow_rate"`
	Calls       int       `json:"calls"`
	OpenUntil   time.Time `json:"open_until,omitzero"`
	Trip        int       `json:"trip"`
	// ClosedEstablished is how many established connections the
	// transition's close pass closed (close_established: an opening's to
	// the circuit's destinations, a closing's redirected to its
	// fallback), filled in when the pass is over.
	ClosedEstablished uint64 `json:"closed_established,omitempty"`
}

// RejectedBy is one pod (or, for a cgroup that is no pod's, one cgroup)
// a circuit turned connects or sends away from, open, by its bulkhead or
// by its slow start, as /v1/circuits reports it.
type RejectedBy struct {
	// Pod is "namespace/name" when the cgroup is a known pod's (its
	// containers' cgroups summed).
	Pod string `json:"pod,omitempty"`
	// Cgroup is the cgroup's path below the cgroup v2 mount, for a
	// cgroup that is no known pod's (empty if it is gone).
	Cgroup string `json:"cgroup,omitempty"`
	// Workload is the protected workload the cgroup belongs to (with
	// workloads configured).
	Workload string `json:"workload,omitempty"`
	// Rejected counts the connects and sends the open circuit turned
	// away; ShadowRejected those shadow mode let through.
	Rejected       uint64 `json:"rejected"`
	ShadowRejected uint64 `json:"shadow_rejected,omitempty"`
	// BulkheadRejected counts the connects its bulkhead (max_connections,
	// max_connecting; for a shared circuit, the cgroup's workload's)
	// turned away; BulkheadShadowRejected those shadow mode let through.
	BulkheadRejected       uint64 `json:"bulkhead_rejected,omitempty"`
	BulkheadShadowRejected uint64 `json:"bulkhead_shadow_rejected,omitempty"`
	// SlowStartRejected counts the connects its slow start (slow_start)
	// turned away with the overload errno while the circuit ramped up
	// after recovery; SlowStartShadowRejected those shadow mode let
	// through.
	SlowStartRejected       uint64 `json:"slow_start_rejected,omitempty"`
	SlowStartShadowRejected uint64 `json:"slow_start_shadow_rejected,omitempty"`
}

// AdaptiveLimit is one bulkhead limit that follows latency, as
// /v1/circuits reports it.
type AdaptiveLimit struct {
	// Kind is the option: max_connections or max_connecting.
	Kind      string `json:"kind"`
	Algorithm string `json:"algorithm"`
	// Limit is the limit the kernel enforces now, within [Min, Max].
	Limit int `json:"limit"`
	Min   int `json:"min"`
	Max   int `json:"max"`
	// LatencySeconds is the average latency of the last window the limit
	// moved by (0 before the first).
	LatencySeconds float64 `json:"latency_seconds"`
	// Changes counts the limit's moves since the circuit was made.
	Changes uint64 `json:"changes"`
}

// BulkheadCount is one workload's bulkhead of a shared circuit, as
// /v1/circuits reports it.
type BulkheadCount struct {
	Connections      int64  `json:"connections"`
	Connecting       int64  `json:"connecting"`
	BulkheadRejected uint64 `json:"bulkhead_rejected"`
}

// Label is how breakerctl and Events name it: the pod, else the cgroup.
func (r RejectedBy) Label() string {
	if r.Pod != "" {
		return r.Pod
	}
	if r.Cgroup != "" {
		return r.Cgroup
	}
	return "(gone)"
}
