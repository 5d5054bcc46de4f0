package kerneltest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// HTTPServer is a small HTTP/1.1 server whose answers are written by hand,
// segment by segment, so a test chooses where a status line and a body
// fall. Each path is one case:
//
//	/ok            200 whose body holds a status line ("HTTP/1.1 500 …")
//	/503 /429 /404 that status
//	/slow          200 after 150 ms
//	/split         503 with its status line in two segments, 30 ms apart
//	/chunked       200, chunked, chunks in segments of their own holding status lines
//	/big           200 with a body of about 200 KB holding status lines
//	/never         no answer, until the client goes
//	/close-before  the connection closed (FIN) before any answer
//	/reset-before  a reset before any answer
//	/reset-during  200 with a partial body, then a reset
//
// and, each before the path's answer (200, or FailWith's status), one or
// more informational (1xx) responses:
//
//	/continue      an unsolicited 100 Continue, a segment of its own
//	/early-hints   103 Early Hints with two Link headers, the answer 100 ms later
//	/one-segment   100 Continue, 103 Early Hints and the answer in one segment
//	/split-hints   103 Early Hints in segments split inside its blank line
//	               ("…\r" "\n\r" "\n" + "HTTP/1.1 5"…), the answer's status
//	               line split too
//	/long-hints    103 Early Hints with 40 Link headers (about 2.5 KB) and the
//	               answer in one segment
//	/hints-slow    103 Early Hints at once, the answer 600 ms later
//	/continue-close 100 Continue, then the connection closed (FIN)
//	/upgrade       101 Switching Protocols, then every byte echoed back
//
// A CONNECT is answered 200, a tunnel to nowhere: every byte is echoed back.
// A request with "Expect: 100-continue" gets a 100 Continue first. FailWith
// makes every request answer one status instead.
type HTTPServer struct {
	fail atomic.Int32
}

// FailWith makes every request answered with code (0: each path's own
// answer again).
func (s *HTTPServer) FailWith(code int) { s.fail.Store(int32(code)) }

// ServeHTTPCases runs an HTTPServer on port of the host until the test ends.
func (h *Host) ServeHTTPCases(tb testing.TB, port uint16) *HTTPServer {
	s := &HTTPServer{}
	h.Serve(tb, port, func(c *net.TCPConn) {
		defer c.Close()
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			if req.Header.Get("Expect") == "100-continue" {
				if _, err := io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n"); err != nil {
					return
				}
			}
			if _, err := io.Copy(io.Discard, req.Body); err != nil {
				return
			}
			if !s.answer(c, req) {
				return
			}
		}
	})
	return s
}

