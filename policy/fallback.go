package policy

import (
	"fmt"
	"net/netip"
	"strings"
)

// noFallback is the fallback option's default: none.
const noFallback = "(none)"

func init() {
	optionFields = append(optionFields, optionField{
		"fallback", noFallback, "ADDRESS:PORT, or {service: NAMESPACE/NAME, port: PORT}",
		"Where connects go while the circuit is open (and a half-open circuit has no probe left for them): the kernel rewrites their destination in `connect()` (and a UDP datagram's in `sendmsg`) instead of rejecting them, and the application still sees the address it asked for (`getpeername`, `recvfrom`). The fallback has a circuit of its own, which counts the redirected connections' outcomes; when it is open too, connects are rejected with `reject_errno`. An address and port (`10.0.0.9:8080`, `[2001:db8::9]:8080`) of the target's address family, or a Kubernetes Service and one of its ports (`{service: shop/house-ads, port: 8080}`: its cluster IP, resolved live as Service targets are). Targets only; never a destination of the target itself, and never one whose own target has a fallback. See *Fallbacks*.",
		setFallback,
	})
}

// setFallback parses ADDRESS:PORT, or a mapping of a Service and a port.
func setFallback(o *Options, r any) error {
	o.Fallback, o.FallbackService = netip.AddrPort{}, ServiceFallback{}
	if r == noFallback {
		return nil
	}
	if m, ok := asMap(r); ok {
		return setServiceFallback(&o.FallbackService, m)
	}
	s, ok := asString(r)
	if !ok {
		return fmt.Errorf("%v is not ADDRESS:PORT or {service: NAMESPACE/NAME, port: PORT}", r)
	}
	dst := &o.Fallback
	ap, err := netip.ParseAddrPort(strings.TrimSpace(s))
	if err != nil || ap.Addr().Zone() != "" {
		return fmt.Errorf("%q is not ADDRESS:PORT (an IP address and a port: 10.0.0.9:8080, [2001:db8::9]:8080)", quoteShort(s))
	}
	if ap.Port() == 0 {
		return fmt.Errorf("%q has port 0", quoteShort(s))
	}
	a := ap.Addr().Unmap()
	if a.IsUnspecified() || a.IsMulticast() {
		return fmt.Errorf("%q is not an address a connect can reach", quoteShort(s))
	}
	if a.Is6() && a.IsLinkLocalUnicast() {
		// The kernel needs an interface (a zone) to connect to it, and a
		// rewritten connect cannot carry one: every redirect would fail
		// with EINVAL, and no outcome would reach the fallback's circuit.
		return fmt.Errorf("%q is link-local: a connect to it needs an interface, which a redirected connect cannot name", quoteShort(s))
	}
	*dst = netip.AddrPortFrom(a, ap.Port())
	return nil
}

// ServiceFallback is a fallback named by a Kubernetes Service: its cluster
// IP and Port, resolved live by the daemon. The zero value is none.
type ServiceFallback struct {
	// Service is "namespace/name".
	Service string
	// Port is one of the Service's ports (spec.ports[].port).
	Port uint16
}

// String returns namespace/name:port.
func (f ServiceFallback) String() string { return fmt.Sprintf("%s:%d", f.Service, f.Port) }

// setServiceFallback parses {service: NAMESPACE/NAME, port: PORT}.
func setServiceFallback(dst *ServiceFallback, m map[string]any) error {
	for k := range m {
		if k != "service" && k != "port" {
			return fmt.Errorf("unknown key %q (a Service fallback takes service and port)", quoteShort(k))
		}
	}
	ref, ok := m["service"].(string)
	if !ok {
		return fmt.Errorf("a Service fallback needs service: NAMESPACE/NAME")
	}
	if err := checkServiceRef(ref); err != nil {
		return err
	}
	var port int
	if m["port"] == nil {
		return fmt.Errorf("a Service fallback needs port: one of the Service's port numbers")
	}
	if err := setInt(&port, m["port"], 1, 65535); err != nil {
		return fmt.Errorf("port: %w", err)
	}
	*dst = ServiceFallback{Service: ref, Port: uint16(port)}
	return nil
}

// HasFallback reports whether the options name a fallback.
func (o *Options) HasFallback() bool { return o.Fallback.IsValid() || o.FallbackService.Service != "" }

// FallbackText is the fallback as configured: ADDRESS:PORT or
// namespace/name:port; "" without one.
func (o *Options) FallbackText() string {
	switch {
	case o.Fallback.IsValid():
		return o.Fallback.String()
	case o.FallbackService.Service != "":
		return o.FallbackService.String()
	}
	return ""
}

// protosOf lists the transport protocols a match of proto p covers.
func protosOf(p string) []string {
	if p == "any" {
		return []string{"tcp", "udp"}
	}
	return []string{p}
}

