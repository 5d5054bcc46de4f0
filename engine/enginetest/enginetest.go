// Package enginetest has a fake kernel and a fake clock for tests of the
// engine's decisions: no root, no maps, no real time.
//
// The fake kernel keeps the maps the engine writes in Go maps and counts
// every call by method name, so a test that asserts something did not
// happen first waits for a positive signal (Calls reaching n) rather than
// sleeping.
package enginetest

import (
	"fmt"
	"iter"
	"maps"
	"slices"
	"sync"
	"time"

	kmaps "github.com/breakerd/breakerd/maps"
)

// Kernel is a fake engine.Kernel. Its zero value is not ready: use
// NewKernel. It is safe for use by several goroutines.
type Kernel struct {
	mu        sync.Mutex
	verdicts  map[kmaps.Dest]kmaps.Verdict
	limits    map[kmaps.Dest]kmaps.Limit
	budgets   map[uint32]kmaps.Budget
	bulk      map[uint32]kmaps.BulkCount
	counters  map[uint32]kmaps.Counters
	answered  map[uint32]answeredWord
	overrides map[string]kmaps.OverrideState
	fallbacks map[uint32]kmaps.Fallback
	stats     kmaps.Stats
	awaiting  []kmaps.Awaiting
	calls     map[string]int
	// maxVerdicts bounds the verdict map (0: no bound), as the kernel's
	// does: a new entry past it is refused with kmaps.ErrVerdictsFull.
	maxVerdicts int
}

type answeredWord struct {
	epoch uint32
	count uint64
}

// NewKernel returns an empty fake kernel.
func NewKernel() *Kernel {
	return &Kernel{
		verdicts: map[kmaps.Dest]kmaps.Verdict{}, limits: map[kmaps.Dest]kmaps.Limit{}, budgets: map[uint32]kmaps.Budget{},
		bulk: map[uint32]kmaps.BulkCount{}, counters: map[uint32]kmaps.Counters{}, answered: map[uint32]answeredWord{},
		overrides: map[string]kmaps.OverrideState{}, fallbacks: map[uint32]kmaps.Fallback{}, calls: map[string]int{},
	}
}

func (k *Kernel) call(name string) {
	k.calls[name]++
}

// Calls is how many times the method named name was called.
func (k *Kernel) Calls(name string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.calls[name]
}

// SetMaxVerdicts bounds the verdict map to n entries (0: no bound).
func (k *Kernel) SetMaxVerdicts(n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.maxVerdicts = n
}

// PutVerdict writes d's verdict.
func (k *Kernel) PutVerdict(d kmaps.Dest, v kmaps.Verdict) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("PutVerdict")
	if v.CircuitID >= kmaps.MaxCircuitIDs {
		return fmt.Errorf("circuit id %d is not below %d", v.CircuitID, kmaps.MaxCircuitIDs)
	}
	if _, ok := k.verdicts[d]; !ok && k.maxVerdicts > 0 && len(k.verdicts) >= k.maxVerdicts {
		return fmt.Errorf("writing verdict for %s: %w", d, kmaps.ErrVerdictsFull)
	}
	k.verdicts[d] = v
	return nil
}

// DeleteVerdict removes d's verdict.
func (k *Kernel) DeleteVerdict(d kmaps.Dest) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("DeleteVerdict")
	delete(k.verdicts, d)
	return nil
}

// Verdict reads d's verdict.
func (k *Kernel) Verdict(d kmaps.Dest) (kmaps.Verdict, bool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("Verdict")
	v, ok := k.verdicts[d]
	return v, ok, nil
}

// Verdicts returns a copy of the verdict map.
func (k *Kernel) Verdicts() map[kmaps.Dest]kmaps.Verdict {
	k.mu.Lock()
	defer k.mu.Unlock()
	return maps.Clone(k.verdicts)
}

// PutFallback writes circuit id's fallback.
func (k *Kernel) PutFallback(id uint32, f kmaps.Fallback) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("PutFallback")
	if f.Epoch == 0 {
		return fmt.Errorf("fallback of circuit id %d: epoch 0 matches no verdict", id)
	}
	k.fallbacks[id] = f
	return nil
}

// DeleteFallback removes circuit id's fallback.
func (k *Kernel) DeleteFallback(id uint32) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("DeleteFallback")
	delete(k.fallbacks, id)
	return nil
}

// FallbackIDs lists the circuit ids with a fallback.
func (k *Kernel) FallbackIDs() ([]uint32, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Sorted(maps.Keys(k.fallbacks)), nil
}

