//go:build !nokube

package kube

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	listersv1 "k8s.io/client-go/listers/core/v1"
	listersdiscoveryv1 "k8s.io/client-go/listers/discovery/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/breakerd/breakerd/policy"
)

// Options configure a Client.
type Options struct {
	// Config reaches the API server (rest.InClusterConfig in a pod, or a
	// kubeconfig).
	Config *rest.Config
	// NodeName is this node's name (the DaemonSet sets NODE_NAME from the
	// downward API): Events about destinations that are not a Service are
	// posted on the Node.
	NodeName string
	// Logger receives what the client reports (default slog.Default()).
	Logger *slog.Logger
	// ProbeInterval is how often the API server's reachability is checked
	// (default 10s).
	ProbeInterval time.Duration
}

// Client watches Services and EndpointSlices and posts Events.
type Client struct {
	opts        Options
	log         *slog.Logger
	cs          kubernetes.Interface
	broadcaster record.EventBroadcaster
	recorder    record.EventRecorder
	changed     chan struct{}
	ctx         context.Context
	cancel      context.CancelFunc
	wg          sync.WaitGroup

	mu         sync.Mutex
	namespaces map[string]*namespaceWatch
	pods       *podWatch
	missing    map[string]bool // Services reported missing, until they appear
	lastErr    map[string]time.Time

	metrics
}

// namespaceWatch holds the informers of one namespace that Service targets
// name.
type namespaceWatch struct {
	factory  informers.SharedInformerFactory
	services listersv1.ServiceLister
	slices   listersdiscoveryv1.EndpointSliceLister
	synced   []cache.InformerSynced
}

// New makes a client; it starts watching nothing until Watch names
// Services.
func New(opts Options) (*Client, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.ProbeInterval == 0 {
		opts.ProbeInterval = 10 * time.Second
	}
	if opts.Config == nil {
		return nil, fmt.Errorf("no Kubernetes API configuration")
	}
	cfg := rest.CopyConfig(opts.Config)
	cfg.UserAgent = "breakerd"
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	c := &Client{opts: opts, log: opts.Logger, cs: cs, changed: make(chan struct{}, 1),
		namespaces: map[string]*namespaceWatch{}, missing: map[string]bool{}, lastErr: map[string]time.Time{}}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.metrics = newMetrics()
	c.broadcaster = record.NewBroadcaster(record.WithContext(c.ctx))
	c.broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events("")})
	c.recorder = c.broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "breakerd", Host: opts.NodeName})
	c.wg.Go(c.probeLoop)
	return c, nil
}

// Close stops the informers and the Event broadcaster (queued Events may
// be lost).
func (c *Client) Close() {
	c.cancel()
	// Shut the informers down outside c.mu: their error handlers take it.
	c.mu.Lock()
	var fs []informers.SharedInformerFactory
	for _, w := range c.namespaces {
		fs = append(fs, w.factory)
	}
	if c.pods != nil {
		fs = append(fs, c.pods.factory)
	}
	c.mu.Unlock()
	for _, f := range fs {
		f.Shutdown()
	}
	c.broadcaster.Shutdown()
	c.wg.Wait()
}

// Changed is signalled (at most one pending signal) when a watched Service
// or EndpointSlice changes.
func (c *Client) Changed() <-chan struct{} { return c.changed }

func (c *Client) signal() {
	select {
	case c.changed <- struct{}{}:
	default:
	}
}

// probeLoop checks the API server's /readyz (readable by any
// authenticated client: system:public-info-viewer).
func (c *Client) probeLoop() {
	t := time.NewTicker(c.opts.ProbeInterval)
	defer t.Stop()
	for {
		ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
		err := c.cs.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error()
		cancel()
		if c.ctx.Err() != nil {
			return
		}
		if err != nil {
			c.reachable.Set(0)
			c.report("readyz", "the Kubernetes API server does not answer; keeping the last known Services and endpoints", err)
		} else {
			c.reachable.Set(1)
		}
		select {
		case <-c.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// report logs an API error at most once a minute per key.
func (c *Client) report(key, msg string, err error) {
	c.mu.Lock()
	last, seen := c.lastErr[key]
	now := time.Now()
	if seen && now.Sub(last) < time.Minute {
		c.mu.Unlock()
		return
	}
	c.lastErr[key] = now
	c.mu.Unlock()
	c.log.Error(msg, "err", err)
}

// Watch makes sure the namespaces of the given Services ("namespace/name")
// are watched: their Services and EndpointSlices, by informers started in
// the background. It does not wait for them to sync (WaitSynced does).
func (c *Client) Watch(refs []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, ref := range refs {
		ns, _ := ParseRef(ref)
		if _, ok := c.namespaces[ns]; ok {
			continue
		}
		f := informers.NewSharedInformerFactoryWithOptions(c.cs, 0, informers.WithNamespace(ns))
		svc := f.Core().V1().Services()
		es := f.Discovery().V1().EndpointSlices()
		w := &namespaceWatch{factory: f, services: svc.Lister(), slices: es.Lister()}
		for resource, inf := range map[string]cache.SharedIndexInformer{"services": svc.Informer(), "endpointslices": es.Informer()} {
			_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
				why := "other"
				msg := "watching " + resource + " in namespace " + ns + " failed; client-go retries with backoff, the last known state stays"
				if apierrors.IsForbidden(err) {
					why = "forbidden"
					msg = "RBAC denies listing or watching " + resource + " in namespace " + ns + " (check breakerd's ClusterRole); retried with backoff"
				}
				c.watchErrors.WithLabelValues(resource, why).Inc()
				c.report(resource+"/"+ns, msg, err)
			})
			_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
				AddFunc:    func(any) { c.signal() },
				UpdateFunc: func(any, any) { c.signal() },
				DeleteFunc: func(any) { c.signal() },
			})
			w.synced = append(w.synced, inf.HasSynced)
		}
		f.Start(c.ctx.Done())
		c.namespaces[ns] = w
		c.log.Info("watching Services and EndpointSlices", "namespace", ns)
	}
}

