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

// DirLock is the exclusive lock on a pin directory (flock on the directory
// itself), held by the one breakerd that uses those pins.
type DirLock struct{ f *os.File }

// ErrLocked is returned by LockDir when another process holds the lock.
var ErrLocked = errors.New("another breakerd is running on these pins")

// LockDir checks that dir (default DefaultDir) is on a bpf filesystem,
// makes it if needed, and takes its lock without waiting.
func LockDir(dir string) (*DirLock, error) {
	if dir == "" {
		dir = DefaultDir
	}
	if err := onBPFFS(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("making pin directory: %w", err)
	}
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("opening pin directory: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w (%s is locked; stop it first, or give this one another --bpffs)", ErrLocked, dir)
		}
		return nil, fmt.Errorf("locking pin directory %s: %w", dir, err)
	}
	return &DirLock{f: f}, nil
}

// Close releases the lock; a nil lock is fine.
func (l *DirLock) Close() {
	if l != nil && l.f != nil {
		l.f.Close()
		l.f = nil
	}
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
