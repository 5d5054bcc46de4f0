package daemon

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	stdmaps "maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/breakerd/breakerd/internal/cgroup2"
	"github.com/breakerd/breakerd/kube"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// cgroupWatch keeps the kernel's workloads map (cgroup id → class) equal to
// the workloads of the cgroups below the attach point, as cgroups come and
// go.
//
// Why an inotify watch on the cgroup tree and not a cgroup_mkdir tracepoint
// program: the selector is a glob over cgroup paths, which only the daemon
// can match, so a tracepoint would only have woken the daemon, as inotify
// does, at the cost of another program run on every cgroup made anywhere on
// the node and another record type. inotify on cgroupfs reports a mkdir
// when it happens, on every kernel breakerd supports, needs no capability
// beyond reading the tree, and its one weakness (a queue overflow, or a
// child made before the watch on its new parent was added) is covered: a new
// directory's subtree is walked once its watch is in place, an overflow
// triggers a full rescan, and a full rescan also runs every rescanInterval
// as a safety net. Every scan also deletes map entries of cgroups that no
// longer exist, so no entry outlives its cgroup by more than a rescan.
//
// It has its own lock and never takes Daemon.mu, so a busy event loop
// never delays protecting a new cgroup.
type cgroupWatch struct {
	k      *maps.Kernel
	log    *slog.Logger
	root   string // patterns are relative to this (the cgroup v2 mount)
	attach string // the attach point: only cgroups below it are looked at

	mu      sync.Mutex
	w       *fsnotify.Watcher
	cfg     *policy.Config
	classes policy.Classes
	paths   map[string]uint64 // every cgroup below attach, watched: path → id
	written map[uint64]entry  // entries this daemon knows are in the map
	// full are the cgroups of a workload the map had no room for (by
	// path): not protected; written again when an entry goes, and tried
	// at every rescan.
	full map[string]entry
	// pods are the pod UIDs each pod-selecting workload selects (kube.go).
	pods map[string]map[string]bool
	// podOf maps the cgroup ids of pods' cgroups (and their containers')
	// to the pod UID; read without mu (handle, the admin API).
	podOf sync.Map
}

// entry is one cgroup's workload as written to the map: its class and its
// bulkhead class (a reordered list moves a sharing workload's bulkhead
// class and leaves its class 0: the entry is written again).
type entry struct {
	workload string
	class    uint8
	bulkhead uint8
}

// rescanInterval is how often the whole tree is scanned again.
const rescanInterval = 10 * time.Second

func newCgroupWatch(k *maps.Kernel, log *slog.Logger, attach string) (*cgroupWatch, error) {
	attach = filepath.Clean(attach)
	root, err := cgroup2.MountOf(attach)
	if err != nil {
		return nil, err
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	return &cgroupWatch{k: k, log: log, root: root, attach: attach, w: w,
		paths: map[string]uint64{}, written: map[uint64]entry{}, full: map[string]entry{}}, nil
}

// apply takes cfg's workloads and brings the map in line with them at
// once (every cgroup classified again).
func (cw *cgroupWatch) apply(cfg *policy.Config) {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	cw.cfg, cw.classes = cfg, cfg.Classes()
	cw.scanLocked()
}

// rescan scans the whole tree now (the attach point was made again, say).
func (cw *cgroupWatch) rescan() {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	cw.scanLocked()
}

// classOf returns the workload and class of the cgroup at path, ok false
// when it belongs to no workload (or no workload is configured).
func (cw *cgroupWatch) classOf(path string) (name string, class uint8, ok bool) {
	if cw.cfg == nil || !cw.cfg.Classed() {
		return "", 0, false
	}
	rel, err := filepath.Rel(cw.root, path)
	if err != nil {
		return "", 0, false
	}
	if rel == "." {
		rel = ""
	}
	uid, _, inPod := kube.PodOfCgroup(filepath.ToSlash(rel))
	w, ok := cw.cfg.WorkloadOfPod(filepath.ToSlash(rel), func(workload string) bool { return inPod && cw.pods[workload][uid] })
	if !ok {
		return "", 0, false
	}
	return w.Name, uint8(cw.classes.Of(w.Name)), true
}

func cgroupID(path string) (uint64, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, errors.New("no inode number")
	}
	return st.Ino, nil
}

