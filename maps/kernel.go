// Package maps is breakerd's typed access to its kernel side: it loads the
// programs of package bpf, pins their maps and links under a versioned bpffs
// directory, attaches them to a cgroup v2 directory, and reads and writes
// the verdict map, the settings (heartbeat, shadow mode), the per-circuit
// counters, the bulkhead limits and counts, and the outcome ring buffer. It
// knows nothing of policy.
//
// # Pins and adoption
//
// Everything lives under Dir/v<LayoutVersion> (default
// /sys/fs/bpf/breakerd/v<LayoutVersion>): every map by name (verdicts, probe_budgets,
// config, counters, limits, bulk, stats, events and socks, the per-socket storage that
// remembers which bulkhead slot a socket holds), one link per hook
// (link_connect4, …) and a marker symlink (breakerd-layout) that says the
// directory is breakerd's. Load reuses pinned maps whose layout matches, so a
// restarted daemon keeps the verdicts, bulkhead counts and counters the
// kernel is using, and swaps the new programs into the pinned links with an
// atomic link update, so the hooks are never empty while breakerd restarts.
// A pin of this layout version that does not match (ebpf.ErrMapIncompatible)
// is an error: it means the layout changed without a version bump.
// Directories of other layout versions that carry breakerd's marker (or,
// for layouts from before the marker, breakerd's own map pins) are removed
// once the new programs are attached and pinned (their links detach as they
// go); nothing else under Dir is touched.
//
// # One daemon per pin directory
//
// Load takes an exclusive flock(2) on Dir (bpffs supports it on
// directories), and a shared one on every bpffs directory above Dir, and
// holds them until Close, so a second breakerd on the same pins, or on a
// directory inside or around them, is refused before it changes anything
// (two daemons would split the ring buffer and overwrite each other's
// verdicts, or attach a second set of programs). Uninstall takes the same
// lock, so it refuses to run under a live daemon. Load also flocks the
// protected cgroup's directory, so a second daemon with pins elsewhere
// (another --bpffs, another bpffs mount) is refused on the same cgroup.
//
// # Ground
//
// Check and Repair watch what the pins stand on. Removed pins, or the
// whole pin directory, are pinned again from the daemon's handles. A pin
// replaced by another object is reported and left alone (it may be
// someone else's). The pins are never made again on another filesystem
// than the bpffs they were made on: after an unmount, the filesystem
// underneath (another bpffs, or none) would hold them only until the next
// mount hid them, with the links they keep attached; only a bpffs mounted
// again where the pins' was gets them.
//
// # Fail-open
//
// The programs reject only on an explicit open verdict while the daemon's
// heartbeat (Settings.Heartbeat) is fresh; any missing entry, failed lookup
// or stale heartbeat allows.
//
// # Kernel
//
// The object needs Linux 5.12 (BPF atomic fetch-and-add, compare-and-swap
// and exchange; every cgroup hook attached as a pinnable bpf_link). Load
// probes for it first and names the kernel when it is older.
package maps

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
)

// LayoutVersion is the version of the maps' and records' layout. It is part
// of the pin directory; bump it whenever bpf/breaker.h or a map definition
// in bpf/maps.h changes (TestLayoutVersionMatchesLayout fails until then).
const LayoutVersion = 15

// DefaultDir is the default bpffs directory for breakerd's pins.
const DefaultDir = "/sys/fs/bpf/breakerd"

