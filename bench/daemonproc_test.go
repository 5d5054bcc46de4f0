package bench

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// buildBreakerd builds ../cmd/breakerd into the test's temporary directory.
func buildBreakerd(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "breakerd")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/breakerd").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	return bin
}

// serveAndClose makes srv accept on port and close each connection once
// the client has closed it.
func serveAndClose(t *testing.T, srv *kerneltest.Host, port uint16) {
	srv.Serve(t, port, func(c *net.TCPConn) {
		buf := make([]byte, 64)
		for {
			if _, err := c.Read(buf); err != nil {
				c.Close()
				return
			}
		}
	})
}

// daemonProc is a real breakerd process started by a benchmark.
type daemonProc struct {
	pid   int
	admin string // its admin API's loopback address
	bpffs string
}

// startBreakerd runs bin with config on cg (its own pins, an admin API on
// a free loopback port, no socket), waits until it is ready, and stops it
// (SIGTERM, then uninstall) when the test ends.
func startBreakerd(t *testing.T, bin, config string, cg *kerneltest.Cgroup) *daemonProc {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "b.yaml")
	if err := os.WriteFile(cfg, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	bpffs := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(bpffs) })
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	admin := l.Addr().String()
	l.Close()
	cmd := exec.Command(bin, "--config", cfg, "--cgroup", cg.Path, "--bpffs", bpffs, "--admin-addr", admin, "--admin-socket", "", "--log-level", "warn")
	logs := &kerneltest.LogBuffer{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(unix.SIGTERM)
		cmd.Wait()
		exec.Command(bin, "uninstall", "--bpffs", bpffs).Run()
	})
	if !kerneltest.WaitFor(10*time.Second, func() bool { return get(admin, "/readyz") == 200 }) {
		t.Fatalf("breakerd not ready:\n%s", logs.String())
	}
	return &daemonProc{pid: cmd.Process.Pid, admin: admin, bpffs: bpffs}
}
