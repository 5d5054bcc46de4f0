package maps

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
)

// Problem is something under a running daemon that changed and that
// weakens or ends protection.
type Problem string

// The problems Check reports.
const (
	// CgroupRemoved: the protected cgroup directory is gone; the links
	// hang on a dead cgroup and protect nothing.
	CgroupRemoved Problem = "cgroup_removed"
	// CgroupRecreated: a new directory stands at the protected path; its
	// processes are not protected until the programs are attached to it.
	CgroupRecreated Problem = "cgroup_recreated"
	// PinsRemoved: a map or link pin is missing, or is another object, or
	// the whole pin directory was removed: on exit the links would detach
	// and a new daemon would start empty.
	PinsRemoved Problem = "pins_removed"
	// BPFFSUnmounted: the bpf filesystem the pins were made on is no
	// longer mounted where it was: the pin directory's path is on the
	// filesystem underneath, or on a new bpffs mounted there.
	BPFFSUnmounted Problem = "bpffs_unmounted"
)

// Problems are the problems found by one Check, with a message each.
type Problems map[Problem]string

func (p Problems) Error() string {
	var errs []error
	for _, k := range []Problem{CgroupRemoved, CgroupRecreated, BPFFSUnmounted, PinsRemoved} {
		if m, ok := p[k]; ok {
			errs = append(errs, fmt.Errorf("%s: %s", k, m))
		}
	}
	return errors.Join(errs...).Error()
}

// mapPins is every map the object pins by name, with this Kernel's handle
// (TestCheckAndRepairEveryMapPin holds it to the object's list): one left
// out is neither checked nor pinned again, and the next start makes it
// anew, empty, beside the others.
func (k *Kernel) mapPins() map[string]*ebpf.Map {
	return map[string]*ebpf.Map{
		bpf.BreakerMapVerdicts: k.objs.Verdicts, bpf.BreakerMapConfig: k.objs.Config, bpf.BreakerMapCounters: k.objs.Counters,
		bpf.BreakerMapLimits: k.objs.Limits, bpf.BreakerMapBulk: k.objs.Bulk, bpf.BreakerMapStats: k.objs.Stats,
		bpf.BreakerMapEvents: k.objs.Events, bpf.BreakerMapSocks: k.objs.Socks, bpf.BreakerMapProbeBudgets: k.objs.ProbeBudgets,
		bpf.BreakerMapOverrides: k.objs.Overrides, bpf.BreakerMapWorkloads: k.objs.Workloads, bpf.BreakerMapHandoff: k.objs.Handoff,
		bpf.BreakerMapInflight:   k.objs.Inflight,
		bpf.BreakerMapRejections: k.objs.Rejections,
		bpf.BreakerMapRespPorts:  k.objs.RespPorts,
		bpf.BreakerMapAnswered:   k.objs.Answered,
		bpf.BreakerMapFallbacks:  k.objs.Fallbacks,
		bpf.BreakerMapRedirects:  k.objs.Redirects,
		bpf.BreakerMapOrigins:    k.objs.Origins,
	}
}

// pinFS is the filesystem a Kernel's pins are on.
type pinFS struct {
	dev  uint64 // its device
	root string // the directory it is mounted on
}

// fsOf returns the filesystem of path, which exists.
func fsOf(path string) (pinFS, error) {
	path, err := filepath.Abs(path)
	if err != nil {
		return pinFS{}, fmt.Errorf("pin directory: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return pinFS{}, fmt.Errorf("pin directory %s: %w", path, err)
	}
	root := path
	for p := filepath.Dir(path); p != root; root, p = p, filepath.Dir(p) {
		var up unix.Stat_t
		if err := unix.Stat(p, &up); err != nil || up.Dev != st.Dev {
			break
		}
	}
	return pinFS{dev: st.Dev, root: root}, nil
}

// groundState is where the pin directory stands now.
type groundState int

const (
	// groundSame: the pin directory is there, on the pins' filesystem.
	groundSame groundState = iota
	// groundDirGone: the pin directory (and maybe directories above it)
	// was removed from the pins' filesystem.
	groundDirGone
	// groundRemounted: the pins' bpffs was unmounted and another bpffs is
	// mounted where it was: the pins are gone, and may be made again on it.
	groundRemounted
	// groundUnmounted: the pins' bpffs was unmounted and the path is on the
	// filesystem underneath (another bpffs, or none), or another
	// filesystem was mounted over the path: nothing may be pinned there.
	groundUnmounted
)

// ground tells where k.dir stands, with a description of what is there
// when it is not the pins' bpffs.
func (k *Kernel) ground() (groundState, string) {
	p := k.dir
	for {
		_, err := os.Lstat(p)
		if err == nil || !errors.Is(err, os.ErrNotExist) || p == filepath.Dir(p) {
			break
		}
		p = filepath.Dir(p)
	}
	now, err := fsOf(p)
	if err != nil {
		return groundUnmounted, err.Error()
	}
	if now.dev == k.fs.dev {
		if p != k.dir {
			return groundDirGone, ""
		}
		return groundSame, ""
	}
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		return groundUnmounted, err.Error()
	}
	if st.Type != unix.BPF_FS_MAGIC {
		return groundUnmounted, fmt.Sprintf("%s is on a filesystem with magic %#x, not bpffs", p, st.Type)
	}
	if now.root != k.fs.root {
		return groundUnmounted, fmt.Sprintf("%s is on the bpffs mounted at %s", p, now.root)
	}
	return groundRemounted, ""
}

