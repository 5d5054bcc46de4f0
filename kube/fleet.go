//go:build !nokube

package kube

import (
	"context"
	"fmt"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/breakerd/breakerd/fleet"
)

// Fleet is a node's link to the fleet's reports (package fleet): a
// Writer publishes the circuits this node has open on its own evidence,
// a Watcher feeds a Tally of every other node's. Nothing here blocks its
// caller: Publish only hands the Writer a set, Open reads the Tally, and
// the API is reached on Run's goroutines alone.
type Fleet struct {
	writer  *fleet.Writer
	watcher *fleet.Watcher
	changed chan struct{}

	mu    sync.Mutex
	tally *fleet.Tally
}

// NewFleet returns the link of this client's node (Options.NodeName),
// with the client's configuration; it reaches the API only once Run
// runs.
func (c *Client) NewFleet() (*Fleet, error) {
	cfg := rest.CopyConfig(c.opts.Config)
	cfg.UserAgent = "breakerd"
	store, err := fleet.NewKubeStore(cfg)
	if err != nil {
		return nil, err
	}
	f := &Fleet{changed: make(chan struct{}, 1), tally: fleet.NewTally(c.opts.NodeName)}
	f.writer = fleet.NewWriter(c.opts.NodeName, store, fleet.SystemClock{}, c.log)
	f.watcher, err = fleet.NewWatcher(cfg, func(r *fleet.CircuitReport) {
		f.mu.Lock()
		f.tally.Observe(r)
		f.mu.Unlock()
		f.signal()
	}, func(node string) {
		f.mu.Lock()
		f.tally.Forget(node)
		f.mu.Unlock()
		f.signal()
	}, c.log)
	if err != nil {
		return nil, fmt.Errorf("fleet: %w", err)
	}
	return f, nil
}

func (f *Fleet) signal() {
	select {
	case f.changed <- struct{}{}:
	default: // one is pending
	}
}

// Run writes this node's report and watches every node's until ctx ends.
func (f *Fleet) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() { f.writer.Run(ctx) })
	wg.Go(func() { f.watcher.Run(ctx) })
	wg.Go(func() {
		// The first list may hold no report at all: say when it is in.
		if cacheSynced(ctx, f.watcher) {
			f.signal()
		}
	})
	wg.Wait()
}

// cacheSynced waits for the watcher's first list; false when ctx ends
// first.
func cacheSynced(ctx context.Context, w *fleet.Watcher) bool {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for !w.Synced() {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
	}
	return true
}

// Changed is signalled after the reports changed (or were first listed).
func (f *Fleet) Changed() <-chan struct{} { return f.changed }

// Synced reports whether the reports have been listed once.
func (f *Fleet) Synced() bool { return f.watcher.Synced() }

// Publish hands the Writer this node's whole set of circuits open on its
// own evidence; it never blocks.
func (f *Fleet) Publish(open []FleetCircuit) {
	cs := make([]fleet.Circuit, len(open))
	for i, c := range open {
		cs[i] = fleet.Circuit{Key: c.Key, Target: c.Target, Workload: c.Workload, Reason: c.Reason,
			Since: metav1.NewMicroTime(c.Since), OpenUntil: metav1.NewMicroTime(c.OpenUntil)}
	}
	f.writer.Set(cs)
}

// Open returns the keys a quorum of other nodes has open at now (see
// fleet.Tally.Open; quorum gives a key's quorum, 0 where the fleet does
// not apply), and when a count may next fall (ok false: nothing counts).
func (f *Fleet) Open(now time.Time, quorum func(key string) int) (open []FleetOpen, next time.Time, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, v := range f.tally.Open(now, quorum) {
		open = append(open, FleetOpen{Key: v.Key, Nodes: v.Nodes, Quorum: v.Quorum, Until: v.Until})
	}
	next, ok = f.tally.NextExpiry(now)
	return open, next, ok
}

// Nodes returns how many other nodes have key open at now.
func (f *Fleet) Nodes(key string, now time.Time) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.tally.Count(key, now)
}

// Stats returns the Writer's counters and the Watcher's failed reads.
func (f *Fleet) Stats() FleetStats {
	s, r := f.writer.Stats(), f.watcher.Errors()
	return FleetStats{Writes: s.Writes, Errors: s.Errors, Omitted: s.Omitted, ListErrors: r.List, WatchErrors: r.Watch}
}
