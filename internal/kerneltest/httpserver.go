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
