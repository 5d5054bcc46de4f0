package engine

import (
	"maps"

	kmaps "github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Overrides are the overrides set through the admin API, by circuit name,
// kept in the kernel's pinned overrides map so that they survive a
// restart, and in memory so that a circuit being made finds its own
// without a system call. Once loaded, this is the map's only writer.
type Overrides struct {
	k    Kernel
	kept map[string]kmaps.OverrideState
}

// keptStates maps the API's overrides to the pinned map's states.
var keptStates = map[policy.Override]kmaps.OverrideState{
	policy.ForceOpen: kmaps.OverrideForcedOpen, policy.ForceClosed: kmaps.OverrideForcedClosed, policy.DisableState: kmaps.OverrideDisabled,
}

// LoadOverrides reads the overrides a previous daemon kept in k.
func LoadOverrides(k Kernel) *Overrides {
	return &Overrides{k: k, kept: maps.Collect(k.Overrides())}
}

// Get returns the override kept for the circuit named name.
func (o *Overrides) Get(name string) (policy.Override, bool) {
	s, ok := o.kept[name]
	if !ok {
		return policy.NoOverride, false
	}
	for ov, k := range keptStates {
		if k == s {
			return ov, true
		}
	}
	return policy.NoOverride, false
}

// Keep records ov for the circuit named name; policy.NoOverride (or any
// override that is not kept) forgets it. Memory follows the kernel: a
// failed write changes neither.
func (o *Overrides) Keep(name string, ov policy.Override) error {
	if s, ok := keptStates[ov]; ok {
		if err := o.k.PutOverride(name, s); err != nil {
			return err
		}
		o.kept[name] = s
		return nil
	}
	if err := o.k.DeleteOverride(name); err != nil {
		return err
	}
	delete(o.kept, name)
	return nil
}
