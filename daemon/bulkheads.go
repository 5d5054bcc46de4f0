package daemon

import (
	"github.com/breakerd/breakerd/api"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Bulkheads per workload. Workloads share circuits by default (one
// circuit per destination for the node: failure detection sees every
// workload's failures), but each has a bulkhead of its own, so one
// tenant's connections never fill another's. The kernel looks a
// connection's limits up by its workload's bulkhead class (the workloads
// map's `bulkhead`, policy.Classes.Bulkhead), so a shared circuit with a
// limit has one limits entry per destination and sharing workload, each
// with a slot of its own, taken from the circuit ids: extra.bulkSlots. Its
// own id keeps the verdict's counters and, without a workloads list, the
// bulkhead of the processes of no workload (class 0). An isolated
// workload's circuit is its own bulkhead, as before.

// bulkEntry is one limits-map entry of a circuit: its key, slot and the
// epoch its rejections are recorded under (0: none, an entry for
// responses only).
type bulkEntry struct {
	dst   maps.Dest
	slot  uint32
	epoch uint32
}

// bulkheadEntries are the limits entries of destination dst of c (which
// has limits): an isolated workload's circuit, or a shared one without a
// workloads list, is keyed as the destination with its own id and epoch
// (given here if it has none: the kernel records whom the bulkhead turns
// away under them); a shared circuit has an entry per sharing workload
// besides, with the slot's id and epoch (syncBulkSlots first). Under d.mu.
func (d *Daemon) bulkheadEntries(c *circuit, dst maps.Dest) []bulkEntry {
	var out []bulkEntry
	if c.ID != 0 && (c.Workload() != policy.SharedWorkload || !d.cfg.Scoped()) {
		out = append(out, bulkEntry{dst: dst, slot: c.ID, epoch: d.eng.EpochOf(c)})
	}
	for k, s := range c.SharedSlots() {
		b := dst
		b.Class = k
		out = append(out, bulkEntry{dst: b, slot: s.ID, epoch: s.Epoch})
	}
	return out
}

// BulkheadCount is api.BulkheadCount.
type BulkheadCount = api.BulkheadCount

// completeBulkheads adds the sharing workloads' bulkheads to ci: each by
// workload name, and into the circuit's totals.
func (d *Daemon) completeBulkheads(ci *CircuitInfo, slots []bulkSlot) {
	if len(slots) == 0 {
		return
	}
	ci.Bulkheads = map[string]BulkheadCount{}
	for _, s := range slots {
		var b BulkheadCount
		if cnt, err := d.kernel.Counters(s.ID); err == nil {
			b.BulkheadRejected = cnt.BulkheadRejected
		}
		if n, err := d.kernel.BulkCount(s.ID); err == nil {
			b.Connections, b.Connecting = n.Connections, n.Connecting
		}
		ci.Bulkheads[s.Workload] = b
		ci.Connections += b.Connections
		ci.Connecting += b.Connecting
		ci.BulkheadRejected += b.BulkheadRejected
	}
}
