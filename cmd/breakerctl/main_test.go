package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/daemon"
	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

func TestMain(m *testing.M) { kerneltest.Main(m) }

func TestConfigValidate(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(good, []byte("targets:\n  db: {match: {cidrs: [192.0.2.1]}}\n"), 0o644)
	os.WriteFile(bad, []byte("all:\n  failure_rate_threshold: 1.5\n  windw_size: 3\n"), 0o644)
	var out bytes.Buffer
	if err := run([]string{"config", "validate", good}, &out); err != nil || !strings.Contains(out.String(), "valid (mode enforce, 1 targets") {
		t.Fatalf("good file: %v %s", err, out.String())
	}
	out.Reset()
	err := run([]string{"config", "validate", bad}, &out)
	if err == nil || !strings.Contains(err.Error(), "2 problem(s)") {
		t.Fatalf("bad file: %v", err)
	}
	for _, want := range []string{"all.failure_rate_threshold: 1.5 is not in (0, 1]", "all.windw_size: unknown key (did you mean window_size?)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	var ue usageError
	if err := run([]string{"config", "check"}, &out); !errors.As(err, &ue) {
		t.Fatalf("bad usage: %v", err)
	}
	if err := run([]string{"status", "-o", "yaml"}, &out); !errors.As(err, &ue) {
		t.Fatalf("bad -o: %v", err)
	}
}

func TestStatusForceAndInspectWithDaemonStopped(t *testing.T) {
	kerneltest.RequireKernel(t)
	cg := kerneltest.NewCgroup(t)
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	dir := t.TempDir()
	cfg := filepath.Join(dir, "b.yaml")
	os.WriteFile(cfg, []byte(strings.ReplaceAll(`
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8080"]}
    consecutive_failures: 2
    open_duration: 1m
  pool:
    match: {cidrs: [SRV], ports: ["8081"]}
    max_connections: 1
`, "SRV", srv.IPv4.String())), 0o644)
	srv.ServeHold(t, 8081)
	bpffs := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(bpffs) })
	sock := filepath.Join(dir, "admin.sock")
	d, err := daemon.New(daemon.Options{ConfigPath: cfg, Cgroup: cg.Path, BPFFS: bpffs, AdminSocket: sock})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() { cancel(); <-done }()
	dst := netip.AddrPortFrom(srv.IPv4, 8080)
	topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 2})
	// Circuits come by name: pool, then svc.
	if !kerneltest.WaitFor(2*time.Second, func() bool { return d.Circuits()[1].State == "open" }) {
		t.Fatal("circuit did not open")
	}
	if res := topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Count: 3}); res[0].Errno != unix.ECONNREFUSED {
		t.Fatalf("not rejected: %+v", res)
	}
	// The pool's bulkhead, full with one held connection, turns 2 away.
	pool := netip.AddrPortFrom(srv.IPv4, 8081)
	holder := topo.Client.StartDial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: pool, Hold: time.Minute})
	defer func() { holder.Cmd.Process.Kill(); holder.Cmd.Wait() }()
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		for _, c := range d.Circuits() {
			if c.Name == "pool" {
				return c.Connections == 1
			}
		}
		return false
	}) {
		t.Fatal("the pool's holder is not counted")
	}
	if res := topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: pool, Count: 2}); res[0].Errno != unix.EAGAIN || res[1].Errno != unix.EAGAIN {
		t.Fatalf("not turned away by the bulkhead: %+v", res)
	}

	var out bytes.Buffer
	if err := run([]string{"status", "--socket", sock}, &out); err != nil || !strings.Contains(out.String(), "svc") || !strings.Contains(out.String(), "open") {
		t.Fatalf("status: %v\n%s", err, out.String())
	}
	out.Reset()
	if err := run([]string{"events", "--socket", sock, "-o", "json"}, &out); err != nil || !strings.Contains(out.String(), `"reason": "consecutive_failures"`) {
		t.Fatalf("events: %v\n%s", err, out.String())
	}
	if err := run([]string{"force", "reset", "nope", "--socket", sock}, &out); err == nil || !strings.Contains(err.Error(), "no such circuit") {
		t.Fatalf("force on an unknown circuit: %v", err)
	}
	reported := d.Circuits()[1] // svc, after pool

	// Stop the daemon: the pins stay and inspect reads them directly.
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	done <- nil
	out.Reset()
	if err := run([]string{"inspect", "--bpffs", bpffs, "-o", "json"}, &out); err != nil {
		t.Fatal(err)
	}
	var rep InspectReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if len(rep.Verdicts) != 1 {
		t.Fatalf("inspect: %+v", rep)
	}
	v := rep.Verdicts[0]
	if v.Dest != reported.Destinations[0] || v.State != reported.State || v.CircuitID != reported.CircuitID || v.Rejected != reported.Rejected || v.Rejected != 3 {
		t.Fatalf("inspect %+v disagrees with the daemon's report %+v", v, reported)
	}
	if id, err := cg.ID(); err != nil || len(v.RejectedCgroups) != 1 || v.RejectedCgroups[id] != 3 {
		t.Fatalf("inspect's rejected cgroups %v, want the client's cgroup %d with 3 (%v)", v.RejectedCgroups, id, err)
	}
	if due := time.Until(reported.OpenUntil).Seconds(); v.DueInSec < due-2 || v.DueInSec > due+2 {
		t.Fatalf("due in %.1fs, the daemon said %.1fs", v.DueInSec, due)
	}
	if !rep.Enforcing || rep.HeartbeatAgeSec > 5 {
		t.Fatalf("heartbeat: %+v", rep)
	}
	// The pool's bulkhead, with the cgroup it turned away (its kind
	// apart: the verdict's rejected cgroups count none of these).
	if len(rep.Bulkheads) != 1 {
		t.Fatalf("inspect's bulkheads: %+v", rep.Bulkheads)
	}
	b := rep.Bulkheads[0]
	if id, err := cg.ID(); err != nil || b.Dest != "tcp/"+pool.String() || b.MaxConnections != 1 || b.Connections != 1 || b.BulkheadRejected != 2 || len(b.RejectedCgroups) != 1 || b.RejectedCgroups[id] != 2 {
		t.Fatalf("inspect's bulkhead %+v, want the pool's, holding 1, with the client's cgroup %d turned away twice (%v)", b, id, err)
	}
	out.Reset()
	if err := run([]string{"inspect", "--bpffs", bpffs}, &out); err != nil || !strings.Contains(out.String(), "BULKHEAD REJECTED") || !strings.Contains(out.String(), "tcp/"+pool.String()) {
		t.Fatalf("inspect's table: %v\n%s", err, out.String())
	}
	t.Logf("inspect:\n%s", out.String())
}

