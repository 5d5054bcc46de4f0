package engine

import (
	"iter"

	"github.com/breakerd/breakerd/maps"
)

// Kernel is what the core reads and writes in the kernel's maps: verdicts,
// the probe budget of a circuit id, bulkhead limits and counts, counters,
// the answered words of circuits whose ordinary successes the kernel
// counts, the overrides kept across restarts and the requests awaiting a
// response. Loading, attaching,
// reading the ring and checking the pins are the daemon's (maps.Kernel).
type Kernel interface {
	// PutVerdict writes the verdict of a destination.
	PutVerdict(d maps.Dest, v maps.Verdict) error
	// DeleteVerdict removes the verdict of a destination (none is fine).
	DeleteVerdict(d maps.Dest) error
	// Verdict reads the verdict of a destination; ok is false without one.
	Verdict(d maps.Dest) (v maps.Verdict, ok bool, err error)
	// PutFallback writes where a circuit id's rejected connects go.
	PutFallback(id uint32, f maps.Fallback) error
	// DeleteFallback removes a circuit id's fallback (none is fine).
	DeleteFallback(id uint32) error
	// FallbackIDs lists the circuit ids with a fallback.
	FallbackIDs() ([]uint32, error)
	// Budget reads the probe budget of a circuit id.
	Budget(id uint32) (maps.Budget, error)
	// PutLimit writes the bulkhead and response limits of a destination.
	PutLimit(d maps.Dest, l maps.Limit) error
	// DeleteLimit removes the limits of a destination.
	DeleteLimit(d maps.Dest) error
	// BulkCount reads what a bulkhead slot counts.
	BulkCount(slot uint32) (maps.BulkCount, error)
	// Counters reads the kernel's counts of a circuit id.
	Counters(id uint32) (maps.Counters, error)
	// ResetCounters zeroes the counts of a circuit id given anew.
	ResetCounters(id uint32) error
	// Answered reads a circuit id's answered word.
	Answered(id uint32) (epoch uint32, count uint64, err error)
	// SetAnswered writes a circuit id's answered word anew under epoch.
	SetAnswered(id, epoch uint32) error
	// FlushAnswered has the kernel write out the successes counted for ids.
	FlushAnswered(ids []uint32) error
	// PutOverride keeps a circuit's override across restarts.
	PutOverride(name string, s maps.OverrideState) error
	// DeleteOverride forgets a kept override.
	DeleteOverride(name string) error
	// Overrides yields the kept overrides.
	Overrides() iter.Seq2[string, maps.OverrideState]
	// Stats reads the kernel's global statistics (lost records).
	Stats() (maps.Stats, error)
	// Awaiting appends every request awaiting its first response byte
	// (the inflight map) to out.
	Awaiting(out []maps.Awaiting) ([]maps.Awaiting, error)
}

var _ Kernel = (*maps.Kernel)(nil)
