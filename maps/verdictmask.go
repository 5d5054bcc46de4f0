package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
)

// The verdict mask (settings.verdict_mask) lets connect and sendmsg skip
// the verdict lookup for a destination whose bit is clear. Its one rule:
// while the verdicts map holds an entry, the entry's bit is set. So a bit
// is set before the first entry under it is written and cleared only after
// the last one is deleted, and a Kernel that adopts pinned maps counts
// their entries before it writes any settings (see countVerdicts). A bit
// set with no entry under it only costs connects under it the lookup they
// made before.

// verdictBuckets is the number of bits in the mask.
const verdictBuckets = 64

// verdictBucket is key's bit of the mask; verdict_bucket in
// bpf/breaker.h computes the same.
func verdictBucket(key *bpf.BreakerDestKey) uint {
	var b [20]byte
	copy(b[:16], key.Addr[:])
	binary.LittleEndian.PutUint16(b[16:], key.Port) // its bytes in the map's key
	b[18], b[19] = key.Proto, key.Class
	var h uint32
	for i := 0; i < 20; i += 4 {
		h ^= binary.LittleEndian.Uint32(b[i:])
	}
	return uint((h * 0x9E3779B1) >> 26)
}

// verdictMask is a Kernel's count of verdict entries under each bit, and
// the mask they make.
type verdictMask struct {
	// mu orders every write of the verdicts map with the counts (held
	// around the map's system calls, and the settings write a bit's change
	// makes).
	mu     sync.Mutex
	counts [verdictBuckets]uint32
	// unknown: the last count failed, so counts may be short; no bit is
	// cleared until a count succeeds (each delete tries one).
	unknown bool
	// kept are bits a count kept without entries of this Kernel's map
	// under them (Load before attaching): never cleared until an exact
	// count.
	kept uint64
	// bits is the mask as last written. It changes with both mu and
	// Kernel.cfgMu held, so either suffices to read it: every write of
	// the settings writes it.
	bits uint64
	// between, when set (tests), runs between a verdict write's two steps:
	// after the bit is set and before the entry is written, and after the
	// entry is deleted and before the bit is cleared.
	between func()
}

// setMaskBits writes bits as the settings' verdict mask, keeping every
// other field as the map holds it. Call with k.vm.mu held.
func (k *Kernel) setMaskBits(bits uint64) error {
	k.cfgMu.Lock()
	defer k.cfgMu.Unlock()
	var raw bpf.BreakerSettings
	if err := k.objs.Config.Lookup(uint32(0), &raw); err != nil {
		return fmt.Errorf("reading settings: %w", err)
	}
	if raw.VerdictMask != bits {
		raw.VerdictMask = bits
		if err := k.objs.Config.Put(uint32(0), &raw); err != nil {
			return fmt.Errorf("writing the verdict mask: %w", err)
		}
	}
	k.vm.bits = bits
	return nil
}

// countVerdicts counts the verdicts map's entries under each bit and
// writes the mask they make. Exact (only this Kernel writes the map: the
// pin directory's lock), it also clears what a previous daemon left set
// (one killed between setting a bit and writing its entry); otherwise it
// only adds bits to the mask the map holds. Load counts before attaching
// with exact false: programs a previous daemon attached may still read
// another verdicts map (one whose pin was removed, made anew at this
// load) or hash with another build's verdict_bucket until this Kernel's
// programs replace theirs; once they have, Load counts exactly.
func (k *Kernel) countVerdicts(exact bool) error {
	k.vm.mu.Lock()
	defer k.vm.mu.Unlock()
	keep := uint64(0)
	if !exact {
		m, err := k.VerdictMask()
		if err != nil {
			return err
		}
		keep = m
	}
	return k.recountLocked(keep)
}

// recountLocked counts the entries and writes their bits, and the bits of
// keep. Call with k.vm.mu held.
func (k *Kernel) recountLocked(keep uint64) error {
	counts, err := countBuckets(k.objs.Verdicts)
	if err != nil {
		// Unknown counts: every bit set, every connect looks up, none
		// cleared until a count succeeds.
		k.vm.unknown = true
		err2 := k.setMaskBits(^uint64(0))
		return errors.Join(fmt.Errorf("counting verdicts: %w", err), err2)
	}
	k.vm.counts, k.vm.unknown, k.vm.kept = counts, false, keep
	bits := keep
	for i, n := range counts {
		if n > 0 {
			bits |= 1 << i
		}
	}
	return k.setMaskBits(bits)
}

