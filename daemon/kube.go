package daemon

import (
	"context"
	"net/netip"
	"slices"
	"time"

	"github.com/breakerd/breakerd/kube"
	"github.com/breakerd/breakerd/policy"
)

// Service targets (match.service) are resolved like host names: the
// Kubernetes client (package kube) keeps Services and EndpointSlices in
// informer caches on its own goroutines; the daemon reads those caches
// outside the owner's steps and applies what changed in one. No API call
// is ever made in a step of the owner, and the heartbeat never waits on
// the API.

// serviceSyncTimeout bounds how long start-up waits for the informers'
// first list (the previous daemon's heartbeat is kept fresh meanwhile).
const serviceSyncTimeout = 10 * time.Second

// serviceTargets returns the Service targets of cfg: target name → match.
func serviceTargets(cfg *policy.Config) map[string]policy.Match {
	out := map[string]policy.Match{}
	for name, t := range cfg.Targets {
		if t.Match.Service != "" {
			out[name] = t.Match
		}
	}
	return out
}

// serviceResult is what one Service target resolved to.
type serviceResult struct {
	dests []policy.ServiceDest
	found bool
}

// lookupServices reads the informers' caches for each Service target
// (watching new namespaces first). It must not be called in a step of the owner.
func (d *Daemon) lookupServices(targets map[string]policy.Match) map[string]serviceResult {
	cl := d.opts.Cluster
	if cl == nil || len(targets) == 0 {
		return nil
	}
	refs := make([]string, 0, len(targets))
	for _, m := range targets {
		refs = append(refs, m.Service)
	}
	cl.Watch(refs)
	out := make(map[string]serviceResult, len(targets))
	for name, m := range targets {
		dests, found := cl.Resolve(m)
		out[name] = serviceResult{dests, found}
	}
	return out
}

// lookupServicesKeepingAlive waits (bounded) for the informers' first
// list at start-up, refreshing a previous daemon's fresh heartbeat
// meanwhile, then resolves the Service targets and the Service fallbacks.
func (d *Daemon) lookupServicesKeepingAlive(cfg *policy.Config) (map[string]serviceResult, map[policy.ServiceFallback]netip.AddrPort) {
	targets, fallbacks := serviceTargets(cfg), serviceFallbacks(cfg)
	if len(targets) == 0 && len(fallbacks) == 0 {
		return nil, nil
	}
	if d.opts.Cluster == nil {
		for name, m := range targets {
			d.log.Warn("a Service target needs Kubernetes API access (in a pod, or --kubeconfig); it matches nothing", "target", name, "service", m.Service)
		}
		for _, f := range fallbacks {
			d.log.Warn("a Service fallback needs Kubernetes API access (in a pod, or --kubeconfig); its targets reject as without one", "fallback", f.String())
		}
		return nil, nil
	}
	refs := make([]string, 0, len(targets)+len(fallbacks))
	for _, m := range targets {
		refs = append(refs, m.Service)
	}
	for _, f := range fallbacks {
		refs = append(refs, f.Service)
	}
	d.opts.Cluster.Watch(refs)
	var res map[string]serviceResult
	var fbs map[policy.ServiceFallback]netip.AddrPort
	d.keepingAlive(func() {
		ctx, cancel := context.WithTimeout(context.Background(), serviceSyncTimeout)
		defer cancel()
		if !d.opts.Cluster.WaitSynced(ctx) {
			d.log.Error("Services and EndpointSlices were not listed in time (the API server unreachable, or RBAC denies it: see the errors logged); Service targets match nothing until they are", "waited", serviceSyncTimeout.String())
		}
		res = d.lookupServices(targets)
		fbs = d.lookupFallbacks(fallbacks)
	})
	return res, fbs
}

