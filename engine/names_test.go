package engine

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/breakerd/breakerd/engine/enginetest"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// A dynamic circuit's name reads back into its destination (its class
// aside), and only its one spelling does.
func TestDynamicNamesReadBack(t *testing.T) {
	for _, d := range []maps.Dest{
		{Proto: maps.TCP, Addr: netip.MustParseAddrPort("192.0.2.1:443")},
		{Proto: maps.UDP, Addr: netip.MustParseAddrPort("[2001:db8::1]:53")},
		{Proto: maps.TCP, Addr: netip.MustParseAddrPort("10.1.2.3:8080"), Class: 3},
	} {
		name := DynamicName(d)
		got, ok := ParseDynamicName(name)
		want := d
		want.Class = 0
		if !ok || got != want {
			t.Fatalf("%s reads back as %v (%v), want %v", name, got, ok, want)
		}
	}
	for _, name := range []string{"tcp/[::ffff:192.0.2.1]:443", "TCP/192.0.2.1:443", "sctp/192.0.2.1:1", "192.0.2.1:443", "tcp/192.0.2.1", "tcp/192.0.2.01:443", "web"} {
		if d, ok := ParseDynamicName(name); ok {
			t.Fatalf("%q read as the dynamic circuit of %v", name, d)
		}
	}
	if got := Classed("web", policy.SharedWorkload); got != "web" {
		t.Fatalf("shared: %s", got)
	}
	if got := Classed(EndpointName("pay", maps.Dest{Addr: netip.MustParseAddrPort("192.0.2.1:80")}), "billing"); got != "pay/192.0.2.1:80@billing" {
		t.Fatalf("isolated endpoint: %s", got)
	}
}

// A target's enumerable destinations are its single addresses and
// resolved hosts times its ports of ranges up to 256, for each of its
// protocols; wider prefixes and ranges are left to traffic.
func TestStaticDests(t *testing.T) {
	cfg, err := policy.Parse([]byte(`
targets:
  x:
    match: {cidrs: [192.0.2.1/32, 198.51.100.0/24], hosts: [db.example], ports: ["80-81", "1000-2000"], protocol: any}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	db := netip.MustParseAddr("203.0.113.7")
	got := StaticDests(cfg.Targets["x"], map[string][]netip.Addr{"db.example": {db}})
	var names []string
	for _, d := range got {
		names = append(names, DynamicName(d))
	}
	slices.Sort(names)
	want := []string{"tcp/192.0.2.1:80", "tcp/192.0.2.1:81", "tcp/203.0.113.7:80", "tcp/203.0.113.7:81",
		"udp/192.0.2.1:80", "udp/192.0.2.1:81", "udp/203.0.113.7:80", "udp/203.0.113.7:81"}
	if !slices.Equal(names, want) {
		t.Fatalf("static destinations %v, want %v", names, want)
	}
}

// Overrides kept by a previous daemon are found by name; keeping one
// writes it to the kernel, and NoOverride forgets it there too.
func TestOverridesFollowTheKernel(t *testing.T) {
	k := enginetest.NewKernel()
	if err := k.PutOverride("web", maps.OverrideDisabled); err != nil {
		t.Fatal(err)
	}
	o := LoadOverrides(k)
	if ov, ok := o.Get("web"); !ok || ov != policy.DisableState {
		t.Fatalf("loaded: %v %v, want disabled", ov, ok)
	}
	if _, ok := o.Get("db"); ok {
		t.Fatal("an override for a circuit that has none")
	}
	if err := o.Keep("db", policy.ForceOpen); err != nil {
		t.Fatal(err)
	}
	if ov, ok := o.Get("db"); !ok || ov != policy.ForceOpen {
		t.Fatalf("kept: %v %v", ov, ok)
	}
	if err := o.Keep("web", policy.NoOverride); err != nil {
		t.Fatal(err)
	}
	again := LoadOverrides(k)
	if _, ok := again.Get("web"); ok {
		t.Fatal("forgotten override still in the kernel")
	}
	if ov, ok := again.Get("db"); !ok || ov != policy.ForceOpen {
		t.Fatalf("after a restart: %v %v, want forced open", ov, ok)
	}
}
