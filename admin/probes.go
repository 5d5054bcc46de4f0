package admin

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"
)

// The health probes are what the kubelet restarts and routes by, so no
// other client may hold them up, and they answer from the moment a port is
// open:
//
//   - They read no kernel state and take no lock that anything slow holds:
//     /healthz reads the heartbeat's time, /readyz the readiness flag and
//     the start-up phase, all atomics.
//   - Every admin listener evicts clients that have sent no whole request
//     when it is full (connLimit), so connections that send nothing or
//     dribble a header cannot keep a probe in the accept queue.
//   - --probe-addr opens a listener of their own, which the DaemonSet's
//     probes use: it serves nothing else (no slot there is held by a scrape
//     or a page that a client does not read), answers one request per
//     connection with a response that fits any socket buffer, and closes.
//     Per-address limits would not help here: in a pod the kubelet's probes
//     come from the node's address, as any local user's connections do.
//   - The servers serve from the moment the daemon's New opens the ports: while New is
//     still loading, adopting or waiting on DNS and the Kubernetes API,
//     /readyz answers 503 naming what it waits on and /healthz answers 200
//     "starting" (every wait of the start-up is bounded; restarting would
//     only begin it again), and the API's other endpoints answer 503.

// serveHealthz answers the liveness probe: healthy while the heartbeat is
// fresh (heartbeat.go), or while starting.
func serveHealthz(b Backend) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if phase := b.Starting(); phase != "" {
			writeJSON(w, http.StatusOK, map[string]string{"status": "starting", "phase": phase})
			return
		}
		if ok, age := b.Live(); !ok {
			writeJSON(w, http.StatusInternalServerError, map[string]string{"status": "heartbeat stale", "heartbeat_age": age.Round(time.Millisecond).String()})
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	}
}

// serveReadyz answers the readiness probe: ready once running with
// protection in place and the heartbeat written.
func serveReadyz(b Backend) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if phase := b.Starting(); phase != "" {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "reason": "starting: " + phase})
			return
		}
		if ok, problems := b.Ready(); !ok {
			body := map[string]any{"status": "not ready"}
			if problems != nil {
				body["problems"] = problems // what the ground check found, so a probe's log says why
			}
			writeJSON(w, http.StatusServiceUnavailable, body)
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
	}
}

// probeHandler serves the probe listener: /healthz and /readyz, GET or
// HEAD, and nothing else.
func probeHandler(b Backend) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", serveHealthz(b))
	mux.HandleFunc("GET /readyz", serveReadyz(b))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "the probe listener serves only GET /healthz and /readyz")
	})
	return mux
}

// probeConns caps the probe listener's connections. Each lives for one
// request, and the ones that have sent no whole request are evicted for
// new ones, so the cap bounds descriptors, not probes.
const probeConns = 32

// newProbeServer serves the probe listener: one small request a
// connection, answered at once, short timeouts.
func newProbeServer(h http.Handler, conns *connLimit) *http.Server {
	s := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 2 * time.Second,
		ReadTimeout:       2 * time.Second,
		WriteTimeout:      2 * time.Second,
		MaxHeaderBytes:    4 << 10,
		ConnState:         conns.track,
	}
	s.SetKeepAlivesEnabled(false)
	return s
}

// connKey is the request context's key of the connection it came on.
type connKey struct{}

// withConn keeps the connection in its requests' context (the server's
// ConnContext), for clientOf.
func withConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// clientOf names the client of r for the per-client request limit.
func clientOf(r *http.Request) string {
	if c, ok := r.Context().Value(connKey{}).(*limitedConn); ok {
		return c.clientKey()
	}
	return r.RemoteAddr
}

// requestLimit bounds requests in flight, in all and per client.
type requestLimit struct {
	mu        sync.Mutex
	total     int
	max, each int
	byClient  map[string]int
}

func newRequestLimit(max, each int) *requestLimit {
	return &requestLimit{max: max, each: each, byClient: map[string]int{}}
}

// take counts a request of client, or says why it cannot be served now.
func (l *requestLimit) take(client string) (release func(), _ error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byClient[client] >= l.each {
		return nil, fmt.Errorf("this client (%s) has %d admin requests in flight already", client, l.each)
	}
	if l.total >= l.max {
		return nil, fmt.Errorf("too many admin requests at once")
	}
	l.total++
	l.byClient[client]++
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.total--
			if l.byClient[client]--; l.byClient[client] == 0 {
				delete(l.byClient, client)
			}
		})
	}, nil
}
