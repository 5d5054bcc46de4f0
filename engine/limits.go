package engine

import (
	"slices"

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
// with a slot of its own, taken from the circuit ids (SharedSlots). Its
// own id keeps the verdict's counters and, without a workloads list, the
// bulkhead of the processes of no workload (class 0). An isolated
// workload's circuit is its own bulkhead.

// bulkEntry is one limits-map entry of a circuit: its key, slot and the
// epoch its rejections are recorded under (0: none, an entry for
// responses only).
type bulkEntry struct {
	dst   maps.Dest
	slot  uint32
	epoch uint32
	// share is the share of the limits a workload of the criticality
	// pool is admitted under (0: the whole limits).
	share float64
}

// WriteLimit writes (or removes) the limits entries of destination dst
// of c from its options.
func (e *Engine) WriteLimit(c *Circuit, dst maps.Dest) {
	if dst.Proto != maps.TCP {
		return
	}
	o := c.Machine.Options()
	if !NeedsLimitEntry(o) {
		e.noLimits(c) // a reload took its limits away: it needs no id for them
		if b, ok := e.batched[c]; ok && !b.off {
			e.retireBatch(c) // its sockets stop counting successes
		}
		e.deleteLimits(c, dst)
		e.syncBulkSlots(c)
		return
	}
	if !e.seatForLimits(c) {
		e.metrics.VerdictWriteErrors().Inc()
		e.ErrorEverySecond("", "no circuit id free (every id is in use or held by open sockets); bulkhead and response options are not enforced for a circuit until one is", "circuit", c.Name(), "dest", dst)
		return
	}
	e.syncBulkSlots(c)
	for _, b := range e.limitEntries(c, dst) {
		if err := e.k.PutLimit(b.dst, e.limitFor(c, o, b)); err != nil {
			e.metrics.VerdictWriteErrors().Inc()
			e.log.Error("writing bulkhead limits (not enforced for this destination)", "circuit", c.Name(), "dest", b.dst, "err", err)
		}
	}
}

// WantedLimits returns the limits entries every circuit should have now:
// per TCP destination of a circuit with a limit or followed responses
// (bulkheadEntries: also one per sharing workload for a shared circuit),
// each in its slot. A circuit that needs none stops counting its
// successes in the kernel; one with no id free for them has none
// (WriteLimit logged and counted it).
func (e *Engine) WantedLimits() map[maps.Dest]maps.Limit {
	want := map[maps.Dest]maps.Limit{}
	for c := range e.reg.All() {
		e.syncBulkSlots(c)
		o := c.Machine.Options()
		if !NeedsLimitEntry(o) {
			e.noLimits(c)
			if b, ok := e.batched[c]; ok && !b.off {
				e.retireBatch(c)
			}
			continue
		}
		if !e.seatForLimits(c) {
			continue
		}
		for _, dst := range c.Dests() {
			if dst.Proto != maps.TCP {
				continue
			}
			for _, b := range e.limitEntries(c, dst) {
				want[b.dst] = e.limitFor(c, o, b)
			}
		}
	}
	return want
}

// limitOf is the limits entry of a circuit with id and options o.
func limitOf(id uint32, o *policy.Options) maps.Limit {
	l := maps.Limit{Slot: id, MaxConnections: uint32(o.MaxConnections), MaxConnecting: uint32(o.MaxConnecting), Errno: o.BulkheadRejectErrno}
	if r := &o.Responses; r.Followed() {
		l.Responses = maps.RespTimed
		if r.HTTP {
			l.Responses |= maps.RespHTTP
		}
		if r.ResponseTimeout > 0 {
			l.Responses |= maps.RespInflight
		}
	}
	return l
}

// limitFor is limits entry b of circuit c (options o): its limits, the
// response flags, and with them, where the kernel may count c's ordinary
// successes, its answered word (written first by batchOf).
func (e *Engine) limitFor(c *Circuit, o *policy.Options, b bulkEntry) maps.Limit {
	l := limitOf(b.slot, o)
	if a := e.syncAdaptive(c, o); a != nil {
		a.limitsOf(&l)
	}
	if b.share > 0 {
		l.MaxConnections = uint32(policy.SharedLimit(int(l.MaxConnections), b.share))
		l.MaxConnecting = uint32(policy.SharedLimit(int(l.MaxConnecting), b.share))
	}
	l.Epoch = b.epoch
	if l.Responses != 0 {
		if bt, ok := e.batchOf(c, o); ok {
			l.Responses |= maps.RespBatch
			l.BatchID, l.BatchEpoch, l.FastBound = bt.id, bt.epoch, bt.fast
		}
	}
	return l
}

// limitEntries are the limits entries of dst of c: its bulkheads' (see
// bulkheadEntries), or, for a circuit that follows responses without a
// bulkhead, one under every class connect looks its limits up with (the
// slot is then unused: an entry with both limits 0 only marks sockets).
func (e *Engine) limitEntries(c *Circuit, dst maps.Dest) []bulkEntry {
	if c.Machine.Options().HasLimits() {
		return e.bulkheadEntries(c, dst)
	}
	if c.ID == 0 {
		return nil // no id free for it (WriteLimit logged it): nothing in slot 0
	}
	var out []bulkEntry
	if c.Workload() != policy.SharedWorkload || !e.scoped() {
		out = append(out, bulkEntry{dst: dst, slot: c.ID})
	}
	if c.Workload() == policy.SharedWorkload {
		for _, k := range e.matching.Classes.SharedBulkheads() {
			b := dst
			b.Class = uint8(k)
			if !slices.ContainsFunc(out, func(x bulkEntry) bool { return x.dst == b }) {
				out = append(out, bulkEntry{dst: b, slot: c.ID})
			}
		}
	}
	return out
}

// bulkheadEntries are the limits entries of destination dst of c (which
// has limits): an isolated workload's circuit, or a shared one without a
// workloads list, is keyed as the destination with its own id and epoch
// (given here if it has none: the kernel records whom the bulkhead turns
// away under them); a shared circuit has an entry per sharing workload
// besides, with the slot's id and epoch (syncBulkSlots first).
func (e *Engine) bulkheadEntries(c *Circuit, dst maps.Dest) []bulkEntry {
	var out []bulkEntry
	if c.ID != 0 && (c.Workload() != policy.SharedWorkload || !e.scoped()) {
		out = append(out, bulkEntry{dst: dst, slot: c.ID, epoch: e.EpochOf(c)})
	}
	for k, s := range c.SharedSlots() {
		b := dst
		b.Class = k
		share, _ := e.reg.classes.Share(policy.Class(k))
		out = append(out, bulkEntry{dst: b, slot: s.ID, epoch: s.Epoch, share: share})
	}
	return out
}
