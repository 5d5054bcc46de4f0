// Package daemon ties breakerd together: it reads the kernel's outcome
// records and hands them to the engine (package engine), which matches
// them to circuits, feeds the state machines and writes the verdicts; it
// logs, counts and keeps every transition for the admin API. It also
// keeps the kernel's fail-safe heartbeat fresh (on its own goroutine,
// which nothing else can hold up: heartbeat.go), runs the engine's tick,
// re-resolves host names and Services and hands the engine what they
// resolved to, reloads its configuration on SIGHUP or when the file
// changes, and on start adopts the open circuits a previous daemon left
// in the pinned verdict map.
//
// One goroutine owns the engine and the state beside it (owner.go):
// every step that touches them (a batch of records, the tick, a reload, a
// resolution, an operator's change) runs there, one at a time. The
// metrics, the probes and the event list read what the owner published
// after its last step and never wait for it.
//
// Shutdown order (Run's return path): the context is cancelled; the tick
// goroutine is waited for (it wakes the reader, whose ring Close unmaps);
// the ring buffer reader is closed (its Read does not watch the context);
// the heartbeat, event, resolve and watch goroutines are waited for; the
// admin servers are shut down; the owner stops; then the kernel handles
// are closed. Pins and links stay, so the programs keep enforcing under
// the heartbeat until a new daemon adopts them, or the fail-safe timeout
// lets everything through.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/breakerd/breakerd/admin"
	"github.com/breakerd/breakerd/api"

	"github.com/breakerd/breakerd/engine"
	"github.com/breakerd/breakerd/kube"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Options configure a daemon.
type Options struct {
	// ConfigPath is the configuration file; empty means the embedded
	// default.
	ConfigPath string
	// Cgroup is the cgroup v2 directory to protect.
	Cgroup string
	// BPFFS is the bpffs directory for pins (default maps.DefaultDir).
	BPFFS string
	// AdminAddr is the TCP address of the admin API; empty disables it.
	// Metrics and health are served to anyone; circuits and events to
	// loopback clients or with the token; changes only with the token.
	AdminAddr string
	// AdminSocket is the unix socket of the admin API (mode 0600, root
	// peers only, all calls); empty disables it.
	AdminSocket string
	// ProbeAddr is the TCP address of a listener that answers only
	// /healthz and /readyz, for the kubelet's probes (probes.go); empty
	// disables it.
	ProbeAddr string
	// TokenFile holds a bearer token that allows mutating calls over TCP.
	TokenFile string
	// Logger receives the transition and reload log (default
	// slog.Default()).
	Logger *slog.Logger
	// TickInterval is how often timers run (default 100ms).
	TickInterval time.Duration
	// ResolveInterval is how often host names are re-resolved (default
	// 30s).
	ResolveInterval time.Duration
	// CheckInterval is how often the daemon checks that the cgroup, the
	// bpf filesystem and its pins are as attached (default 1s; negative:
	// never, for tests that run the checks themselves).
	CheckInterval time.Duration
	// MaxWorkloadCgroups overrides the capacity of the kernel's workloads
	// map when it is made (default maps.MaxWorkloadCgroups; for tests).
	MaxWorkloadCgroups uint32
	// Resolver looks host names up (default net.DefaultResolver).
	Resolver Resolver
	// CloseMechanisms narrows the mechanisms close_established may use
	// (default: the best this kernel offers): breakerd's --close-mechanism,
	// and tests that run the fallback, or none.
	CloseMechanisms []maps.CloseMechanism
	// Cluster is the Kubernetes API client that resolves Service targets
	// and receives Events (kube.go); nil without API access, when Service
	// targets match nothing.
	Cluster *kube.Client
}