// WaitSynced waits, at most until ctx ends, for the watched namespaces'
// caches to hold the API server's state; false when they did not.
func (c *Client) WaitSynced(ctx context.Context) bool {
	c.mu.Lock()
	var synced []cache.InformerSynced
	for _, w := range c.namespaces {
		synced = append(synced, w.synced...)
	}
	c.mu.Unlock()
	return cache.WaitForCacheSync(ctx.Done(), synced...)
}

// ClusterAddr is the address a Service fallback names: the Service's
// first cluster IP (its primary family) and the port, which must be one of
// its ports; false while the Service is not known, has no such port or no
// cluster IP (a headless Service: its pods have no one address).
func (c *Client) ClusterAddr(f policy.ServiceFallback) (netip.AddrPort, bool) {
	ns, name := ParseRef(f.Service)
	c.mu.Lock()
	w := c.namespaces[ns]
	c.mu.Unlock()
	if w == nil {
		return netip.AddrPort{}, false
	}
	svc, err := w.services.Services(ns).Get(name)
	if err != nil {
		c.noteMissing(f.Service, true)
		return netip.AddrPort{}, false
	}
	c.noteMissing(f.Service, false)
	for _, p := range svc.Spec.Ports {
		if p.Port != int32(f.Port) {
			continue
		}
		for _, ip := range svc.Spec.ClusterIPs {
			if a, err := netip.ParseAddr(ip); err == nil {
				return netip.AddrPortFrom(a.Unmap(), f.Port), true
			}
		}
	}
	return netip.AddrPort{}, false
}

// Resolve returns the destinations a Service match currently resolves to,
// from the informers' caches (no API call): the Service's cluster IPs
// times its selected ports, and its EndpointSlices' serving endpoints
// times the same ports' target ports. found is false while the Service
// does not exist (or its namespace is not watched yet).
func (c *Client) Resolve(m policy.Match) (dests []policy.ServiceDest, found bool) {
	ns, name := ParseRef(m.Service)
	c.mu.Lock()
	w := c.namespaces[ns]
	c.mu.Unlock()
	if w == nil {
		return nil, false
	}
	svc, err := w.services.Services(ns).Get(name)
	if err != nil {
		c.noteMissing(m.Service, true)
		return nil, false
	}
	c.noteMissing(m.Service, false)
	type sel struct {
		name  string
		proto string
	}
	var ports []sel
	for _, p := range svc.Spec.Ports {
		proto := strings.ToLower(string(p.Protocol))
		if proto == "" {
			proto = "tcp"
		}
		if (proto != "tcp" && proto != "udp") || (m.Proto != "any" && m.Proto != proto) || !selected(m, p) {
			continue
		}
		ports = append(ports, sel{p.Name, proto})
		for _, ip := range svc.Spec.ClusterIPs {
			if a, err := netip.ParseAddr(ip); err == nil {
				dests = append(dests, policy.ServiceDest{Addr: netip.AddrPortFrom(a.Unmap(), uint16(p.Port)), Proto: proto})
			}
		}
	}
	list, err := w.slices.EndpointSlices(ns).List(labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: name}))
	if err == nil {
		for _, es := range list {
			if es.AddressType != discoveryv1.AddressTypeIPv4 && es.AddressType != discoveryv1.AddressTypeIPv6 {
				continue
			}
			for _, sp := range es.Ports {
				if sp.Port == nil {
					continue
				}
				pname := ""
				if sp.Name != nil {
					pname = *sp.Name
				}
				proto := "tcp"
				if sp.Protocol != nil {
					proto = strings.ToLower(string(*sp.Protocol))
				}
				if !slices.ContainsFunc(ports, func(s sel) bool { return s.name == pname && s.proto == proto }) {
					continue
				}
				for _, ep := range es.Endpoints {
					if !Serving(ep.Conditions) {
						continue
					}
					for _, addr := range ep.Addresses {
						if a, err := netip.ParseAddr(addr); err == nil {
							dests = append(dests, policy.ServiceDest{Addr: netip.AddrPortFrom(a.Unmap(), uint16(*sp.Port)), Proto: proto})
						}
					}
				}
			}
		}
	}
	sortDests(dests)
	return slices.Compact(dests), true
}

