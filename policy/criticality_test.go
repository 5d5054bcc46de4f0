package policy

import (
	"strings"
	"testing"
)

func TestCriticalityOptions(t *testing.T) {
	c, err := Parse([]byte(`
workloads:
  - {name: web, cgroups: [web], criticality: critical}
  - {name: batch, cgroups: [batch], criticality: sheddable, share: 0.25}
  - {name: jobs, cgroups: [jobs], criticality: sheddable}
  - {name: other, cgroups: [other]}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	cl := c.Classes()
	for _, tc := range []struct {
		name   string
		share  float64
		pooled bool
	}{{"web", 1, true}, {"batch", 0.25, true}, {"jobs", 0.5, true}, {"other", 0, false}} {
		if s, ok := cl.Share(cl.Bulkhead(tc.name)); s != tc.share || ok != tc.pooled {
			t.Errorf("%s: share %v (pooled %v), want %v (%v)", tc.name, s, ok, tc.share, tc.pooled)
		}
	}
	for _, tc := range []struct{ limit, want int }{{20, 5}, {3, 1}, {0, 0}} {
		if got := SharedLimit(tc.limit, 0.25); got != tc.want {
			t.Errorf("a quarter of %d: %d, want %d", tc.limit, got, tc.want)
		}
	}
	if got := SharedLimit(7, 1); got != 7 {
		t.Errorf("critical: %d", got)
	}
}

func TestCriticalityProblems(t *testing.T) {
	got := strings.Join(problems(t, `
workloads:
  - {name: a, cgroups: [a], criticality: vital}
  - {name: b, cgroups: [b], criticality: critical, isolate: true}
  - {name: c, cgroups: [c], criticality: critical, share: 0.5}
  - {name: d, cgroups: [d], criticality: sheddable, share: 1.5}
`), "\n")
	for _, want := range []string{
		"workloads[0].criticality: vital is not critical or sheddable",
		"workloads[1].criticality: needs a workload that shares circuits",
		"workloads[2].share: only a sheddable workload has a share",
		"workloads[3].share: 1.5 is not in (0, 1]",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("problems lack %q:\n%s", want, got)
		}
	}
}
