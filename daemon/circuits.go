package daemon

import (
	"time"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// circuit and bulkSlot are the engine's; allTarget names the target of
// dynamic circuits.
type (
	circuit  = engine.Circuit
	bulkSlot = engine.BulkSlot
)

const allTarget = engine.AllTarget

// idLimitForTest, when not 0, is the number of ids a new daemon has
// (tests that run out of ids at start-up).
var idLimitForTest uint32

// newEngine makes the daemon's core on d.kernel and d.clock; the
// response programs were attached at respSince (maps.Now clock).
func (d *Daemon) newEngine(respSince time.Duration) {
	limit := uint32(maps.MaxCircuitIDs)
	if idLimitForTest != 0 {
		limit = idLimitForTest
	}
	d.eng = engine.New(engine.Config{Kernel: d.kernel, Clock: d.clock, Log: d.log, Metrics: d.metrics, Hooks: hooks{d}, Rand: d.rand, IDs: limit, RespondingSince: respSince})
}

// hooks are the daemon's part in what the engine decides (engine.Hooks).
type hooks struct{ d *Daemon }

// Opened queues c's close_established passes (closer.go).
func (h hooks) Opened(c *circuit, from, to policy.State, at time.Time) {
	h.d.closePasses(c, from, to, at)
}

// Transitioned files the transition in the event list and sends its
// Kubernetes Event.
func (h hooks) Transitioned(c *circuit, t policy.Transition) {
	d := h.d
	d.kubeEvent(c, t)
	d.fleetNoted(c, t)
	d.events.add(TransitionEvent{Time: t.At, Circuit: c.Name(), Target: c.Target(), Workload: c.Workload(), From: t.From.String(), To: t.To.String(),
		Reason: string(t.Reason), FailureRate: t.FailureRate, SlowRate: t.SlowRate, Calls: t.Calls, OpenUntil: t.OpenUntil, Trip: t.Trip})
}
