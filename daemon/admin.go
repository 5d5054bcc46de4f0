package daemon

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/breakerd/breakerd/api"
	"github.com/breakerd/breakerd/engine"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Bounds of the admin API. Every response is built from a snapshot taken
// under the daemon's lock (copies of names and in-memory state, no kernel
// reads), then completed and encoded outside it, so a slow or hostile
// client never holds up the event loop or the heartbeat.
const (
	// PageSize is the most circuits one GET /v1/circuits returns; more
	// are fetched with ?after=NAME (the Link header names the next page).
	PageSize = 1000
	// listedDests is the most destinations one circuit lists; the count
	// of all is destinations_total.
	listedDests = 32
	// maxQuoted is the most bytes of a client's input an error repeats.
	maxQuoted = 64
	// maxBody is the largest request body accepted.
	maxBody = 4096
	// heavyRequests is how many requests for circuits, events or metrics
	// each server handles at once, and clientHeavyRequests how many of
	// them one client may have (clientKey: a local user, a remote address,
	// a process on the unix socket); more get 503 at once. A client that
	// never reads its responses holds at most clientHeavyRequests, each
	// for at most writeStall after its socket buffers fill, so other
	// clients' scrapes and pages are served meanwhile. Two, because the
	// status page asks for circuits and events together.
	heavyRequests       = 8
	clientHeavyRequests = 2
	// tcpConns and socketConns cap open connections per server (the two
	// servers count apart, so TCP clients never use up the socket's).
	tcpConns    = 128
	socketConns = 32
	// tcpSendBuffer caps the kernel's send buffer of each TCP connection,
	// so unread responses cannot pile up in socket memory.
	tcpSendBuffer = 64 << 10
)

// CircuitInfo is api.CircuitInfo.
type CircuitInfo = api.CircuitInfo

// circuitSnap is what is copied of a circuit under the lock; complete
// turns it into a CircuitInfo outside the lock.
type circuitSnap struct {
	info  CircuitInfo
	opts  *policy.Options // from the loaded configuration: never changed after load
	dests []maps.Dest
	round uint32 // the half-open round the circuit's verdict admits probes of
	// cgroups whose connections failed, named as pods by complete.
	cgroups []uint64
	bulk    []bulkSlot // the sharing workloads' bulkheads
	owners  []owner    // key the cgroups it rejected (rejections.go)
}

// snap copies what the API shows of c. Called under d.mu; no kernel reads.
func (d *Daemon) snap(c *circuit, now time.Time) circuitSnap {
	st := c.Machine.Status(now)
	scope := string(c.Scope())
	if c.Target() == allTarget {
		scope = "dynamic"
	}
	return circuitSnap{
		info: CircuitInfo{Name: c.Name(), Target: c.Target(), Workload: c.Workload(), Scope: scope, State: st.State.String(),
			FailureRate: st.FailureRate, SlowRate: st.SlowRate, Calls: st.Calls, Failures: st.Failures, Slow: st.Slow,
			ConsecutiveFailures: st.ConsecutiveFailures, OpenUntil: st.OpenUntil, Trip: st.Trip, CircuitID: c.ID,
			DestinationsTotal: len(c.Dests()), ClosedEstablished: c.ClosedEstablished(), Unenforced: d.isUnenforced(c)},
		opts:    c.Machine.Options(),
		dests:   slices.Clone(c.Dests()[:min(len(c.Dests()), listedDests)]),
		round:   st.Round,
		cgroups: c.FailedCgroups(),
		bulk:    c.BulkSlots(),
		owners:  owners(c),
	}
}

