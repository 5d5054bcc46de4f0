package fleet

import (
	"cmp"
	"context"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// WriteInterval is the least time between two writes of one node's
// report: transitions within it are coalesced, the latest state wins.
const WriteInterval = time.Second

// Backoff after a failed write: it doubles from MinBackoff up to
// MaxBackoff and returns to nothing after a write succeeds.
const (
	MinBackoff = time.Second
	MaxBackoff = 30 * time.Second
)

// writeTimeout bounds one write, so a hung API server delays the next
// write (and is counted) instead of holding the Writer forever.
const writeTimeout = 10 * time.Second

// Clock is the time as the Writer sees it: the wall clock in the daemon,
// a clock the test moves by hand in the Writer's tests.
type Clock interface {
	Now() time.Time
	After(d time.Duration) <-chan time.Time
}

// SystemClock is the wall clock.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// After is time.After.
func (SystemClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Store writes a node's report. The Kubernetes API's (NewKubeStore)
// creates the object when it is missing.
type Store interface {
	Apply(ctx context.Context, r *CircuitReport) error
}

// Stats are a Writer's counters.
type Stats struct {
	// Writes counts the reports written.
	Writes uint64
	// Errors counts the writes that failed (each is retried, backed off,
	// with the latest state).
	Errors uint64
	// Omitted is how many open circuits the last report built left out
	// (past MaxCircuits).
	Omitted uint64
}

// Writer publishes one node's own open circuits. The daemon hands it the
// whole open set on each transition (Set, which never blocks); Run writes
// it at most once per WriteInterval, the latest set winning, bounded to
// MaxCircuits, and backs off after errors. A write that fails is never
// lost: the latest set is written once the API takes writes again.
type Writer struct {
	node  string
	store Store
	clock Clock
	log   *slog.Logger

	mu      sync.Mutex
	pending []Circuit
	dirty   bool
	wake    chan struct{}

	writes, errors, omitted atomic.Uint64
}

// NewWriter returns a Writer of node's report to store.
func NewWriter(node string, store Store, clock Clock, log *slog.Logger) *Writer {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Writer{node: node, store: store, clock: clock, log: log, wake: make(chan struct{}, 1)}
}

// Set hands the Writer the node's whole set of circuits open on its own
// evidence (an empty set clears the report). It copies open and returns
// at once.
func (w *Writer) Set(open []Circuit) {
	cp := slices.Clone(open)
	w.mu.Lock()
	w.pending, w.dirty = cp, true
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default: // a wake-up is already pending
	}
}

// Stats returns the counters.
func (w *Writer) Stats() Stats {
	return Stats{Writes: w.writes.Load(), Errors: w.errors.Load(), Omitted: w.omitted.Load()}
}

// Run writes until ctx ends.
func (w *Writer) Run(ctx context.Context) {
	var last time.Time // when the last write was attempted
	var backoff time.Duration
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		}
		for {
			wait := WriteInterval
			if backoff > 0 {
				wait = backoff
			}
			if !last.IsZero() {
				if d := last.Add(wait).Sub(w.clock.Now()); d > 0 {
					select {
					case <-ctx.Done():
						return
					case <-w.clock.After(d):
					}
				}
			}
			w.mu.Lock()
			open, dirty := w.pending, w.dirty
			w.dirty = false
			w.mu.Unlock()
			if !dirty {
				break
			}
			last = w.clock.Now()
			r := w.report(open)
			wctx, cancel := context.WithTimeout(ctx, writeTimeout)
			err := w.store.Apply(wctx, r)
			cancel()
			if err == nil {
				w.writes.Add(1)
				backoff = 0
				continue
			}
			if ctx.Err() != nil {
				return
			}
			w.errors.Add(1)
			backoff = min(max(2*backoff, MinBackoff), MaxBackoff)
			w.log.Warn("writing the fleet report", "node", w.node, "err", err, "retry_in", backoff)
			w.mu.Lock()
			w.dirty = true // retry with whatever is latest then
			w.mu.Unlock()
		}
	}
}

// report builds the node's report from its open set.
func (w *Writer) report(open []Circuit) *CircuitReport {
	listed, omitted := Bound(open, MaxCircuits)
	w.omitted.Store(uint64(omitted))
	return &CircuitReport{
		TypeMeta:   metav1.TypeMeta{APIVersion: Group + "/" + Version, Kind: Kind},
		ObjectMeta: metav1.ObjectMeta{Name: w.node},
		Spec:       ReportSpec{Open: len(open), Omitted: omitted, Circuits: listed},
	}
}

// Bound keeps at most limit circuits of open: the most recently opened
// (latest Since; on a tie, the lower key), ordered by key. It returns them
// and how many it left out.
func Bound(open []Circuit, limit int) ([]Circuit, int) {
	kept := slices.Clone(open)
	if len(kept) > limit {
		slices.SortStableFunc(kept, func(a, b Circuit) int {
			if c := b.Since.Time.Compare(a.Since.Time); c != 0 {
				return c
			}
			return cmp.Compare(a.Key, b.Key)
		})
		kept = kept[:limit]
	}
	slices.SortStableFunc(kept, func(a, b Circuit) int { return cmp.Compare(a.Key, b.Key) })
	if kept == nil {
		kept = []Circuit{} // written as [], as a report with none reads
	}
	return kept, len(open) - len(kept)
}
