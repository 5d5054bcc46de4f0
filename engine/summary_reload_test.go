package engine_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/breakerd/breakerd/maps"
)

const sharedBefore = `
all:
  consecutive_failures: 1
  open_duration: 1m
  jitter: 0
workloads:
  - name: a
    cgroups: [x/a]
  - name: b
    cgroups: [x/b]
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8201-8202"]}
    max_connections: 5
    consecutive_failures: 1
  eps:
    match: {cidrs: [SRV], ports: ["8301-8303"]}
    scope: endpoint
    max_connections: 3
`

// Reloads that reorder the sharing workloads, isolate one, drop one, take
// the limits away, change a scope and remove a target, each followed by
// records: the Summary still says what a walk says, the sharing
// workloads' bulkhead slots included.
func TestSummaryAcrossReloads(t *testing.T) {
	f := newFed(t, sharedBefore, nil)
	for _, p := range []uint16{8201, 8202, 8301, 8302, 7001, 7002} {
		f.refused(p, 1)
	}
	f.e.Publish()
	bulk := 0
	for id := range f.e.Summary().NextID {
		if o, ok := f.e.Summary().Owner(id); ok && o.Bulk {
			bulk++
		}
	}
	if bulk == 0 {
		t.Fatal("no bulkhead slot seated: the reloads would not cover them")
	}
	check := func(what string) {
		t.Helper()
		f.e.Publish()
		if err := summaryMatchesWalk(f.e); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	check("start")
	steps := []struct{ what, yaml string }{
		{"reordered workloads", `
all:
  consecutive_failures: 1
  open_duration: 1m
  jitter: 0
workloads:
  - name: b
    cgroups: [x/b]
  - name: a
    cgroups: [x/a]
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8201-8202"]}
    max_connections: 5
    consecutive_failures: 1
  eps:
    match: {cidrs: [SRV], ports: ["8301-8303"]}
    scope: endpoint
    max_connections: 3
`},
		{"one workload isolated", `
all:
  consecutive_failures: 1
  open_duration: 1m
  jitter: 0
workloads:
  - name: b
    cgroups: [x/b]
    isolate: true
  - name: a
    cgroups: [x/a]
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8201-8202"]}
    max_connections: 5
    consecutive_failures: 1
  eps:
    match: {cidrs: [SRV], ports: ["8301-8303"]}
    scope: endpoint
    max_connections: 3
`},
		{"limits gone, scope changed, target taking dynamic dests", `
all:
  consecutive_failures: 1
  open_duration: 1m
  jitter: 0
workloads:
  - name: a
    cgroups: [x/a]
targets:
  pool:
    match: {cidrs: [SRV], ports: ["8201-8202", "7001"]}
    consecutive_failures: 1
  eps:
    match: {cidrs: [SRV], ports: ["8301-8303"]}
    max_connections: 3
`},
		{"target removed", `
all:
  consecutive_failures: 1
  open_duration: 1m
  jitter: 0
targets:
  eps:
    match: {cidrs: [SRV], ports: ["8301-8303"]}
    max_connections: 3
`},
	}
	for _, s := range steps {
		f.reload(s.yaml)
		check(s.what)
		for _, p := range []uint16{8201, 8301, 7002, 7003} {
			f.refused(p, 1)
		}
		f.tick()
		check(s.what + ", then records")
	}
}

// A batch of one failure that opens a new dynamic circuit (a failure
// wakes the reader at once, so it is the failure path's batch) and the
// Publish after it allocate a few KiB: a new id's owner costs a copy of
// its chunk of the owners table, not of the table.
func TestPublishCostsLittlePerOpening(t *testing.T) {
	f := newFed(t, `
max_circuits: 100000
all:
  consecutive_failures: 1
  open_duration: 1m
  jitter: 0
`, nil)
	const n = 4000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range n {
		f.e.HandleBatch([]maps.Event{{Outcome: maps.Refused, Dest: dest(uint16(10000 + i)), Duration: time.Millisecond, Cookie: uint64(i + 1)}}, f.clk.Now())
		f.e.Publish()
	}
	runtime.ReadMemStats(&after)
	if per := float64(after.TotalAlloc-before.TotalAlloc) / n; per > 16<<10 {
		t.Fatalf("a batch that opens one circuit, and its Publish, allocate %.0f bytes, want under 16 KiB", per)
	}
}
