package admin

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// adminSocket is the admin API's unix socket: created mode 0600 in a
// directory only root can write, never replacing anything but a stale
// socket, and removed on shutdown only if the path is still this socket.
type adminSocket struct {
	path string
	l    *net.UnixListener
	dev  uint64
	ino  uint64
}

// listenAdminSocket creates the socket at path. It refuses a path whose
// directory others could write (they could swap the socket), a path that
// holds anything but a socket, and a socket something listens on (another
// breakerd); a socket nothing listens on is stale and replaced. The socket
// is bound in a fresh 0700 directory, set to 0600 there, then renamed into
// place without replacing anything, so it is never reachable with a wider
// mode (no umask window).
func listenAdminSocket(path string) (*adminSocket, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("admin socket directory: %w", err)
	}
	if err := checkSocketDir(dir); err != nil {
		return nil, err
	}
	if err := removeStaleSocket(path); err != nil {
		return nil, err
	}
	// Clients connect by path: it must fit in sockaddr_un.
	if len(path) >= len(unix.RawSockaddrUnix{}.Path) {
		return nil, fmt.Errorf("admin socket path %s is longer than %d bytes", path, len(unix.RawSockaddrUnix{}.Path)-1)
	}
	tmp, err := os.MkdirTemp(dir, ".breakerd-admin-")
	if err != nil {
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	defer os.RemoveAll(tmp)
	// Bind through the directory's descriptor: /proc/self/fd/N/s is short
	// however long the directory's path is.
	tmpDir, err := os.Open(tmp)
	if err != nil {
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	defer tmpDir.Close()
	bound := fmt.Sprintf("/proc/self/fd/%d/s", tmpDir.Fd())
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: bound, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	// The path changes under the listener: it must not unlink on close.
	l.SetUnlinkOnClose(false)
	fail := func(err error) (*adminSocket, error) {
		l.Close()
		return nil, err
	}
	if err := unix.Fchmodat(int(tmpDir.Fd()), "s", 0o600, 0); err != nil {
		return fail(fmt.Errorf("admin socket mode: %w", err))
	}
	if err := unix.Renameat2(int(tmpDir.Fd()), "s", unix.AT_FDCWD, path, unix.RENAME_NOREPLACE); err != nil {
		return fail(fmt.Errorf("admin socket: moving it to %s: %w", path, err))
	}
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return fail(fmt.Errorf("admin socket: %w", err))
	}
	return &adminSocket{path: path, l: l, dev: st.Dev, ino: st.Ino}, nil
}

// CheckSocket tells early, changing nothing, whether Start would refuse
// the socket path: a directory others can write, a
// path that holds anything but a socket, or a socket something listens on.
func CheckSocket(path string) error {
	dir := filepath.Dir(path)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil // made, 0700, when the socket is
	}
	if err := checkSocketDir(dir); err != nil {
		return err
	}
	_, err := socketInUse(path)
	return err
}

// checkSocketDir refuses a directory that is not the daemon's user's
// (root's) or that its group or others can write.
func checkSocketDir(dir string) error {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return fmt.Errorf("admin socket directory: %w", err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("admin socket directory %s is not a directory", dir)
	case int(st.Uid) != os.Geteuid():
		return fmt.Errorf("admin socket directory %s is owned by uid %d, not by breakerd's uid %d: its owner could replace the socket", dir, st.Uid, os.Geteuid())
	case st.Mode&0o022 != 0:
		return fmt.Errorf("admin socket directory %s is writable by its group or others (mode %04o): they could replace the socket; use a directory only root can write, such as /run/breakerd", dir, st.Mode&0o7777)
	}
	return nil
}

// removeStaleSocket removes path only if it is a socket nothing listens
// on. Nothing at path is fine; anything else is an error.
func removeStaleSocket(path string) error {
	stale, err := socketInUse(path)
	if err != nil || !stale {
		return err
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("removing stale admin socket: %w", err)
	}
	return nil
}

// socketInUse returns an error when path holds anything but a socket, or a
// socket something listens on; stale reports a socket nothing listens on.
func socketInUse(path string) (stale bool, _ error) {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("admin socket: %w", err)
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return false, fmt.Errorf("admin socket %s exists and is not a socket (%s); refusing to replace it", path, fi.Mode().Type())
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return false, fmt.Errorf("admin socket %s: another process listens on it (another breakerd?); refusing to take it over", path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return false, fmt.Errorf("admin socket %s: cannot tell whether it is in use: %w", path, err)
	}
	return true, nil
}

// remove closes the listener and unlinks the path if it is still this
// socket (not one another process put there since).
func (s *adminSocket) remove() {
	s.l.Close()
	var st unix.Stat_t
	if unix.Lstat(s.path, &st) == nil && st.Dev == s.dev && st.Ino == s.ino {
		_ = os.Remove(s.path)
	}
}

// peerIsRoot checks the connecting process's credentials (SO_PEERCRED):
// only root, or breakerd's own uid, may use the socket. The file mode
// already keeps others out; this holds even if the mode is widened.
func peerIsRoot(c net.Conn) error {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("not a unix connection: %T", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if credErr != nil {
		return fmt.Errorf("reading peer credentials: %w", credErr)
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("peer uid %d (pid %d) is not root", cred.Uid, cred.Pid)
	}
	return nil
}
