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
// their entries before it writes any settings. A bit set with no entry
// under it only costs connects under it the lookup they made before.

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
	// bits is the mask as last written, changed and read with
	// Kernel.cfgMu held: every write of the settings writes it.
	bits uint64
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
// writes the mask they make: exact, as only this Kernel writes the map
// (the pin directory's lock), and clearing what a previous daemon left set
// (one killed between setting a bit and writing its entry).
func (k *Kernel) countVerdicts() error {
	k.vm.mu.Lock()
	defer k.vm.mu.Unlock()
	return k.recountLocked()
}

func (k *Kernel) recountLocked() error {
	var counts [verdictBuckets]uint32
	var key bpf.BreakerDestKey
	var raw bpf.BreakerVerdict
	it := k.objs.Verdicts.Iterate()
	for it.Next(&key, &raw) {
		counts[verdictBucket(&key)]++
	}
	if err := it.Err(); err != nil {
		// Unknown counts: every bit set, every connect looks up.
		for i := range k.vm.counts {
			k.vm.counts[i] = 1
		}
		err2 := k.setMaskBits(^uint64(0))
		return errors.Join(fmt.Errorf("counting verdicts: %w", err), err2)
	}
	k.vm.counts = counts
	var bits uint64
	for i, n := range counts {
		if n > 0 {
			bits |= 1 << i
		}
	}
	return k.setMaskBits(bits)
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
	if k.vm.counts[b] == 0 {
		if err := k.setMaskBits(k.vm.bits | 1<<b); err != nil {
			return err
		}
	}
	err := k.objs.Verdicts.Update(key, val, ebpf.UpdateNoExist)
	if err == nil {
		k.vm.counts[b]++
		return nil
	}
	if errors.Is(err, ebpf.ErrKeyExist) {
		// A replacement: counted already.
		return k.objs.Verdicts.Update(key, val, ebpf.UpdateExist)
	}
	if k.vm.counts[b] == 0 {
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
	b := verdictBucket(key)
	if k.vm.counts[b] > 0 {
		k.vm.counts[b]--
	}
	if k.vm.counts[b] == 0 {
		if err := k.setMaskBits(k.vm.bits &^ (1 << b)); err != nil {
			// Left set: safe, and the next change of the mask writes it.
			k.log.Warn("clearing a bit of the verdict mask", "err", err)
		}
	}
	return nil
}
