// Package admin serves breakerd's admin API, its health probes and its
// status page over HTTP: on a TCP address, on a unix socket only root may
// use, and on a listener of the probes' own. It holds no state of the
// daemon: it asks a Backend, which the daemon implements, and it bounds
// what any client can hold (connections, requests in flight, bytes
// unread), so no local user can starve the probes or the scrape.
package admin

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/breakerd/breakerd/api"
)

// Bounds of the admin API.
const (
	// PageSize is the most circuits one GET /v1/circuits returns; more
	// are fetched with ?after=NAME (the Link header names the next page).
	PageSize = 1000
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
	// MaxConns is the most connections the servers hold open together.
	MaxConns = tcpConns + socketConns + probeConns
	// tcpSendBuffer caps the kernel's send buffer of each TCP connection,
	// so unread responses cannot pile up in socket memory.
	tcpSendBuffer = 64 << 10
)

// ErrNoCircuit is what Backend.Force wraps for an unknown circuit name
// (404).
var ErrNoCircuit = errors.New("no such circuit")

// Backend is the daemon as the admin API sees it. Its methods are called
// from the servers' goroutines, concurrently; the probes' (Starting, Live,
// Ready) must not wait on anything slow.
type Backend interface {
	// Starting says what the start-up is doing, or "" once it is over.
	Starting() string
	// Live reports whether the heartbeat is fresh, and its age.
	Live() (ok bool, heartbeatAge time.Duration)
	// Ready reports whether protection is in place; when it is not,
	// problems says why (nil when nothing more is known).
	Ready() (ok bool, problems any)
	// Metrics serves the Prometheus scrape.
	Metrics() http.Handler
	// CircuitsPage returns up to limit circuits whose names sort after
	// after, in name order, and whether more follow.
	CircuitsPage(after string, limit int) (_ []api.CircuitInfo, more bool)
	// Circuit returns one circuit by name.
	Circuit(name string) (api.CircuitInfo, bool)
	// Force applies an operator's action (open, close, release, reset)
	// to a circuit; an unknown name is ErrNoCircuit.
	Force(name, action string) (api.CircuitInfo, error)
	// Events returns the recent transitions, oldest first.
	Events() []api.TransitionEvent
}

// Config says where the servers listen.
type Config struct {
	// ProbeAddr is the probes' own TCP listener ("" for none).
	ProbeAddr string
	// AdminAddr is the admin API's TCP address ("" for none).
	AdminAddr string
	// AdminSocket is the admin API's unix socket path ("" for none).
	AdminSocket string
	// TokenFile holds the bearer token that allows changes, and details
	// to non-loopback clients, on AdminAddr ("" for none).
	TokenFile string
	// Log is where the servers log.
	Log *slog.Logger
}

