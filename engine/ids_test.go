package engine

import (
	"net/netip"
	"testing"

	"github.com/breakerd/breakerd/engine/enginetest"
	"github.com/breakerd/breakerd/maps"
)

func idDest(p uint16) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.1"), p)}
}

// After a restart every id below the highest pinned one that no circuit
// holds is handed out again.
func TestRestartFreesIDsBelowPinned(t *testing.T) {
	s := NewIDs(enginetest.NewKernel(), 8)
	s.LoadPinned(map[maps.Dest]maps.Verdict{idDest(1): {CircuitID: 7}}, nil, nil)
	if id, inh, ok := s.Alloc("a", idDest(1)); id != 7 || !inh || !ok {
		t.Fatalf("inherit: %d %v %v", id, inh, ok)
	}
	s.EndStartup()
	got := map[uint32]bool{}
	for i := range 6 {
		id, _, ok := s.take("x", idDest(uint16(10+i)))
		if !ok || id == 0 || id == 7 || got[id] {
			t.Fatalf("take %d: id %d, ok %v (had %v)", i, id, ok, got)
		}
		got[id] = true
	}
	if _, _, ok := s.take("y", idDest(99)); ok {
		t.Fatal("an eighth id out of 7")
	}
}

// A released id whose bulkhead slot still counts sockets is held back
// until the count is zero, except for the same circuit made again, which
// takes back its own slot with the sockets it counts; ids are scarce from
// half of them held or held back.
func TestReleasedIDWaitsForItsSockets(t *testing.T) {
	k := enginetest.NewKernel()
	s := NewIDs(k, 3) // ids 1 and 2
	a, _, _ := s.Alloc("a", idDest(1))
	if !s.Scarce() {
		t.Fatal("one of two ids held: want scarce")
	}
	b, _, _ := s.Alloc("b", idDest(2))
	if _, _, ok := s.Alloc("c", idDest(3)); ok {
		t.Fatal("a third id out of two")
	}
	k.SetBulkCount(a, maps.BulkCount{Connections: 1})
	s.Release(a, "a")
	if s.Held() != 1 || s.Releases() != 1 {
		t.Fatalf("held %d, releases %d after one release of two", s.Held(), s.Releases())
	}
	// Absence after a positive signal: the allocator read a's slot.
	before := k.Calls("BulkCount")
	if id, _, ok := s.Alloc("c", idDest(3)); ok {
		t.Fatalf("id %d handed out while its slot counts a socket", id)
	}
	if k.Calls("BulkCount") == before {
		t.Fatal("the held-back id's slot was not read")
	}
	if id, _, ok := s.Alloc("a", idDest(1)); !ok || id != a {
		t.Fatalf("a made again: id %d, ok %v, want its own %d", id, ok, a)
	}
	s.Release(a, "a")
	k.SetBulkCount(a, maps.BulkCount{})
	if id, _, ok := s.Alloc("c", idDest(3)); !ok || id != a {
		t.Fatalf("c once a's socket closed: id %d, ok %v, want %d", id, ok, a)
	}
	s.Release(b, "b")
	s.Release(a, "c")
	if s.Scarce() || s.Held() != 0 {
		t.Fatalf("all released: scarce %v, held %d", s.Scarce(), s.Held())
	}
}

// A pinned id goes to the circuit made for its destination, with its
// epoch, unless its key class was forgotten (the workload's class moved);
// an unclaimed pinned id is handed out only once start-up ends.
func TestPinnedIDsAreInheritedOrKeptUntilStartupEnds(t *testing.T) {
	s := NewIDs(enginetest.NewKernel(), 4) // ids 1 to 3
	moved := idDest(2)
	moved.Class = 1
	s.LoadPinned(map[maps.Dest]maps.Verdict{idDest(1): {CircuitID: 3, Epoch: 9}, moved: {CircuitID: 2}}, nil, nil)
	s.ForgetClasses(map[uint8]bool{1: true})
	if s.PinnedFor(moved) || !s.PinnedFor(idDest(1)) {
		t.Fatalf("pinned for: moved %v, kept %v", s.PinnedFor(moved), s.PinnedFor(idDest(1)))
	}
	if id, inh, ok := s.Alloc("a", idDest(1)); id != 3 || !inh || !ok || s.PinnedEpoch(id) != 9 {
		t.Fatalf("inherit: %d %v %v epoch %d", id, inh, ok, s.PinnedEpoch(id))
	}
	if id, inh, ok := s.Alloc("m", moved); id != 1 || inh || !ok {
		t.Fatalf("moved class: %d %v %v, want the free id 1, not inherited", id, inh, ok)
	}
	if id, _, ok := s.Alloc("x", idDest(5)); ok {
		t.Fatalf("id %d handed out while pinned id 2 waits for start-up to end", id)
	}
	s.EndStartup()
	if id, _, ok := s.Alloc("x", idDest(5)); id != 2 || !ok {
		t.Fatalf("after start-up: %d %v, want 2", id, ok)
	}
}
