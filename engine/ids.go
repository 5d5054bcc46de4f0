package engine

import (
	"sync/atomic"

	"github.com/breakerd/breakerd/maps"
)

// IDs hands out circuit ids: each indexes the circuit's kernel counters
// and its bulkhead slot. Id 0 is never handed out. An id is given to one
// live circuit at a time; a returned id whose bulkhead slot still counts
// sockets (they release into the slot they were counted in) is held back
// until the count is zero, so a slot never mixes two circuits' sockets.
// Used by one goroutine at a time, like the registry.
type IDs struct {
	k        Kernel
	next     uint32            // ids from here up were never handed out
	free     []uint32          // returned ids whose slot counts nothing
	draining map[uint32]string // returned ids whose slot still counts sockets, with the circuit's name
	pinned   map[uint32]bool   // ids found in the pinned maps at start-up, not yet claimed
	epochs   map[uint32]uint32 // the epochs of pinned verdicts and limits, by id (start-up only)
	byDest   map[maps.Dest]uint32
	// held counts the ids handed out and not yet released.
	held int
	// releases counts the ids given back (a scrape's check that the
	// slots it read kept their owners).
	releases atomic.Uint64
	// limit is the number of ids (maps.MaxCircuitIDs; less in tests).
	limit uint32
}

// NewIDs hands out ids 1 to limit-1 (maps.MaxCircuitIDs: all the kernel
// has), reading the bulkhead counts of returned ids from k.
func NewIDs(k Kernel, limit uint32) *IDs {
	return &IDs{k: k, next: 1, limit: limit, draining: map[uint32]string{}, pinned: map[uint32]bool{}, epochs: map[uint32]uint32{}, byDest: map[maps.Dest]uint32{}}
}

// SetLimit changes the number of ids (tests that run out of them).
func (s *IDs) SetLimit(limit uint32) { s.limit = limit }

// Held is the number of ids handed out and not yet released.
func (s *IDs) Held() int { return s.held }

// Next is the least id never handed out: every id handed out is below it.
func (s *IDs) Next() uint32 { return s.next }

// Releases counts the ids given back, so that a reader of the kernel's
// per-id slots can tell whether they kept their owners meanwhile.
func (s *IDs) Releases() uint64 { return s.releases.Load() }

// LoadPinned records the ids a previous daemon left in the kernel: the
// circuit id of each verdict, the slot of each limit, and every slot that
// still counts sockets. A circuit made for one of those destinations
// inherits its id (so its counters and bulkhead counts carry on); the
// others are handed out only once the end of start-up (EndStartup) or a
// later release (giveBack) finds them unclaimed and idle.
// Every unpinned id below the highest pinned one is free at once.
func (s *IDs) LoadPinned(verdicts map[maps.Dest]maps.Verdict, limits map[maps.Dest]maps.Limit, busy map[uint32]maps.BulkCount) {
	mark := func(id uint32) {
		if id != 0 && id < s.limit {
			s.pinned[id] = true
			s.next = max(s.next, id+1)
		}
	}
	for d, v := range verdicts {
		mark(v.CircuitID)
		s.byDest[d] = v.CircuitID
		if v.Epoch != 0 {
			s.epochs[v.CircuitID] = v.Epoch
		}
	}
	for d, l := range limits {
		mark(l.Slot)
		if _, ok := s.byDest[d]; !ok {
			s.byDest[d] = l.Slot
		}
		// A circuit's own limits carry its verdicts' epoch; a sharing
		// workload's slot has its own. A verdict's wins.
		if _, ok := s.epochs[l.Slot]; !ok && l.Epoch != 0 {
			s.epochs[l.Slot] = l.Epoch
		}
	}
	for id := range busy {
		mark(id)
	}
	// Every other id below next is free now (no circuit exists yet):
	// handed out from the start, not only once start-up ends.
	for id := uint32(1); id < s.next; id++ {
		if !s.pinned[id] {
			s.free = append(s.free, id)
		}
	}
}

// ForgetClasses makes the pinned entries of destinations of the given key
// classes pass on nothing: no circuit inherits their ids (which stay held
// until start-up ends, and then until their slots count nothing).
func (s *IDs) ForgetClasses(classes map[uint8]bool) {
	for d := range s.byDest {
		if classes[d.Class] {
			delete(s.byDest, d)
		}
	}
}

// Alloc returns an id for a new circuit named name whose first destination
// is dst. inherited says the id carries the kernel state of the circuit a
// previous daemon had for dst (its counters are kept). ok is false when
// every id is in use or held back.
func (s *IDs) Alloc(name string, dst maps.Dest) (id uint32, inherited, ok bool) {
	id, inherited, ok = s.take(name, dst)
	if ok {
		s.held++
	}
	return id, inherited, ok
}

// PinnedFor reports whether a previous daemon left an id for dst that a
// circuit made for it inherits (start-up only).
func (s *IDs) PinnedFor(dst maps.Dest) bool {
	id, found := s.byDest[dst]
	return found && s.pinned[id]
}

// Scarce reports whether half the ids or more are handed out or held
// back for sockets still counted in their slots: a closing dynamic circuit
// then gives its id back (Engine.releaseID).
func (s *IDs) Scarce() bool { return s.held+len(s.draining) >= int(s.limit/2) }

func (s *IDs) take(name string, dst maps.Dest) (id uint32, inherited, ok bool) {
	if id, found := s.byDest[dst]; found && s.pinned[id] {
		delete(s.pinned, id)
		return id, true, true
	}
	// The same circuit made again (a reload) takes back its own slot, with
	// the sockets it still counts.
	for id, n := range s.draining {
		if n == name {
			delete(s.draining, id)
			return id, false, true
		}
	}
	for len(s.free) > 0 {
		id := s.free[len(s.free)-1]
		s.free = s.free[:len(s.free)-1]
		if s.busy(id) {
			s.draining[id] = ""
			continue
		}
		return id, false, true
	}
	for s.next < s.limit {
		id := s.next
		s.next++
		if !s.pinned[id] {
			return id, false, true
		}
	}
	for id := range s.draining {
		if !s.busy(id) {
			delete(s.draining, id)
			return id, false, true
		}
	}
	return 0, false, false
}

// Release takes back the id of a dropped circuit named name.
func (s *IDs) Release(id uint32, name string) {
	if id == 0 {
		return
	}
	s.held--
	s.releases.Add(1)
	s.giveBack(id, name)
}

// giveBack files a returned id as free, or as draining while its slot
// still counts sockets.
func (s *IDs) giveBack(id uint32, name string) {
	if s.busy(id) {
		s.draining[id] = name
		return
	}
	s.free = append(s.free, id)
}

// EndStartup releases the pinned ids no circuit claimed. The unpinned ids
// below them were free from loadPinned on, so every id no circuit holds
// is free or held back from here on.
func (s *IDs) EndStartup() {
	for id := range s.pinned {
		s.giveBack(id, "") // never handed out here: not in held
	}
	clear(s.pinned)
	clear(s.byDest)
	clear(s.epochs)
}

// PinnedEpoch is the epoch the pinned verdicts or limits of id carry (0:
// none), for the circuit or bulkhead slot that inherits id at start-up.
func (s *IDs) PinnedEpoch(id uint32) uint32 { return s.epochs[id] }

func (s *IDs) busy(id uint32) bool {
	b, err := s.k.BulkCount(id)
	return err != nil || b.Connections != 0 || b.Connecting != 0
}