// addLocked watches one cgroup directory and writes its entry.
func (cw *cgroupWatch) addLocked(path string) {
	id, err := cgroupID(path)
	if err != nil {
		return // gone already
	}
	if old, ok := cw.paths[path]; ok && old != id {
		cw.forgetLocked(path) // removed and made again between two events
	}
	if _, ok := cw.paths[path]; !ok {
		if err := cw.w.Add(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			cw.log.Warn("watching a cgroup for children (a rescan will find them)", "cgroup", path, "err", err)
		}
		cw.paths[path] = id
	}
	if rel, err := filepath.Rel(cw.root, path); err == nil {
		if uid, _, ok := kube.PodOfCgroup(filepath.ToSlash(rel)); ok {
			cw.podOf.Store(id, uid)
		}
	}
	name, class, ok := cw.classOf(path)
	if !ok {
		delete(cw.full, path)
		if _, was := cw.written[id]; was {
			cw.deleteLocked(id)
		}
		return
	}
	want := entry{name, class, uint8(cw.classes.Bulkhead(name))}
	if e, ok := cw.written[id]; ok && e == want {
		return
	}
	if err := cw.k.PutWorkload(id, class, want.bulkhead); err != nil {
		_, known := cw.full[path]
		if errors.Is(err, maps.ErrWorkloadsFull) {
			cw.full[path] = want
		}
		if !known { // once per cgroup, not at every rescan
			cw.log.Error("cgroup not protected: writing its workload", "cgroup", path, "workload", name, "capacity", cw.k.WorkloadCapacity(), "err", err)
		}
		return
	}
	if _, was := cw.full[path]; was {
		delete(cw.full, path)
		cw.log.Info("cgroup protected: its workload written once the workloads map had room", "cgroup", path, "workload", name)
	}
	cw.written[id] = want
}

// addTreeLocked adds path and every cgroup below it.
func (cw *cgroupWatch) addTreeLocked(path string) {
	_ = filepath.WalkDir(path, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return nil // removed while walking
		}
		if e.IsDir() {
			cw.addLocked(p)
		}
		return nil
	})
}

func (cw *cgroupWatch) deleteLocked(id uint64) {
	if err := cw.k.DeleteWorkload(id); err != nil {
		cw.log.Warn("deleting the workload of a removed cgroup (the next rescan retries)", "cgroup_id", id, "err", err)
		return
	}
	delete(cw.written, id)
	// Room for a cgroup the full map turned away.
	for p := range cw.full {
		if _, watched := cw.paths[p]; watched {
			cw.addLocked(p)
			break
		}
	}
}

// forgetLocked drops path and everything below it: watches, paths and
// map entries.
func (cw *cgroupWatch) forgetLocked(path string) {
	for p, id := range cw.paths {
		if p == path || strings.HasPrefix(p, path+"/") {
			_ = cw.w.Remove(p)
			delete(cw.paths, p)
			delete(cw.full, p)
			cw.podOf.Delete(id)
			if _, ok := cw.written[id]; ok {
				cw.deleteLocked(id)
			}
		}
	}
}

// scanLocked walks the whole tree below the attach point, writes what is
// missing and deletes every map entry whose cgroup is gone, also entries a
// previous daemon left.
func (cw *cgroupWatch) scanLocked() {
	seen := map[string]bool{}
	_ = filepath.WalkDir(cw.attach, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if e.IsDir() {
			seen[p] = true
			cw.addLocked(p)
		}
		return nil
	})
	for p := range cw.paths {
		if !seen[p] {
			cw.forgetLocked(p)
		}
	}
	live := map[uint64]bool{}
	for _, id := range cw.paths {
		live[id] = true
	}
	entries, err := cw.k.Workloads()
	if err != nil {
		cw.log.Warn("reading the workloads map", "err", err)
		return
	}
	for id := range entries {
		if _, ok := cw.written[id]; !live[id] || !ok {
			cw.deleteLocked(id)
		}
	}
}

