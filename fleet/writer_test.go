package fleet

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// fakeClock moves only when the test advances it. Each After it hands
// out is announced on timers, so a test waits for the Writer to be
// waiting instead of sleeping.
type fakeClock struct {
	mu      sync.Mutex
	now     time.Time
	pending []fakeTimer
	timers  chan time.Duration
}

type fakeTimer struct {
	at time.Time
	ch chan time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: t0, timers: make(chan time.Duration, 100)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) After(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	ch := make(chan time.Time, 1)
	c.pending = append(c.pending, fakeTimer{c.now.Add(d), ch})
	c.mu.Unlock()
	c.timers <- d
	return ch
}

// Advance moves the clock and fires the timers that are due.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	kept := c.pending[:0]
	for _, t := range c.pending {
		if t.at.After(c.now) {
			kept = append(kept, t)
			continue
		}
		t.ch <- c.now
	}
	c.pending = kept
}

// Waiting returns how many timers have not fired.
func (c *fakeClock) Waiting() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.pending)
}

// fakeStore records each report applied, and fails while fail > 0.
type fakeStore struct {
	mu      sync.Mutex
	fail    int
	applied chan *CircuitReport
	at      chan time.Time
	clock   Clock
}

func newFakeStore(c Clock) *fakeStore {
	return &fakeStore{applied: make(chan *CircuitReport, 100), at: make(chan time.Time, 100), clock: c}
}

func (s *fakeStore) Apply(ctx context.Context, r *CircuitReport) error {
	s.mu.Lock()
	fail := s.fail > 0
	if fail {
		s.fail--
	}
	s.mu.Unlock()
	s.at <- s.clock.Now()
	if fail {
		return errors.New("the API server said no")
	}
	s.applied <- r.DeepCopy()
	return nil
}

func keysOf(r *CircuitReport) []string {
	var ks []string
	for _, c := range r.Spec.Circuits {
		ks = append(ks, c.Key)
	}
	return ks
}

func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(5 * time.Second):
		t.Fatalf("no %s within 5 s", what)
		panic("unreachable")
	}
}

