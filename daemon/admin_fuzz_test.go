package daemon

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// FuzzAdminRequest sends raw HTTP requests to the admin API's handlers
// (the socket's and the TCP one, from loopback or not) of a running
// daemon. Whatever the request: no panic, a known status, a JSON error
// body of bounded size quoting at most a little of the input, Allow on
// 405, and a change applied only for a body that is exactly one
// {"action": "..."} object with a valid action.
func FuzzAdminRequest(f *testing.F) {
	long := strings.Repeat("x", 900<<10)
	for _, seed := range []string{
		"GET /v1/circuits HTTP/1.1\r\nHost: b\r\n\r\n",
		"GET /v1/circuits?limit=0&after=zzz HTTP/1.1\r\nHost: b\r\n\r\n",
		"GET /v1/circuits?limit=-1 HTTP/1.1\r\nHost: b\r\n\r\n",
		"GET /v1/circuits/svc HTTP/1.1\r\nHost: b\r\n\r\n",
		"GET /v1/events HTTP/1.1\r\nHost: b\r\n\r\n",
		"GET /readyz HTTP/1.1\r\nHost: b\r\n\r\n",
		"DELETE /v1/circuits/svc HTTP/1.1\r\nHost: b\r\n\r\n",
		"PUT /v1/circuits HTTP/1.1\r\nHost: b\r\n\r\n",
		"POST /v1/circuits/svc HTTP/1.1\r\nHost: b\r\nContent-Length: 17\r\n\r\n{\"action\":\"open\"}",
		"POST /v1/circuits/svc HTTP/1.1\r\nHost: b\r\nContent-Length: 35\r\n\r\n{\"action\":\"open\"}{\"action\":\"close\"}",
		"POST /v1/circuits/svc HTTP/1.1\r\nHost: b\r\nContent-Length: 17\r\n\r\n{\"Action\":\"open\"}",
		"POST /v1/circuits/svc HTTP/1.1\r\nHost: b\r\nContent-Length: 36\r\n\r\n{\"action\":\"open\",\"action\":\"close\"}",
		"POST /v1/circuits/svc HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer s3cret\r\nContent-Length: 20\r\n\r\n{\"action\":\"release\"}",
		"POST /v1/circuits/a%3Fb HTTP/1.1\r\nHost: b\r\nContent-Length: 18\r\n\r\n{\"action\":\"close\"}",
		"POST /v1/circuits/" + long + " HTTP/1.1\r\nHost: b\r\nContent-Length: 17\r\n\r\n{\"action\":\"open\"}",
		"GET /v1/circuits/" + long + " HTTP/1.1\r\nHost: b\r\n\r\n",
		"GET /" + long + " HTTP/1.1\r\nHost: b\r\n\r\n",
		"POST /v1/circuits/svc HTTP/1.1\r\nHost: b\r\nContent-Length: 4000\r\n\r\n{\"action\":\"" + strings.Repeat("o", 3980) + "\"}",
	} {
		f.Add([]byte(seed), byte(0))
		f.Add([]byte(seed), byte(3))
	}
	fx := newFixture(f, svcConfig)
	fx.start()
	handlers := []http.Handler{fx.d.handler(exposeAll, nil), fx.d.handler(exposeTCP, nil), fx.d.handler(exposeTCP, []byte("s3cret"))}
	f.Fuzz(func(t *testing.T, raw []byte, how byte) {
		req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(raw)))
		if err != nil {
			return // the server answers 400 before any handler
		}
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return
		}
		req.Body = io.NopCloser(bytes.NewReader(body))
		req.RemoteAddr = "127.0.0.1:4000"
		if how&4 != 0 {
			req.RemoteAddr = "192.0.2.9:4000"
		}
		rec := httptest.NewRecorder()
		handlers[int(how&3)%len(handlers)].ServeHTTP(rec, req)
		switch rec.Code {
		case 200, 400, 401, 403, 404, 405, 503:
		case 301, 307, 308: // ServeMux cleaning a path
			return
		default:
			t.Fatalf("status %d for %q", rec.Code, raw[:min(len(raw), 200)])
		}
		if rec.Code == 405 && rec.Header().Get("Allow") == "" {
			t.Fatal("405 without Allow")
		}
		if rec.Code != 200 {
			var e apiError
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error == "" {
				t.Fatalf("error body %q: %v", rec.Body.String(), err)
			}
			if len(e.Error) > 400 {
				t.Fatalf("error of %d bytes for a %d-byte request", len(e.Error), len(raw))
			}
			return
		}
		if req.Method != http.MethodPost {
			return
		}
		// A change was applied: the body must have been exactly one
		// object {"action": one of the four}.
		var m map[string]json.RawMessage
		dec := json.NewDecoder(bytes.NewReader(body))
		if err := dec.Decode(&m); err != nil || dec.More() || len(m) != 1 {
			t.Fatalf("a change applied for body %q", body)
		}
		var action string
		if err := json.Unmarshal(m["action"], &action); err != nil {
			t.Fatalf("a change applied for body %q", body)
		}
		switch action {
		case "open", "close", "release", "reset":
		default:
			t.Fatalf("a change applied for action %q", action)
		}
	})
}
