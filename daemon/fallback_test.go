package daemon

import (
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// "web" (port 8601, nothing listening) opens after two refusals and
// sends its connects to its fallback on port 8602 of the same host.
const fallbackStreamConfig = `
failsafe_timeout: 30s
targets:
  web:
    match: {cidrs: [SRV], ports: ["8601"]}
    consecutive_failures: 2
    open_duration: 1m
    jitter: 0
    FALLBACK
  house:
    match: {cidrs: [SRV], ports: ["8602"]}
`

// A steady client (a connect every 5 ms) of a target whose circuit is open
// is served by the fallback without one connect turned away across a
// SIGTERM restart, a refused second start and a reload that keeps the
// fallback; a reload that removes it turns the connects away with the
// circuit's errno, and one that sets it again redirects them at once.
// The daemon's count of redirects is the client's count of connects the
// fallback took.
func TestFallbackStreamAcrossRestartAndReload(t *testing.T) {
	with := replaceFallback(fallbackStreamConfig, "fallback: SRV:8602")
	f := newFixture(t, with)
	f.srv.Serve(t, 8602, func(c *net.TCPConn) { c.Close() })
	f.start()
	if got := errnos(f.dial(8601, 2, 0)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("connects to the closed port: %v", got)
	}
	f.waitState("web", "open", 2*time.Second)
	st := f.topo.Client.StartStream(t, f.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(f.srv.IPv4, 8601), Interval: 5 * time.Millisecond})
	t.Cleanup(func() { st.Close() })
	s := &streamed{}
	go s.collect(st)
	// mark waits for n more results and returns how many there are.
	mark := func(n int) int {
		t.Helper()
		from := len(s.results())
		if !kerneltest.WaitFor(5*time.Second, func() bool { return len(s.results()) >= from+n }) {
			t.Fatalf("the client stopped at %d results", len(s.results()))
		}
		return len(s.results())
	}
	mark(20)
	f.restart()
	mark(20)
	if _, err := New(Options{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs}); err == nil {
		t.Fatal("a second daemon started on the same pins")
	}
	mark(20)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	kept := mark(20)
	for i, r := range s.results()[:kept] {
		if r.Errno != 0 {
			t.Fatalf("connect %d of %d (through a restart, a second start and a reload): %v, want the fallback's", i, kept, r.Errno)
		}
	}
	f.writeConfig(replaceFallback(fallbackStreamConfig, ""))
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	removed := mark(20)
	if r := s.results()[removed-1]; r.Errno != unix.ECONNREFUSED {
		t.Fatalf("after the reload that removed the fallback: %v, want ECONNREFUSED", r.Errno)
	}
	f.writeConfig(with)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	back := mark(20)
	if r := s.results()[back-1]; r.Errno != 0 {
		t.Fatalf("after the reload that set the fallback again: %v, want the fallback's", r.Errno)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	admitted := 0
	for _, r := range s.results() {
		if r.Errno == 0 {
			admitted++
		}
	}
	if c, _ := f.circuit("web"); c.State != "open" || c.Redirected != uint64(admitted) {
		t.Fatalf("web %s, %d redirected; want open and the %d connects the fallback took", c.State, c.Redirected, admitted)
	}
}

func replaceFallback(yaml, with string) string {
	return strings.ReplaceAll(yaml, "FALLBACK", with)
}
