package engine

import (
	"time"

	"github.com/breakerd/breakerd/policy"
)

// Force applies an operator's change to c: "open", "close", "release"
// (back to the configured behaviour) or "reset". The override is kept
// across restarts and the verdicts written; a circuit the change closed
// gives its id back. ok is false for an unknown action (nothing changed).
// The daemon logs, counts and lists the change (Hooks are not told).
func (e *Engine) Force(c *Circuit, action string, now time.Time) (t policy.Transition, ok bool) {
	switch action {
	case "open":
		e.EnsureID(c) // its verdict needs one (none free: it waits, unenforced)
		t = c.Machine.Override(now, policy.ForceOpen)
		e.KeepOverride(c, policy.ForceOpen)
	case "close":
		t = c.Machine.Override(now, policy.ForceClosed)
		e.KeepOverride(c, policy.ForceClosed)
	case "release":
		t = c.Machine.Override(now, policy.NoOverride)
		e.KeepOverride(c, policy.NoOverride)
	case "reset":
		t = c.Machine.Reset(now)
	default:
		return t, false
	}
	e.reg.Track(c)
	e.WriteVerdicts(c, t)
	if t.From != t.To && t.To == policy.Closed {
		e.releaseID(c)
	}
	return t, true
}
