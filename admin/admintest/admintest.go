// Package admintest serves requests to the admin API's handlers in tests,
// without a listener.
package admintest

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// Do serves one request through h, from remote if given (a client's
// address, "192.0.2.1:1234"; the recorder's default otherwise).
func Do(t testing.TB, h http.Handler, method, target, body string, remote ...string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(method, target, strings.NewReader(body))
	if len(remote) > 0 {
		req.RemoteAddr = remote[0]
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}
