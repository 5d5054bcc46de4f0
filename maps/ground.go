package maps

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

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
	// PinsRemoved: a map or link pin is missing (or is another object): on
	// exit the links would detach and a new daemon would start empty.
	PinsRemoved Problem = "pins_removed"
	// BPFFSUnmounted: the pin directory is no longer on a bpf filesystem.
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
	}
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
	var st unix.Statfs_t
	if err := unix.Statfs(k.dir, &st); err != nil || st.Type != unix.BPF_FS_MAGIC {
		p[BPFFSUnmounted] = fmt.Sprintf("%s is no longer on a bpf filesystem; the pins are gone", k.dir)
		return p
	}
	var missing []string
	for name, m := range k.mapPins() {
		if !samePinnedMap(filepath.Join(k.dir, name), m) {
			missing = append(missing, name)
		}
	}
	for name, l := range k.links {
		if !samePinnedLink(filepath.Join(k.dir, "link_"+name), l) {
			missing = append(missing, "link_"+name)
		}
	}
	if len(missing) > 0 {
		p[PinsRemoved] = fmt.Sprintf("missing or replaced in %s: %v", k.dir, missing)
	}
	if len(p) == 0 {
		return nil
	}
	return p
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
// this Kernel's handles (when the bpf filesystem is there), and a protected
// cgroup made again at the same path gets the programs attached to it (new
// links, pinned in place of the old ones). A removed cgroup or an unmounted
// bpffs cannot be repaired; Check keeps reporting them.
func (k *Kernel) Repair() error {
	var errs []error
	var st unix.Statfs_t
	if err := unix.Statfs(k.dir, &st); err != nil && errors.Is(err, unix.ENOENT) {
		if err := os.MkdirAll(k.dir, 0o700); err != nil {
			return fmt.Errorf("making pin directory again: %w", err)
		}
	} else if err != nil || st.Type != unix.BPF_FS_MAGIC {
		return fmt.Errorf("%s is not on a bpf filesystem: nothing can be pinned", k.dir)
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
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.cgroup != "" {
		if id, err := cgroupID(k.cgroup); err == nil && id != k.cgroupID {
			if err := CheckCgroup(k.cgroup); err != nil {
				return errors.Join(append(errs, err)...)
			}
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
