package maps

import (
	"errors"
	"fmt"
	"iter"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
)

// OverrideState is an override set through the admin API, as kept in the
// pinned overrides map.
type OverrideState uint32

// The overrides, as in bpf/breaker.h.
const (
	OverrideForcedOpen   = OverrideState(bpf.BreakerOverrideStateOVERRIDE_FORCED_OPEN)
	OverrideForcedClosed = OverrideState(bpf.BreakerOverrideStateOVERRIDE_FORCED_CLOSED)
	OverrideDisabled     = OverrideState(bpf.BreakerOverrideStateOVERRIDE_DISABLED)
)

// MaxOverrideName is the longest circuit name whose override can be kept.
const MaxOverrideName = len(bpf.BreakerOverrideKey{}.Name)

// ErrOverrideName is returned for a circuit name too long to keep.
var ErrOverrideName = fmt.Errorf("circuit name longer than %d bytes", MaxOverrideName)

func overrideKey(name string) (bpf.BreakerOverrideKey, error) {
	var k bpf.BreakerOverrideKey
	if len(name) > len(k.Name) || len(name) == 0 {
		return k, fmt.Errorf("keeping the override of %q: %w", name, ErrOverrideName)
	}
	for i := range len(name) {
		k.Name[i] = int8(name[i])
	}
	return k, nil
}

func overrideName(k *bpf.BreakerOverrideKey) string {
	b := make([]byte, 0, len(k.Name))
	for _, c := range k.Name {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

// PutOverride keeps circuit name's override in the pinned overrides map,
// so a restarted daemon finds it.
func (k *Kernel) PutOverride(name string, s OverrideState) error {
	key, err := overrideKey(name)
	if err != nil {
		return err
	}
	val := bpf.BreakerOverride{State: uint32(s)}
	if err := k.objs.Overrides.Put(&key, &val); err != nil {
		return fmt.Errorf("keeping the override of %s: %w", name, err)
	}
	return nil
}

// DeleteOverride forgets circuit name's override; a missing one is not an
// error.
func (k *Kernel) DeleteOverride(name string) error {
	key, err := overrideKey(name)
	if err != nil {
		return nil // never kept
	}
	if err := k.objs.Overrides.Delete(&key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("forgetting the override of %s: %w", name, err)
	}
	return nil
}

// Override reads circuit name's kept override; ok is false when there is
// none.
func (v *View) Override(name string) (s OverrideState, ok bool, err error) {
	key, err := overrideKey(name)
	if err != nil {
		return 0, false, nil
	}
	var val bpf.BreakerOverride
	if err := v.overrides.Lookup(&key, &val); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return 0, false, nil
		}
		return 0, false, fmt.Errorf("reading the override of %s: %w", name, err)
	}
	return OverrideState(val.State), true, nil
}

// Overrides iterates over every kept override.
func (v *View) Overrides() iter.Seq2[string, OverrideState] {
	return func(yield func(string, OverrideState) bool) {
		var key bpf.BreakerOverrideKey
		var val bpf.BreakerOverride
		it := v.overrides.Iterate()
		for it.Next(&key, &val) {
			if !yield(overrideName(&key), OverrideState(val.State)) {
				return
			}
		}
	}
}
