// Package policy is breakerd's brain: the configuration (schema, defaults,
// validation, reload diff), the matching of destinations to targets, and the
// circuit state machine. It is pure Go: no kernel, no clock or randomness of
// its own (both are injected), so all of it is testable without root.
//
// Choices made where the design is silent:
//   - Keys are case-sensitive. Target names must match [a-z0-9_-]+ and
//     must not be all, tcp or udp: those name the dynamic circuits of `all`
//     (tcp/addr:port, udp/addr:port) and their metric label, and an
//     endpoint-scope target of that name would make circuit names that
//     collide with them.
//   - A named target's scope defaults to service; max_ejection_percent
//     defaults to 50 and only applies to endpoint scope. The share is of the
//     endpoints the group knows, rounded down, so with 5 endpoints and 40%
//     at most 2 are ejected; one endpoint may always be ejected (Envoy's
//     rule), so with 2 endpoints and 40% one is.
//   - Jitter only lengthens an open period (up to jitter × duration), so an
//     open duration never exceeds max_open_duration × (1 + jitter).
//   - A half-open circuit counts only probe outcomes of its current round;
//     outcomes of connections started before it opened, and of probes of
//     earlier rounds, are ignored in open and half-open.
//   - probe_timeout is the daemon's alone: a round none of whose probes
//     succeeded reopens then; a round with successes and no failure begins
//     a new round, keeping the count (see Circuit.Tick).
package policy