// Options says where to pin and what to attach to.
type Options struct {
	// Dir is the bpffs directory for pins (default DefaultDir); the pins
	// go in Dir/v<LayoutVersion>.
	Dir string
	// Cgroup is the cgroup v2 directory whose processes are protected.
	// Empty means load and pin without attaching.
	Cgroup string
	// MaxVerdicts overrides the verdict map's capacity (default
	// MaxDestinations). It is fixed when the map is first created; an
	// adopted map keeps its own.
	MaxVerdicts uint32
	// RingBytes overrides the ring buffer's size (default 4 MiB, 65536
	// records); a power of two multiple of the page size.
	RingBytes uint32
	// MaxWorkloadCgroups overrides the workloads map's capacity (default
	// MaxWorkloadCgroups), like MaxVerdicts: fixed when the map is first
	// created.
	MaxWorkloadCgroups uint32
	// Lock is the pin directory's lock when the caller took it already
	// (LockDir); Load then owns it. Nil: Load takes it.
	Lock *DirLock
	// Logger receives load and adoption messages (default slog.Default()).
	Logger *slog.Logger
	// Responses attaches the response programs (cgroup_skb ingress and
	// egress) too: some target has response options. Without it they are
	// not attached, and a pinned link of theirs is detached.
	Responses bool

	// handoff keys the handoff by the socket's cookie even where sockops
	// could read the current thread (tests: the path 6.1 takes).
	handoff bool
}

// Features is what the running kernel offers breakerd, probed at load.
type Features struct {
	// SetRetval: bpf_set_retval exists (5.18+), so a rejected connect sees
	// the verdict's errno; without it, it sees EPERM.
	SetRetval bool
	// SockOpsCurrent: sockops may call bpf_get_current_pid_tgid and
	// bpf_get_current_cgroup_id (6.12 and 6.18 here; not 6.1), so with
	// workloads connect4/6 hand sockops their decision keyed by the
	// connecting thread; without it, by the socket's cookie, which
	// connect4/6 must make (35–40 ns of their run time here).
	SockOpsCurrent bool
}

// Kernel is breakerd's loaded kernel side.
type Kernel struct {
	View
	objs bpf.BreakerObjects
	dir  string
	lock *DirLock // replaced by Repair (guarded by mu)
	// cgroupLock is the protected cgroup directory, flocked exclusive
	// while this Kernel protects it (guarded by mu).
	cgroupLock *os.File
	fresh      bool // Load made the layout directory (nothing was pinned before)
	// The bpf filesystem the pins are on: its device, and the directory it
	// is mounted on (Check and Repair tell it from the one underneath).
	fs       pinFS
	features Features
	log      *slog.Logger

	mu        sync.Mutex // guards links, cgroup, cgroupID, responses, lock, cgroupLock, fs
	links     map[string]link.Link
	cgroup    string
	cgroupID  uint64
	responses bool // the response hooks are wanted (SetResponses)

	// What the loader says in the settings, as syncLoaderSettings last
	// wrote it: SetSettings (the heartbeat) reads these, never k.mu, which
	// attaching, repairing and the ground check hold around their system
	// calls.
	loaderTrace    atomic.Bool   // reset_seen attached: CONFIG_RESET_TRACE
	loaderCgroupID atomic.Uint64 // settings.attach_cgroup_id
	// cfgMu orders the writes of the settings (the heartbeat's, the
	// loader's read-modify-write and the verdict mask's), so none
	// overwrites another's newer fields with older ones. Held only around
	// the map's system calls.
	cfgMu sync.Mutex
	vm    verdictMask

	// The answered map, memory-mapped at its first read (Answered).
	answeredOnce sync.Once
	answeredMem  *ebpf.Memory
	answeredErr  error
}

type hook struct {
	name   string
	attach ebpf.AttachType
	prog   func(*bpf.BreakerObjects) *ebpf.Program
	// optional: attached only once something needs it (see
	// Kernel.ensureHook), and from then on kept while the pins live.
	optional bool
	// responses: attached only while some target has response options.
	responses bool
}

