package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/breakerd/breakerd/api"
)

// fakeDaemon serves the admin API's routes on a unix socket with Go's
// ServeMux, as breakerd does, and records the names it was asked about.
type fakeDaemon struct {
	mu       sync.Mutex
	names    []string
	auth     []string // Authorization headers of GET requests
	sock     string
	pods     []string         // the failed pods of the first circuit
	rejected []api.RejectedBy // whom the first circuit rejected
	fallback string           // the first circuit's fallback, with 5 redirected
	ramp     *api.SlowStart   // the second circuit's slow start
}

func newFakeDaemon(t *testing.T, circuits int) *fakeDaemon {
	t.Helper()
	dir, err := os.MkdirTemp("", "bkctl")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	f := &fakeDaemon{sock: filepath.Join(dir, "s")}
	l, err := net.Listen("unix", f.sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/circuits/{name...}", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.names = append(f.names, r.PathValue("name"))
		f.mu.Unlock()
		json.NewEncoder(w).Encode(api.CircuitInfo{Name: r.PathValue("name"), State: "forced_closed"})
	})
	mux.HandleFunc("GET /v1/circuits", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.auth = append(f.auth, r.Header.Get("Authorization"))
		f.mu.Unlock()
		after := -1
		if a := r.URL.Query().Get("after"); a != "" {
			after, _ = strconv.Atoi(strings.TrimPrefix(a, "c"))
		}
		page := []api.CircuitInfo{}
		for i := after + 1; i < circuits && len(page) < 3; i++ {
			ci := api.CircuitInfo{Name: fmt.Sprintf("c%06d", i), State: "closed"}
			if i == 0 {
				f.mu.Lock()
				ci.FailedPods = f.pods
				ci.RejectedBy = f.rejected
				ci.RejectedByTotal = len(f.rejected) + 1
				if f.fallback != "" {
					ci.State, ci.Fallback, ci.Redirected = "open", f.fallback, 5
				}
				f.mu.Unlock()
			}
			if i == 1 {
				f.mu.Lock()
				ci.SlowStart = f.ramp
				f.mu.Unlock()
			}
			page = append(page, ci)
		}
		if n := len(page); n > 0 && page[n-1].Name != fmt.Sprintf("c%06d", circuits-1) {
			w.Header().Set("Link", fmt.Sprintf(`</v1/circuits?after=%s&limit=3>; rel="next"`, page[n-1].Name))
		}
		json.NewEncoder(w).Encode(page)
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return f
}

func TestForceEscapesNames(t *testing.T) {
	f := newFakeDaemon(t, 0)
	names := []string{"a?b", "a#b", "a b%2Fc", "tcp/[2001:db8::1]:443", "web/192.0.2.1", "../x"}
	for _, n := range names {
		var out bytes.Buffer
		if err := run([]string{"force", "close", n, "--socket", f.sock}, &out); err != nil {
			t.Fatalf("force close %q: %v", n, err)
		}
	}
	if fmt.Sprint(f.names) != fmt.Sprint(names) {
		t.Fatalf("the daemon was asked about %q, want %q", f.names, names)
	}
}

func TestStatusReadsEveryPage(t *testing.T) {
	f := newFakeDaemon(t, 8)
	var out bytes.Buffer
	if err := run([]string{"status", "-o", "json", "--socket", f.sock}, &out); err != nil {
		t.Fatal(err)
	}
	var cs []api.CircuitInfo
	if err := json.Unmarshal(out.Bytes(), &cs); err != nil || len(cs) != 8 || cs[7].Name != "c000007" {
		t.Fatalf("status over 3 pages: %d circuits, %v\n%s", len(cs), err, out.String())
	}
	// With --token-file, reads carry the token too (a non-loopback
	// address serves circuits only with it).
	tok := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tok, []byte("s3cret\n"), 0o600)
	f.auth = nil
	if err := run([]string{"status", "--socket", f.sock, "--token-file", tok}, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	if len(f.auth) != 3 || f.auth[0] != "Bearer s3cret" {
		t.Fatalf("Authorization of the reads: %q", f.auth)
	}
	out.Reset()
	f0 := newFakeDaemon(t, 0)
	if err := run([]string{"status", "-o", "json", "--socket", f0.sock}, &out); err != nil || strings.TrimSpace(out.String()) != "[]" {
		t.Fatalf("no circuits: %v %q", err, out.String())
	}
}