// setPods takes the pods each pod-selecting workload selects now and, when
// that changed, classifies every cgroup again.
func (cw *cgroupWatch) setPods(pods map[string]map[string]bool) {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	if stdmaps.EqualFunc(pods, cw.pods, stdmaps.Equal) {
		return
	}
	cw.pods = pods
	cw.scanLocked()
}

// presetPods takes the selected pods without classifying again (the
// caller's apply does).
func (cw *cgroupWatch) presetPods(pods map[string]map[string]bool) {
	cw.mu.Lock()
	cw.pods = pods
	cw.mu.Unlock()
}

// podUID returns the pod of a cgroup id, if the cgroup is a pod's.
func (cw *cgroupWatch) podUID(id uint64) (string, bool) {
	v, ok := cw.podOf.Load(id)
	if !ok {
		return "", false
	}
	return v.(string), true
}

// counts returns how many cgroups each workload has in the map.
func (cw *cgroupWatch) counts() map[string]int {
	c, _ := cw.countsAndFull()
	return c
}

// countsAndFull returns how many cgroups each workload has in the map, and
// how many the full map had no room for.
func (cw *cgroupWatch) countsAndFull() (in, full map[string]int) {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	in, full = map[string]int{}, map[string]int{}
	for _, e := range cw.written {
		in[e.workload]++
	}
	for _, e := range cw.full {
		full[e.workload]++
	}
	return in, full
}

// run follows the tree until ctx ends.
func (cw *cgroupWatch) run(ctx context.Context) {
	defer cw.w.Close()
	t := time.NewTicker(rescanInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-cw.w.Events:
			if !ok {
				return
			}
			cw.mu.Lock()
			switch {
			case ev.Has(fsnotify.Create):
				if fi, err := os.Lstat(ev.Name); err == nil && fi.IsDir() {
					cw.addTreeLocked(ev.Name)
				}
			case ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename):
				cw.forgetLocked(ev.Name)
			}
			cw.mu.Unlock()
		case err, ok := <-cw.w.Errors:
			if !ok {
				return
			}
			cw.log.Warn("watching the cgroup tree; rescanning", "err", err)
			cw.mu.Lock()
			cw.scanLocked()
			cw.mu.Unlock()
		case <-t.C:
			cw.mu.Lock()
			cw.scanLocked()
			cw.mu.Unlock()
		}
	}
}

// workloadCollector reports how many cgroups of each workload the kernel
// protects (label values: the configured workload names).
type workloadCollector struct{ d *Daemon }

var (
	descWorkloadCgroups     = prometheus.NewDesc("breakerd_workload_cgroups", "Cgroups in the kernel's workloads map, by workload (the configured names).", []string{"workload"}, nil)
	descWorkloadUnprotected = prometheus.NewDesc("breakerd_workload_cgroups_unprotected", "Cgroups of a workload that are not protected because the kernel's workloads map is full, by workload.", []string{"workload"}, nil)
	descWorkloadCapacity    = prometheus.NewDesc("breakerd_workload_cgroups_capacity", "How many cgroups the kernel's workloads map can hold.", nil, nil)
)

// Describe sends the collector's descriptors.
func (w *workloadCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descWorkloadCgroups
	ch <- descWorkloadUnprotected
	ch <- descWorkloadCapacity
}