// Quote returns s quoted, cut to maxQuoted bytes: errors never repeat
// unbounded client input.
func Quote(s string) string {
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
			return "", fmt.Errorf("unknown field %s (the only field is \"action\")", Quote(key))
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

// Exposure says who may read circuits, destinations and events on a
// server.
type Exposure int

const (
	// ExposeAll is the unix socket's (root only): everything, changes too.
	ExposeAll Exposure = iota
	// ExposeTCP is the TCP address's: metrics and health to anyone who
	// reaches the port; circuits, destinations and events to loopback
	// clients or with the bearer token; changes only with the bearer
	// token.
	ExposeTCP
)

// Handler builds the admin API of one server over b: what exp lets its
// clients see, and changes for holders of token (ExposeAll: everyone).
func Handler(b Backend, exp Exposure, token []byte) http.Handler {
	mux := http.NewServeMux()
	heavy := newRequestLimit(heavyRequests, clientHeavyRequests)
	limited := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if phase := b.Starting(); phase != "" {
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
			if exp == ExposeTCP && !fromLoopback(r) && !authorized(r) {
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
				writeError(w, http.StatusMethodNotAllowed, "method %s is not allowed here (%s)", Quote(r.Method), allow)
				return
			}
			h(w, r)
		})
	}
	metrics := b.Metrics()
	route("/metrics", map[string]http.HandlerFunc{http.MethodGet: limited(metrics.ServeHTTP)})
	route("/healthz", map[string]http.HandlerFunc{http.MethodGet: serveHealthz(b)})
	route("/readyz", map[string]http.HandlerFunc{http.MethodGet: serveReadyz(b)})
	route("/v1/circuits", map[string]http.HandlerFunc{http.MethodGet: details(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		limit := PageSize
		if s := q.Get("limit"); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 1 || n > PageSize {
				writeError(w, http.StatusBadRequest, "limit %s is not a number from 1 to %d", Quote(s), PageSize)
				return
			}
			limit = n
		}
		after := q.Get("after")
		page, more := b.CircuitsPage(after, limit)
		if more {
			next := url.Values{"after": {page[len(page)-1].Name}, "limit": {strconv.Itoa(limit)}}
			w.Header().Set("Link", "</v1/circuits?"+next.Encode()+`>; rel="next"`)
		}
		writeJSON(w, http.StatusOK, page)
	})})
	route("/v1/circuits/{name...}", map[string]http.HandlerFunc{
		http.MethodGet: details(func(w http.ResponseWriter, r *http.Request) {
			name := r.PathValue("name")
			if ci, ok := b.Circuit(name); ok {
				writeJSON(w, http.StatusOK, ci)
				return
			}
			writeError(w, http.StatusNotFound, "no circuit named %s", Quote(name))
		}),
		http.MethodPost: limited(func(w http.ResponseWriter, r *http.Request) {
			if exp != ExposeAll {
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
			ci, err := b.Force(r.PathValue("name"), action)
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
		writeJSON(w, http.StatusOK, b.Events())
	})})
	// The status page (ui.go): static files with no data in them, served
	// to anyone; its data calls go through the routes above.
	route("/{$}", map[string]http.HandlerFunc{http.MethodGet: serveUI})
	route("/ui/{file}", map[string]http.HandlerFunc{http.MethodGet: serveUI})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no endpoint %s", Quote(r.URL.Path))
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

// Servers are the admin servers Start opened: the probe listener, the
// admin API on TCP and on the unix socket, each with its own connection
// and request limits.
type Servers struct {
	servers   []*http.Server
	listeners []net.Listener // listeners[i] is served by servers[i], once serve runs
	socket    *adminSocket
	tcp       net.Addr // the TCP listener's address, once listening
	probe     net.Addr // the probe listener's address, once listening
}

// TCPAddr is the admin API's TCP address, nil without one.
func (a *Servers) TCPAddr() net.Addr { return a.tcp }

// ProbeAddr is the probe listener's address, nil without one.
func (a *Servers) ProbeAddr() net.Addr { return a.probe }

// Serve starts serving on the listeners Start opened.
func (a *Servers) Serve() {
	for i, s := range a.servers {
		go s.Serve(a.listeners[i])
	}
}

// Shutdown stops the servers (each given 2 s to finish its requests),
// closes the listeners and removes the unix socket if it is still ours.
func (a *Servers) Shutdown() {
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

// Start opens the probe listener, and the admin API on the TCP address and
// on the unix socket, as cfg asks. The daemon calls it before the kernel
// side is touched, so a bad address, socket path or token file stops the
// start-up with nothing loaded; Serve starts serving (at once: the probes
// answer while the start-up goes on, probes.go).
func Start(cfg Config, b Backend) (*Servers, error) {
	a := &Servers{}
	var token []byte
	if cfg.TokenFile != "" {
		t, err := os.ReadFile(cfg.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("reading admin token: %w", err)
		}
		token = []byte(strings.TrimSpace(string(t)))
		if len(token) == 0 {
			return nil, fmt.Errorf("admin token file %s is empty", cfg.TokenFile)
		}
	}
	if cfg.ProbeAddr != "" {
		l, err := net.Listen("tcp", cfg.ProbeAddr)
		if err != nil {
			return nil, fmt.Errorf("probe address: %w", err)
		}
		a.probe = l.Addr()
		conns := newConnLimit(l, probeConns, nil)
		a.servers = append(a.servers, newProbeServer(probeHandler(b), conns))
		a.listeners = append(a.listeners, conns)
		cfg.Log.Info("probes listening", "addr", l.Addr().String())
	}
	if cfg.AdminAddr != "" {
		l, err := net.Listen("tcp", cfg.AdminAddr)
		if err != nil {
			a.Shutdown()
			return nil, fmt.Errorf("admin address: %w", err)
		}
		a.tcp = l.Addr()
		cfg.Log.Info("admin API listening", "addr", l.Addr().String())
		conns := newConnLimit(l, tcpConns, func(c net.Conn) bool {
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetWriteBuffer(tcpSendBuffer)
			}
			return true
		})
		s := newServer(Handler(b, ExposeTCP, token), conns)
		a.servers = append(a.servers, s)
		a.listeners = append(a.listeners, conns)
	}
	if cfg.AdminSocket != "" {
		sock, err := listenAdminSocket(cfg.AdminSocket)
		if err != nil {
			a.Shutdown()
			return nil, err
		}
		a.socket = sock
		conns := newConnLimit(sock.l, socketConns, func(c net.Conn) bool {
			if err := peerIsRoot(c); err != nil {
				cfg.Log.Warn("admin socket: connection refused", "err", err)
				return false
			}
			return true
		})
		s := newServer(Handler(b, ExposeAll, nil), conns)
		a.servers = append(a.servers, s)
		a.listeners = append(a.listeners, conns)
	}
	return a, nil
}
