// Package engine is breakerd's event-to-verdict core: what the daemon
// decides from the kernel's outcome records, apart from how it is started,
// fed and served, so that each decision can be tested without root and
// without real time.
//
// The core reaches the kernel only through Kernel, the map operations it
// truly uses (*maps.Kernel implements it; tests use enginetest.Kernel,
// which counts its calls so that a test can wait for a positive signal
// instead of sleeping), reads the time only through a Clock, wall and
// kernel-monotonic (enginetest.Clock in tests), and counts through Metrics, which the
// daemon implements with its Prometheus vectors (the engine does not
// import Prometheus).
//
// What the package holds:
//
//   - Engine, which owns the circuits (its registry: by name and
//     destination, the active and endpoint sets, the endpoint groups,
//     the idle list eviction takes its victim from; the daemon reads
//     them through At, Get, All, Active, Ordered and the counts), the
//     circuits waiting for an id or for room (unenforced, unlimited),
//     the kept overrides, the retired kernel counts and the
//     rate-limited error log. Its methods make a circuit and attach
//     destinations (Make, Attach), record calls (Record: one way, with
//     a count), apply a transition (Apply), seat and release kernel ids
//     (seatID, EnsureID, releaseID), write verdicts (WriteVerdicts),
//     retry what could not be written (RetryUnenforced), evict and drop
//     circuits, and keep the sharing workloads' bulkhead slots and the
//     circuits' epochs.
//   - Handling the kernel's outcome records (HandleBatch: the cache
//     warming, the dating of resets, connect timeouts, responses and the
//     answered batches) and the timers (Tick: connect, response and probe
//     timeouts, the sweep of departed endpoints, the retries, the end of
//     finished slow starts, the reconciliation after lost records).
//   - The lookup of a destination's circuit (Lookup) under a Matching:
//     the configuration, its classes and what host names and Services
//     resolved to, which the daemon resolves and hands the engine
//     (SetMatching) on start, reload and every change of a resolution.
//   - The limits entries of a destination (WriteLimit, WantedLimits),
//     the answered words of the circuits whose ordinary successes the
//     kernel counts (answered.go), and an operator's change to a
//     circuit (Force).
//   - Slow start after recovery (slowstart.go): the ramp verdict a
//     circuit with `slow_start` writes when it closes on successful
//     probes, from which the kernel computes the share of new connects
//     it admits; the engine reports the share now (Ramping), adopts a
//     ramp a previous daemon left (AdoptRamp) and deletes finished ones
//     from the tick (EndRamps).
//   - The fleet's part (Follower): the circuits this node opens because a
//     quorum of other nodes has them open (fleet_open, never probing),
//     the keys that name circuits here (FleetCircuit, FleetQuorum), and
//     the circuits open on its own evidence that its report lists
//     (Reported); the daemon runs the API side (package fleet).
//   - Circuit, one circuit in a single 192-byte allocation, and the
//     destination index (DestIndex), ids and the rules of their seating
//     (IDs), the overrides kept across restarts (Overrides), circuit names
//     and a target's enumerable destinations.
//
// The transition is the truth of what is written: a circuit without a
// kernel id is seated as it is about to open, before its transition is
// computed (policy.Seat, passed by Record), so the transition's round is
// its verdict's, and a verdict write never changes the state machine.
//
// Its tests run without root and without real time: engine_test.go
// calls the engine's methods, handle_test.go feeds it records and runs
// its tick as the daemon does, both on enginetest's kernel and clock.
//
// One goroutine owns an Engine (the daemon's owner): it is not safe for
// concurrent use. After each step the owner calls Publish, and other
// goroutines read the Summary it made (the circuits by state and the
// owner of each kernel id, by target, kept up to date as the engine goes
// rather than walked), never the engine itself.
//
// What the daemon does around the engine, through Hooks: the close pass
// of close_established (Opened), and the event list and the Kubernetes
// Event of a transition (Transitioned). A reload's decisions about
// circuits are the engine's (Reconfigure, Rematch); the daemon hands it
// the new configuration and resolutions (SetMatching), and keeps
// start-up and the adoption of pinned state, the heartbeat, the
// goroutines and their shutdown order, the admin server and the ground
// watcher.
package engine
