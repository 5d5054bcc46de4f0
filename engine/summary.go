package engine

import (
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Summary is what the metrics need of the engine, as of its owner's last
// step: the circuits by state and the owner of every kernel circuit id, by
// target. The engine keeps both up to date as it goes (a tally per target,
// a table of id owners), and Publish copies them in time proportional to
// the number of targets and of id chunks changed, not of circuits, so a
// scrape reads a Summary on its own goroutine and never waits for the
// owner or walks a million circuits. A Summary is never changed once
// published.
type Summary struct {
	// Targets are the configured targets and AllTarget (the dynamic
	// circuits), by name.
	Targets map[string]TargetSummary
	// Unenforced is the number of rejecting circuits whose verdicts are
	// not all in the kernel.
	Unenforced int
	// Ramping is the number of closed circuits whose slow-start verdicts
	// are in the kernel (RampCount).
	Ramping int
	// NextID is one past the highest kernel id ever handed out, and
	// Releases the ids given back, when the summary was taken.
	NextID   uint32
	Releases uint64
	owners   []*[ownerChunk]uint32
	targets  []string // names of the owners' targets, by index
}

// TargetSummary is one target's share of a Summary.
type TargetSummary struct {
	// States counts the target's circuits by state.
	States policy.Tally
	// Retired are the kernel counts of its dropped circuits.
	Retired maps.Counters
	// Limits: its circuits have bulkheads, so their ids' bulkhead
	// counts are its connections.
	Limits bool
	// Adaptive are its adaptive limits' current values summed over its
	// circuits, by kind (KindConnections, KindConnecting): 0 for one
	// configured with no circuit yet.
	Adaptive map[string]int
}

// IDOwner is whom a kernel circuit id counts for: a target's circuit, or
// (Bulk) a sharing workload's bulkhead slot of one.
type IDOwner struct {
	Target string
	Bulk   bool
}

// Owner returns the owner of id when the summary was taken.
func (s *Summary) Owner(id uint32) (IDOwner, bool) {
	i := int(id / ownerChunk)
	if i >= len(s.owners) || s.owners[i] == nil {
		return IDOwner{}, false
	}
	w := s.owners[i][id%ownerChunk]
	if w == 0 {
		return IDOwner{}, false
	}
	return IDOwner{Target: s.targets[w>>1-1], Bulk: w&1 != 0}, true
}

// ownerChunk is how many ids one chunk of the owners table holds: a
// change of one id's owner costs the next Publish a copy of its chunk
// (4 KiB) and of the chunk pointers (2 KiB at the kernel's 2^18 ids).
const ownerChunk = 1024

// idOwners is the engine's table of id owners, in chunks of words:
// 0 for none, else the owner's index in targets plus one, shifted left
// once, with the low bit for a bulkhead slot. published holds the chunks
// as last published, shared with the Summaries: a chunk is copied, never
// changed, once published.
type idOwners struct {
	targets   []string // every target ever seen, by index (a few)
	index     map[string]uint32
	chunks    []*[ownerChunk]uint32
	dirty     []bool
	changed   bool
	published []*[ownerChunk]uint32
}

func (t *idOwners) set(id uint32, o IDOwner) {
	k, ok := t.index[o.Target]
	if !ok {
		if t.index == nil {
			t.index = map[string]uint32{}
		}
		k = uint32(len(t.targets))
		t.targets = append(t.targets, o.Target)
		t.index[o.Target] = k
	}
	w := (k + 1) << 1
	if o.Bulk {
		w |= 1
	}
	i := int(id / ownerChunk)
	for len(t.chunks) <= i {
		t.chunks = append(t.chunks, nil)
		t.dirty = append(t.dirty, false)
	}
	if t.chunks[i] == nil {
		t.chunks[i] = new([ownerChunk]uint32)
	}
	t.chunks[i][id%ownerChunk] = w
	t.dirty[i], t.changed = true, true
}

func (t *idOwners) clear(id uint32) {
	if i := int(id / ownerChunk); id != 0 && i < len(t.chunks) && t.chunks[i] != nil {
		t.chunks[i][id%ownerChunk] = 0
		t.dirty[i], t.changed = true, true
	}
}

// publish returns the chunks as they are: the last ones published when
// nothing changed since, else new pointers with copies of the chunks
// changed.
func (t *idOwners) publish() []*[ownerChunk]uint32 {
	if !t.changed {
		return t.published
	}
	out := make([]*[ownerChunk]uint32, len(t.chunks))
	copy(out, t.published)
	for i, d := range t.dirty {
		if d {
			c := *t.chunks[i]
			out[i] = &c
			t.dirty[i] = false
		}
	}
	t.published, t.changed = out, false
	return out
}

// shared returns what target's circuits share (policy.Shared): the
// engine's random source and their tally by state.
func (e *Engine) shared(target string) *policy.Shared {
	s := e.tallies[target]
	if s == nil {
		s = &policy.Shared{Rand: e.rand}
		e.tallies[target] = s
	}
	return s
}

// Publish makes the engine's current Summary the one Summary returns. The
// owner calls it at the end of each step that may have changed circuits.
func (e *Engine) Publish() {
	s := &Summary{Targets: map[string]TargetSummary{}, Unenforced: len(e.unenforced), Ramping: len(e.ramps),
		NextID: e.reg.ids.Next(), Releases: e.reg.ids.Releases(), owners: e.owners.publish(), targets: e.owners.targets}
	add := func(name string, o *policy.Options) {
		ts := TargetSummary{Retired: e.retired[name], Limits: o != nil && o.HasLimits()}
		if o != nil && (o.AdaptiveConnections.On() || o.AdaptiveConnecting.On()) {
			ts.Adaptive = map[string]int{}
			if o.AdaptiveConnections.On() {
				ts.Adaptive[KindConnections] = 0
			}
			if o.AdaptiveConnecting.On() {
				ts.Adaptive[KindConnecting] = 0
			}
		}
		if t := e.tallies[name]; t != nil {
			ts.States = t.Tally
		}
		s.Targets[name] = ts
	}
	if cfg := e.matching.Config; cfg != nil {
		for name, t := range cfg.Targets {
			add(name, &t.Options)
		}
		add(AllTarget, &cfg.All)
	} else {
		add(AllTarget, nil)
	}
	for c := range e.adaptive {
		if ts, ok := s.Targets[c.Target()]; ok && ts.Adaptive != nil {
			for _, l := range c.AdaptiveLimits() {
				ts.Adaptive[l.Kind] += l.Limit
			}
		}
	}
	e.summary.Store(s)
}

// Summary returns the Summary last published (Publish): safe to call from
// any goroutine.
func (e *Engine) Summary() *Summary {
	if s := e.summary.Load(); s != nil {
		return s
	}
	return &Summary{Targets: map[string]TargetSummary{}}
}

// ReleasesNow is the number of ids given back so far, read from any
// goroutine: a reader of kernel slots by the owners of a Summary compares
// it with Summary.Releases to tell whether an id changed hands meanwhile.
func (e *Engine) ReleasesNow() uint64 { return e.reg.ids.releases.Load() }
