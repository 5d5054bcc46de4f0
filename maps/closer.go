package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
)

// CloseMechanism says how this kernel lets breakerd close established
// connections (the `close_established` option).
type CloseMechanism string

// The mechanisms, best first.
const (
	// CloseIterator: a TCP socket iterator program calls bpf_sock_destroy
	// (Linux 6.5+), filtering by destination and cgroup in the kernel.
	CloseIterator CloseMechanism = "bpf_sock_destroy"
	// CloseSockDiag: the daemon lists established sockets over
	// NETLINK_SOCK_DIAG with their cgroup ids and destroys the matching
	// ones with SOCK_DESTROY (CONFIG_INET_DIAG_DESTROY, Linux 4.5+; the
	// cgroup id attribute, 5.7+).
	CloseSockDiag CloseMechanism = "sock_diag"
	// CloseNone: neither; established connections stay open.
	CloseNone CloseMechanism = "none"
)

// CloseWorkloads says how a pass finds a socket's workload class from the
// cgroup it was made in (the main programs' Settings.Scoped and Classes).
type CloseWorkloads uint32

// The ways.
const (
	// CloseUnclassed: every socket is of class 0 (no workloads).
	CloseUnclassed = CloseWorkloads(bpf.DestroyCloseWorkloadsCLOSE_UNCLASSED)
	// CloseScoped: only sockets of cgroups in the workloads map count,
	// in their class.
	CloseScoped = CloseWorkloads(bpf.DestroyCloseWorkloadsCLOSE_SCOPED)
	// CloseClassed: a cgroup in the workloads map gives its class, every
	// other cgroup below the attach point class 0.
	CloseClassed = CloseWorkloads(bpf.DestroyCloseWorkloadsCLOSE_CLASSED)
)

// MaxCloseTargets is how many destinations one iterator run takes; a
// pass over more runs the iterator again for the rest.
const MaxCloseTargets = 4096

// CloseCount is what one pass did for one destination.
type CloseCount struct {
	Closed uint32 // connections closed
	Failed uint32 // connections the kernel refused to close
}

// PassStats describe one close pass.
type PassStats struct {
	Namespaces int // network namespaces walked
	Skipped    int // namespaces that could not be entered (logged)
	// Processes below the attach point whose network namespace the pass
	// could not find: Hidden, outside breakerd's PID namespace
	// (cgroup.procs lists them as 0); Unreadable, whose /proc/PID/ns/net
	// it may not open (the ptrace read check: CAP_SYS_PTRACE).
	Hidden, Unreadable int
	Duration           time.Duration // the whole pass, namespace enumeration included
}

// Closer closes the established TCP connections that protected processes
// hold to given destinations. It is used by one goroutine at a time.
type Closer struct {
	k    *Kernel
	mech CloseMechanism
	why  string // why the better mechanisms are not available
	objs bpf.DestroyObjects
	iter *link.Iter
	// With sock_diag: list_accepted, which lists the accepted sockets
	// (nil when it could not load: then only listening ports tell).
	listProg *ebpf.Program
	lister   *link.Iter
	cgroup   string
	log      *slog.Logger
	selfIno  uint64 // the daemon's own network namespace
}

// NewCloser finds the best mechanism this kernel offers and prepares it:
// the iterator object (its workloads map is the Kernel's own), else the
// sock_diag path. With neither, it returns a Closer whose Mechanism is
// CloseNone and whose Close does nothing; Reason says why. allowed, when
// given, narrows the choice to those mechanisms (breakerd
// --close-mechanism; tests use it to run the fallback, or none, on a
// kernel that has better).
func (k *Kernel) NewCloser(allowed ...CloseMechanism) *Closer {
	k.mu.Lock()
	cgroup := k.cgroup
	k.mu.Unlock()
	c := &Closer{k: k, cgroup: cgroup, log: k.log, mech: CloseNone}
	if ino, err := nsIno("/proc/thread-self/ns/net"); err == nil {
		c.selfIno = ino
	}
	c.mech, c.why = chooseClose(allowed, func() error { return c.loadIterator(k.objs.Workloads, k.objs.Origins) })
	if c.mech == CloseSockDiag {
		if err := c.loadLister(); err != nil {
			c.log.Warn("close_established: accepted sockets are told from clients by listening ports only", "err", err)
		}
	}
	return c
}

