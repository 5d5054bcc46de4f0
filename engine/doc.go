// Package engine is breakerd's event-to-verdict core: what the daemon
// decides from the kernel's outcome records, apart from how it is started,
// fed and served, so that each decision can be tested without root and
// without real time.
//
// The engine reaches the kernel only through Kernel, the handful of map
// operations the core truly uses (*maps.Kernel implements it; tests use
// enginetest.Kernel, which counts its calls so a test can wait for a
// positive signal instead of sleeping), and reads the time only through a
// Clock (enginetest.Clock in tests).
//
// The cut, in the order it is made (each step builds and passes):
//
//  1. The parts with no knowledge of a circuit: the destination index
//     (DestIndex) and the circuit ids with their seating rules (IDs), the
//     Kernel interface and the Clock. The daemon's registry holds them.
//  2. The daemon's core files reach the kernel through Kernel and the
//     time through Clock, so the daemon's decisions (id scarcity,
//     unenforced circuits, eviction, overrides) run against a fake
//     kernel and a fake clock in its own tests.
//  3. The circuit type, the registry with its LRU and name parsing, the
//     handling of an outcome record, applying a transition and writing
//     verdicts (daemon/circuits.go, events.go, answered.go,
//     responses.go, bulkheads.go, rejections.go) move here whole, as an
//     Engine type that owns that state. It publishes snapshots for the
//     admin API, metrics and the status page, and is driven by the
//     reader's goroutine.
//
// What stays in the daemon: start-up and adoption of pinned state, the
// heartbeat, reload (it hands the engine a new configuration), the
// goroutines and their shutdown order, the admin server and the ground
// watcher.
package engine