// Fallbacks returns a copy of the fallbacks map.
func (k *Kernel) Fallbacks() map[uint32]kmaps.Fallback {
	k.mu.Lock()
	defer k.mu.Unlock()
	return maps.Clone(k.fallbacks)
}

// Budget reads id's probe budget (zero when never set, as a fresh map's).
func (k *Kernel) Budget(id uint32) (kmaps.Budget, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("Budget")
	return k.budgets[id], nil
}

// SetBudget sets id's probe budget, as the kernel does when it admits a
// round's first probe.
func (k *Kernel) SetBudget(id uint32, b kmaps.Budget) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.budgets[id] = b
}

// PutLimit writes d's limits.
func (k *Kernel) PutLimit(d kmaps.Dest, l kmaps.Limit) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("PutLimit")
	k.limits[d] = l
	return nil
}

// DeleteLimit removes d's limits.
func (k *Kernel) DeleteLimit(d kmaps.Dest) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("DeleteLimit")
	delete(k.limits, d)
	return nil
}

// Limits returns a copy of the limits map.
func (k *Kernel) Limits() map[kmaps.Dest]kmaps.Limit {
	k.mu.Lock()
	defer k.mu.Unlock()
	return maps.Clone(k.limits)
}

// BulkCount reads what slot counts.
func (k *Kernel) BulkCount(slot uint32) (kmaps.BulkCount, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("BulkCount")
	return k.bulk[slot], nil
}

// SetBulkCount sets what slot counts (sockets opened or closed).
func (k *Kernel) SetBulkCount(slot uint32, b kmaps.BulkCount) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.bulk[slot] = b
}

// Counters reads id's counts.
func (k *Kernel) Counters(id uint32) (kmaps.Counters, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("Counters")
	return k.counters[id], nil
}

// SetCounters sets id's counts (the kernel counted rejections).
func (k *Kernel) SetCounters(id uint32, c kmaps.Counters) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.counters[id] = c
}

// ResetCounters zeroes id's counts.
func (k *Kernel) ResetCounters(id uint32) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("ResetCounters")
	delete(k.counters, id)
	return nil
}

// Answered reads id's answered word.
func (k *Kernel) Answered(id uint32) (uint32, uint64, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("Answered")
	w := k.answered[id]
	return w.epoch, w.count, nil
}

// SetAnswered writes id's answered word anew under epoch.
func (k *Kernel) SetAnswered(id, epoch uint32) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("SetAnswered")
	k.answered[id] = answeredWord{epoch: epoch}
	return nil
}

// FlushAnswered counts the call; the fake writes no records.
func (k *Kernel) FlushAnswered(ids []uint32) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("FlushAnswered")
	return nil
}

// PutOverride keeps name's override.
func (k *Kernel) PutOverride(name string, s kmaps.OverrideState) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("PutOverride")
	k.overrides[name] = s
	return nil
}

// DeleteOverride forgets name's override.
func (k *Kernel) DeleteOverride(name string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("DeleteOverride")
	delete(k.overrides, name)
	return nil
}

// Overrides yields the kept overrides (a copy taken when called).
func (k *Kernel) Overrides() iter.Seq2[string, kmaps.OverrideState] {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("Overrides")
	return maps.All(maps.Clone(k.overrides))
}

// Stats reads the global statistics.
func (k *Kernel) Stats() (kmaps.Stats, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("Stats")
	return k.stats, nil
}

// Awaiting appends the requests SetAwaiting left in flight to out.
func (k *Kernel) Awaiting(out []kmaps.Awaiting) ([]kmaps.Awaiting, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.call("Awaiting")
	return append(out, k.awaiting...), nil
}

// SetAwaiting sets the requests in flight, as the inflight map holds them.
func (k *Kernel) SetAwaiting(a []kmaps.Awaiting) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.awaiting = append([]kmaps.Awaiting(nil), a...)
}

// LoseEvents adds n to the count of lost records.
func (k *Kernel) LoseEvents(n uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.stats.EventsLost += n
}

// Clock is a clock that moves only when told to: its wall time and its
// monotonic reading advance together. Its zero value is not ready: use
// NewClock.
type Clock struct {
	mu   sync.Mutex
	now  time.Time
	mono time.Duration
}

// NewClock returns a clock reading start, whose monotonic reading starts
// at an hour (a kernel's clock that has run a while: times before it are
// positive).
func NewClock(start time.Time) *Clock { return &Clock{now: start, mono: time.Hour} }

// Mono returns the clock's monotonic reading.
func (c *Clock) Mono() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mono
}

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock on by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	c.mono += d
}