// Daemon is a running breakerd.
type Daemon struct {
	opts    Options
	log     *slog.Logger
	k       *maps.Kernel
	metrics *metrics
	rand    func() float64
	beat    beat // the heartbeat's own state and lock, apart from the owner
	// reloadTurns numbers the reloads in the order they begin reading
	// the file (Reload).
	reloadTurns atomic.Uint64
	// reloadRead, when set (tests), runs once, in the next reload to have
	// read the file.
	reloadRead atomic.Pointer[func()]

	// kernel is k as the core sees it (circuits, ids, verdicts, limits,
	// answered words, overrides), and clock its time: fakes in the tests
	// of its decisions (engine/enginetest).
	kernel engine.Kernel
	clock  engine.Clock

	// own runs the steps that touch everything below (owner.go).
	own stepOwner
	// reloadApplied is the turn of the last reload applied.
	reloadApplied uint64
	shown         atomic.Pointer[shown] // what the last step published (owner.go)
	cfg           *policy.Config
	classes       policy.Classes // the workloads' classes under cfg
	scope         *cgroupWatch   // keeps the kernel's workloads map
	resolved      map[string][]netip.Addr
	services      map[string][]policy.ServiceDest // Service targets' destinations, by target
	// fallbackAddrs are the addresses the targets' Service fallbacks
	// resolved to.
	fallbackAddrs map[policy.ServiceFallback]netip.AddrPort
	// eng is the event-to-verdict core: the circuits, their ids and
	// verdicts.
	eng    *engine.Engine
	events eventRing
	// ready: running with protection in place (written in the owner's
	// steps, read by /readyz without it); phase: what the start-up is doing, nil
	// once Run has begun (probes.go).
	ready    atomic.Bool
	phase    atomic.Pointer[string]
	admin    net.Addr      // the admin API's TCP address, once listening
	problems maps.Problems // what Check found last (nil: protection intact)
	// shownProblems is problems for /readyz, which takes no lock.
	shownProblems atomic.Pointer[maps.Problems]
	repairErr     string         // the last failed repair's error (watchGround's goroutine only)
	servers       *admin.Servers // opened and served from New on

	// rejections is the last sweep of the kernel's rejections map, with
	// its own lock (rejections.go).
	rejections rejectionIndex

	// runCtx is Run's context once it runs: a reload's lookups end with it.
	runCtx context.Context
	// lastPagesCheck is when the tick last dropped idle pages.
	lastPagesCheck time.Time
	// pages keeps the sorted circuit names for CircuitsPage while the set
	// of circuits is unchanged (version: registry.version when taken).
	pages struct {
		mu       sync.Mutex
		version  uint64
		names    []string
		at, used time.Time // when names were sorted, and last asked for
	}
	// closer runs the close passes of close_established (closer.go); nil
	// until a configuration asks for it. closeJobs feeds its goroutine.
	closer    *maps.Closer
	closeJobs chan closeJob
	closeMech atomic.Value // the closer's maps.CloseMechanism, read off the owner
	// cannotReturnSaid is set once the log said that this kernel's
	// mechanism cannot send redirected pools back (closer.go's returned).
	cannotReturnSaid bool
	// fleet shares circuits with the other nodes (fleet.go).
	fleet fleetWiring
}

// TransitionEvent is api.TransitionEvent.
type TransitionEvent = api.TransitionEvent

const maxEvents = 1000

