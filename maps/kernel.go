// Package maps is breakerd's typed access to its kernel side: it loads the
// programs of package bpf, pins their maps and links under a versioned bpffs
// directory, attaches them to a cgroup v2 directory, and reads and writes
// the verdict map, the settings (heartbeat, shadow mode), the per-circuit
// counters and the outcome ring buffer. It knows nothing of policy.
//
// # Pins and adoption
//
// Everything lives under Dir/v<LayoutVersion> (default
// /sys/fs/bpf/breakerd/v2): the maps by name (verdicts, config, counters,
// stats, events, socks) and one link per hook (link_connect4, …). Load
// reuses pinned maps whose layout matches, so a restarted daemon keeps the
// verdicts the kernel is enforcing, and swaps the new programs into the
// pinned links with an atomic link update, so the hooks are never empty
// while breakerd restarts. A pin of this layout version that does not
// match (ebpf.ErrMapIncompatible) is an error: it means the layout changed
// without a version bump. Directories of other layout versions are removed
// once the new programs are attached (their links detach as they go).
//
// # The legacy attach path
//
// Kernels without bpf_link for cgroups (before 5.7) attach with
// BPF_PROG_ATTACH, and such attachments cannot be pinned. breakerd then
// keeps the attachment only as long as its process runs: Close detaches it,
// and a crashed daemon's attachment is released with its file descriptors.
// Enforcement stops with the daemon — the fail-open direction — and a new
// daemon attaches again. Features.PinnedLinks says which path is in use.
//
// # Fail-open
//
// The programs reject only on an explicit open verdict while the daemon's
// heartbeat (Settings.Heartbeat) is fresh; any missing entry, failed lookup
// or stale heartbeat allows.
package maps

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"

	"github.com/breakerd/breakerd/bpf"
)

// LayoutVersion is the version of the maps' and records' layout. It is part
// of the pin directory; bump it whenever bpf/breaker.h changes.
const LayoutVersion = 2

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
	// MaxVerdicts overrides the verdict map's capacity (default 1<<20). It
	// is fixed when the map is first created; an adopted map keeps its own.
	MaxVerdicts uint32
	// RingBytes overrides the ring buffer's size (default 4 MiB, 65536
	// records); a power of two multiple of the page size.
	RingBytes uint32
	// Logger receives load and adoption messages (default slog.Default()).
	Logger *slog.Logger
}

// Features is what the running kernel offers breakerd, probed at load.
type Features struct {
	// SetRetval: bpf_set_retval exists (5.18+), so a rejected connect sees
	// the verdict's errno; without it, it sees EPERM.
	SetRetval bool
	// RingBuf: the outcome ring buffer exists (5.8+).
	RingBuf bool
	// PinnedLinks: cgroup attachments are bpf_links that survive a daemon
	// restart (5.7+); false on the legacy attach path.
	PinnedLinks bool
	// SockopsCgroupID: the observation program can tell which cgroup a
	// connection came from (not on 6.1: records then carry cgroup id 0).
	SockopsCgroupID bool
}

// Kernel is breakerd's loaded kernel side.
type Kernel struct {
	View
	objs     bpf.BreakerObjects
	links    map[string]link.Link
	dir      string
	features Features
	log      *slog.Logger
}

type hook struct {
	name   string
	attach ebpf.AttachType
	prog   func(*bpf.BreakerObjects) *ebpf.Program
}