import (
	"bytes"
	_ "embed"
	"fmt"
	"net/netip"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Mode is enforce or shadow.
type Mode string

// The modes.
const (
	Enforce Mode = "enforce"
	Shadow  Mode = "shadow"
)

// Scope says how many circuits a target has.
type Scope string

// The scopes.
const (
	// ServiceScope: one circuit for the whole target.
	ServiceScope Scope = "service"
	// EndpointScope: one circuit per address and port, grouped under
	// max_ejection_percent.
	EndpointScope Scope = "endpoint"
)

// Override is an operator's fixed state for a target.
type Override string

// The overrides.
const (
	NoOverride   Override = ""
	ForceOpen    Override = "forced_open"
	ForceClosed  Override = "forced_closed"
	DisableState Override = "disabled"
)

// MaxCircuitsLimit is the largest max_circuits (2^20). A dynamic circuit
// without bulkhead or response options takes a kernel circuit id only when
// it first rejects, so closed ones cost the daemon's memory alone; the
// kernel holds 2^18 ids and 2^18 destinations with a verdict or a limit.
const MaxCircuitsLimit = 1 << 20

// GuaranteedCircuits is the max_circuits (2^17) up to which every circuit
// can reject at once: half the kernel's circuit ids (maps.MaxCircuitIDs),
// so ids held back while sockets of a dropped circuit still count in its
// bulkhead slot never run out, and half its verdict map's destinations
// (the bulkhead slots of sharing workloads, which take ids too, aside).
// Past it, a circuit that opens when no id or verdict entry is left is not
// enforced, and the daemon logs and counts it.
const GuaranteedCircuits = 1 << 17

// Config is a whole, validated configuration.
type Config struct {
	// Mode is enforce or shadow (circuits run, the kernel rejects nothing).
	Mode Mode
	// MaxCircuits bounds the destinations breakerd tracks, of every
	// circuit: each dynamic circuit, each endpoint of an endpoint-scope
	// target and each destination a service-scope target has seen counts
	// one. At most MaxCircuitsLimit.
	MaxCircuits int
	// FailsafeTimeout: the kernel ignores every verdict when the daemon's
	// heartbeat is older than this.
	FailsafeTimeout time.Duration
	// MaxRTO is how many retransmission timeouts make an established
	// connection stalled.
	MaxRTO int
	// All holds the options of every destination no target names.
	All Options
	// Targets are the named services, by name.
	Targets map[string]*Target
	// Exclude lists destinations never protected.
	Exclude []Match
	// Workloads select the protected processes by cgroup, in order (a
	// cgroup belongs to the first that matches it); empty protects every
	// process below the attach point.
	Workloads []Workload
}

// Target is a named service.
type Target struct {
	// Name is the target's key under `targets`.
	Name string
	// Match says which destinations belong to it.
	Match Match
	// Scope is service or endpoint.
	Scope Scope
	// MaxEjectionPercent caps the share of endpoints open at once
	// (endpoint scope).
	MaxEjectionPercent int
	// State is an operator's override, or empty.
	State Override
	// Options are the target's own options (defaults, not `all`, for what
	// it leaves out).
	Options Options
	// Source names the workloads the target applies to; empty means
	// every workload.
	Source []string
}

// Match selects destinations.
type Match struct {
	// Prefixes are the CIDRs and addresses (as /32 or /128).
	Prefixes []netip.Prefix
	// Hosts are DNS names, resolved and refreshed by the daemon.
	Hosts []string
	// Ports are single ports or ranges; empty means every port.
	Ports []PortRange
	// Proto is tcp, udp or any.
	Proto string
	// Service is a Kubernetes Service, "namespace/name", resolved live by
	// the daemon (its cluster IPs and its EndpointSlices' serving
	// endpoints); empty when the match names addresses. With a Service,
	// Ports are the Service's port numbers and PortNames its port names
	// (neither: every port of the Service).
	Service string
	// PortNames are Service port names (with Service only).
	PortNames []string
}

// ServiceDest is one destination a Service currently resolves to: a
// cluster IP and Service port, or an endpoint address and its port.
type ServiceDest struct {
	Addr  netip.AddrPort
	Proto string // tcp or udp
}

// PortRange is an inclusive range of ports; a single port has Lo == Hi.
type PortRange struct{ Lo, Hi uint16 }

// String returns "443" or "8000-8100".
func (p PortRange) String() string {
	if p.Lo == p.Hi {
		return strconv.Itoa(int(p.Lo))
	}
	return fmt.Sprintf("%d-%d", p.Lo, p.Hi)
}

// docField documents a key that is not an option: its default, unit and
// meaning, for the configuration reference.
type docField struct{ key, def, unit, doc string }

// topFields are the top-level keys.
var topFields = []docField{
	{"mode", "enforce", "enforce | shadow", "`shadow` runs every circuit and reports what it would reject; the kernel rejects nothing."},
	{"max_circuits", "100000", "destinations", "Bound on the destinations breakerd tracks, of every circuit: each dynamic circuit of `all` (one per address and port), each endpoint of an endpoint-scope target and each destination a service-scope target has seen counts one. Past it, the least recently active idle closed dynamic circuit is evicted; when there is none, the new destination is not protected and `breakerd_circuits_refused_total{target}` counts it. At most 1048576. Up to 131072 every circuit can reject at once (half the kernel's 262144 circuit ids and verdict entries, the other half kept for ids still held by open sockets of dropped circuits; each sharing workload's bulkhead slot takes an id besides); a dynamic circuit without bulkhead or response options takes a kernel id only when it first rejects, so above that closed circuits cost only the daemon's memory (about 250 B each), and a circuit that opens when the kernel has no id or verdict entry left is not enforced: the daemon logs it and counts it in `breakerd_verdict_write_errors_total`."},
	{"failsafe_timeout", "10s", "duration", "The kernel ignores every verdict when the daemon's heartbeat is older than this (a dead daemon never strands open circuits)."},
	{"max_rto", "3", "timeouts", "Retransmission timeouts on an established connection that make it stalled (a failure)."},
	{"workloads", "[] (every process below `--cgroup`)", "list of workloads", "The protected workloads, by cgroup (see *Workloads*). Processes of no listed workload are never rejected, never counted in a bulkhead, and their outcomes are not reported."},
}

// targetFields are a target's keys besides its options.
var targetFields = []docField{
	{"match.cidrs", "[]", "list of CIDRs or addresses", "Destinations by address (`10.0.0.0/8`, `192.0.2.7`, `2001:db8::/48`)."},
	{"match.hosts", "[]", "list of DNS names", "Destinations by name, resolved and re-resolved by the daemon."},
	{"match.service", "(none)", "NAMESPACE/NAME", "A Kubernetes Service, resolved live from the API (needs API access: in a pod, or `--kubeconfig`): its cluster IPs × its ports, and its EndpointSlices' serving endpoints (ready, or terminating and still serving) × their ports. Not with `cidrs` or `hosts`. A Service that does not exist yet matches nothing until it appears. See *Kubernetes Services*."},
	{"match.ports", "[] (every port)", "list of ports or ranges", "`443`, `8000-8100`. With `service`: the Service's port numbers (`spec.ports[].port`) or names (`http`), no ranges."},
	{"match.protocol", "tcp", "tcp | udp | any", "Transport protocol. UDP is enforced on sendmsg and connected UDP."},
	{"scope", "service", "service | endpoint", "`service`: one circuit for the target; `endpoint`: one per address and port."},
	{"max_ejection_percent", "50", "percent in [1, 100]", "Endpoint scope: never more than this share of the target's known endpoints open at once (rounded down), except that one endpoint may always be open (Envoy's rule). See *Endpoint groups*."},
	{"state", "(none)", "forced_open | forced_closed | disabled", "Operator override: always reject, never reject, or metrics only."},
	{"source", "[] (every workload)", "list of workload names and `cgroup:PATTERN`s", "The workloads the target applies to: names of listed workloads, or cgroup patterns after `cgroup:`, each a workload of its own. The workloads it names are isolated: their circuits are their own (see *Workloads*)."},
}

var nameRE = regexp.MustCompile(`^[a-z0-9_-]+$`)

//go:embed default.yaml
var defaultYAML []byte

// DefaultYAML is the embedded default configuration, used when none is
// given.
func DefaultYAML() []byte { return bytes.Clone(defaultYAML) }

// Problem is one thing wrong with a configuration.
type Problem struct {
	// Path is the key path, like targets.payments.min_requests, or
	// "(file)" for the file as a whole.
	Path string
	// Line is the line of the key in the file, when known (0 otherwise).
	Line int
	// Msg says what is wrong.
	Msg string
}

// String returns "key.path: reason (line N)".
func (p Problem) String() string {
	s := p.Path + ": " + p.Msg
	if p.Line > 0 {
		s += " (line " + strconv.Itoa(p.Line) + ")"
	}
	return s
}

// ValidationError lists every problem of a configuration.
type ValidationError struct {
	Problems []Problem
}

// Error lists every problem, one per line, as "key.path: reason".
func (e *ValidationError) Error() string {
	lines := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		lines[i] = p.String()
	}
	return "invalid configuration:\n  " + strings.Join(lines, "\n  ")
}

