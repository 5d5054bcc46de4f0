// Package engine is breakerd's event-to-verdict core: what the daemon
// decides from the kernel's outcome records, apart from how it is started,
// fed and served, so that each decision can be tested without root and
// without real time.
//
// The core reaches the kernel only through Kernel, the map operations it
// truly uses (*maps.Kernel implements it; tests use enginetest.Kernel,
// which counts its calls so that a test can wait for a positive signal
// instead of sleeping), and reads the time only through a Clock
// (enginetest.Clock in tests).
//
// What the package holds: the destination index (DestIndex), circuit ids
// and the rules of their seating (IDs), the overrides kept across
// restarts (Overrides), circuit names and a target's enumerable
// destinations. The daemon's registry holds a DestIndex and an IDs, and
// the daemon's core methods (daemon/circuits.go, answered.go,
// bulkheads.go, and handle, apply and tick in daemon.go) use Kernel and
// Clock, so daemon/core_test.go runs them on the fakes.
//
// The cut still to make, in steps that each build and pass:
//
//   - The circuit type, the registry with its LRU, handling an outcome
//     record, applying a transition and writing verdicts move here as an
//     Engine that owns that state. A circuit carries its target's
//     Prometheus series today, so the engine first needs its own
//     metrics seam (counters it exports, which the daemon's collectors
//     read).
//   - The engine is driven by the reader's goroutine alone and publishes
//     snapshots for the admin API, the metrics and the status page,
//     which then no longer take its lock.
//
// What stays in the daemon: start-up and adoption of pinned state, the
// heartbeat, reload (it hands the engine a new configuration), the
// goroutines and their shutdown order, the admin server and the ground
// watcher.
package engine
