package maps

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// watcher collects the test cgroup's outcome records in the background.
type watcher struct {
	mu     sync.Mutex
	events []Event
	rd     *EventReader
	done   chan struct{}
}

func (e *env) watch(t testing.TB) *watcher {
	t.Helper()
	rd, err := e.k.NewEventReader()
	if err != nil {
		t.Fatal(err)
	}
	w := &watcher{rd: rd, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		// Healthy established records wake no reader: read in batches
		// with a short wait, as the daemon does.
		batch := make([]Event, 256)
		for {
			n, err := rd.ReadBatch(batch, 20*time.Millisecond)
			if err != nil {
				if errors.Is(err, ErrReaderClosed) {
					return
				}
				t.Errorf("reading events: %v", err)
				return
			}
			w.mu.Lock()
			w.events = append(w.events, batch[:n]...)
			w.mu.Unlock()
		}
	}()
	t.Cleanup(func() { rd.Close(); <-w.done })
	return w
}

// wait returns the records for port once there are n of them (or after
// the timeout, whatever there is).
func (w *watcher) wait(port uint16, n int, timeout time.Duration) []Event {
	var out []Event
	kerneltest.WaitFor(timeout, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		out = out[:0]
		for _, ev := range w.events {
			if ev.Dest.Addr.Port() == port {
				out = append(out, ev)
			}
		}
		return len(out) >= n
	})
	return out
}

// sentinel makes one connect from cg to port, where nothing listens,
// and waits for its refused record. The ring keeps the kernel's order, so
// every record written before the connect has been read by then: a test
// asserts that a record did not come after this, not after a sleep.
func (w *watcher) sentinel(t *testing.T, e *env, cg *kerneltest.Cgroup, port uint16) {
	t.Helper()
	n := len(w.wait(port, 0, 0)) + 1
	if res := e.dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(port, false).Addr}); res[0].Errno != unix.ECONNREFUSED {
		t.Fatalf("sentinel connect to port %d: %v, want refused by the server", port, res[0].Errno)
	}
	if evs := w.wait(port, n, 3*time.Second); len(evs) != n || evs[n-1].Outcome != Refused {
		t.Fatalf("sentinel records for port %d: %v, want %d, the last refused", port, outcomes(evs), n)
	}
}

func outcomes(evs []Event) []Outcome {
	var out []Outcome
	for _, e := range evs {
		out = append(out, e.Outcome)
	}
	return out
}

func expectOutcomes(t *testing.T, evs []Event, want ...Outcome) {
	t.Helper()
	got := outcomes(evs)
	if len(got) != len(want) {
		t.Fatalf("outcomes %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("outcomes %v, want %v", got, want)
		}
	}
}

