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

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

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
// A storm of cgroups made or removed (a node starting or draining many
// pods) must not hold up the one that needs protection: run reads every
// queued event at once, handles first the new cgroups that belong to a
// workload (or may have such children), then the rest in order, a chunk at
// a time with another look at the queue between chunks. Each new cgroup
// costs two system calls (the watch, then a stat for its id and its number
// of child directories; only a directory with children is read), a removed
// one a map lookup, a stat and the end of its watch; nothing visits every
// cgroup but a scan.
//
// It has its own lock and never waits for the owner, so a busy event loop
// never delays protecting a new cgroup.
type cgroupWatch struct {
	k      *maps.Kernel
	log    *slog.Logger
	root   string // patterns are relative to this (the cgroup v2 mount)
	attach string // the attach point: only cgroups below it are looked at

	mu      sync.Mutex
	ino     *inotify // nil once closed
	cfg     *policy.Config
	match   *policy.CgroupMatcher
	classes policy.Classes
	// nodes is every cgroup below attach (attach included) by path;
	// byWd those watched, by watch descriptor.
	nodes   map[string]*cgroupNode
	byWd    map[int32]*cgroupNode
	scanGen uint64           // counts scans: a node a scan did not see is gone
	written map[uint64]entry // entries this daemon knows are in the map
	// full are the cgroups of a workload the map had no room for (by
	// path): not protected; written again when an entry goes, and tried
	// at every rescan.
	full map[string]entry
	// pods are the pod UIDs each pod-selecting workload selects (kube.go).
	pods map[string]map[string]bool
	// podOf maps the cgroup ids of pods' cgroups (and their containers')
	// to the pod UID; read without the watch's lock (the admin API).
	podOf sync.Map
}

// noWatch is the watch descriptor of a cgroup that could not be watched.
const noWatch int32 = -1

// cgroupNode is one cgroup directory below the attach point.
type cgroupNode struct {
	path     string
	id       uint64
	wd       int32
	parent   *cgroupNode
	children map[string]*cgroupNode // by name
	scan     uint64                 // the last scan that saw it
}

// entry is one cgroup's workload as written to the map: its class and its
// bulkhead class (a reordered list moves a sharing workload's bulkhead
// class and leaves its class 0: the entry is written again).
type entry struct {
	workload string
	class    uint8
	bulkhead uint8
}

const (
	// rescanInterval is how often the whole tree is scanned again.
	rescanInterval = 10 * time.Second
	// eventChunk is how many queued events are handled between two looks
	// for new ones: a new protected cgroup waits for at most one chunk.
	eventChunk = 256
	// maxQueuedEvents bounds the events read ahead of handling them (about
	// 64 bytes each); beyond it they wait in the kernel's queue, whose
	// overflow makes a rescan.
	maxQueuedEvents = 1 << 16
)

func newCgroupWatch(k *maps.Kernel, log *slog.Logger, attach string) (*cgroupWatch, error) {
	attach = filepath.Clean(attach)
	root, err := cgroup2.MountOf(attach)
	if err != nil {
		return nil, err
	}
	ino, err := newInotify()
	if err != nil {
		return nil, err
	}
	return &cgroupWatch{k: k, log: log, root: root, attach: attach, ino: ino,
		nodes: map[string]*cgroupNode{}, byWd: map[int32]*cgroupNode{}, written: map[uint64]entry{}, full: map[string]entry{}}, nil
}

// close ends the watch (run returns).
func (cw *cgroupWatch) close() {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	if cw.ino != nil {
		cw.ino.close()
		cw.ino = nil
	}
}

// apply takes cfg's workloads and brings the map in line with them at
// once (every cgroup classified again).
func (cw *cgroupWatch) apply(cfg *policy.Config) {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	cw.cfg, cw.match, cw.classes = cfg, cfg.CgroupMatcher(), cfg.Classes()
	cw.scanLocked()
}

// rescan scans the whole tree now (the attach point was made again, say).
func (cw *cgroupWatch) rescan() {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	cw.scanLocked()
}