// complete adds the kernel's view (probe tokens, counters) to a snapshot.
// Called outside d.mu: the maps are safe for concurrent use.
func (d *Daemon) complete(s circuitSnap, names *cgroupNamer) CircuitInfo {
	ci := s.info
	ci.Options = optionsMap(s.opts)
	ci.FailedPods = d.podNames(s.cgroups)
	if s.opts.CloseEstablished {
		ci.CloseMechanism = string(maps.CloseNone)
		if m, ok := d.closeMech.Load().(maps.CloseMechanism); ok {
			ci.CloseMechanism = string(m)
		}
	}
	ci.RejectedBy, ci.RejectedByTotal = d.rejectedBy(s.owners, names)
	ci.Destinations = make([]string, 0, len(s.dests))
	for _, dst := range s.dests {
		ci.Destinations = append(ci.Destinations, dst.String())
	}
	slices.Sort(ci.Destinations)
	if ci.CircuitID != 0 && (ci.State == policy.Open.String() || ci.State == policy.HalfOpen.String()) {
		// One budget per circuit: the tokens left in its current round,
		// all of them when the round has not begun.
		left := int32(s.opts.HalfOpenProbes)
		if b, err := d.kernel.Budget(ci.CircuitID); err == nil && b.Round == s.round {
			left = int32(b.Tokens)
		}
		ci.ProbesLeft = &left
	}
	if ci.CircuitID != 0 { // 0: a dynamic circuit that never rejected has nothing in the kernel
		if cnt, err := d.kernel.Counters(ci.CircuitID); err == nil {
			ci.Rejected, ci.ShadowRejected, ci.BulkheadRejected = cnt.Rejected, cnt.ShadowRejected, cnt.BulkheadRejected
		}
		if b, err := d.kernel.BulkCount(ci.CircuitID); err == nil {
			ci.Connections, ci.Connecting = b.Connections, b.Connecting
		}
	}
	d.completeBulkheads(&ci, s.bulk)
	return ci
}

func optionsMap(o *policy.Options) map[string]any {
	m := map[string]any{
		"failure_rate_threshold": o.FailureRateThreshold, "window_size": o.WindowSize, "window_duration": o.WindowDuration.String(),
		"min_requests": o.MinRequests, "consecutive_failures": o.ConsecutiveFailures, "slow_call_duration": o.SlowCallDuration.String(),
		"slow_call_rate_threshold": o.SlowCallRateThreshold, "connect_timeout": o.ConnectTimeout.String(), "open_duration": o.OpenDuration.String(),
		"open_duration_multiplier": o.OpenDurationMultiplier, "max_open_duration": o.MaxOpenDuration.String(), "jitter": o.Jitter,
		"half_open_probes": o.HalfOpenProbes, "half_open_success_threshold": o.HalfOpenSuccessThreshold, "probe_timeout": o.ProbeTimeout.String(),
		"reject_errno": policy.ErrnoName(o.RejectErrno), "count_abandoned": o.CountAbandoned, "reset_failure_window": o.ResetFailureWindow.String(),
		"max_connections": o.MaxConnections, "max_connecting": o.MaxConnecting, "bulkhead_reject_errno": policy.ErrnoName(o.BulkheadRejectErrno),
		"close_established": o.CloseEstablished,
	}
	responseOptions(m, &o.Responses)
	return m
}

// CircuitsPage returns up to limit circuits (1..PageSize; other values
// mean PageSize) whose names sort after after, in name order, and whether
// more follow. The daemon's lock is held only to copy names and then the
// chosen circuits' in-memory state; sorting, kernel reads and encoding
// happen outside it. The sorted names are kept: a first page (after "")
// sorts them again only when the set of circuits changed since
// (registry.version); a later page uses them as they are for up to
// pagesStale, so a walk through every page sorts them once, not once a
// page: it lists the circuits there were when some first page (its own,
// or another client's up to pagesStale before) sorted them, less those
// gone since. The tick drops names no page asked for in pagesIdle.
func (d *Daemon) CircuitsPage(after string, limit int) (_ []CircuitInfo, more bool) {
	if limit <= 0 || limit > PageSize {
		limit = PageSize
	}
	all := d.sortedNames(after != "")
	i, found := slices.BinarySearch(all, after)
	if found {
		i++
	}
	names := all[i:]
	if len(names) > limit {
		names, more = names[:limit], true
	}
	snaps := make([]circuitSnap, 0, len(names))
	d.mu.Lock()
	now := d.now()
	for _, name := range names {
		if c, ok := d.reg.Get(name); ok { // it may have gone in between
			snaps = append(snaps, d.snap(c, now))
		}
	}
	d.mu.Unlock()
	out := make([]CircuitInfo, 0, len(snaps))
	var namer cgroupNamer
	for _, s := range snaps {
		out = append(out, d.complete(s, &namer))
	}
	return out, more
}

