// Package fleet is breakerd's shared store of circuit state: each node
// publishes, in a CircuitReport named after it, the circuits it has open
// on its own evidence; every node reads the others' reports and counts,
// per destination, the nodes that still have it open.
//
// The store is the Kubernetes API, not gossip of breakerd's own: the
// CircuitReport custom resource (deploy/fleet-crd.yaml) holds one object
// per node, and a ValidatingAdmissionPolicy (deploy/fleet-policy.yaml)
// lets a service account write only the report of the node its pod-bound
// token names. Reports carry no heartbeat: each circuit carries its
// open-until, and a circuit past it stops counting by itself, so a node
// that died or lost the API drops out of every tally without writing.
//
// The package has four parts, each usable alone: the API type
// (CircuitReport, with KubeStore to write and read it), the Writer (a
// node's own report, coalesced, bounded, never blocking its caller), the
// Watcher (every node's report, through an informer) and the Tally (pure:
// the reports seen, the clock, and the quorum decision). The daemon
// reaches it through kube.Fleet, and decides with engine.Follower, for
// the circuits whose configuration has a `fleet` block.
package fleet

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// The API group, version, kind and resource of a report.
const (
	Group    = "breakerd.io"
	Version  = "v1alpha1"
	Kind     = "CircuitReport"
	Resource = "circuitreports"
)

// GroupVersionResource names the reports' resource for the dynamic client.
var GroupVersionResource = schema.GroupVersionResource{Group: Group, Version: Version, Resource: Resource}

// MaxCircuits is the most circuits one report lists (the CRD's maxItems).
// Past it the most recently opened win and Spec.Omitted counts the rest.
// It bounds what each write costs every watcher: a report of 128 circuits
// is 23 KB of JSON as written and 40 KB as the API server stores it and
// sends it to every node, managedFields included (TestFleetReportSize).
const MaxCircuits = 128

// CircuitReport is one node's report: the circuits it has open on its own
// evidence. It is cluster-scoped and named after the node.
type CircuitReport struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              ReportSpec `json:"spec"`
}

// ReportSpec is what a node reports.
type ReportSpec struct {
	// Open is how many circuits the node has open on its own evidence,
	// listed or not.
	Open int `json:"open"`
	// Omitted is how many of them the report leaves out (past
	// MaxCircuits; the least recently opened go first).
	Omitted int `json:"omitted"`
	// Circuits are the listed circuits, ordered by key. A report
	// cleared by a server-side apply has none stored (the schema does
	// not require the field), which reads as an empty list.
	Circuits []Circuit `json:"circuits"`
}

// Circuit is one circuit a node has open on its own evidence.
type Circuit struct {
	// Key names the destination fleet-wide: the circuit's name as
	// breakerd gives it (tcp/ADDR:PORT for a dynamic circuit of `all`,
	// the target's name in service scope, with @WORKLOAD for an isolated
	// workload's circuit), the same on every node with the same
	// configuration. The Tally counts nodes per key.
	Key string `json:"key"`
	// Target is the target the circuit belongs to (`all` for dynamic
	// circuits).
	Target string `json:"target"`
	// Workload is the circuit's workload class (`shared`, or an isolated
	// workload's name).
	Workload string `json:"workload"`
	// Since is when the circuit opened.
	Since metav1.MicroTime `json:"since"`
	// OpenUntil is when this entry stops counting, unless a later write
	// replaces it: other nodes treat it as expired from then on.
	OpenUntil metav1.MicroTime `json:"openUntil"`
	// Reason is why it opened (a policy.Reason: failure_rate,
	// consecutive_failures …).
	Reason string `json:"reason"`
}
