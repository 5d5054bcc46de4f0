package maps

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// markerName is the symlink breakerd puts in each layout directory it
// makes (bpffs holds no regular files; it holds symlinks). Its target is
// the directory's layout version.
const markerName = "breakerd-layout"

// DirLock is the lock on a pin directory, held by the one breakerd that
// uses those pins: an exclusive flock on the directory itself, and a shared
// one on every directory above it on a bpf filesystem. So a second daemon is
// refused on the same directory, on one inside it (its shared lock meets the
// exclusive one) and on one around it (its exclusive lock meets the shared
// ones): pin directories never nest, on one bpffs or on bpffs mounted inside
// another, however the path is spelled.
type DirLock struct {
	dir   string     // the locked directory, absolute, symbolic links resolved
	f     *os.File   // dir, locked exclusive
	above []*os.File // the bpffs directories above dir, locked shared
}

// ErrLocked is returned by LockDir when another process holds the lock.
var ErrLocked = errors.New("another breakerd is running on these pins")

// LockDir checks that dir (default DefaultDir) is on a bpf filesystem,
// makes it if needed, and takes its lock without waiting. Refused, it
// removes the directories it made.
func LockDir(dir string) (_ *DirLock, err error) {
	if dir == "" {
		dir = DefaultDir
	}
	if err := onBPFFS(dir); err != nil {
		return nil, err
	}
	made := firstMissing(dir)
	defer func() {
		if err != nil && made != "" {
			for p := filepath.Clean(dir); os.Remove(p) == nil && p != made; p = filepath.Dir(p) {
			}
		}
	}()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("making pin directory: %w", err)
	}
	real, err := filepath.Abs(dir)
	if err == nil {
		real, err = filepath.EvalSymlinks(real)
	}
	if err != nil {
		return nil, fmt.Errorf("resolving pin directory %s: %w", dir, err)
	}
	l := &DirLock{dir: real}
	if l.f, err = flockDir(real, unix.LOCK_EX); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w (%s is locked by a breakerd using it or a directory inside it; stop that one first, or give this one a --bpffs outside every other breakerd's)", ErrLocked, real)
		}
		return nil, err
	}
	for p := filepath.Dir(real); ; p = filepath.Dir(p) {
		var st unix.Statfs_t
		if err := unix.Statfs(p, &st); err != nil || st.Type != unix.BPF_FS_MAGIC {
			break
		}
		f, err := flockDir(p, unix.LOCK_SH)
		if err != nil {
			l.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return nil, fmt.Errorf("%w (%s, which holds %s, is another breakerd's pin directory; stop that one first, or give this one a --bpffs outside it)", ErrLocked, p, real)
			}
			return nil, err
		}
		l.above = append(l.above, f)
		if p == filepath.Dir(p) {
			break
		}
	}
	return l, nil
}

// firstMissing returns the topmost directory of path (path itself, or one
// above it) that does not exist, or "" when path exists.
func firstMissing(path string) string {
	missing := ""
	for p := filepath.Clean(path); ; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil || p == filepath.Dir(p) {
			return missing
		}
		missing = p
	}
}

// ErrCgroupLocked is returned by Load when another breakerd, with other
// pins, protects the cgroup (on the same pins, ErrLocked comes first).
var ErrCgroupLocked = errors.New("another breakerd protects this cgroup")

// lockCgroup takes an exclusive flock on the cgroup directory path without
// waiting. Two daemons on one cgroup, each with its own pins (another
// --bpffs, another bpffs mount), would each attach a full set of programs
// and enforce two sets of verdicts and bulkheads on the same connects.
func lockCgroup(path string) (*os.File, error) {
	f, err := flockDir(path, unix.LOCK_EX)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return nil, fmt.Errorf("%w (%s is locked by a breakerd with other pins; stop that one first, or protect another cgroup)", ErrCgroupLocked, path)
	}
	return f, err
}

// flockDir opens directory path and locks it (how: LOCK_EX or LOCK_SH)
// without waiting.
func flockDir(path string, how int) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening %s to lock it: %w", path, err)
	}
	if err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("locking %s: %w", path, err)
	}
	return f, nil
}