// sortedNames returns the names of every circuit, sorted: the kept list
// while the set of circuits is unchanged (or, with stale, whenever there
// is one), else a new one. The slice is shared: do not change it.
func (d *Daemon) sortedNames(stale bool) []string {
	// Under the lock only copies: a named circuit's name, a dynamic one's
	// destination (its name is made outside).
	d.mu.Lock()
	version := d.reg.Version
	d.pages.mu.Lock()
	d.pages.used = time.Now()
	if d.pages.names != nil && (d.pages.version == version || stale && time.Since(d.pages.at) < pagesStale) {
		names := d.pages.names
		d.pages.mu.Unlock()
		d.mu.Unlock()
		return names
	}
	d.pages.mu.Unlock()
	at := time.Now()
	named := make([]string, 0, len(d.reg.ByName))
	for name := range d.reg.ByName {
		named = append(named, name)
	}
	type dyn struct {
		dst      maps.Dest
		workload string
	}
	dynamic := make([]dyn, 0, d.reg.Dynamic)
	for c := range d.reg.All() {
		if !c.IsNamed() {
			dynamic = append(dynamic, dyn{c.First(), c.Workload()})
		}
	}
	d.mu.Unlock()
	names := make([]string, 0, len(named)+len(dynamic))
	names = append(names, named...)
	for _, x := range dynamic {
		names = append(names, engine.Classed(engine.DynamicName(x.dst), x.workload))
	}
	slices.Sort(names)
	d.pages.mu.Lock()
	d.pages.names, d.pages.version, d.pages.at = names, version, at
	d.pages.mu.Unlock()
	return names
}

const (
	// pagesStale is how long a walk's later pages may use names sorted
	// for an earlier first page.
	pagesStale = 10 * time.Second
	// pagesIdle is how long sorted names are kept with no page asking
	// (a million of them take tens of MiB).
	pagesIdle = 30 * time.Second
)

// dropIdlePages forgets the sorted names once no page asked for them in
// pagesIdle.
func (d *Daemon) dropIdlePages() {
	d.pages.mu.Lock()
	defer d.pages.mu.Unlock()
	if d.pages.names != nil && time.Since(d.pages.used) >= pagesIdle {
		d.pages.names = nil
	}
}

// Circuits returns every circuit's state, sorted by name, page by page.
func (d *Daemon) Circuits() []CircuitInfo {
	out := []CircuitInfo{}
	after := ""
	for {
		page, more := d.CircuitsPage(after, PageSize)
		out = append(out, page...)
		if !more || len(page) == 0 {
			return out
		}
		after = page[len(page)-1].Name
	}
}

// Circuit returns one circuit's state.
func (d *Daemon) Circuit(name string) (CircuitInfo, bool) {
	d.mu.Lock()
	c, ok := d.reg.Get(name)
	var s circuitSnap
	if ok {
		s = d.snap(c, d.now())
	}
	d.mu.Unlock()
	if !ok {
		return CircuitInfo{}, false
	}
	return d.complete(s, &cgroupNamer{}), true
}

// Events returns the recent transitions, oldest first.
func (d *Daemon) Events() []TransitionEvent {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.events.list()
}

// ErrNoCircuit is returned for an unknown circuit name.
var ErrNoCircuit = errors.New("no such circuit")

// Force applies an operator's change to a circuit: "open", "close",
// "release" (back to the configured behaviour) or "reset".
func (d *Daemon) Force(name, action string) (CircuitInfo, error) {
	d.mu.Lock()
	c, ok := d.reg.Get(name)
	if !ok {
		d.mu.Unlock()
		return CircuitInfo{}, fmt.Errorf("%w: %s", ErrNoCircuit, quote(name))
	}
	now := d.now()
	var t policy.Transition
	switch action {
	case "open":
		d.eng.EnsureID(c) // its verdict needs one (none free: it waits, unenforced)
		t = c.Machine.Override(now, policy.ForceOpen)
		d.eng.KeepOverride(c, policy.ForceOpen)
	case "close":
		t = c.Machine.Override(now, policy.ForceClosed)
		d.eng.KeepOverride(c, policy.ForceClosed)
	case "release":
		t = c.Machine.Override(now, policy.NoOverride)
		d.eng.KeepOverride(c, policy.NoOverride)
	case "reset":
		t = c.Machine.Reset(now)
	default:
		d.mu.Unlock()
		return CircuitInfo{}, fmt.Errorf("unknown action %s (open, close, release, reset)", quote(action))
	}
	d.reg.Track(c)
	d.eng.WriteVerdicts(c, t)
	d.opened(c, t.From, t.To, now)
	d.metrics.transitions.WithLabelValues(t.From.String(), t.To.String(), string(t.Reason), c.Workload()).Inc()
	d.log.Info("circuit changed by hand", "circuit", c.Name(), "action", action, "from", t.From.String(), "to", t.To.String())
	d.events.add(TransitionEvent{Time: now, Circuit: c.Name(), Target: c.Target(), Workload: c.Workload(), From: t.From.String(), To: t.To.String(), Reason: string(t.Reason)})
	if t.From != t.To && t.To == policy.Closed {
		d.eng.ReleaseID(c)
	}
	s := d.snap(c, now)
	d.mu.Unlock()
	return d.complete(s, &cgroupNamer{}), nil
}

