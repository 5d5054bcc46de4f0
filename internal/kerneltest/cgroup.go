package kerneltest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Cgroup is a child cgroup v2 directory made for one test.
type Cgroup struct {
	// Path is the cgroup's directory under the cgroup v2 mount.
	Path string
	root string
}

// NewCgroup makes a child cgroup under the cgroup v2 mount and removes it
// when the test ends: processes the test put there are killed (they were
// started by the test), anything else still inside is moved out first.
func NewCgroup(tb testing.TB) *Cgroup {
	tb.Helper()
	root, err := CgroupV2Mount()
	if err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join(root, UniqueName())
	if err := os.Mkdir(path, 0o755); err != nil {
		tb.Fatalf("making cgroup: %v", err)
	}
	cg := &Cgroup{Path: path, root: root}
	tb.Cleanup(func() {
		if err := cg.remove(); err != nil {
			tb.Errorf("removing cgroup %s: %v", path, err)
		}
	})
	return cg
}

// Child makes a child cgroup named name below c (a sibling of c's other
// children) and removes it when the test ends, before c.
func (c *Cgroup) Child(tb testing.TB, name string) *Cgroup {
	tb.Helper()
	path := filepath.Join(c.Path, name)
	if err := os.Mkdir(path, 0o755); err != nil {
		tb.Fatalf("making cgroup: %v", err)
	}
	cg := &Cgroup{Path: path, root: c.root}
	tb.Cleanup(func() {
		if err := cg.remove(); err != nil {
			tb.Errorf("removing cgroup %s: %v", path, err)
		}
	})
	return cg
}

// Open returns a read-only descriptor of the cgroup directory, as
// SysProcAttr.CgroupFD and link.AttachCgroup want it. The caller closes it.
func (c *Cgroup) Open() (*os.File, error) {
	f, err := os.Open(c.Path)
	if err != nil {
		return nil, fmt.Errorf("opening cgroup: %w", err)
	}
	return f, nil
}

// ID returns the cgroup's id, the inode number of its directory, which is
// what bpf_get_current_cgroup_id reports for processes inside it.
func (c *Cgroup) ID() (uint64, error) {
	fi, err := os.Stat(c.Path)
	if err != nil {
		return 0, fmt.Errorf("stat cgroup: %w", err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino, nil
}

// Procs returns the PIDs currently in the cgroup.
func (c *Cgroup) Procs() ([]int, error) {
	data, err := os.ReadFile(filepath.Join(c.Path, "cgroup.procs"))
	if err != nil {
		return nil, fmt.Errorf("reading cgroup.procs: %w", err)
	}
	var pids []int
	for _, f := range bytes.Fields(data) {
		pid, err := strconv.Atoi(string(f))
		if err != nil {
			return nil, fmt.Errorf("parsing cgroup.procs: %w", err)
		}
		pids = append(pids, pid)
	}
	return pids, nil
}

// AddProc moves a process into the cgroup.
func (c *Cgroup) AddProc(pid int) error {
	return os.WriteFile(filepath.Join(c.Path, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
}

func (c *Cgroup) remove() error {
	var lastErr error
	for i := 0; i < 100; i++ {
		pids, err := c.Procs()
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		// Whatever is still here belongs to the test (a helper thread of
		// this process that joined for a moment, or a child the test
		// started): move it back to the root so the directory can go.
		for _, pid := range pids {
			_ = os.WriteFile(filepath.Join(c.root, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
		}
		if lastErr = os.Remove(c.Path); lastErr == nil || errors.Is(lastErr, os.ErrNotExist) {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return lastErr
}

// leftoverCgroups lists cgroups under the v2 mount whose name starts with
// prefix.
func leftoverCgroups(prefix string) []string {
	root, err := CgroupV2Mount()
	if err != nil {
		return nil
	}
	entries, _ := os.ReadDir(root)
	var out []string
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), prefix) {
			out = append(out, filepath.Join(root, e.Name()))
		}
	}
	return out
}
