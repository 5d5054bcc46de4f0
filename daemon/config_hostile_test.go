package daemon

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// guarded has a forced-open target on a port where a server listens: a
// connect that is not rejected succeeds.
const guarded = `
failsafe_timeout: 2s
targets:
  guard:
    match: {cidrs: [SRV], ports: ["8080"]}
    state: forced_open
  svc:
    match: {cidrs: [SRV], ports: ["8081"]}
`

const shadowLike = "root:$y$j9T$c2FsdA$aGFzaGhhc2g:19700:0:99999:7:::\ndaemon:*:19700:0:99999:7:::\nnobody:*:19700:0:99999:7:::\n"

// waitReturn fails the test if fn has not returned after a generous
// while (it guards against a hang; it is not a timing assertion).
func waitReturn(t *testing.T, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { fn(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s blocked", what)
	}
}

// TestHostileReloadsAreRefused: each hostile file of issue 16, written
// over the configuration or put in its place by a symlink swap, is refused
// on reload with what was wrong; last_reload_successful goes to 0 and the
// forced-open target keeps rejecting every connect. A FIFO or a device
// never blocks the reload, and the daemon still stops.
func TestHostileReloadsAreRefused(t *testing.T) {
	f := newFixture(t, guarded)
	f.srv.ServeHold(t, 8080)
	f.start()
	dir := filepath.Dir(f.config)
	guardRejects := func(label string) {
		t.Helper()
		if got := errnos(f.dial(8080, 3, 0)); got[unix.ECONNREFUSED] != 3 {
			t.Fatalf("%s: forced-open guard let connects through: %v", label, got)
		}
		if c, ok := f.circuit("guard"); !ok || c.State != "forced_open" {
			t.Fatalf("%s: guard is %+v", label, c)
		}
	}
	guardRejects("before")
	shadow := filepath.Join(dir, "shadow")
	if err := os.WriteFile(shadow, []byte(shadowLike), 0o600); err != nil {
		t.Fatal(err)
	}
	swap := func(make func(tmp string) error) {
		t.Helper()
		tmp := f.config + ".swap"
		os.Remove(tmp)
		if err := make(tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, f.config); err != nil {
			t.Fatal(err)
		}
	}
	file := func(text string) func(string) error {
		return func(tmp string) error { return os.WriteFile(tmp, []byte(text), 0o644) }
	}
	link := func(target string) func(string) error {
		return func(tmp string) error { return os.Symlink(target, tmp) }
	}
	fifo := func(tmp string) error { return unix.Mkfifo(tmp, 0o600) }
	cases := []struct {
		name string
		make func(string) error
		want string
	}{
		{"empty file", file(""), "(file): empty"},
		{"only comments", file("# nothing here\n"), "(file): empty"},
		{"shadow-like copy", file(shadowLike), "(key of 48 bytes on line 1): unknown key"},
		{"bogus key", file("bogus_key:\n"), "bogus_key: unknown key"},
		{"misspelt option", file(strings.Replace(guarded, "targets:", "all:\n  failure_rate_treshold:\ntargets:", 1)), "all.failure_rate_treshold: unknown key (did you mean failure_rate_threshold?)"},
		{"bad target name", file("targets:\n  Bad Name!:\n"), "targets.Bad Name!: target names must match"},
		{"multi-document", file(guarded + "---\nmode: shadow\n"), "more than one YAML document"},
		{"null value", file(strings.Replace(guarded, "state: forced_open", "state:", 1)), "targets.guard.state: no value (null)"},
		{"reserved name", file(strings.Replace(guarded, "  svc:", "  tcp:", 1)), `targets.tcp: "tcp" is reserved`},
		{"symlink to a shadow-like file", link(shadow), "(key of 48 bytes on line 1): unknown key"},
		{"symlink to /dev/null", link("/dev/null"), "not a regular file (it is a character device)"},
		{"symlink to /dev/urandom", link("/dev/urandom"), "not a regular file (it is a character device)"},
		{"FIFO", fifo, "not a regular file (it is a FIFO)"},
	}
	for i, tc := range cases {
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		swap(tc.make)
		var err error
		waitReturn(t, tc.name+" reload", func() { err = f.d.Reload() })
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("%s: reload %v, want %q", tc.name, err, tc.want)
		}
		if strings.Contains(err.Error(), "c2FsdA") {
			t.Fatalf("%s: the error echoes the file's secrets: %v", tc.name, err)
		}
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 64<<20 {
			t.Fatalf("%s: the heap grew by %d bytes", tc.name, grew)
		}
		if v := testutil.ToFloat64(f.d.metrics.reloadOK); v != 0 {
			t.Fatalf("%s: last_reload_successful %v after a refused reload", tc.name, v)
		}
		guardRejects(tc.name)
		if i == len(cases)-1 {
			break // the FIFO stays in place while the daemon stops
		}
		f.writeConfig(guarded)
		if err := f.d.Reload(); err != nil {
			t.Fatalf("good reload after %s: %v", tc.name, err)
		}
		// The file watcher may still be finishing a reload it began on
		// the refused file (its events come 200 ms after the change, much
		// later in an emulated VM); its reload of the good file follows.
		if !kerneltest.WaitFor(5*time.Second, func() bool { return testutil.ToFloat64(f.d.metrics.reloadOK) == 1 }) {
			t.Fatalf("last_reload_successful %v after a good reload", testutil.ToFloat64(f.d.metrics.reloadOK))
		}
	}
	if !strings.Contains(f.logs.String(), "configuration reload refused") {
		t.Fatal("no refusal in the log")
	}
	// The watcher saw the swaps too and reloads on its own: once it has
	// refused the FIFO as well (the test's own reload was the first),
	// stop with the FIFO in place.
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		return strings.Count(grepLines(f.logs.String(), "configuration reload refused"), "it is a FIFO") >= 2
	}) {
		t.Fatalf("the watcher did not try the FIFO:\n%s", grepLines(f.logs.String(), "configuration reload refused"))
	}
	guardRejects("with a FIFO as the configuration")
	waitReturn(t, "stopping with a FIFO as the configuration", f.stop)
}