// quote returns s quoted, cut to maxQuoted bytes: errors never repeat
// unbounded client input.
func quote(s string) string {
	if len(s) <= maxQuoted {
		return strconv.Quote(s)
	}
	cut := maxQuoted
	for cut > 0 && !utf8Start(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s… (%d bytes)", strconv.Quote(s[:cut]), len(s))
}

func utf8Start(b byte) bool { return b&0xC0 != 0x80 }

type apiError struct {
	Error string `json:"error"`
}

// writeJSON encodes v in full before writing, so a response has a
// Content-Length and never ends half-written because encoding failed.
func writeJSON(w http.ResponseWriter, code int, v any) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		code = http.StatusInternalServerError
		buf.Reset()
		fmt.Fprintf(&buf, "{\"error\": %q}\n", "encoding the response: "+err.Error())
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(buf.Len()))
	w.WriteHeader(code)
	_, _ = w.Write(buf.Bytes())
}

func writeError(w http.ResponseWriter, code int, format string, args ...any) {
	writeJSON(w, code, apiError{fmt.Sprintf(format, args...)})
}

// decodeAction reads a change request's body: exactly one JSON object
// with exactly one key, "action" (exact case), whose value is a string,
// and nothing after it but white space. encoding/json alone would accept
// "Action", a repeated key and trailing data.
func decodeAction(body io.Reader) (string, error) {
	dec := json.NewDecoder(body)
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil {
		return "", err
	} else if tok != json.Delim('{') {
		return "", errors.New("the body is not a JSON object")
	}
	action, seen := "", false
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return "", err
		}
		key, _ := tok.(string)
		if key != "action" {
			return "", fmt.Errorf("unknown field %s (the only field is \"action\")", quote(key))
		}
		if seen {
			return "", errors.New("field \"action\" given twice")
		}
		seen = true
		tok, err = dec.Token()
		if err != nil {
			return "", err
		}
		s, ok := tok.(string)
		if !ok {
			return "", errors.New("\"action\" must be a string")
		}
		action = s
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return "", err
	}
	if !seen {
		return "", errors.New("no \"action\" field")
	}
	if _, err := dec.Token(); err != io.EOF {
		return "", errors.New("trailing data after the JSON object")
	}
	return action, nil
}

// exposure says who may read circuits, destinations and events on a
// server.
type exposure int

const (
	// exposeAll: the unix socket (root only): everything, changes too.
	exposeAll exposure = iota
	// exposeTCP: metrics and health to anyone who reaches the port;
	// circuits, destinations and events to loopback clients or with the
	// bearer token; changes only with the bearer token.
	exposeTCP
)