type decoder struct {
	problems []Problem
	dropped  int            // problems past maxProblems, counted only
	lines    map[string]int // line of each key path
}

func (d *decoder) add(path, format string, args ...any) {
	d.addLine(path, d.lineOf(path), fmt.Sprintf(format, args...))
}

// result returns the validation error, if any.
func (d *decoder) result() error {
	if len(d.problems) == 0 {
		return nil
	}
	ps := d.problems
	if d.dropped > 0 {
		ps = append(ps, Problem{Path: "(file)", Msg: fmt.Sprintf("and %d more problems", d.dropped)})
	}
	return &ValidationError{Problems: ps}
}

// reservedNames are target names that the dynamic circuits of `all` use
// (their target label, and the tcp/… and udp/… circuit names).
var reservedNames = map[string]bool{"all": true, "tcp": true, "udp": true}

func (d *decoder) decode(raw map[string]any) (*Config, error) {
	c := &Config{Mode: Enforce, MaxCircuits: 100000, FailsafeTimeout: 10 * time.Second, MaxRTO: 3, All: DefaultOptions(), Targets: map[string]*Target{}}
	for _, k := range sortedKeys(raw) {
		val := raw[k]
		known := k == "all" || k == "targets" || k == "exclude"
		for _, f := range topFields {
			known = known || f.key == k
		}
		if !known {
			d.add(k, "unknown key%s", d.suggest(k, topKeys()))
			continue
		}
		if val == nil {
			continue // reported as a null value
		}
		switch k {
		case "mode":
			s, _ := asString(val)
			switch Mode(strings.ToLower(s)) {
			case Enforce, Shadow:
				c.Mode = Mode(strings.ToLower(s))
			default:
				d.add(k, "%v is not enforce or shadow", val)
			}
		case "max_circuits":
			if err := setInt(&c.MaxCircuits, val, 1, MaxCircuitsLimit); err != nil {
				d.add(k, "%v", err)
			}
		case "failsafe_timeout":
			if err := setDuration(&c.FailsafeTimeout, val, time.Second, time.Hour); err != nil {
				d.add(k, "%v", err)
			}
		case "max_rto":
			if err := setInt(&c.MaxRTO, val, 1, 30); err != nil {
				d.add(k, "%v", err)
			}
		case "all":
			m, ok := asMap(val)
			if !ok {
				d.add(k, "must be a mapping of options")
				continue
			}
			c.All = d.options("all", m, nil)
			d.checkResponses("all", m, nil)
			d.checkAdaptive("all", &c.All)
		case "targets":
			m, ok := asMap(val)
			if !ok {
				d.add(k, "must be a mapping of target names to blocks")
				continue
			}
			if len(m) > MaxTargets {
				d.add(k, "%d targets; the limit is %d", len(m), MaxTargets)
				continue
			}
			for _, name := range sortedKeys(m) {
				if t := d.target(name, m[name]); t != nil {
					c.Targets[name] = t
				}
			}
		case "workloads":
			c.Workloads = d.workloads(val)
		case "exclude":
			list, ok := val.([]any)
			if !ok {
				d.add(k, "must be a list of match blocks")
				continue
			}
			if len(list) > MaxExclude {
				d.add(k, "%d exclude blocks; the limit is %d", len(list), MaxExclude)
				continue
			}
			for i, e := range list {
				path := fmt.Sprintf("exclude[%d]", i)
				if e == nil {
					continue // reported as an empty entry
				}
				m, ok := asMap(e)
				if !ok {
					d.add(path, "must be a match block (cidrs, hosts, ports, protocol)")
					continue
				}
				mt := d.match(path, m)
				if len(mt.Prefixes) == 0 && len(mt.Hosts) == 0 {
					d.add(path, "names no cidrs or hosts")
				}
				c.Exclude = append(c.Exclude, mt)
			}
		}
	}
	d.limits(c)
	d.checkSources(c)
	d.overlaps(c)
	d.checkFallbacks(c, raw)
	if err := d.result(); err != nil {
		return nil, err
	}
	return c, nil
}