var hooks = []hook{
	{"connect4", ebpf.AttachCGroupInet4Connect, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Connect4 }},
	{"connect6", ebpf.AttachCGroupInet6Connect, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Connect6 }},
	{"sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Sendmsg4 }},
	{"sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Sendmsg6 }},
	{"sockops", ebpf.AttachCGroupSockOps, func(o *bpf.BreakerObjects) *ebpf.Program { return o.Observe }},
	{"sock_release", ebpf.AttachCgroupInetSockRelease, func(o *bpf.BreakerObjects) *ebpf.Program { return o.SockRelease }},
}

// ProbeFeatures asks the kernel what it supports. An inconclusive probe
// counts as not supported (the fail-open direction).
func ProbeFeatures() Features {
	return Features{
		SetRetval:       features.HaveProgramHelper(ebpf.CGroupSockAddr, asm.FnSetRetval) == nil,
		RingBuf:         features.HaveMapType(ebpf.RingBuf) == nil,
		SockopsCgroupID: features.HaveProgramHelper(ebpf.SockOps, asm.FnGetCurrentCgroupId) == nil,
	}
}

// PinDir returns the versioned pin directory under dir.
func PinDir(dir string) string {
	if dir == "" {
		dir = DefaultDir
	}
	return filepath.Join(dir, fmt.Sprintf("v%d", LayoutVersion))
}

// Load loads breakerd's programs, adopting pinned maps of the same layout,
// and attaches them to opts.Cgroup (updating pinned links in place). The
// caller must Close the Kernel; pins stay until Uninstall.
func Load(opts Options) (*Kernel, error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if err := CheckCapabilities(); err != nil {
		return nil, err
	}
	// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK (raising it
	// needs CAP_SYS_RESOURCE there); later ones ignore it and this is a
	// no-op.
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("raising RLIMIT_MEMLOCK (this kernel charges BPF memory to it; grant CAP_SYS_RESOURCE): %w", err)
	}
	dir := PinDir(opts.Dir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("making pin directory: %w", err)
	}
	k := &Kernel{dir: dir, links: map[string]link.Link{}, features: ProbeFeatures(), log: log}
	if !k.features.RingBuf {
		return nil, errors.New("kernel has no BPF ring buffer (needs 5.8+)")
	}

	spec, err := bpf.LoadBreaker()
	if err != nil {
		return nil, fmt.Errorf("reading BPF object: %w", err)
	}
	if err := setFeatureVars(spec, k.features); err != nil {
		return nil, err
	}
	if opts.MaxVerdicts != 0 {
		spec.Maps[bpf.BreakerMapVerdicts].MaxEntries = opts.MaxVerdicts
	}
	if opts.RingBytes != 0 {
		spec.Maps[bpf.BreakerMapEvents].MaxEntries = opts.RingBytes
	}
	err = spec.LoadAndAssign(&k.objs, &ebpf.CollectionOptions{
		Maps: ebpf.MapOptions{PinPath: dir},
	})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("loading BPF programs: %+v", ve)
		}
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return nil, fmt.Errorf("pinned maps in %s do not match layout v%d (the layout changed without a version bump; remove the directory or run breakerd uninstall): %w", dir, LayoutVersion, err)
		}
		return nil, fmt.Errorf("loading BPF programs: %w", err)
	}

	k.View = viewOf(&k.objs)

	if opts.Cgroup != "" {
		if err := k.attach(opts.Cgroup); err != nil {
			k.Close()
			return nil, err
		}
		k.removeOtherLayouts(filepath.Dir(dir))
	}
	log.Info("kernel side loaded", "pins", dir, "cgroup", opts.Cgroup,
		"set_retval", k.features.SetRetval, "pinned_links", k.features.PinnedLinks, "sockops_cgroup_id", k.features.SockopsCgroupID)
	return k, nil
}

// setFeatureVars hands the probed features to the programs as load-time
// constants; the verifier prunes the branches they turn off.
func setFeatureVars(spec *ebpf.CollectionSpec, f Features) error {
	for name, on := range map[string]bool{bpf.BreakerVarHasSetRetval: f.SetRetval, bpf.BreakerVarHasSockopsCgroupId: f.SockopsCgroupID} {
		if err := spec.Variables[name].Set(boolU32(on)); err != nil {
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

func (k *Kernel) attach(cgroup string) error {
	fi, err := os.Stat(cgroup)
	if err != nil {
		return fmt.Errorf("cgroup %s: %w", cgroup, err)
	}
	cgID := fi.Sys().(*syscall.Stat_t).Ino
	k.features.PinnedLinks = true
	for _, h := range hooks {
		prog := h.prog(&k.objs)
		pin := filepath.Join(k.dir, "link_"+h.name)
		if l, err := k.adoptLink(pin, cgID, prog); err != nil {
			return fmt.Errorf("adopting %s: %w", pin, err)
		} else if l != nil {
			k.links[h.name] = l
			continue
		}
		l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: h.attach, Program: prog})
		if err != nil {
			return fmt.Errorf("attaching %s to %s: %w", h.name, cgroup, err)
		}
		k.links[h.name] = l
		if err := l.Pin(pin); err != nil {
			if !errors.Is(err, ebpf.ErrNotSupported) {
				return fmt.Errorf("pinning %s: %w", h.name, err)
			}
			k.features.PinnedLinks = false
		}
	}
	return nil
}

// adoptLink reopens a pinned link and swaps prog into it, when it is
// attached to the cgroup with id cgID. A pinned link to another cgroup is
// removed (its program detaches) and nil returned, so the caller attaches
// afresh.
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
	k.log.Info("pinned link is attached elsewhere; replacing it", "pin", pin)
	_ = l.Unpin()
	l.Close()
	return nil, nil
}

// removeOtherLayouts removes pin directories of other layout versions under
// base: their links detach and their maps go once nothing holds them.
func (k *Kernel) removeOtherLayouts(base string) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	own := filepath.Base(k.dir)
	for _, e := range entries {
		if !e.IsDir() || e.Name() == own || !strings.HasPrefix(e.Name(), "v") {
			continue
		}
		old := filepath.Join(base, e.Name())
		if err := os.RemoveAll(old); err != nil {
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

// Close releases the daemon's handles. Pinned links and maps stay, so the
// programs keep enforcing (under the fail-safe heartbeat) until a new
// daemon adopts them. Unpinned (legacy) attachments are detached.
func (k *Kernel) Close() error {
	var errs []error
	for _, l := range k.links {
		errs = append(errs, l.Close())
	}
	k.links = nil
	errs = append(errs, k.objs.Close())
	return errors.Join(errs...)
}

// Uninstall detaches the programs and removes every pin, then closes k.
func (k *Kernel) Uninstall() error {
	var errs []error
	for _, l := range k.links {
		if err := l.Unpin(); err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
			errs = append(errs, err)
		}
	}
	errs = append(errs, k.Close())
	if err := os.RemoveAll(k.dir); err != nil {
		errs = append(errs, err)
	}
	_ = os.Remove(filepath.Dir(k.dir)) // the base, when empty
	return errors.Join(errs...)
}