func TestUsage(t *testing.T) {
	for _, help := range []string{"--help", "-h"} {
		var out bytes.Buffer
		if err := run([]string{help}, &out); err != nil || !strings.Contains(out.String(), "usage: breakerctl") || !strings.Contains(out.String(), "--socket") {
			t.Fatalf("%s: %v\n%s", help, err, out.String())
		}
	}
	for _, args := range [][]string{
		{"status", "extra-arg"}, {"events", "x"}, {"inspect", "x"}, {"force", "close"}, {"force", "explode", "x"},
		{"--bogus"}, {}, {"frobnicate"}, {"status", "-o", "yaml"},
	} {
		var ue usageError
		if err := run(args, &bytes.Buffer{}); !errors.As(err, &ue) {
			t.Errorf("%q: %v, want a usage error (exit 2)", args, err)
		}
	}
}

// TestExitCodes runs the built binary: 0 and the usage on stdout for
// --help, 2 for bad usage.
func TestExitCodes(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "breakerctl")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building breakerctl: %v\n%s", err, out)
	}
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"--help"}, 0}, {[]string{"status", "--help"}, 0},
		{[]string{"status", "extra-arg"}, 2}, {[]string{"--bogus"}, 2}, {nil, 2},
	} {
		cmd := exec.Command(bin, c.args...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != c.code {
			t.Errorf("breakerctl %q: exit %d, want %d (stderr %s)", c.args, code, c.code, stderr.String())
		}
		if c.code == 0 && (!strings.Contains(stdout.String(), "usage: breakerctl") || strings.Contains(stdout.String()+stderr.String(), "pflag")) {
			t.Errorf("breakerctl %q: stdout %q stderr %q", c.args, stdout.String(), stderr.String())
		}
	}
}

// TestStatusNamesFailedPods: status shows the pods that saw failures
// and those rejected, with their counts (the open circuit's, the
// bulkhead's and the slow start's told apart, shadow ones as what would
// have been rejected) and how many more there are, and "-" where none
// are known.
func TestStatusNamesFailedPods(t *testing.T) {
	f := newFakeDaemon(t, 2)
	f.pods = []string{"shop/web-1", "shop/web-2"}
	f.rejected = []api.RejectedBy{{Pod: "shop/web-2", Rejected: 7}, {Pod: "shop/web-3", BulkheadRejected: 4},
		{Pod: "shop/web-4", Rejected: 1, BulkheadRejected: 2}, {Pod: "shop/web-5", Rejected: 1, SlowStartRejected: 3},
		{Pod: "shop/web-6", SlowStartShadowRejected: 2}, {Cgroup: "system.slice/x.service", Rejected: 2}}
	var out bytes.Buffer
	if err := run([]string{"status", "--socket", f.sock}, &out); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	last2 := func(l string) string { f := strings.Fields(l); return strings.Join(f[max(0, len(f)-2):], " ") }
	if len(lines) != 3 || !strings.HasSuffix(lines[0], "REJECTED PODS") ||
		!strings.HasSuffix(lines[1], " shop/web-1,shop/web-2  shop/web-2:7,shop/web-3:bulkhead:4,shop/web-4:1+bulkhead:2,shop/web-5:1+slow-start:3,shop/web-6:slow-start:2,system.slice/x.service:2,+1 more") || last2(lines[2]) != "- -" {
		t.Fatalf("status:\n%s", out.String())
	}
}

// TestStatusShowsARamp: a closed circuit ramping up after recovery shows
// the share of new connects admitted now.
func TestStatusShowsARamp(t *testing.T) {
	f := newFakeDaemon(t, 2)
	f.ramp = &api.SlowStart{Share: 0.25}
	var out bytes.Buffer
	if err := run([]string{"status", "--socket", f.sock}, &out); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 3 || strings.Contains(lines[1], "ramping") || !strings.Contains(lines[2], " closed (ramping: 25% admitted) ") {
		t.Fatalf("status:\n%s", out.String())
	}
}

// TestStatusShowsTheFallback: a circuit running on its fallback says where
// its connects went, and how many.
func TestStatusShowsTheFallback(t *testing.T) {
	f := newFakeDaemon(t, 1)
	f.fallback = "10.0.0.9:8080"
	var out bytes.Buffer
	if err := run([]string{"status", "--socket", f.sock}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "open (to fallback 10.0.0.9:8080: 5)") {
		t.Fatalf("status:\n%s", out.String())
	}
}
