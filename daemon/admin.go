package daemon

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/breakerd/breakerd/policy"
)

// CircuitInfo is one circuit as /v1/circuits reports it.
type CircuitInfo struct {
	Name                string         `json:"name"`
	Target              string         `json:"target"`
	Scope               string         `json:"scope"`
	State               string         `json:"state"`
	FailureRate         float64        `json:"failure_rate"`
	SlowRate            float64        `json:"slow_rate"`
	Calls               int            `json:"calls"`
	Failures            int            `json:"failures"`
	Slow                int            `json:"slow"`
	ConsecutiveFailures int            `json:"consecutive_failures"`
	OpenUntil           time.Time      `json:"open_until,omitzero"`
	ProbesLeft          *int32         `json:"probes_left,omitempty"`
	Trip                int            `json:"trip"`
	Destinations        []string       `json:"destinations"`
	CircuitID           uint32         `json:"circuit_id"`
	Rejected            uint64         `json:"rejected"`
	ShadowRejected      uint64         `json:"shadow_rejected"`
	BulkheadRejected    uint64         `json:"bulkhead_rejected"`
	Connections         int64          `json:"connections"`
	Connecting          int64          `json:"connecting"`
	Options             map[string]any `json:"options"`
}

func (d *Daemon) info(c *circuit, now time.Time) CircuitInfo {
	st := c.c.Status(now)
	scope := string(c.scope)
	if c.target == allTarget {
		scope = "dynamic"
	}
	ci := CircuitInfo{Name: c.name, Target: c.target, Scope: scope, State: st.State.String(),
		FailureRate: st.FailureRate, SlowRate: st.SlowRate, Calls: st.Calls, Failures: st.Failures, Slow: st.Slow,
		ConsecutiveFailures: st.ConsecutiveFailures, OpenUntil: st.OpenUntil, Trip: st.Trip, CircuitID: c.id,
		Options: optionsMap(c.c.Options())}
	for _, dst := range c.dests {
		ci.Destinations = append(ci.Destinations, dst.String())
		if v, ok, err := d.k.Verdict(dst); err == nil && ok && ci.ProbesLeft == nil {
			tokens := max(v.Tokens, 0)
			ci.ProbesLeft = &tokens
		}
	}
	sortStringsSlice(ci.Destinations)
	if cnt, err := d.k.Counters(c.id); err == nil {
		ci.Rejected, ci.ShadowRejected, ci.BulkheadRejected = cnt.Rejected, cnt.ShadowRejected, cnt.BulkheadRejected
	}
	if b, err := d.k.BulkCount(c.id); err == nil {
		ci.Connections, ci.Connecting = b.Connections, b.Connecting
	}
	return ci
}

func optionsMap(o *policy.Options) map[string]any {
	return map[string]any{
		"failure_rate_threshold": o.FailureRateThreshold, "window_size": o.WindowSize, "window_duration": o.WindowDuration.String(),
		"min_requests": o.MinRequests, "consecutive_failures": o.ConsecutiveFailures, "slow_call_duration": o.SlowCallDuration.String(),
		"slow_call_rate_threshold": o.SlowCallRateThreshold, "connect_timeout": o.ConnectTimeout.String(), "open_duration": o.OpenDuration.String(),
		"open_duration_multiplier": o.OpenDurationMultiplier, "max_open_duration": o.MaxOpenDuration.String(), "jitter": o.Jitter,
		"half_open_probes": o.HalfOpenProbes, "half_open_success_threshold": o.HalfOpenSuccessThreshold, "probe_timeout": o.ProbeTimeout.String(),
		"reject_errno": policy.ErrnoName(o.RejectErrno), "count_abandoned": o.CountAbandoned,
		"max_connections": o.MaxConnections, "max_connecting": o.MaxConnecting, "bulkhead_reject_errno": policy.ErrnoName(o.BulkheadRejectErrno),
	}
}

// Circuits returns every circuit's state, sorted by name.
func (d *Daemon) Circuits() []CircuitInfo {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := d.now()
	var out []CircuitInfo
	for _, c := range d.sortedCircuits() {
		out = append(out, d.info(c, now))
	}
	return out
}

// Events returns the recent transitions, oldest first.
func (d *Daemon) Events() []TransitionEvent {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]TransitionEvent(nil), d.events...)
}

// ErrNoCircuit is returned for an unknown circuit name.
var ErrNoCircuit = errors.New("no such circuit")

