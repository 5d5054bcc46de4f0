package admin

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/api"
)

// fakeBackend is a daemon with one circuit, svc, always live and ready.
type fakeBackend struct{}

func (fakeBackend) Starting() string              { return "" }
func (fakeBackend) Live() (bool, time.Duration)   { return true, 0 }
func (fakeBackend) Ready() (bool, any)            { return true, nil }
func (fakeBackend) Metrics() http.Handler         { return http.NotFoundHandler() }
func (fakeBackend) Events() []api.TransitionEvent { return []api.TransitionEvent{} }
func (fakeBackend) Circuit(name string) (api.CircuitInfo, bool) {
	return api.CircuitInfo{Name: "svc"}, name == "svc"
}
func (b fakeBackend) CircuitsPage(after string, limit int) ([]api.CircuitInfo, bool) {
	if after != "" {
		return nil, false
	}
	return []api.CircuitInfo{{Name: "svc"}}, false
}
func (fakeBackend) Force(name, action string) (api.CircuitInfo, error) {
	return api.CircuitInfo{}, ErrNoCircuit
}

// do serves one request through h, from remote if given.
func do(t *testing.T, h http.Handler, method, target, body string, remote ...string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(method, target, strings.NewReader(body))
	if len(remote) > 0 {
		req.RemoteAddr = remote[0]
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}