// chooseClose picks the best mechanism allowed (all when allowed is
// empty): the iterator when loadIterator succeeds, else sock_diag when
// the kernel's SOCK_DESTROY answers, else none; and says why the better
// ones are not used ("" with the iterator).
func chooseClose(allowed []CloseMechanism, loadIterator func() error) (CloseMechanism, string) {
	ok := func(m CloseMechanism) bool { return len(allowed) == 0 || slices.Contains(allowed, m) }
	var reasons []string
	if !ok(CloseIterator) {
		reasons = append(reasons, "bpf_sock_destroy: not chosen (--close-mechanism)")
	} else if err := loadIterator(); err == nil {
		return CloseIterator, ""
	} else {
		reasons = append(reasons, fmt.Sprintf("bpf_sock_destroy: %v", err))
	}
	mech := CloseNone
	if !ok(CloseSockDiag) {
		reasons = append(reasons, "sock_diag: not chosen (--close-mechanism)")
	} else if err := probeSockDiagDestroy(); err == nil {
		mech = CloseSockDiag
	} else {
		reasons = append(reasons, fmt.Sprintf("sock_diag: %v", err))
	}
	return mech, strings.Join(reasons, "; ")
}

// ProbeClose reports the mechanism NewCloser(allowed...) would pick on
// this kernel, and why the better ones are not used, without a loaded
// Kernel (breakerd probe).
func ProbeClose(allowed ...CloseMechanism) (CloseMechanism, string) {
	c := &Closer{mech: CloseNone}
	defer c.Release()
	return chooseClose(allowed, func() error { return c.loadIterator(nil, nil) })
}

// Mechanism is how this Closer closes connections.
func (c *Closer) Mechanism() CloseMechanism { return c.mech }

// CanReturn reports whether CloseReturning can close anything here: only
// the iterator reads a socket's origins storage (sock_diag cannot).
func (c *Closer) CanReturn() bool { return c.mech == CloseIterator }

// ErrCannotReturn is CloseReturning's error where CanReturn is false.
var ErrCannotReturn = errors.New("only bpf_sock_destroy can tell the connections redirected to a fallback")

// Reason says why better mechanisms are not used ("" with the iterator).
func (c *Closer) Reason() string { return c.why }

// Release frees the iterator object.
func (c *Closer) Release() error {
	var errs []error
	if c.iter != nil {
		errs = append(errs, c.iter.Close())
		c.iter = nil
	}
	if c.lister != nil {
		errs = append(errs, c.lister.Close())
		c.lister = nil
	}
	if c.listProg != nil {
		errs = append(errs, c.listProg.Close())
		c.listProg = nil
	}
	errs = append(errs, c.objs.Close())
	return errors.Join(errs...)
}

// loadIterator loads the close object, sharing workloads and origins (the
// Kernel's maps; nil: maps of its own, for a probe).
func (c *Closer) loadIterator(workloads, origins *ebpf.Map) error {
	spec, err := bpf.LoadDestroy()
	if err != nil {
		return fmt.Errorf("reading the close object: %w", err)
	}
	opts := ebpf.CollectionOptions{Cache: btfCache.Load()}
	if workloads != nil && origins != nil {
		opts.MapReplacements = map[string]*ebpf.Map{bpf.DestroyMapWorkloads: workloads, bpf.DestroyMapOrigins: origins}
	}
	err = spec.LoadAndAssign(&c.objs, &opts)
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("loading: %+v", ve)
		}
		return fmt.Errorf("loading: %w", err)
	}
	it, err := link.AttachIter(link.IterOptions{Program: c.objs.CloseEstablished})
	if err != nil {
		c.objs.Close()
		return fmt.Errorf("making the iterator: %w", err)
	}
	c.iter = it
	return nil
}