// handler builds the admin API of one server.
func (d *Daemon) handler(exp exposure, token []byte) http.Handler {
	mux := http.NewServeMux()
	heavy := newRequestLimit(heavyRequests, clientHeavyRequests)
	limited := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if phase := d.startPhase(); phase != "" {
				w.Header().Set("Retry-After", "1")
				writeError(w, http.StatusServiceUnavailable, "breakerd is starting (%s); retry", phase)
				return
			}
			release, err := heavy.take(clientOf(r))
			if err != nil {
				w.Header().Set("Retry-After", "1")
				writeError(w, http.StatusServiceUnavailable, "%s; retry", err)
				return
			}
			defer release()
			h(w, r)
		}
	}
	authorized := func(r *http.Request) bool {
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		return ok && len(token) > 0 && subtle.ConstantTimeCompare([]byte(got), token) == 1
	}
	// details guards what is not for everyone on a non-loopback address.
	details := func(h http.HandlerFunc) http.HandlerFunc {
		return limited(func(w http.ResponseWriter, r *http.Request) {
			if exp == exposeTCP && !fromLoopback(r) && !authorized(r) {
				writeError(w, http.StatusForbidden, "circuits, destinations and events are served to loopback clients, on the unix socket, or with the bearer token (--admin-token-file)")
				return
			}
			h(w, r)
		})
	}
	route := func(pattern string, byMethod map[string]http.HandlerFunc) {
		var allowed []string
		for m := range byMethod {
			allowed = append(allowed, m)
			if m == http.MethodGet {
				allowed = append(allowed, http.MethodHead)
			}
		}
		slices.Sort(allowed)
		allow := strings.Join(allowed, ", ")
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			m := r.Method
			if m == http.MethodHead {
				m = http.MethodGet
			}
			h, ok := byMethod[m]
			if !ok {
				w.Header().Set("Allow", allow)
				writeError(w, http.StatusMethodNotAllowed, "method %s is not allowed here (%s)", quote(r.Method), allow)
				return
			}
			h(w, r)
		})
	}
	metrics := promhttp.HandlerFor(d.metrics.reg, promhttp.HandlerOpts{})
	route("/metrics", map[string]http.HandlerFunc{http.MethodGet: limited(metrics.ServeHTTP)})
	route("/healthz", map[string]http.HandlerFunc{http.MethodGet: d.serveHealthz})
	route("/readyz", map[string]http.HandlerFunc{http.MethodGet: d.serveReadyz})
	route("/v1/circuits", map[string]http.HandlerFunc{http.MethodGet: details(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		limit := PageSize
		if s := q.Get("limit"); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 1 || n > PageSize {
				writeError(w, http.StatusBadRequest, "limit %s is not a number from 1 to %d", quote(s), PageSize)
				return
			}
			limit = n
		}
		after := q.Get("after")
		page, more := d.CircuitsPage(after, limit)
		if more {
			next := url.Values{"after": {page[len(page)-1].Name}, "limit": {strconv.Itoa(limit)}}
			w.Header().Set("Link", "</v1/circuits?"+next.Encode()+`>; rel="next"`)
		}
		writeJSON(w, http.StatusOK, page)
	})})
	route("/v1/circuits/{name...}", map[string]http.HandlerFunc{
		http.MethodGet: details(func(w http.ResponseWriter, r *http.Request) {
			name := r.PathValue("name")
			if ci, ok := d.Circuit(name); ok {
				writeJSON(w, http.StatusOK, ci)
				return
			}
			writeError(w, http.StatusNotFound, "no circuit named %s", quote(name))
		}),
		http.MethodPost: limited(func(w http.ResponseWriter, r *http.Request) {
			if exp != exposeAll {
				if len(token) == 0 {
					writeError(w, http.StatusForbidden, "changes are served only on the admin unix socket (or with --admin-token-file)")
					return
				}
				if !authorized(r) {
					writeError(w, http.StatusUnauthorized, "missing or wrong bearer token")
					return
				}
			}
			action, err := decodeAction(http.MaxBytesReader(w, r.Body, maxBody))
			if err != nil {
				writeError(w, http.StatusBadRequest, "body must be {\"action\": \"open|close|release|reset\"}: %s", err)
				return
			}
			ci, err := d.Force(r.PathValue("name"), action)
			switch {
			case errors.Is(err, ErrNoCircuit):
				writeError(w, http.StatusNotFound, "%s", err)
			case err != nil:
				writeError(w, http.StatusBadRequest, "%s", err)
			default:
				writeJSON(w, http.StatusOK, ci)
			}
		}),
	})
	route("/v1/events", map[string]http.HandlerFunc{http.MethodGet: details(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, d.Events())
	})})
	// The status page (ui.go): static files with no data in them, served
	// to anyone; its data calls go through the routes above.
	route("/{$}", map[string]http.HandlerFunc{http.MethodGet: serveUI})
	route("/ui/{file}", map[string]http.HandlerFunc{http.MethodGet: serveUI})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no endpoint %s", quote(r.URL.Path))
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.RequestURI == "*" { // ServeMux would answer 400 with no body
			writeError(w, http.StatusBadRequest, "no endpoint *")
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// fromLoopback reports whether the request came from this host's loopback.
func fromLoopback(r *http.Request) bool {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	return err == nil && ap.Addr().Unmap().IsLoopback()
}

type adminServers struct {
	servers   []*http.Server
	listeners []net.Listener // listeners[i] is served by servers[i], once serve runs
	socket    *adminSocket
	tcp       net.Addr // the TCP listener's address, once listening
	probe     net.Addr // the probe listener's address, once listening
}

// serve starts serving on the listeners startAdmin opened.
func (a *adminServers) serve() {
	for i, s := range a.servers {
		go s.Serve(a.listeners[i])
	}
}

func (a *adminServers) shutdown() {
	for i, s := range a.servers {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if s.Shutdown(ctx) != nil {
			_ = s.Close()
		}
		cancel()
		_ = a.listeners[i].Close() // never served (a failed start)
	}
	if a.socket != nil {
		a.socket.remove()
	}
}

// newServer is an http.Server with every timeout set: a client that sends
// slowly, reads slowly or idles loses its connection.
func newServer(h http.Handler, conns *connLimit) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       30 * time.Second,
		MaxHeaderBytes:    16 << 10,
		ConnState:         conns.track,
		ConnContext:       withConn,
	}
}

