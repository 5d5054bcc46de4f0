// Package kerneltest is the harness every kernel and end-to-end test of
// breakerd stands on: it checks that the machine can run them, gives each test
// its own child cgroup v2 directory and its own network hosts (namespaces
// joined by veth), starts real processes inside them, and makes real failures
// on the server hosts (refused, dropped SYNs, ICMP unreachable, resets,
// stalls, slow handshakes) with nftables counters to assert on.
//
// Everything the harness creates carries the name prefix returned by Prefix,
// which holds the test binary's PID, so suites that `go test ./...` runs in
// parallel never collide, and Main can check after a package's tests that
// nothing it made is left behind.
//
// Safety: nothing here ever attaches to, or moves a process into, the
// machine's root cgroup except to move a test's own leftover process out of a
// child cgroup being removed. All test traffic stays on loopback or on veth
// links between namespaces the harness created, addressed from 198.18.0.0/15
// and 2001:db8::/32, so no packet can leave for a real network.
package kerneltest

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"testing"

	"github.com/cilium/ebpf/rlimit"

	"github.com/breakerd/breakerd/internal/cgroup2"
	"golang.org/x/sys/unix"
)

// BPFFSRoot is where bpffs is mounted on every supported system.
const BPFFSRoot = "/sys/fs/bpf"

func init() {
	// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; later ones
	// ignore it. Raising it once here keeps every test short.
	_ = rlimit.RemoveMemlock()
}

// Prefix is the name prefix of everything this test process creates:
// cgroups, network namespaces, nftables tables and bpffs pins.
func Prefix() string {
	return fmt.Sprintf("bkdt%d-", os.Getpid())
}

// UniqueName returns a fresh name that starts with Prefix.
func UniqueName() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return Prefix() + hex.EncodeToString(b[:])
}

// SocketDir returns a fresh directory only its owner can use, under the
// system's temporary directory (short enough for a unix socket's path,
// unlike t.TempDir's), removed when the test ends.
func SocketDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", UniqueName())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// InCI reports whether the tests run under CI (CI set and not "false"),
// where a kernel test that would skip must fail instead.
func InCI() bool {
	v := os.Getenv("CI")
	return v != "" && v != "false" && v != "0"
}

// Emulated reports whether the tests run inside vmtest's VM, where qemu
// emulates the CPU (TCG) and everything is 10–50× slower: latency checks
// that hold on real hardware (a rejection within a millisecond) are not
// meaningful there.
func Emulated() bool { return os.Getenv("BREAKERD_VMTEST") != "" }

// Fast reports whether BREAKERD_FAST is set: scripts/test-fast, the
// contributor's loop, runs only the tests that need no kernel, API server
// or browser, and those that do skip (under CI too: it never sets it).
func Fast() bool { return os.Getenv("BREAKERD_FAST") != "" }

// RequireKernel skips the test, with the reason, when this machine cannot
// run kernel tests: not root, no bpffs at /sys/fs/bpf, or no cgroup v2 mount;
// and always in the fast loop (Fast).
// Under CI it fails instead, because a silently skipped kernel suite is a
// broken build.
func RequireKernel(tb testing.TB) {
	tb.Helper()
	if Fast() {
		tb.Skip("kernel test skipped: BREAKERD_FAST is set (scripts/test-fast)")
	}
	if reason := kernelMissing(); reason != "" {
		if InCI() {
			tb.Fatalf("kernel test cannot run under CI: %s", reason)
		}
		tb.Skipf("kernel test skipped: %s", reason)
	}
}

func kernelMissing() string {
	if os.Geteuid() != 0 {
		return "needs root (euid is " + fmt.Sprint(os.Geteuid()) + ")"
	}
	var st unix.Statfs_t
	if err := unix.Statfs(BPFFSRoot, &st); err != nil || st.Type != unix.BPF_FS_MAGIC {
		return "bpffs is not mounted at " + BPFFSRoot + " (scripts/setup mounts it)"
	}
	if _, err := CgroupV2Mount(); err != nil {
		return err.Error()
	}
	if _, err := os.Stat("/sys/kernel/btf/vmlinux"); err != nil {
		return "kernel has no BTF (/sys/kernel/btf/vmlinux)"
	}
	return ""
}

// CgroupV2Mount returns the mount point of the cgroup v2 hierarchy, read
// from /proc/mounts (never hard-coded).
func CgroupV2Mount() (string, error) { return cgroup2.Mount() }
