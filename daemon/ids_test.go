package daemon

import (
	"testing"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Up to policy.GuaranteedCircuits every circuit fits the kernel's maps at
// once, and half the ids stay free for slots held by sockets of dropped
// circuits.
func TestGuaranteedCircuitsFitTheKernel(t *testing.T) {
	if policy.GuaranteedCircuits > maps.MaxCircuitIDs/2 {
		t.Fatalf("guaranteed circuits %d leave too few of %d ids", policy.GuaranteedCircuits, maps.MaxCircuitIDs)
	}
	if policy.GuaranteedCircuits > maps.MaxDestinations {
		t.Fatalf("guaranteed circuits %d exceed the verdict map's %d entries", policy.GuaranteedCircuits, maps.MaxDestinations)
	}
	if policy.MaxCircuitsLimit < 1_000_000 {
		t.Fatalf("max_circuits limit %d is under a million", policy.MaxCircuitsLimit)
	}
}