func TestOutcomes(t *testing.T) {
	e := newEnv(t, Options{})
	w := e.watch(t)
	cgID, err := e.cg.ID()
	if err != nil {
		t.Fatal(err)
	}
	// Keep the timed-out case short: 1 SYN retransmission (1 s + 2 s).
	if err := e.topo.Client.Sysctl("net/ipv4/tcp_syn_retries", "1"); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, MaxRTO: 2}); err != nil {
		t.Fatal(err)
	}
	srv := e.srv
	srv.DropSYNs(t, 9002)
	srv.RejectUnreachable(t, 9003)
	srv.ServeReset(t, 9004)
	srv.ServeHold(t, 9005)
	srv.SlowHandshakes(t, 9006, 1)
	srv.ServeHold(t, 9006)
	srv.ServeHold(t, 9008)
	srv.ServeHold(t, 9099)
	// Resolve the neighbours both ways first (ARP, IPv6 ND), so no first
	// SYN waits on them and no early retransmit record muddies a case.
	for _, network := range []string{"tcp4", "tcp6"} {
		e.dial(t, e.cg, kerneltest.DialSpec{Network: network, Addr: e.dest(9099, network == "tcp6").Addr})
	}

	checkCommon := func(t *testing.T, ev Event, d Dest) {
		t.Helper()
		if ev.Dest != d {
			t.Errorf("dest %v, want %v", ev.Dest, d)
		}
		if ev.CgroupID != cgID {
			t.Errorf("cgroup id %d, want %d", ev.CgroupID, cgID)
		}
		if ev.Cookie == 0 || ev.Time == 0 || ev.Time > Now() {
			t.Errorf("cookie %d time %v", ev.Cookie, ev.Time)
		}
	}

	t.Run("refused", func(t *testing.T) {
		for _, v6 := range []bool{false, true} {
			port := uint16(9001)
			network := "tcp4"
			if v6 {
				port, network = 9011, "tcp6"
			}
			d := e.dest(port, v6)
			e.dial(t, e.cg, kerneltest.DialSpec{Network: network, Addr: d.Addr})
			evs := w.wait(port, 1, 2*time.Second)
			expectOutcomes(t, evs, Refused)
			checkCommon(t, evs[0], d)
			if evs[0].Err != unix.ECONNREFUSED || evs[0].Probe {
				t.Errorf("%+v", evs[0])
			}
		}
	})
	t.Run("timed out, with an early retransmit record", func(t *testing.T) {
		d := e.dest(9002, false)
		e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Timeout: 6 * time.Second})
		evs := w.wait(9002, 2, 2*time.Second)
		expectOutcomes(t, evs, SYNRetrans, TimedOut)
		if d := evs[0].Duration; d < 900*time.Millisecond || d > 1500*time.Millisecond {
			t.Errorf("first retransmit after %v, want about 1s", d)
		}
		if evs[1].Err != unix.ETIMEDOUT || evs[1].Duration < 2500*time.Millisecond {
			t.Errorf("timed out: %+v", evs[1])
		}
	})
	t.Run("unreachable", func(t *testing.T) {
		d := e.dest(9003, false)
		e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr})
		evs := w.wait(9003, 2, 3*time.Second)
		// Over veth the first ICMP error arrives while connect() holds the
		// socket lock and stays a soft error (see RejectUnreachable): the
		// retransmitted SYN's answer fails the connect.
		expectOutcomes(t, evs, SYNRetrans, Unreachable)
		checkCommon(t, evs[1], d)
		if evs[1].Err != unix.EHOSTUNREACH {
			t.Errorf("err %v", evs[1].Err)
		}
	})
	t.Run("reset", func(t *testing.T) {
		d := e.dest(9004, true)
		e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp6", Addr: d.Addr, Op: "connect-read"})
		evs := w.wait(9004, 2, 2*time.Second)
		expectOutcomes(t, evs, Established, Reset)
		checkCommon(t, evs[1], d)
		if evs[0].Cookie != evs[1].Cookie {
			t.Errorf("cookies differ: %d %d", evs[0].Cookie, evs[1].Cookie)
		}
	})
	t.Run("stalled", func(t *testing.T) {
		d := e.dest(9005, false)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: "connect-send", Hold: 500 * time.Millisecond, Linger: 3 * time.Second})
		}()
		if evs := w.wait(9005, 1, 2*time.Second); len(evs) != 1 || evs[0].Outcome != Established {
			t.Fatalf("no established record: %v", outcomes(evs))
		}
		srv.DropAll(t, 9005) // the host goes dark after the handshake
		wg.Wait()
		evs := w.wait(9005, 2, 2*time.Second)
		expectOutcomes(t, evs, Established, Stalled)
		if evs[1].Count < 2 {
			t.Errorf("stalled after %d RTOs, want ≥ max_rto 2", evs[1].Count)
		}
	})
	t.Run("slow handshake", func(t *testing.T) {
		d := e.dest(9006, false)
		e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Timeout: 5 * time.Second})
		evs := w.wait(9006, 2, 2*time.Second)
		// The dropped SYN's retransmission is reported early, then the
		// handshake completes.
		expectOutcomes(t, evs, SYNRetrans, Established)
		if d := evs[1].Duration; d < 900*time.Millisecond || d > 2500*time.Millisecond {
			t.Errorf("handshake took %v, want about 1s", d)
		}
	})
	t.Run("abandoned", func(t *testing.T) {
		d := e.dest(9002, false)
		before := len(w.wait(9002, 0, 0))
		e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Op: "abandon", Hold: 300 * time.Millisecond})
		evs := w.wait(9002, before+1, 2*time.Second)[before:]
		expectOutcomes(t, evs, Abandoned)
		if d := evs[0].Duration; d < 300*time.Millisecond || d > time.Second {
			t.Errorf("abandoned after %v, want about 300ms", d)
		}
	})
	t.Run("probe mark", func(t *testing.T) {
		d := e.dest(9008, false)
		if err := e.k.PutVerdict(d, OpenVerdict(Now(), 5, 1, 0, 11)); err != nil {
			t.Fatal(err)
		}
		res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})
		if got := errnos(res); got[0] != 1 {
			t.Fatalf("errnos %v, want one probe through", got)
		}
		evs := w.wait(9008, 2, 2*time.Second)
		expectOutcomes(t, evs, ProbeRound, Established)
		if !evs[1].Probe || evs[0].Dest != d || evs[0].Round != 5 || evs[1].Round != 5 {
			t.Fatalf("records %+v", evs)
		}
	})
	t.Run("outside the cgroup", func(t *testing.T) {
		d := e.dest(9009, false)
		e.dial(t, nil, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 5})
		if evs := w.wait(9009, 1, 500*time.Millisecond); len(evs) != 0 {
			t.Fatalf("a process outside the cgroup produced %v", outcomes(evs))
		}
	})
}

