package fleet

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
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
	handler  cache.ResourceEventHandlerRegistration
	log      *slog.Logger

	listErrors, watchErrors atomic.Uint64
}

// ReadErrors are a Watcher's failed requests: lists (the first, and
// each after a watch could not resume) and watches that could not be
// started. client-go retries each, backed off.
type ReadErrors struct {
	List, Watch uint64
}

// Errors returns the failed requests so far.
func (w *Watcher) Errors() ReadErrors {
	return ReadErrors{List: w.listErrors.Load(), Watch: w.watchErrors.Load()}
}

// NewWatcher returns a Watcher of the reports on the API server cfg
// reaches: observe gets each report added or updated, forget the name of
// each report deleted. A report that cannot be decoded is logged and
// skipped. observe's report is the one in the informer's cache: it must
// not change it (Tally.Observe copies what it keeps).
func NewWatcher(cfg *rest.Config, observe func(*CircuitReport), forget func(node string), log *slog.Logger) (*Watcher, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("fleet watch client: %w", err)
	}
	w := &Watcher{log: log}
	reports := dc.Resource(GroupVersionResource)
	// dynamicinformer's ListWatch, with each failed request counted.
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			l, err := reports.List(ctx, o)
			if err != nil {
				w.listErrors.Add(1)
				return nil, err
			}
			return l, nil
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			wi, err := reports.Watch(ctx, o)
			if err != nil {
				// A watch that sends the initial events is the list
				// (client-go's WatchListClient). An API server without
				// such watches refuses them as invalid, and the reflector
				// lists the usual way: only that list counts then.
				if o.SendInitialEvents != nil && *o.SendInitialEvents {
					if !apierrors.IsInvalid(err) && !apierrors.IsBadRequest(err) {
						w.listErrors.Add(1)
					}
				} else {
					w.watchErrors.Add(1)
				}
				return nil, err
			}
			return wi, nil
		},
	}
	inf := cache.NewSharedIndexInformerWithOptions(cache.ToListWatcherWithWatchListSemantics(lw, dc),
		&unstructured.Unstructured{}, cache.SharedIndexInformerOptions{ObjectDescription: GroupVersionResource.String()})
	if err := inf.SetTransform(compact); err != nil {
		return nil, fmt.Errorf("fleet watch transform: %w", err)
	}
	w.informer = inf
	decode := func(obj any) *CircuitReport {
		switch o := obj.(type) {
		case *CircuitReport:
			return o
		case *unstructured.Unstructured: // compact could not decode it
			r, err := FromUnstructured(o)
			if err != nil {
				log.Warn("skipping a CircuitReport", "name", o.GetName(), "err", err)
				return nil
			}
			return r
		}
		return nil
	}
	reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
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
			if m, ok := obj.(metav1.Object); ok {
				forget(m.GetName())
			}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("fleet watch handler: %w", err)
	}
	w.handler = reg
	return w, nil
}

// compact is the informer's transform: its cache keeps each report as a
// CircuitReport without its managedFields, not as the unstructured map the
// dynamic client decodes, which with the server-side apply's managedFields
// takes several times the memory. Every node caches every other node's
// report, so this is what the fleet costs each daemon in memory. A report
// that does not decode stays unstructured, for the handler to log.
func compact(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil // compacted already
	}
	u.SetManagedFields(nil)
	r, err := FromUnstructured(u)
	if err != nil {
		return u, nil
	}
	return r, nil
}

// Run watches until ctx ends.
func (w *Watcher) Run(ctx context.Context) { w.informer.RunWithContext(ctx) }

// Synced reports whether the first list has been delivered: handed to
// observe, not only listed (the informer's own HasSynced is true before
// its handlers have seen the list).
func (w *Watcher) Synced() bool { return w.handler.HasSynced() }
