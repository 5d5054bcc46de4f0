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

	"golang.org/x/sys/unix"
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

// Hammer is n "hammer" helpers connecting to one destination back to back,
// for a test that asserts every connect during some change (a restart, a
// reload) had the same outcome. Unlike a helper given a fixed Count, it
// runs until Stop, so the test waits for connects before and after the
// change (Await) instead of guessing a count that outlasts the change on
// a slow machine. Each helper reports its counts by errno every
// hammerEvery connects, not each result, so that the connects, not the
// reporting, set the pace (in vmtest's emulated VM a result a line halved
// it).
type Hammer struct {
	procs []*hammerProc
}

// hammerEvery is how many connects a hammer helper makes between reports.
const hammerEvery = 250

type hammerProc struct {
	p    *Process
	in   io.WriteCloser
	err  *LogBuffer
	done chan struct{}
	mu   sync.Mutex
	last map[unix.Errno]int // the latest report: counts by errno so far
	n    atomic.Int64       // connects so far
}

// StartHammer starts n hammer helpers connecting to spec.Addr inside cg
// and the host.
func (h *Host) StartHammer(tb testing.TB, cg *Cgroup, spec DialSpec, n int) *Hammer {
	tb.Helper()
	spec.Op = "hammer"
	m := &Hammer{}
	for range n {
		p, in, out, errOut := h.startPiped(tb, cg, spec)
		hp := &hammerProc{p: p, in: in, err: errOut, done: make(chan struct{}), last: map[unix.Errno]int{}}
		m.procs = append(m.procs, hp)
		go func() {
			defer close(hp.done)
			dec := json.NewDecoder(bufio.NewReader(out))
			for {
				var rs []DialResult
				if err := dec.Decode(&rs); err != nil {
					return
				}
				counts, total := map[unix.Errno]int{}, 0
				for _, r := range rs {
					counts[r.Errno] = int(r.Nanos)
					total += int(r.Nanos)
				}
				hp.mu.Lock()
				hp.last = counts
				hp.mu.Unlock()
				hp.n.Store(int64(total))
			}
		}()
	}
	return m
}

// Await waits until every helper has made k more connects than it had
// reported when Await was called, and reports whether they did within
// timeout.
func (m *Hammer) Await(k int, timeout time.Duration) bool {
	base := make([]int64, len(m.procs))
	for i, hp := range m.procs {
		base[i] = hp.n.Load()
	}
	return WaitFor(timeout, func() bool {
		for i, hp := range m.procs {
			if hp.n.Load()-base[i] < int64(k) {
				return false
			}
		}
		return true
	})
}

// Stop ends the helpers and returns how many of their connects ended with
// each errno (0: connected), every connect counted.
func (m *Hammer) Stop(tb testing.TB) map[unix.Errno]int {
	tb.Helper()
	all := map[unix.Errno]int{}
	for _, hp := range m.procs {
		hp.in.Close()
		<-hp.done // the last report, written when its input ended
		if err := hp.p.Cmd.Wait(); err != nil {
			tb.Errorf("hammer helper: %v (stderr: %s)", err, hp.err.String())
		}
		hp.mu.Lock()
		for e, n := range hp.last {
			all[e] += n
		}
		hp.mu.Unlock()
	}
	return all
}

// runHammer connects back to back until standard input ends, and writes
// its counts so far by errno (one entry per errno, the count in Nanos, as
// "rate") as one JSON line every hammerEvery connects and at the end.
func runHammer(spec DialSpec) int {
	stop := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stop)
	}()
	enc := json.NewEncoder(os.Stdout)
	s := spec
	s.Op, s.Hold = "connect", 0
	counts := map[unix.Errno]int64{}
	report := func() bool {
		rs := make([]DialResult, 0, len(counts))
		for e, n := range counts {
			rs = append(rs, DialResult{Errno: e, Nanos: n})
		}
		return enc.Encode(rs) == nil
	}
	for n := 1; ; n++ {
		select {
		case <-stop:
			if !report() {
				return 2
			}
			return 0
		default:
		}
		counts[dialOnce(s).Errno]++
		if n%hammerEvery == 0 && !report() {
			return 2
		}
	}
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
