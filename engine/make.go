package engine

import (
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Make makes a circuit whose first destination is dst (named name;
// "" for a dynamic circuit, named by dst); nil when no circuit id is free.
func (e *Engine) Make(name, target string, scope policy.Scope, o *policy.Options, ov policy.Override, g *policy.Group, dst maps.Dest, now time.Time) *Circuit {
	workload := e.reg.classes.Name(policy.Class(dst.Class))
	dynamic := name == ""
	if dynamic {
		name = Classed(DynamicName(dst), workload)
	}
	// A dynamic circuit without limits entries takes its kernel id when it
	// is about to open (Record), unless it inherits one now.
	var id uint32
	var inherited bool
	if !dynamic || NeedsLimitEntry(o) || e.reg.ids.PinnedFor(dst) {
		var ok bool
		id, inherited, ok = e.reg.ids.Alloc(name, dst)
		if !ok {
			e.metrics.Refused(target).Inc()
			// At most a line a second a target: every new destination
			// of a target with limits meets this once ids run out.
			e.ErrorEverySecond(target, "no circuit id free (every id is in use or held by open sockets); destination not protected (breakerd_circuits_refused_total counts each)", "circuit", name, "target", target)
			return nil
		}
	}
	// An override set through the API before a restart (or before the
	// circuit was last dropped and made again) comes back.
	if kept, ok := e.keptOverride(name); ok {
		ov = kept
	}
	cname := name
	if dynamic {
		cname = ""
	}
	c := newCircuit(cname, scope == policy.EndpointScope, id, e.series(target, workload), dst)
	c.Machine.Init(o, ov, g, now, nil)
	c.Machine.Share(e.shared(target))
	if id != 0 {
		e.seatID(c, id, inherited)
	}
	if dynamic {
		e.reg.dynamic++
	} else {
		e.reg.byName[name] = c
		e.reg.version++
	}
	if scope == policy.EndpointScope {
		e.reg.endpoints[c] = struct{}{}
	}
	e.reg.Track(c)
	if ov == policy.ForceOpen {
		e.EnsureID(c) // its verdict needs one (none free: it waits, unenforced)
		e.WriteVerdicts(c, policy.Transition{To: policy.ForcedOpen, At: now})
		e.hooks.Opened(c, policy.Closed, policy.ForcedOpen, now)
	}
	return c
}

// Attach adds dst to c; if c already rejects, the new destination's
// verdict is written at once.
func (e *Engine) Attach(c *Circuit, dst maps.Dest) {
	if cur, _ := e.reg.At(dst); cur == c {
		return
	}
	e.reg.Attach(c, dst)
	if o := c.Machine.Options(); NeedsLimitEntry(o) {
		e.WriteLimit(c, dst)
	}
	if s := c.Machine.State(); s.Rejects() {
		e.writeVerdict(c, dst, s, c.Machine.Status(e.clock.Now()).OpenUntil, c.Machine.Round())
	} else if r, ok := e.ramps[c]; ok {
		e.putRamp(c, dst, r.v) // a new destination ramps with the others
	}
}

// series returns the series of target's circuits of workload, made once.
func (e *Engine) series(target, workload string) *Series {
	key := target + "\x00" + workload
	if s := e.seriesOf[key]; s != nil {
		return s
	}
	s := NewSeries(e.metrics, target, workload)
	e.seriesOf[key] = s
	return s
}