// serviceFallbacks lists the Service fallbacks of cfg's targets.
func serviceFallbacks(cfg *policy.Config) []policy.ServiceFallback {
	var out []policy.ServiceFallback
	for _, t := range cfg.Targets {
		if f := t.Options.FallbackService; f.Service != "" && !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	return out
}

// lookupFallbacks reads the informers' caches for each Service fallback
// (watching new namespaces first): what it resolves to now, or nothing.
// It must not be called in a step.
func (d *Daemon) lookupFallbacks(fallbacks []policy.ServiceFallback) map[policy.ServiceFallback]netip.AddrPort {
	cl := d.opts.Cluster
	if cl == nil || len(fallbacks) == 0 {
		return nil
	}
	refs := make([]string, 0, len(fallbacks))
	for _, f := range fallbacks {
		refs = append(refs, f.Service)
	}
	cl.Watch(refs)
	out := map[policy.ServiceFallback]netip.AddrPort{}
	for _, f := range fallbacks {
		if a, ok := cl.ClusterAddr(f); ok {
			out[f] = a
		}
	}
	return out
}

// applyFallbacks takes what the Service fallbacks resolved to and, when
// that changed, rewrites the fallbacks of the circuits that reject.
// Called in a step of the owner.
func (d *Daemon) applyFallbacks(res map[policy.ServiceFallback]netip.AddrPort) {
	same := len(res) == len(d.fallbackAddrs)
	for f, a := range res {
		if b, ok := d.fallbackAddrs[f]; !ok || b != a {
			same = false
		}
	}
	if same {
		return
	}
	for f, a := range res {
		if d.fallbackAddrs[f] != a {
			d.log.Info("Service fallback resolved", "fallback", f.String(), "address", a)
		}
	}
	for f := range d.fallbackAddrs {
		if _, ok := res[f]; !ok {
			d.log.Warn("Service fallback resolves to nothing (no such Service, port or cluster IP): its targets reject as without one", "fallback", f.String())
		}
	}
	d.fallbackAddrs = res
	d.eng.SetMatching(d.matching())
	for c := range d.eng.Named() {
		d.eng.SyncFallback(c)
	}
}

// applyServices takes what Service targets resolved to; changes rebuild
// the matcher and the enumerated destinations. Called in a step of the owner.
func (d *Daemon) applyServices(res map[string]serviceResult) (changed bool) {
	current := serviceTargets(d.cfg)
	for name := range d.services {
		if _, ok := current[name]; !ok {
			delete(d.services, name)
			changed = true
		}
	}
	for name, m := range current {
		r, ok := res[name]
		if !ok {
			continue // configured after the lookups began: next round
		}
		if !slices.Equal(r.dests, d.services[name]) {
			d.services[name] = r.dests
			changed = true
			d.log.Info("Service resolved", "target", name, "service", m.Service, "found", r.found, "destinations", len(r.dests))
		}
	}
	if changed {
		d.rematch()
	}
	return changed
}

// resolveServices resolves every Service target and Service fallback
// outside the owner and has the owner apply the result. It must not be
// called in a step.
func (d *Daemon) resolveServices() {
	var targets map[string]policy.Match
	var fallbacks []policy.ServiceFallback
	d.do(func() { targets, fallbacks = serviceTargets(d.cfg), serviceFallbacks(d.cfg) })
	res := d.lookupServices(targets)
	fbs := d.lookupFallbacks(fallbacks)
	d.do(func() {
		d.applyFallbacks(fbs)
		if d.applyServices(res) {
			if err := d.reconcileLimits(); err != nil {
				d.log.Error("after resolving Services", "err", err)
			}
		}
	})
}

// kubeLoop resolves Service targets again whenever a watched Service or
// EndpointSlice changes.
func (d *Daemon) kubeLoop(ctx context.Context) {
	cl := d.opts.Cluster
	if cl == nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-cl.Changed():
			d.resolveServices()
			d.resolvePods()
		}
	}
}

