package engine

import (
	"net/netip"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Matching is what decides the circuit of a destination: the
// configuration, its workloads' classes, the addresses its host names
// resolved to and the destinations of its Service targets. The daemon
// resolves names and Services (DNS, Kubernetes) and hands the engine a
// new Matching whenever one of them changes (SetMatching).
type Matching struct {
	Config   *policy.Config
	Classes  policy.Classes
	Resolved map[string][]netip.Addr
	Services map[string][]policy.ServiceDest
	// Fallbacks are the addresses the Service fallbacks of targets
	// resolved to (a cluster IP and the named port); one missing has none
	// yet, and its circuits reject as without a fallback.
	Fallbacks map[policy.ServiceFallback]netip.AddrPort
}

// SetMatching takes m for the lookups from now on; the matchers of the
// previous one are dropped and made again as classes are seen.
func (e *Engine) SetMatching(m Matching) {
	e.matching = m
	e.matchers = map[uint8]*policy.Matcher{}
	e.respTimeouts = m.Config != nil && hasResponseTimeouts(m.Config)
}

// scoped reports whether the configuration lists workloads whose
// processes alone are protected (policy.Config.Scoped).
func (e *Engine) scoped() bool { return e.matching.Config != nil && e.matching.Config.Scoped() }

// MatcherOf returns the matcher of a destination's class and its
// workload; nil for a class no workload has (a stale key).
func (e *Engine) MatcherOf(class uint8) (*policy.Matcher, string) {
	w := e.matching.Classes.Name(policy.Class(class))
	if w == "" {
		return nil, ""
	}
	m := e.matchers[class]
	if m == nil {
		name := w
		if class == 0 {
			name = ""
		}
		m = policy.NewWorkloadMatcher(e.matching.Config, name, e.matching.Resolved, e.matching.Services)
		e.matchers[class] = m
	}
	return m, w
}

// Lookup finds or makes the circuit of destination dst under the
// matching's configuration. It returns nil for an excluded destination,
// and for a new one past max_circuits (which bounds the destinations of
// every circuit, dynamic or of a target) when no idle closed dynamic
// circuit can be evicted, or when no circuit id is free. made tells
// whether this call made the circuit (a destination added to a target's
// existing circuit is not a new one).
func (e *Engine) Lookup(dst maps.Dest, now time.Time) (c *Circuit, made bool) {
	if c, ok := e.reg.At(dst); ok {
		return c, false
	}
	cfg := e.matching.Config
	m, workload := e.MatcherOf(dst.Class)
	if m == nil {
		return nil, false
	}
	target, excluded := m.Match(dst.Addr.Addr(), dst.Addr.Port(), dst.Proto.String())
	if excluded {
		return nil, false
	}
	label := target
	if label == "" {
		label = AllTarget
	}
	if !e.reg.adopting && e.reg.byDest.Len() >= cfg.MaxCircuits && !e.EvictIdle() {
		e.metrics.Refused(label).Inc()
		return nil, false
	}
	if target == "" {
		c := e.Make("", AllTarget, "", &cfg.All, policy.NoOverride, nil, dst, now)
		if c == nil {
			return nil, false
		}
		e.Attach(c, dst)
		return c, true
	}
	t := cfg.Targets[target]
	name := Classed(target, workload)
	scope := policy.ServiceScope
	var g *policy.Group
	if t.Scope == policy.EndpointScope {
		name, scope = Classed(EndpointName(target, dst), workload), policy.EndpointScope
	}
	c, ok := e.reg.byName[name]
	if !ok {
		if scope == policy.EndpointScope {
			// One endpoint group per target and workload.
			group := Classed(target, workload)
			if g = e.reg.groups[group]; g == nil {
				g = policy.NewGroup(t.MaxEjectionPercent)
				e.reg.groups[group] = g
			}
		}
		if c = e.Make(name, target, scope, &t.Options, t.State, g, dst, now); c == nil {
			return nil, false
		}
	}
	e.Attach(c, dst)
	return c, !ok
}

// hasResponseTimeouts reports whether some target of cfg has a
// response_timeout (only then does the tick read the inflight map).
func hasResponseTimeouts(cfg *policy.Config) bool {
	for _, t := range cfg.Targets {
		if t.Options.Responses.ResponseTimeout > 0 {
			return true
		}
	}
	return false
}
