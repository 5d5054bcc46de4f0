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
// the quorum. A reload that changes it gives the circuits their new
// options and keeps their state, as with any option.
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
	{"fleet", "(none: off)", "mapping", "Shares the state of these circuits (of `all`, or of a target) with the other nodes through the Kubernetes API (see *Fleet*; needs API access, and the CRD and policy of `deploy/`): this node reports the ones it opens on its own evidence, and opens, without probing, the ones a quorum of other nodes reports. Present, even empty (`fleet: {}`), it takes the defaults below. A target's block stands in for `all`'s, as every option does."},
	{"fleet.quorum", "2", fmt.Sprintf("nodes in [%d, %d]", MinFleetQuorum, MaxFleetQuorum), "How many other nodes must report the circuit open on their own evidence for this node to open it (`fleet_open`). A quorum of 1 is refused: one node alone, misconfigured, partitioned or compromised, must never open a circuit fleet-wide."},
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
	b.WriteString("Every node learns alone, unless its circuits have a `fleet` block: then the nodes share what they have open through the Kubernetes API, so that a dependency that failed on a quorum of nodes is rejected on every other node at once, before it costs each of them its own failures, and so that at recovery only the nodes that saw it fail probe it.\n\n")
	b.WriteString("**What is written, and by whom.** Each node writes one `CircuitReport` (`deploy/fleet-crd.yaml`: group `breakerd.io`, cluster-scoped, named after the node; `kubectl get circuitreports` lists them) listing the circuits it has open **on its own evidence** (open or half-open by its state machine; not `forced_open`, not a circuit it follows): for each, its key (the circuit's name: `tcp/ADDR:PORT` for a dynamic circuit of `all`, the target's name, `TARGET/ADDR:PORT` in endpoint scope, with `@WORKLOAD` for an isolated workload's), target, workload, since, open-until and reason. ")
	b.WriteString("It is written only when that set changes, at most once a second (changes in between are coalesced, the latest wins), with at most 128 circuits (past that, the most recently opened win and `breakerd_fleet_report_omitted_circuits` counts the rest). ")
	b.WriteString("The admission policy of `deploy/fleet-policy.yaml` lets a service account write only the report named after the node its pod-bound token names, so a node cannot speak for another.\n\n")
	b.WriteString("**Expiry instead of heartbeats.** An open circuit's entry counts until its open duration ends, plus one `probe_timeout` and one second (the time of a write), so the other nodes stay with it through its first half-open round; a half-open circuit's, until its round began plus as much, renewed by each new round. Nothing is written while nothing changes, and the report of a node that died, or lost the API, stops counting by itself.\n\n")
	b.WriteString("**Quorum and following.** A node counts, per key, the **other** nodes whose entries have not expired (its own report never counts). When at least `fleet.quorum` of them have a key open and this node's circuit of that key is closed, it opens it at once, in state `fleet_open` (reason `fleet_quorum`), even if it never sent traffic there: a dynamic circuit is made for it, an endpoint circuit from its address; a service-scope target's circuit is followed once it exists. ")
	b.WriteString("A followed circuit rejects every connect in the kernel and **never probes** (its verdict is the forced-open one); it writes nothing to the node's report, so writes stay near the quorum however many nodes follow. It closes (reason `fleet_quorum_lost`) as soon as fewer than the quorum have it open, because their circuits closed or their entries expired; the node decides again at the earliest expiry, with no polling. `/v1/circuits` shows it with `fleet_nodes` and `fleet_quorum`; the event list, the log and a Kubernetes Event record each follow and its end, and `breakerd_fleet_followed_circuits` counts them.\n\n")
	b.WriteString("**Own evidence and operators win.** A circuit open on the node's own evidence is not closed by the fleet, and one under an override (`state:` or `breakerctl force`) is never opened or closed by it; a follow is no override and is not kept in the pinned overrides map. A node that closes its own circuit on successful probes while a quorum of others still report it follows them again.\n\n")
	b.WriteString("**Failure modes.** The API is never in the path of protection: start-up and reload never wait for it; with it down, slow or refusing writes, local breaking works as without the fleet, failed writes are counted (`breakerd_fleet_report_write_errors_total`) and retried with the latest state, backed off from 1 s to 30 s, and followed circuits close when the entries they follow expire. A restarted node keeps the follows its predecessor left in the kernel until it has listed the reports (at most 10 s), then decides afresh; its first write replaces its previous report. A node without API access logs that it decides alone.\n\n")
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
	c.setState(FleetOpen)
	c.openUntil, c.consecutive, c.blocked = stampOf(until), 0, false
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
