package admin

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

func TestAdminSocketNeverReplacesWhatIsThere(t *testing.T) {
	dir := kerneltest.SocketDir(t)

	// A regular file at the path is kept, byte for byte.
	file := filepath.Join(dir, "precious")
	os.WriteFile(file, []byte("data"), 0o644)
	if _, err := listenAdminSocket(file); err == nil || !strings.Contains(err.Error(), "is not a socket") {
		t.Fatalf("regular file: %v", err)
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "data" {
		t.Fatalf("the regular file was touched: %q %v", b, err)
	}
	// So is a directory.
	sub := filepath.Join(dir, "sub")
	os.Mkdir(sub, 0o700)
	if _, err := listenAdminSocket(sub); err == nil {
		t.Fatal("a directory was accepted as the socket path")
	}

	// The socket is 0600 and the temporary directory it was bound in is gone.
	path := filepath.Join(dir, "admin.sock")
	first, err := listenAdminSocket(path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket %v %v, want a socket of mode 0600", fi.Mode(), err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 3 {
		t.Fatalf("directory holds %d entries, want precious, sub and admin.sock", len(entries))
	}
	served := make(chan struct{})
	go func() {
		for {
			c, err := first.l.Accept()
			if err != nil {
				close(served)
				return
			}
			c.Close()
		}
	}()

	// A second daemon given the same path neither takes it over nor
	// unlinks it.
	if _, err := listenAdminSocket(path); err == nil || !strings.Contains(err.Error(), "another process listens") {
		t.Fatalf("second listener: %v", err)
	}
	if c, err := net.Dial("unix", path); err != nil {
		t.Fatalf("the first daemon's socket stopped answering: %v", err)
	} else {
		c.Close()
	}

	// If someone replaced the socket, shutdown leaves theirs alone.
	os.Rename(path, path+".mine")
	other, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	first.path = path // still the path it was told to remove
	first.remove()
	<-served
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("shutdown removed a socket that was not its own: %v", err)
	}
	other.Close()

	// A stale socket (nothing listens) is replaced; shutdown removes its own.
	stale := filepath.Join(dir, "stale.sock")
	l, _ := net.Listen("unix", stale)
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	s, err := listenAdminSocket(stale)
	if err != nil {
		t.Fatalf("stale socket: %v", err)
	}
	s.remove()
	if _, err := os.Lstat(stale); !os.IsNotExist(err) {
		t.Fatalf("shutdown left its socket: %v", err)
	}
}

func TestAdminSocketDirectoryChecked(t *testing.T) {
	dir := kerneltest.SocketDir(t)
	os.Chmod(dir, 0o777)
	if _, err := listenAdminSocket(filepath.Join(dir, "a.sock")); err == nil || !strings.Contains(err.Error(), "writable by its group or others") {
		t.Fatalf("world-writable directory: %v", err)
	}
	os.Chmod(dir, 0o1777) // like /tmp: sticky does not help, others can still create the path first
	if _, err := listenAdminSocket(filepath.Join(dir, "a.sock")); err == nil {
		t.Fatal("sticky world-writable directory accepted")
	}
	if os.Geteuid() == 0 {
		os.Chmod(dir, 0o755)
		os.Chown(dir, 65534, 65534)
		if _, err := listenAdminSocket(filepath.Join(dir, "a.sock")); err == nil || !strings.Contains(err.Error(), "owned by uid 65534") {
			t.Fatalf("directory of another user: %v", err)
		}
	}
}

func TestAdminSocketLongPath(t *testing.T) {
	dir := kerneltest.SocketDir(t)
	// The final path has room; a temporary name beside it would not.
	sub := filepath.Join(dir, strings.Repeat("d", 106-len(dir)-len("/a.sock")-1))
	os.Mkdir(sub, 0o700)
	path := filepath.Join(sub, "a.sock")
	s, err := listenAdminSocket(path)
	if err != nil {
		t.Fatalf("%d-byte path: %v", len(path), err)
	}
	s.remove()
	if _, err := listenAdminSocket(path + strings.Repeat("x", 10)); err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("too long a path: %v", err)
	}
}