func topKeys() []string {
	keys := []string{"all", "targets", "exclude"}
	for _, f := range topFields {
		keys = append(keys, f.key)
	}
	return keys
}

// limits checks the limits that span blocks: match entries and host
// names over the whole file.
func (d *decoder) limits(c *Config) {
	entries := 0
	hosts := map[string]bool{}
	services := 0
	count := func(m Match) {
		if m.Service != "" {
			services++
		}
		ports := max(len(m.Ports), 1)
		entries += len(m.Prefixes) * ports
		for _, h := range m.Hosts {
			hosts[h] = true
		}
	}
	for _, t := range c.Targets {
		count(t.Match)
	}
	for _, ex := range c.Exclude {
		count(ex)
	}
	if entries > MaxMatchEntries {
		d.add("(file)", "targets and excludes name %d address × port pairs; the limit is %d", entries, MaxMatchEntries)
	}
	if services > MaxServices {
		d.add("(file)", "%d Service targets; the limit is %d", services, MaxServices)
	}
	if len(hosts) > MaxHosts {
		d.add("(file)", "%d distinct host names; the limit is %d", len(hosts), MaxHosts)
	}
}

// options decodes an options block; extra lists the other keys the block
// may hold (a target's match, scope …), which are skipped here.
func (d *decoder) options(path string, m map[string]any, extra map[string]bool) Options {
	o := DefaultOptions()
	known := map[string]*optionField{}
	for i := range optionFields {
		known[optionFields[i].key] = &optionFields[i]
	}
	for _, k := range sortedKeys(m) {
		if extra[k] {
			continue
		}
		if k == "fleet" {
			if m[k] != nil { // null is reported as a null value
				o.Fleet = d.fleet(path+".fleet", m[k])
			}
			continue
		}
		if k == "slow_start" {
			if m[k] != nil { // null is reported as a null value
				o.SlowStart = d.slowStart(path+".slow_start", m[k])
			}
			continue
		}
		f, ok := known[k]
		if !ok {
			d.add(path+"."+k, "unknown key%s", d.suggest(k, optionKeys(extra)))
			continue
		}
		if m[k] == nil {
			continue // reported as a null value
		}
		if err := f.set(&o, m[k]); err != nil {
			d.addKeyErrors(path+"."+k, err)
		}
	}
	d.contradictions(path, m, &o)
	return o
}