var hooks = []hook{
	{"connect4", ebpf.AttachCGroupInet4Connect, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Connect4 }, false, false},
	{"connect6", ebpf.AttachCGroupInet6Connect, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Connect6 }, false, false},
	{"sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Sendmsg4 }, false, false},
	{"sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Sendmsg6 }, false, false},
	{"sockops", ebpf.AttachCGroupSockOps, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Observe }, false, false},
	// sock_release gives back what a socket holds in a bulkhead; every
	// connection pays for its call, so it is attached only with bulkhead
	// limits (before the first one is written) and stays attached.
	{"sock_release", ebpf.AttachCgroupInetSockRelease, func(o *bpf.BreakerObjects) *ebpf.Program { return o.SockRelease }, true, false},
	// The fallback's hooks show a redirected socket's application the
	// address it asked for; attached before the first fallback is written
	// (PutFallback) and kept, so a configuration without fallbacks pays
	// nothing on getpeername and UDP receives.
	{"getpeername4", ebpf.AttachCgroupInet4GetPeername, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Getpeername4 }, true, false},
	{"getpeername6", ebpf.AttachCgroupInet6GetPeername, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Getpeername6 }, true, false},
	{"recvmsg4", ebpf.AttachCGroupUDP4Recvmsg, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Recvmsg4 }, true, false},
	{"recvmsg6", ebpf.AttachCGroupUDP6Recvmsg, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Recvmsg6 }, true, false},
	{"resp_egress", ebpf.AttachCGroupInetEgress, func(o *bpf.BreakerObjects) *ebpf.Program { return o.RespEgress }, false, true},
	{"resp_ingress", ebpf.AttachCGroupInetIngress, func(o *bpf.BreakerObjects) *ebpf.Program { return o.RespIngress }, false, true},
}

func hookNames() []string {
	names := make([]string, len(hooks))
	for i, h := range hooks {
		names[i] = h.name
	}
	return names
}

// ProbeFeatures asks the kernel what it supports. An inconclusive probe
// counts as not supported (the fail-open direction).
func ProbeFeatures() Features {
	return Features{
		SetRetval: features.HaveProgramHelper(ebpf.CGroupSockAddr, asm.FnSetRetval) == nil,
		SockOpsCurrent: features.HaveProgramHelper(ebpf.SockOps, asm.FnGetCurrentPidTgid) == nil &&
			features.HaveProgramHelper(ebpf.SockOps, asm.FnGetCurrentCgroupId) == nil,
	}
}

// ErrKernelTooOld is returned by CheckKernel on a kernel before 5.12.
var ErrKernelTooOld = errors.New("kernel too old: breakerd needs Linux 5.12 or later")

// CheckKernel verifies that the kernel runs what breakerd's object uses:
// BPF atomic fetch-and-add, compare-and-swap and exchange (5.12). A verifier
// refusal of the probe program is ErrKernelTooOld, with the kernel's release;
// other errors (no permission, seccomp) are returned as they are.
func CheckKernel() error {
	insns := asm.Instructions{
		asm.Mov.Imm(asm.R1, 0),
		asm.StoreMem(asm.RFP, -8, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R1, 1),
		asm.FetchAdd.Mem(asm.RFP, asm.R1, asm.DWord, -8),
		asm.Mov.Imm(asm.R0, 0),
		asm.CmpXchg.Mem(asm.RFP, asm.R1, asm.DWord, -8),
		asm.Xchg.Mem(asm.RFP, asm.R1, asm.DWord, -8),
		asm.Mov.Imm(asm.R0, 0),
		asm.Return(),
	}
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SocketFilter, Instructions: insns, License: "GPL"})
	if err == nil {
		p.Close()
		return nil
	}
	var ve *ebpf.VerifierError
	if errors.As(err, &ve) || errors.Is(err, unix.EINVAL) {
		var u unix.Utsname
		_ = unix.Uname(&u)
		return fmt.Errorf("%w (this one is %s; the programs use BPF atomic fetch-and-add, compare-and-swap and exchange): %v",
			ErrKernelTooOld, unix.ByteSliceToString(u.Release[:]), err)
	}
	return fmt.Errorf("probing the kernel's BPF support: %w", err)
}

