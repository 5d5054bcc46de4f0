package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/breakerd/breakerd/internal/cgroup2"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// start rebuilds the daemon's state on a freshly loaded kernel side, in an
// order that keeps what the kernel enforces:
//
//  1. A previous daemon's heartbeat that is still fresh is refreshed at
//     once, so its verdicts stay enforced however long the rest takes (a
//     stale one is left stale: nothing is re-armed before it is checked).
//  2. The circuit ids, limits and busy bulkhead slots found in the pinned
//     maps are recorded, so circuits made for those destinations inherit
//     their ids (counters and bulkhead counts carry on) and no other
//     circuit is given an id sockets still hold.
//  3. The configuration is applied (targets' circuits made) and the pinned
//     verdicts and limits adopted, in one pass over each map.
//  4. The limits map is made to say exactly what the configuration says.
//  5. The heartbeat and settings are written.
func (d *Daemon) start(cfg *policy.Config) error {
	if s, err := d.k.Settings(); err == nil && s.Heartbeat != 0 && maps.Now()-s.Heartbeat < s.FailSafe {
		if err := d.k.Heartbeat(); err != nil {
			return fmt.Errorf("refreshing the previous heartbeat: %w", err)
		}
	}
	d.setPhase("reading the pinned maps")
	verdicts, err := d.k.AllVerdicts()
	if err != nil {
		return fmt.Errorf("reading pinned verdicts: %w", err)
	}
	limits, err := d.k.AllLimits()
	if err != nil {
		return fmt.Errorf("reading pinned limits: %w", err)
	}
	busy, err := d.k.BusySlots()
	if err != nil {
		return fmt.Errorf("reading bulkhead counts: %w", err)
	}
	d.do(func() { d.eng.IDs().LoadPinned(verdicts, limits, busy) })
	// Host names are looked up first, in parallel and each bounded,
	// keeping a fresh previous heartbeat fresh meanwhile.
	hosts := hostNamesOf(cfg)
	if len(hosts) > 0 {
		d.setPhase(fmt.Sprintf("waiting on DNS: resolving %d host names", len(hosts)))
	}
	resolved := d.lookupHostsKeepingAlive(hosts)
	if len(serviceTargets(cfg))+len(serviceFallbacks(cfg)) > 0 && d.opts.Cluster != nil {
		d.setPhase("waiting on the Kubernetes API: listing Services and EndpointSlices")
	}
	services, fallbacks := d.lookupServicesKeepingAlive(cfg)
	if len(podWorkloads(cfg)) > 0 && d.opts.Cluster != nil {
		d.setPhase("waiting on the Kubernetes API: listing this node's pods")
	}
	pods := d.lookupPodsKeepingAlive(cfg)
	d.setPhase("applying the configuration and adopting pinned circuits")

	pinnedClasses, err := d.k.Workloads()
	if err != nil {
		return fmt.Errorf("reading pinned workloads: %w", err)
	}
	pinnedBulkheads, err := d.k.WorkloadBulkheads()
	if err != nil {
		return fmt.Errorf("reading pinned workloads: %w", err)
	}

	return d.doErr(func() error {
		// The selected pods before the first classification, so their cgroups'
		// entries a previous daemon left stay in the workloads map.
		d.scope.presetPods(pods)
		// Classes that name other workloads than they did for the previous
		// daemon: their pinned verdicts and limits are not adopted, and no
		// circuit inherits their ids (as a reload drops the circuits of the
		// classes it changes): a healthy workload never takes over another's
		// open circuit or the sockets counted in its bulkhead.
		moved := d.scope.movedClasses(cfg, pinnedEntries(pinnedClasses, pinnedBulkheads))
		if len(moved) > 0 {
			d.eng.IDs().ForgetClasses(moved)
			// Gone before the workloads map says the new classes, so no
			// connection is judged by another workload's entry meanwhile.
			droppedVerdicts, droppedLimits := 0, 0
			for dst := range verdicts {
				if moved[dst.Class] {
					_ = d.k.DeleteVerdict(dst)
					delete(verdicts, dst)
					droppedVerdicts++
				}
			}
			for dst, l := range limits {
				if moved[dst.Class] {
					_ = d.k.DeleteLimit(dst)
					delete(limits, dst)
					// An entry that only marks sockets for the response
					// programs turned no connect away: nothing is lost.
					if l.MaxConnections > 0 || l.MaxConnecting > 0 {
						droppedLimits++
					}
				}
			}
			// Protection lost, not kept: a destination a moved class rejected
			// admits its workload again until its failures open it anew.
			lvl := slog.LevelInfo
			if droppedVerdicts > 0 || droppedLimits > 0 {
				lvl = slog.LevelWarn
			}
			d.log.Log(context.Background(), lvl, "workload classes changed since the previous daemon: their pinned circuits and bulkheads are not adopted",
				"classes", len(moved), "rejecting_verdicts_dropped", droppedVerdicts, "bulkhead_limits_dropped", droppedLimits)
		}
		d.eng.RetirePinnedBatches(limits)
		d.eng.LoadKept()
		d.fallbackAddrs = fallbacks // in the engine's matching from the first one on
		// Adaptive limits resume where the kernel was holding them.
		d.eng.SetPinnedLimits(limits)
		d.applyConfig(cfg)
		d.applyResolved(resolved)
		d.applyServices(services)
		d.eng.SetAdopting(true) // max_circuits never drops an adopted verdict
		d.adopt(verdicts, limits)
		d.eng.SyncFallbacks()
		d.eng.SetAdopting(false)
		d.eng.IDs().EndStartup()
		d.eng.SetPinnedLimits(nil)
		if err := d.reconcileLimits(); err != nil {
			return err
		}
		return d.heartbeat()
	})
}