// loadLister loads list_accepted alone (it needs no bpf_sock_destroy), so
// that the sock_diag pass tells an accepted socket from a client's also
// after its listener is closed.
func (c *Closer) loadLister() error {
	spec, err := bpf.LoadDestroy()
	if err != nil {
		return fmt.Errorf("reading the close object: %w", err)
	}
	var objs struct {
		ListAccepted *ebpf.Program `ebpf:"list_accepted"`
	}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{Cache: btfCache.Load()}); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("loading list_accepted: %+v", ve)
		}
		return fmt.Errorf("loading list_accepted: %w", err)
	}
	it, err := link.AttachIter(link.IterOptions{Program: objs.ListAccepted})
	if err != nil {
		objs.ListAccepted.Close()
		return fmt.Errorf("making the accepted sockets' iterator: %w", err)
	}
	c.listProg, c.lister = objs.ListAccepted, it
	return nil
}

// acceptedKey names a socket as sock_diag does: its family and the start
// of its inet_diag_sockid (ports, source and destination addresses).
type acceptedKey struct {
	family uint8
	id     [36]byte
}

// acceptedSocks lists the accepted established sockets of the calling
// thread's network namespace (none without the lister).
func (c *Closer) acceptedSocks() (map[acceptedKey]bool, error) {
	out := map[acceptedKey]bool{}
	if c.lister == nil {
		return out, nil
	}
	r, err := c.lister.Open()
	if err != nil {
		return out, fmt.Errorf("opening the accepted sockets' iterator: %w", err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		return out, fmt.Errorf("reading the accepted sockets' iterator: %w", err)
	}
	var a bpf.DestroyAcceptedSock
	size := binary.Size(a)
	if len(b)%size != 0 {
		return out, fmt.Errorf("the accepted sockets' iterator wrote %d bytes, not records of %d", len(b), size)
	}
	for off := 0; off < len(b); off += size {
		if _, err := binary.Decode(b[off:off+size], binary.NativeEndian, &a); err != nil {
			return out, fmt.Errorf("decoding an accepted socket: %w", err)
		}
		k := acceptedKey{family: a.Family}
		binary.NativeEndian.PutUint16(k.id[0:2], a.Sport)
		binary.NativeEndian.PutUint16(k.id[2:4], a.Dport)
		copy(k.id[4:20], a.Src[:])
		copy(k.id[20:36], a.Dst[:])
		out[k] = true
	}
	return out, nil
}

// Close closes, in every network namespace of a process below the attach
// point, the established client connections to dests made in a cgroup
// below it (and as w says, in a cgroup of the workloads map; the class
// the map gives must be the destination's). Server-side sockets and every
// other socket are left alone: accepted sockets (told by how they were
// made, bpf/destroy.c; with sock_diag, when list_accepted loads) and those
// whose local port is a listening port of their namespace. It returns the
// count per destination.
func (c *Closer) Close(dests []Dest, w CloseWorkloads) (map[Dest]CloseCount, PassStats, error) {
	return c.pass(dests, w, closeByPeer)
}

// CloseReturning closes, as Close would, the established client
// connections that asked for one of dests and were redirected to a
// fallback they are still connected to (bpf/destroy.c's CLOSE_RETURNING),
// so that they reconnect to dests: a circuit with a fallback closed.
// Sockets that connected to the fallback's address themselves are left
// alone. The counts are by the destination the sockets asked for. Where
// CanReturn is false it closes nothing and returns ErrCannotReturn.
func (c *Closer) CloseReturning(dests []Dest, w CloseWorkloads) (map[Dest]CloseCount, PassStats, error) {
	if c.mech != CloseIterator {
		return map[Dest]CloseCount{}, PassStats{}, ErrCannotReturn
	}
	return c.pass(dests, w, closeReturning)
}

type closeMode = bpf.DestroyCloseMode

const (
	closeByPeer    = bpf.DestroyCloseModeCLOSE_BY_PEER
	closeReturning = bpf.DestroyCloseModeCLOSE_RETURNING
)

// pass closes the sockets of dests that mode picks (sock_diag: only
// closeByPeer).
func (c *Closer) pass(dests []Dest, w CloseWorkloads, mode closeMode) (map[Dest]CloseCount, PassStats, error) {
	start := time.Now()
	out := map[Dest]CloseCount{}
	var st PassStats
	if c.mech == CloseNone || len(dests) == 0 {
		return out, st, nil
	}
	var tcp []Dest
	for _, d := range dests {
		if d.Proto == TCP {
			tcp = append(tcp, d)
		}
	}
	tree, err := walkProtected(c.cgroup)
	if err != nil {
		return out, st, err
	}
	st.Hidden, st.Unreadable = tree.hidden, tree.unreadable
	var run func() error
	var errs []error
	switch c.mech {
	case CloseIterator:
		if err := c.settings(tree.depth, w, mode); err != nil {
			return out, st, err
		}
		for chunk := range chunks(tcp, MaxCloseTargets) {
			if err := c.putTargets(chunk); err != nil {
				return out, st, err
			}
			run = c.runIterator
			st.Namespaces, st.Skipped, errs = c.eachNetns(tree, run)
			counts, err := c.takeCounts(chunk)
			if err != nil {
				return out, st, err
			}
			for d, n := range counts {
				out[d] = n
			}
		}
	case CloseSockDiag:
		want := map[Dest]bool{}
		for _, d := range tcp {
			want[d] = true
		}
		run = func() error { return c.sockDiagPass(want, tree.ids, w, out) }
		st.Namespaces, st.Skipped, errs = c.eachNetns(tree, run)
	}
	st.Duration = time.Since(start)
	return out, st, errors.Join(errs...)
}

func chunks(ds []Dest, n int) func(func([]Dest) bool) {
	return func(yield func([]Dest) bool) {
		for len(ds) > 0 {
			m := min(n, len(ds))
			if !yield(ds[:m]) {
				return
			}
			ds = ds[m:]
		}
	}
}

func (c *Closer) settings(depth int, w CloseWorkloads, mode closeMode) error {
	cgID, err := cgroupID(c.cgroup)
	if err != nil {
		return err
	}
	v := bpf.DestroyCloseConfig{CgroupId: cgID, Workloads: bpf.DestroyCloseWorkloads(w), MaxDepth: uint32(depth), Mode: mode}
	if err := c.objs.CloseSettings.Put(uint32(0), &v); err != nil {
		return fmt.Errorf("writing the close settings: %w", err)
	}
	return nil
}

func (c *Closer) putTargets(ds []Dest) error {
	var k bpf.DestroyDestKey
	var v bpf.DestroyCloseCount
	it := c.objs.CloseTargets.Iterate()
	var stale []bpf.DestroyDestKey
	for it.Next(&k, &v) {
		stale = append(stale, k)
	}
	for _, k := range stale {
		_ = c.objs.CloseTargets.Delete(&k)
	}
	for _, d := range ds {
		key := destroyKey(d)
		if err := c.objs.CloseTargets.Put(&key, &bpf.DestroyCloseCount{}); err != nil {
			return fmt.Errorf("writing close target %s: %w", d, err)
		}
	}
	return nil
}

func (c *Closer) takeCounts(ds []Dest) (map[Dest]CloseCount, error) {
	out := map[Dest]CloseCount{}
	for _, d := range ds {
		key := destroyKey(d)
		var v bpf.DestroyCloseCount
		if err := c.objs.CloseTargets.Lookup(&key, &v); err != nil {
			return out, fmt.Errorf("reading close counts of %s: %w", d, err)
		}
		if v.Closed != 0 || v.Failed != 0 {
			out[d] = CloseCount{Closed: v.Closed, Failed: v.Failed}
		}
		_ = c.objs.CloseTargets.Delete(&key)
	}
	return out, nil
}

func destroyKey(d Dest) bpf.DestroyDestKey {
	k := d.Key()
	return bpf.DestroyDestKey{Addr: k.Addr, Port: k.Port, Proto: k.Proto, Class: k.Class}
}

// runIterator walks the TCP sockets of the calling thread's network
// namespace once.
func (c *Closer) runIterator() error {
	if err := c.objs.Listeners.Put(uint32(0), &bpf.DestroyListenPorts{}); err != nil {
		return fmt.Errorf("clearing the listening ports: %w", err)
	}
	r, err := c.iter.Open()
	if err != nil {
		return fmt.Errorf("opening the socket iterator: %w", err)
	}
	defer r.Close()
	if _, err := io.Copy(io.Discard, r); err != nil {
		return fmt.Errorf("reading the socket iterator: %w", err)
	}
	return nil
}

// protectedTree is what a pass needs of the cgroup tree below the attach
// point: its cgroup ids, its depth, one way into each network namespace
// its processes are in, and how many processes it could not place.
type protectedTree struct {
	ids        map[uint64]bool
	depth      int
	netns      map[uint64][]int // namespace inode -> pids in it
	hidden     int              // listed as 0: outside this PID namespace
	unreadable int              // /proc/PID/ns/net refused (ptrace read check)
}

func walkProtected(root string) (protectedTree, error) {
	t := protectedTree{ids: map[uint64]bool{}, netns: map[uint64][]int{}}
	base := strings.Count(filepath.Clean(root), string(filepath.Separator))
	err := filepath.WalkDir(root, func(path string, e fs.DirEntry, err error) error {
		if err != nil {
			if path == root {
				return err
			}
			return nil // a cgroup removed during the walk
		}
		if !e.IsDir() {
			return nil
		}
		if fi, err := e.Info(); err == nil {
			t.ids[fi.Sys().(*syscall.Stat_t).Ino] = true
		}
		t.depth = max(t.depth, strings.Count(path, string(filepath.Separator))-base)
		b, err := os.ReadFile(filepath.Join(path, "cgroup.procs"))
		if err != nil {
			return nil
		}
		for _, f := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(f)
			if err != nil || pid < 0 {
				continue
			}
			if pid == 0 {
				t.hidden++ // a process outside our PID namespace
				continue
			}
			ino, err := nsIno(fmt.Sprintf("/proc/%d/ns/net", pid))
			if errors.Is(err, fs.ErrPermission) {
				t.unreadable++
			}
			if err != nil {
				continue // or it exited
			}
			if len(t.netns[ino]) < 4 {
				t.netns[ino] = append(t.netns[ino], pid)
			}
		}
		return nil
	})
	if err != nil {
		return t, fmt.Errorf("walking cgroup %s: %w", root, err)
	}
	return t, nil
}