// New checks every input (configuration, cgroup, capabilities, kernel,
// admin address, socket and token file) and takes the pin directory's lock
// before it touches the kernel; then it loads or adopts the kernel side,
// attaches it, and rebuilds the circuits a previous daemon left. A failed
// New leaves nothing it made behind: a fresh install is removed, adopted
// pins are left as they were found.
func New(opts Options) (*Daemon, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.TickInterval == 0 {
		opts.TickInterval = 100 * time.Millisecond
	}
	if opts.ResolveInterval == 0 {
		opts.ResolveInterval = 30 * time.Second
	}
	if opts.CheckInterval == 0 {
		opts.CheckInterval = time.Second
	}
	cfg, err := policy.LoadFile(opts.ConfigPath)
	if err != nil {
		return nil, fmt.Errorf("configuration %s: %w", configName(opts.ConfigPath), err)
	}
	if opts.Cgroup == "" {
		return nil, errors.New("no cgroup to protect")
	}
	if err := maps.CheckCgroup(opts.Cgroup); err != nil {
		return nil, err
	}
	if opts.AdminSocket != "" {
		// Before touching the kernel: a path that is taken stops here.
		if err := admin.CheckSocket(opts.AdminSocket); err != nil {
			return nil, err
		}
	}
	if err := maps.CheckCapabilities(); err != nil {
		return nil, err
	}
	if err := maps.CheckKernel(); err != nil {
		return nil, err
	}
	feats := maps.ProbeFeatures()
	opts.Logger.Info("kernel features", "set_retval", feats.SetRetval,
		"reject_errno", map[bool]string{true: "configured errno", false: "EPERM (no bpf_set_retval before 5.18)"}[feats.SetRetval],
		"sockops_current", feats.SockOpsCurrent)
	lock, err := maps.LockDir(opts.BPFFS)
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(os.Getpid())))
	d := &Daemon{
		opts: opts, log: opts.Logger, rand: rng.Float64, clock: engine.SystemClock{},
		resolved: map[string][]netip.Addr{}, services: map[string][]policy.ServiceDest{},
		closeJobs: make(chan closeJob, closeQueue),
	}
	d.metrics = newMetrics(d)
	d.setPhase("loading the kernel side")
	srv, err := admin.Start(admin.Config{ProbeAddr: opts.ProbeAddr, AdminAddr: opts.AdminAddr, AdminSocket: opts.AdminSocket,
		TokenFile: opts.TokenFile, Log: opts.Logger}, d)
	if err != nil {
		lock.Close()
		return nil, err
	}
	srv.Serve()
	respSince := maps.Now()
	k, err := maps.Load(maps.Options{Dir: opts.BPFFS, Cgroup: opts.Cgroup, Lock: lock, Logger: opts.Logger, MaxWorkloadCgroups: opts.MaxWorkloadCgroups,
		Responses: followsResponses(cfg)})
	if err != nil {
		srv.Shutdown()
		return nil, fmt.Errorf("loading the kernel side: %w", err)
	}
	d.k, d.kernel, d.servers = k, k, srv
	d.newEngine(respSince)
	if d.scope, err = newCgroupWatch(k, opts.Logger, opts.Cgroup); err == nil {
		err = d.start(cfg)
	}
	if err != nil {
		if d.scope != nil {
			d.scope.close()
		}
		srv.Shutdown()
		if aerr := k.Abandon(); aerr != nil {
			d.log.Error("undoing the failed start", "err", aerr)
		}
		return nil, err
	}
	d.metrics.reloadOK.Set(1)
	d.metrics.reloadTime.SetToCurrentTime()
	d.metrics.protected.Set(1)
	d.setPhase("starting the event loop")
	return d, nil
}

func configName(p string) string {
	if p == "" {
		return "(embedded default)"
	}
	return p
}

func (d *Daemon) now() time.Time { return d.clock.Now() }

// Kernel returns the daemon's kernel side (for tests and breakerctl).
func (d *Daemon) Kernel() *maps.Kernel { return d.k }