// adopt rebuilds open and half-open circuits from the verdicts a previous
// daemon left, with their remaining open time and their circuit ids (so the
// kernel's counters carry on), the slow starts in progress, and the
// circuits of pinned limits (so
// sockets counted before the restart stay counted). Each entry is visited
// once; none is dropped for want of room (max_circuits does not refuse them
// here; eviction of idle closed circuits brings the count back later).
func (d *Daemon) adopt(verdicts map[maps.Dest]maps.Verdict, limits map[maps.Dest]maps.Limit) {
	now, mono := d.now(), maps.Now()
	adopted, beat := 0, 0
	for dst, v := range verdicts {
		if beat++; beat%4096 == 0 {
			d.keepAlive()
		}
		c, _ := d.eng.Lookup(dst, now)
		if c == nil {
			// Excluded or no longer protected under this configuration.
			_ = d.k.DeleteVerdict(dst)
			continue
		}
		switch v.State {
		case maps.Open:
			switch c.Machine.State() {
			case policy.ForcedOpen:
				continue // the engine's Make wrote its forced-open verdict: kept
			case policy.ForcedClosed, policy.Disabled:
				// The configuration (or a kept override) says it
				// rejects nothing now.
				_ = d.k.DeleteVerdict(dst)
				continue
			}
			if !d.eng.EnsureID(c) {
				// Its verdict names an id it does not hold (another
				// circuit's, or a free one): gone, and the circuit is
				// open here, enforced once an id is free.
				_ = d.k.DeleteVerdict(dst)
				if c.Machine.State() == policy.Closed {
					c.Machine.Restore(now, now.Add(v.Due-mono), c.Machine.Round()+1, false)
					d.eng.Track(c)
				}
				d.eng.MarkUnenforced(c)
				d.metrics.verdictWriteErrors.Inc()
				d.eng.ErrorEverySecond("", "no circuit id free for an adopted open circuit; it is not enforced until one is", "circuit", c.Name(), "dest", dst)
				continue
			}
			if c.Machine.State() == policy.Closed {
				round, begun := v.Round, false
				if b, err := d.k.Budget(v.CircuitID); err == nil && b.Round == v.Round {
					begun = true
				}
				if v.CircuitID != c.ID {
					// Another slot: continue its rounds, from a round
					// not begun there.
					c.Machine.SeedRound(v.Round)
					if b, err := d.k.Budget(c.ID); err == nil {
						c.Machine.SeedRound(b.Round)
					}
					round, begun = c.Machine.Round()+1, false
				}
				c.Machine.Restore(now, now.Add(v.Due-mono), round, begun)
				d.eng.Track(c)
				d.log.Debug("adopted open circuit", "circuit", c.Name(), "dest", dst, "round", round, "half_open", begun, "due_in", (v.Due - mono).String())
				adopted++
			}
			if e := d.eng.EpochOf(c); v.CircuitID != c.ID || v.Round != c.Machine.Round() || v.Epoch != e {
				// Re-point counters, the probe budget and the rejected
				// cgroups' counts to the circuit's slot and epoch, in its
				// round; the due time stays.
				v.CircuitID, v.Round, v.Epoch = c.ID, c.Machine.Round(), e
				d.eng.SyncFallback(c) // of the new epoch, before the verdict
				_ = d.k.PutVerdict(dst, v)
			}
		case maps.Ramp:
			// A slow start in progress carries on from when it began;
			// one that is over, or whose circuit no longer ramps
			// (forced, disabled), goes.
			if d.eng.AdoptRamp(c, dst, v) {
				d.log.Debug("adopted slow start", "circuit", c.Name(), "dest", dst, "ends_in", (v.RampEnd() - mono).String())
			}
		case maps.ForcedOpen:
			if c.Machine.State() != policy.ForcedOpen && !d.fleetAdopt(c, now) {
				// The override was not in the new configuration (nor
				// is it a follow of the fleet).
				_ = d.k.DeleteVerdict(dst)
			}
		}
	}
	for dst := range limits {
		// A sharing workload's bulkhead entry belongs to the shared
		// circuit of its destination (class 0).
		if d.classes.SharedOfBulkhead(policy.Class(dst.Class)) != "" {
			dst.Class = 0
		}
		d.eng.Lookup(dst, now) // reconcileLimits keeps or removes the entry
	}
	if adopted > 0 {
		d.log.Info("adopted open circuit(s) from the pinned verdict map", "count", adopted)
	}
	if over := d.eng.Destinations() - d.cfg.MaxCircuits; over > 0 {
		d.log.Warn("more destinations adopted than max_circuits allows; idle closed circuits are evicted as new ones come", "destinations", d.eng.Destinations(), "max_circuits", d.cfg.MaxCircuits)
	}
}

