package policy

import (
	"reflect"
	"strings"
	"testing"
)

// TestFleetConfig: the `fleet` block of `all` and of a target, its
// defaults, and what validation refuses, each problem under its key path.
func TestFleetConfig(t *testing.T) {
	const target = "targets:\n  pay:\n    match: {cidrs: [10.0.0.0/24]}\n"
	valid := []struct {
		name, yaml  string
		all, target FleetOptions
	}{
		{"no block: off", "mode: enforce\n" + target, FleetOptions{}, FleetOptions{}},
		{"an empty block takes the default quorum", "all:\n  fleet: {}\n", FleetOptions{Enabled: true, Quorum: 2}, FleetOptions{}},
		{"all's quorum", "all:\n  fleet: {quorum: 3}\n" + target, FleetOptions{Enabled: true, Quorum: 3}, FleetOptions{}},
		{"a target's own block", target + "    fleet: {quorum: 5}\n", FleetOptions{}, FleetOptions{Enabled: true, Quorum: 5}},
		{"the largest quorum", "all:\n  fleet: {quorum: 5000}\n", FleetOptions{Enabled: true, Quorum: 5000}, FleetOptions{}},
	}
	for _, tc := range valid {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse([]byte(tc.yaml), false)
			if err != nil {
				t.Fatal(err)
			}
			if c.All.Fleet != tc.all {
				t.Errorf("all.fleet = %+v, want %+v", c.All.Fleet, tc.all)
			}
			if p := c.Targets["pay"]; p != nil && p.Options.Fleet != tc.target {
				t.Errorf("targets.pay.fleet = %+v, want %+v", p.Options.Fleet, tc.target)
			}
		})
	}
	invalid := []struct{ name, yaml, want string }{
		{"a quorum of one", "all:\n  fleet: {quorum: 1}\n",
			"all.fleet.quorum: a quorum of 1 is refused: it would let one node alone (misconfigured, partitioned or compromised) open this circuit on every node; the least is 2"},
		{"a target's quorum of one", target + "    fleet:\n      quorum: 1\n", "targets.pay.fleet.quorum: a quorum of 1 is refused"},
		{"a quorum of zero", "all:\n  fleet: {quorum: 0}\n", "all.fleet.quorum: a quorum of 0 is refused"},
		{"a negative quorum", "all:\n  fleet: {quorum: -3}\n", "all.fleet.quorum: a quorum of -3 is refused"},
		{"past the largest", "all:\n  fleet: {quorum: 5001}\n", "all.fleet.quorum: 5001 is not in"},
		{"not a number", "all:\n  fleet: {quorum: many}\n", "all.fleet.quorum: \"many\" is not a number"},
		{"not whole", "all:\n  fleet: {quorum: 2.5}\n", "all.fleet.quorum: 2.5 is not a whole number"},
		{"a misspelt key", "all:\n  fleet: {quorom: 3}\n", "all.fleet.quorom: unknown key (did you mean quorum?)"},
		{"not a mapping", "all:\n  fleet: 3\n", "all.fleet: must be a mapping"},
		{"a misspelt block", "all:\n  flet: {}\n", "all.flet: unknown key (did you mean fleet?)"},
	}
	for _, tc := range invalid {
		t.Run(tc.name, func(t *testing.T) {
			got := problems(t, tc.yaml)
			if len(got) != 1 || !strings.HasPrefix(got[0], tc.want) {
				t.Fatalf("problems %q, want one starting %q", got, tc.want)
			}
		})
	}
}

// TestFleetConfigReloadIsAChange: a reload that changes only a fleet
// block is a change of the options it is in (the circuits take them, and
// keep their state), like any other option's.
func TestFleetConfigReloadIsAChange(t *testing.T) {
	parse := func(y string) *Config {
		c, err := Parse([]byte(y), false)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	old := parse("targets:\n  pay:\n    match: {cidrs: [10.0.0.0/24]}\n")
	same := parse("targets:\n  pay:\n    match: {cidrs: [10.0.0.0/24]}\n")
	if ch := Diff(old, same); !ch.Empty() {
		t.Fatalf("an unchanged reload changes %+v", ch)
	}
	next := parse("all:\n  fleet: {quorum: 3}\ntargets:\n  pay:\n    match: {cidrs: [10.0.0.0/24]}\n    fleet: {}\n")
	if ch := Diff(old, next); !ch.AllChanged || !reflect.DeepEqual(ch.Changed, []string{"pay"}) {
		t.Fatalf("a fleet-only reload: %+v", ch)
	}
}
