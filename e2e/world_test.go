package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/breakerd/breakerd/daemon"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

func TestMain(m *testing.M) { kerneltest.Main(m) }

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// bin returns the path of one of breakerd's binaries, built once per run.
func bin(t *testing.T, name string) string {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "breakerd-e2e-")
		if buildErr != nil {
			return
		}
		out, err := exec.Command("go", "build", "-o", binDir+"/", "../cmd/breakerd", "../cmd/breakerctl", "../internal/demoserver").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("building: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(binDir, name)
}

// need fails (under CI) or skips when a client or server program the
// scenario drives is not installed.
func need(t *testing.T, programs ...string) {
	t.Helper()
	for _, p := range programs {
		if _, err := exec.LookPath(p); err != nil {
			if kerneltest.InCI() {
				t.Fatalf("%s is not installed (scripts/setup installs it)", p)
			}
			t.Skipf("%s is not installed", p)
		}
	}
}

// world is one scenario's machine: a child cgroup, a client host and server
// hosts, a ConfigMap-style configuration directory, and breakerd.
type world struct {
	t      *testing.T
	cg     *kerneltest.Cgroup
	topo   *kerneltest.Topology
	dir    string
	config string // the path breakerd reads (a symlink, as in a ConfigMap)
	admin  string // loopback admin address
	socket string
	bpffs  string
	d      *exec.Cmd
	logs   *kerneltest.LogBuffer
	gen    int
}

func newWorld(t *testing.T, servers int, config string) *world {
	t.Helper()
	kerneltest.RequireKernel(t)
	need(t, "curl", "bpftool")
	w := &world{t: t, cg: kerneltest.NewCgroup(t), topo: kerneltest.NewTopology(t, servers), dir: t.TempDir()}
	for _, s := range w.topo.Servers {
		s.StartCounting(t)
	}
	w.config = filepath.Join(w.dir, "breakerd.yaml")
	w.socket = filepath.Join(w.dir, "admin.sock")
	w.bpffs = filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(w.bpffs) })
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	w.admin = l.Addr().String()
	l.Close()
	w.swapConfig(config)
	if err := os.Symlink("..data/breakerd.yaml", w.config); err != nil {
		t.Fatal(err)
	}
	return w
}

// swapConfig writes a configuration the way the kubelet updates a
// ConfigMap: a new timestamped directory, then an atomic rename of the
// ..data symlink onto it. SRVn in the text is server n's IPv4 address.
func (w *world) swapConfig(config string) {
	w.t.Helper()
	for i := len(w.topo.Servers) - 1; i >= 0; i-- {
		config = strings.ReplaceAll(config, fmt.Sprintf("SRV%d", i), w.topo.Servers[i].IPv4.String())
	}
	w.gen++
	gen := fmt.Sprintf("..%d", w.gen)
	if err := os.Mkdir(filepath.Join(w.dir, gen), 0o755); err != nil {
		w.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(w.dir, gen, "breakerd.yaml"), []byte(config), 0o644); err != nil {
		w.t.Fatal(err)
	}
	tmp := filepath.Join(w.dir, "..data_tmp")
	if err := os.Symlink(gen, tmp); err != nil {
		w.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(w.dir, "..data")); err != nil {
		w.t.Fatal(err)
	}
}

// start runs breakerd and waits until it is ready.
func (w *world) start() {
	w.t.Helper()
	os.Remove(w.socket)
	w.logs = &kerneltest.LogBuffer{}
	cmd := exec.Command(bin(w.t, "breakerd"), "--config", w.config, "--cgroup", w.cg.Path, "--bpffs", w.bpffs,
		"--admin-addr", w.admin, "--admin-socket", w.socket)
	cmd.Stderr = w.logs
	if err := cmd.Start(); err != nil {
		w.t.Fatal(err)
	}
	w.d = cmd
	w.t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	ok := kerneltest.WaitFor(10*time.Second, func() bool {
		resp, err := http.Get("http://" + w.admin + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	if !ok {
		w.t.Fatalf("breakerd not ready:\n%s", w.logs.String())
	}
}

func (w *world) signal(sig os.Signal) {
	w.t.Helper()
	w.d.Process.Signal(sig)
	w.d.Wait()
}

func (w *world) get(path string, v any) {
	w.t.Helper()
	resp, err := http.Get("http://" + w.admin + path)
	if err != nil {
		w.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if v == nil {
		return
	}
	if s, ok := v.(*string); ok {
		*s = string(body)
		return
	}
	if err := json.Unmarshal(body, v); err != nil {
		w.t.Fatalf("GET %s: %v: %s", path, err, body)
	}
}

func (w *world) circuits() map[string]daemon.CircuitInfo {
	var cs []daemon.CircuitInfo
	w.get("/v1/circuits", &cs)
	out := map[string]daemon.CircuitInfo{}
	for _, c := range cs {
		out[c.Name] = c
	}
	return out
}

func (w *world) events() []daemon.TransitionEvent {
	var evs []daemon.TransitionEvent
	w.get("/v1/events", &evs)
	return evs
}

func (w *world) metrics() string {
	var s string
	w.get("/metrics", &s)
	return s
}

func (w *world) waitState(name, state string, timeout time.Duration) {
	w.t.Helper()
	if !kerneltest.WaitFor(timeout, func() bool { return w.circuits()[name].State == state }) {
		w.t.Fatalf("circuit %s is %q, want %q within %v; logs:\n%s", name, w.circuits()[name].State, state, timeout, w.logs.String())
	}
}

// curlResult is one run of an unmodified curl.
type curlResult struct {
	exit    int
	elapsed time.Duration
	out     string
}

// curl runs curl in the protected cgroup (or outside it with cg nil) and
// the client host.
func (w *world) curl(cg *kerneltest.Cgroup, url string, args ...string) curlResult {
	w.t.Helper()
	all := append([]string{"-sS", "-o", "/dev/null", "--max-time", "15"}, args...)
	p := w.topo.Client.Command(cg, "curl", append(all, url)...)
	t0 := time.Now()
	out, err := p.Run(w.t)
	r := curlResult{elapsed: time.Since(t0), out: string(out)}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		r.exit = ee.ExitCode()
	} else if err != nil {
		w.t.Fatal(err)
	}
	return r
}

// serve runs the demo HTTP server on server host i and port, until the
// returned stop is called or the test ends.
func (w *world) serve(i int, port int) (stop func()) {
	w.t.Helper()
	p := w.topo.Servers[i].Command(nil, bin(w.t, "demoserver"), fmt.Sprintf(":%d", port))
	if err := p.Start(w.t); err != nil {
		w.t.Fatal(err)
	}
	addr := net.JoinHostPort(w.topo.Servers[i].IPv4.String(), fmt.Sprint(port))
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		var up bool
		w.topo.Servers[i].Do(func() error {
			c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
			if err == nil {
				c.Close()
				up = true
			}
			return nil
		})
		return up
	}) {
		w.t.Fatal("demo server did not start")
	}
	return func() { p.Cmd.Process.Kill(); p.Cmd.Wait() }
}
