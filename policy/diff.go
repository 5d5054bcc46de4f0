package policy

import "reflect"

// Change is what a reload changes. Circuits of unchanged targets (and of
// `all`, when its options are unchanged) keep their state and windows;
// those of changed targets are reset with the new options; those of removed
// targets are dropped.
type Change struct {
	// AllChanged: the options of `all` differ (dynamic circuits reset).
	AllChanged bool
	// ModeChanged: enforce/shadow switched.
	ModeChanged bool
	// WorkloadsChanged: the workloads (names, order, patterns or
	// isolation) differ.
	WorkloadsChanged bool
	// Added, Removed, Changed and Unchanged are target names.
	Added, Removed, Changed, Unchanged []string
}

// Empty reports whether the reload changes nothing that circuits see.
func (c Change) Empty() bool {
	return !c.AllChanged && !c.ModeChanged && !c.WorkloadsChanged && len(c.Added)+len(c.Removed)+len(c.Changed) == 0
}

// Diff computes what changes from old to next. A `fleet` block is
// compared as every option is: the circuits take it with their new
// options, and keep their state.
func Diff(old, next *Config) Change {
	ch := Change{AllChanged: old.All != next.All, ModeChanged: old.Mode != next.Mode,
		WorkloadsChanged: !reflect.DeepEqual(old.Workloads, next.Workloads)}
	for _, name := range sortedTargetNames(next) {
		o, ok := old.Targets[name]
		switch {
		case !ok:
			ch.Added = append(ch.Added, name)
		case reflect.DeepEqual(o, next.Targets[name]):
			ch.Unchanged = append(ch.Unchanged, name)
		default:
			ch.Changed = append(ch.Changed, name)
		}
	}
	for _, name := range sortedTargetNames(old) {
		if _, ok := next.Targets[name]; !ok {
			ch.Removed = append(ch.Removed, name)
		}
	}
	return ch
}