func (s *HTTPServer) answer(c *net.TCPConn, req *http.Request) bool {
	keep := "" // an HTTP/1.0 client (ab -k) asks for keep-alive and is told
	if req.ProtoMinor == 0 && strings.EqualFold(req.Header.Get("Connection"), "keep-alive") {
		keep = "Connection: keep-alive\r\n"
	}
	simple := func(code int, body string) bool {
		_, err := fmt.Fprintf(c, "HTTP/1.1 %d %s\r\n%sContent-Length: %d\r\n\r\n", code, http.StatusText(code), keep, len(body))
		if err == nil && req.Method != http.MethodHead {
			_, err = io.WriteString(c, body)
		}
		return err == nil
	}
	final := func(code int) bool {
		if f := s.fail.Load(); f != 0 {
			code = int(f)
		}
		return simple(code, "final")
	}
	// writes writes each part as a segment of its own (the connection has
	// TCP_NODELAY, Go's default, and the parts are apart in time).
	writes := func(parts ...string) bool {
		for i, p := range parts {
			if i > 0 {
				time.Sleep(20 * time.Millisecond)
			}
			if _, err := io.WriteString(c, p); err != nil {
				return false
			}
		}
		return true
	}
	const hints = "HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload; as=style\r\nLink: </app.js>; rel=preload; as=script\r\n\r\n"
	if req.Method == http.MethodConnect {
		if !writes("HTTP/1.1 200 Connection Established\r\n\r\n") {
			return false
		}
		_, _ = io.Copy(c, c)
		return false
	}
	switch req.URL.Path {
	case "/continue":
		return writes("HTTP/1.1 100 Continue\r\n\r\n") && final(200)
	case "/early-hints":
		if !writes(hints) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
		return final(200)
	case "/one-segment":
		code := 200
		if f := s.fail.Load(); f != 0 {
			code = int(f)
		}
		return writes(fmt.Sprintf("HTTP/1.1 100 Continue\r\n\r\n%sHTTP/1.1 %d %s\r\n%sContent-Length: 0\r\n\r\n",
			hints, code, http.StatusText(code), keep))
	case "/split-hints":
		code := 200
		if f := s.fail.Load(); f != 0 {
			code = int(f)
		}
		line := fmt.Sprintf("HTTP/1.1 %d %s\r\n%sContent-Length: 0\r\n\r\n", code, http.StatusText(code), keep)
		return writes("HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload; as=style\r",
			"\n\r", "\n"+line[:10], line[10:])
	case "/hints-slow":
		if !writes(hints) {
			return false
		}
		time.Sleep(600 * time.Millisecond)
		return final(200)
	case "/long-hints":
		code := 200
		if f := s.fail.Load(); f != 0 {
			code = int(f)
		}
		var b strings.Builder
		b.WriteString("HTTP/1.1 103 Early Hints\r\n")
		for i := range 40 {
			fmt.Fprintf(&b, "Link: </assets/chunk-%02d.js>; rel=preload; as=script\r\n", i)
		}
		fmt.Fprintf(&b, "\r\nHTTP/1.1 %d %s\r\n%sContent-Length: 0\r\n\r\n", code, http.StatusText(code), keep)
		return writes(b.String())
	case "/continue-close":
		_ = writes("HTTP/1.1 100 Continue\r\n\r\n")
		return false
	case "/upgrade":
		if !writes("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n") {
			return false
		}
		_, _ = io.Copy(c, c)
		return false
	}
	if code := s.fail.Load(); code != 0 {
		return simple(int(code), "failing")
	}
	switch req.URL.Path {
	case "/ok":
		return simple(200, "HTTP/1.1 500 Internal Server Error\r\n")
	case "/503":
		return simple(503, "down")
	case "/429":
		return simple(429, "slow down")
	case "/404":
		return simple(404, "no such thing")
	case "/slow":
		time.Sleep(150 * time.Millisecond)
		return simple(200, "late")
	case "/split":
		if _, err := io.WriteString(c, "HTTP/1.1 5"); err != nil {
			return false
		}
		time.Sleep(30 * time.Millisecond)
		_, err := io.WriteString(c, "03 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
		return err == nil
	case "/chunked":
		if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"); err != nil {
			return false
		}
		for _, chunk := range []string{"HTTP/1.1 500 x\r\n", "more", "HTTP/1.1 503 y"} {
			time.Sleep(10 * time.Millisecond)
			if _, err := fmt.Fprintf(c, "%x\r\n%s\r\n", len(chunk), chunk); err != nil {
				return false
			}
		}
		time.Sleep(10 * time.Millisecond)
		_, err := io.WriteString(c, "0\r\n\r\n")
		return err == nil
	case "/big":
		return simple(200, strings.Repeat("HTTP/1.1 500 in the body\r\n", 8000))
	case "/never":
		_, _ = io.Copy(io.Discard, c)
		return false
	case "/close-before":
		return false
	case "/reset-before":
		_ = c.SetLinger(0)
		return false
	case "/reset-during":
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\npartial")
		time.Sleep(20 * time.Millisecond)
		_ = c.SetLinger(0)
		return false
	}
	return simple(400, "unknown case")
}