// Run serves until ctx is cancelled, then shuts down in the documented
// order and closes the kernel handles, leaving pins in place.
func (d *Daemon) Run(ctx context.Context) error {
	srv := d.servers
	rd, err := d.k.NewEventReader()
	if err != nil {
		srv.Shutdown()
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	d.do(func() { d.runCtx = ctx })
	// From here every step runs on the owner's goroutine, until all the
	// goroutines that ask for steps are done.
	stopOwner := make(chan struct{})
	ownerDone := d.startOwner(stopOwner)
	var wg sync.WaitGroup
	wg.Go(func() { d.heartbeatLoop(ctx) })
	wg.Go(func() { d.readEvents(rd) })
	// The tick wakes the reader (rd.Wake), so it must be over before the
	// reader closes.
	tickDone := make(chan struct{})
	go func() { defer close(tickDone); d.tickLoop(ctx, rd) }()
	wg.Go(func() { d.resolveLoop(ctx) })
	wg.Go(func() { d.kubeLoop(ctx) })
	watcher := d.configWatcher()
	wg.Go(func() { d.watchConfig(ctx, watcher) })
	wg.Go(func() { d.watchGround(ctx) })
	wg.Go(func() { d.scope.run(ctx) })
	wg.Go(func() { d.closeLoop(ctx) })
	wg.Go(func() { d.rejectionsLoop(ctx) })
	wg.Go(func() { d.fleetLoop(ctx) })
	d.do(func() {
		// Started before ready: a client that sees ready finds the
		// whole API served (and a ground check's verdict, also a step,
		// comes before or after this one, never between).
		d.admin = srv.TCPAddr()
		d.setPhase("")
		d.ready.Store(d.problems == nil)
	})
	d.log.Info("breakerd ready", "cgroup", d.opts.Cgroup, "pins", d.k.PinDir(), "admin", d.opts.AdminAddr, "socket", d.opts.AdminSocket)

	<-ctx.Done()
	d.ready.Store(false)
	var failsafe time.Duration
	d.do(func() { failsafe = d.cfg.FailsafeTimeout })
	if p := d.k.Check(); p != nil {
		d.log.Error("shutting down with protection not in place: what is missing is not kept after this process exits", "problems", p.Error())
	} else {
		d.log.Info("shutting down; links and maps stay pinned: the kernel keeps enforcing open circuits until a new breakerd adopts them, or for the fail-safe timeout without a heartbeat", "failsafe_timeout", failsafe.String())
	}
	<-tickDone
	rd.Close()
	wg.Wait()
	srv.Shutdown()
	close(stopOwner)
	<-ownerDone
	d.do(func() {
		if d.closer != nil {
			_ = d.closer.Release()
		}
	})
	return d.k.Close()
}

// readBatch is how many records the owner handles in one step (about
// 0.5 ms of work at most).
const readBatch = 2048

// readEvents handles the kernel's records in batches: whatever the ring
// holds when the reader wakes, in the kernel's order. Failures, probes and
// slow handshakes wake it at once; healthy established records do not, and
// are read with the next wake-up or at the next tick, which wakes the
// reader only when the ring holds something (tickLoop): a healthy
// connection costs the daemon no wake-up of its own, and an idle daemon's
// reader sleeps.
func (d *Daemon) readEvents(rd *maps.EventReader) {
	batch := make([]maps.Event, readBatch)
	for {
		n, err := rd.ReadBatch(batch, 0)
		if err != nil {
			if errors.Is(err, maps.ErrReaderClosed) {
				return
			}
			d.log.Warn("reading outcome records", "err", err)
		}
		if n == 0 {
			continue
		}
		now := d.now()
		d.do(func() {
			d.eng.HandleBatch(batch[:n], now)
		})
	}
}

// tickLoop runs tick every TickInterval, and wakes the reader when the
// ring holds records that did not wake it (healthy ones, see readEvents).
func (d *Daemon) tickLoop(ctx context.Context, rd *maps.EventReader) {
	tick := time.NewTicker(d.opts.TickInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			d.flushAnswered()
			rd.Wake()
			d.do(func() {
				d.tick(d.now())
			})
		}
	}
}

// tick runs the engine's timers (engine.Tick) and, once a second, drops
// the admin API's idle pages. Called in a step of the owner.
func (d *Daemon) tick(now time.Time) {
	d.eng.Tick(now)
	if now.Sub(d.lastPagesCheck) >= time.Second {
		d.lastPagesCheck = now
		d.dropIdlePages()
	}
}

// fleetBlocks reports whether cfg has a fleet block (policy.FleetOptions).
func fleetBlocks(cfg *policy.Config) bool {
	if cfg.All.Fleet.Enabled {
		return true
	}
	for _, t := range cfg.Targets {
		if t.Options.Fleet.Enabled {
			return true
		}
	}
	return false
}

