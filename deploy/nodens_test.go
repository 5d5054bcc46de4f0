package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// overlaidDirs are the machine's directories that the node's processes see
// through an overlay whose upper layer is the test's: what they write there
// and have no setting for (the kubelet's device plugin socket and container
// log links, libcni's result cache and lock, containerd's shim sockets,
// runc's state and /opt/containerd, buildah's blob cache) lands in the
// test's directory, while what the machine has there stays readable.
var overlaidDirs = []string{"/etc", "/opt", "/run", "/var/lib", "/var/log"}

// nodeNamespace is the one-node cluster's mount namespace: its daemons
// (containerd with its shims and CNI plugins, the kubelet, kube-proxy) run
// in it and in the node's network namespace (Do), and the builds of its
// images in it (Mounts). In it, the machine-wide kernel settings the
// kubelet writes when it starts (kubeletSysctls) are files of the test's
// bound over their /proc/sys entries, and overlaidDirs are overlays. Its
// mounts are private: none of them, nor the kubelet's volume mounts, reach
// the machine's namespace, and all go with its last process, so even a
// killed test leaves the machine's kernel settings and overlaidDirs as
// they were.
//
// The kubelet offers no way to leave the settings alone:
// protectKernelDefaults makes it refuse to start unless the machine
// already has its values, and it has no flag for the device plugin
// socket's directory or the container log links'.
type nodeNamespace struct {
	host *kerneltest.Host
	dir  string      // the shadowed settings and the overlays' layers
	task string      // /proc/<pid>/task/<tid> of the thread that holds the namespace
	run  chan func() // what that thread runs
}

// newNodeNamespace makes the node's mount namespace, its files under dir,
// and holds it on a thread of its own, which starts the node's processes
// (Do): their parent death signal follows that thread, which ends when
// the test's cleanup does, after the processes it started were stopped.
func newNodeNamespace(t *testing.T, host *kerneltest.Host, dir string) *nodeNamespace {
	t.Helper()
	n := &nodeNamespace{host: host, dir: dir, run: make(chan func())}
	for _, s := range kubeletSysctls {
		v, err := os.ReadFile(filepath.Join("/proc/sys", s.key))
		if err == nil {
			err = os.MkdirAll(n.sysctlDir(), 0o755)
		}
		if err == nil {
			err = os.WriteFile(n.sysctlFile(s.key), v, 0o644)
		}
		if err != nil {
			t.Fatalf("shadowing %s: %v", s.key, err)
		}
	}
	ready := make(chan error)
	go func() {
		// Never unlocked: the thread leaves the process's mount namespace,
		// so the runtime must end it with this goroutine.
		runtime.LockOSThread()
		if err := n.setUp(); err != nil {
			ready <- err
			return
		}
		n.task = fmt.Sprintf("/proc/%d/task/%d", os.Getpid(), unix.Gettid())
		ready <- nil
		for f := range n.run {
			f()
		}
	}()
	if err := <-ready; err != nil {
		t.Fatalf("making the node's mount namespace: %v", err)
	}
	t.Cleanup(func() { close(n.run) })
	return n
}

func (n *nodeNamespace) sysctlDir() string { return filepath.Join(n.dir, "sysctl") }

func (n *nodeNamespace) sysctlFile(key string) string {
	return filepath.Join(n.sysctlDir(), strings.ReplaceAll(key, "/", "."))
}

// upper is the overlay's upper layer for the machine's directory d: what
// the node's daemons wrote below d.
func (n *nodeNamespace) upper(d string) string {
	return filepath.Join(n.dir, "upper"+strings.ReplaceAll(d, "/", "-"))
}

// setUp unshares the calling thread's mount namespace and mounts what the
// node sees differently from the machine.
func (n *nodeNamespace) setUp() error {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	// Before anything is mounted: a machine whose mounts are shared
	// (systemd's default) would otherwise receive them.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making the mounts private: %w", err)
	}
	for _, s := range kubeletSysctls {
		p := filepath.Join("/proc/sys", s.key)
		if err := unix.Mount(n.sysctlFile(s.key), p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("binding %s over %s: %w", n.sysctlFile(s.key), p, err)
		}
	}
	for _, d := range overlaidDirs {
		upper, work := n.upper(d), filepath.Join(n.dir, "work"+strings.ReplaceAll(d, "/", "-"))
		for _, w := range []string{upper, work} {
			if err := os.MkdirAll(w, 0o755); err != nil {
				return err
			}
		}
		opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", d, upper, work)
		if err := unix.Mount("overlay", d, "overlay", 0, opts); err != nil {
			return fmt.Errorf("mounting an overlay on %s (%s): %w", d, opts, err)
		}
	}
	return nil
}

// Do runs f in the node's mount and network namespaces, on the thread
// that holds the former: processes f starts live in both.
func (n *nodeNamespace) Do(f func() error) error {
	return n.Mounts(func() error { return n.host.Do(f) })
}

// Mounts runs f in the node's mount namespace (and the machine's network
// namespace), on the thread that holds it.
func (n *nodeNamespace) Mounts(f func() error) error {
	errc := make(chan error, 1)
	n.run <- func() { errc <- f() }
	return <-errc
}

// Path is the path, from the machine's namespace, of what the node's
// namespace has at p (a file in a volume the kubelet mounted, say).
func (n *nodeNamespace) Path(p string) string {
	return filepath.Join(n.task, "root", p)
}

// written is where the node's daemons' writes to p, below one of
// overlaidDirs, land: in the overlay's upper layer.
func (n *nodeNamespace) written(p string) string {
	for _, d := range overlaidDirs {
		if rel, err := filepath.Rel(d, p); err == nil && !strings.HasPrefix(rel, "..") {
			return filepath.Join(n.upper(d), rel)
		}
	}
	panic(p + " is not below an overlaid directory")
}