// CheckCgroup verifies that path is a directory of a cgroup v2 hierarchy
// (statfs magic CGROUP2_SUPER_MAGIC): a tmpfs or a cgroup v1 controller
// directory is refused before anything is loaded or attached.
func CheckCgroup(path string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return fmt.Errorf("cgroup %s: %w", path, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		return fmt.Errorf("cgroup %s is not a cgroup v2 directory (filesystem magic %#x, want cgroup2 %#x)", path, st.Type, unix.CGROUP2_SUPER_MAGIC)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("cgroup %s: %w", path, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("cgroup %s is not a directory", path)
	}
	return nil
}

// PinDir returns the versioned pin directory under dir.
func PinDir(dir string) string {
	return layoutDir(dir, LayoutVersion)
}

func layoutDir(dir string, version int) string {
	if dir == "" {
		dir = DefaultDir
	}
	return filepath.Join(dir, fmt.Sprintf("v%d", version))
}

// Load loads breakerd's programs, adopting pinned maps of the same layout,
// and attaches them to opts.Cgroup (updating pinned links in place). Every
// input is checked before anything is created; a Load that fails leaves no
// pin it made behind. The caller must Close the Kernel; pins stay until
// Uninstall.
func Load(opts Options) (_ *Kernel, err error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	lock := opts.Lock
	defer func() {
		if err != nil && lock != nil {
			lock.Close()
		}
	}()
	if err := CheckCapabilities(); err != nil {
		return nil, err
	}
	if err := CheckKernel(); err != nil {
		return nil, err
	}
	if opts.Cgroup != "" {
		if err := CheckCgroup(opts.Cgroup); err != nil {
			return nil, err
		}
	}
	if opts.Dir == "" {
		opts.Dir = DefaultDir
	}
	if lock == nil {
		made := firstMissing(opts.Dir)
		if lock, err = LockDir(opts.Dir); err != nil {
			return nil, err
		}
		defer func() {
			if err != nil && made != "" {
				_ = os.RemoveAll(made) // made by LockDir: all in it is this Load's
			}
		}()
	}
	var cgroupLock *os.File
	if opts.Cgroup != "" {
		if cgroupLock, err = lockCgroup(opts.Cgroup); err != nil {
			return nil, err
		}
		defer func() {
			if err != nil {
				cgroupLock.Close()
			}
		}()
	}
	dir := PinDir(opts.Dir)
	k := &Kernel{dir: dir, lock: lock, cgroupLock: cgroupLock, links: map[string]link.Link{}, features: ProbeFeatures(), log: log, responses: opts.Responses}
	if opts.handoff {
		k.features.SockOpsCurrent = false
	}
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		k.fresh = true
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("making pin directory: %w", err)
	}
	defer func() {
		if err != nil && k.fresh {
			_ = os.RemoveAll(dir)
		}
	}()
	if err := writeMarker(dir); err != nil {
		return nil, err
	}
	if k.fs, err = fsOf(dir); err != nil {
		return nil, err
	}

	spec, err := bpf.LoadBreaker()
	if err != nil {
		return nil, fmt.Errorf("reading BPF object: %w", err)
	}
	if err := setFeatureVars(spec, k.features); err != nil {
		return nil, err
	}
	// resp_ports about to be made anew beside an adopted socks map (its
	// pin removed while the others stayed): see markEveryRespPort.
	respPortsAnew := !k.fresh && !pinned(dir, bpf.BreakerMapRespPorts) && pinned(dir, bpf.BreakerMapSocks)
	if opts.MaxVerdicts != 0 {
		spec.Maps[bpf.BreakerMapVerdicts].MaxEntries = opts.MaxVerdicts
	}
	if opts.RingBytes != 0 {
		spec.Maps[bpf.BreakerMapEvents].MaxEntries = opts.RingBytes
	}
	if opts.MaxWorkloadCgroups != 0 {
		spec.Maps[bpf.BreakerMapWorkloads].MaxEntries = opts.MaxWorkloadCgroups
	}
	err = spec.LoadAndAssign(&k.objs, &ebpf.CollectionOptions{
		Maps:  ebpf.MapOptions{PinPath: dir},
		Cache: btfCache.Load(),
	})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("loading BPF programs: %+v", ve)
		}
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return nil, fmt.Errorf("pinned maps in %s do not match layout v%d (the layout changed without a version bump; run breakerd uninstall): %w", dir, LayoutVersion, err)
		}
		return nil, fmt.Errorf("loading BPF programs: %w", err)
	}

	k.View = viewOf(&k.objs)
	// Before any write of the settings (attaching writes the loader's):
	// an adopted map's entries must keep their bits.
	if err := k.countVerdicts(false); err != nil {
		k.closeHandles()
		return nil, err
	}
	if respPortsAnew {
		if err := k.markEveryRespPort(); err != nil {
			k.closeHandles()
			return nil, err
		}
		log.Warn("resp_ports was made anew beside the pinned socket storage (its pin was removed): every port is marked, so the response programs look up the storage of every packet of the cgroup until the next uninstall", "pins", dir)
	}

	if opts.Cgroup != "" {
		if err := k.attach(opts.Cgroup); err != nil {
			k.closeHandles()
			return nil, err
		}
		// Only this Kernel's programs read the settings now: bits no
		// entry of its map needs go. (A failed count sets every bit.)
		if err := k.countVerdicts(true); err != nil {
			log.Warn("the verdict mask could not be counted exactly: no bit of it is cleared until a count succeeds", "err", err)
		}
		k.removeOtherLayouts(filepath.Dir(dir))
	}
	log.Info("kernel side loaded", "pins", dir, "cgroup", opts.Cgroup, "adopted", !k.fresh,
		"set_retval", k.features.SetRetval, "sockops_current", k.features.SockOpsCurrent)
	return k, nil
}

