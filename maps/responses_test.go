package maps

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// waitResponses returns the Response and NoResponse records for port
// once there are n of them (or after the timeout, whatever there is).
func (w *watcher) waitResponses(port uint16, n int, timeout time.Duration) []Event {
	var out []Event
	kerneltest.WaitFor(timeout, func() bool {
		out = responses(w.wait(port, 0, 0))
		return len(out) >= n
	})
	return out
}

// responses are the Response and NoResponse records among evs.
func responses(evs []Event) []Event {
	var out []Event
	for _, e := range evs {
		if e.Outcome == Response || e.Outcome == NoResponse {
			out = append(out, e)
		}
	}
	return out
}

func statuses(evs []Event) []string {
	var out []string
	for _, e := range evs {
		switch {
		case e.Outcome == NoResponse:
			out = append(out, fmt.Sprintf("no_response(peer=%v,%v)", e.PeerClosed, e.Err))
		case e.HTTP:
			out = append(out, fmt.Sprint(e.Status))
		default:
			out = append(out, "-")
		}
	}
	return out
}

func (e *env) followResponses(t *testing.T, port uint16, f ResponseFlags) {
	t.Helper()
	if err := e.k.PutLimit(e.dest(port, false), Limit{Slot: 7, Responses: f}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
}

// requests runs a keep-alive client (Go's net/http, in a helper process
// in the cgroup) that makes reqs in order, and returns its statuses.
func (e *env) requests(t *testing.T, port uint16, timeout time.Duration, reqs ...kerneltest.HTTPRequest) []kerneltest.DialResult {
	t.Helper()
	return e.dial(t, e.cg, kerneltest.DialSpec{Op: "keepalive", Addr: e.dest(port, false).Addr, Timeout: timeout, Requests: reqs})
}

func gets(paths ...string) []kerneltest.HTTPRequest {
	var out []kerneltest.HTTPRequest
	for _, p := range paths {
		out = append(out, kerneltest.HTTPRequest{Path: p})
	}
	return out
}

// TestHTTPStatusFromTheKernel: a keep-alive client (Go's net/http) makes
// several requests over one connection, and the kernel reports one
// response per request with its status, whatever the segments: a status
// line split in two, a body (plain, chunked, many segments) holding status
// lines, HEAD, 100 Continue; a slow answer is timed from its request.
func TestHTTPStatusFromTheKernel(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8080)
	e.followResponses(t, 8080, RespTimed|RespHTTP)
	reqs := gets("/ok", "/503", "/split", "/429", "/404", "/chunked", "/big", "/slow")
	reqs = append(reqs, kerneltest.HTTPRequest{Method: "HEAD", Path: "/404"},
		kerneltest.HTTPRequest{Method: "POST", Path: "/503", Body: strings.Repeat("x", 2000), Expect100: true})
	for i, r := range e.requests(t, 8080, 5*time.Second, reqs...) {
		if r.Errno != 0 {
			t.Fatalf("request %d (%s): %v", i, reqs[i].Path, r.Errno)
		}
	}
	// The 1xx is a turn of its own; the final status is the next turn's,
	// after the body.
	want := []string{"200", "503", "503", "429", "404", "200", "200", "200", "404", "100", "503"}
	evs := w.waitResponses(8080, len(want), 5*time.Second)
	if got := statuses(evs); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("statuses %v, want %v", got, want)
	}
	cookie := evs[0].Cookie
	for i, ev := range evs {
		if ev.Cookie != cookie || ev.Count != uint32(i+1) {
			t.Errorf("response %d: cookie %d turn %d, want one connection (cookie %d) and turn %d", i, ev.Cookie, ev.Count, cookie, i+1)
		}
	}
	if d := evs[7].Duration; d < 150*time.Millisecond || d > 2*time.Second {
		t.Errorf("slow answer timed %v, want about 150ms", d)
	}
	if d := evs[0].Duration; d > 100*time.Millisecond {
		t.Errorf("quick answer timed %v", d)
	}

}

// TestResponseTimingWithoutParsing: a target without protocol http is
// timed, turn by turn, and nothing is read from its bytes.
func TestResponseTimingWithoutParsing(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8081)
	e.followResponses(t, 8081, RespTimed)
	e.requests(t, 8081, 5*time.Second, gets("/503", "/slow")...)
	evs := w.waitResponses(8081, 2, 5*time.Second)
	if got := statuses(evs); strings.Join(got, " ") != "- -" {
		t.Fatalf("records %v, want two responses without a status", got)
	}
	if evs[1].Duration < 150*time.Millisecond {
		t.Errorf("slow answer timed %v", evs[1].Duration)
	}
}

// TestAwaitingAndNoResponse: a request that never gets an answer is in
// the inflight map from its first byte, with its start; when the client
// gives up the connection's end reports it (not the peer's doing) and the
// entry goes. A reset before the first response byte is the peer's.
func TestAwaitingAndNoResponse(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8082)
	e.followResponses(t, 8082, RespTimed|RespHTTP|RespInflight)
	start := Now()
	e.requests(t, 8082, time.Second, gets("/never")...) // the client gives up after 1 s
	evs := w.waitResponses(8082, 1, 5*time.Second)
	if got := statuses(evs); strings.Join(got, " ") != "no_response(peer=false,errno 0)" {
		t.Fatalf("records %v, want one no_response the client caused", got)
	}
	if d := evs[0].Duration; d < 900*time.Millisecond || d > 3*time.Second {
		t.Errorf("no_response after %v, want about the client's 1s", d)
	}
	if a, err := e.k.Awaiting(nil); err != nil || len(a) != 0 {
		t.Errorf("inflight after the close: %v %v, want none", a, err)
	}

	// While it waits, the request is listed with its start.
	p := e.topo.Client.StartDial(t, e.cg, kerneltest.DialSpec{Op: "keepalive", Addr: e.dest(8082, false).Addr, Timeout: 5 * time.Second, Requests: gets("/never")})
	var a []Awaiting
	kerneltest.WaitFor(3*time.Second, func() bool { a, _ = e.k.Awaiting(nil); return len(a) == 1 && a[0].Since != 0 })
	if len(a) != 1 || a[0].Dest != e.dest(8082, false) || a[0].Turn != 1 || a[0].Since < start || a[0].Probe {
		t.Fatalf("awaiting %+v, want one request to %v", a, e.dest(8082, false))
	}
	_ = p.Cmd.Process.Kill()
	_ = p.Cmd.Wait()
	if !kerneltest.WaitFor(3*time.Second, func() bool { a, _ = e.k.Awaiting(nil); return len(a) == 0 }) {
		t.Fatalf("inflight after the client was killed: %+v", a)
	}

	e.requests(t, 8082, 5*time.Second, gets("/reset-before")...)
	e.requests(t, 8082, 5*time.Second, gets("/reset-during")...)
	e.requests(t, 8082, 5*time.Second, gets("/close-before")...)
	evs = w.waitResponses(8082, 5, 5*time.Second)
	got := statuses(evs)
	if g := strings.Join(got[len(got)-4:], " "); g != fmt.Sprintf("no_response(peer=false,errno 0) no_response(peer=true,%v) 200 no_response(peer=true,errno 0)", syscall.ECONNRESET) {
		t.Fatalf("records %v: want the reset before any answer as the peer's no_response, then a 200, then the close before any answer as the peer's", got)
	}
	var resets int
	for _, ev := range w.wait(8082, 100, 200*time.Millisecond) {
		if ev.Outcome == Reset {
			resets++
		}
	}
	if resets != 1 {
		t.Errorf("%d reset records, want 1 (the reset during a response; the one before it is the no_response)", resets)
	}
}