func (d *decoder) contradictions(path string, m map[string]any, o *Options) {
	if o.WindowDuration == 0 && o.MinRequests > o.WindowSize {
		d.add(path+".min_requests", "%d exceeds window_size %d", o.MinRequests, o.WindowSize)
	}
	if o.HalfOpenSuccessThreshold > o.HalfOpenProbes {
		d.add(path+".half_open_success_threshold", "%d exceeds half_open_probes %d", o.HalfOpenSuccessThreshold, o.HalfOpenProbes)
	}
	if o.MaxOpenDuration < o.OpenDuration {
		d.add(path+".max_open_duration", "%v is shorter than open_duration %v", o.MaxOpenDuration, o.OpenDuration)
	}
	if o.ProbeTimeout < o.ConnectTimeout {
		d.add(path+".probe_timeout", "%v is shorter than connect_timeout %v (a probe would time out while still connecting)", o.ProbeTimeout, o.ConnectTimeout)
	}
	if o.WindowDuration != 0 && o.WindowDuration < WindowBuckets*time.Millisecond {
		d.add(path+".window_duration", "%v is shorter than %v", o.WindowDuration, WindowBuckets*time.Millisecond)
	}
}

var targetKeys = map[string]bool{"match": true, "scope": true, "max_ejection_percent": true, "state": true, "source": true}

func (d *decoder) target(name string, val any) *Target {
	path := "targets." + name
	if !nameRE.MatchString(name) {
		d.add(path, "target names must match [a-z0-9_-]+")
		return nil
	}
	if reservedNames[name] {
		d.add(path, "%q is reserved: all, tcp and udp name the dynamic circuits of `all` (tcp/addr:port) and their metrics; choose another name", name)
		return nil
	}
	if val == nil {
		return nil // reported as a null value
	}
	m, ok := asMap(val)
	if !ok {
		d.add(path, "must be a mapping (match, scope, options …)")
		return nil
	}
	t := &Target{Name: name, Scope: ServiceScope, MaxEjectionPercent: 50}
	t.Options = d.options(path, m, targetKeys)
	if mv, ok := m["match"]; ok && mv != nil {
		mm, ok := asMap(mv)
		if !ok {
			d.add(path+".match", "must be a mapping (cidrs, hosts, ports, protocol)")
		} else {
			t.Match = d.match(path+".match", mm)
		}
	}
	if len(t.Match.Prefixes) == 0 && len(t.Match.Hosts) == 0 && t.Match.Service == "" {
		d.add(path+".match", "names no cidrs, hosts or service")
	}
	if t.Options.CloseEstablished && t.Match.Proto == "udp" {
		d.add(path+".close_established", "closes TCP connections, but match.protocol is udp")
	}
	d.checkResponses(path, m, t)
	if v, ok := m["scope"]; ok && v != nil {
		s, _ := asString(v)
		switch Scope(s) {
		case ServiceScope, EndpointScope:
			t.Scope = Scope(s)
		default:
			d.add(path+".scope", "%v is not service or endpoint", v)
		}
	}
	if v, ok := m["max_ejection_percent"]; ok && v != nil {
		if err := setInt(&t.MaxEjectionPercent, v, 1, 100); err != nil {
			d.add(path+".max_ejection_percent", "%v (one endpoint may always be ejected; to never reject, use state: forced_closed or disabled)", err)
		}
	}
	if v, ok := m["source"]; ok && v != nil {
		t.Source = d.source(path+".source", v)
	}
	if v, ok := m["state"]; ok && v != nil {
		s, _ := asString(v)
		switch Override(s) {
		case ForceOpen, ForceClosed, DisableState:
			t.State = Override(s)
		default:
			d.add(path+".state", "%v is not forced_open, forced_closed or disabled", v)
		}
	}
	return t
}