// pinned reports whether dir holds a pin named name.
func pinned(dir, name string) bool {
	_, err := os.Lstat(filepath.Join(dir, name))
	return err == nil
}

// markEveryRespPort sets every bit of resp_ports. A resp_ports made anew
// beside an adopted socks map has no bit for the sockets connect marked
// before (sockops set theirs in the old map, at their connect): without
// all bits, their turns from now on would go unseen. Marked, every packet
// of the cgroup pays the storage lookup, as before resp_ports existed.
func (k *Kernel) markEveryRespPort() error {
	keys := make([]uint32, respPortWords)
	all := make([]uint64, respPortWords)
	for i := range keys {
		keys[i], all[i] = uint32(i), ^uint64(0)
	}
	if _, err := k.objs.RespPorts.BatchUpdate(keys, all, nil); err != nil {
		return fmt.Errorf("marking every port in resp_ports: %w", err)
	}
	return nil
}

// setFeatureVars hands the probed features to the programs as load-time
// constants; the verifier prunes the branches they turn off.
func setFeatureVars(spec *ebpf.CollectionSpec, f Features) error {
	for name, on := range map[string]bool{bpf.BreakerVarHasSetRetval: f.SetRetval, bpf.BreakerVarHasSockopsCurrent: f.SockOpsCurrent} {
		v, ok := spec.Variables[name]
		if !ok {
			return fmt.Errorf("setting %s: the object has no such variable", name)
		}
		if err := v.Set(boolU32(on)); err != nil {
			return fmt.Errorf("setting %s: %w", name, err)
		}
	}
	return nil
}

func boolU32(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}