// keepAlive refreshes the heartbeat during a long start-up, only when it is
// fresh already (see start).
func (d *Daemon) keepAlive() {
	if s, err := d.k.Settings(); err == nil && s.Heartbeat != 0 && maps.Now()-s.Heartbeat < s.FailSafe {
		_ = d.k.Heartbeat()
	}
}

// reconcileLimits makes the kernel's limits map hold exactly the bulkheads
// of the current circuits: entries per TCP destination of a circuit with a
// limit (engine.WantedLimits: also one per sharing workload for a shared
// circuit), each in its slot. Anything else (a limit the configuration
// dropped, a destination that moved, a workload no longer sharing, an
// entry a previous daemon left) is removed; sockets it counted still
// release into their slot.
func (d *Daemon) reconcileLimits() error {
	want := d.eng.WantedLimits()
	have, err := d.k.AllLimits()
	if err != nil {
		return fmt.Errorf("reconciling bulkhead limits: %w", err)
	}
	removed, written := 0, 0
	for dst := range have {
		if _, ok := want[dst]; !ok {
			if err := d.k.DeleteLimit(dst); err != nil {
				return fmt.Errorf("reconciling bulkhead limits: %w", err)
			}
			removed++
		}
	}
	for dst, l := range want {
		if h, ok := have[dst]; ok && h == l {
			continue
		}
		if err := d.k.PutLimit(dst, l); err != nil {
			d.metrics.verdictWriteErrors.Inc()
			d.log.Error("writing bulkhead limits (not enforced for this destination)", "dest", dst, "err", err)
			continue
		}
		written++
	}
	if removed > 0 || written > 0 {
		d.log.Info("bulkhead limits reconciled with the configuration", "written", written, "removed", removed)
	}
	return nil
}

// watchGround checks, every CheckInterval, that protection still stands
// where it was attached: the cgroup, the bpf filesystem, every pin. A
// problem is logged at error level once, counted, and makes /readyz fail
// (its answer names the problems); what can be repaired (pins or the pin
// directory removed, the cgroup made again, the bpffs mounted again where
// it was) is, and the daemon is ready again once nothing is missing. A
// failed repair is logged when its error changes, not at every check.
//
// The protected cgroup's parent directory is also watched with inotify, so
// the cgroup removed or made again is checked (and re-attached) when it
// happens, not at the next tick: see checkGround for what is protected
// in between.
func (d *Daemon) watchGround(ctx context.Context) {
	if d.opts.CheckInterval < 0 {
		return
	}
	t := time.NewTicker(d.opts.CheckInterval)
	defer t.Stop()
	var changed <-chan fsnotify.Event
	if w := d.cgroupParentWatcher(); w != nil {
		defer w.Close()
		changed = w.Events
		go func() {
			for err := range w.Errors {
				d.log.Warn("watching the protected cgroup's parent (checked every interval still)", "err", err)
			}
		}()
	}
	name := filepath.Base(d.opts.Cgroup)
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-changed:
			if !ok {
				changed = nil
				continue
			}
			if filepath.Base(ev.Name) == name && (ev.Has(fsnotify.Create) || ev.Has(fsnotify.Remove)) {
				d.checkGround(ctx)
			}
		case <-t.C:
			d.checkGround(ctx)
		}
	}
}

