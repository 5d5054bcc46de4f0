package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/cgroup2"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

// TestV2TreeOnThisMachine resolves --cgroup against the machine's real
// layout (no attach): /sys/fs/cgroup is the v2 tree on a unified node, and
// leads to /sys/fs/cgroup/unified on a hybrid one; a child cgroup is kept;
// a directory that is not a cgroup stays as given (and is refused later).
func TestV2TreeOnThisMachine(t *testing.T) {
	kerneltest.RequireKernel(t)
	mount, err := cgroup2.Mount()
	if err != nil {
		t.Fatal(err)
	}
	if got := v2Tree("/sys/fs/cgroup"); got != mount {
		t.Fatalf("v2Tree(/sys/fs/cgroup) = %s, want the cgroup2 mount %s", got, mount)
	}
	t.Logf("this machine's v2 tree: %s", mount)
	cg := kerneltest.NewCgroup(t)
	if got := v2Tree(cg.Path); got != cg.Path {
		t.Fatalf("a child cgroup %s became %s", cg.Path, got)
	}
	dir := t.TempDir()
	if got := v2Tree(dir); got != dir {
		t.Fatalf("a plain directory %s became %s", dir, got)
	}
	// The DaemonSet's view: the host's /sys/fs/cgroup bound recursively at
	// another path (/host/cgroup), in a mount namespace of its own.
	host := t.TempDir()
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "--", os.Args[0], "-test.run=^TestV2TreeHelper$")
	cmd.Env = append(os.Environ(), "BREAKERD_V2TREE_BIND="+host)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper in a mount namespace: %v\n%s", err, out)
	}
	want := host
	if mount == "/sys/fs/cgroup/unified" {
		want = filepath.Join(host, "unified")
	}
	if !strings.Contains(string(out), "v2 tree: "+want+"\n") {
		t.Fatalf("v2Tree of the bound /sys/fs/cgroup: %s, want %s", out, want)
	}
}

// TestV2TreeHelper runs in the mount namespace TestV2TreeOnThisMachine
// makes: it binds /sys/fs/cgroup (recursively, as a hostPath mount is)
// and prints what v2Tree makes of the bound path.
func TestV2TreeHelper(t *testing.T) {
	dst := os.Getenv("BREAKERD_V2TREE_BIND")
	if dst == "" {
		t.Skip("helper of TestV2TreeOnThisMachine")
	}
	if err := unix.Mount("/sys/fs/cgroup", dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("v2 tree: %s\n", v2Tree(dst))
}
