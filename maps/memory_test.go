package maps

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

// daemonSetLimit is the memory limit of deploy/daemonset.yaml; the maps
// must leave most of it to the daemon.
const daemonSetLimit = 256 << 20

// TestMapMemoryWithinBound fills the hash maps (verdicts, limits,
// overrides, workloads, inflight, rejections) to capacity
// and reads what every map takes (memlock in fdinfo): it stays within
// MemoryBound for this node's CPUs, and MemoryBound for a 256-CPU node
// stays within half the DaemonSet's limit. scripts/vmtest also runs it in
// qemu on Linux 6.1 booted with possible_cpus=64 and 256 (per-CPU maps are
// sized by the possible CPUs, not the online ones); when the kernel command
// line carries possible_cpus=N, the test first checks that the kernel
// reports N possible CPUs, so those runs measure what they claim.
func TestMapMemoryWithinBound(t *testing.T) {
	kerneltest.RequireKernel(t)
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	if want, ok, err := bootPossibleCPUs(); err != nil {
		t.Fatal(err)
	} else if ok && cpus != want {
		t.Fatalf("the kernel was booted with possible_cpus=%d but reports %d possible CPUs", want, cpus)
	}
	dir := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
	t.Cleanup(func() { os.RemoveAll(dir) })
	k, err := Load(Options{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Uninstall()

	dests := make([]Dest, MaxDestinations)
	for i := range dests {
		a := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		dests[i] = Dest{Proto: TCP, Addr: netip.AddrPortFrom(a, 80)}
	}
	if n, err := k.PutVerdicts(dests, OpenVerdict(Now(), 1, 0, 0, 1)); err != nil || n != len(dests) {
		t.Fatalf("filling verdicts: %d %v", n, err)
	}
	for _, d := range dests {
		if err := k.PutLimit(d, Limit{Slot: 1, MaxConnections: 1}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range maxOverrides {
		if err := k.PutOverride(fmt.Sprintf("circuit-%d", i), OverrideForcedOpen); err != nil {
			t.Fatal(err)
		}
	}
	for i := range uint64(MaxWorkloadCgroups) {
		if err := k.PutWorkload(i+1, 1, 1); err != nil {
			t.Fatal(err)
		}
	}
	for i := range uint64(MaxInflight) {
		if err := k.objs.Inflight.Put(i+1, bpf.BreakerInflightTurn{ReqNs: 1}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range uint32(MaxRejections) {
		rk := bpf.BreakerRejectionKey{CgroupId: uint64(i + 1), CircuitId: 1, Epoch: 1}
		if err := k.objs.Rejections.Put(&rk, &bpf.BreakerRejectionCount{}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range uint32(MaxFallbacks) {
		if err := k.objs.Fallbacks.Put(i+1, &bpf.BreakerFallback{Epoch: 1}); err != nil {
			t.Fatal(err)
		}
	}
	mem, err := k.MapMemory()
	if err != nil {
		t.Fatal(err)
	}
	var total uint64
	names := make([]string, 0, len(mem))
	for name := range mem {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		t.Logf("map %-13s %10d bytes (%.2f MiB)", name, mem[name], mib(mem[name]))
		total += mem[name]
	}
	t.Logf("total %d bytes (%.1f MiB) on %d possible CPUs; bound %.1f MiB; bound at 64 CPUs %.1f MiB, at 256 CPUs %.1f MiB",
		total, mib(total), cpus, mib(MemoryBound(cpus)), mib(MemoryBound(64)), mib(MemoryBound(256)))
	if total > MemoryBound(cpus) {
		t.Fatalf("maps take %d bytes, more than MemoryBound(%d) = %d: the stated formula is wrong", total, cpus, MemoryBound(cpus))
	}
	if MemoryBound(256) > daemonSetLimit/2 {
		t.Fatalf("on 256 CPUs the maps may take %.1f MiB, more than half the DaemonSet's %d MiB", mib(MemoryBound(256)), daemonSetLimit>>20)
	}
}

// bootPossibleCPUs returns N when the kernel command line carries
// possible_cpus=N.
func bootPossibleCPUs() (int, bool, error) {
	b, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return 0, false, fmt.Errorf("reading the kernel command line: %w", err)
	}
	for _, f := range strings.Fields(string(b)) {
		if v, ok := strings.CutPrefix(f, "possible_cpus="); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				return 0, false, fmt.Errorf("kernel command line: bad possible_cpus=%q: %w", v, err)
			}
			return n, true, nil
		}
	}
	return 0, false, nil
}

func mib(n uint64) float64 { return float64(n) / (1 << 20) }