// cgroupParentWatcher watches the directory that holds the protected
// cgroup, when that is a cgroup too (the cgroup v2 mount's root has no
// parent cgroup to watch); nil otherwise.
func (d *Daemon) cgroupParentWatcher() *fsnotify.Watcher {
	cg := filepath.Clean(d.opts.Cgroup)
	root, err := cgroup2.MountOf(cg)
	if err != nil || cg == filepath.Clean(root) {
		return nil
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		d.log.Warn("cannot watch the protected cgroup's parent (checked every interval still)", "err", err)
		return nil
	}
	if err := w.Add(filepath.Dir(cg)); err != nil {
		w.Close()
		d.log.Warn("cannot watch the protected cgroup's parent (checked every interval still)", "dir", filepath.Dir(cg), "err", err)
		return nil
	}
	return w
}

// checkGround checks the ground once, and repairs what it can.
//
// The protected cgroup removed and made again is a new, empty directory
// at the same path, which the programs are re-attached to here (when the
// parent's watch reports the mkdir, within milliseconds). In between:
//   - Until the rmdir nothing changes (the old directory is protected to
//     the end). cgroup v2 removes only a cgroup without processes and
//     child cgroups, so whatever ran in it had been moved out before, and
//     is protected only if it went to another protected cgroup.
//   - From the mkdir to the attach, processes moved into the new
//     directory (or started in it) and cgroups made in it are not
//     protected: their connects are not checked against open circuits
//     or bulkheads, and their outcomes are not counted.
//   - From the attach on, every new connect of every process in it, and
//     in every cgroup below it, is checked (attaching to a cgroup covers
//     its descendants); the cgroups made in it before the attach have
//     their workloads written first (the rescan below), so none of them
//     waits for a later event. Connections made in the gap stay unseen
//     to their end: they hold no bulkhead slot, and their failures are
//     not counted.
//
// The circuits, verdicts and counts live in the pinned maps, not in the
// cgroup, so they carry over unchanged.
func (d *Daemon) checkGround(ctx context.Context) {
	p := d.k.Check()
	if p != nil {
		d.do(func() {
			for prob, msg := range p {
				if _, known := d.problems[prob]; !known {
					d.metrics.groundProblems.WithLabelValues(string(prob)).Inc()
					d.log.Error("protection is not in place", "problem", string(prob), "detail", msg)
				}
			}
			d.setProblems(p)
			d.ready.Store(false)
			d.metrics.protected.Set(0)
		})
		if _, ok := p[maps.CgroupRecreated]; ok {
			// A new directory: its children are new cgroups to watch and
			// classify, before the programs attach, so that every cgroup
			// in it is protected from the attach on.
			d.scope.rescan()
		}
		if err := d.k.Repair(); err != nil {
			if err.Error() != d.repairErr {
				d.log.Error("repairing protection", "err", err)
			}
			d.repairErr = err.Error()
		} else {
			d.repairErr = ""
		}
		p = d.k.Check()
	}
	d.do(func() {
		if p == nil && d.problems != nil {
			d.log.Info("protection in place again", "cgroup", d.opts.Cgroup, "pins", d.k.PinDir())
			d.setProblems(nil)
			d.ready.Store(ctx.Err() == nil)
			d.metrics.protected.Set(1)
		}
		if p != nil {
			d.setProblems(p)
		}
	})
}

// setProblems records what the ground check found, for the daemon and
// for /readyz. Called in a step of the owner.
func (d *Daemon) setProblems(p maps.Problems) {
	d.problems = p
	if p == nil {
		d.shownProblems.Store(nil)
	} else {
		d.shownProblems.Store(&p)
	}
}

// pinnedEntries are the pinned workloads map's entries (classes only: the
// workload names are not pinned).
func pinnedEntries(classes, bulkheads map[uint64]uint8) map[uint64]entry {
	out := make(map[uint64]entry, len(classes))
	for id, k := range classes {
		out[id] = entry{class: k, bulkhead: bulkheads[id]}
	}
	return out
}