// countBuckets counts m's keys under each bit of the mask, reading the map
// in batches of 4096 (one entry at a time where batches fail).
func countBuckets(m *ebpf.Map) (counts [verdictBuckets]uint32, _ error) {
	keys := make([]bpf.BreakerDestKey, batchSize)
	vals := make([]bpf.BreakerVerdict, batchSize)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := range keys[:n] {
			counts[verdictBucket(&keys[i])]++
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return counts, nil
		}
		if err != nil {
			break
		}
	}
	counts = [verdictBuckets]uint32{}
	var key bpf.BreakerDestKey
	var raw bpf.BreakerVerdict
	it := m.Iterate()
	for it.Next(&key, &raw) {
		counts[verdictBucket(&key)]++
	}
	return counts, it.Err()
}

// VerdictMask reads the settings' verdict mask (see settings.verdict_mask).
func (v *View) VerdictMask() (uint64, error) {
	var raw bpf.BreakerSettings
	if err := v.config.Lookup(uint32(0), &raw); err != nil {
		return 0, fmt.Errorf("reading settings: %w", err)
	}
	return raw.VerdictMask, nil
}

// MaskOf is the verdict mask that exactly covers dests (tests compare it
// with VerdictMask).
func MaskOf(dests []Dest) uint64 {
	var bits uint64
	for _, d := range dests {
		key := d.Key()
		bits |= 1 << verdictBucket(&key)
	}
	return bits
}

// putVerdictLocked writes key's verdict, counting a new entry under its
// bit, which is set first. Call with k.vm.mu held.
func (k *Kernel) putVerdictLocked(key *bpf.BreakerDestKey, val *bpf.BreakerVerdict) error {
	b := verdictBucket(key)
	if k.vm.bits&(1<<b) == 0 {
		if err := k.setMaskBits(k.vm.bits | 1<<b); err != nil {
			return err
		}
	}
	if k.vm.between != nil {
		k.vm.between()
	}
	err := k.objs.Verdicts.Update(key, val, ebpf.UpdateNoExist)
	if err == nil {
		k.vm.counts[b]++
		return nil
	}
	if errors.Is(err, ebpf.ErrKeyExist) {
		// A replacement: counted already (at least once, whatever the
		// counts missed).
		k.vm.counts[b] = max(k.vm.counts[b], 1)
		return k.objs.Verdicts.Update(key, val, ebpf.UpdateExist)
	}
	if k.vm.counts[b] == 0 && !k.vm.unknown && k.vm.kept&(1<<b) == 0 {
		// Nothing written: the bit goes again (keeping it would only cost
		// lookups).
		_ = k.setMaskBits(k.vm.bits &^ (1 << b))
	}
	return err
}

// deleteVerdictLocked deletes key's verdict and, when it was the last
// under its bit, clears the bit. Call with k.vm.mu held.
func (k *Kernel) deleteVerdictLocked(key *bpf.BreakerDestKey) error {
	if err := k.objs.Verdicts.Delete(key); err != nil {
		return err
	}
	if k.vm.between != nil {
		k.vm.between()
	}
	if k.vm.unknown {
		// Counted anew, from the map as it is now: exact again, or
		// every bit stays set.
		if err := k.recountLocked(0); err != nil {
			k.log.Warn("counting verdicts for the verdict mask", "err", err)
		}
		return nil
	}
	b := verdictBucket(key)
	if k.vm.counts[b] > 0 {
		k.vm.counts[b]--
	}
	if k.vm.counts[b] == 0 && k.vm.kept&(1<<b) == 0 {
		if err := k.setMaskBits(k.vm.bits &^ (1 << b)); err != nil {
			// Left set (it costs a lookup, no more); the next delete under
			// it or the next count clears it.
			k.log.Warn("clearing a bit of the verdict mask", "err", err)
		}
	}
	return nil
}
