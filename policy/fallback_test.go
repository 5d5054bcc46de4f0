package policy

import (
	"net/netip"
	"slices"
	"testing"
)

func TestFallbackParses(t *testing.T) {
	c, err := Parse([]byte(`
targets:
  pay:
    match: {cidrs: [10.0.0.0/24], ports: ["443"]}
    fallback: 10.1.0.9:8443
  pay6:
    match: {cidrs: ["2001:db8::/64"]}
    fallback: "[2001:db8:1::9]:80"
  house:
    match: {cidrs: [10.1.0.9]}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := c.Targets["pay"].Options.Fallback, netip.MustParseAddrPort("10.1.0.9:8443"); got != want {
		t.Fatalf("fallback %v, want %v", got, want)
	}
	if got, want := c.Targets["pay6"].Options.Fallback, netip.MustParseAddrPort("[2001:db8:1::9]:80"); got != want {
		t.Fatalf("fallback %v, want %v", got, want)
	}
	if c.Targets["house"].Options.HasFallback() || c.All.HasFallback() {
		t.Fatal("a fallback where none is set")
	}
	// A changed fallback is a changed target (a reload rewrites it).
	next, err := Parse([]byte(`
targets:
  pay:
    match: {cidrs: [10.0.0.0/24], ports: ["443"]}
    fallback: 10.1.0.10:8443
  pay6:
    match: {cidrs: ["2001:db8::/64"]}
    fallback: "[2001:db8:1::9]:80"
  house:
    match: {cidrs: [10.1.0.9]}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	if ch := Diff(c, next); !slices.Equal(ch.Changed, []string{"pay"}) {
		t.Fatalf("changed %v, want [pay]", ch.Changed)
	}
}

func TestFallbackRefusals(t *testing.T) {
	for _, tc := range []struct{ name, yaml, want string }{
		{"not an address", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: house.example:80}\n",
			`targets.a.fallback: "house.example:80" is not ADDRESS:PORT (an IP address and a port: 10.0.0.9:8080, [2001:db8::9]:8080)`},
		{"no port", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: 10.0.0.9}\n",
			`targets.a.fallback: "10.0.0.9" is not ADDRESS:PORT (an IP address and a port: 10.0.0.9:8080, [2001:db8::9]:8080)`},
		{"port 0", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: \"10.0.0.9:0\"}\n",
			`targets.a.fallback: "10.0.0.9:0" has port 0`},
		{"unspecified", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: \"0.0.0.0:80\"}\n",
			`targets.a.fallback: "0.0.0.0:80" is not an address a connect can reach`},
		{"link-local", "targets:\n  a: {match: {cidrs: [\"2001:db8::1\"]}, fallback: \"[fe80::9]:80\"}\n",
			`targets.a.fallback: "[fe80::9]:80" is link-local: a connect to it needs an interface, which a redirected connect cannot name`},
		{"in all", "all: {fallback: \"10.0.0.9:80\"}\n",
			`all.fallback: only a target can set it (every destination of ` + "`all`" + ` would share one fallback); set it on the targets that have one`},
		{"into its own target", "targets:\n  a: {match: {cidrs: [10.0.0.0/24]}, fallback: \"10.0.0.9:80\"}\n",
			`targets.a.fallback: 10.0.0.9:80 is a destination of this target: a fallback must lead elsewhere`},
		{"chains", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: \"10.0.1.9:80\"}\n  b: {match: {cidrs: [10.0.1.9]}, fallback: \"10.0.2.9:80\"}\n",
			`targets.a.fallback: 10.0.1.9:80 is target b's, which has a fallback itself: fallbacks never chain`},
		{"other family", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: \"[2001:db8::9]:80\"}\n",
			`targets.a.fallback: [2001:db8::9]:80 is IPv6, but the target names 10.0.0.1/32: a connect is never sent to another address family`},
		{"protocol", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: \"10.0.1.9:53\"}\n  dns: {match: {cidrs: [10.0.1.9], protocol: udp}}\n",
			`targets.a.fallback: 10.0.1.9:53 is target dns's for udp only, but this target's connects are tcp: the fallback's protocol must match its target's`},
		{"excluded", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: \"10.0.1.9:80\"}\nexclude:\n  - {cidrs: [10.0.1.0/24]}\n",
			`targets.a.fallback: 10.0.1.9:80 is excluded (tcp): a fallback needs a circuit of its own`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := problems(t, tc.yaml)
			if !slices.Contains(got, tc.want) {
				t.Fatalf("problems %q, want %q", got, tc.want)
			}
		})
	}
}

// TestFallbackToAnotherTargetIsFine: a fallback that is another target's
// destination (one without a fallback) of the same protocol, or a
// destination of `all`, is valid.
func TestFallbackToAnotherTargetIsFine(t *testing.T) {
	for _, yaml := range []string{
		"targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: \"10.0.1.9:80\"}\n  b: {match: {cidrs: [10.0.1.9]}}\n",
		"targets:\n  a: {match: {cidrs: [10.0.0.1], protocol: any}, fallback: \"10.0.1.9:53\"}\n  b: {match: {cidrs: [10.0.1.9], protocol: any}}\n",
		"targets:\n  a: {match: {cidrs: [10.0.0.1], ports: [\"80\"]}, fallback: \"10.0.0.1:81\"}\n",
		"targets:\n  a: {match: {hosts: [pay.example]}, fallback: \"10.0.1.9:80\"}\n",
	} {
		if _, err := Parse([]byte(yaml), false); err != nil {
			t.Errorf("%s: %v", yaml, err)
		}
	}
}

func TestServiceFallbackParses(t *testing.T) {
	c, err := Parse([]byte(`
targets:
  pay:
    match: {cidrs: [10.0.0.0/24]}
    fallback: {service: shop/house-ads, port: 8080}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	o := c.Targets["pay"].Options
	if o.FallbackService != (ServiceFallback{"shop/house-ads", 8080}) || o.Fallback.IsValid() || !o.HasFallback() || o.FallbackText() != "shop/house-ads:8080" {
		t.Fatalf("options %+v", o)
	}
}

func TestServiceFallbackRefusals(t *testing.T) {
	for _, tc := range []struct{ name, yaml, want string }{
		{"no port", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: {service: shop/house}}\n",
			`targets.a.fallback: a Service fallback needs port: one of the Service's port numbers`},
		{"bad service", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: {service: house, port: 80}}\n",
			`targets.a.fallback: "house" is not NAMESPACE/NAME`},
		{"unknown key", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: {service: shop/house, port: 80, ports: [80]}}\n",
			`targets.a.fallback: unknown key "ports" (a Service fallback takes service and port)`},
		{"its own Service", "targets:\n  a: {match: {service: shop/house}, fallback: {service: shop/house, port: 80}}\n",
			`targets.a.fallback: service shop/house is this target's own: a fallback must lead elsewhere`},
		{"chains", "targets:\n  a: {match: {cidrs: [10.0.0.1]}, fallback: {service: shop/house, port: 80}}\n  b: {match: {service: shop/house}, fallback: \"10.0.2.9:80\"}\n",
			`targets.a.fallback: service shop/house is target b's, which has a fallback itself: fallbacks never chain`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := problems(t, tc.yaml)
			if !slices.Contains(got, tc.want) {
				t.Fatalf("problems %q, want %q", got, tc.want)
			}
		})
	}
}
