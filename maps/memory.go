package maps

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
)

// MapMemory returns the memory each of k's maps takes, as the kernel
// accounts it (memlock in the map's fdinfo). Hash maps grow with their
// entries; the other maps are allocated whole at creation.
func (k *Kernel) MapMemory() (map[string]uint64, error) {
	out := map[string]uint64{}
	for name, m := range k.mapPins() {
		n, err := memlock(m)
		if err != nil {
			return nil, fmt.Errorf("memory of map %s: %w", name, err)
		}
		out[name] = n
	}
	return out, nil
}

func memlock(m *ebpf.Map) (uint64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/self/fdinfo/%d", m.FD()))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "memlock:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("no memlock line in fdinfo")
}

// Per-entry costs of the hash maps when full, from the kernel's hash map
// (struct htab_elem of 48 bytes, key and value rounded up to 8, an 8-byte
// free-list node) and one 16-byte bucket per entry (the bucket count is the
// capacity rounded up to a power of two).
const (
	htabElem        = 48 + 8
	htabBucket      = 16
	verdictEntry    = htabElem + 24 + 48 + htabBucket // key 20 -> 24, value 48
	limitEntry      = htabElem + 24 + 32 + htabBucket // key 20 -> 24, value 32
	overrideEntry   = htabElem + 128 + 8 + htabBucket // key 128 (a circuit name), value 8
	maxOverrides    = 4096
	workloadEntry   = htabElem + 8 + 8 + htabBucket   // key 8 (a cgroup id), value 8
	inflightEntry   = htabElem + 8 + 48 + htabBucket  // key 8 (a socket cookie), value 48
	rejectionEntry  = htabElem + 16 + 48 + htabBucket // key 16 (cgroup, circuit, epoch), value 48
	handoffBytes    = 16                              // per CPU
	counterEntry    = 56
	redirectEntry   = 8
	fallbackEntry   = htabElem + 8 + 24 + htabBucket // key 4 -> 8, value 24
	bulkEntry       = 16
	budgetEntry     = 8
	answeredBytes   = AnsweredIDs * 8
	ringBytes       = 4 << 20
	statEntries     = 8
	perCPULockBytes = 4 * 8 // the hash maps' per-CPU lock counters (8 ints)
)

// respPortsBytes is the resp_ports array: a bit per port.
const respPortsBytes = respPortWords * 8

// MemoryBound is the most memory breakerd's maps take, every map full, on
// a node with cpus possible CPUs (docs/install.md states it):
//
//	verdicts       MaxDestinations × 144 B   (36 MiB)
//	limits         MaxDestinations × 128 B   (32 MiB)
//	overrides      4096 × 208 B              (0.8 MiB)
//	counters       MaxCircuitIDs × 56 B      (14 MiB)
//	bulk           MaxCircuitIDs × 16 B      (4 MiB)
//	probe_budgets  MaxCircuitIDs × 8 B       (2 MiB)
//	answered       AnsweredIDs × 8 B         (0.5 MiB)
//	workloads      MaxWorkloadCgroups × 88 B (5.5 MiB)
//	inflight       MaxInflight × 128 B       (8 MiB)
//	rejections     MaxRejections × 136 B     (4.25 MiB)
//	fallbacks      MaxFallbacks × 104 B      (1.6 MiB)
//	redirects      MaxCircuitIDs × 8 B       (2 MiB)
//	resp_ports     a bit per port            (8 KiB)
//	events         4 MiB ring buffer
//	stats          8 × 8 B × cpus, plus 6 × 32 B × cpus of hash-map locks
//	handoff        16 B × cpus
//
// about 115 MiB whatever the CPU count (114.8 MiB at 2, 64 or 256
// CPUs).
// Kernels before 6.5 report a coarser figure in fdinfo (key plus value
// times capacity), below this bound too. The
// per-socket storage (socks, origins) is not in it: socks holds one small
// entry (120 bytes of value plus the kernel's bookkeeping) per observed
// socket of the protected cgroup, origins one of 40 bytes per socket
// redirected to a fallback, allocated as sockets need them and freed with
// them.
func MemoryBound(cpus int) uint64 {
	return MaxDestinations*(verdictEntry+limitEntry) +
		maxOverrides*overrideEntry +
		MaxCircuitIDs*(counterEntry+bulkEntry+budgetEntry+redirectEntry) +
		MaxFallbacks*fallbackEntry +
		MaxWorkloadCgroups*workloadEntry +
		MaxInflight*inflightEntry +
		MaxRejections*rejectionEntry +
		respPortsBytes +
		answeredBytes +
		ringBytes +
		uint64(cpus)*(statEntries*8+6*perCPULockBytes+handoffBytes) +
		64<<10 // map headers, the config entry, the ring buffer's page array
}
