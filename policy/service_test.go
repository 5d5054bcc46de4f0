package policy

import (
	"maps"
	"net/netip"
	"slices"
	"testing"
)

func TestServiceMatchParses(t *testing.T) {
	c, err := Parse([]byte(`
targets:
  pay:
    match: {service: shop/payments, ports: [http, "8443"], protocol: any}
    scope: endpoint
`), false)
	if err != nil {
		t.Fatal(err)
	}
	m := c.Targets["pay"].Match
	if m.Service != "shop/payments" || !slices.Equal(m.PortNames, []string{"http"}) || !slices.Equal(m.Ports, []PortRange{{8443, 8443}}) || m.Proto != "any" {
		t.Fatalf("match %+v", m)
	}
}

func TestServiceMatchRefusals(t *testing.T) {
	for _, tc := range []struct{ name, yaml, want string }{
		{"no slash", "targets:\n  a: {match: {service: payments}}\n", `targets.a.match.service: "payments" is not NAMESPACE/NAME`},
		{"two slashes", "targets:\n  a: {match: {service: a/b/c}}\n", `targets.a.match.service: "a/b/c" is not NAMESPACE/NAME`},
		{"bad namespace", "targets:\n  a: {match: {service: Shop/pay}}\n", `targets.a.match.service: namespace "Shop" is not a DNS-1123 label (lowercase letters, digits, '-', at most 63)`},
		{"bad name", "targets:\n  a: {match: {service: shop/1pay}}\n", `targets.a.match.service: service name "1pay" is not a DNS-1035 label (a lowercase letter, then letters, digits, '-', at most 63)`},
		{"not a string", "targets:\n  a: {match: {service: [shop/pay]}}\n", `targets.a.match.service: must be NAMESPACE/NAME`},
		{"with cidrs", "targets:\n  a: {match: {service: shop/pay, cidrs: [10.0.0.1]}}\n", `targets.a.match.service: a service match names no cidrs or hosts (the Service's addresses come from the API)`},
		{"range", "targets:\n  a: {match: {service: shop/pay, ports: [80-90]}}\n", `targets.a.match.ports[0]: "80-90" is not a Service port number (1-65535) or port name`},
		{"bad port name", "targets:\n  a: {match: {service: shop/pay, ports: [Http_1]}}\n", `targets.a.match.ports[0]: "Http_1" is not a Service port number (1-65535) or port name`},
		{"port name without service", "targets:\n  a: {match: {cidrs: [10.0.0.1], ports: [http]}}\n", `targets.a.match.ports[0]: "http" is not a port (1-65535) or a range like 8000-8100`},
		{"in exclude", "exclude:\n  - {service: shop/pay}\n", `exclude[0].service: an exclude takes cidrs and hosts, not a service`},
		{"twice", "targets:\n  a: {match: {service: shop/pay}}\n  b: {match: {service: shop/pay}}\n", `targets.b.match.service: service shop/pay is also matched by targets.a`},
		{"empty match", "targets:\n  a: {match: {ports: [\"80\"]}}\n", `targets.a.match: names no cidrs, hosts or service`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := problems(t, tc.yaml)
			if !slices.Contains(got, tc.want) {
				t.Fatalf("problems %q, want %q", got, tc.want)
			}
		})
	}
}

