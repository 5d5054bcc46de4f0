package daemon

import (
	"github.com/breakerd/breakerd/api"
)

// BulkheadCount is api.BulkheadCount.
type BulkheadCount = api.BulkheadCount

// completeBulkheads adds the sharing workloads' bulkheads to ci: each by
// workload name, and into the circuit's totals.
func (d *Daemon) completeBulkheads(ci *CircuitInfo, slots []bulkSlot) {
	if len(slots) == 0 {
		return
	}
	ci.Bulkheads = map[string]BulkheadCount{}
	for _, s := range slots {
		var b BulkheadCount
		if cnt, err := d.kernel.Counters(s.ID); err == nil {
			b.BulkheadRejected = cnt.BulkheadRejected
		}
		if n, err := d.kernel.BulkCount(s.ID); err == nil {
			b.Connections, b.Connecting = n.Connections, n.Connecting
		}
		ci.Bulkheads[s.Workload] = b
		ci.Connections += b.Connections
		ci.Connecting += b.Connecting
		ci.BulkheadRejected += b.BulkheadRejected
	}
}
