package policy

import (
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
