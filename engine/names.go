package engine

import (
	"net/netip"
	"strings"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// DynamicName is the name of the dynamic circuit of destination d (that
// of `all`): tcp/addr:port or udp/addr:port, whatever d's class.
func DynamicName(d maps.Dest) string { return d.Shared().String() }

// ParseDynamicName reads a dynamic circuit's name (tcp/addr:port,
// udp/addr:port) back into its destination; false for any other string,
// including one that names it in another spelling.
func ParseDynamicName(name string) (maps.Dest, bool) {
	proto, addr, ok := strings.Cut(name, "/")
	if !ok {
		return maps.Dest{}, false
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return maps.Dest{}, false
	}
	d := maps.Dest{Addr: netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())}
	switch proto {
	case "tcp":
		d.Proto = maps.TCP
	case "udp":
		d.Proto = maps.UDP
	default:
		return maps.Dest{}, false
	}
	return d, DynamicName(d) == name
}

// EndpointName is the name of the circuit of endpoint d of an
// endpoint-scoped target: target/addr:port.
func EndpointName(target string, d maps.Dest) string { return target + "/" + d.Addr.String() }

// Classed names the circuit of an isolated workload: name@workload (name
// itself for the shared one).
func Classed(name, workload string) string {
	if workload == policy.SharedWorkload {
		return name
	}
	return name + "@" + workload
}

// StaticDests lists the destinations a named target covers that can be
// enumerated: full-length prefixes (single addresses) and resolved host
// names, times explicit ports (ranges up to 256 ports). Wider CIDRs and
// "any port" are covered as destinations are seen.
func StaticDests(t *policy.Target, resolved map[string][]netip.Addr) []maps.Dest {
	var addrs []netip.Addr
	for _, p := range t.Match.Prefixes {
		if p.IsSingleIP() {
			addrs = append(addrs, p.Addr())
		}
	}
	for _, h := range t.Match.Hosts {
		addrs = append(addrs, resolved[h]...)
	}
	var ports []uint16
	for _, pr := range t.Match.Ports {
		if int(pr.Hi)-int(pr.Lo) > 255 {
			continue
		}
		for p := int(pr.Lo); p <= int(pr.Hi); p++ {
			ports = append(ports, uint16(p))
		}
	}
	var protos []maps.Proto
	switch t.Match.Proto {
	case "udp":
		protos = []maps.Proto{maps.UDP}
	case "any":
		protos = []maps.Proto{maps.TCP, maps.UDP}
	default:
		protos = []maps.Proto{maps.TCP}
	}
	var out []maps.Dest
	for _, a := range addrs {
		for _, p := range ports {
			for _, pr := range protos {
				out = append(out, maps.Dest{Proto: pr, Addr: netip.AddrPortFrom(a.Unmap(), p)})
			}
		}
	}
	return out
}