// kubeEvent posts a Kubernetes Event when a circuit opens or closes (on
// its Service, or on the Node for other targets and `all`). It only
// queues: client-go's broadcaster sends it later, never holding up the owner.
func (d *Daemon) kubeEvent(c *circuit, t policy.Transition) {
	cl := d.opts.Cluster
	if cl == nil || t.From == t.To {
		return
	}
	opened := t.To.Rejects() && !t.From.Rejects()
	closed := t.To == policy.Closed && t.From.Rejects()
	if t.To == policy.Open && t.From == policy.HalfOpen {
		opened = true // a failed probe reopens
	}
	if !opened && !closed {
		return
	}
	ev := kube.Transition{Circuit: c.Name(), Target: c.Target(), Opened: opened, Reason: string(t.Reason),
		FailureRatio: t.FailureRate, SlowRatio: t.SlowRate, Calls: t.Calls, Workload: c.Workload()}
	if opened {
		ev.Pods = d.podNames(c.FailedCgroups())
	} else {
		ev.Rejected = d.rejectedPods(c)
	}
	if tg := d.cfg.Targets[c.Target()]; tg != nil {
		ev.Service = tg.Match.Service
	}
	cl.CircuitEvent(ev)
}

// podWorkloads returns cfg's workloads that select pods.
func podWorkloads(cfg *policy.Config) []policy.Workload {
	var out []policy.Workload
	for _, w := range cfg.Workloads {
		if w.Kubernetes() {
			out = append(out, w)
		}
	}
	return out
}

// lookupPods returns the UIDs of this node's pods each pod-selecting
// workload of cfg selects, from the pod informer's cache (started here
// when needed). It must not be called in a step of the owner.
func (d *Daemon) lookupPods(cfg *policy.Config) map[string]map[string]bool {
	ws := podWorkloads(cfg)
	cl := d.opts.Cluster
	if len(ws) == 0 || cl == nil {
		return nil
	}
	cl.WatchPods()
	out := make(map[string]map[string]bool, len(ws))
	for _, w := range ws {
		sel := cl.SelectPods(kube.PodSelector{Namespaces: w.Namespaces, Labels: w.PodLabels})
		set := make(map[string]bool, len(sel))
		for uid := range sel {
			set[uid] = true
		}
		out[w.Name] = set
	}
	return out
}

// lookupPodsKeepingAlive waits (bounded) for the pod informer's first
// list at start-up, keeping a previous daemon's fresh heartbeat fresh.
func (d *Daemon) lookupPodsKeepingAlive(cfg *policy.Config) map[string]map[string]bool {
	ws := podWorkloads(cfg)
	if len(ws) == 0 {
		return nil
	}
	if d.opts.Cluster == nil {
		for _, w := range ws {
			d.log.Warn("a workload that selects pods needs Kubernetes API access (in a pod, or --kubeconfig); it selects no pod", "workload", w.Name)
		}
		return nil
	}
	var res map[string]map[string]bool
	d.keepingAlive(func() {
		d.opts.Cluster.WatchPods()
		ctx, cancel := context.WithTimeout(context.Background(), serviceSyncTimeout)
		defer cancel()
		if !d.opts.Cluster.WaitPodsSynced(ctx) {
			d.log.Error("this node's pods were not listed in time (the API server unreachable, or RBAC denies it: see the errors logged); pod workloads select nothing until they are", "waited", serviceSyncTimeout.String())
		}
		res = d.lookupPods(cfg)
	})
	for name, set := range res {
		if len(set) == 0 {
			d.log.Warn("a workload's namespaces and pod labels select no pod on this node (yet)", "workload", name)
		}
	}
	return res
}

// resolvePods brings the workloads map in line with the pods selected now.
// It must not be called in a step of the owner.
func (d *Daemon) resolvePods() {
	var cfg *policy.Config
	d.do(func() { cfg = d.cfg })
	if len(podWorkloads(cfg)) == 0 {
		return
	}
	d.scope.setPods(d.lookupPods(cfg))
}

// podNames names the pods of cgroup ids, where known: the cgroup watch
// knows which cgroups are pods' (their path), the pod informer their
// names. Cheap (two in-memory lookups per id), so Events use it in the
// owner's steps too.
func (d *Daemon) podNames(ids []uint64) []string {
	cl := d.opts.Cluster
	if cl == nil || d.scope == nil {
		return nil
	}
	var out []string
	for _, id := range ids {
		uid, ok := d.scope.podUID(id)
		if !ok {
			continue
		}
		if name, ok := cl.PodName(uid); ok && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}
