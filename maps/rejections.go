package maps

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
)

// MaxRejections is the capacity of the rejections map: how many (circuit,
// cgroup) pairs the kernel can count rejections of, open-circuit, bulkhead
// and slow-start ones alike (MAX_REJECTIONS in bpf/breaker.h). A pair past it is
// not recorded (Stats.RejectionsFull counts those rejections); the
// circuit's own counters still count it.
const MaxRejections = 1 << 15

// RejectionKey names one entry of the rejections map: the cgroup a
// circuit turned connects or sends away from. CircuitID and Epoch are the
// rejecting verdict's (open, half-open or a slow-start ramp), or the rejecting limit's Slot and Epoch (the same
// pair for a circuit's own bulkhead; a sharing workload's bulkhead slot
// has its own).
type RejectionKey struct {
	CgroupID  uint64
	CircuitID uint32
	Epoch     uint32
}

// Rejection is one entry of the rejections map.
type Rejection struct {
	RejectionKey
	// Rejected counts the connects and sends an open circuit turned away.
	Rejected uint64
	// ShadowRejected counts those shadow mode let through.
	ShadowRejected uint64
	// BulkheadRejected counts the connects a limit (max_connections,
	// max_connecting) turned away.
	BulkheadRejected uint64
	// BulkheadShadowRejected counts those shadow mode let through.
	BulkheadShadowRejected uint64
	// SlowStartRejected counts the connects a slow-start ramp turned
	// away.
	SlowStartRejected uint64
	// SlowStartShadowRejected counts those shadow mode let through.
	SlowStartShadowRejected uint64
}

// Rejections reads the whole rejections map, in batches (one system call
// per 4096 entries).
func (v *View) Rejections() ([]Rejection, error) {
	var out []Rejection
	keys := make([]bpf.BreakerRejectionKey, batchSize)
	vals := make([]bpf.BreakerRejectionCount, batchSize)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := v.rejections.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			k, c := keys[i], vals[i]
			out = append(out, Rejection{RejectionKey: RejectionKey{CgroupID: k.CgroupId, CircuitID: k.CircuitId, Epoch: k.Epoch},
				Rejected: c.Rejected, ShadowRejected: c.ShadowRejected,
				BulkheadRejected: c.BulkheadRejected, BulkheadShadowRejected: c.BulkheadShadowRejected,
				SlowStartRejected: c.SlowStartRejected, SlowStartShadowRejected: c.SlowStartShadowRejected})
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil // the last batch
		}
		if err != nil {
			return out, fmt.Errorf("reading the rejections map: %w", err)
		}
		if n == 0 {
			return out, nil
		}
	}
}

// DeleteRejections removes entries of the rejections map; missing ones
// are not an error.
func (k *Kernel) DeleteRejections(keys []RejectionKey) error {
	var errs []error
	for _, rk := range keys {
		raw := bpf.BreakerRejectionKey{CgroupId: rk.CgroupID, CircuitId: rk.CircuitID, Epoch: rk.Epoch}
		if err := k.objs.Rejections.Delete(&raw); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("deleting %d of %d rejection entries: %w", len(errs), len(keys), errs[0])
	}
	return nil
}
