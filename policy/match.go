package policy

import (
	"net/netip"
	"slices"
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
//
// It is a longest-prefix lookup: entries are indexed by their masked
// prefix, in one table per prefix length and address family, and a lookup
// probes the lengths present from the longest down (at most 33 for IPv4,
// 129 for IPv6), so its cost does not grow with the number of targets or
// excludes.
type Matcher struct {
	exclude prefixIndex
	targets prefixIndex
}

// prefixIndex holds entries by masked prefix, one map per prefix length.
type prefixIndex struct {
	byPrefix map[netip.Prefix][]entry // entries of a node: best (port rank, then name) first
	lens4    []int                    // IPv4 prefix lengths present, longest first
	lens6    []int                    // IPv6 prefix lengths present, longest first
}

func (x *prefixIndex) add(e entry) {
	if x.byPrefix == nil {
		x.byPrefix = map[netip.Prefix][]entry{}
	}
	p := e.prefix.Masked()
	if _, ok := x.byPrefix[p]; !ok {
		if p.Addr().Is4() {
			x.lens4 = insertLen(x.lens4, p.Bits())
		} else {
			x.lens6 = insertLen(x.lens6, p.Bits())
		}
	}
	x.byPrefix[p] = append(x.byPrefix[p], e)
}

func insertLen(lens []int, n int) []int {
	i := sort.Search(len(lens), func(i int) bool { return lens[i] <= n })
	if i < len(lens) && lens[i] == n {
		return lens
	}
	return slices.Insert(lens, i, n)
}

// finish orders each node's entries: exact port, then range, then any
// port; at equal rank, by target name (the order NewMatcher adds them).
func (x *prefixIndex) finish() {
	for _, es := range x.byPrefix {
		sort.SliceStable(es, func(i, j int) bool { return es[i].spec.portRank > es[j].spec.portRank })
	}
}

// lookup returns the most specific entry covering the destination.
func (x *prefixIndex) lookup(a netip.Addr, port uint16, proto string) (entry, bool) {
	lens := x.lens6
	if a.Is4() {
		lens = x.lens4
	}
	for _, n := range lens {
		p, err := a.Prefix(n)
		if err != nil {
			continue
		}
		for _, e := range x.byPrefix[p] {
			if e.covers(a, port, proto) {
				return e, true
			}
		}
	}
	return entry{}, false
}

// NewMatcher builds the matcher of c for the shared class (targets
// without a source), with the addresses that the host names of targets and
// excludes currently resolve to (by host name).
func NewMatcher(c *Config, resolved map[string][]netip.Addr) *Matcher {
	return NewMatcherWithServices(c, resolved, nil)
}

// serviceEntries are the exact address:port entries of a Service target,
// from what its Service currently resolves to.
func serviceEntries(name string, dests []ServiceDest) []entry {
	out := make([]entry, 0, len(dests))
	for _, d := range dests {
		a := d.Addr.Addr().Unmap()
		bits := a.BitLen()
		rank := bits
		if a.Is4() {
			rank += 96
		}
		out = append(out, entry{target: name, prefix: netip.PrefixFrom(a, bits), ports: PortRange{d.Addr.Port(), d.Addr.Port()},
			proto: d.Proto, spec: specificity{rank, 2}})
	}
	return out
}

// NewMatcherWithServices is NewMatcher with the destinations each Service
// target currently resolves to (by target name): exact address and port
// entries, as specific as a single address with an exact port.
func NewMatcherWithServices(c *Config, resolved map[string][]netip.Addr, services map[string][]ServiceDest) *Matcher {
	return NewWorkloadMatcher(c, "", resolved, services)
}

// NewWorkloadMatcher builds the matcher of c for the workload named w (""
// for the shared class): the targets whose source names w, then those
// without a source. At equal specificity a target with a source wins.
func NewWorkloadMatcher(c *Config, w string, resolved map[string][]netip.Addr, services map[string][]ServiceDest) *Matcher {
	m := &Matcher{}
	for _, ex := range c.Exclude {
		for _, e := range entries("", ex, resolved) {
			m.exclude.add(e)
		}
	}
	add := func(name string, t *Target) {
		for _, e := range entries(name, t.Match, resolved) {
			m.targets.add(e)
		}
		if t.Match.Service != "" {
			for _, e := range serviceEntries(name, services[name]) {
				m.targets.add(e)
			}
		}
	}
	if w != "" {
		for _, name := range sortedTargetNames(c) {
			if t := c.Targets[name]; len(t.Source) > 0 && t.appliesTo(w) {
				add(name, t)
			}
		}
	}
	for _, name := range sortedTargetNames(c) {
		if t := c.Targets[name]; len(t.Source) == 0 {
			add(name, t)
		}
	}
	m.exclude.finish()
	m.targets.finish()
	return m
}

// Match returns the target that a destination belongs to ("" for `all`),
// and whether it is excluded from protection. proto is "tcp" or "udp".
func (m *Matcher) Match(a netip.Addr, port uint16, proto string) (target string, excluded bool) {
	a = a.Unmap()
	if _, ok := m.exclude.lookup(a, port, proto); ok {
		return "", true
	}
	if e, ok := m.targets.lookup(a, port, proto); ok {
		return e.target, false
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
// specifically for one workload, and host names claimed by two such
// targets. Targets without a source are checked together; so are, for each
// workload, the targets whose source names it (they win over those without
// for that workload, so the two sets never conflict). Entries of equal
// specificity overlap only at the same masked prefix, so entries are
// grouped by prefix and port rank, and each group is checked in one sweep
// over its ports: O(n log n) in the number of entries, not quadratic.
func (d *decoder) overlaps(c *Config) {
	seen := map[[2]string]bool{}
	var shared []string
	bySource := map[string][]string{}
	for _, name := range sortedTargetNames(c) {
		src := c.Targets[name].Source
		if len(src) == 0 {
			shared = append(shared, name)
		}
		for _, w := range src {
			if !contains(bySource[w], name) {
				bySource[w] = append(bySource[w], name)
			}
		}
	}
	d.overlapsAmong(c, shared, seen)
	for _, w := range c.Workloads {
		d.overlapsAmong(c, bySource[w.Name], seen)
	}
}

func contains(list []string, s string) bool {
	for _, e := range list {
		if e == s {
			return true
		}
	}
	return false
}

func (d *decoder) overlapsAmong(c *Config, names []string, seen map[[2]string]bool) {
	hostOwner := map[string]string{}
	serviceOwner := map[string]string{}
	type groupKey struct {
		prefix netip.Prefix
		rank   int
	}
	groups := map[groupKey][]entry{}
	for _, a := range names {
		for _, h := range c.Targets[a].Match.Hosts {
			if o, ok := hostOwner[h]; ok && o != a && !seen[[2]string{o, a}] {
				seen[[2]string{o, a}] = true
				d.add("targets."+a+".match.hosts", "host %s is also matched by targets.%s", h, o)
			}
			hostOwner[h] = a
		}
		if sv := c.Targets[a].Match.Service; sv != "" {
			if o, ok := serviceOwner[sv]; ok {
				d.add("targets."+a+".match.service", "service %s is also matched by targets.%s", sv, o)
			}
			serviceOwner[sv] = a
		}
		for _, e := range entries(a, c.Targets[a].Match, nil) {
			k := groupKey{e.prefix.Masked(), e.spec.portRank}
			groups[k] = append(groups[k], e)
		}
	}
	report := func(x, y entry) {
		a, b := x.target, y.target
		if b < a {
			a, b, x = b, a, y
		}
		if seen[[2]string{a, b}] {
			return
		}
		seen[[2]string{a, b}] = true
		d.add("targets."+b+".match", "matches %s port %s as specifically as targets.%s; make one more specific", x.prefix, portText(x.ports), a)
	}
	keys := make([]groupKey, 0, len(groups))
	for k := range groups {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if c := keys[i].prefix.Addr().Compare(keys[j].prefix.Addr()); c != 0 {
			return c < 0
		}
		if keys[i].prefix.Bits() != keys[j].prefix.Bits() {
			return keys[i].prefix.Bits() < keys[j].prefix.Bits()
		}
		return keys[i].rank < keys[j].rank
	})
	for _, k := range keys {
		g := groups[k]
		if len(g) < 2 {
			continue
		}
		// Two sweeps, one per protocol a destination can have; an entry
		// for any protocol takes part in both.
		for _, proto := range []string{"tcp", "udp"} {
			var es []entry
			for _, e := range g {
				if protosOverlap(e.proto, proto) {
					es = append(es, e)
				}
			}
			sweepPorts(es, report)
		}
	}
}

// sweepPorts reports entries of different targets whose ports overlap.
// Sorted by the start of their port range, an entry overlaps an earlier
// one of another target exactly when the highest end among earlier
// entries of other targets reaches it; keeping the highest end of the two
// best targets gives that end in constant time.
func sweepPorts(es []entry, report func(x, y entry)) {
	lo := func(e entry) int {
		if e.ports == (PortRange{}) {
			return 0
		}
		return int(e.ports.Lo)
	}
	hi := func(e entry) int {
		if e.ports == (PortRange{}) {
			return 65535
		}
		return int(e.ports.Hi)
	}
	sort.SliceStable(es, func(i, j int) bool { return lo(es[i]) < lo(es[j]) })
	var best, second *entry // highest end so far, and highest of another target
	for i := range es {
		e := &es[i]
		switch {
		case best != nil && best.target != e.target && hi(*best) >= lo(*e):
			report(*best, *e)
		case second != nil && hi(*second) >= lo(*e):
			report(*second, *e)
		}
		switch {
		case best == nil || hi(*e) > hi(*best):
			if best != nil && best.target != e.target {
				second = best
			}
			best = e
		case e.target != best.target && (second == nil || hi(*e) > hi(*second)):
			second = e
		}
	}
}

func portText(p PortRange) string {
	if p == (PortRange{}) {
		return "any"
	}
	return p.String()
}
