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

// bulkSlotName names a workload's bulkhead slot of circuit c for the id
// allocator (a reload that keeps it takes the same slot back).
func bulkSlotName(c *circuit, workload string) string { return c.Name() + "#" + workload }

// syncBulkSlots gives a shared circuit with limits one bulkhead slot per
// sharing workload of the current configuration, and releases the slots
// of workloads that no longer share it (or all, without limits). Stale
// limits entries are left to reconcileLimits, which follows every change
// of the configuration.
func (d *Daemon) syncBulkSlots(c *circuit) {
	sharing := c.Workload() == policy.SharedWorkload && c.Machine.Options().HasLimits() && len(d.classes.SharedBulkheads()) > 0
	if !sharing && len(c.SharedSlots()) == 0 {
		return // the usual case: nothing to give or take back
	}
	want := map[uint8]string{}
	if sharing {
		for _, k := range d.classes.SharedBulkheads() {
			want[uint8(k)] = d.classes.SharedOfBulkhead(k)
		}
	}
	// A workload that still shares under another class (a reordered
	// list) keeps its slot: its id, with the sockets it counts and its
	// counters, and its epoch, with the cgroups it turned away. Released
	// and taken again, an idle slot could come back as another's id, and
	// both workloads' rejected cgroups would be forgotten.
	wanted := map[string]bool{}
	for _, w := range want {
		wanted[w] = true
	}
	moved := map[string]bulkSlot{}
	slots := c.SharedSlots()
	for k, s := range slots {
		if want[k] != s.Workload {
			delete(slots, k)
			if wanted[s.Workload] {
				moved[s.Workload] = s
				continue
			}
			d.releaseBulkSlot(c, s)
		}
	}
	if len(want) == 0 {
		return
	}
	for k, w := range want {
		if _, ok := c.SharedSlots()[k]; ok {
			continue
		}
		if s, ok := moved[w]; ok {
			c.SetSharedSlot(k, s)
			continue
		}
		// A slot a previous daemon left for this workload's entry is
		// inherited, with the sockets it counts.
		dst := c.First()
		if ds := c.Dests(); len(ds) > 0 {
			dst = ds[0]
		}
		dst.Class = k
		name := bulkSlotName(c, w)
		id, inherited, ok := d.reg.IDs.Alloc(name, dst)
		if !ok {
			d.metrics.circuitsRefused.WithLabelValues(c.Target()).Inc()
			d.log.Error("no circuit id free for a workload's bulkhead; its connections are not limited", "circuit", c.Name(), "workload", w)
			continue
		}
		var epoch uint32
		if inherited {
			epoch = d.reg.IDs.PinnedEpoch(id) // its rejected cgroups carry on
		} else if err := d.kernel.ResetCounters(id); err != nil {
			d.log.Warn("resetting counters", "circuit", name, "err", err)
		}
		if epoch == 0 {
			epoch = d.reg.NewEpoch()
		}
		c.SetSharedSlot(k, bulkSlot{ID: id, Epoch: epoch, Workload: w})
		d.reg.Recording[id] = c
	}
}

// releaseBulkSlot gives a workload's bulkhead slot back, keeping its
// kernel counts in the target's retired counters; the cgroups it
// rejected are no longer c's (the next sweep deletes their entries).
func (d *Daemon) releaseBulkSlot(c *circuit, s bulkSlot) {
	d.retire(c.Target(), s.ID)
	if d.reg.Recording[s.ID] == c {
		delete(d.reg.Recording, s.ID)
	}
	d.reg.IDs.Release(s.ID, bulkSlotName(c, s.Workload))
}

// retire adds the kernel counts of slot id to target's retired counters,
// so the per-target counters never go down when a circuit goes.
func (d *Daemon) retire(target string, id uint32) {
	if cnt, err := d.kernel.Counters(id); err == nil {
		r := d.retired[target]
		r.Rejected += cnt.Rejected
		r.ShadowRejected += cnt.ShadowRejected
		r.Probes += cnt.Probes
		r.BulkheadRejected += cnt.BulkheadRejected
		d.retired[target] = r
	}
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
		out = append(out, bulkEntry{dst: dst, slot: c.ID, epoch: d.epochOf(c)})
	}
	for k, s := range c.SharedSlots() {
		b := dst
		b.Class = k
		out = append(out, bulkEntry{dst: b, slot: s.ID, epoch: s.Epoch})
	}
	return out
}

// deleteLimits removes every limits entry of dst of c.
func (d *Daemon) deleteLimits(c *circuit, dst maps.Dest) {
	keys := []maps.Dest{dst}
	for k := range c.SharedSlots() {
		b := dst
		b.Class = k
		keys = append(keys, b)
	}
	for _, k := range keys {
		if err := d.kernel.DeleteLimit(k); err != nil {
			d.log.Warn("deleting bulkhead limits", "circuit", c.Name(), "dest", k, "err", err)
		}
	}
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
