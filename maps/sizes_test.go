package maps

import (
	"testing"

	"github.com/breakerd/breakerd/bpf"
)

// TestSizesMatchTheKernel checks the Go side's sizes against breaker.h's
// enum sizes, read from the generated bindings: a size changed on one side
// only fails here, not in a map that refuses a key at run time.
func TestSizesMatchTheKernel(t *testing.T) {
	for _, c := range []struct {
		name      string
		goValue   int
		kernelVal bpf.BreakerSizes
	}{
		{"MaxDestinations", MaxDestinations, bpf.BreakerSizesMAX_DESTINATIONS},
		{"MaxCircuitIDs", MaxCircuitIDs, bpf.BreakerSizesMAX_CIRCUIT_IDS},
		{"maxOverrides", maxOverrides, bpf.BreakerSizesMAX_OVERRIDES},
		{"MaxWorkloadCgroups", MaxWorkloadCgroups, bpf.BreakerSizesMAX_WORKLOAD_CGROUPS},
		{"MaxInflight", MaxInflight, bpf.BreakerSizesMAX_INFLIGHT},
		{"MaxRejections", MaxRejections, bpf.BreakerSizesMAX_REJECTIONS},
		{"AnsweredIDs", AnsweredIDs, bpf.BreakerSizesANSWERED_IDS},
		{"answeredShift", answeredShift, bpf.BreakerSizesANSWERED_SHIFT},
		{"answeredFlushIDs", answeredFlushIDs, bpf.BreakerSizesANSWERED_FLUSH_IDS},
		{"answeredFlushHeader", answeredFlushHeader, bpf.BreakerSizesANSWERED_FLUSH_HEADER},
		{"respPortWords", respPortWords, bpf.BreakerSizesRESP_PORT_WORDS},
		{"ringBytes", ringBytes, bpf.BreakerSizesEVENTS_SIZE},
	} {
		if c.goValue != int(c.kernelVal) {
			t.Errorf("%s is %d, breaker.h says %d", c.name, c.goValue, c.kernelVal)
		}
	}
}
