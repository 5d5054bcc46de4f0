package engine

import (
	"math"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Adaptive limits (policy.Adaptive): a circuit whose max_connections or
// max_connecting follows latency has a policy.Limiter for each, fed by
// handle (handshake or response times, and drops) and moved by the tick,
// which rewrites the circuit's limits entries when the limit moves. The
// kernel enforces the entry as it does a static limit.

// Limit kinds: the option an adaptive limit stands for (metric labels).
const (
	KindConnections = "max_connections"
	KindConnecting  = "max_connecting"
)

// adaptiveLimits are a circuit's limiters (nil: that limit is static)
// and how often each moved.
type adaptiveLimits struct {
	conns, connecting *policy.Limiter
	changes           [2]uint64 // by kind: connections, connecting
}

// AdaptiveLimit is one adaptive limit of a circuit as the daemon shows it.
type AdaptiveLimit struct {
	Kind      string // KindConnections or KindConnecting
	Algorithm string
	Limit     int
	Min, Max  int
	// Latency is the last window's average latency (0 before the first).
	Latency time.Duration
	// Changes counts the limit's moves since the circuit was made.
	Changes uint64
}

// AdaptiveLimits are c's adaptive limits (none when its limits are static).
func (c *Circuit) AdaptiveLimits() []AdaptiveLimit {
	if c.extra == nil || c.extra.adaptive == nil {
		return nil
	}
	a := c.extra.adaptive
	var out []AdaptiveLimit
	for i, l := range []*policy.Limiter{a.conns, a.connecting} {
		if l == nil {
			continue
		}
		s := l.Spec()
		out = append(out, AdaptiveLimit{Kind: kinds[i], Algorithm: s.Algorithm.String(), Limit: l.Limit(), Min: s.Min, Max: s.Max,
			Latency: l.Latency(), Changes: a.changes[i]})
	}
	return out
}

var kinds = [2]string{KindConnections, KindConnecting}

func (c *Circuit) adaptive() *adaptiveLimits {
	if c.extra == nil {
		return nil
	}
	return c.extra.adaptive
}

// syncAdaptive gives c the limiters its options o ask for: new ones start
// at the limit a previous daemon's pinned entry held (SetPinnedLimits),
// else at initial; kept ones follow a reload's new bounds or algorithm
// (policy.Limiter.Reshape); a limit made static loses its limiter.
func (e *Engine) syncAdaptive(c *Circuit, o *policy.Options) *adaptiveLimits {
	if !o.AdaptiveConnections.On() && !o.AdaptiveConnecting.On() {
		if a := c.adaptive(); a != nil {
			c.extra.adaptive = nil
			delete(e.adaptive, c)
		}
		return nil
	}
	x := c.ensureExtra()
	if x.adaptive == nil {
		x.adaptive = &adaptiveLimits{}
	}
	a := x.adaptive
	pinned := e.pinnedLimit(c)
	a.conns = syncLimiter(a.conns, o.AdaptiveConnections, int(pinned.MaxConnections))
	a.connecting = syncLimiter(a.connecting, o.AdaptiveConnecting, int(pinned.MaxConnecting))
	e.adaptive[c] = struct{}{}
	return a
}

func syncLimiter(l *policy.Limiter, spec policy.Adaptive, pinned int) *policy.Limiter {
	switch {
	case !spec.On():
		return nil
	case l == nil:
		return policy.NewLimiter(spec, pinned)
	case l.Spec() != spec:
		l.Reshape(spec)
	}
	return l
}

// SetPinnedLimits hands the engine the limits entries a previous daemon
// left (start-up, before the configuration is applied), so an adaptive
// limit resumes where the kernel was holding it rather than at initial;
// nil once start-up is over.
func (e *Engine) SetPinnedLimits(limits map[maps.Dest]maps.Limit) {
	if limits == nil {
		e.pinned = nil
		return
	}
	e.pinned = make(map[maps.Dest]maps.Limit, len(limits))
	for dst, l := range limits {
		e.pinned[dst] = l
	}
}

// pinnedLimit is the limit a previous daemon held c to (zero: none, or
// start-up is over): the pinned entry of c's first destination that has
// one, else, for a shared circuit whose bulkheads are its workloads', the
// largest of their entries, a sheddable workload's scaled back up from
// its share (an entry holds only that share of the circuit's limit).
func (e *Engine) pinnedLimit(c *Circuit) maps.Limit {
	if e.pinned == nil {
		return maps.Limit{}
	}
	for _, dst := range c.Dests() {
		if l, ok := e.pinned[dst]; ok {
			return l
		}
	}
	var out maps.Limit
	for _, dst := range c.Dests() {
		for k := range c.SharedSlots() {
			b := dst
			b.Class = k
			l, ok := e.pinned[b]
			if !ok {
				continue
			}
			share, _ := e.reg.classes.Share(policy.Class(k))
			out.MaxConnections = max(out.MaxConnections, wholeLimit(l.MaxConnections, share))
			out.MaxConnecting = max(out.MaxConnecting, wholeLimit(l.MaxConnecting, share))
		}
	}
	return out
}

// wholeLimit is the limit whose share (policy.SharedLimit) an entry of n
// holds, n / share rounded up (a share's floor of 1 makes it a lower
// bound there); n itself without a share.
func wholeLimit(n uint32, share float64) uint32 {
	if share <= 0 || share >= 1 || n == 0 {
		return n
	}
	return uint32(math.Ceil(float64(n)/share - 1e-9))
}

// limitsOf puts c's current adaptive limits into l, its limits entry.
func (a *adaptiveLimits) limitsOf(l *maps.Limit) {
	if a.conns != nil {
		l.MaxConnections = uint32(a.conns.Limit())
	}
	if a.connecting != nil {
		l.MaxConnecting = uint32(a.connecting.Limit())
	}
}

// sample and drop feed each limiter of a (no closure: they run on the
// record path).
func (a *adaptiveLimits) sample(d time.Duration) {
	if a.conns != nil {
		a.conns.Sample(d)
	}
	if a.connecting != nil {
		a.connecting.Sample(d)
	}
}

func (a *adaptiveLimits) drop() {
	if a.conns != nil {
		a.conns.Drop()
	}
	if a.connecting != nil {
		a.connecting.Drop()
	}
}

// feedHandshake gives c's adaptive limits a record's handshake: its time
// when c follows no responses (a target that does is fed its responses'
// times instead), a drop when the connect timed out.
func feedHandshake(c *Circuit, out maps.Outcome, d time.Duration) {
	a := c.adaptive()
	if a == nil {
		return
	}
	switch out {
	case maps.Established:
		if !c.Machine.Options().Responses.Followed() {
			a.sample(d)
		}
	case maps.TimedOut:
		a.drop()
	}
}

// feedDrop gives c's adaptive limits a call dropped for want of capacity
// (connect_timeout, response_timeout).
func feedDrop(c *Circuit) {
	if a := c.adaptive(); a != nil {
		a.drop()
	}
}

// feedResponse gives c's adaptive limits a response: its time, or a drop
// for an overload status (429, 503, 504). Other 4xx and 5xx statuses say
// nothing of capacity (a refusal is quick whatever the load), nor does a
// connection closed without an answer.
func feedResponse(c *Circuit, r *policy.Result) {
	a := c.adaptive()
	if a == nil || r.Kind != policy.Answered {
		return
	}
	if r.HTTP {
		switch {
		case r.Status == 429 || r.Status == 503 || r.Status == 504:
			a.drop()
			return
		case r.Status >= 400:
			return
		}
	}
	a.sample(r.Duration)
}

// moveLimits runs from Tick: each adaptive limit whose window is full
// moves by it, given what its bulkheads hold now (the fullest one's
// count, with workloads), and a limit that moved has c's limits entries
// rewritten and is counted.
func (e *Engine) moveLimits() {
	for c := range e.adaptive {
		a := c.adaptive()
		if a == nil {
			delete(e.adaptive, c)
			continue
		}
		if (a.conns == nil || a.conns.Pending() < policy.LimitWindow) && (a.connecting == nil || a.connecting.Pending() < policy.LimitWindow) {
			continue
		}
		inflight := e.inflight(c)
		moved := false
		for i, l := range []*policy.Limiter{a.conns, a.connecting} {
			if l == nil {
				continue
			}
			n := inflight.Connections
			if i == 1 {
				n = inflight.Connecting
			}
			if _, ok := l.Update(int(n)); ok {
				moved = true
				a.changes[i]++
				e.metrics.LimitChanges(c.Target(), kinds[i]).Inc()
			}
		}
		if moved {
			for _, dst := range c.Dests() {
				e.WriteLimit(c, dst)
			}
		}
	}
}

// inflight is what c's fullest bulkhead counts now.
func (e *Engine) inflight(c *Circuit) maps.BulkCount {
	var out maps.BulkCount
	read := func(slot uint32) {
		if slot == 0 {
			return
		}
		b, err := e.k.BulkCount(slot)
		if err != nil {
			return
		}
		out.Connections = max(out.Connections, b.Connections)
		out.Connecting = max(out.Connecting, b.Connecting)
	}
	read(c.ID)
	for _, s := range c.SharedSlots() {
		read(s.ID)
	}
	return out
}
