package fleet

import (
	"slices"
	"sort"
	"time"

	"github.com/breakerd/breakerd/policy"
)

// MinQuorum is the smallest quorum: one node alone, misconfigured,
// partitioned or compromised, never opens a circuit on other nodes.
const MinQuorum = policy.MinFleetQuorum

// Tally counts, per destination key, the other nodes whose reports have
// it open now. It is pure: the caller feeds it the reports a watch
// delivers (Observe, Forget) and the time (every decision takes now), so
// it needs no API and no clock of its own. It is not safe for concurrent
// use.
//
// Only other nodes count: a node's own report is its own evidence, which
// it acts on without the fleet, so the Tally skips the report named self.
// An entry counts while its open-until is after now; there is no
// heartbeat, so the report of a node that died stops counting by itself.
type Tally struct {
	self    string
	reports map[string][]Circuit // node → its circuits
}

// NewTally returns an empty Tally for the node named self.
func NewTally(self string) *Tally {
	return &Tally{self: self, reports: map[string][]Circuit{}}
}

// Observe records a report as the watch delivered it (added or updated),
// replacing that node's earlier one. Entries without a key are ignored.
func (t *Tally) Observe(r *CircuitReport) {
	if r == nil || r.Name == "" || r.Name == t.self {
		return
	}
	cs := make([]Circuit, 0, len(r.Spec.Circuits))
	for _, c := range r.Spec.Circuits {
		if c.Key != "" {
			cs = append(cs, c)
		}
	}
	t.reports[r.Name] = cs
}

// Forget drops a node's report (the watch delivered its deletion).
func (t *Tally) Forget(node string) { delete(t.reports, node) }

// Count returns how many distinct other nodes have key open at now.
func (t *Tally) Count(key string, now time.Time) int {
	n := 0
	for _, cs := range t.reports {
		for _, c := range cs {
			if c.Key == key && c.OpenUntil.After(now) {
				n++
				break
			}
		}
	}
	return n
}

// Verdict is the fleet's decision for one destination key.
type Verdict struct {
	// Key is the destination.
	Key string
	// Nodes is how many other nodes have it open now.
	Nodes int
	// Quorum is the quorum it was judged against.
	Quorum int
	// Until is when, with no new report, fewer than Quorum nodes will
	// have it open: the Quorum-th latest open-until among them.
	Until time.Time
}

// Open returns the keys the fleet opens at now, ordered by key: those
// that at least quorum(key) other nodes have open. quorum returns the
// key's quorum, or 0 when the fleet does not apply to it (no `fleet`
// block); a quorum below MinQuorum is taken as MinQuorum, so a caller's
// mistake never lets one node decide. A key below its quorum is closed
// by the fleet; whether the node's own evidence has it open is the
// caller's, and separate.
func (t *Tally) Open(now time.Time, quorum func(key string) int) []Verdict {
	// Per key, each node's latest open-until that is still in the future.
	until := map[string][]time.Time{}
	for _, cs := range t.reports {
		latest := map[string]time.Time{}
		for _, c := range cs {
			if u := c.OpenUntil.Time; u.After(now) && u.After(latest[c.Key]) {
				latest[c.Key] = u
			}
		}
		for k, u := range latest {
			until[k] = append(until[k], u)
		}
	}
	var out []Verdict
	for k, us := range until {
		q := quorum(k)
		if q <= 0 {
			continue
		}
		q = max(q, MinQuorum)
		if len(us) < q {
			continue
		}
		slices.SortFunc(us, func(a, b time.Time) int { return b.Compare(a) })
		out = append(out, Verdict{Key: k, Nodes: len(us), Quorum: q, Until: us[q-1]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// NextExpiry returns the earliest open-until after now among the entries
// of other nodes: when a count may next fall, so when the caller should
// decide again if no report arrives before. ok is false when nothing
// counts.
func (t *Tally) NextExpiry(now time.Time) (next time.Time, ok bool) {
	for _, cs := range t.reports {
		for _, c := range cs {
			if u := c.OpenUntil.Time; u.After(now) && (!ok || u.Before(next)) {
				next, ok = u, true
			}
		}
	}
	return next, ok
}