// rel returns path relative to the cgroup v2 mount ("" for the mount).
func (cw *cgroupWatch) rel(path string) string {
	if r, ok := strings.CutPrefix(path, cw.root); ok && (r == "" || r[0] == '/') {
		return strings.TrimPrefix(r, "/")
	}
	r, err := filepath.Rel(cw.root, path)
	if err != nil || r == "." {
		return ""
	}
	return filepath.ToSlash(r)
}

// podOfCgroup is kube.PodOfCgroup, without its work for the paths that
// cannot be a pod's.
func podOfCgroup(rel string) (string, bool) {
	if !strings.Contains(rel, "kubepods") {
		return "", false
	}
	uid, _, ok := kube.PodOfCgroup(rel)
	return uid, ok
}

// classOf returns the workload and class of the cgroup at path, ok false
// when it belongs to no workload (or no workload is configured).
func (cw *cgroupWatch) classOf(path string) (name string, class uint8, ok bool) {
	if cw.cfg == nil || !cw.cfg.Classed() {
		return "", 0, false
	}
	rel := cw.rel(path)
	uid, inPod := podOfCgroup(rel)
	w, ok := cw.match.WorkloadOf(rel, func(workload string) bool { return inPod && cw.pods[workload][uid] })
	if !ok {
		return "", 0, false
	}
	return w.Name, uint8(cw.classes.Of(w.Name)), true
}

// urgent reports whether the cgroup at path may need protection: it
// belongs to a workload (a selected pod's cgroup included), or a cgroup
// below it may match a pattern.
func (cw *cgroupWatch) urgent(path string) bool {
	if cw.cfg == nil || !cw.cfg.Classed() {
		return false
	}
	if _, _, ok := cw.classOf(path); ok {
		return true
	}
	return cw.match.MayMatchBelow(cw.rel(path))
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

// addLocked watches one cgroup directory and writes its entry. It
// returns the directory's node (nil when it is gone) and whether it has
// child directories (st_nlink counts them on cgroupfs, as on every
// kernfs): the watch is added before the stat, so a child made after
// the stat is reported by the watch, one made before is counted.
func (cw *cgroupWatch) addLocked(path string) (*cgroupNode, bool) {
	if cw.ino == nil {
		return nil, false
	}
	var st unix.Stat_t
	n := cw.nodes[path]
	if n != nil {
		if err := unix.Stat(path, &st); err != nil {
			return nil, false // gone already: its removal is queued
		}
		if st.Ino != n.id {
			cw.forgetLocked(n) // removed and made again between two events
			n = nil
		}
	}
	if n == nil {
		wd, err := cw.ino.add(path)
		switch {
		case errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR):
			return nil, false // gone already
		case err != nil:
			// Out of watches, say: the cgroup is still classified (and
			// its removal seen by its parent's watch); its children are
			// found by rescans.
			cw.log.Warn("watching a cgroup for children (a rescan will find them)", "cgroup", path, "err", err)
			wd = noWatch
		}
		if err := unix.Stat(path, &st); err != nil {
			cw.ino.remove(wd)
			return nil, false
		}
		if old := cw.byWd[wd]; old != nil && wd != noWatch {
			// The same directory under another path (a bind mount): one
			// node per watch.
			cw.forgetLocked(old)
			if wd, err = cw.ino.add(path); err != nil {
				return nil, false
			}
		}
		n = &cgroupNode{path: path, id: st.Ino, wd: wd}
		if parent := cw.nodes[filepath.Dir(path)]; parent != nil && path != cw.attach {
			n.parent = parent
			if parent.children == nil {
				parent.children = map[string]*cgroupNode{}
			}
			parent.children[filepath.Base(path)] = n
		}
		cw.nodes[path] = n
		if wd != noWatch {
			cw.byWd[wd] = n
		}
		if uid, ok := podOfCgroup(cw.rel(path)); ok {
			cw.podOf.Store(n.id, uid)
		}
	}
	n.scan = cw.scanGen
	cw.writeLocked(n)
	// Two links are the directory's name and its "."; each child
	// directory's ".." adds one. Another count (a filesystem that does
	// not keep it) is read.
	return n, st.Nlink != 2
}

