package policy

import (
	"net/netip"
	"sort"
)

// Specificity ranks how closely a match entry names a destination: a
// longer prefix wins; at equal prefix length an exact port beats a range,
// which beats any port.
type specificity struct {
	bits     int
	portRank int // 2 exact, 1 range, 0 any
}

func (s specificity) less(o specificity) bool {
	if s.bits != o.bits {
		return s.bits < o.bits
	}
	return s.portRank < o.portRank
}

type entry struct {
	target string // "" for an exclude entry
	prefix netip.Prefix
	ports  PortRange // {0,0} for any
	proto  string
	spec   specificity
}

func (e entry) covers(a netip.Addr, port uint16, proto string) bool {
	if e.proto != "any" && e.proto != proto {
		return false
	}
	if e.ports != (PortRange{}) && (port < e.ports.Lo || port > e.ports.Hi) {
		return false
	}
	return e.prefix.Contains(a)
}

func entries(name string, m Match, resolved map[string][]netip.Addr) []entry {
	prefixes := append([]netip.Prefix(nil), m.Prefixes...)
	for _, h := range m.Hosts {
		for _, a := range resolved[h] {
			a = a.Unmap()
			prefixes = append(prefixes, netip.PrefixFrom(a, a.BitLen()))
		}
	}
	var out []entry
	ports := m.Ports
	if len(ports) == 0 {
		ports = []PortRange{{}}
	}
	for _, p := range prefixes {
		bits := p.Bits()
		if p.Addr().Is4() {
			bits += 96 // rank IPv4 prefixes as their IPv4-mapped form
		}
		for _, pr := range ports {
			rank := 0
			switch {
			case pr == (PortRange{}):
			case pr.Lo == pr.Hi:
				rank = 2
			default:
				rank = 1
			}
			out = append(out, entry{target: name, prefix: p, ports: pr, proto: m.Proto, spec: specificity{bits, rank}})
		}
	}
	return out
}

// Matcher maps destinations to targets: exclude wins, then the most
// specific target entry; a destination no target names belongs to `all`.
type Matcher struct {
	exclude []entry
	targets []entry // most specific first
}

// NewMatcher builds the matcher of c, with the addresses that the host
// names of targets and excludes currently resolve to (by host name).
func NewMatcher(c *Config, resolved map[string][]netip.Addr) *Matcher {
	m := &Matcher{}
	for _, ex := range c.Exclude {
		m.exclude = append(m.exclude, entries("", ex, resolved)...)
	}
	for _, name := range sortedTargetNames(c) {
		m.targets = append(m.targets, entries(name, c.Targets[name].Match, resolved)...)
	}
	sort.SliceStable(m.targets, func(i, j int) bool { return m.targets[j].spec.less(m.targets[i].spec) })
	return m
}

// Match returns the target that a destination belongs to ("" for `all`),
// and whether it is excluded from protection. proto is "tcp" or "udp".
func (m *Matcher) Match(a netip.Addr, port uint16, proto string) (target string, excluded bool) {
	a = a.Unmap()
	for _, e := range m.exclude {
		if e.covers(a, port, proto) {
			return "", true
		}
	}
	for _, e := range m.targets {
		if e.covers(a, port, proto) {
			return e.target, false
		}
	}
	return "", false
}

func sortedTargetNames(c *Config) []string {
	names := make([]string, 0, len(c.Targets))
	for n := range c.Targets {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func portsOverlap(a, b PortRange) bool {
	if a == (PortRange{}) || b == (PortRange{}) {
		return true
	}
	return a.Lo <= b.Hi && b.Lo <= a.Hi
}

func protosOverlap(a, b string) bool { return a == "any" || b == "any" || a == b }

// overlaps reports two targets that match some destination equally
// specifically, and host names claimed by two targets.
func (d *decoder) overlaps(c *Config) {
	names := sortedTargetNames(c)
	seen := map[string]bool{}
	hostOwner := map[string]string{}
	for i, a := range names {
		for _, h := range c.Targets[a].Match.Hosts {
			if o, ok := hostOwner[h]; ok && o != a {
				d.add("targets."+a+".match.hosts", "host %s is also matched by targets.%s", h, o)
			}
			hostOwner[h] = a
		}
		ea := entries(a, c.Targets[a].Match, nil)
		for _, b := range names[i+1:] {
			for _, x := range ea {
				for _, y := range entries(b, c.Targets[b].Match, nil) {
					if x.spec != y.spec || !x.prefix.Overlaps(y.prefix) || !portsOverlap(x.ports, y.ports) || !protosOverlap(x.proto, y.proto) {
						continue
					}
					key := a + "|" + b
					if seen[key] {
						continue
					}
					seen[key] = true
					d.add("targets."+b+".match", "matches %s port %s as specifically as targets.%s; make one more specific", x.prefix, portText(x.ports), a)
				}
			}
		}
	}
}

func portText(p PortRange) string {
	if p == (PortRange{}) {
		return "any"
	}
	return p.String()
}