func sortDests(d []policy.ServiceDest) {
	slices.SortFunc(d, func(a, b policy.ServiceDest) int {
		if c := a.Addr.Compare(b.Addr); c != 0 {
			return c
		}
		return strings.Compare(a.Proto, b.Proto)
	})
}

// selected reports whether a Service port is one the match names (by
// number or name); a match naming none selects every port.
func selected(m policy.Match, p corev1.ServicePort) bool {
	if len(m.Ports) == 0 && len(m.PortNames) == 0 {
		return true
	}
	for _, pr := range m.Ports {
		if int32(pr.Lo) == p.Port {
			return true
		}
	}
	return p.Name != "" && slices.Contains(m.PortNames, p.Name)
}

// Serving reports whether an EndpointSlice endpoint counts as one of its
// Service's endpoints: serving (ready, or terminating and still serving),
// or, where serving is not set, not known to be unready.
func Serving(c discoveryv1.EndpointConditions) bool {
	if c.Serving != nil {
		return *c.Serving
	}
	return c.Ready == nil || *c.Ready
}

// noteMissing logs and posts a Node Event the first time a Service is not
// found, and logs when it appears.
func (c *Client) noteMissing(ref string, missing bool) {
	c.mu.Lock()
	was := c.missing[ref]
	if missing {
		c.missing[ref] = true
	} else {
		delete(c.missing, ref)
	}
	c.mu.Unlock()
	switch {
	case missing && !was:
		c.log.Warn("Service not found; waiting for it (its target matches nothing until it exists)", "service", ref)
		c.post(c.nodeRef(), corev1.EventTypeWarning, ReasonServiceNotFound,
			fmt.Sprintf("Service %s named by breakerd's configuration does not exist; breakerd waits for it", ref))
	case !missing && was:
		c.log.Info("Service found", "service", ref)
	}
}

// CircuitEvent queues an Event for a transition; it never blocks (the
// broadcaster drops when its queue is full).
func (c *Client) CircuitEvent(t Transition) {
	reason, typ, verb := ReasonCircuitClosed, corev1.EventTypeNormal, "closed"
	if t.Opened {
		reason, typ, verb = ReasonCircuitOpened, corev1.EventTypeWarning, "opened"
	}
	msg := fmt.Sprintf("breakerd on %s: circuit %s (target %s) %s (%s): failure ratio %s, slow ratio %s over %d calls",
		c.opts.NodeName, t.Circuit, t.Target, verb, t.Reason, ratio(t.FailureRatio), ratio(t.SlowRatio), t.Calls)
	if t.Workload != "" {
		msg += "; workload " + t.Workload
	}
	if len(t.Pods) > 0 {
		msg += "; pods that saw failures: " + strings.Join(t.Pods, ", ")
	}
	if len(t.Rejected) > 0 {
		msg += "; pods it rejected (times): " + strings.Join(t.Rejected, ", ")
	}
	ref := c.nodeRef()
	if t.Service != "" {
		ref = c.serviceRef(t.Service)
	}
	c.post(ref, typ, reason, msg)
}

func ratio(f float64) string { return strconv.FormatFloat(f, 'f', 3, 64) }

func (c *Client) post(ref *corev1.ObjectReference, typ, reason, msg string) {
	c.events.WithLabelValues(reason).Inc()
	c.recorder.Event(ref, typ, reason, msg)
}

// nodeRef refers to this node as the kubelet does (its UID is its name).
func (c *Client) nodeRef() *corev1.ObjectReference {
	return &corev1.ObjectReference{Kind: "Node", APIVersion: "v1", Name: c.opts.NodeName, UID: types.UID(c.opts.NodeName)}
}

// serviceRef refers to a Service, with its UID when the cache has it.
func (c *Client) serviceRef(ref string) *corev1.ObjectReference {
	ns, name := ParseRef(ref)
	r := &corev1.ObjectReference{Kind: "Service", APIVersion: "v1", Namespace: ns, Name: name}
	c.mu.Lock()
	w := c.namespaces[ns]
	c.mu.Unlock()
	if w != nil {
		if svc, err := w.services.Services(ns).Get(name); err == nil {
			r.UID = svc.UID
			r.ResourceVersion = svc.ResourceVersion
		}
	}
	return r
}