// Check looks at what protection stands on: the protected cgroup (same
// directory as attached, links on it), the bpf filesystem, and every pin
// (present, and the object this Kernel uses). It returns nil when all is
// as attached.
func (k *Kernel) Check() Problems {
	p := Problems{}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.cgroup != "" {
		id, err := cgroupID(k.cgroup)
		switch {
		case err != nil:
			p[CgroupRemoved] = fmt.Sprintf("%s is gone; nothing is protected", k.cgroup)
		case id != k.cgroupID:
			p[CgroupRecreated] = fmt.Sprintf("%s was removed and made again; its processes are not protected", k.cgroup)
		}
	}
	switch g, detail := k.ground(); g {
	case groundDirGone:
		p[PinsRemoved] = fmt.Sprintf("the pin directory %s was removed: every pin is gone (the daemon's handles still hold the maps and links)", k.dir)
		return p
	case groundRemounted:
		p[BPFFSUnmounted] = fmt.Sprintf("the bpffs mounted at %s was unmounted and another is mounted there: the pins in %s are gone (the daemon's handles still hold the maps and links)", k.fs.root, k.dir)
		return p
	case groundUnmounted:
		p[BPFFSUnmounted] = fmt.Sprintf("the bpffs mounted at %s, which held %s, is unmounted or hidden by another mount (%s): the pins are out of reach, and are not made again on the filesystem now there, where a later mount would hide them and the links they keep attached; mount bpffs at %s again and breakerd pins everything there (a restart before that starts with nothing adopted: open circuits are forgotten)", k.fs.root, k.dir, detail, k.fs.root)
		return p
	}
	var missing, foreign []string
	for name, m := range k.mapPins() {
		path := filepath.Join(k.dir, name)
		if !samePinnedMap(path, m) {
			missing, foreign = sortPin(path, name, missing, foreign)
		}
	}
	for name, l := range k.links {
		path := filepath.Join(k.dir, "link_"+name)
		if !samePinnedLink(path, l) {
			missing, foreign = sortPin(path, "link_"+name, missing, foreign)
		}
	}
	var msgs []string
	if len(missing) > 0 {
		slices.Sort(missing)
		msgs = append(msgs, fmt.Sprintf("missing in %s: %v", k.dir, missing))
	}
	if len(foreign) > 0 {
		slices.Sort(foreign)
		paths := make([]string, len(foreign))
		for i, name := range foreign {
			paths[i] = filepath.Join(k.dir, name)
		}
		msgs = append(msgs, fmt.Sprintf("replaced in %s by objects breakerd did not pin: %v; breakerd never removes or repairs these (they may be another program's), so protection stays incomplete until the operator removes them (rm %s), after which the next check pins breakerd's own again",
			k.dir, foreign, strings.Join(paths, " ")))
	}
	if len(msgs) > 0 {
		p[PinsRemoved] = strings.Join(msgs, "; ")
	}
	if len(p) == 0 {
		return nil
	}
	return p
}

// sortPin adds name, whose pin at path is not this Kernel's object, to
// missing (nothing is pinned there) or to foreign (something else is).
func sortPin(path, name string, missing, foreign []string) ([]string, []string) {
	if _, err := os.Lstat(path); err != nil {
		return append(missing, name), foreign
	}
	return missing, append(foreign, name)
}

func samePinnedMap(path string, m *ebpf.Map) bool {
	pinned, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return false
	}
	defer pinned.Close()
	a, err1 := pinned.Info()
	b, err2 := m.Info()
	if err1 != nil || err2 != nil {
		return false
	}
	ida, _ := a.ID()
	idb, _ := b.ID()
	return ida == idb
}

