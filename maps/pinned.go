package maps

import (
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
)

// AllLimits reads every entry of the limits map.
func (v *View) AllLimits() (map[Dest]Limit, error) {
	out := map[Dest]Limit{}
	var key bpf.BreakerDestKey
	var raw bpf.BreakerLimit
	it := v.limits.Iterate()
	for it.Next(&key, &raw) {
		out[DestFromKey(&key)] = Limit{Slot: raw.Slot, MaxConnections: raw.MaxConnections, MaxConnecting: raw.MaxConnecting, Errno: syscall.Errno(raw.RejectErrno), Responses: ResponseFlags(raw.Responses), Epoch: raw.Epoch,
			BatchID: raw.BatchId, BatchEpoch: raw.BatchEpoch, FastBound: time.Duration(raw.FastUs) * time.Microsecond}
	}
	if err := it.Err(); err != nil {
		return out, fmt.Errorf("iterating limits: %w", err)
	}
	return out, nil
}

// BusySlots returns the bulkhead slots that still count sockets (a socket
// counted there has not been released yet), with their counts.
func (v *View) BusySlots() (map[uint32]BulkCount, error) {
	out := map[uint32]BulkCount{}
	const batch = 4096
	keys := make([]uint32, batch)
	vals := make([]bpf.BreakerBulkCount, batch)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := v.bulk.BatchLookup(&cursor, keys, vals, nil)
		for i := 0; i < n; i++ {
			if vals[i].Connections != 0 || vals[i].Connecting != 0 {
				out[keys[i]] = BulkCount{Connections: vals[i].Connections, Connecting: vals[i].Connecting}
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if err != nil {
			return out, fmt.Errorf("reading bulkhead counts: %w", err)
		}
	}
}
