package kerneltest

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/sony/gobreaker/v2"
	"golang.org/x/sys/unix"
)

// ErrBreakerOpen is the Errno a "loop" helper reports for a request its
// in-process library breaker turned away.
const ErrBreakerOpen = unix.ECANCELED

// httpOnce makes one HTTP/1.0 request on a new connection and returns its
// status, or the errno of what failed (ETIMEDOUT for a timeout).
func httpOnce(addr string, timeout time.Duration) (int, unix.Errno) {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return 0, netErrno(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout + 5*time.Second))
	if _, err := c.Write([]byte("GET / HTTP/1.0\r\nHost: bench\r\n\r\n")); err != nil {
		return 0, netErrno(err)
	}
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return 0, netErrno(err)
	}
	f := strings.Fields(line)
	if len(f) < 2 {
		return 0, unix.EPROTO
	}
	status, _ := strconv.Atoi(f[1])
	for {
		if _, err := r.ReadString('\n'); err != nil {
			break
		}
	}
	return status, 0
}

func netErrno(err error) unix.Errno {
	var e unix.Errno
	if errors.As(err, &e) {
		return e
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return unix.ETIMEDOUT
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return unix.ETIMEDOUT
	}
	return unix.EIO
}

func runHTTP(spec DialSpec) []DialResult {
	addr := spec.Addr.String()
	res := make([]DialResult, spec.Count)
	for i := range res {
		t0 := time.Now()
		status, errno := httpOnce(addr, spec.Timeout)
		res[i] = DialResult{Nanos: time.Since(t0).Nanoseconds(), Status: status, Errno: errno}
	}
	return res
}

// runPaced makes one "http" request for each byte it reads from standard
// input and writes its result as one JSON line, until standard input ends:
// a test that alternates such helpers in different cgroups compares their
// requests pair by pair, each made while the others wait.
func runPaced(spec DialSpec) int {
	addr := spec.Addr.String()
	in := bufio.NewReader(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	enc := json.NewEncoder(out)
	for {
		if _, err := in.ReadByte(); err != nil {
			return 0
		}
		t0 := time.Now()
		status, errno := httpOnce(addr, spec.Timeout)
		if err := enc.Encode(DialResult{Nanos: time.Since(t0).Nanoseconds(), Status: status, Errno: errno}); err != nil {
			return 2
		}
		if err := out.Flush(); err != nil {
			return 2
		}
	}
}

// runLoop makes a request every Interval for For, each in its own
// goroutine so a slow one does not delay the next, as a client with a
// steady request rate does.
func runLoop(spec DialSpec) []DialResult {
	addr := spec.Addr.String()
	var cb *gobreaker.CircuitBreaker[int]
	if spec.Breaker == "gobreaker" {
		cb = gobreaker.NewCircuitBreaker[int](gobreaker.Settings{
			Name:        "bench",
			MaxRequests: 1,
			Timeout:     spec.BreakerOpen,
			ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= spec.BreakerFailures },
		})
	}
	n := int(spec.For / spec.Interval)
	res := make([]DialResult, n)
	done := make(chan struct{}, n)
	tick := time.NewTicker(spec.Interval)
	defer tick.Stop()
	for i := 0; i < n; i++ {
		if i > 0 {
			<-tick.C
		}
		go func(i int) {
			defer func() { done <- struct{}{} }()
			t0 := time.Now()
			r := DialResult{Start: t0.UnixNano()}
			if cb == nil {
				r.Status, r.Errno = httpOnce(addr, spec.Timeout)
			} else {
				status, err := cb.Execute(func() (int, error) {
					s, e := httpOnce(addr, spec.Timeout)
					if e != 0 {
						return 0, e
					}
					if s >= 500 {
						return s, errors.New("server error")
					}
					return s, nil
				})
				r.Status = status
				switch {
				case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
					r.Errno = ErrBreakerOpen
				case err != nil:
					r.Errno = netErrno(err)
				}
			}
			r.Nanos = time.Since(t0).Nanoseconds()
			res[i] = r
		}(i)
	}
	for i := 0; i < n; i++ {
		<-done
	}
	return res
}

// runKeepAlive makes spec.Requests in order through one net/http client:
// its pool keeps the connection alive from one request to the next.
func runKeepAlive(spec DialSpec) []DialResult {
	tr := &http.Transport{MaxIdleConnsPerHost: 1, ExpectContinueTimeout: 5 * time.Second, DisableCompression: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: spec.Timeout}
	res := make([]DialResult, len(spec.Requests)*spec.Count)
	for i := range res {
		rq := spec.Requests[i%len(spec.Requests)]
		method := rq.Method
		if method == "" {
			method = http.MethodGet
		}
		var body io.Reader
		if rq.Body != "" {
			body = strings.NewReader(rq.Body)
		}
		req, err := http.NewRequest(method, "http://"+spec.Addr.String()+rq.Path, body)
		if err != nil {
			res[i].Errno = unix.EINVAL
			continue
		}
		if rq.Expect100 {
			req.Header.Set("Expect", "100-continue")
		}
		t0 := time.Now()
		resp, err := client.Do(req)
		res[i].Nanos = time.Since(t0).Nanoseconds()
		if err != nil {
			res[i].Errno = netErrno(err)
			continue
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		res[i].Status = resp.StatusCode
		if err != nil {
			res[i].Errno = netErrno(err)
		}
	}
	return res
}