// startAdmin opens the probe listener, and the admin API on the TCP
// address and on the unix socket, each with its own server, connection
// limit and request limit. It runs before the kernel side is touched, so a
// bad address, socket path or token file stops the start-up with nothing
// loaded; serve starts serving (at once: the probes answer while the
// start-up goes on, probes.go).
func (d *Daemon) startAdmin() (*adminServers, error) {
	a := &adminServers{}
	var token []byte
	if d.opts.TokenFile != "" {
		t, err := os.ReadFile(d.opts.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("reading admin token: %w", err)
		}
		token = []byte(strings.TrimSpace(string(t)))
		if len(token) == 0 {
			return nil, fmt.Errorf("admin token file %s is empty", d.opts.TokenFile)
		}
	}
	if d.opts.ProbeAddr != "" {
		l, err := net.Listen("tcp", d.opts.ProbeAddr)
		if err != nil {
			return nil, fmt.Errorf("probe address: %w", err)
		}
		a.probe = l.Addr()
		conns := newConnLimit(l, probeConns, nil)
		a.servers = append(a.servers, newProbeServer(d.probeHandler(), conns))
		a.listeners = append(a.listeners, conns)
		d.log.Info("probes listening", "addr", l.Addr().String())
	}
	if d.opts.AdminAddr != "" {
		l, err := net.Listen("tcp", d.opts.AdminAddr)
		if err != nil {
			a.shutdown()
			return nil, fmt.Errorf("admin address: %w", err)
		}
		a.tcp = l.Addr()
		d.log.Info("admin API listening", "addr", l.Addr().String())
		conns := newConnLimit(l, tcpConns, func(c net.Conn) bool {
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetWriteBuffer(tcpSendBuffer)
			}
			return true
		})
		s := newServer(d.handler(exposeTCP, token), conns)
		a.servers = append(a.servers, s)
		a.listeners = append(a.listeners, conns)
	}
	if d.opts.AdminSocket != "" {
		sock, err := listenAdminSocket(d.opts.AdminSocket)
		if err != nil {
			a.shutdown()
			return nil, err
		}
		a.socket = sock
		conns := newConnLimit(sock.l, socketConns, func(c net.Conn) bool {
			if err := peerIsRoot(c); err != nil {
				d.log.Warn("admin socket: connection refused", "err", err)
				return false
			}
			return true
		})
		s := newServer(d.handler(exposeAll, nil), conns)
		a.servers = append(a.servers, s)
		a.listeners = append(a.listeners, conns)
	}
	return a, nil
}

// isUnenforced reports whether c is a rejecting circuit whose verdicts the
// kernel does not all have yet (engine.Engine.Unenforced). The caller
// holds d.mu.
func (d *Daemon) isUnenforced(c *circuit) bool { return d.eng.Unenforced(c) }