func cgroupID(path string) (uint64, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, fmt.Errorf("cgroup %s: %w", path, err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino, nil
}

// attach puts every program on cgroup: a pinned link already attached to it
// gets the new program by an atomic update; otherwise a new link is
// attached and pinned, and only then replaces the old pin (a pinned link to
// another cgroup keeps its place until the new one is attached and pinned).
func (k *Kernel) attach(cgroup string) error {
	id, err := cgroupID(cgroup)
	if err != nil {
		return err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.cgroup, k.cgroupID = cgroup, id
	for _, h := range hooks {
		prog := h.prog(&k.objs)
		pin := filepath.Join(k.dir, "link_"+h.name)
		if h.responses && !k.responses {
			if err := detachPinned(pin); err != nil {
				return fmt.Errorf("detaching %s: %w", h.name, err)
			}
			continue
		}
		if h.optional && !k.needs(h, pin) {
			continue
		}
		if l, err := k.adoptLink(pin, id, prog); err != nil {
			return fmt.Errorf("adopting %s: %w", pin, err)
		} else if l != nil {
			k.links[h.name] = l
			continue
		}
		l, err := attachLink(cgroup, h, prog)
		if err != nil {
			return err
		}
		k.links[h.name] = l
		if err := pinReplacing(l, pin); err != nil {
			return fmt.Errorf("pinning %s: %w", h.name, err)
		}
	}
	k.attachTracer()
	return k.syncLoaderSettings()
}

// syncLoaderSettings writes what the loader, not the daemon, says in the
// settings: CONFIG_RESET_TRACE, whether reset_seen is attached now (a
// previous daemon's settings may say otherwise), and attach_cgroup_id,
// the cgroup attached to now. Call with k.mu held, after every change of
// either.
func (k *Kernel) syncLoaderSettings() error {
	k.loaderTrace.Store(k.tracing())
	k.loaderCgroupID.Store(k.cgroupID)
	k.cfgMu.Lock()
	defer k.cfgMu.Unlock()
	var raw bpf.BreakerSettings
	if err := k.objs.Config.Lookup(uint32(0), &raw); err != nil {
		return fmt.Errorf("reading settings: %w", err)
	}
	was := raw
	k.loaderSettings(&raw)
	if raw == was {
		return nil
	}
	if err := k.objs.Config.Put(uint32(0), &raw); err != nil {
		return fmt.Errorf("writing settings: %w", err)
	}
	return nil
}

// tracerName names reset_seen's link (link_reset_seen): a tracing link
// on the tcp_receive_reset tracepoint, for the whole machine, not a
// cgroup's.
const tracerName = "reset_seen"

// attachTracer attaches reset_seen and pins it, or adopts the pinned link
// when it runs this very program. A pinned link of another build is
// replaced: a tracing link takes no new program, so the old one goes
// first (for a moment no reset of a storage-less connection is reported,
// the fail-open direction; the other order could report one twice).
// Without it (the kernel refuses the attachment), sockops keeps following
// established connections with state callbacks, as before: the settings'
// CONFIG_RESET_TRACE says which.
func (k *Kernel) attachTracer() {
	pin := filepath.Join(k.dir, "link_"+tracerName)
	if old, err := link.LoadPinnedLink(pin, nil); err == nil {
		if sameProgram(old, k.objs.ResetSeen) {
			k.links[tracerName] = old
			k.log.Info("adopted pinned link", "pin", pin)
			return
		}
		_ = old.Unpin()
		old.Close()
	}
	l, err := link.AttachTracing(link.TracingOptions{Program: k.objs.ResetSeen})
	if err != nil {
		k.log.Warn("resets of established connections are followed with sockops state callbacks (the reset tracepoint could not be attached)", "err", err)
		return
	}
	if err := pinReplacing(l, pin); err != nil {
		k.log.Warn("resets of established connections are followed with sockops state callbacks (pinning the reset tracepoint's link)", "err", err)
		l.Close()
		return
	}
	k.links[tracerName] = l
}

// sameProgram reports whether link l runs a program with p's instructions
// on p's maps. The kernel's tag of a program leaves its map references
// out, so the maps are compared too: a pinned link whose program still
// writes to maps whose pins were removed (made anew at this load) is not
// the same.
func sameProgram(l link.Link, p *ebpf.Program) bool {
	li, err := l.Info()
	if err != nil {
		return false
	}
	running, err := ebpf.NewProgramFromID(li.Program)
	if err != nil {
		return false
	}
	defer running.Close()
	a, err1 := running.Info()
	b, err2 := p.Info()
	if err1 != nil || err2 != nil || a.Tag != b.Tag {
		return false
	}
	ma, ok1 := a.MapIDs()
	mb, ok2 := b.MapIDs()
	return ok1 && ok2 && slices.Equal(ma, mb)
}

// loaderSettings sets what the loader says in raw, as syncLoaderSettings
// last stored it, and the verdict mask as last written. Call with cfgMu
// held.
func (k *Kernel) loaderSettings(raw *bpf.BreakerSettings) {
	raw.VerdictMask = k.vm.bits
	bit := uint32(bpf.BreakerConfigFlagsCONFIG_RESET_TRACE)
	raw.Flags &^= bit
	if k.loaderTrace.Load() {
		raw.Flags |= bit
	}
	raw.AttachCgroupId = k.loaderCgroupID.Load()
}

// tracing reports whether reset_seen is attached. Call with k.mu held.
func (k *Kernel) tracing() bool { return k.links[tracerName] != nil }

// needs reports whether optional hook h must be attached at load: it was
// (its link is pinned, on any cgroup), or what it serves is in the maps
// already (bulkhead limits, for sock_release; fallbacks, for the
// getpeername and recvmsg hooks).
func (k *Kernel) needs(h hook, pin string) bool {
	if _, err := os.Lstat(pin); err == nil {
		return true
	}
	if h.name == "sock_release" {
		var key bpf.BreakerDestKey
		return k.objs.Limits.NextKey(nil, &key) == nil
	}
	if fallbackHooks[h.name] {
		var id uint32
		return k.objs.Fallbacks.NextKey(nil, &id) == nil
	}
	return false
}

// ensureHook attaches optional hook name to the protected cgroup, and pins
// it, unless it is attached already. Without a cgroup (nothing attached)
// there is nothing to do.
func (k *Kernel) ensureHook(name string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.cgroup == "" || k.links[name] != nil {
		return nil
	}
	for _, h := range hooks {
		if h.name != name {
			continue
		}
		l, err := attachLink(k.cgroup, h, h.prog(&k.objs))
		if err != nil {
			return err
		}
		if err := pinReplacing(l, filepath.Join(k.dir, "link_"+h.name)); err != nil {
			l.Close()
			return fmt.Errorf("pinning %s: %w", h.name, err)
		}
		k.links[h.name] = l
		k.log.Info("attached", "program", h.name, "cgroup", k.cgroup)
		return nil
	}
	return fmt.Errorf("no hook %s", name)
}

func attachLink(cgroup string, h hook, prog *ebpf.Program) (link.Link, error) {
	f, err := os.Open(cgroup)
	if err != nil {
		return nil, fmt.Errorf("opening cgroup %s: %w", cgroup, err)
	}
	defer f.Close()
	l, err := link.AttachRawLink(link.RawLinkOptions{Target: int(f.Fd()), Program: prog, Attach: h.attach})
	if err != nil {
		return nil, fmt.Errorf("attaching %s to %s: %w", h.name, cgroup, err)
	}
	return l, nil
}

// pinReplacing pins l at path, replacing what is there in one rename, so
// the hook never goes without a pinned link.
func pinReplacing(l link.Link, path string) error {
	tmp := filepath.Join(filepath.Dir(path), "new_"+filepath.Base(path)) // bpffs refuses dots in names
	_ = os.Remove(tmp)
	if err := objPin(l, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("moving the pin into place: %w", err)
	}
	return nil
}

// objPin pins l's file descriptor at path (BPF_OBJ_PIN), apart from the
// path the library remembers for l, so a link can be pinned again and moved
// by rename.
func objPin(l link.Link, path string) error {
	fder, ok := l.(interface{ FD() int })
	if !ok {
		return fmt.Errorf("link %T has no file descriptor", l)
	}
	p, err := unix.BytePtrFromString(path)
	if err != nil {
		return err
	}
	attr := struct {
		pathname uint64
		fd       uint32
		flags    uint32
		pathFD   int32
		_        uint32
	}{pathname: uint64(uintptr(unsafe.Pointer(p))), fd: uint32(fder.FD())}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_OBJ_PIN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	runtime.KeepAlive(p)
	runtime.KeepAlive(l)
	if errno != 0 {
		return fmt.Errorf("pinning at %s: %w", path, errno)
	}
	return nil
}

// adoptLink reopens a pinned link and swaps prog into it, when it is
// attached to the cgroup with id cgID. A pinned link to another cgroup is
// left as it is (nil is returned): the caller attaches a new link and its
// pin replaces this one.
func (k *Kernel) adoptLink(pin string, cgID uint64, prog *ebpf.Program) (link.Link, error) {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	info, err := l.Info()
	if err == nil && info.Cgroup() != nil && info.Cgroup().CgroupId == cgID {
		if err := l.Update(prog); err != nil {
			l.Close()
			return nil, fmt.Errorf("updating program: %w", err)
		}
		k.log.Info("adopted pinned link", "pin", pin)
		return l, nil
	}
	k.log.Info("pinned link is attached to another cgroup; it is replaced once the new link is pinned", "pin", pin)
	l.Close()
	return nil, nil
}

// removeOtherLayouts removes breakerd's pin directories of other layout
// versions under base: their links detach and their maps go once nothing
// holds them. Directories breakerd did not make are left alone.
func (k *Kernel) removeOtherLayouts(base string) {
	for _, old := range otherLayouts(base, filepath.Base(k.dir)) {
		if err := removePins(old); err != nil {
			k.log.Warn("removing old layout", "dir", old, "err", err)
			continue
		}
		k.log.Info("removed pins of another layout version", "dir", old)
	}
}

// Features reports what the kernel offered at load.
func (k *Kernel) Features() Features { return k.features }

// PinDir is the directory holding this Kernel's pins.
func (k *Kernel) PinDir() string { return k.dir }

// Fresh reports whether this Load made the pin directory (nothing of this
// layout was pinned before it).
func (k *Kernel) Fresh() bool { return k.fresh }

func (k *Kernel) closeHandles() error {
	var errs []error
	k.mu.Lock()
	for _, l := range k.links {
		errs = append(errs, l.Close())
	}
	k.links = nil
	k.mu.Unlock()
	errs = append(errs, k.objs.Close())
	return errors.Join(errs...)
}

// Close releases the daemon's handles and the pin directory's lock. Pinned
// links and maps stay, so the programs keep enforcing (under the fail-safe
// heartbeat) until a new daemon adopts them.
func (k *Kernel) Close() error {
	err := k.closeHandles()
	k.unlock()
	return err
}

// unlock releases the pin directory's and the cgroup's locks.
func (k *Kernel) unlock() {
	k.mu.Lock()
	k.lock.Close()
	if k.cgroupLock != nil {
		k.cgroupLock.Close()
		k.cgroupLock = nil
	}
	k.mu.Unlock()
}

// Abandon undoes a Load whose caller could not finish starting: a fresh
// install is removed entirely (links detach, maps go); adopted pins stay as
// they were found, still enforcing.
func (k *Kernel) Abandon() error {
	if k.fresh {
		return k.Uninstall()
	}
	return k.Close()
}

// Uninstall detaches the programs and removes every pin of this layout,
// then closes k.
func (k *Kernel) Uninstall() error {
	errs := []error{k.closeHandles()}
	if err := removePins(k.dir); err != nil {
		errs = append(errs, err)
	}
	_ = os.Remove(filepath.Dir(k.dir)) // the base, when empty
	k.unlock()
	return errors.Join(errs...)
}