func (d *decoder) match(path string, m map[string]any) Match {
	mt := Match{Proto: "tcp"}
	for _, k := range sortedKeys(m) {
		v := m[k]
		if v == nil {
			switch k {
			case "cidrs", "hosts", "ports", "protocol", "service":
				continue // reported as a null value
			}
		}
		switch k {
		case "service":
			if strings.HasPrefix(path, "exclude") {
				d.add(path+".service", "an exclude takes cidrs and hosts, not a service")
				continue
			}
			s, ok := v.(string)
			if !ok {
				d.add(path+".service", "must be NAMESPACE/NAME")
				continue
			}
			if err := checkServiceRef(s); err != nil {
				d.add(path+".service", "%v", err)
				continue
			}
			mt.Service = s
		case "cidrs":
			for i, s := range d.strings(path+".cidrs", v) {
				p, err := parsePrefix(s)
				if err != nil {
					d.add(fmt.Sprintf("%s.cidrs[%d]", path, i), "%v", err)
					continue
				}
				mt.Prefixes = append(mt.Prefixes, p)
			}
		case "hosts":
			for i, s := range d.strings(path+".hosts", v) {
				if s == "" || strings.ContainsAny(s, " /:") {
					d.add(fmt.Sprintf("%s.hosts[%d]", path, i), "%q is not a host name", s)
					continue
				}
				mt.Hosts = append(mt.Hosts, strings.ToLower(s))
			}
		case "ports":
			_, service := m["service"]
			for i, s := range d.strings(path+".ports", v) {
				if service {
					if isPortName(s) {
						mt.PortNames = append(mt.PortNames, s)
						continue
					}
					if pr, err := parsePorts(s); err == nil && pr.Lo == pr.Hi {
						mt.Ports = append(mt.Ports, pr)
						continue
					}
					d.add(fmt.Sprintf("%s.ports[%d]", path, i), "%q is not a Service port number (1-65535) or port name", s)
					continue
				}
				pr, err := parsePorts(s)
				if err != nil {
					d.add(fmt.Sprintf("%s.ports[%d]", path, i), "%v", err)
					continue
				}
				mt.Ports = append(mt.Ports, pr)
			}
		case "protocol":
			s, _ := asString(v)
			switch s {
			case "tcp", "udp", "any":
				mt.Proto = s
			default:
				d.add(path+".protocol", "%v is not tcp, udp or any", v)
			}
		default:
			d.add(path+"."+k, "unknown key (match takes cidrs, hosts, service, ports, protocol)")
		}
	}
	if mt.Service != "" && len(mt.Prefixes)+len(mt.Hosts) > 0 {
		d.add(path+".service", "a service match names no cidrs or hosts (the Service's addresses come from the API)")
	}
	if n := len(mt.Prefixes) + len(mt.Hosts); n > MaxAddresses {
		d.add(path, "%d cidrs and hosts; the limit is %d per match block", n, MaxAddresses)
	}
	if len(mt.Ports) > MaxPorts {
		d.add(path+".ports", "%d ports and ranges; the limit is %d per match block", len(mt.Ports), MaxPorts)
	}
	return mt
}

