package kerneltest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Stream is a "stream" client helper: it connects (and closes) again and
// again, one connect every Interval, and reports each result as it happens,
// until Close. A test moves it between cgroups (Cgroup.AddProc with PID)
// to see when a cgroup's protection begins.
type Stream struct {
	// Results has every connect's result, in order, with its Start.
	Results <-chan DialResult
	p       *Process
	in      io.WriteCloser
	err     *LogBuffer
}

// StartStream starts a "stream" client helper inside cg and the host,
// connecting to spec.Addr every spec.Interval (0: back to back); it ends
// with the test or at Close. Results not read in time are dropped: a test
// reads them all along.
func (h *Host) StartStream(tb testing.TB, cg *Cgroup, spec DialSpec) *Stream {
	tb.Helper()
	spec.Op = "stream"
	p, in, out, errOut := h.startPiped(tb, cg, spec)
	res := make(chan DialResult, 1<<16)
	go func() {
		defer close(res)
		dec := json.NewDecoder(bufio.NewReader(out))
		for {
			var r DialResult
			if err := dec.Decode(&r); err != nil {
				return
			}
			select {
			case res <- r:
			default:
			}
		}
	}()
	return &Stream{Results: res, p: p, in: in, err: errOut}
}

// PID is the helper's process id.
func (s *Stream) PID() int { return s.p.Cmd.Process.Pid }

// Close ends the helper and waits for it.
func (s *Stream) Close() error {
	s.in.Close()
	if err := s.p.Cmd.Wait(); err != nil {
		return fmt.Errorf("stream helper: %w (stderr: %s)", err, s.err.String())
	}
	return nil
}

// runStream connects every spec.Interval and writes each result as one
// JSON line, until standard input ends.
func runStream(spec DialSpec) int {
	stop := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stop)
	}()
	out := bufio.NewWriter(os.Stdout)
	enc := json.NewEncoder(out)
	s := spec
	s.Op, s.Hold = "connect", 0
	for {
		select {
		case <-stop:
			return 0
		default:
		}
		start := time.Now()
		r := dialOnce(s)
		r.Start = start.UnixNano()
		if enc.Encode(r) != nil || out.Flush() != nil {
			return 2
		}
		if spec.Interval > 0 {
			time.Sleep(spec.Interval)
		}
	}
}

// Hammer is n "stream" helpers connecting to one destination back to back,
// for a test that asserts every connect during some change (a restart, a
// reload) had the same outcome. Unlike a helper given a fixed Count, it
// runs until Stop, so the test waits for results before and after the
// change (Await) instead of guessing a count that outlasts the change on
// a slow machine.
type Hammer struct {
	streams []*Stream
	counts  []atomic.Int64
	mu      sync.Mutex
	res     []DialResult
	done    sync.WaitGroup
}

// StartHammer starts n streams (StartStream, Interval 0) to spec.Addr
// inside cg and the host.
func (h *Host) StartHammer(tb testing.TB, cg *Cgroup, spec DialSpec, n int) *Hammer {
	tb.Helper()
	spec.Interval = 0
	m := &Hammer{counts: make([]atomic.Int64, n)}
	for i := range n {
		s := h.StartStream(tb, cg, spec)
		m.streams = append(m.streams, s)
		m.done.Add(1)
		go func() {
			defer m.done.Done()
			for r := range s.Results {
				m.mu.Lock()
				m.res = append(m.res, r)
				m.mu.Unlock()
				m.counts[i].Add(1)
			}
		}()
	}
	return m
}

// Await waits until every stream has reported k more results than it had
// when Await was called, and reports whether they did within timeout.
func (m *Hammer) Await(k int, timeout time.Duration) bool {
	base := make([]int64, len(m.counts))
	for i := range m.counts {
		base[i] = m.counts[i].Load()
	}
	return WaitFor(timeout, func() bool {
		for i := range m.counts {
			if m.counts[i].Load()-base[i] < int64(k) {
				return false
			}
		}
		return true
	})
}

// Stop ends the streams and returns every result they reported.
func (m *Hammer) Stop(tb testing.TB) []DialResult {
	tb.Helper()
	for _, s := range m.streams {
		if err := s.Close(); err != nil {
			tb.Error(err)
		}
	}
	m.done.Wait()
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.res
}

// Dialer is a "dialer" client helper: one connect (and close) to the
// address the test names, each time Dial asks. A test that changes the
// kernel's state between single connects pays for one helper process
// instead of one a connect (in vmtest's emulated VM, a sixth of a second
// each).
type Dialer struct {
	p   *Process
	in  io.WriteCloser
	out *json.Decoder
	err *LogBuffer
}

// StartDialer starts a "dialer" client helper inside cg and the host; its
// connects are spec's (Network, Timeout) to the address of each Dial. It
// ends with the test or at Close.
func (h *Host) StartDialer(tb testing.TB, cg *Cgroup, spec DialSpec) *Dialer {
	tb.Helper()
	spec.Op = "dialer"
	p, in, out, errOut := h.startPiped(tb, cg, spec)
	return &Dialer{p: p, in: in, out: json.NewDecoder(bufio.NewReader(out)), err: errOut}
}

// Dial makes one connect to addr and returns its result.
func (d *Dialer) Dial(addr netip.AddrPort) (DialResult, error) {
	var r DialResult
	if _, err := fmt.Fprintln(d.in, addr); err != nil {
		return r, fmt.Errorf("asking the dialer for a connect to %s: %w (stderr: %s)", addr, err, d.err.String())
	}
	if err := d.out.Decode(&r); err != nil {
		return r, fmt.Errorf("reading the dialer's result for %s: %w (stderr: %s)", addr, err, d.err.String())
	}
	return r, nil
}

// Close ends the helper and waits for it.
func (d *Dialer) Close() error {
	d.in.Close()
	if err := d.p.Cmd.Wait(); err != nil {
		return fmt.Errorf("dialer helper: %w (stderr: %s)", err, d.err.String())
	}
	return nil
}

// runDialer connects once to each address read from standard input, one
// a line, and writes each result as one JSON line, until the input ends.
func runDialer(spec DialSpec) int {
	in := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	enc := json.NewEncoder(out)
	s := spec
	s.Op, s.Hold = "connect", 0
	for in.Scan() {
		addr, err := netip.ParseAddrPort(in.Text())
		if err != nil {
			fmt.Fprintf(os.Stderr, "dialer: %v\n", err)
			return 2
		}
		s.Addr = addr
		if enc.Encode(dialOnce(s)) != nil || out.Flush() != nil {
			return 2
		}
	}
	return 0
}
