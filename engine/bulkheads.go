package engine

import (
	"slices"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// bulkSlotName names a workload's bulkhead slot of circuit c for the id
// allocator (a reload that keeps it takes the same slot back).
func bulkSlotName(c *Circuit, workload string) string { return c.Name() + "#" + workload }

// syncBulkSlots gives a shared circuit with limits one bulkhead slot per
// sharing workload of the current configuration, and releases the slots
// of workloads that no longer share it (or all, without limits). Stale
// limits entries are left to reconcileLimits, which follows every change
// of the configuration.
func (e *Engine) syncBulkSlots(c *Circuit) {
	sharing := c.Workload() == policy.SharedWorkload && c.Machine.Options().HasLimits() && len(e.reg.classes.SharedBulkheads()) > 0
	if !sharing && len(c.SharedSlots()) == 0 {
		return // the usual case: nothing to give or take back
	}
	// Each sharing workload's class wants its own slot, but the classes
	// of the workloads with a criticality want the circuit's pool's, one
	// slot for them all.
	want := map[uint8]string{}
	if sharing {
		for _, k := range e.reg.classes.SharedBulkheads() {
			want[uint8(k)] = e.reg.classes.SharedOfBulkhead(k)
			if _, pooled := e.reg.classes.Share(k); pooled {
				want[uint8(k)] = policy.CriticalityPool
			}
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
	moved := map[string]BulkSlot{}
	released := map[uint32]bool{} // a pool's slot is held by several classes
	slots := c.SharedSlots()
	for k, s := range slots {
		if want[k] != s.Workload {
			delete(slots, k)
			if wanted[s.Workload] {
				moved[s.Workload] = s
				continue
			}
			if !released[s.ID] {
				released[s.ID] = true
				e.releaseBulkSlot(c, s)
			}
		}
	}
	if len(want) == 0 {
		return
	}
	// In class order: a pool's slot is allocated for its first class, so a
	// restarted daemon inherits it through the same entry.
	classes := make([]uint8, 0, len(want))
	for k := range want {
		classes = append(classes, k)
	}
	slices.Sort(classes)
	for _, k := range classes {
		w := want[k]
		if _, ok := c.SharedSlots()[k]; ok {
			continue
		}
		if s, ok := moved[w]; ok {
			c.SetSharedSlot(k, s)
			continue
		}
		if s, ok := slotOf(c, w); ok {
			c.SetSharedSlot(k, s) // the pool's, taken for an earlier class
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
		id, inherited, ok := e.reg.ids.Alloc(name, dst)
		if !ok {
			e.metrics.Refused(c.Target()).Inc()
			e.log.Error("no circuit id free for a workload's bulkhead; its connections are not limited", "circuit", c.Name(), "workload", w)
			continue
		}
		var epoch uint32
		if inherited {
			epoch = e.reg.ids.PinnedEpoch(id) // its rejected cgroups carry on
		} else if err := e.k.ResetCounters(id); err != nil {
			e.log.Warn("resetting counters", "circuit", name, "err", err)
		}
		if epoch == 0 {
			epoch = e.reg.NewEpoch()
		}
		c.SetSharedSlot(k, BulkSlot{ID: id, Epoch: epoch, Workload: w})
		e.owners.set(id, IDOwner{Target: c.Target(), Bulk: true})
		e.reg.recording[id] = c
	}
}

// slotOf returns the slot c holds for workload w under some class.
func slotOf(c *Circuit, w string) (BulkSlot, bool) {
	for _, s := range c.SharedSlots() {
		if s.Workload == w {
			return s, true
		}
	}
	return BulkSlot{}, false
}

// releaseBulkSlot gives a workload's bulkhead slot back, keeping its
// kernel counts in the target's retired counters; the cgroups it
// rejected are no longer c's (the next sweep deletes their entries).
func (e *Engine) releaseBulkSlot(c *Circuit, s BulkSlot) {
	e.retire(c.Target(), s.ID)
	if e.reg.recording[s.ID] == c {
		delete(e.reg.recording, s.ID)
	}
	e.owners.clear(s.ID)
	e.reg.ids.Release(s.ID, bulkSlotName(c, s.Workload))
}

// retire adds the kernel counts of slot id to target's retired counters,
// so the per-target counters never go down when a circuit goes.
func (e *Engine) retire(target string, id uint32) {
	if cnt, err := e.k.Counters(id); err == nil {
		r := e.retired[target]
		r.Rejected += cnt.Rejected
		r.ShadowRejected += cnt.ShadowRejected
		r.Probes += cnt.Probes
		r.BulkheadRejected += cnt.BulkheadRejected
		r.SlowStartRejected += cnt.SlowStartRejected
		r.Redirected += cnt.Redirected
		e.retired[target] = r
	}
}

// deleteLimits removes every limits entry of dst of c.
func (e *Engine) deleteLimits(c *Circuit, dst maps.Dest) {
	keys := []maps.Dest{dst}
	for k := range c.SharedSlots() {
		b := dst
		b.Class = k
		keys = append(keys, b)
	}
	for _, k := range keys {
		if err := e.k.DeleteLimit(k); err != nil {
			e.log.Warn("deleting bulkhead limits", "circuit", c.Name(), "dest", k, "err", err)
		}
	}
}

// setEpoch gives c epoch ep and files it among the circuits whose
// rejections are recorded.
func (e *Engine) setEpoch(c *Circuit, ep uint32) {
	c.SetEpoch(ep)
	e.reg.recording[c.ID] = c
}

// EpochOf returns c's epoch, giving it one first if it has none.
func (e *Engine) EpochOf(c *Circuit) uint32 {
	if ep := c.Epoch(); ep != 0 {
		return ep
	}
	if c.ID == 0 {
		return 0 // nothing of it in the kernel to key: see EnsureID
	}
	ep := e.reg.NewEpoch()
	e.setEpoch(c, ep)
	return ep
}

// forgetEpoch is called when c is dropped: its entries are stale from now
// on (its verdicts are gone) and the next sweep deletes them.
func (e *Engine) forgetEpoch(c *Circuit) {
	if c.Epoch() != 0 && e.reg.recording[c.ID] == c {
		delete(e.reg.recording, c.ID)
	}
}
