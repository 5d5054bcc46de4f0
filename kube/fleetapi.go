package kube

import "time"

// FleetCircuit is one circuit this node has open on its own evidence, as
// its CircuitReport lists it (fleet.Circuit, without the API types).
type FleetCircuit struct {
	Key, Target, Workload, Reason string
	Since, OpenUntil              time.Time
}

// FleetOpen is the fleet's decision on one key (fleet.Verdict): Nodes
// other nodes, at least Quorum, have it open; with no new report fewer
// than Quorum will from Until.
type FleetOpen struct {
	Key           string
	Nodes, Quorum int
	Until         time.Time
}

// FleetStats are the report writer's counters (fleet.Stats) and the
// watcher's failed reads (fleet.ReadErrors).
type FleetStats struct {
	Writes, Errors, Omitted uint64
	ListErrors, WatchErrors uint64
}
