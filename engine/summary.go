package engine

import (
	"slices"

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
	owners   [][]IDOwner
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
}

// IDOwner is whom a kernel circuit id counts for: a target's circuit, or
// (Bulk) a sharing workload's bulkhead slot of one.
type IDOwner struct {
	Target string
	Bulk   bool
}

// Owner returns the owner of id when the summary was taken.
func (s *Summary) Owner(id uint32) (IDOwner, bool) {
	i, j := int(id/ownerChunk), int(id%ownerChunk)
	if i >= len(s.owners) || s.owners[i] == nil {
		return IDOwner{}, false
	}
	o := s.owners[i][j]
	return o, o.Target != ""
}

// ownerChunk is how many ids one chunk of the owners table holds: a
// change of one id's owner costs the next Publish a copy of its chunk.
const ownerChunk = 4096

// idOwners is the engine's table of id owners, in chunks; published holds
// the chunks as last published, shared with the Summaries until changed.
type idOwners struct {
	chunks    [][]IDOwner
	dirty     []bool
	published [][]IDOwner
}

func (t *idOwners) set(id uint32, o IDOwner) {
	i := int(id / ownerChunk)
	for len(t.chunks) <= i {
		t.chunks = append(t.chunks, nil)
		t.dirty = append(t.dirty, false)
		t.published = append(t.published, nil)
	}
	if t.chunks[i] == nil {
		t.chunks[i] = make([]IDOwner, ownerChunk)
	}
	t.chunks[i][id%ownerChunk] = o
	t.dirty[i] = true
}

func (t *idOwners) clear(id uint32) {
	if i := int(id / ownerChunk); id != 0 && i < len(t.chunks) && t.chunks[i] != nil {
		t.chunks[i][id%ownerChunk] = IDOwner{}
		t.dirty[i] = true
	}
}

// publish returns the chunks as they are, copying only those changed
// since the last call.
func (t *idOwners) publish() [][]IDOwner {
	for i, d := range t.dirty {
		if d {
			t.published[i] = slices.Clone(t.chunks[i])
			t.dirty[i] = false
		}
	}
	return slices.Clone(t.published)
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
// owner calls it at the end of each step that may have changed circuits
// (HandleBatch and Tick call it themselves).
func (e *Engine) Publish() {
	s := &Summary{Targets: map[string]TargetSummary{}, Unenforced: len(e.unenforced), Ramping: len(e.ramps),
		NextID: e.reg.ids.Next(), Releases: e.reg.ids.Releases(), owners: e.owners.publish()}
	add := func(name string, o *policy.Options) {
		ts := TargetSummary{Retired: e.retired[name], Limits: o != nil && o.HasLimits()}
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
