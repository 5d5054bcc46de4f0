package daemon

import (
	"cmp"
	"context"
	stdmaps "maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/breakerd/breakerd/api"

	"github.com/breakerd/breakerd/maps"
)

// Which cgroups (and so which pods) each circuit turned away: the kernel
// counts them in the rejections map on the reject paths only, keyed by the
// rejecting verdict's circuit id and epoch (a slow-start ramp's verdict
// carries the circuit's epoch too), or the rejecting limit's slot and
// epoch, and the caller's cgroup; an open circuit's rejections, a
// bulkhead's and a slow-start ramp's are counted apart in one entry. The
// epoch names one circuit among those that held the id one after the
// other: a circuit takes one when it first writes a rejecting verdict or a
// limit of its own slot (or inherits the one its pinned verdicts or limits
// carry at start-up), and a sharing workload's bulkhead slot one of its
// own when it is given out (bulkSlot.epoch), so a reused id never shows
// another circuit's rejections.
//
// Every rejectionsEvery the daemon reads the map (outside the owner's steps), keeps
// the live circuits' entries in an index the admin API and Events read,
// and deletes the entries of circuits that are gone (no live circuit holds
// their id and epoch) and of cgroups that are gone (not below the attach
// point at two sweeps in a row: a cgroup made after the tree was last
// walked gets a second chance).

// rejectionsEvery is how often the rejections map is read.
const rejectionsEvery = time.Second

// listedRejected is the most rejected cgroups or pods one circuit lists;
// rejected_by_total counts them all.
const listedRejected = 32

// cgroupRejections is one cgroup's rejections by one circuit (or one of
// its sharing workloads' bulkhead slots): by the open circuit, by the
// bulkhead and by its slow start.
type cgroupRejections struct {
	cgroup                     uint64
	rejected, shadow           uint64
	bulkhead, bulkheadShadow   uint64
	slowStart, slowStartShadow uint64
}

// rejectionIndex is the last sweep's view, with its own lock.
type rejectionIndex struct {
	mu        sync.Mutex
	byCircuit map[owner][]cgroupRejections // live circuits' entries
	suspect   map[uint64]bool              // cgroups not below the attach point at the last sweep
}

// owner is the circuit an entry counts for: its id and epoch, or one of
// its sharing workloads' bulkhead slots (the slot's id and epoch).
type owner struct{ id, epoch uint32 }

// owners are the keys c's entries are counted under: its own id and
// epoch (when it has one) and each sharing workload's bulkhead slot's.
// Called in a step of the owner.
func owners(c *circuit) []owner {
	var out []owner
	if e := c.Epoch(); e != 0 {
		out = append(out, owner{c.ID, e})
	}
	for _, s := range c.BulkSlots() { // each slot once: a criticality pool's is several classes'
		out = append(out, owner{s.ID, s.Epoch})
	}
	return out
}

// records reports whether c counts the entries of owner o. Called in a step of the owner.
func records(c *circuit, o owner) bool {
	if o.id == c.ID {
		return c.Epoch() == o.epoch
	}
	for _, s := range c.SharedSlots() {
		if s.ID == o.id {
			return s.Epoch == o.epoch
		}
	}
	return false
}

// of returns a copy of the entries of the circuit with id and epoch.
func (x *rejectionIndex) of(id, epoch uint32) []cgroupRejections {
	if epoch == 0 {
		return nil
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return slices.Clone(x.byCircuit[owner{id, epoch}])
}

// rejectionsLoop sweeps the rejections map until ctx ends.
func (d *Daemon) rejectionsLoop(ctx context.Context) {
	t := time.NewTicker(rejectionsEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			d.sweepRejections()
		}
	}
}

// sweepRejections reads the rejections map, indexes the live circuits'
// entries and deletes the stale ones. It must not be called in a step of the owner.
func (d *Daemon) sweepRejections() {
	rs, err := d.k.Rejections()
	if err != nil {
		d.log.Warn("reading the rejections map (the next sweep retries)", "err", err)
		return
	}
	x := &d.rejections
	if len(rs) == 0 {
		x.mu.Lock()
		x.byCircuit, x.suspect = nil, nil
		x.mu.Unlock()
		return
	}
	cgroups := d.scope.cgroupIDs()
	// The distinct circuits first, outside the owner's step: in it, one
	// lookup per circuit, not per entry.
	live := map[owner]bool{}
	for _, r := range rs {
		live[owner{r.CircuitID, r.Epoch}] = false
	}
	d.do(func() {
		for o := range live {
			c := d.eng.Recording(o.id)
			live[o] = c != nil && records(c, o)
		}
	})
	x.mu.Lock()
	lastSuspect := x.suspect
	x.mu.Unlock()
	var stale []maps.RejectionKey
	byCircuit := map[owner][]cgroupRejections{}
	suspect := map[uint64]bool{}
	for _, r := range rs {
		if !live[owner{r.CircuitID, r.Epoch}] {
			stale = append(stale, r.RejectionKey)
			continue
		}
		if !cgroups[r.CgroupID] {
			if lastSuspect[r.CgroupID] {
				stale = append(stale, r.RejectionKey)
				continue
			}
			suspect[r.CgroupID] = true
		}
		o := owner{r.CircuitID, r.Epoch}
		byCircuit[o] = append(byCircuit[o], cgroupRejections{r.CgroupID, r.Rejected, r.ShadowRejected,
			r.BulkheadRejected, r.BulkheadShadowRejected, r.SlowStartRejected, r.SlowStartShadowRejected})
	}
	if len(stale) > 0 {
		if err := d.k.DeleteRejections(stale); err != nil {
			d.log.Warn("deleting stale rejection entries (the next sweep retries)", "err", err)
		}
	}
	x.mu.Lock()
	x.byCircuit, x.suspect = byCircuit, suspect
	x.mu.Unlock()
}