// TestInspectShowsSlowStartRejections: inspect reads a slow-start ramp's
// rejections from the pins, the circuit's count and the cgroup they came
// from, apart from an open circuit's.
func TestInspectShowsSlowStartRejections(t *testing.T) {
	kerneltest.RequireKernel(t)
	cg := kerneltest.NewCgroup(t)
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	srv.ServeHold(t, 8082)
	bpffs := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(bpffs) })
	k, err := maps.Load(maps.Options{Dir: bpffs, Cgroup: cg.Path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := k.Uninstall(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	if err := k.SetSettings(maps.Settings{Heartbeat: maps.Now(), FailSafe: time.Hour}); err != nil {
		t.Fatal(err)
	}
	// A ramp admitting none of its connects all hour: each is turned away.
	dst := maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(srv.IPv4, 8082)}
	v := maps.RampVerdict(maps.Now(), time.Hour, func(float64) float64 { return 0 }, unix.EAGAIN, 5)
	v.Epoch = 71
	if err := k.PutVerdict(dst, v); err != nil {
		t.Fatal(err)
	}
	for _, r := range topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst.Addr, Count: 4}) {
		if r.Errno != unix.EAGAIN {
			t.Fatalf("a connect under a ramp admitting none: %v, want EAGAIN", r.Errno)
		}
	}
	var out bytes.Buffer
	if err := run([]string{"inspect", "--bpffs", bpffs, "-o", "json"}, &out); err != nil {
		t.Fatal(err)
	}
	var rep InspectReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	id, err := cg.ID()
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Verdicts) != 1 {
		t.Fatalf("inspect: %+v", rep)
	}
	e := rep.Verdicts[0]
	if e.State != "ramp" || e.Rejected != 0 || len(e.RejectedCgroups) != 0 || e.SlowStartRejected != 4 ||
		len(e.SlowStartRejectedCgroups) != 1 || e.SlowStartRejectedCgroups[id] != 4 {
		t.Fatalf("inspect's ramp verdict %+v, want 4 slow-start rejections, all from the client's cgroup %d", e, id)
	}
	out.Reset()
	if err := run([]string{"inspect", "--bpffs", bpffs}, &out); err != nil || !strings.Contains(out.String(), " slow-start:4  1\n") {
		t.Fatalf("inspect's table, want slow-start:4 from 1 cgroup: %v\n%s", err, out.String())
	}
}

