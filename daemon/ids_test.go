package daemon

import (
	"testing"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Every destination max_circuits allows fits the kernel's maps, and half
// the ids stay free for slots held by sockets of dropped circuits.
func TestMaxCircuitsFitsTheKernel(t *testing.T) {
	if policy.MaxCircuitsLimit > maps.MaxCircuitIDs/2 {
		t.Fatalf("max_circuits limit %d leaves too few of %d ids", policy.MaxCircuitsLimit, maps.MaxCircuitIDs)
	}
	if policy.MaxCircuitsLimit > maps.MaxDestinations {
		t.Fatalf("max_circuits limit %d exceeds the verdict map's %d entries", policy.MaxCircuitsLimit, maps.MaxDestinations)
	}
}