// Force applies an operator's change to a circuit: "open", "close",
// "release" (back to the configured behaviour) or "reset".
func (d *Daemon) Force(name, action string) (CircuitInfo, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	c, ok := d.reg.byName[name]
	if !ok {
		return CircuitInfo{}, fmt.Errorf("%w: %q", ErrNoCircuit, name)
	}
	now := d.now()
	var t policy.Transition
	switch action {
	case "open":
		t = c.c.Override(now, policy.ForceOpen)
	case "close":
		t = c.c.Override(now, policy.ForceClosed)
	case "release":
		t = c.c.Override(now, policy.NoOverride)
	case "reset":
		t = c.c.Reset(now)
	default:
		return CircuitInfo{}, fmt.Errorf("unknown action %q (open, close, release, reset)", action)
	}
	d.writeVerdicts(c, t)
	d.metrics.transitions.WithLabelValues(t.From.String(), t.To.String(), string(t.Reason)).Inc()
	d.log.Info("circuit changed by hand", "circuit", c.name, "action", action, "from", t.From.String(), "to", t.To.String())
	d.events = append(d.events, TransitionEvent{Time: now, Circuit: c.name, Target: c.target, From: t.From.String(), To: t.To.String(), Reason: string(t.Reason)})
	return d.info(c, now), nil
}

type adminServers struct{ servers []*http.Server }

func (a *adminServers) shutdown() {
	for _, s := range a.servers {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = s.Shutdown(ctx)
		cancel()
	}
}

// startAdmin serves the admin API on the loopback TCP address (read-only
// unless the bearer token is given) and on the unix socket (everything,
// mode 0600).
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
	if d.opts.AdminAddr != "" {
		l, err := net.Listen("tcp", d.opts.AdminAddr)
		if err != nil {
			return nil, fmt.Errorf("admin address: %w", err)
		}
		s := &http.Server{Handler: d.handler(false, token), ReadHeaderTimeout: 5 * time.Second}
		a.servers = append(a.servers, s)
		go s.Serve(l)
	}
	if d.opts.AdminSocket != "" {
		if err := os.MkdirAll(filepath.Dir(d.opts.AdminSocket), 0o700); err != nil {
			a.shutdown()
			return nil, fmt.Errorf("admin socket directory: %w", err)
		}
		_ = os.Remove(d.opts.AdminSocket)
		l, err := net.Listen("unix", d.opts.AdminSocket)
		if err != nil {
			a.shutdown()
			return nil, fmt.Errorf("admin socket: %w", err)
		}
		if err := os.Chmod(d.opts.AdminSocket, 0o600); err != nil {
			l.Close()
			a.shutdown()
			return nil, fmt.Errorf("admin socket mode: %w", err)
		}
		s := &http.Server{Handler: d.handler(true, nil), ReadHeaderTimeout: 5 * time.Second}
		a.servers = append(a.servers, s)
		go s.Serve(l)
	}
	return a, nil
}

type apiError struct {
	Error string `json:"error"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// handler builds the admin API. On the socket every call is allowed; over
// TCP the mutating ones need the bearer token (and are refused when none is
// configured).
func (d *Daemon) handler(socket bool, token []byte) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(d.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		d.mu.Lock()
		ready := d.ready && !d.lastBeat.IsZero()
		d.mu.Unlock()
		if !ready {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready"})
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
	})
	mux.HandleFunc("GET /v1/circuits", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, d.Circuits())
	})
	mux.HandleFunc("GET /v1/circuits/{name...}", func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		for _, c := range d.Circuits() {
			if c.Name == name {
				writeJSON(w, http.StatusOK, c)
				return
			}
		}
		writeJSON(w, http.StatusNotFound, apiError{fmt.Sprintf("no circuit named %q", name)})
	})
	mux.HandleFunc("GET /v1/events", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, d.Events())
	})
	mux.HandleFunc("POST /v1/circuits/{name...}", func(w http.ResponseWriter, r *http.Request) {
		if !socket {
			if len(token) == 0 {
				writeJSON(w, http.StatusForbidden, apiError{"changes are served only on the admin unix socket (or with --admin-token-file)"})
				return
			}
			got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !ok || subtle.ConstantTimeCompare([]byte(got), token) != 1 {
				writeJSON(w, http.StatusUnauthorized, apiError{"missing or wrong bearer token"})
				return
			}
		}
		var body struct {
			Action string `json:"action"`
		}
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&body); err != nil {
			writeJSON(w, http.StatusBadRequest, apiError{"body must be {\"action\": \"open|close|release|reset\"}: " + err.Error()})
			return
		}
		ci, err := d.Force(r.PathValue("name"), body.Action)
		switch {
		case errors.Is(err, ErrNoCircuit):
			writeJSON(w, http.StatusNotFound, apiError{err.Error()})
		case err != nil:
			writeJSON(w, http.StatusBadRequest, apiError{err.Error()})
		default:
			writeJSON(w, http.StatusOK, ci)
		}
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusNotFound, apiError{fmt.Sprintf("no endpoint %s %s", r.Method, r.URL.Path)})
	})
	return mux
}
