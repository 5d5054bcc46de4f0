package maps

import (
	"testing"

	"github.com/cilium/ebpf"

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
		{"MaxFallbacks", MaxFallbacks, bpf.BreakerSizesMAX_FALLBACKS},
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

// TestMemoryBoundUsesTheObjectsSizes checks the key, value and map sizes
// MemoryBound counts with against the maps of the compiled object: a
// struct or a capacity changed in C without memory.go fails here.
func TestMemoryBoundUsesTheObjectsSizes(t *testing.T) {
	spec, err := bpf.LoadBreaker()
	if err != nil {
		t.Fatal(err)
	}
	m := func(name string) *ebpf.MapSpec {
		t.Helper()
		s, ok := spec.Maps[name]
		if !ok {
			t.Fatalf("no map %s in the object", name)
		}
		return s
	}
	round8 := func(n uint32) int { return int(n+7) &^ 7 }
	hashEntry := func(name string) int {
		return htabElem + round8(m(name).KeySize) + round8(m(name).ValueSize) + htabBucket
	}
	array := func(name string) int { return int(m(name).MaxEntries * m(name).ValueSize) }
	for _, c := range []struct {
		name      string
		goValue   int
		objectVal int
	}{
		{"verdictEntry", verdictEntry, hashEntry(bpf.BreakerMapVerdicts)},
		{"limitEntry", limitEntry, hashEntry(bpf.BreakerMapLimits)},
		{"overrideEntry", overrideEntry, hashEntry(bpf.BreakerMapOverrides)},
		{"workloadEntry", workloadEntry, hashEntry(bpf.BreakerMapWorkloads)},
		{"inflightEntry", inflightEntry, hashEntry(bpf.BreakerMapInflight)},
		{"rejectionEntry", rejectionEntry, hashEntry(bpf.BreakerMapRejections)},
		{"handoffBytes", handoffBytes, int(m(bpf.BreakerMapHandoff).ValueSize)},
		{"counterEntry", counterEntry, int(m(bpf.BreakerMapCounters).ValueSize)},
		{"bulkEntry", bulkEntry, int(m(bpf.BreakerMapBulk).ValueSize)},
		{"budgetEntry", budgetEntry, int(m(bpf.BreakerMapProbeBudgets).ValueSize)},
		{"answeredBytes", answeredBytes, array(bpf.BreakerMapAnswered)},
		{"respPortsBytes", respPortsBytes, array(bpf.BreakerMapRespPorts)},
		{"ringBytes", ringBytes, int(m(bpf.BreakerMapEvents).MaxEntries)},
		{"statEntries", statEntries, int(m(bpf.BreakerMapStats).MaxEntries)},
	} {
		if c.goValue != c.objectVal {
			t.Errorf("%s is %d, the object's maps say %d", c.name, c.goValue, c.objectVal)
		}
	}
}