func startWriter(t *testing.T, store Store, clock Clock) *Writer {
	w := NewWriter("node-a", store, clock, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return w
}

// TestFleetWriterCoalesces: the first transition is written at once;
// those within the next second are written together, once, a second
// after the first write, with the latest set.
func TestFleetWriterCoalesces(t *testing.T) {
	clock := newFakeClock()
	store := newFakeStore(clock)
	w := startWriter(t, store, clock)

	w.Set([]Circuit{open("a", 10)})
	if r := recv(t, store.applied, "first write"); fmt.Sprint(keysOf(r)) != "[a]" || r.Name != "node-a" || r.Spec.Open != 1 {
		t.Fatalf("first write %+v", r)
	}
	if at := recv(t, store.at, "first write's time"); !at.Equal(t0) {
		t.Fatalf("first write at %v, want at once (%v)", at, t0)
	}
	w.Set([]Circuit{open("a", 10), open("b", 10)})
	w.Set([]Circuit{open("b", 10)})
	w.Set([]Circuit{open("b", 10), open("c", 10)})
	if d := recv(t, clock.timers, "the Writer waiting"); d != WriteInterval {
		t.Fatalf("the Writer waits %v, want %v after its last write", d, WriteInterval)
	}
	clock.Advance(WriteInterval - time.Millisecond)
	if clock.Waiting() != 1 {
		t.Fatal("the Writer's timer fired before a second had passed")
	}
	clock.Advance(time.Millisecond)
	r := recv(t, store.applied, "coalesced write")
	if fmt.Sprint(keysOf(r)) != "[b c]" || r.Spec.Open != 2 {
		t.Fatalf("coalesced write has %v (open %d), want the latest set [b c]", keysOf(r), r.Spec.Open)
	}
	if at := recv(t, store.at, "second write's time"); !at.Equal(t0.Add(WriteInterval)) {
		t.Fatalf("second write at %v, want a second after the first", at)
	}
	// A set handed over long after is written at once; an empty set
	// clears the report.
	clock.Advance(time.Minute)
	w.Set(nil)
	if r := recv(t, store.applied, "clearing write"); len(r.Spec.Circuits) != 0 || r.Spec.Circuits == nil || r.Spec.Open != 0 {
		t.Fatalf("clearing write %+v, want an empty (not null) list", r.Spec)
	}
	if s := w.Stats(); s.Writes != 3 || s.Errors != 0 {
		t.Fatalf("stats %+v, want 3 writes: the three coalesced sets made one", s)
	}
}

// TestFleetWriterBacksOff: a failed write is counted and retried with the
// latest set after a growing backoff; a success ends the backoff.
func TestFleetWriterBacksOff(t *testing.T) {
	clock := newFakeClock()
	store := newFakeStore(clock)
	store.fail = 3
	w := startWriter(t, store, clock)

	w.Set([]Circuit{open("a", 10)})
	recv(t, store.at, "first attempt")
	for i, want := range []time.Duration{MinBackoff, 2 * MinBackoff, 4 * MinBackoff} {
		if i == 1 {
			w.Set([]Circuit{open("z", 10)}) // the retry takes the latest
		}
		if d := recv(t, clock.timers, "backoff"); d != want {
			t.Fatalf("backoff %d is %v, want %v", i+1, d, want)
		}
		clock.Advance(want)
		recv(t, store.at, "retry")
	}
	r := recv(t, store.applied, "write after the errors")
	if fmt.Sprint(keysOf(r)) != "[z]" {
		t.Fatalf("retried write has %v, want the latest set [z]", keysOf(r))
	}
	if s := w.Stats(); s.Writes != 1 || s.Errors != 3 {
		t.Fatalf("stats %+v, want 1 write and 3 errors", s)
	}
	// After a success the pace is one second again.
	w.Set(nil)
	if d := recv(t, clock.timers, "pace"); d != WriteInterval {
		t.Fatalf("after a success the Writer waits %v, want %v", d, WriteInterval)
	}
}

// blockingStore never answers until released.
type blockingStore struct{ release chan struct{} }

func (s blockingStore) Apply(ctx context.Context, r *CircuitReport) error {
	select {
	case <-s.release:
	case <-ctx.Done():
	}
	return nil
}

// TestFleetWriterNeverBlocks: Set returns while the API hangs.
func TestFleetWriterNeverBlocks(t *testing.T) {
	store := blockingStore{release: make(chan struct{})}
	defer close(store.release)
	w := startWriter(t, store, SystemClock{})
	done := make(chan struct{})
	go func() {
		for i := range 10000 {
			w.Set([]Circuit{open(fmt.Sprint(i), 10)})
		}
		close(done)
	}()
	recv(t, done, "return from 10000 Sets while the store hangs")
}

// TestFleetBound: past the limit the most recently opened win, listed by
// key, and the rest are counted.
func TestFleetBound(t *testing.T) {
	var cs []Circuit
	for i := range MaxCircuits + 2 {
		c := open(fmt.Sprintf("k%03d", MaxCircuits+1-i), 10) // k129 first
		c.Since = metav1.NewMicroTime(t0.Add(time.Duration(i) * time.Second))
		cs = append(cs, c)
	}
	listed, omitted := Bound(cs, MaxCircuits)
	if omitted != 2 || len(listed) != MaxCircuits {
		t.Fatalf("listed %d, omitted %d; want %d and 2", len(listed), omitted, MaxCircuits)
	}
	// k129 and k128 opened first: they are left out.
	if listed[0].Key != "k000" || listed[len(listed)-1].Key != "k127" {
		t.Fatalf("listed %s … %s, want k000 … k127 (the two oldest, k128 and k129, left out)", listed[0].Key, listed[len(listed)-1].Key)
	}
	for i := 1; i < len(listed); i++ {
		if listed[i-1].Key >= listed[i].Key {
			t.Fatalf("not ordered by key at %d: %s, %s", i, listed[i-1].Key, listed[i].Key)
		}
	}
	if l, o := Bound(cs[:3], MaxCircuits); len(l) != 3 || o != 0 {
		t.Fatalf("under the limit: %d listed, %d omitted", len(l), o)
	}

	clock := newFakeClock()
	store := newFakeStore(clock)
	w := startWriter(t, store, clock)
	w.Set(cs)
	r := recv(t, store.applied, "bounded write")
	if r.Spec.Open != MaxCircuits+2 || r.Spec.Omitted != 2 || len(r.Spec.Circuits) != MaxCircuits {
		t.Fatalf("report open %d omitted %d listed %d", r.Spec.Open, r.Spec.Omitted, len(r.Spec.Circuits))
	}
	if s := w.Stats(); s.Omitted != 2 {
		t.Fatalf("stats %+v, want 2 omitted", s)
	}
}
