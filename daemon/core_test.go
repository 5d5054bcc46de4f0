package daemon

import (
	"testing"

	"github.com/breakerd/breakerd/policy"
)

// The event-to-verdict core's tests on the fake kernel and clock are the
// engine's (engine/handle_test.go).

// A fleet block anywhere (all, or one target) is what makes the daemon
// link to the fleet at start and reload (configureFleet).
func TestFleetBlocksAreSeen(t *testing.T) {
	for _, c := range []struct {
		yaml string
		want bool
	}{
		{"all: {consecutive_failures: 2}\n", false},
		{"all: {fleet: {}}\n", true},
		{"targets:\n  web:\n    match: {cidrs: [198.18.0.2/32], ports: [\"80\"]}\n    fleet: {quorum: 3}\n", true},
		{"targets:\n  web:\n    match: {cidrs: [198.18.0.2/32], ports: [\"80\"]}\n", false},
	} {
		cfg, err := policy.Parse([]byte(c.yaml), false)
		if err != nil {
			t.Fatalf("%q: %v", c.yaml, err)
		}
		if got := fleetBlocks(cfg); got != c.want {
			t.Errorf("%q: fleetBlocks %v, want %v", c.yaml, got, c.want)
		}
	}
}