func TestRingOverflowIsCounted(t *testing.T) {
	e := newEnv(t, Options{RingBytes: 4096})
	rd, err := e.k.NewEventReader()
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	const n = 300
	d := e.dest(9010, false)
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: n})
	if got := errnos(res); got[unix.ECONNREFUSED] != n {
		t.Fatalf("errnos %v", got)
	}
	read := 0
	var ev Event
	for {
		rd.SetDeadline(time.Now().Add(200 * time.Millisecond))
		if err := rd.Read(&ev); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				break
			}
			t.Fatal(err)
		}
		if ev.Outcome != Refused {
			t.Fatalf("unexpected %v", ev.Outcome)
		}
		read++
	}
	st, err := e.k.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.EventsLost == 0 || uint64(read)+st.EventsLost != n {
		t.Fatalf("read %d + lost %d, want %d in all with some lost", read, st.EventsLost, n)
	}
}

func TestDecodeEventAllocatesNothing(t *testing.T) {
	b := make([]byte, EventSize)
	b[10], b[11], b[12], b[15] = 0xff, 0xff, 198, 7
	b[16], b[17], b[18], b[20], b[21] = 0x1f, 0x90, 6, byte(Refused), 1
	var ev Event
	allocs := testing.AllocsPerRun(100, func() { _ = DecodeEvent(b, &ev) })
	if allocs != 0 {
		t.Fatalf("%v allocations per decode", allocs)
	}
	want := Dest{Proto: TCP, Addr: netip.MustParseAddrPort("198.0.0.7:8080")}
	if ev.Dest != want || ev.Outcome != Refused || !ev.Probe {
		t.Fatalf("decoded %+v", ev)
	}
	if err := DecodeEvent(b[:10], &ev); !errors.Is(err, ErrShortRecord) {
		t.Fatalf("short record: %v", err)
	}
}

func BenchmarkDecodeEvent(b *testing.B) {
	buf := make([]byte, EventSize)
	buf[18], buf[20] = 6, byte(Established)
	var ev Event
	b.ReportAllocs()
	b.SetBytes(int64(EventSize))
	for b.Loop() {
		_ = DecodeEvent(buf, &ev)
	}
}

// A healthy established record wakes no reader (the daemon reads it with
// its next batch); a failure wakes it at once, and the batch it reads keeps
// the kernel's order: the earlier healthy record comes first.
func TestHealthyRecordsWakeNoReader(t *testing.T) {
	e := newEnv(t, Options{})
	rd, err := e.k.NewEventReader()
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	srv := e.srv
	srv.ServeHold(t, 9020)
	healthy, refused := e.dest(9020, false), e.dest(9021, false)
	if res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: healthy.Addr}); res[0].Errno != 0 {
		t.Fatalf("healthy connect: %v", res[0].Errno)
	}
	// Nothing wakes the reader: Read returns only at its deadline, with
	// the record that was there all along.
	const wait = 600 * time.Millisecond
	var ev Event
	rd.SetDeadline(time.Now().Add(wait))
	t0 := time.Now()
	if err := rd.Read(&ev); err != nil || ev.Outcome != Established || ev.Dest != healthy {
		t.Fatalf("read %+v, %v; want the established record", ev, err)
	}
	if el := time.Since(t0); el < wait/2 {
		t.Fatalf("a healthy record woke the reader after %v (deadline %v)", el, wait)
	}
	// With the reader waiting on an empty ring, a healthy connect does
	// not wake it; a refused one does, and the batch holds both, in order.
	batch := make([]Event, 8)
	done := make(chan int, 1)
	go func() {
		for {
			n, err := rd.ReadBatch(batch, 5*time.Second)
			if err != nil {
				t.Errorf("ReadBatch: %v", err)
			}
			if n > 0 || err != nil {
				done <- n
				return
			}
		}
	}()
	if res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: healthy.Addr}); res[0].Errno != 0 {
		t.Fatalf("healthy connect: %v", res[0].Errno)
	}
	select {
	case n := <-done:
		t.Fatalf("a healthy record woke the reader (%d records)", n)
	case <-time.After(300 * time.Millisecond):
	}
	t0 = time.Now()
	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: refused.Addr})
	n := <-done
	if el := time.Since(t0); el > 3*time.Second {
		t.Fatalf("a refused connect did not wake the reader (%v)", el)
	}
	if n != 2 || batch[0].Outcome != Established || batch[1].Outcome != Refused || batch[1].Dest != refused {
		t.Fatalf("batch %v, want [established refused]", outcomes(batch[:n]))
	}
}

