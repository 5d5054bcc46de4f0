package kerneltest

import (
	"net"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// MountBPFFS mounts a bpffs of the test's own at a new directory under
// parent (a temporary directory, or a directory of another such mount) and
// unmounts it when the test ends (if it is still mounted).
func MountBPFFS(tb testing.TB, parent string) string {
	tb.Helper()
	dir := filepath.Join(parent, "bpffs")
	if err := os.Mkdir(dir, 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := unix.Mount("bpffs", dir, "bpf", 0, ""); err != nil {
		tb.Fatalf("mounting a bpffs of the test's own: %v", err)
	}
	tb.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// FreeLoopbackAddr is a 127.0.0.1 address with a port nothing listens on
// now (another process may take it before the caller binds it).
func FreeLoopbackAddr(tb testing.TB) string {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