// RejectedBy is api.RejectedBy.
type RejectedBy = api.RejectedBy

// rejectedTotal is every rejection r counts, of every kind, shadow ones included.
func rejectedTotal(r RejectedBy) uint64 {
	return r.Rejected + r.ShadowRejected + r.BulkheadRejected + r.BulkheadShadowRejected +
		r.SlowStartRejected + r.SlowStartShadowRejected
}

// cgroupNamer names cgroup ids for one request: paths and workloads from
// the cgroup watch, copied once, on first need.
type cgroupNamer struct {
	names map[uint64]cgroupName
}

// rejectedBy lists who the circuit whose entries are counted under owners
// rejected, open, by its bulkheads or by its slow start, most rejections
// first, at most
// listedRejected, and how many there are in all. It must not be called
// in a step of the owner.
func (d *Daemon) rejectedBy(owners []owner, n *cgroupNamer) ([]RejectedBy, int) {
	var entries []cgroupRejections
	for _, o := range owners {
		entries = append(entries, d.rejections.of(o.id, o.epoch)...)
	}
	if len(entries) == 0 {
		return nil, 0
	}
	if n.names == nil {
		n.names = d.scope.names()
	}
	byKey := map[string]*RejectedBy{}
	for _, e := range entries {
		cn := n.names[e.cgroup]
		r := RejectedBy{Cgroup: cn.path, Workload: cn.workload}
		key := "cgroup:" + cn.path
		if cn.path == "" {
			key = "id:" + strconv.FormatUint(e.cgroup, 10) // gone: one entry each
		}
		if pods := d.podNames([]uint64{e.cgroup}); len(pods) == 1 {
			r.Pod, r.Cgroup, key = pods[0], "", "pod:"+pods[0]
		}
		x, ok := byKey[key]
		if !ok {
			x = &r
			byKey[key] = x
		}
		x.Rejected += e.rejected
		x.ShadowRejected += e.shadow
		x.BulkheadRejected += e.bulkhead
		x.BulkheadShadowRejected += e.bulkheadShadow
		x.SlowStartRejected += e.slowStart
		x.SlowStartShadowRejected += e.slowStartShadow
	}
	out := make([]RejectedBy, 0, len(byKey))
	for _, r := range byKey {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b RejectedBy) int {
		if c := cmp.Compare(rejectedTotal(b), rejectedTotal(a)); c != 0 {
			return c
		}
		return cmp.Compare(a.Label(), b.Label())
	})
	total := len(out)
	return out[:min(total, listedRejected)], total
}

// eventRejected is the most pods a CircuitClosed Event names.
const eventRejected = 8

// rejectedPods names the pods c rejected while open, "namespace/name
// (N)", most first, at most eventRejected: for its CircuitClosed Event,
// from the last sweep (at most rejectionsEvery old). Cgroups of no known
// pod are left out, and so are bulkhead and slow-start rejections: they
// are no part of the circuit opening and closing (/v1/circuits lists
// them). No kernel
// read: callable in a step of the owner.
func (d *Daemon) rejectedPods(c *circuit) []string {
	byPod := map[string]uint64{}
	for _, e := range d.rejections.of(c.ID, c.Epoch()) {
		if pods := d.podNames([]uint64{e.cgroup}); len(pods) == 1 && e.rejected > 0 {
			byPod[pods[0]] += e.rejected
		}
	}
	pods := slices.Collect(stdmaps.Keys(byPod))
	slices.SortFunc(pods, func(a, b string) int {
		if c := cmp.Compare(byPod[b], byPod[a]); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	out := make([]string, 0, min(len(pods), eventRejected))
	for _, p := range pods[:min(len(pods), eventRejected)] {
		out = append(out, p+" ("+strconv.FormatUint(byPod[p], 10)+")")
	}
	return out
}
