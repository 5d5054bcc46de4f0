package daemon

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// The heartbeat keeps the kernel enforcing: once it is older than
// failsafe_timeout, the kernel ignores every verdict. So nothing may hold
// it up: it has its own goroutine and timer, and takes only its own small
// lock (beat.mu), never waits for the owner. The settings it writes with it (fail-safe,
// shadow, max_rto, limits) are set under beat.mu when a configuration is
// applied; host-name resolution, reloads and admin requests never run on
// its path.
type beat struct {
	mu       sync.Mutex // serialises writes of the settings map
	settings maps.Settings
	set      bool         // settings holds a configuration
	last     atomic.Int64 // time of the last successful write (UnixNano), 0 before
	failsafe atomic.Int64 // the configured failsafe_timeout, for /healthz
}

// heartbeatEvery is how often the heartbeat goroutine wakes up. It writes
// when the heartbeat is a quarter of the fail-safe old (failsafe_timeout
// is at least 1 s, so that is at least every 250 ms).
const heartbeatEvery = 50 * time.Millisecond

// heartbeat takes the settings of the current configuration and writes
// them with a fresh heartbeat. Called in a step of the owner (it reads d.cfg).
func (d *Daemon) heartbeat() error {
	s := maps.Settings{FailSafe: d.cfg.FailsafeTimeout, Shadow: d.cfg.Mode == policy.Shadow,
		MaxRTO: uint32(d.cfg.MaxRTO), Limits: hasLimits(d.cfg), UDP: coversUDP(d.cfg), WakeSlow: minSlowCall(d.cfg),
		Scoped: d.cfg.Scoped(), Classes: d.cfg.Classed() && !d.cfg.Scoped()}
	d.beat.mu.Lock()
	defer d.beat.mu.Unlock()
	d.beat.settings, d.beat.set = s, true
	d.beat.failsafe.Store(int64(s.FailSafe))
	return d.writeBeat()
}

// writeBeat writes the settings with the current time. The caller holds
// d.beat.mu.
func (d *Daemon) writeBeat() error {
	s := d.beat.settings
	s.Heartbeat = maps.Now()
	if err := d.k.SetSettings(s); err != nil {
		return fmt.Errorf("writing heartbeat: %w", err)
	}
	d.beat.last.Store(time.Now().UnixNano())
	return nil
}

// heartbeatLoop refreshes the heartbeat until ctx is cancelled.
func (d *Daemon) heartbeatLoop(ctx context.Context) {
	t := time.NewTicker(heartbeatEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.beat.mu.Lock()
		if d.beat.set && d.heartbeatAge() >= d.beat.settings.FailSafe/4 {
			if err := d.writeBeat(); err != nil {
				d.log.Error("heartbeat", "err", err)
			}
		}
		d.beat.mu.Unlock()
	}
}

// heartbeatAge is how long ago the heartbeat was last written (a very
// long time before the first).
func (d *Daemon) heartbeatAge() time.Duration {
	last := d.beat.last.Load()
	if last == 0 {
		return time.Duration(1<<63 - 1)
	}
	return time.Since(time.Unix(0, last))
}

// healthy reports whether the heartbeat is fresh: younger than half the
// fail-safe timeout, so /healthz fails well before the kernel stops
// enforcing.
func (d *Daemon) healthy() (bool, time.Duration) {
	age := d.heartbeatAge()
	return age < time.Duration(d.beat.failsafe.Load())/2, age
}

// Resolver looks host names up; *net.Resolver is one. Options.Resolver
// lets tests put a slow or hanging one in.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

const (
	// resolveTimeout bounds one host name's lookup.
	resolveTimeout = 2 * time.Second
	// resolveParallel bounds the lookups in flight.
	resolveParallel = 16
)

// hostNames lists the host names of targets and excludes. Called in a
// step of the owner.
func (d *Daemon) hostNames() []string { return hostNamesOf(d.cfg) }

// hostNamesOf lists the host names of cfg's targets and excludes.
func hostNamesOf(cfg *policy.Config) []string {
	seen := map[string]bool{}
	var hosts []string
	add := func(m policy.Match) {
		for _, h := range m.Hosts {
			if !seen[h] {
				seen[h] = true
				hosts = append(hosts, h)
			}
		}
	}
	for _, t := range cfg.Targets {
		add(t.Match)
	}
	for _, ex := range cfg.Exclude {
		add(ex)
	}
	slices.Sort(hosts)
	return hosts
}

