package admin

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
)

func TestDecodeActionIsStrict(t *testing.T) {
	for _, c := range []struct{ body, action, err string }{
		{`{"action":"open"}`, "open", ""},
		{" {\"action\" : \"close\"}\n\t ", "close", ""},
		{`{"action":"open"}{"action":"close"}`, "", "trailing data"},
		{`{"action":"open"} x`, "", "trailing data"},
		{`{"Action":"open"}`, "", `unknown field "Action"`},
		{`{"ACTION":"open"}`, "", `unknown field "ACTION"`},
		{`{"action":"open","action":"close"}`, "", "given twice"},
		{`{"action":"open","verb":"x"}`, "", `unknown field "verb"`},
		{`{"action":1}`, "", "must be a string"},
		{`{"action":{"x":1}}`, "", "must be a string"},
		{`{"action":null}`, "", "must be a string"},
		{`{}`, "", `no "action"`},
		{`[]`, "", "not a JSON object"},
		{`"open"`, "", "not a JSON object"},
		{``, "", "EOF"},
		{`{"action":"open"`, "", "EOF"},
		{`{"action":"open",}`, "", "invalid character"},
		{`{"` + strings.Repeat("k", 3000) + `":1}`, "", "(3000 bytes)"},
	} {
		got, err := decodeAction(strings.NewReader(c.body))
		if c.err == "" {
			if err != nil || got != c.action {
				t.Errorf("%q: %q %v, want %q", c.body, got, err, c.action)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("%q: %q %v, want an error with %q", c.body, got, err, c.err)
		}
		if err != nil && len(err.Error()) > 200 {
			t.Errorf("%q: error of %d bytes", c.body[:min(len(c.body), 40)], len(err.Error()))
		}
	}
}

func TestQuoteIsBounded(t *testing.T) {
	if q := Quote("a?b"); q != `"a?b"` {
		t.Fatalf("short: %s", q)
	}
	q := Quote(strings.Repeat("é", 500000))
	if len(q) > maxQuoted+40 || !strings.Contains(q, "(1000000 bytes)") || !strings.HasPrefix(q, `"éé`) {
		t.Fatalf("long: %s", q)
	}
}

// TestHandlerHostileRequests: what the servers answer whatever the daemon
// holds. Bodies that are not exactly one action apply nothing; other
// methods get 405 with Allow; no error repeats a long name; non-loopback
// TCP clients see metrics and health but not circuits or events unless
// they hold the token, and change nothing without it.
func TestHandlerHostileRequests(t *testing.T) {
	b := &fakeBackend{}
	sock := Handler(b, ExposeAll, nil)
	tcp := Handler(b, ExposeTCP, nil)

	for _, body := range []string{`{"action":"open"}{"action":"close"}`, `{"Action":"open"}`, `{"action":"open","action":"close"}`, `[]`, ``} {
		if rec := do(t, sock, "POST", "/v1/circuits/svc", body); rec.Code != http.StatusBadRequest {
			t.Errorf("POST %q: %d %s", body, rec.Code, rec.Body.String())
		}
	}
	if rec := do(t, sock, "POST", "/v1/circuits/other", `{"action":"open"}`); rec.Code != http.StatusNotFound {
		t.Errorf("POST to an unknown circuit: %d", rec.Code)
	}
	if rec := do(t, sock, "POST", "/v1/circuits/svc", `{"action":"open"}`); rec.Code != http.StatusOK {
		t.Errorf("POST open on the socket: %d %s", rec.Code, rec.Body.String())
	}
	if got := b.forces(); !slices.Equal(got, []string{"open"}) {
		t.Fatalf("forces applied: %q, want only the one well-formed request's", got)
	}

	for _, c := range []struct{ method, path, allow string }{
		{"DELETE", "/v1/circuits/svc", "GET, HEAD, POST"},
		{"PUT", "/v1/circuits", "GET, HEAD"},
		{"POST", "/metrics", "GET, HEAD"},
		{"PATCH", "/v1/events", "GET, HEAD"},
		{"POST", "/healthz", "GET, HEAD"},
	} {
		rec := do(t, sock, c.method, c.path, "")
		var e apiError
		if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != c.allow || json.Unmarshal(rec.Body.Bytes(), &e) != nil {
			t.Errorf("%s %s: %d Allow %q %s", c.method, c.path, rec.Code, rec.Header().Get("Allow"), rec.Body.String())
		}
	}

	long := strings.Repeat("x", 900<<10)
	for _, rec := range []*httptest.ResponseRecorder{
		do(t, sock, "GET", "/v1/circuits/"+long, ""),
		do(t, sock, "POST", "/v1/circuits/"+long, `{"action":"open"}`),
		do(t, sock, "GET", "/nothing/"+long, ""),
		do(t, sock, "GET", "/v1/circuits?limit="+long, ""),
	} {
		if rec.Code/100 != 4 || rec.Body.Len() > 300 {
			t.Errorf("long name: %d, %d bytes", rec.Code, rec.Body.Len())
		}
	}

	remote := "192.0.2.7:40000"
	for _, p := range []string{"/v1/circuits", "/v1/circuits/svc", "/v1/events"} {
		if rec := do(t, tcp, "GET", p, "", remote); rec.Code != http.StatusForbidden {
			t.Errorf("remote GET %s: %d", p, rec.Code)
		}
		if rec := do(t, tcp, "GET", p, "", "127.0.0.1:40000"); rec.Code != http.StatusOK {
			t.Errorf("loopback GET %s: %d", p, rec.Code)
		}
	}
	for _, p := range []string{"/metrics", "/healthz", "/readyz"} {
		if rec := do(t, tcp, "GET", p, "", remote); rec.Code != http.StatusOK {
			t.Errorf("remote GET %s: %d", p, rec.Code)
		}
	}
	if rec := do(t, tcp, "POST", "/v1/circuits/svc", `{"action":"close"}`, "127.0.0.1:40000"); rec.Code != http.StatusForbidden {
		t.Errorf("POST on TCP without a token configured: %d", rec.Code)
	}
	withToken := Handler(b, ExposeTCP, []byte("s3cret"))
	for _, c := range []struct {
		auth string
		code int
	}{{"", http.StatusUnauthorized}, {"Bearer wrong", http.StatusUnauthorized}, {"Bearer s3cret", http.StatusOK}} {
		req := httptest.NewRequest("POST", "/v1/circuits/svc", strings.NewReader(`{"action":"close"}`))
		req.RemoteAddr = remote
		if c.auth != "" {
			req.Header.Set("Authorization", c.auth)
		}
		rec := httptest.NewRecorder()
		withToken.ServeHTTP(rec, req)
		if rec.Code != c.code {
			t.Errorf("remote POST with %q: %d, want %d", c.auth, rec.Code, c.code)
		}
	}
	req := httptest.NewRequest("GET", "/v1/circuits", nil)
	req.RemoteAddr = remote
	req.Header.Set("Authorization", "Bearer s3cret")
	rec := httptest.NewRecorder()
	withToken.ServeHTTP(rec, req)
	if rec.Code != http.StatusOK {
		t.Errorf("remote GET with the token: %d", rec.Code)
	}
	if got := b.forces(); !slices.Equal(got, []string{"open", "close"}) {
		t.Fatalf("forces applied: %q, want open, then the token holder's close", got)
	}
}

// TestProbesFollowTheBackend: /healthz and /readyz on the API and on the
// probe listener answer from the backend's state: starting (200 and 503
// naming the phase, other endpoints 503), a stale heartbeat (500), not
// ready (503 with the problems), and the probe listener serves nothing
// else.
func TestProbesFollowTheBackend(t *testing.T) {
	for _, c := range []struct {
		name                   string
		b                      *fakeBackend
		healthz, readyz, pages int
		want                   string
	}{
		{"running", &fakeBackend{}, 200, 200, 200, `"ready"`},
		{"starting", &fakeBackend{starting: "waiting on DNS"}, 200, 503, 503, "waiting on DNS"},
		{"stale heartbeat", &fakeBackend{stale: true}, 500, 200, 200, `"ready"`},
		{"not ready", &fakeBackend{notReady: true}, 200, 503, 200, "pins removed"},
	} {
		for _, h := range []http.Handler{Handler(c.b, ExposeAll, nil), probeHandler(c.b)} {
			if rec := do(t, h, "GET", "/healthz", ""); rec.Code != c.healthz {
				t.Errorf("%s: /healthz %d, want %d", c.name, rec.Code, c.healthz)
			}
			if rec := do(t, h, "GET", "/readyz", ""); rec.Code != c.readyz || !strings.Contains(rec.Body.String(), c.want) {
				t.Errorf("%s: /readyz %d %s, want %d with %s", c.name, rec.Code, rec.Body.String(), c.readyz, c.want)
			}
		}
		if rec := do(t, Handler(c.b, ExposeAll, nil), "GET", "/v1/circuits", ""); rec.Code != c.pages {
			t.Errorf("%s: /v1/circuits %d, want %d", c.name, rec.Code, c.pages)
		}
		for _, p := range []string{"/metrics", "/v1/circuits", "/"} {
			if rec := do(t, probeHandler(c.b), "GET", p, ""); rec.Code != http.StatusNotFound {
				t.Errorf("%s: the probe listener served GET %s: %d", c.name, p, rec.Code)
			}
		}
	}
}
