package policy

import (
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func TestMatchCgroup(t *testing.T) {
	cases := []struct {
		pattern, path string
		want          bool
	}{
		{"system.slice/legacy-*.service", "system.slice/legacy-a.service", true},
		{"system.slice/legacy-*.service", "system.slice/legacy-a.service/sub", false},
		{"system.slice/legacy-*.service", "system.slice/other.service", false},
		{"system.slice/legacy-*.service", "system.slice", false},
		{"kubepods.slice/**", "kubepods.slice", true},
		{"kubepods.slice/**", "kubepods.slice/a/b/c", true},
		{"kubepods.slice/**", "kubepods.slicex/a", false},
		{"**/app", "x/y/app", true},
		{"**/app", "app", true},
		{"**/app", "x/app/y", false},
		{"a/**/b", "a/b", true},
		{"a/**/b", "a/x/y/b", true},
		{"a/**/b", "a/x/y/c", false},
		{"a/?", "a/b", true},
		{"a/[bc]", "a/c", true},
		{"a/[bc]", "a/d", false},
		{"**", "anything/at/all", true},
		{"*", "a/b", false},
	}
	for _, c := range cases {
		if got := MatchCgroup(c.pattern, c.path); got != c.want {
			t.Errorf("MatchCgroup(%q, %q) = %v, want %v", c.pattern, c.path, got, c.want)
		}
	}
}

// MayMatchBelow is true exactly when some longer path below the cgroup
// could match: checked against MatchCgroup on the paths one and two
// elements below.
func TestCgroupMatcherMayMatchBelow(t *testing.T) {
	cases := []struct {
		pattern, path string
		want          bool
	}{
		{"system.slice/legacy-*.service", "system.slice", true},
		{"system.slice/legacy-*.service", "system.slice/legacy-a.service", false},
		{"system.slice/legacy-*.service", "user.slice", false},
		{"system.slice/legacy-*.service", "", true},
		{"a/*/c", "a/b", true},
		{"a/*/c", "a/b/c", false},
		{"a/*/c", "x/b", false},
		{"kubepods.slice/**", "kubepods.slice", true},
		{"kubepods.slice/**", "kubepods.slice/a/b", true},
		{"kubepods.slice/**", "storm-00001", false},
		{"**/app", "storm-00001", true},
	}
	for _, c := range cases {
		m := (&Config{Workloads: []Workload{{Name: "w", Cgroups: []string{c.pattern}}}}).CgroupMatcher()
		if got := m.MayMatchBelow(c.path); got != c.want {
			t.Errorf("MayMatchBelow(%q) under %q = %v, want %v", c.path, c.pattern, got, c.want)
		}
		prefix := c.path + "/"
		if c.path == "" {
			prefix = ""
		}
		for _, below := range []string{"legacy-a.service", "b/c", "c", "app", "x/app"} {
			if MatchCgroup(c.pattern, prefix+below) && !c.want {
				t.Errorf("%q matches %q, below %q, for which MayMatchBelow is false", c.pattern, prefix+below, c.path)
			}
		}
	}
	pods := (&Config{Workloads: []Workload{{Name: "p", Namespaces: []string{"default"}}}}).CgroupMatcher()
	if pods.MayMatchBelow("kubepods.slice") {
		t.Error("a pod-selecting workload without patterns: MayMatchBelow true (pods' cgroups are classified one by one)")
	}
}

func TestWorkloadsDecode(t *testing.T) {
	c, err := Parse([]byte(`
workloads:
  - name: legacy
    cgroups: [system.slice/legacy-*.service]
  - name: tenant-a
    cgroups: [kubepods.slice/a/**]
  - name: tenant-b
    cgroups: [kubepods.slice/b/**]
    isolate: true
  - name: rest
    cgroups: ["**"]
targets:
  pay:
    match: {cidrs: [10.0.0.0/16]}
  pay-a:
    source: [tenant-a]
    match: {cidrs: [10.0.0.0/16]}
    max_connections: 5
  pay-b:
    source: [tenant-b]
    match: {cidrs: [10.0.0.0/16]}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	if !c.Scoped() || len(c.Workloads) != 4 {
		t.Fatalf("workloads: %+v", c.Workloads)
	}
	if w, ok := c.WorkloadOf("kubepods.slice/a/pod1"); !ok || w.Name != "tenant-a" {
		t.Errorf("kubepods.slice/a/pod1 is in %v, want tenant-a", w)
	}
	if w, ok := c.WorkloadOf("user.slice"); !ok || w.Name != "rest" {
		t.Errorf("user.slice is in %v, want rest (first match in list order)", w)
	}
	cl := c.Classes()
	for name, want := range map[string]Class{"legacy": 0, "tenant-a": 2, "tenant-b": 3, "rest": 0} {
		if got := cl.Of(name); got != want {
			t.Errorf("class of %s = %d, want %d", name, got, want)
		}
	}
	if cl.Name(0) != SharedWorkload || cl.Name(2) != "tenant-a" || cl.Name(1) != "" {
		t.Errorf("class names: 0=%q 1=%q 2=%q", cl.Name(0), cl.Name(1), cl.Name(2))
	}
	a := netip.MustParseAddr("10.0.1.1")
	for w, want := range map[string]string{"": "pay", "tenant-a": "pay-a", "tenant-b": "pay-b", "legacy": "pay"} {
		if got, _ := NewWorkloadMatcher(c, w, nil, nil).Match(a, 443, "tcp"); got != want {
			t.Errorf("workload %q: 10.0.1.1 matches %q, want %q", w, got, want)
		}
	}
}

func TestWorkloadsEmptyIsUnscoped(t *testing.T) {
	c, err := Parse([]byte("mode: enforce\n"), false)
	if err != nil {
		t.Fatal(err)
	}
	if c.Scoped() {
		t.Fatal("a configuration without workloads is scoped")
	}
	if cl := c.Classes(); cl.Name(0) != SharedWorkload {
		t.Fatalf("class 0 is %q", cl.Name(0))
	}
}

func TestWorkloadsInvalid(t *testing.T) {
	cases := []struct{ yaml, want string }{
		{"workloads: {a: 1}\n", "workloads: must be a list of workloads"},
		{"workloads:\n  - name: a\n", "workloads[0].cgroups: missing"},
		{"workloads:\n  - cgroups: [x]\n", "workloads[0].name: missing"},
		{"workloads:\n  - name: A\n    cgroups: [x]\n", "workloads[0].name: workload names must match"},
		{"workloads:\n  - name: shared\n    cgroups: [x]\n", `workloads[0].name: "shared" is reserved`},
		{"workloads:\n  - name: a\n    cgroups: [/sys/fs/cgroup/x]\n", "workloads[0].cgroups[0]: \"/sys/fs/cgroup/x\" starts with /"},
		{"workloads:\n  - name: a\n    cgroups: [a//b]\n", "workloads[0].cgroups[0]: \"a//b\" has an empty path element"},
		{"workloads:\n  - name: a\n    cgroups: [a/../b]\n", "has a .. element"},
		{"workloads:\n  - name: a\n    cgroups: [a/x**]\n", "** must be a whole path element"},
		{"workloads:\n  - name: a\n    cgroups: ['a/[b']\n", "is not a valid glob"},
		{"workloads:\n  - name: a\n    cgroups: []\n", "workloads[0].cgroups: empty"},
		{"workloads:\n  - name: a\n    cgroups: [x]\n    isolate: maybe\n", "workloads[0].isolate: maybe is not true or false"},
		{"workloads:\n  - name: a\n    cgroups: [x]\n    cgroup: [y]\n", "workloads[0].cgroup: unknown key (did you mean cgroups?)"},
		{"workloads:\n  - name: a\n    cgroups: [x]\n  - name: a\n    cgroups: [y]\n", `workloads[1].name: "a" is also the name of workloads[0]`},
		{"workloads:\n  - name: a\n    cgroups: [x]\ntargets:\n  t:\n    source: [b]\n    match: {cidrs: [10.0.0.1]}\n", `targets.t.source[0]: "b" is not a workload (did you mean a?)`},
		{"targets:\n  t:\n    source: []\n    match: {cidrs: [10.0.0.1]}\n", "targets.t.source: empty"},
		{"workloads:\n  - name: a\n    cgroups: [x]\ntargets:\n  t:\n    source: [a]\n    match: {cidrs: [10.0.0.1]}\n  u:\n    source: [a]\n    match: {cidrs: [10.0.0.1]}\n", "targets.u.match: matches 10.0.0.1/32 port any as specifically as targets.t"},
		{"targets:\n  t:\n    match: {cidrs: [10.0.0.1]}\n  u:\n    match: {cidrs: [10.0.0.1]}\n", "targets.u.match: matches 10.0.0.1/32 port any as specifically as targets.t"},
	}
	for _, c := range cases {
		_, err := Parse([]byte(c.yaml), false)
		var ve *ValidationError
		if !errors.As(err, &ve) {
			t.Errorf("%q: err %v, want a validation error", c.yaml, err)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q:\n%v\nwant %q", c.yaml, err, c.want)
		}
	}
}

// Targets with disjoint sources may match the same destinations: that is
// how two workloads get different options for one service.
func TestSourcesDisjointMayOverlap(t *testing.T) {
	_, err := Parse([]byte(`
workloads:
  - {name: a, cgroups: [a]}
  - {name: b, cgroups: [b]}
targets:
  ta: {source: [a], match: {cidrs: [10.0.0.1], hosts: [svc.example]}}
  tb: {source: [b], match: {cidrs: [10.0.0.1], hosts: [svc.example]}}
  t:  {match: {cidrs: [10.0.0.1], hosts: [other.example]}}
`), false)
	if err != nil {
		t.Fatal(err)
	}
}

// A cgroup pattern in a source (cgroup:PATTERN) is a workload of its own,
// named by the pattern's hash, the same in every target; it is isolated, is
// matched before the listed workloads, and does not make an unscoped
// configuration scoped.
func TestSourcePatterns(t *testing.T) {
	c, err := Parse([]byte(`
targets:
  p:
    source: ["cgroup:shop/tenant-a/**"]
    match: {cidrs: [10.0.0.1]}
  q:
    source: ["cgroup:shop/tenant-a/**", "cgroup:shop/b"]
    match: {cidrs: [10.0.0.2]}
  all-of-them:
    match: {cidrs: [10.0.0.1]}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	if c.Scoped() || !c.Classed() {
		t.Fatalf("scoped %v, classed %v: want an unscoped configuration with classes", c.Scoped(), c.Classed())
	}
	a, b := SourceWorkload("shop/tenant-a/**"), SourceWorkload("shop/b")
	// The name is part of circuit names and metric labels: it must not
	// change between releases.
	if a != "cgroup.88542360" || a == b {
		t.Fatalf("derived names %s, %s; want cgroup.88542360 for shop/tenant-a/**", a, b)
	}
	if !reflect.DeepEqual(c.Targets["p"].Source, []string{a}) || !reflect.DeepEqual(c.Targets["q"].Source, []string{a, b}) {
		t.Fatalf("sources %v, %v; want [%s] and [%s %s]", c.Targets["p"].Source, c.Targets["q"].Source, a, a, b)
	}
	if len(c.Workloads) != 2 || c.Workloads[0].Name != a || c.Workloads[1].Name != b || c.Workloads[0].Pattern != "shop/tenant-a/**" {
		t.Fatalf("workloads %+v", c.Workloads)
	}
	cl := c.Classes()
	if cl.Of(a) == 0 || cl.Of(b) == 0 || cl.Name(cl.Of(a)) != a {
		t.Fatalf("pattern workloads not isolated: %d %d", cl.Of(a), cl.Of(b))
	}
	if w, ok := c.WorkloadOf("shop/tenant-a/x"); !ok || w.Name != a {
		t.Fatalf("shop/tenant-a/x: %v %v", w, ok)
	}
	if _, ok := c.WorkloadOf("shop/c"); ok {
		t.Fatal("shop/c has a workload")
	}

	// With a list: the pattern wins over a listed workload matching the
	// same cgroup, and the configuration is scoped by the list.
	c, err = Parse([]byte(`
workloads:
  - {name: shop, cgroups: ["shop/**"]}
targets:
  p:
    source: [shop, "cgroup:shop/tenant-a"]
    match: {cidrs: [10.0.0.1]}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	if !c.Scoped() {
		t.Fatal("a configuration with a workloads list is not scoped")
	}
	if w, ok := c.WorkloadOf("shop/tenant-a"); !ok || w.Name != SourceWorkload("shop/tenant-a") {
		t.Fatalf("shop/tenant-a belongs to %v, want the source pattern's workload", w)
	}
	if w, ok := c.WorkloadOf("shop/tenant-b"); !ok || w.Name != "shop" {
		t.Fatalf("shop/tenant-b belongs to %v, want shop", w)
	}

	for _, bad := range []struct{ yaml, want string }{
		{"targets:\n  t:\n    source: [\"cgroup:/abs\"]\n    match: {cidrs: [10.0.0.1]}\n", `targets.t.source[0]: "/abs" starts with /`},
		{"targets:\n  t:\n    source: [\"cgroup:\"]\n    match: {cidrs: [10.0.0.1]}\n", "targets.t.source[0]: empty pattern"},
		{"targets:\n  t:\n    source: [\"cgroup:a/x**\"]\n    match: {cidrs: [10.0.0.1]}\n", "** must be a whole path element"},
		{"targets:\n  t:\n    source: [tenant]\n    match: {cidrs: [10.0.0.1]}\n", `targets.t.source[0]: "tenant" is not a workload`},
	} {
		_, err := Parse([]byte(bad.yaml), false)
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: %v, want %q", bad.yaml, err, bad.want)
		}
	}
}