func nsIno(path string) (uint64, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, err
	}
	return fi.Sys().(*syscall.Stat_t).Ino, nil
}

// eachNetns runs fn in every network namespace of the tree, on a locked
// thread moved into it (setns needs CAP_SYS_ADMIN). A namespace that
// cannot be entered is skipped, counted and its error returned.
func (c *Closer) eachNetns(t protectedTree, fn func() error) (walked, skipped int, errs []error) {
	for ino, pids := range t.netns {
		var err error
		if ino == c.selfIno {
			err = fn()
		} else {
			err = errNoWay
			for _, pid := range pids {
				var f *os.File
				f, err = os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
				if err != nil {
					continue // exited: try another process of the namespace
				}
				err = inNetns(f, fn)
				f.Close()
				break
			}
		}
		if err != nil {
			skipped++
			errs = append(errs, fmt.Errorf("network namespace %d: %w", ino, err))
			continue
		}
		walked++
	}
	return walked, skipped, errs
}

var errNoWay = errors.New("no process of it is left to enter it by")

// inNetns runs fn on a thread of its own in the network namespace ns. If
// the thread cannot go back, it stays locked and ends with its goroutine.
func inNetns(ns *os.File, fn func() error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			done <- err
			return
		}
		defer self.Close()
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("entering it: %w", err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- errors.Join(ferr, fmt.Errorf("leaving it: %w", err))
			return // the thread stays locked: the runtime ends it
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}