type lookupResult struct {
	addrs []netip.Addr
	err   error
}

// lookupHosts resolves host names in parallel, each within
// resolveTimeout. It takes no lock.
func (d *Daemon) lookupHosts(ctx context.Context, hosts []string) map[string]lookupResult {
	r := d.opts.Resolver
	if r == nil {
		r = net.DefaultResolver
	}
	out := make(map[string]lookupResult, len(hosts))
	var mu sync.Mutex
	var wg sync.WaitGroup
	slots := make(chan struct{}, resolveParallel)
	for _, h := range hosts {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			rctx, cancel := context.WithTimeout(ctx, resolveTimeout)
			ips, err := r.LookupNetIP(rctx, "ip", h)
			cancel()
			for i := range ips {
				ips[i] = ips[i].Unmap()
			}
			mu.Lock()
			out[h] = lookupResult{ips, err}
			mu.Unlock()
		})
	}
	wg.Wait()
	return out
}

// lookupHostsKeepingAlive looks host names up at start-up, refreshing a
// previous daemon's heartbeat meanwhile when it is fresh (see start), so
// slow DNS never lets the adopted verdicts lapse.
func (d *Daemon) lookupHostsKeepingAlive(hosts []string) map[string]lookupResult {
	if len(hosts) == 0 {
		return nil
	}
	var res map[string]lookupResult
	d.keepingAlive(func() { res = d.lookupHosts(context.Background(), hosts) })
	return res
}

// keepingAlive runs fn, refreshing a previous daemon's fresh heartbeat
// every heartbeatEvery meanwhile (start-up only).
func (d *Daemon) keepingAlive(fn func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(heartbeatEvery)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				d.keepAlive()
			}
		}
	})
	fn()
	close(done)
	wg.Wait()
}

// applyResolved takes the addresses of host names still configured;
// changed addresses rebuild the matcher and the static destinations. A
// failed lookup keeps a name's last addresses. Called in a step of the owner.
func (d *Daemon) applyResolved(res map[string]lookupResult) (changed bool) {
	for _, h := range d.hostNames() {
		r, ok := res[h]
		if !ok {
			continue // configured after the lookups started: next round
		}
		if r.err != nil {
			d.log.Warn("resolving host name (keeping its last addresses)", "host", h, "err", r.err)
			continue
		}
		if fmt.Sprint(r.addrs) != fmt.Sprint(d.resolved[h]) {
			d.resolved[h] = r.addrs
			changed = true
			d.log.Info("host name resolved", "host", h, "addresses", fmt.Sprint(r.addrs))
		}
	}
	if changed {
		d.rematch()
	}
	return changed
}

// resolve re-resolves every host name with the lookups outside the owner's steps,
// which is taken only to read the names and to apply the results. The
// caller must not be a step of the owner.
func (d *Daemon) resolve(ctx context.Context) {
	var hosts []string
	d.do(func() { hosts = d.hostNames() })
	if len(hosts) == 0 {
		return
	}
	res := d.lookupHosts(ctx, hosts)
	if ctx.Err() != nil {
		return
	}
	d.do(func() {
		if d.applyResolved(res) {
			if err := d.reconcileLimits(); err != nil {
				d.log.Error("after resolving host names", "err", err)
			}
		}
	})
}

// resolveLoop re-resolves host names every ResolveInterval, on its own
// goroutine so slow DNS holds up neither the timers nor the heartbeat.
func (d *Daemon) resolveLoop(ctx context.Context) {
	t := time.NewTicker(d.opts.ResolveInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			d.resolve(ctx)
		}
	}
}

// coversUDP reports whether a target of cfg matches UDP destinations;
// only then do connect and sendmsg look UDP destinations up.
func coversUDP(cfg *policy.Config) bool {
	for _, t := range cfg.Targets {
		if t.Match.Proto == "udp" || t.Match.Proto == "any" {
			return true
		}
	}
	return false
}

// minSlowCall is the shortest slow_call_duration of cfg: an established
// record with a handshake at least this long wakes the reader at once.
func minSlowCall(cfg *policy.Config) time.Duration {
	m := cfg.All.SlowCallDuration
	for _, t := range cfg.Targets {
		if s := t.Options.SlowCallDuration; s > 0 && (m == 0 || s < m) {
			m = s
		}
	}
	if s := minSlowResponse(cfg); s > 0 && (m == 0 || s < m) {
		m = s
	}
	return m
}
