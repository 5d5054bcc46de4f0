package maps

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
)

// MaxWorkloadCgroups is the capacity of the workloads map: how many
// cgroups of protected workloads the kernel can know (MAX_WORKLOAD_CGROUPS
// in bpf/breaker.h). A cgroup past it is not protected.
const MaxWorkloadCgroups = 1 << 16

// PutWorkload records that processes in the cgroup with id cgroupID
// belong to a workload whose connections are keyed by class in the
// verdicts and records, and by bulkhead in the limits map.
func (k *Kernel) PutWorkload(cgroupID uint64, class, bulkhead uint8) error {
	v := bpf.BreakerWorkload{Class: uint32(class), Bulkhead: uint32(bulkhead)}
	if err := k.objs.Workloads.Put(cgroupID, &v); err != nil {
		if errors.Is(err, unix.E2BIG) {
			err = ErrWorkloadsFull
		}
		return fmt.Errorf("writing workload of cgroup %d: %w", cgroupID, err)
	}
	return nil
}

// ErrWorkloadsFull is returned by PutWorkload when the workloads map holds
// as many cgroups as it can (MaxWorkloadCgroups): the cgroup is not
// protected until an entry is deleted.
var ErrWorkloadsFull = errors.New("workloads map is full")

// DeleteWorkload forgets a cgroup; a missing entry is not an error.
func (k *Kernel) DeleteWorkload(cgroupID uint64) error {
	if err := k.objs.Workloads.Delete(cgroupID); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("deleting workload of cgroup %d: %w", cgroupID, err)
	}
	return nil
}

// Workloads returns every entry of the workloads map: cgroup id to class.
func (v *View) Workloads() (map[uint64]uint8, error) {
	return v.workloadEntries(func(w bpf.BreakerWorkload) uint32 { return w.Class })
}

// WorkloadBulkheads returns every entry of the workloads map: cgroup id
// to bulkhead class.
func (v *View) WorkloadBulkheads() (map[uint64]uint8, error) {
	return v.workloadEntries(func(w bpf.BreakerWorkload) uint32 { return w.Bulkhead })
}

func (v *View) workloadEntries(field func(bpf.BreakerWorkload) uint32) (map[uint64]uint8, error) {
	out := map[uint64]uint8{}
	var id uint64
	var w bpf.BreakerWorkload
	it := v.workloads.Iterate()
	for it.Next(&id, &w) {
		out[id] = uint8(field(w))
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("reading the workloads map: %w", err)
	}
	return out, nil
}

// WorkloadCapacity is the workloads map's capacity.
func (v *View) WorkloadCapacity() uint32 { return v.workloads.MaxEntries() }

// Workload returns the class of one cgroup, and whether it is in the map.
func (v *View) Workload(cgroupID uint64) (class uint8, ok bool, err error) {
	var w bpf.BreakerWorkload
	switch err := v.workloads.Lookup(cgroupID, &w); {
	case errors.Is(err, ebpf.ErrKeyNotExist):
		return 0, false, nil
	case err != nil:
		return 0, false, fmt.Errorf("reading the workload of cgroup %d: %w", cgroupID, err)
	}
	return uint8(w.Class), true, nil
}
