package maps

import (
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
)

// Limit is a destination's bulkhead: concurrency limits enforced in
// connect, counted in one slot (destinations of a service-scoped target
// share it). A limit of 0 is off.
type Limit struct {
	// Slot indexes the live counts (0 .. MaxCircuitIDs-1); breakerd uses
	// the circuit id.
	Slot uint32
	// MaxConnections caps connecting plus established sockets.
	MaxConnections uint32
	// MaxConnecting caps sockets still in SYN_SENT.
	MaxConnecting uint32
	// Errno is what a connect over a limit sees (0: EAGAIN).
	Errno syscall.Errno
	// Responses marks the destination's sockets for the response programs
	// (an entry with both limits 0 and Responses set only marks).
	Responses ResponseFlags
	// Epoch names the slot's current holder: the kernel counts the
	// connects a limit turns away per cgroup in the rejections map, under
	// (Slot, Epoch) (Rejection.BulkheadRejected). 0 records none.
	Epoch uint32
	// With RespBatch: BatchID is the circuit id whose answered word counts
	// the destination's ordinary successes, under BatchEpoch (see
	// SetAnswered), and a response FastBound or slower is recorded, not
	// counted (0: none is).
	BatchID, BatchEpoch uint32
	FastBound           time.Duration
}

// PutLimit writes d's limits. Settings.Limits must be on for connect to
// look them up.
func (k *Kernel) PutLimit(d Dest, l Limit) error {
	if l.Slot >= MaxCircuitIDs {
		return fmt.Errorf("bulkhead slot %d is not below %d", l.Slot, MaxCircuitIDs)
	}
	// What a socket takes must be given back however it goes: the
	// release hook runs before any limit can be taken.
	if err := k.ensureHook("sock_release"); err != nil {
		return fmt.Errorf("writing limits for %s: %w", d, err)
	}
	key := d.Key()
	if l.Responses&RespBatch != 0 && (l.BatchID >= AnsweredIDs || l.BatchEpoch == 0 || l.BatchEpoch >= AnsweredEpochs || l.FastBound < 0) {
		return fmt.Errorf("writing limits for %s: counted successes need a circuit id below %d and an epoch in 1..%d (have %d, %d)", d, AnsweredIDs, AnsweredEpochs-1, l.BatchID, l.BatchEpoch)
	}
	raw := bpf.BreakerLimit{Slot: l.Slot, MaxConnections: l.MaxConnections, MaxConnecting: l.MaxConnecting, RejectErrno: uint16(l.Errno), Responses: uint16(l.Responses), Epoch: l.Epoch,
		BatchId: l.BatchID, BatchEpoch: l.BatchEpoch, FastUs: uint32(min(l.FastBound/time.Microsecond, 1<<32-1))}
	if err := k.objs.Limits.Put(&key, &raw); err != nil {
		return fmt.Errorf("writing limits for %s: %w", d, err)
	}
	return nil
}

// respPortWords is the size of resp_ports: a bit per port, 64 to a word.
const respPortWords = 65536 / 64

// RespPorts reports the ports whose bit is set in resp_ports (the remote
// ports of sockets the response programs have followed), ascending. The
// whole array is read in one batch.
func (v *View) RespPorts() ([]uint16, error) {
	keys := make([]uint32, respPortWords)
	words := make([]uint64, respPortWords)
	var cursor ebpf.MapBatchCursor
	n, err := v.respPorts.BatchLookup(&cursor, keys, words, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, fmt.Errorf("reading resp_ports: %w", err)
	}
	var out []uint16
	for j, w := range words[:n] {
		for b := range uint32(64) {
			if w&(1<<b) != 0 {
				out = append(out, uint16(keys[j]*64+b))
			}
		}
	}
	return out, nil
}

// DeleteLimit removes d's limits. Sockets already counted are still
// released into their slot.
func (k *Kernel) DeleteLimit(d Dest) error {
	key := d.Key()
	if err := k.objs.Limits.Delete(&key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("deleting limits for %s: %w", d, err)
	}
	return nil
}

// BulkCountsUpTo reads the counts of bulkhead slots 0 to n-1 in batches
// (one system call per 4096 slots), indexed by slot.
func (v *View) BulkCountsUpTo(n uint32) ([]BulkCount, error) {
	n = min(n, v.bulk.MaxEntries())
	out := make([]BulkCount, 0, n)
	keys := make([]uint32, batchSize)
	vals := make([]bpf.BreakerBulkCount, batchSize)
	var cursor ebpf.MapBatchCursor
	for uint32(len(out)) < n {
		want := min(int(n)-len(out), batchSize)
		got, err := v.bulk.BatchLookup(&cursor, keys[:want], vals[:want], nil)
		for _, b := range vals[:got] {
			out = append(out, BulkCount{Connections: b.Connections, Connecting: b.Connecting})
		}
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, fmt.Errorf("reading bulkhead counts: %w", err)
		}
		if got == 0 || err != nil {
			break
		}
	}
	return out, nil
}

// BulkCount is the live socket count of one bulkhead slot.
type BulkCount struct {
	// Connections counts connecting plus established sockets.
	Connections int64
	// Connecting counts sockets in SYN_SENT.
	Connecting int64
}

// BulkCount reads the live counts of slot.
func (v *View) BulkCount(slot uint32) (BulkCount, error) {
	var raw bpf.BreakerBulkCount
	if err := v.bulk.Lookup(slot, &raw); err != nil {
		return BulkCount{}, fmt.Errorf("reading bulkhead slot %d: %w", slot, err)
	}
	return BulkCount{Connections: raw.Connections, Connecting: raw.Connecting}, nil
}