// TestFIFOConfigRefusedAtStart: a FIFO as the configuration file is
// refused at once at start-up (nothing writes to it: reading would block
// forever).
func TestFIFOConfigRefusedAtStart(t *testing.T) {
	f := newFixture(t, guarded)
	os.Remove(f.config)
	if err := unix.Mkfifo(f.config, 0o600); err != nil {
		t.Fatal(err)
	}
	var err error
	waitReturn(t, "New with a FIFO configuration", func() {
		var d *Daemon
		d, err = New(Options{ConfigPath: f.config, Cgroup: f.cg.Path, BPFFS: f.bpffs})
		if d != nil {
			d.k.Close()
		}
	})
	if err == nil || !strings.Contains(err.Error(), "not a regular file (it is a FIFO)") {
		t.Fatalf("New: %v", err)
	}
}

// hangingResolver never answers: each lookup waits for its deadline, as
// with a DNS server that drops queries.
type hangingResolver struct{ calls atomic.Int64 }

func (r *hangingResolver) LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error) {
	r.calls.Add(1)
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestSlowDNSNeverStopsTheHeartbeat: two host names whose lookups hang
// (2 s each before they give up, re-resolved every 100 ms, and on every
// reload), with failsafe_timeout 2s. Before, the lookups ran one after the
// other under the daemon's lock, on the goroutine that writes the
// heartbeat: the heartbeat went stale and a forced-open circuit let
// connects through. Now every connect is rejected throughout, /healthz
// stays 200, and once the daemon stops /healthz turns 500.
func TestSlowDNSNeverStopsTheHeartbeat(t *testing.T) {
	f := newFixture(t, guarded+`
  named:
    match: {hosts: [one.unresolvable.test, two.unresolvable.test], ports: ["9"]}
`)
	f.srv.ServeHold(t, 8080)
	hr := &hangingResolver{}
	f.resolver, f.resolveEvery = hr, 100*time.Millisecond
	f.start()
	health := func() int {
		rec := httptest.NewRecorder()
		f.d.handler(exposeAll, nil).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
		return rec.Code
	}
	var reloads sync.WaitGroup
	rejected, passed := 0, 0
	deadline := time.Now().Add(8 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		if i%10 == 0 {
			reloads.Go(func() { _ = f.d.Reload() }) // resolves the names again
		}
		for _, r := range f.dial(8080, 50, 0) {
			if r.Errno == unix.ECONNREFUSED {
				rejected++
			} else {
				passed++
			}
		}
		if code := health(); code != http.StatusOK {
			t.Errorf("/healthz %d while the heartbeat should be fresh", code)
		}
	}
	reloads.Wait()
	if passed != 0 {
		st, _ := f.d.k.Stats()
		t.Fatalf("%d of %d connects passed the forced-open circuit (verdicts ignored for a stale heartbeat: %d)", passed, passed+rejected, st.FailsafeAllowed)
	}
	// The lookups ran (and hung) throughout: at least one round per
	// 2 s for each name, besides the reloads'.
	if n := hr.calls.Load(); n < 8 {
		t.Fatalf("the resolver was asked only %d times; the test proves nothing", n)
	}
	if !strings.Contains(f.logs.String(), "resolving host name (keeping its last addresses)") {
		t.Fatal("failed lookups not logged")
	}
	// With the daemon stopped, the heartbeat ages: /healthz says so once
	// it is half the fail-safe old.
	f.stop()
	if !kerneltest.WaitFor(5*time.Second, func() bool { return health() == http.StatusInternalServerError }) {
		t.Fatalf("/healthz %d with no heartbeat", health())
	}
}

// mapResolver answers from a table.
type mapResolver map[string][]netip.Addr

func (m mapResolver) LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error) {
	if a, ok := m[host]; ok {
		return append([]netip.Addr(nil), a...), nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

// TestReloadResolvesNewHostNames: a host name a reload adds is looked up
// (outside the lock) before Reload returns, and its target covers the
// address: a forced-open one rejects it.
func TestReloadResolvesNewHostNames(t *testing.T) {
	f := newFixture(t, guarded)
	f.srv.ServeHold(t, 8082)
	f.resolver = mapResolver{"svc.test": {f.srv.IPv4}}
	f.start()
	if got := errnos(f.dial(8082, 1, 0)); got[0] != 1 {
		t.Fatalf("before the reload: %v", got)
	}
	f.writeConfig(guarded + `
  named:
    match: {hosts: [svc.test], ports: ["8082"]}
    state: forced_open
`)
	if err := f.d.Reload(); err != nil {
		t.Fatal(err)
	}
	c, ok := f.circuit("named")
	if !ok || c.State != "forced_open" || !strings.Contains(strings.Join(c.Destinations, " "), "tcp/"+f.srv.IPv4.String()+":8082") {
		t.Fatalf("circuit after the reload: %+v", c)
	}
	if got := errnos(f.dial(8082, 3, 0)); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("the resolved address is not enforced: %v", got)
	}
}
