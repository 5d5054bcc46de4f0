package engine

import (
	"hash/maphash"
	"iter"
	"unsafe"

	"github.com/breakerd/breakerd/maps"
)

// DestIndex maps destinations to their circuits (the registry's index by
// destination), pointers to C. It is an open-addressing table with linear probing and backward-shift deletion
// (no tombstones), kept at most 13/16 full, in one slice of 32-byte slots,
// two to a cache line.
//
// Why not a Go map: with a hundred thousand circuits and more, a record's
// lookup misses the CPU caches, and a Go map's makes two misses one after
// the other (a group's control word, then the slot it points to). Here the
// hash alone names a lookup's first slot, which holds a key itself (most
// often the one looked for), so the reader loads the first slots of a
// whole chunk of records before it looks any up (Touch, then GetHashed),
// and their misses overlap.
//
// The hash is hash/maphash under a seed drawn per index: a local user who
// picks the destinations a node connects to cannot pick colliding ones.
//
// The daemon reserves room for max_circuits destinations whenever it
// applies a configuration (Reserve), so the index does not grow on the
// record path: growing rehashes every key at once, which measured 5–35 ms
// at 106,496 keys here (a Go map grows in tables of at most 1024 slots).
// It still grows when more keys go in (start-up adopting more pinned
// verdicts than max_circuits allows). It never shrinks. The zero value is
// empty and ready; it is used by one goroutine at a time, like the
// registry.
//
// It is generic only so that it can live apart from the circuit type: a
// type argument that is not a pointer has a shape of its own, so the
// compiler makes one copy of these methods for it, as for a plain type.
type DestIndex[C any] struct {
	slots []destSlot[C] // len is 0 or a power of two
	n     int
	seed  maphash.Seed
}

// destSlot is one slot: empty when c is nil. h is the low half of the
// key's hash, kept so that growing and deleting need not hash again, and
// so that most slots that hold another key are passed over without
// comparing it.
type destSlot[C any] struct {
	c   *C
	key maps.DestKey
	h   uint32
}

const (
	destIndexMin = 64 // slots when the first key goes in
	// destIndexLoad is the most keys per 16 slots.
	destIndexLoad = 13
)

// Len is the number of keys.
func (x *DestIndex[C]) Len() int { return x.n }

// Bytes is the memory the table's slots take.
func (x *DestIndex[C]) Bytes() uintptr {
	return uintptr(len(x.slots)) * unsafe.Sizeof(destSlot[C]{})
}

// Hash is the hash of k in x (its low half chooses the first slot). x
// must have slots: a key put, or room reserved.
func (x *DestIndex[C]) Hash(k *maps.DestKey) uint32 {
	return uint32(k.Hash(x.seed))
}

// Touch loads the first slot a key of hash h is looked for in, and returns
// something of it so the load is kept (the caller sums what it returns). x must have
// slots: a key put, or room reserved.
func (x *DestIndex[C]) Touch(h uint32) uintptr {
	return uintptr(x.slots[h&uint32(len(x.slots)-1)].h)
}

// Get returns the circuit of k, or nil.
func (x *DestIndex[C]) Get(k maps.DestKey) *C {
	if x.n == 0 {
		return nil
	}
	return x.GetHashed(&k, x.Hash(&k))
}

// GetHashed is Get with k's hash already computed (Hash).
func (x *DestIndex[C]) GetHashed(k *maps.DestKey, h uint32) *C {
	mask := uint32(len(x.slots) - 1)
	for i := h & mask; ; i = (i + 1) & mask {
		s := &x.slots[i]
		if s.c == nil {
			return nil // the load bound keeps an empty slot in every run
		}
		if s.h == h && s.key == *k {
			return s.c
		}
	}
}

// Put files c under k, in place of any circuit there.
func (x *DestIndex[C]) Put(k maps.DestKey, c *C) {
	if c == nil {
		panic("DestIndex: Put of a nil circuit")
	}
	if x.slots == nil {
		x.Reserve(0)
	}
	h := x.Hash(&k)
	for {
		mask := uint32(len(x.slots) - 1)
		i := h & mask
		for ; x.slots[i].c != nil; i = (i + 1) & mask {
			if s := &x.slots[i]; s.h == h && s.key == k {
				s.c = c
				return
			}
		}
		if (x.n+1)*16 <= len(x.slots)*destIndexLoad {
			x.slots[i] = destSlot[C]{c: c, key: k, h: h}
			x.n++
			return
		}
		x.resize(2 * len(x.slots))
	}
}

// Reserve makes room for n keys without growing (within the load bound).
func (x *DestIndex[C]) Reserve(n int) {
	if x.slots == nil {
		x.seed = maphash.MakeSeed()
		x.slots = make([]destSlot[C], destIndexMin)
	}
	size := len(x.slots)
	for n*16 > size*destIndexLoad {
		size *= 2
	}
	if size > len(x.slots) {
		x.resize(size)
	}
}

// resize moves every key into size slots (a power of two, above the
// keys' load bound).
func (x *DestIndex[C]) resize(size int) {
	old := x.slots
	x.slots = make([]destSlot[C], size)
	mask := uint32(len(x.slots) - 1)
	for _, s := range old {
		if s.c == nil {
			continue
		}
		i := s.h & mask
		for x.slots[i].c != nil {
			i = (i + 1) & mask
		}
		x.slots[i] = s
	}
}

// Del removes k, if it is there. The keys after it in its run move back
// into the hole when their first slot is not between the hole and where
// they are (backward-shift deletion), so every run stays unbroken and no
// slot is ever marked deleted.
func (x *DestIndex[C]) Del(k maps.DestKey) {
	if x.n == 0 {
		return
	}
	h := x.Hash(&k)
	mask := uint32(len(x.slots) - 1)
	i := h & mask
	for {
		s := &x.slots[i]
		if s.c == nil {
			return
		}
		if s.h == h && s.key == k {
			break
		}
		i = (i + 1) & mask
	}
	for j := (i + 1) & mask; x.slots[j].c != nil; j = (j + 1) & mask {
		// The entry at j may fill the hole at i unless its first slot
		// lies cyclically in (i, j].
		home := x.slots[j].h & mask
		if (j-home)&mask >= (j-i)&mask {
			x.slots[i] = x.slots[j]
			i = j
		}
	}
	x.slots[i] = destSlot[C]{}
	x.n--
}

// All yields every key and its circuit, in no order. The index must not
// change while it runs.
func (x *DestIndex[C]) All() iter.Seq2[maps.DestKey, *C] {
	return func(yield func(maps.DestKey, *C) bool) {
		for i := range x.slots {
			if s := &x.slots[i]; s.c != nil && !yield(s.key, s.c) {
				return
			}
		}
	}
}
