package fleet

import (
	"context"
	"fmt"
	"log/slog"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

// Watcher follows every node's report through a client-go informer (a
// list, then a watch, resumed with client-go's backoff after the API
// server fails), and hands each change to the caller: the input of a
// Tally. The callbacks run on the informer's goroutine, one at a time, in
// the order of the changes; they must not block (the daemon queues them
// to its own loop, which owns its Tally).
type Watcher struct {
	informer cache.SharedIndexInformer
	log      *slog.Logger
}

// NewWatcher returns a Watcher of the reports on the API server cfg
// reaches: observe gets each report added or updated, forget the name of
// each report deleted. A report that cannot be decoded is logged and
// skipped.
func NewWatcher(cfg *rest.Config, observe func(*CircuitReport), forget func(node string), log *slog.Logger) (*Watcher, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("fleet watch client: %w", err)
	}
	inf := dynamicinformer.NewFilteredDynamicInformer(dc, GroupVersionResource, "", 0, cache.Indexers{}, nil).Informer()
	w := &Watcher{informer: inf, log: log}
	decode := func(obj any) *CircuitReport {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			return nil
		}
		r, err := FromUnstructured(u)
		if err != nil {
			log.Warn("skipping a CircuitReport", "name", u.GetName(), "err", err)
			return nil
		}
		return r
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if r := decode(obj); r != nil {
				observe(r)
			}
		},
		UpdateFunc: func(_, obj any) {
			if r := decode(obj); r != nil {
				observe(r)
			}
		},
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if u, ok := obj.(*unstructured.Unstructured); ok {
				forget(u.GetName())
			}
		},
	}); err != nil {
		return nil, fmt.Errorf("fleet watch handler: %w", err)
	}
	return w, nil
}

// Run watches until ctx ends.
func (w *Watcher) Run(ctx context.Context) { w.informer.RunWithContext(ctx) }

// Synced reports whether the first list has been delivered.
func (w *Watcher) Synced() bool { return w.informer.HasSynced() }
