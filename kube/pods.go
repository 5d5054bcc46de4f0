//go:build !nokube

package kube

import (
	"context"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
)

// podWatch is the informer on this node's pods.
type podWatch struct {
	factory  informers.SharedInformerFactory
	informer cache.SharedIndexInformer
}

const byUID = "uid"

// WatchPods starts watching the pods of this node (NodeName), through a
// field selector on spec.nodeName, so the API server sends only those.
// It is idempotent.
func (c *Client) WatchPods() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pods != nil {
		return
	}
	sel := fields.OneTermEqualSelector("spec.nodeName", c.opts.NodeName).String()
	f := informers.NewSharedInformerFactoryWithOptions(c.cs, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.FieldSelector = sel }))
	inf := f.Core().V1().Pods().Informer()
	_ = inf.AddIndexers(cache.Indexers{byUID: func(obj any) ([]string, error) {
		if p, ok := obj.(*corev1.Pod); ok {
			return []string{string(p.UID)}, nil
		}
		return nil, nil
	}})
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		why, msg := "other", "watching this node's pods failed; client-go retries with backoff, the last known pods stay"
		if apierrors.IsForbidden(err) {
			why, msg = "forbidden", "RBAC denies listing or watching pods (check breakerd's ClusterRole); retried with backoff"
		}
		c.watchErrors.WithLabelValues("pods", why).Inc()
		c.report("pods", msg, err)
	})
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { c.signal() },
		UpdateFunc: func(any, any) { c.signal() },
		DeleteFunc: func(any) { c.signal() },
	})
	f.Start(c.ctx.Done())
	c.pods = &podWatch{factory: f, informer: inf}
	c.log.Info("watching this node's pods", "node", c.opts.NodeName)
}

// WaitPodsSynced waits, at most until ctx ends, for the pod cache to hold
// the API server's state.
func (c *Client) WaitPodsSynced(ctx context.Context) bool {
	c.mu.Lock()
	p := c.pods
	c.mu.Unlock()
	if p == nil {
		return true
	}
	return cache.WaitForCacheSync(ctx.Done(), p.informer.HasSynced)
}

// SelectPods returns the UIDs of this node's pods, from the cache, that
// the selector selects, with each one's "namespace/name".
func (c *Client) SelectPods(s PodSelector) map[string]string {
	c.mu.Lock()
	p := c.pods
	c.mu.Unlock()
	if p == nil {
		return nil
	}
	ls := labels.SelectorFromSet(s.Labels)
	out := map[string]string{}
	for _, obj := range p.informer.GetStore().List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || pod.Spec.NodeName != c.opts.NodeName {
			continue
		}
		if len(s.Namespaces) > 0 && !slices.Contains(s.Namespaces, pod.Namespace) {
			continue
		}
		if !ls.Matches(labels.Set(pod.Labels)) {
			continue
		}
		out[string(pod.UID)] = pod.Namespace + "/" + pod.Name
	}
	return out
}

// PodName returns "namespace/name" of this node's pod with the given UID,
// from the cache.
func (c *Client) PodName(uid string) (string, bool) {
	c.mu.Lock()
	p := c.pods
	c.mu.Unlock()
	if p == nil {
		return "", false
	}
	objs, err := p.informer.GetIndexer().ByIndex(byUID, uid)
	if err != nil || len(objs) == 0 {
		return "", false
	}
	pod := objs[0].(*corev1.Pod)
	return pod.Namespace + "/" + pod.Name, true
}