// checkFallbacks checks every target's fallback against the whole
// configuration: `all` has none (every destination of it would share
// one); a fallback is none of its own target's destinations, not
// excluded, reached with the protocols of its target, of the address
// family of the target's addresses, and the destination of no target
// that has a fallback itself (fallbacks never chain: the kernel follows
// one). Only addresses are known here: a fallback that a target's
// host names or Service will resolve to is not checked.
func (d *decoder) checkFallbacks(c *Config, raw map[string]any) {
	if all, ok := asMap(raw["all"]); ok {
		if _, ok := all["fallback"]; ok {
			d.add("all.fallback", "only a target can set it (every destination of `all` would share one fallback); set it on the targets that have one")
		}
	}
	var m *Matcher
	for _, name := range sortedTargetNames(c) {
		t := c.Targets[name]
		if sf := t.Options.FallbackService; sf.Service != "" {
			d.checkServiceFallback(c, name, t, sf)
			continue
		}
		fb := t.Options.Fallback
		if !fb.IsValid() {
			continue
		}
		if m == nil {
			m = NewMatcher(c, nil)
		}
		path := "targets." + name + ".fallback"
		a, port := fb.Addr(), fb.Port()
		for _, p := range t.Match.Prefixes {
			if p.Addr().Is4() != a.Is4() {
				d.add(path, "%v is IPv%s, but the target names %v: a connect is never sent to another address family", fb, family(a), p)
				break
			}
		}
		for _, e := range entries(name, t.Match, nil) {
			if e.covers(a, port, e.proto) {
				d.add(path, "%v is a destination of this target: a fallback must lead elsewhere", fb)
				break
			}
		}
		for _, proto := range protosOf(t.Match.Proto) {
			owner, excluded := m.Match(a, port, proto)
			if excluded {
				d.add(path, "%v is excluded (%s): a fallback needs a circuit of its own", fb, proto)
				break
			}
			if owner == "" {
				// Of `all` for this protocol: is it another protocol's target?
				for _, other := range []string{"tcp", "udp"} {
					if other == proto {
						continue
					}
					if o, _ := m.Match(a, port, other); o != "" && o != name {
						d.add(path, "%v is target %s's for %s only, but this target's connects are %s: the fallback's protocol must match its target's", fb, o, other, proto)
					}
				}
				continue
			}
			if owner == name {
				continue // reported above
			}
			if c.Targets[owner].Options.HasFallback() {
				d.add(path, "%v is target %s's, which has a fallback itself: fallbacks never chain", fb, owner)
				break
			}
		}
	}
}

func family(a netip.Addr) string {
	if a.Is4() {
		return "4"
	}
	return "6"
}

// fallbackReference is the configuration reference's section on
// fallbacks.
const fallbackReference = "## Fallbacks\n\n" +
	"A target's `fallback` (`fallback: 10.0.0.9:8080`) turns its open circuit from a fast failure into a degraded service: while the circuit rejects, the kernel rewrites the destination of each connect (`connect()`; a UDP target's datagrams in `sendmsg`, and a connected UDP socket's `connect()`) to the fallback instead of turning it away, as socket-level load balancers do, for any process and with no proxy. " +
	"The application sees the address it asked for: `getpeername()` on the socket and the source address `recvfrom()` reports for the fallback's UDP answers are the original destination's, so logs and name checks are not confused (TLS still verifies the certificate the fallback presents against the name the client asked for: a fallback that serves TLS needs a certificate for that name). " +
	"A half-open circuit sends its probes to the target itself and the connects that find no probe left to the fallback; once it closes, new connects go to the target again. Connections already redirected stay with the fallback until their clients close them (a keep-alive or database pool keeps using it), unless the target has `close_established`: then, when its circuit stops rejecting, breakerd closes the connections it sent to the fallback that are still there, so the pools reconnect to the target (see *Closing established connections*). In `shadow` mode nothing is redirected (nothing is rejected). " +
	"**The fallback's own circuit.** The fallback is a destination like any other, with the circuit that matching gives it (another target's, or a dynamic circuit of `all`), and the outcomes of redirected connections count there, never for the dead target. When that circuit is open too, connects to the target are rejected with its `reject_errno`, as without a fallback; a half-open fallback may take a redirected connect as its probe. " +
	"Its bulkhead limits apply to redirected connects, the target's do not. " +
	"**Refused**: a fallback in `all`, a link-local IPv6 address (a connect to it needs an interface, which a redirected connect cannot name), one that is a destination of the target itself, one that belongs to a target with a fallback of its own (fallbacks never chain: the kernel follows one), one that is excluded, one that is another protocol's target's, and one of another address family than the target's addresses (an IPv4 socket cannot be sent to an IPv6 address). Only addresses are checked: a fallback that a target's host names or Service resolve to later is not. " +
	"**A Service** (`fallback: {service: shop/house-ads, port: 8080}`) is its first cluster IP (the primary family) and that Service port, resolved live from the Kubernetes API as Service targets are (it needs API access): a new cluster IP applies at once; while the Service, that port or a cluster IP is missing (a headless Service has none), the target's connects are rejected as without a fallback. Validation refuses the target's own Service, and the Service of a target with a fallback. " +
	"A reload that sets, changes or removes a fallback applies at once, also to a circuit already open. " +
	"**Seeing it**: `breakerd_redirected_total{target}` counts redirected connects and datagrams per target, `/v1/circuits` shows each circuit's `fallback` and `redirected`, and so does the status page. " +
	"The kernel keeps the original address per redirected socket in the socket's own storage, freed with the socket; an unconnected UDP socket remembers its last redirect only, so a socket that sends to several redirected targets at once sees the last one's address on replies from a fallback they share. " +
	"When a fallback helps and when it hides an outage: [Degrading gracefully](guides/degrading-gracefully.md).\n\n"

// checkServiceFallback checks what can be known of a Service fallback
// before it resolves: it is not the target's own Service, and no target
// of that Service has a fallback itself.
func (d *decoder) checkServiceFallback(c *Config, name string, t *Target, sf ServiceFallback) {
	path := "targets." + name + ".fallback"
	if t.Match.Service == sf.Service {
		d.add(path, "service %s is this target's own: a fallback must lead elsewhere", sf.Service)
		return
	}
	for _, other := range sortedTargetNames(c) {
		o := c.Targets[other]
		if other != name && o.Match.Service == sf.Service && o.Options.HasFallback() {
			d.add(path, "service %s is target %s's, which has a fallback itself: fallbacks never chain", sf.Service, other)
		}
	}
}