func samePinnedLink(path string, l link.Link) bool {
	pinned, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		return false
	}
	defer pinned.Close()
	a, err1 := pinned.Info()
	b, err2 := l.Info()
	return err1 == nil && err2 == nil && a.ID == b.ID
}

// Repair puts back what can be put back: missing pins are pinned again from
// this Kernel's handles (when the bpf filesystem they were made on, or a
// bpffs mounted again in its place, is there; the pin directory is made
// again, and locked again, when it was removed), and a protected cgroup
// made again at the same path gets the programs attached to it (new links,
// pinned in place of the old ones). A removed cgroup, an unmounted bpffs or
// a pin replaced by another object cannot be repaired; Check keeps
// reporting them.
func (k *Kernel) Repair() error {
	var errs []error
	k.mu.Lock()
	defer k.mu.Unlock()
	g, detail := k.ground()
	if g == groundUnmounted {
		return fmt.Errorf("the bpffs mounted at %s, which held %s, is unmounted or hidden by another mount (%s): nothing is pinned until a bpffs is mounted there again", k.fs.root, k.dir, detail)
	}
	if err := k.relock(); err != nil {
		return err
	}
	if g != groundSame {
		if err := os.MkdirAll(k.dir, 0o700); err != nil {
			return fmt.Errorf("making pin directory again: %w", err)
		}
		// Unmounted between the look and the mkdir: what was made is not
		// the pins' ground.
		fs, err := fsOf(k.dir)
		var st unix.Statfs_t
		if err == nil {
			err = unix.Statfs(k.dir, &st)
		}
		if err != nil || fs.root != k.fs.root || st.Type != unix.BPF_FS_MAGIC {
			_ = os.Remove(k.dir)
			return fmt.Errorf("the pin directory %s made again is not on a bpffs mounted at %s: nothing is pinned (%v)", k.dir, k.fs.root, err)
		}
		k.fs = fs // after a mount again: the new bpffs at the same place
	}
	if err := writeMarker(k.dir); err != nil {
		errs = append(errs, err)
	}
	for name, m := range k.mapPins() {
		path := filepath.Join(k.dir, name)
		if _, err := os.Lstat(path); err == nil {
			continue // there (if it is another object, leave it: not ours to remove)
		}
		_ = m.Unpin()
		if err := m.Pin(path); err != nil {
			errs = append(errs, fmt.Errorf("pinning %s again: %w", name, err))
		}
	}
	if k.cgroup != "" {
		if id, err := cgroupID(k.cgroup); err == nil && id != k.cgroupID {
			if err := CheckCgroup(k.cgroup); err != nil {
				return errors.Join(append(errs, err)...)
			}
			// The lock is on the removed directory: take the new one's
			// first (another daemon may protect it already).
			f, err := lockCgroup(k.cgroup)
			if err != nil {
				return errors.Join(append(errs, err)...)
			}
			if k.cgroupLock != nil {
				k.cgroupLock.Close()
			}
			k.cgroupLock = f
			for _, h := range hooks {
				if h.optional && k.links[h.name] == nil {
					continue // not needed so far
				}
				if h.responses && !k.responses {
					continue
				}
				l, err := attachLink(k.cgroup, h, h.prog(&k.objs))
				if err != nil {
					errs = append(errs, err)
					continue
				}
				if err := pinReplacing(l, filepath.Join(k.dir, "link_"+h.name)); err != nil {
					l.Close()
					errs = append(errs, fmt.Errorf("pinning %s: %w", h.name, err))
					continue
				}
				if old := k.links[h.name]; old != nil {
					old.Close()
				}
				k.links[h.name] = l
			}
			k.cgroupID = id
			if err := k.syncLoaderSettings(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for name, l := range k.links {
		path := filepath.Join(k.dir, "link_"+name)
		if _, err := os.Lstat(path); err == nil {
			continue
		}
		if err := pinReplacing(l, path); err != nil {
			errs = append(errs, fmt.Errorf("pinning link_%s again: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// relock takes the lock of the pin directory's base again when its path
// names another directory than the one locked (it was removed, or its
// bpffs mounted again), before anything is pinned there: a second daemon
// may have taken the new directory meanwhile, and then it is its. Call
// with k.mu held.
func (k *Kernel) relock() error {
	if k.lock == nil || !k.lock.moved() {
		return nil
	}
	l, err := LockDir(filepath.Dir(k.dir))
	if err != nil {
		return fmt.Errorf("locking the pin directory again before pinning: %w", err)
	}
	k.lock.Close()
	k.lock = l
	return nil
}