// TestHelperBreakerctl runs main() when re-executed by a test, so the
// real exit status can be seen.
func TestHelperBreakerctl(t *testing.T) {
	if os.Getenv("BREAKERCTL_HELPER") != "1" {
		t.Skip("helper process only")
	}
	os.Args = append([]string{"breakerctl"}, strings.Split(os.Getenv("BREAKERCTL_ARGS"), "\n")...)
	main()
	os.Exit(0)
}

// TestConfigValidateRefusesHostileFiles: every hostile file of issue 16
// makes `breakerctl config validate` exit 1 with what was wrong.
func TestConfigValidateRefusesHostileFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	shadow := write("shadow", "root:$y$j9T$c2FsdA$aGFzaGhhc2g:19700:0:99999:7:::\nnobody:*:19700:0:99999:7:::\n")
	link := filepath.Join(dir, "linked.yaml")
	if err := os.Symlink(shadow, link); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo.yaml")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ path, want string }{
		{write("empty.yaml", ""), "(file): empty"},
		{"/dev/null", "not a regular file"},
		{"/dev/urandom", "not a regular file"},
		{fifo, "not a regular file (it is a FIFO)"},
		{write("comments.yaml", "# only\n# comments\n"), "(file): empty"},
		{shadow, "(key of 48 bytes on line 1): unknown key"},
		{link, "(key of 48 bytes on line 1): unknown key"},
		{write("bogus.yaml", "bogus_key:\n"), "bogus_key: unknown key (line 1)"},
		{write("treshold.yaml", "all:\n  failure_rate_treshold:\n"), "all.failure_rate_treshold: unknown key (did you mean failure_rate_threshold?) (line 2)"},
		{write("badname.yaml", "targets:\n  Bad Name!:\n"), "targets.Bad Name!: target names must match"},
		{write("multi.yaml", "mode: enforce\n---\nmode: shadow\n"), "more than one YAML document"},
		{write("reserved.yaml", "targets:\n  tcp: {match: {cidrs: [192.0.2.1]}}\n"), `targets.tcp: "tcp" is reserved`},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperBreakerctl$")
		cmd.Env = append(os.Environ(), "BREAKERCTL_HELPER=1", "BREAKERCTL_ARGS=config\nvalidate\n"+tc.path)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Errorf("validate %s: %v, want exit status 1\n%s", tc.path, err, out)
			continue
		}
		if !strings.Contains(string(out), tc.want) {
			t.Errorf("validate %s: output lacks %q:\n%s", tc.path, tc.want, out)
		}
		if strings.Contains(string(out), "c2FsdA") {
			t.Errorf("validate %s echoed the file's secrets:\n%s", tc.path, out)
		}
	}
}
