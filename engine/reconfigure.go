package engine

import (
	"slices"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Reconfigure brings the circuits from configuration old to the one the
// engine matches with now (SetMatching), and returns what changed.
//
// A circuit whose matching still holds is kept: its state, window, trips,
// open time and any override set through the API stay, and the new
// options apply from its next call and transition (a verdict already
// written keeps its errno and probe settings until then). A circuit is
// dropped when its target is removed or its scope changes; Rematch drops
// those whose destinations now match elsewhere. A target whose `state`
// key changed takes the new state, over one set through the API.
func (e *Engine) Reconfigure(old *policy.Config, now time.Time) policy.Change {
	cfg := e.matching.Config
	ch := policy.Diff(old, cfg)
	for _, c := range e.Ordered() {
		if c.Target() == AllTarget {
			if ch.AllChanged {
				e.setOptions(c, &cfg.All, now)
			}
			continue
		}
		if !slices.Contains(ch.Changed, c.Target()) && !slices.Contains(ch.Removed, c.Target()) {
			continue
		}
		nt, ot := cfg.Targets[c.Target()], old.Targets[c.Target()]
		if nt == nil || nt.Scope != ot.Scope {
			e.Drop(c)
			continue
		}
		e.setOptions(c, &nt.Options, now)
		if nt.State != ot.State {
			e.Apply(c, c.Machine.Override(now, nt.State))
			e.KeepOverride(c, policy.NoOverride)
		}
	}
	e.SetEjection(cfg)
	return ch
}

// setOptions gives a kept circuit its reloaded options and rewrites its
// fallback and bulkhead limits.
func (e *Engine) setOptions(c *Circuit, o *policy.Options, now time.Time) {
	had := NeedsLimitEntry(c.Machine.Options())
	c.Machine.SetOptions(o, now)
	e.SyncFallback(c) // a fallback set, changed or removed applies at once
	if !had && !NeedsLimitEntry(o) && c.BulkSlots() == nil {
		return // no limits entry before or now: nothing to write or delete
	}
	for _, dst := range c.Dests() {
		e.WriteLimit(c, dst)
	}
}

// Rematch follows a change of what destinations match (a reload, names
// or Services resolved anew, given by SetMatching first): it drops the
// circuits whose destinations now belong elsewhere (a Service target's
// circuit loses only its departed endpoints, keeping its state), and
// makes the circuits of targets whose destinations can be enumerated, so
// forced states and open verdicts cover them before any traffic.
func (e *Engine) Rematch(now time.Time) {
	cfg := e.matching.Config
	for _, c := range e.Ordered() {
		var stale []maps.Dest
		for _, dst := range c.Dests() {
			// A circuit of a class that now names another workload
			// (or none) goes too.
			m, workload := e.MatcherOf(dst.Class)
			if m == nil || workload != c.Workload() {
				stale = c.Dests()
				break
			}
			target, excluded := m.Match(dst.Addr.Addr(), dst.Addr.Port(), dst.Proto.String())
			if target == "" {
				target = AllTarget
			}
			if excluded || target != c.Target() {
				stale = append(stale, dst)
			}
		}
		switch {
		case len(stale) == 0:
		case len(stale) < len(c.Dests()) && isServiceTarget(cfg, c.Target()):
			e.Detach(c, stale)
		default:
			e.Drop(c)
		}
	}
	names := make([]string, 0, len(cfg.Targets))
	for name := range cfg.Targets {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, class := range e.classList() {
		for _, name := range names {
			dests := append(StaticDests(cfg.Targets[name], e.matching.Resolved), ServiceDests(e.matching.Services[name])...)
			for _, dst := range dests {
				dst.Class = class
				if c, _ := e.Lookup(dst, now); c != nil {
					c.Enumerated = true
				}
			}
		}
	}
}

// classList returns the classes connections can have under the
// configuration: 0 when some workload shares circuits or processes of no
// workload are protected (no list of workloads), and each isolated
// workload's.
func (e *Engine) classList() []uint8 {
	cfg, classes := e.matching.Config, e.matching.Classes
	var out []uint8
	shared := !cfg.Scoped()
	for _, w := range cfg.Workloads {
		k := uint8(classes.Of(w.Name))
		if k == 0 {
			shared = true
		} else {
			out = append(out, k)
		}
	}
	if shared {
		out = append([]uint8{0}, out...)
	}
	return out
}

// ServiceDests lists a Service target's current destinations as the
// kernel keys them.
func ServiceDests(dests []policy.ServiceDest) []maps.Dest {
	out := make([]maps.Dest, 0, len(dests))
	for _, sd := range dests {
		p := maps.TCP
		if sd.Proto == "udp" {
			p = maps.UDP
		}
		out = append(out, maps.Dest{Proto: p, Addr: sd.Addr})
	}
	return out
}

func isServiceTarget(cfg *policy.Config, target string) bool {
	t := cfg.Targets[target]
	return t != nil && t.Match.Service != ""
}
