package engine

import (
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/breakerd/breakerd/maps"
)

// item stands for a circuit (of non-zero size, so that two have distinct
// addresses).
type item struct{ _ [8]byte }

// dynamicDest is the i-th of a set of distinct TCP destinations.
func dynamicDest(i int) maps.Dest {
	return maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, byte(i >> 16), byte(i >> 8)}), uint16(1+i&0xff))}
}

// checkIndex compares x with want entry by entry, and checks the table's
// invariant: every key is found from its first slot with no empty slot on
// the way (what deletion's backward shift must keep).
func checkIndex(t *testing.T, x *DestIndex[item], want map[maps.DestKey]*item) {
	t.Helper()
	if x.Len() != len(want) {
		t.Fatalf("len %d, want %d", x.Len(), len(want))
	}
	seen := 0
	for k, c := range x.All() {
		seen++
		if want[k] != c {
			t.Fatalf("all yields %v for a key, want %v", c, want[k])
		}
	}
	if seen != len(want) {
		t.Fatalf("all yields %d entries, want %d", seen, len(want))
	}
	if x.slots == nil {
		return
	}
	mask := uint32(len(x.slots) - 1)
	used := 0
	for i, s := range x.slots {
		if s.c == nil {
			continue
		}
		used++
		if s.h != x.Hash(&s.key) {
			t.Fatalf("slot %d keeps hash %#x, its key hashes to %#x", i, s.h, x.Hash(&s.key))
		}
		for j := s.h & mask; j != uint32(i); j = (j + 1) & mask {
			if x.slots[j].c == nil {
				t.Fatalf("slot %d's key (first slot %d) sits past the empty slot %d: lookups miss it", i, s.h&mask, j)
			}
		}
	}
	if used*16 > len(x.slots)*destIndexLoad {
		t.Fatalf("%d of %d slots used: over the load bound", used, len(x.slots))
	}
	for k, c := range want {
		if got := x.Get(k); got != c {
			t.Fatalf("get: %v, want %v", got, c)
		}
	}
}

// The index agrees with a Go map under random puts, replacements and
// deletions (and lookups of absent keys), across growth, with runs long
// enough for deletions to shift entries that wrapped past the table's end.
func TestDestIndexMatchesMap(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, keys := range []int{40, 500, 20_000} {
		var x DestIndex[item]
		want := map[maps.DestKey]*item{}
		circuits := make([]item, keys)
		for op := range 20 * keys {
			k := dynamicDest(r.IntN(keys)).Compact()
			switch r.IntN(3) {
			case 0, 1:
				c := &circuits[r.IntN(keys)]
				x.Put(k, c)
				want[k] = c
			default:
				x.Del(k)
				delete(want, k)
			}
			if got := x.Get(k); got != want[k] {
				t.Fatalf("%d keys, op %d: get after the op %v, want %v", keys, op, got, want[k])
			}
			if op%(keys/4) == 0 {
				checkIndex(t, &x, want)
			}
		}
		checkIndex(t, &x, want)
		for k := range want {
			x.Del(k)
		}
		checkIndex(t, &x, map[maps.DestKey]*item{})
		if got := x.Get(dynamicDest(0).Compact()); got != nil {
			t.Fatalf("emptied: get %v", got)
		}
	}
}

// A key differing from one in the index in a single field is another key:
// the class, the protocol, the port or one address byte.
func TestDestIndexKeysDifferByField(t *testing.T) {
	var x DestIndex[item]
	base := dynamicDest(7)
	var c1, c2 item
	x.Put(base.Compact(), &c1)
	variants := []maps.Dest{base, base, base, base}
	variants[0].Class = 1
	variants[1].Proto = maps.UDP
	variants[2].Addr = netip.AddrPortFrom(base.Addr.Addr().Next(), base.Addr.Port())
	variants[3].Addr = netip.AddrPortFrom(base.Addr.Addr(), base.Addr.Port()+1)
	for i, v := range variants {
		if got := x.Get(v.Compact()); got != nil {
			t.Fatalf("variant %d (%v) found %v", i, v, got)
		}
	}
	x.Put(variants[0].Compact(), &c2)
	if x.Get(base.Compact()) != &c1 || x.Get(variants[0].Compact()) != &c2 || x.Len() != 2 {
		t.Fatal("two keys differing by class do not keep their own circuits")
	}
}

// Lookups allocate nothing.
func TestDestIndexGetAllocatesNothing(t *testing.T) {
	var x DestIndex[item]
	var c item
	for i := range 1000 {
		x.Put(dynamicDest(i).Compact(), &c)
	}
	k := dynamicDest(500).Compact()
	if n := testing.AllocsPerRun(1000, func() { x.Get(k) }); n != 0 {
		t.Fatalf("%v allocations per lookup", n)
	}
}

// Reserved room takes n keys without growing, and replacing a key in a
// full index does not grow it either.
func TestDestIndexReserve(t *testing.T) {
	for _, n := range []int{0, 1, 52, 53, 100_000, 131_072} {
		var x DestIndex[item]
		x.Reserve(n)
		size := len(x.slots)
		if size&(size-1) != 0 || n*16 > size*destIndexLoad || (size > destIndexMin && n*16 <= size/2*destIndexLoad) {
			t.Fatalf("reserve(%d): %d slots, want the least power of two (from %d) that holds %d within the load bound", n, size, destIndexMin, n)
		}
		var c, d item
		for i := range n {
			x.Put(dynamicDest(i).Compact(), &c)
		}
		for i := range n {
			x.Put(dynamicDest(i).Compact(), &d)
		}
		if len(x.slots) != size || x.Len() != n {
			t.Fatalf("reserve(%d), %d puts and as many replacements: %d slots (reserved %d), %d keys", n, n, len(x.slots), size, x.Len())
		}
		if n > 0 && x.Get(dynamicDest(n-1).Compact()) != &d {
			t.Fatalf("reserve(%d): a replaced key does not find its new circuit", n)
		}
	}
}