// TestMatcherWithServices: a Service target's resolved destinations match
// exactly (address, port, protocol), and nothing else of the address.
func TestMatcherWithServices(t *testing.T) {
	c, err := Parse([]byte(`
targets:
  pay:
    match: {service: shop/pay}
  net:
    match: {cidrs: [10.1.0.0/16]}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	m := NewMatcherWithServices(c, nil, map[string][]ServiceDest{"pay": {
		{Addr: netip.MustParseAddrPort("10.96.0.10:80"), Proto: "tcp"},
		{Addr: netip.MustParseAddrPort("10.1.2.3:8080"), Proto: "tcp"},
	}})
	for _, tc := range []struct {
		addr  string
		port  uint16
		proto string
		want  string
	}{
		{"10.96.0.10", 80, "tcp", "pay"},
		{"10.96.0.10", 81, "tcp", ""},
		{"10.96.0.10", 80, "udp", ""},
		{"10.1.2.3", 8080, "tcp", "pay"}, // more specific than the /16
		{"10.1.2.3", 8081, "tcp", "net"},
	} {
		if got, _ := m.Match(netip.MustParseAddr(tc.addr), tc.port, tc.proto); got != tc.want {
			t.Errorf("%s:%d/%s matched %q, want %q", tc.addr, tc.port, tc.proto, got, tc.want)
		}
	}
	// Unresolved: nothing matches it.
	m = NewMatcher(c, nil)
	if got, _ := m.Match(netip.MustParseAddr("10.96.0.10"), 80, "tcp"); got != "" {
		t.Errorf("unresolved Service matched %q", got)
	}
}

func TestPodWorkloadsParse(t *testing.T) {
	c, err := Parse([]byte(`
workloads:
  - name: shop
    namespaces: [shop, shop-canary]
    pod_labels: ["app.kubernetes.io/name=web", "tier=front"]
  - name: legacy
    cgroups: [system.slice/legacy.service]
`), false)
	if err != nil {
		t.Fatal(err)
	}
	w := c.Workloads[0]
	if !w.Kubernetes() || !slices.Equal(w.Namespaces, []string{"shop", "shop-canary"}) || w.PodLabels["app.kubernetes.io/name"] != "web" || w.PodLabels["tier"] != "front" {
		t.Fatalf("workload %+v", w)
	}
	if c.Workloads[1].Kubernetes() {
		t.Fatal("a cgroup workload selects pods")
	}
	// The mapping form, as matchLabels is written: keys with '/' and '.'
	// kept as written.
	m, err := Parse([]byte(`
workloads:
  - name: shop
    pod_labels:
      app.kubernetes.io/name: web
      tier: front
  - name: flow
    pod_labels: {example.com/team: pay}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(m.Workloads[0].PodLabels, w.PodLabels) || m.Workloads[1].PodLabels["example.com/team"] != "pay" || len(m.Workloads[1].PodLabels) != 1 {
		t.Fatalf("mapping form: %+v and %+v, want %v", m.Workloads[0].PodLabels, m.Workloads[1].PodLabels, w.PodLabels)
	}
	// Order: the first workload whose pattern or pod selection matches.
	if got, _ := c.WorkloadOfPod("system.slice/legacy.service", func(string) bool { return true }); got.Name != "shop" {
		t.Fatalf("first match %s, want shop (selected pod)", got.Name)
	}
	if got, _ := c.WorkloadOfPod("system.slice/legacy.service", func(string) bool { return false }); got.Name != "legacy" {
		t.Fatalf("pattern match %s, want legacy", got.Name)
	}
	if _, ok := c.WorkloadOfPod("user.slice", func(string) bool { return false }); ok {
		t.Fatal("matched nothing's cgroup")
	}
}

func TestPodWorkloadsRefusals(t *testing.T) {
	for _, tc := range []struct{ name, yaml, want string }{
		{"bad namespace", "workloads:\n  - {name: a, namespaces: [Shop]}\n", `workloads[0].namespaces[0]: "Shop" is not a namespace name (a DNS-1123 label)`},
		{"not key=value", "workloads:\n  - {name: a, pod_labels: [web]}\n", `workloads[0].pod_labels[0]: "web" is not KEY=VALUE`},
		{"bad key", "workloads:\n  - {name: a, pod_labels: [\"-x=1\"]}\n", `workloads[0].pod_labels[0]: label key "-x" is not a label name (alphanumerics, '-', '_', '.', at most 63)`},
		{"bad value", "workloads:\n  - {name: a, pod_labels: [\"app=we b\"]}\n", `workloads[0].pod_labels[0]: label value "we b" is not a label value (alphanumerics, '-', '_', '.', at most 63)`},
		{"bad prefix", "workloads:\n  - {name: a, pod_labels: [\"Ex.com/app=web\"]}\n", `workloads[0].pod_labels[0]: label key prefix "Ex.com" is not a DNS subdomain`},
		{"map: bad key", "workloads:\n  - name: a\n    pod_labels: {Ex.com/app: web}\n", `workloads[0].pod_labels.Ex.com/app: label key prefix "Ex.com" is not a DNS subdomain`},
		{"map: bad value", "workloads:\n  - name: a\n    pod_labels:\n      app.kubernetes.io/name: we b\n", `workloads[0].pod_labels.app.kubernetes.io/name: label value "we b" is not a label value (alphanumerics, '-', '_', '.', at most 63)`},
		{"map: number", "workloads:\n  - name: a\n    pod_labels: {version: 1}\n", `workloads[0].pod_labels.version: 1 is not a string: quote a label value that YAML reads as a number or a boolean ("1", "true")`},
		{"map: nested", "workloads:\n  - name: a\n    pod_labels: {app: {x: y}}\n", `workloads[0].pod_labels.app: must be a label value (a string), not a mapping or a list`},
		{"map: duplicate", "workloads:\n  - name: a\n    pod_labels:\n      app: web\n      app: db\n", `workloads[0].pod_labels.app: duplicate key (first at line 4)`},
		{"nothing selects", "workloads:\n  - {name: a}\n", `workloads[0].cgroups: missing: a workload needs at least one cgroup pattern, or namespaces or pod_labels`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := problems(t, tc.yaml); !slices.Contains(got, tc.want) {
				t.Fatalf("problems %q, want %q", got, tc.want)
			}
		})
	}
}