// Collect reports every configured workload, 0 when it has no cgroup.
func (w *workloadCollector) Collect(ch chan<- prometheus.Metric) {
	d := w.d
	d.mu.Lock()
	cfg, cw := d.cfg, d.scope
	d.mu.Unlock()
	if cfg == nil || cw == nil {
		return
	}
	counts, full := cw.countsAndFull()
	for _, wl := range cfg.Workloads {
		ch <- prometheus.MustNewConstMetric(descWorkloadCgroups, prometheus.GaugeValue, float64(counts[wl.Name]), wl.Name)
		ch <- prometheus.MustNewConstMetric(descWorkloadUnprotected, prometheus.GaugeValue, float64(full[wl.Name]), wl.Name)
	}
	ch <- prometheus.MustNewConstMetric(descWorkloadCapacity, prometheus.GaugeValue, float64(cw.k.WorkloadCapacity()))
}

// cgroupIDs returns the ids of every cgroup below the attach point, as
// of the last walk and the events since.
func (cw *cgroupWatch) cgroupIDs() map[uint64]bool {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	out := make(map[uint64]bool, len(cw.paths))
	for _, id := range cw.paths {
		out[id] = true
	}
	return out
}

// cgroupName is what the daemon knows of one cgroup: its path below the
// cgroup v2 mount and its workload (if it is in the workloads map).
type cgroupName struct {
	path, workload string
}

// names returns what is known of every cgroup below the attach point, by
// id.
func (cw *cgroupWatch) names() map[uint64]cgroupName {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	out := make(map[uint64]cgroupName, len(cw.paths))
	for p, id := range cw.paths {
		rel, err := filepath.Rel(cw.root, p)
		if err != nil {
			rel = p
		}
		out[id] = cgroupName{path: filepath.ToSlash(rel), workload: cw.written[id].workload}
	}
	return out
}

// podCgroup reports whether the cgroup at path is a pod's (or one of its
// containers').
func (cw *cgroupWatch) podCgroup(path string) bool {
	rel, err := filepath.Rel(cw.root, path)
	if err != nil {
		return false
	}
	_, _, ok := kube.PodOfCgroup(filepath.ToSlash(rel))
	return ok
}

// movedClasses returns the key classes whose pinned entries (verdicts,
// limits) cannot be trusted under cfg: a previous daemon wrote the
// workloads map that pinned holds (cgroup id → entry; read before this
// daemon writes it), and a class whose cgroups now have another class, or
// that now holds cgroups of another class, names another workload than
// the one its pinned circuits and bulkheads belonged to (a reordered or
// changed workloads list across the restart). The same for bulkhead
// classes. Class 0 is never moved. Cgroups gone since are no evidence,
// nor a pod's cgroup of no workload now.
func (cw *cgroupWatch) movedClasses(cfg *policy.Config, pinned map[uint64]entry) map[uint8]bool {
	if len(pinned) == 0 {
		return nil
	}
	cw.mu.Lock()
	defer cw.mu.Unlock()
	savedCfg, savedClasses := cw.cfg, cw.classes
	cw.cfg, cw.classes = cfg, cfg.Classes()
	defer func() { cw.cfg, cw.classes = savedCfg, savedClasses }()
	moved := map[uint8]bool{}
	move := func(was, is uint8) {
		if was != is {
			moved[was], moved[is] = true, true
		}
	}
	_ = filepath.WalkDir(cw.attach, func(p string, e fs.DirEntry, err error) error {
		if err != nil || !e.IsDir() {
			return nil
		}
		id, err := cgroupID(p)
		if err != nil {
			return nil
		}
		old, ok := pinned[id]
		if !ok {
			return nil // a cgroup of no workload then: its class 0 is never moved
		}
		var now entry
		if name, class, ok := cw.classOf(p); ok {
			now = entry{name, class, uint8(cw.classes.Bulkhead(name))}
		} else if cw.podCgroup(p) {
			// Maybe only not known to be selected yet (the API was not
			// reachable): no evidence either way.
			return nil
		}
		move(old.class, now.class)
		move(old.bulkhead, now.bulkhead)
		return nil
	})
	delete(moved, 0)
	return moved
}