// Wake makes a waiting reader return what the ring holds, and does nothing
// when it holds nothing (an idle daemon's reader is never woken for
// nothing): waiting in Go's poller (which the ring's descriptor must
// accept here), and in the ring reader, where the poller does not take it.
func TestWakeOnlyWithRecords(t *testing.T) {
	e := newEnv(t, Options{})
	e.srv.ServeHold(t, 9030)
	for _, poller := range []bool{true, false} {
		rd, err := e.k.NewEventReader()
		if err != nil {
			t.Fatal(err)
		}
		if rd.f == nil {
			t.Fatal("the ring's descriptor is not in Go's poller")
		}
		if !poller {
			rd.f.Close()
			rd.f, rd.rc = nil, nil
		}
		wakeOnlyWithRecords(t, e, rd)
		rd.Close()
	}
}

func wakeOnlyWithRecords(t *testing.T, e *env, rd *EventReader) {
	batch := make([]Event, 8)
	done := make(chan int, 1)
	read := func() {
		go func() {
			n, err := rd.ReadBatch(batch, 0)
			if err != nil {
				t.Errorf("ReadBatch: %v", err)
			}
			done <- n
		}()
	}
	// A reader that waits: Wake with an empty ring, then a healthy record,
	// must not wake it, so the first return is the one a failure's record
	// causes, with the healthy record before it. (The pause only lets the
	// reader reach its wait before the healthy record, which it would
	// otherwise find at once.)
	read()
	time.Sleep(50 * time.Millisecond)
	rd.Wake() // nothing to read: the reader keeps waiting
	if res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(9030, false).Addr}); res[0].Errno != 0 {
		t.Fatalf("healthy connect: %v", res[0].Errno)
	}
	if res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(9198, false).Addr}); res[0].Errno != unix.ECONNREFUSED {
		t.Fatalf("refused connect: %v", res[0].Errno)
	}
	select {
	case n := <-done:
		if got := outcomes(batch[:n]); !slices.Equal(got, []Outcome{Established, Refused}) {
			t.Fatalf("first return of the waiting reader: %v, want [established refused] (an empty Wake or the healthy record woke it)", got)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("a refused connect's record did not wake the reader")
	}
	// Wake with a record waiting wakes it (the pause again lets the
	// reader wait before the record comes).
	read()
	time.Sleep(50 * time.Millisecond)
	if res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(9030, false).Addr}); res[0].Errno != 0 {
		t.Fatalf("healthy connect: %v", res[0].Errno)
	}
	rd.Wake()
	select {
	case n := <-done:
		if n != 1 || batch[0].Outcome != Established {
			t.Fatalf("after Wake: %v, want [established]", outcomes(batch[:n]))
		}
	case <-time.After(3 * time.Second):
		t.Fatal("Wake with a record waiting did not wake the reader")
	}
}