// moved reports whether the locked directory's path now names another
// directory, or none (it was removed, or a filesystem was mounted or
// unmounted there): the lock then no longer keeps a second daemon off it.
func (l *DirLock) moved() bool {
	var held, now unix.Stat_t
	if unix.Fstat(int(l.f.Fd()), &held) != nil || unix.Stat(l.dir, &now) != nil {
		return true
	}
	return held.Dev != now.Dev || held.Ino != now.Ino
}

// Close releases the lock; a nil lock is fine.
func (l *DirLock) Close() {
	if l == nil {
		return
	}
	if l.f != nil {
		l.f.Close()
		l.f = nil
	}
	for _, f := range l.above {
		f.Close()
	}
	l.above = nil
}

// onBPFFS reports an error unless dir, or the nearest directory above it
// that exists, is on a bpf filesystem.
func onBPFFS(dir string) error {
	p := filepath.Clean(dir)
	for {
		var st unix.Statfs_t
		err := unix.Statfs(p, &st)
		if err == nil {
			if st.Type != unix.BPF_FS_MAGIC {
				return fmt.Errorf("pin directory %s is not on a bpf filesystem (%s has magic %#x; mount bpffs there: mount -t bpf bpffs /sys/fs/bpf)", dir, p, st.Type)
			}
			return nil
		}
		if !errors.Is(err, unix.ENOENT) || p == filepath.Dir(p) {
			return fmt.Errorf("pin directory %s: %w", dir, err)
		}
		p = filepath.Dir(p)
	}
}

func writeMarker(dir string) error {
	want := "v" + strconv.Itoa(LayoutVersion)
	path := filepath.Join(dir, markerName)
	if got, err := os.Readlink(path); err == nil && got == want {
		return nil
	}
	_ = os.Remove(path)
	if err := os.Symlink(want, path); err != nil {
		return fmt.Errorf("marking pin directory: %w", err)
	}
	return nil
}

var layoutName = regexp.MustCompile(`^v[0-9]+$`)

// isBreakerdLayout reports whether dir is a layout directory breakerd made:
// named v<N>, and holding breakerd's marker or (layouts from before the
// marker) breakerd's verdicts and config maps pinned under those names.
func isBreakerdLayout(dir string) bool {
	if !layoutName.MatchString(filepath.Base(dir)) {
		return false
	}
	if t, err := os.Readlink(filepath.Join(dir, markerName)); err == nil && t == filepath.Base(dir) {
		return true
	}
	for _, name := range []string{"verdicts", "config"} {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return false
		}
		info, err := m.Info()
		m.Close()
		if err != nil || info.Name != name {
			return false
		}
	}
	return true
}

// otherLayouts lists breakerd's layout directories under base other than
// own (a base name like "v3").
func otherLayouts(base, own string) []string {
	entries, err := os.ReadDir(base)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		p := filepath.Join(base, e.Name())
		if e.IsDir() && e.Name() != own && isBreakerdLayout(p) {
			out = append(out, p)
		}
	}
	return out
}

// removePins removes a layout directory: its links detach as their last
// pin goes (breakerd holds no other reference once its handles are closed),
// its maps go once nothing uses them.
func removePins(dir string) error {
	if err := os.RemoveAll(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing %s: %w", dir, err)
	}
	return nil
}

// Uninstall detaches breakerd's programs and removes its pins under dir
// (default DefaultDir), of every layout version, without loading or
// attaching anything and without a configuration. It takes the pin
// directory's lock, so it refuses to run while a breakerd uses these pins.
// It returns the layout directories it removed.
func Uninstall(dir string) ([]string, error) {
	if dir == "" {
		dir = DefaultDir
	}
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	lock, err := LockDir(dir)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	var removed []string
	var errs []error
	for _, d := range otherLayouts(dir, "") {
		// Detach explicitly too, so a link some other process still holds
		// open stops running now.
		for _, name := range append(hookNames(), tracerName) {
			if l, err := link.LoadPinnedLink(filepath.Join(d, "link_"+name), nil); err == nil {
				_ = l.Detach()
				l.Close()
			}
		}
		if err := removePins(d); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, d)
	}
	_ = os.Remove(dir) // when empty (never a mount point: rmdir refuses it)
	return removed, errors.Join(errs...)
}