// applyConfig installs a new configuration (first start or reload) and
// rebuilds what depends on it: the fleet link, the close pass, the
// response programs, the workloads map (with the bridging verdicts of
// workloads whose class changes), the circuits (engine.Engine.Reconfigure
// and Rematch say which are kept) and the kernel's settings.
func (d *Daemon) applyConfig(cfg *policy.Config) {
	old, oldClasses := d.cfg, d.classes
	d.cfg = cfg
	d.eng.Reserve(cfg.MaxCircuits)
	if cfg.MaxCircuits > policy.GuaranteedCircuits && (old == nil || old.MaxCircuits <= policy.GuaranteedCircuits) {
		d.log.Warn("max_circuits is above the number of circuits that can all reject at once; a circuit that opens when the kernel has no circuit id or verdict entry left is not enforced, logged and counted in breakerd_verdict_write_errors_total",
			"max_circuits", cfg.MaxCircuits, "guaranteed", policy.GuaranteedCircuits)
	}
	d.configureFleet(cfg, old)
	d.metrics.presetLimitChanges(cfg)
	d.classes = cfg.Classes()
	d.eng.SetMatching(d.matching())
	d.ensureCloser(cfg)
	if old != nil {
		d.setResponses(cfg)
	}
	// The kernel's workloads map first: cgroups of a newly selected
	// workload are protected before the settings say scoped. A workload
	// whose class changes finds its verdicts under the new class already
	// (bridge.go).
	var bridged []maps.Dest
	if old != nil {
		bridged = d.bridgeClasses(old, oldClasses)
	}
	d.scope.apply(cfg)
	if old != nil {
		ch := d.eng.Reconfigure(old, d.now())
		d.log.Info("configuration reloaded", "all_changed", ch.AllChanged, "mode_changed", ch.ModeChanged, "workloads_changed", ch.WorkloadsChanged,
			"added", ch.Added, "changed", ch.Changed, "removed", ch.Removed, "unchanged", ch.Unchanged)
		if err := d.heartbeat(); err != nil { // mode and limits flags
			d.log.Error("writing settings", "err", err)
		}
	}
	d.rematch()
	d.unbridge(bridged)
}

// matching is what the engine matches destinations with: the
// configuration, its classes and what names and Services resolved to.
func (d *Daemon) matching() engine.Matching {
	return engine.Matching{Config: d.cfg, Classes: d.classes, Resolved: d.resolved, Services: d.services, Fallbacks: d.fallbackAddrs}
}

// rematch gives the engine what destinations match now and has it follow
// (engine.Engine.Rematch).
func (d *Daemon) rematch() {
	d.eng.SetMatching(d.matching())
	d.eng.Rematch(d.now())
}

// hasLimits reports whether any circuit of cfg has a bulkhead or follows
// responses; only then does connect look destinations up in the limits map.
func hasLimits(cfg *policy.Config) bool {
	if cfg.All.HasLimits() {
		return true
	}
	for _, t := range cfg.Targets {
		if engine.NeedsLimitEntry(&t.Options) {
			return true
		}
	}
	return false
}

// Reload reads the configuration file again. An invalid file changes
// nothing; the error names every offending key. Of reloads that overlap
// (the file watcher's and SIGHUP's, say), one that began reading the file
// after another is never undone by it: a reload whose turn comes after
// a later one's was applied changes nothing.
func (d *Daemon) Reload() error {
	turn := d.reloadTurns.Add(1)
	cfg, err := policy.LoadFile(d.opts.ConfigPath)
	if hook := d.reloadRead.Swap(nil); hook != nil {
		(*hook)()
	}
	var pods map[string]map[string]bool
	if err == nil {
		pods = d.lookupPods(cfg) // the informer's cache, before the step
	}
	var ctx context.Context
	applied := false
	d.do(func() {
		if turn < d.reloadApplied {
			d.log.Info("configuration reload skipped: one that read the file later was applied first")
			return
		}
		d.reloadApplied = turn
		if err != nil {
			d.metrics.reloadOK.Set(0)
			return
		}
		d.scope.presetPods(pods)
		d.applyConfig(cfg)
		if err := d.reconcileLimits(); err != nil {
			d.log.Error("after the reload", "err", err)
		}
		d.metrics.reloadOK.Set(1)
		d.metrics.reloadTime.SetToCurrentTime()
		ctx, applied = d.runCtx, true
	})
	if err != nil {
		d.log.Error("configuration reload refused; keeping the last valid one", "file", configName(d.opts.ConfigPath), "err", err)
		return err
	}
	if !applied {
		return nil
	}
	if ctx == nil {
		ctx = context.Background()
	}
	// Host names are looked up outside the owner's steps (and given up
	// when the daemon stops); addresses that changed are applied in one.
	d.resolve(ctx)
	d.resolveServices()
	return nil
}
