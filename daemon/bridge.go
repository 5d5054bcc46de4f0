package daemon

import (
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// A reload that changes an isolated workload's class (a workload inserted
// before it in the list, say) moves its cgroups to the new class in the
// workloads map (cgroupWatch.apply) before rematch has made the new
// class's circuits and written their verdicts: in between, a connect of
// that workload is keyed by a class with no verdict, and allowed. So
// before the map moves, bridgeClasses writes every rejecting verdict a
// moving workload's connects hit under its old class again under its new
// class, and after rematch unbridge deletes those no rejecting circuit of
// the new class owns (a target's circuit in a new class starts closed, as
// it did before).
//
// Only a class no workload had before is bridged: a class another
// workload still has until the map moves it would have that workload's
// connects rejected by verdicts that are not its own. A reload that swaps
// two workloads' classes is not bridged (the fail-open direction).

// bridgeClasses writes the bridging verdicts for the move from old (with
// oldClasses) to d.cfg and d.classes, and returns them. In a step of the
// owner, before d.scope.apply.
func (d *Daemon) bridgeClasses(old *policy.Config, oldClasses policy.Classes) []maps.Dest {
	used := map[uint8]bool{0: true}
	before := map[string]bool{}
	for _, w := range old.Workloads {
		used[uint8(oldClasses.Of(w.Name))] = true
		before[w.Name] = true
	}
	to := map[uint8][]uint8{} // old class → new classes of workloads that had it
	for _, w := range d.cfg.Workloads {
		ko, kn := uint8(oldClasses.Of(w.Name)), uint8(d.classes.Of(w.Name))
		if before[w.Name] && kn != ko && !used[kn] {
			to[ko] = append(to[ko], kn)
		}
	}
	if len(to) == 0 {
		return nil
	}
	var bridged []maps.Dest
	for c := range d.eng.Active() {
		for _, dst := range c.Dests() {
			for _, kn := range to[dst.Class] {
				v, ok, err := d.k.Verdict(dst)
				if err != nil || !ok {
					continue
				}
				nd := dst
				nd.Class = kn
				if _, has, err := d.k.Verdict(nd); err != nil || has {
					continue
				}
				if err := d.k.PutVerdict(nd, v); err != nil {
					d.log.Warn("bridging a verdict to a workload's new class (its connects may pass while the reload moves it)", "dest", nd, "err", err)
					continue
				}
				bridged = append(bridged, nd)
			}
		}
	}
	return bridged
}

// unbridge deletes the bridging verdicts no rejecting circuit owns now.
// In a step of the owner, after rematch.
func (d *Daemon) unbridge(bridged []maps.Dest) {
	for _, dst := range bridged {
		if c, ok := d.eng.At(dst); ok && c.Machine.State().Rejects() {
			continue // its own circuit wrote its verdict
		}
		if err := d.k.DeleteVerdict(dst); err != nil {
			d.log.Warn("deleting a bridging verdict", "dest", dst, "err", err)
		}
	}
}