// writeLocked brings n's map entry in line with its workload.
func (cw *cgroupWatch) writeLocked(n *cgroupNode) {
	path, id := n.path, n.id
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

// addTreeLocked adds path and every cgroup below it, reading only the
// directories that have child directories (known ones too, in case an
// event was lost).
func (cw *cgroupWatch) addTreeLocked(path string) {
	n, below := cw.addLocked(path)
	if n == nil || !below {
		return
	}
	f, err := os.Open(path)
	if err != nil {
		return // removed meanwhile
	}
	entries, _ := f.ReadDir(-1)
	f.Close()
	for _, e := range entries {
		if e.IsDir() {
			cw.addTreeLocked(filepath.Join(path, e.Name()))
		}
	}
}

func (cw *cgroupWatch) deleteLocked(id uint64) {
	if err := cw.k.DeleteWorkload(id); err != nil {
		cw.log.Warn("deleting the workload of a removed cgroup (the next rescan retries)", "cgroup_id", id, "err", err)
		return
	}
	delete(cw.written, id)
	// Room for a cgroup the full map turned away.
	for p := range cw.full {
		if n := cw.nodes[p]; n != nil {
			cw.writeLocked(n)
			break
		}
	}
}

// forgetLocked drops n and everything below it: watches, nodes and map
// entries.
func (cw *cgroupWatch) forgetLocked(n *cgroupNode) {
	for _, c := range n.children {
		cw.forgetLocked(c)
	}
	if cw.ino != nil {
		cw.ino.remove(n.wd)
	}
	if cw.byWd[n.wd] == n {
		delete(cw.byWd, n.wd)
	}
	if cw.nodes[n.path] == n {
		delete(cw.nodes, n.path)
		delete(cw.full, n.path)
	}
	if n.parent != nil && n.parent.children[filepath.Base(n.path)] == n {
		delete(n.parent.children, filepath.Base(n.path))
	}
	cw.podOf.Delete(n.id)
	if _, ok := cw.written[n.id]; ok {
		cw.deleteLocked(n.id)
	}
}

// scanLocked walks the whole tree below the attach point, writes what is
// missing and deletes every map entry whose cgroup is gone, also entries a
// previous daemon left.
func (cw *cgroupWatch) scanLocked() {
	if cw.ino == nil {
		// Closed (the daemon stops): a scan would find nothing watched
		// and delete every entry the next daemon's kernel still uses.
		return
	}
	cw.scanGen++
	cw.addTreeLocked(cw.attach) // known directories with children are read again too
	for _, n := range cw.nodes {
		if n.scan != cw.scanGen {
			cw.forgetLocked(n)
		}
	}
	entries, err := cw.k.Workloads()
	if err != nil {
		cw.log.Warn("reading the workloads map", "err", err)
		return
	}
	live := make(map[uint64]bool, len(cw.nodes))
	for _, n := range cw.nodes {
		live[n.id] = true
	}
	for id := range entries {
		if _, ok := cw.written[id]; !live[id] || !ok {
			cw.deleteLocked(id)
		}
	}
}

// handleLocked acts on queued events: first the cgroups made that may
// need protection (urgent), then, in order, at most eventChunk of the
// rest. It returns how many events it consumed from the front.
func (cw *cgroupWatch) handleLocked(evs []cgroupEvent, fresh int) int {
	for i := fresh; i < len(evs); i++ {
		ev := &evs[i]
		if ev.wd < 0 {
			// The queue overflowed: events were lost. A scan sees the tree
			// as it is now, after every event read so far.
			cw.log.Warn("the cgroup watch's event queue overflowed; rescanning")
			cw.scanLocked()
			return len(evs)
		}
		if ev.mask&unix.IN_CREATE == 0 {
			continue
		}
		parent := cw.byWd[ev.wd]
		if parent == nil {
			continue
		}
		if path := parent.path + "/" + ev.name; cw.urgent(path) {
			cw.addTreeLocked(path)
			ev.done = true
		}
	}
	n := min(len(evs), eventChunk)
	for i := range n {
		ev := &evs[i]
		parent := cw.byWd[ev.wd]
		if ev.done || parent == nil {
			continue
		}
		path := parent.path + "/" + ev.name
		if ev.mask&unix.IN_CREATE != 0 {
			cw.addTreeLocked(path)
			continue
		}
		// Removed: unless the directory at path now is the one the node
		// knows (made again, and already added ahead of this event).
		c := cw.nodes[path]
		if c == nil {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(path, &st) == nil && st.Ino == c.id {
			continue
		}
		cw.forgetLocked(c)
	}
	return n
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

// run follows the tree until ctx ends: it reads what the kernel has
// queued, handles the urgent events of it at once and the rest a chunk at
// a time, looking for new events between chunks.
func (cw *cgroupWatch) run(ctx context.Context) {
	cw.mu.Lock()
	ino := cw.ino
	cw.mu.Unlock()
	if ino == nil {
		return
	}
	defer cw.close()
	stop := context.AfterFunc(ctx, cw.close) // ends a blocking read
	defer stop()
	buf := make([]byte, 64<<10)
	var queue []cgroupEvent
	next := time.Now().Add(rescanInterval)
	for {
		fresh := len(queue) // queue[:fresh] were looked at for urgent ones
		if len(queue) == 0 {
			// Nothing to do: wait for an event or the next rescan.
			_ = ino.f.SetReadDeadline(next)
			n, err := ino.f.Read(buf)
			switch {
			case errors.Is(err, os.ErrDeadlineExceeded):
				cw.rescan()
				next = time.Now().Add(rescanInterval)
				continue
			case errors.Is(err, os.ErrClosed):
				return
			case err != nil:
				cw.log.Warn("reading the cgroup watch's events; rescanning", "err", err)
				cw.rescan()
				select { // not in a tight loop if it persists
				case <-ctx.Done():
					return
				case <-time.After(time.Second):
				}
				continue
			}
			queue = parseEvents(queue, buf[:n])
		}
		cw.mu.Lock()
		if cw.ino == nil {
			cw.mu.Unlock()
			return
		}
		for len(queue) < maxQueuedEvents {
			n, err := ino.read(buf, false)
			if err != nil || n == 0 {
				break
			}
			queue = parseEvents(queue, buf[:n])
		}
		done := cw.handleLocked(queue, fresh)
		cw.mu.Unlock()
		if queue = queue[done:]; len(queue) == 0 {
			queue = nil
		}
		if time.Now().After(next) {
			cw.rescan()
			next = time.Now().Add(rescanInterval)
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
	sh := d.shown.Load()
	if sh == nil || sh.cfg == nil || sh.scope == nil {
		return
	}
	cfg, cw := sh.cfg, sh.scope
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
	out := make(map[uint64]bool, len(cw.nodes))
	for _, n := range cw.nodes {
		out[n.id] = true
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
	out := make(map[uint64]cgroupName, len(cw.nodes))
	for _, n := range cw.nodes {
		out[n.id] = cgroupName{path: cw.rel(n.path), workload: cw.written[n.id].workload}
	}
	return out
}

// podCgroup reports whether the cgroup at path is a pod's (or one of its
// containers').
func (cw *cgroupWatch) podCgroup(path string) bool {
	_, ok := podOfCgroup(cw.rel(path))
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
	savedCfg, savedMatch, savedClasses := cw.cfg, cw.match, cw.classes
	cw.cfg, cw.match, cw.classes = cfg, cfg.CgroupMatcher(), cfg.Classes()
	defer func() { cw.cfg, cw.match, cw.classes = savedCfg, savedMatch, savedClasses }()
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
