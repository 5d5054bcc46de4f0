package policy

import (
	"fmt"
	"strings"
	"time"
)

// The fleet's quorum bounds. MinFleetQuorum is 2 so that one node alone,
// misconfigured, partitioned or compromised, can never open a circuit on
// other nodes; MaxFleetQuorum is the largest cluster Kubernetes supports.
const (
	MinFleetQuorum = 2
	MaxFleetQuorum = 5000
)

// FleetOptions are a circuit's `fleet` block: whether its state is shared
// with the other nodes through the Kubernetes API (package fleet), and
// the quorum. The block is experimental and inert in this version: it is
// parsed and validated, and nothing acts on it; Diff ignores it, so a
// reload that changes only it resets no circuit.
type FleetOptions struct {
	// Enabled: the block is present.
	Enabled bool
	// Quorum is how many other nodes must report the circuit open on their
	// own evidence for the fleet to open it on this node (at least
	// MinFleetQuorum).
	Quorum int
}

// fleetFields document the block's keys.
var fleetFields = []docField{
	{"fleet", "(none: off)", "mapping", "Experimental and inert in this version (see *Fleet*): validated, with no effect. It marks the circuits (of `all`, or of a target) whose state the fleet is to share with the other nodes; present, even empty (`fleet: {}`), it takes the defaults below. A target's block stands in for `all`'s, as every option does."},
	{"fleet.quorum", "2", fmt.Sprintf("nodes in [%d, %d]", MinFleetQuorum, MaxFleetQuorum), "The quorum the fleet is to use: how many other nodes must report the circuit open on their own evidence for the fleet to open it on this node. A quorum of 1 is refused: one node alone, misconfigured, partitioned or compromised, must never open a circuit fleet-wide."},
}

var fleetKeys = []string{"quorum"}

// fleet decodes a `fleet` block at path.
func (d *decoder) fleet(path string, v any) FleetOptions {
	m, ok := asMap(v)
	if !ok {
		d.add(path, "must be a mapping (quorum); write `fleet: {}` for the defaults")
		return FleetOptions{}
	}
	f := FleetOptions{Enabled: true, Quorum: MinFleetQuorum}
	for _, k := range sortedKeys(m) {
		if m[k] == nil {
			continue // reported as a null value
		}
		switch k {
		case "quorum":
			q := f.Quorum
			if err := setInt(&q, m[k], -1<<31, MaxFleetQuorum); err != nil {
				d.add(path+".quorum", "%v", err)
				continue
			}
			if q < MinFleetQuorum {
				d.add(path+".quorum", "a quorum of %d is refused: it would let one node alone (misconfigured, partitioned or compromised) open this circuit on every node; the least is %d", q, MinFleetQuorum)
				continue
			}
			f.Quorum = q
		default:
			d.add(path+"."+k, "unknown key%s", d.suggest(k, fleetKeys))
		}
	}
	return f
}

// writeFleetReference writes the configuration reference's section on the
// fleet.
func writeFleetReference(b *strings.Builder) {
	b.WriteString("## Fleet\n\n")
	b.WriteString("**Experimental and inert in this version.** A `fleet` block, in `all` or in a target, is parsed and validated at start-up, on reload and by `breakerctl config validate`, and nothing else reads it: breakerd writes no report and opens no circuit because other nodes have it open. ")
	b.WriteString("It is accepted so that a configuration written with it is checked, while the store it is for ships first: the `CircuitReport` resource (`deploy/fleet-crd.yaml`, group `breakerd.io`, one object per node, named after the node, listing the circuits that node has open on its own evidence, each with an open-until after which it no longer counts) and the admission policy that lets a node's service account write only the report named after its own node (`deploy/fleet-policy.yaml`). ")
	b.WriteString("A reload that changes only a `fleet` block resets no circuit.\n\n")
	writeTable(b, fleetFields)
	b.WriteString("\n")
}

// The reasons of a follow's transitions.
const (
	// ReasonFleetQuorum: a quorum of other nodes has the circuit open on
	// their own evidence, and this node follows (FleetOpen).
	ReasonFleetQuorum Reason = "fleet_quorum"
	// ReasonFleetQuorumLost: fewer than the quorum still have it open
	// (their circuits closed, or their entries expired).
	ReasonFleetQuorumLost Reason = "fleet_quorum_lost"
)

// Follow opens a closed circuit because a quorum of other nodes has it
// open on their own evidence: FleetOpen, until until, when the fleet's
// count falls below the quorum unless a later report renews it. A
// followed circuit only renews its until (no transition). Any other
// state stays: a circuit open on the node's own evidence is its own, and
// an operator's override is never overridden by the fleet.
func (c *Circuit) Follow(now, until time.Time) (Transition, bool) {
	switch c.state {
	case FleetOpen:
		c.openUntil = stampOf(until)
		return Transition{}, false
	case Closed:
	default:
		return Transition{}, false
	}
	c.last = stampOf(now)
	t := c.transition(now, FleetOpen, ReasonFleetQuorum)
	t.OpenUntil = until
	c.state, c.openUntil, c.consecutive, c.blocked = FleetOpen, stampOf(until), 0, false
	return t, true
}

// Unfollow closes a followed circuit (FleetOpen) whose quorum is lost; it
// counts its calls afresh. Any other state stays (false).
func (c *Circuit) Unfollow(now time.Time) (Transition, bool) {
	if c.state != FleetOpen {
		return Transition{}, false
	}
	c.last = stampOf(now)
	return c.close(now, ReasonFleetQuorumLost), true
}