func (d *decoder) strings(path string, v any) []string {
	list, ok := v.([]any)
	if !ok {
		if s, ok := v.(string); ok {
			// Environment variables arrive as one string: split on commas
			// and spaces.
			return strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' })
		}
		d.add(path, "must be a list")
		return nil
	}
	out := make([]string, 0, len(list))
	for i, e := range list {
		if e == nil {
			continue // reported as an empty entry
		}
		if _, isList := e.([]any); isList {
			d.add(fmt.Sprintf("%s[%d]", path, i), "must be a single value, not a list")
			continue
		}
		if _, isMap := e.(map[string]any); isMap {
			d.add(fmt.Sprintf("%s[%d]", path, i), "must be a single value, not a mapping")
			continue
		}
		out = append(out, strings.TrimSpace(fmt.Sprint(e)))
	}
	return out
}

var (
	// dnsLabelRE is a DNS-1123 label (a namespace, a Service port name),
	// dns1035RE a DNS-1035 label (a Service name).
	dnsLabelRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)
	dns1035RE  = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
)

// isPortName reports a Service port name: a DNS-1123 label with at least
// one letter (all digits is a port number).
func isPortName(s string) bool {
	return dnsLabelRE.MatchString(s) && strings.IndexFunc(s, func(r rune) bool { return r >= 'a' && r <= 'z' }) >= 0
}

// checkServiceRef checks "namespace/name" as Kubernetes would.
func checkServiceRef(s string) error {
	ns, name, ok := strings.Cut(s, "/")
	switch {
	case !ok || strings.Contains(name, "/"):
		return fmt.Errorf("%q is not NAMESPACE/NAME", quoteShort(s))
	case !dnsLabelRE.MatchString(ns):
		return fmt.Errorf("namespace %q is not a DNS-1123 label (lowercase letters, digits, '-', at most 63)", quoteShort(ns))
	case !dns1035RE.MatchString(name):
		return fmt.Errorf("service name %q is not a DNS-1035 label (a lowercase letter, then letters, digits, '-', at most 63)", quoteShort(name))
	}
	return nil
}

func quoteShort(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return p, fmt.Errorf("%q is not a CIDR", s)
		}
		if p.Addr().Is4In6() {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q is not an address or CIDR", s)
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

func parsePorts(s string) (PortRange, error) {
	lo, hi, isRange := strings.Cut(s, "-")
	a, err1 := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
	b := a
	var err2 error
	if isRange {
		b, err2 = strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
	}
	if err1 != nil || err2 != nil || a == 0 || b < a {
		return PortRange{}, fmt.Errorf("%q is not a port (1-65535) or a range like 8000-8100", s)
	}
	return PortRange{uint16(a), uint16(b)}, nil
}

func asMap(v any) (map[string]any, bool) {
	m, ok := v.(map[string]any)
	return m, ok
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func optionKeys(extra map[string]bool) []string {
	keys := make([]string, 0, len(optionFields)+len(extra)+1)
	for _, f := range optionFields {
		keys = append(keys, f.key)
	}
	keys = append(keys, "fleet", "slow_start")
	for k := range extra {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// suggest names the known key closest to a misspelt one, while problems
// are still reported (past maxProblems they are only counted).
func (d *decoder) suggest(k string, known []string) string {
	if len(k) > 64 || len(d.problems) >= maxProblems {
		return "" // no key is that long; spare the edit distance
	}
	best, bestD := "", 4
	for _, key := range known {
		if d := editDistance(k, key); d < bestD {
			best, bestD = key, d
		}
	}
	if best == "" {
		return ""
	}
	return " (did you mean " + best + "?)"
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