// A reset of an established connection without socket storage is seen by
// reset_seen, not by sockops' state callbacks (which on_established turns
// off for it): reported exactly once, for IPv4 and IPv6, also after a
// restart on the same pins (which adopts the tracing link running the
// same program). A connection the client resets itself (SO_LINGER 0)
// reports no reset: only a reset received counts.
func TestResetSeenOnceAcrossRestart(t *testing.T) {
	e := newEnv(t, Options{})
	w := e.watch(t)
	e.srv.ServeReset(t, 9104)
	e.srv.ServeHold(t, 9105)
	e.srv.ServeHold(t, 9199)
	// Resolve the neighbours both ways first, so no SYN waits on them.
	for _, network := range []string{"tcp4", "tcp6"} {
		e.dial(t, e.cg, kerneltest.DialSpec{Network: network, Addr: e.dest(9199, network == "tcp6").Addr})
	}
	pin := filepath.Join(e.k.PinDir(), "link_"+tracerName)
	id := linkID(t, pin) // attached and pinned
	n := 0
	resetOnce := func(network string) {
		t.Helper()
		d := e.dest(9104, network == "tcp6")
		e.dial(t, e.cg, kerneltest.DialSpec{Network: network, Addr: d.Addr, Op: "connect-read"})
		n += 2
		w.wait(9104, n, 2*time.Second)
		w.sentinel(t, e, e.cg, 9198) // a second report would come before it
		evs := w.wait(9104, n, 0)
		if len(evs) != n {
			t.Fatalf("%s: %d records for %d connections: %v", network, len(evs), n/2, outcomes(evs))
		}
		expectOutcomes(t, evs[n-2:], Established, Reset)
		r := evs[n-1]
		if r.Dest != d || !r.NoAge || r.Cookie != evs[n-2].Cookie || r.Err != unix.ECONNRESET {
			t.Fatalf("%s: reset record %+v after %+v", network, r, evs[n-2])
		}
	}
	resetOnce("tcp4")
	resetOnce("tcp6")
	e.restart(t)
	if got := linkID(t, pin); got != id {
		t.Fatalf("reset_seen's link %d after a restart, want %d adopted", got, id)
	}
	resetOnce("tcp4")
	resetOnce("tcp6")

	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(9105, false).Addr, Op: "connect-abort"})
	w.sentinel(t, e, e.cg, 9198)
	if evs := w.wait(9105, 0, 0); len(evs) != 1 || evs[0].Outcome != Established {
		t.Fatalf("the client's own reset: %v, want only established", outcomes(evs))
	}
}

// A connection the application has closed is not followed any more: the
// retransmission timeouts of its FIN to a host gone dark (FIN_WAIT1, and
// LAST_ACK after the peer closed first) report no stall, as when sockops
// had the state callbacks and turned them off at the close. With
// reset_seen attached an established socket keeps only the RTO callback,
// which fires in those states too.
func TestNoStallAfterApplicationClose(t *testing.T) {
	e := newEnv(t, Options{})
	w := e.watch(t)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, MaxRTO: 1}); err != nil {
		t.Fatal(err)
	}
	e.srv.ServeHold(t, 9120)
	e.srv.Serve(t, 9121, func(c *net.TCPConn) { c.Close() }) // the peer closes first
	e.srv.ServeHold(t, 9199)
	e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(9199, false).Addr})
	for _, port := range []uint16{9120, 9121} {
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: e.dest(port, false).Addr, Hold: 500 * time.Millisecond})
		}()
		if evs := w.wait(port, 1, 2*time.Second); len(evs) != 1 || evs[0].Outcome != Established {
			t.Fatalf("port %d: no established record: %v", port, outcomes(evs))
		}
		e.srv.DropAll(t, port) // dark before the application closes
		wg.Wait()
	}
	// RTOs of the FINs at about 0.2, 0.6 and 1.4 s after each close: a
	// stall (max_rto 1) would be reported at the first, and read before
	// the sentinel's record.
	time.Sleep(1500 * time.Millisecond)
	w.sentinel(t, e, e.cg, 9198)
	for _, port := range []uint16{9120, 9121} {
		if evs := w.wait(port, 0, 0); len(evs) != 1 {
			t.Errorf("port %d: %v after the application closed, want only established", port, outcomes(evs))
		}
	}
}

// reset_seen sees every socket of the machine; it reports only those made
// at or below its own attach point: another breakerd's (here: another
// Kernel on a sibling cgroup) stay out of this ring, a child cgroup's are
// in it.
func TestResetSeenOnlyBelowAttachPoint(t *testing.T) {
	mine, other := newEnv(t, Options{}), newEnv(t, Options{})
	wMine, wOther := mine.watch(t), other.watch(t)
	mine.srv.ServeReset(t, 9114)
	mine.srv.ServeHold(t, 9199)
	child := mine.cg.Child(t, "pod")
	mine.dial(t, mine.cg, kerneltest.DialSpec{Network: "tcp4", Addr: mine.dest(9199, false).Addr}) // neighbours resolved
	for _, cg := range []*kerneltest.Cgroup{mine.cg, child} {
		mine.dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: mine.dest(9114, false).Addr, Op: "connect-read"})
	}
	evs := wMine.wait(9114, 4, 2*time.Second)
	expectOutcomes(t, evs, Established, Reset, Established, Reset)
	wOther.sentinel(t, other, other.cg, 9198) // the other ring's own later record
	if evs := wOther.wait(9114, 0, 0); len(evs) != 0 {
		t.Fatalf("the other attach point's ring has %v", outcomes(evs))
	}
}
