package maps

import (
	"errors"
	"fmt"
	"hash/maphash"
	"iter"
	"net/netip"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
)

// Proto is the transport protocol of a destination.
type Proto uint8

// The protocols breakerd enforces.
const (
	TCP Proto = unix.IPPROTO_TCP
	UDP Proto = unix.IPPROTO_UDP
)

// String returns "tcp" or "udp".
func (p Proto) String() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	}
	return fmt.Sprintf("proto(%d)", uint8(p))
}

// Dest is a destination: protocol, address and port, and the workload
// class of the connecting process (0, the shared class, unless isolated
// workloads are configured). IPv4 addresses are kept IPv4-mapped in the
// kernel; Dest always holds the unmapped form.
type Dest struct {
	Proto Proto
	Class uint8 // next to Proto, so that a Dest packs into 40 bytes
	Addr  netip.AddrPort
}

// String returns proto/addr:port, e.g. tcp/198.18.0.2:80, with #class
// after it for a class other than 0 (tcp/198.18.0.2:80#2).
func (d Dest) String() string {
	s := d.Proto.String() + "/" + d.Addr.String()
	if d.Class != 0 {
		s += "#" + strconv.Itoa(int(d.Class))
	}
	return s
}

// Shared returns d in the shared class (Class 0).
func (d Dest) Shared() Dest { d.Class = 0; return d }

// DestKey is a Dest in 20 bytes with no pointer in it, for maps keyed by
// destination: cheaper to hash and to hold than a Dest, whose
// netip.AddrPort carries a zone pointer. Two Dests are equal exactly when
// their DestKeys are.
type DestKey struct {
	addr  [16]byte
	port  uint16
	proto Proto
	class uint8
}

// DestKey has no padding: its bytes are its fields (Hash reads them).
var _ = [1]struct{}{}[unsafe.Sizeof(DestKey{})-
	(unsafe.Sizeof(DestKey{}.addr)+unsafe.Sizeof(DestKey{}.port)+unsafe.Sizeof(DestKey{}.proto)+unsafe.Sizeof(DestKey{}.class))]

// Hash returns a hash of k under seed: equal keys hash alike. It does not
// allocate.
func (k *DestKey) Hash(seed maphash.Seed) uint64 {
	return maphash.Bytes(seed, unsafe.Slice((*byte)(unsafe.Pointer(k)), unsafe.Sizeof(*k)))
}

// Compact returns d's DestKey.
func (d Dest) Compact() DestKey {
	return DestKey{addr: d.Addr.Addr().As16(), port: d.Addr.Port(), proto: d.Proto, class: d.Class}
}

// Key returns the kernel's key for d.
func (d Dest) Key() bpf.BreakerDestKey {
	return bpf.BreakerDestKey{
		Addr:  netip.AddrFrom16(d.Addr.Addr().As16()).As16(),
		Port:  htons(d.Addr.Port()),
		Proto: uint8(d.Proto),
		Class: d.Class,
	}
}

// DestFromKey converts a kernel key back to a Dest.
func DestFromKey(k *bpf.BreakerDestKey) Dest {
	return Dest{
		Proto: Proto(k.Proto),
		Addr:  netip.AddrPortFrom(netip.AddrFrom16(k.Addr).Unmap(), ntohs(k.Port)),
		Class: k.Class,
	}
}

func htons(p uint16) uint16 { return p<<8 | p>>8 }
func ntohs(p uint16) uint16 { return p<<8 | p>>8 }

// State is the kernel's state of a circuit with a verdict entry.
type State uint32

// Verdict states, as in bpf/breaker.h. An Open verdict whose Due has
// passed is half-open: the kernel admits the probes of its Round. A Ramp
// verdict is a closed circuit's slow start: from Due, the kernel admits a
// share of new TCP connects that follows its Ramp curve over RampLen.
const (
	Open       = State(bpf.BreakerVerdictStateVERDICT_OPEN)
	Ramp       = State(bpf.BreakerVerdictStateVERDICT_RAMP)
	ForcedOpen = State(bpf.BreakerVerdictStateVERDICT_FORCED_OPEN)
)

// String returns the state's name as bpftool users know it.
func (s State) String() string {
	switch s {
	case Open:
		return "open"
	case ForcedOpen:
		return "forced_open"
	case Ramp:
		return "ramp"
	}
	return fmt.Sprintf("state(%d)", uint32(s))
}

// Verdict is what the kernel enforces for one destination.
type Verdict struct {
	// State is Open or ForcedOpen.
	State State
	// Due is the monotonic time (see Now) from which an open verdict
	// admits the probes of Round.
	Due time.Duration
	// Round is the half-open round the verdict admits probes of; the
	// kernel takes them from the circuit's probe budget (CircuitID), which
	// it moves to Round on the first probe. A new round is a verdict with
	// a higher Round.
	Round uint32
	// Probes is the number of probe tokens per round.
	Probes uint32
	// Errno is what a rejected connect sees (0: ECONNREFUSED).
	Errno syscall.Errno
	// CircuitID indexes the counters and probe budgets (0 ..
	// MaxCircuitIDs-1).
	CircuitID uint32
	// Epoch tells apart the circuits that held CircuitID one after the
	// other: the kernel keys the cgroups a verdict rejects by CircuitID
	// and Epoch (Rejections). 0 records none.
	Epoch uint32
	// RampLen is a Ramp verdict's length: from Due+RampLen on it admits
	// every connect.
	RampLen time.Duration
	// Curve is a Ramp verdict's share of new connects admitted at
	// i/RampPoints of the ramp, in 1/RampUnit (Curve[0] is the floor).
	Curve [RampPoints]uint8
}

// The slow-start curve's resolution (breaker.h enum ramp).
const (
	RampPoints = int(bpf.BreakerRampRAMP_POINTS)
	RampUnit   = int(bpf.BreakerRampRAMP_UNIT)
)

// RampVerdict returns a slow-start verdict for circuit id: from start
// (the maps.Now clock) the kernel admits the share share(x) of new TCP
// connects at x, the share of length elapsed, and turns the rest away with
// errno; from start+length on it admits every one. share is sampled at
// RampPoints points (x = i/RampPoints) and the kernel interpolates
// linearly between them.
func RampVerdict(start, length time.Duration, share func(x float64) float64, errno syscall.Errno, id uint32) Verdict {
	v := Verdict{State: Ramp, Due: start, RampLen: length, Errno: errno, CircuitID: id}
	for i := range v.Curve {
		s := share(float64(i) / float64(RampPoints))
		v.Curve[i] = uint8(min(max(s*float64(RampUnit)+0.5, 0), float64(RampUnit-1)))
	}
	return v
}

// RampShare is the share of new connects v admits at now, as the kernel
// computes it (a Ramp verdict; 1 for any other state, or past its end).
func (v Verdict) RampShare(now time.Duration) float64 {
	if v.State != Ramp {
		return 1
	}
	if now < v.Due {
		return float64(v.Curve[0]) / float64(RampUnit)
	}
	el := now - v.Due
	if v.RampLen <= 0 || el >= v.RampLen {
		return 1
	}
	pos := float64(el) * float64(RampPoints) / float64(v.RampLen)
	i := min(int(pos), RampPoints-1)
	lo, hi := float64(v.Curve[i]), float64(RampUnit)
	if i+1 < RampPoints {
		hi = float64(v.Curve[i+1])
	}
	return (lo + (hi-lo)*(pos-float64(i))) / float64(RampUnit)
}

// RampEnd is when a Ramp verdict admits everything (the maps.Now clock).
func (v Verdict) RampEnd() time.Duration { return v.Due + v.RampLen }

// MaxCircuitIDs is the number of circuit ids: per-circuit counter entries
// and bulkhead slots (breaker.h enum sizes, checked by TestSizesMatchTheKernel). Id 0 is never
// given to a circuit.
const MaxCircuitIDs = 1 << 18

// MaxDestinations is the capacity of the verdict and limits maps
// (breaker.h enum sizes).
const MaxDestinations = 1 << 18

// OpenVerdict returns an open verdict due at due that admits probes of
// round.
func OpenVerdict(due time.Duration, round, probes uint32, errno syscall.Errno, id uint32) Verdict {
	return Verdict{State: Open, Due: due, Round: round, Probes: probes, Errno: errno, CircuitID: id}
}

func (v Verdict) raw() bpf.BreakerVerdict {
	return bpf.BreakerVerdict{
		DueNs:       uint64(v.Due),
		State:       uint32(v.State),
		Round:       v.Round,
		Probes:      v.Probes,
		CircuitId:   v.CircuitID,
		RejectErrno: uint16(v.Errno),
		Epoch:       v.Epoch,
		RampNs:      uint64(v.RampLen),
		Ramp:        v.Curve,
	}
}

func verdictFromRaw(r *bpf.BreakerVerdict) Verdict {
	return Verdict{
		State:     State(r.State),
		Due:       time.Duration(r.DueNs),
		Round:     r.Round,
		Probes:    r.Probes,
		CircuitID: r.CircuitId,
		Errno:     syscall.Errno(r.RejectErrno),
		Epoch:     r.Epoch,
		RampLen:   time.Duration(r.RampNs),
		Curve:     r.Ramp,
	}
}

// Budget is a circuit's probe budget: the round the kernel is in and the
// tokens left in it.
type Budget struct {
	Round  uint32
	Tokens uint32
}

// Budget reads circuit id's probe budget.
func (v *View) Budget(id uint32) (Budget, error) {
	var raw bpf.BreakerProbeBudget
	if err := v.budgets.Lookup(&id, &raw); err != nil {
		return Budget{}, fmt.Errorf("reading probe budget %d: %w", id, err)
	}
	return Budget{Round: uint32(raw.Word >> 32), Tokens: uint32(raw.Word)}, nil
}

// ErrVerdictsFull is returned by PutVerdict when the verdict map has no
// room. The destination stays unenforced (fail-open).
var ErrVerdictsFull = errors.New("verdict map is full")

// PutVerdict writes (creates or replaces) d's verdict.
func (k *Kernel) PutVerdict(d Dest, v Verdict) error {
	if v.CircuitID >= MaxCircuitIDs {
		return fmt.Errorf("circuit id %d is not below %d", v.CircuitID, MaxCircuitIDs)
	}
	key, val := d.Key(), v.raw()
	k.vm.mu.Lock()
	defer k.vm.mu.Unlock()
	if err := k.putVerdictLocked(&key, &val); err != nil {
		if errors.Is(err, unix.E2BIG) {
			return fmt.Errorf("writing verdict for %s: %w", d, ErrVerdictsFull)
		}
		return fmt.Errorf("writing verdict for %s: %w", d, err)
	}
	return nil
}

// DeleteVerdict removes d's verdict (its circuit is closed). Deleting a
// missing entry is not an error.
func (k *Kernel) DeleteVerdict(d Dest) error {
	key := d.Key()
	k.vm.mu.Lock()
	defer k.vm.mu.Unlock()
	if err := k.deleteVerdictLocked(&key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("deleting verdict for %s: %w", d, err)
	}
	return nil
}

// Verdict reads d's verdict; ok is false when there is none.
func (v *View) Verdict(d Dest) (_ Verdict, ok bool, err error) {
	key := d.Key()
	var raw bpf.BreakerVerdict
	if err := v.verdicts.Lookup(&key, &raw); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return Verdict{}, false, nil
		}
		return Verdict{}, false, fmt.Errorf("reading verdict for %s: %w", d, err)
	}
	return verdictFromRaw(&raw), true, nil
}

// Verdicts iterates over every verdict entry; a read error ends the
// iteration early (AllVerdicts reports it).
func (v *View) Verdicts() iter.Seq2[Dest, Verdict] {
	return iterVerdicts(v.verdicts, nil)
}

// AllVerdicts reads every verdict entry.
func (v *View) AllVerdicts() (map[Dest]Verdict, error) {
	var err error
	out := map[Dest]Verdict{}
	for d, v := range iterVerdicts(v.verdicts, &err) {
		out[d] = v
	}
	if err != nil {
		return out, fmt.Errorf("iterating verdicts: %w", err)
	}
	return out, nil
}

func iterVerdicts(m *ebpf.Map, errp *error) iter.Seq2[Dest, Verdict] {
	return func(yield func(Dest, Verdict) bool) {
		var key bpf.BreakerDestKey
		var raw bpf.BreakerVerdict
		it := m.Iterate()
		for it.Next(&key, &raw) {
			if !yield(DestFromKey(&key), verdictFromRaw(&raw)) {
				return
			}
		}
		if errp != nil {
			*errp = it.Err()
		}
	}
}

// VerdictCount returns the number of verdict entries and the map's
// capacity. It reads the map in batches of 4096 entries (a few dozen
// system calls for a full map, not two per entry).
func (v *View) VerdictCount() (n int, capacity uint32) {
	keys := make([]bpf.BreakerDestKey, batchSize)
	vals := make([]bpf.BreakerVerdict, batchSize)
	var cursor ebpf.MapBatchCursor
	for {
		got, err := v.verdicts.BatchLookup(&cursor, keys, vals, nil)
		n += got
		if err != nil {
			if !errors.Is(err, ebpf.ErrKeyNotExist) {
				// Batches not supported or another failure: one entry at a time.
				n = 0
				for range v.Verdicts() {
					n++
				}
			}
			return n, v.verdicts.MaxEntries()
		}
	}
}

// batchSize is how many entries one batched map read carries.
const batchSize = 4096

// Now is the kernel's monotonic clock (bpf_ktime_get_ns), the time base of
// Verdict.Due, Settings.Heartbeat and event timestamps.
func Now() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return time.Duration(ts.Nano())
}

// PutVerdicts writes the same verdict for many destinations in batches
// (tests and benchmarks); it returns how many were written. The verdict
// mask gets every destination's bit first, and is counted again from the
// map after.
func (k *Kernel) PutVerdicts(dests []Dest, v Verdict) (_ int, err error) {
	k.vm.mu.Lock()
	defer k.vm.mu.Unlock()
	if err := k.setMaskBits(k.vm.bits | MaskOf(dests)); err != nil {
		return 0, err
	}
	defer func() {
		err = errors.Join(err, k.recountLocked(0))
	}()
	const batch = 4096
	keys := make([]bpf.BreakerDestKey, 0, batch)
	vals := make([]bpf.BreakerVerdict, 0, batch)
	raw := v.raw()
	written := 0
	for i := 0; i < len(dests); i += batch {
		keys, vals = keys[:0], vals[:0]
		for _, d := range dests[i:min(i+batch, len(dests))] {
			keys = append(keys, d.Key())
			vals = append(vals, raw)
		}
		n, err := k.objs.Verdicts.BatchUpdate(keys, vals, nil)
		written += n
		if err != nil {
			return written, fmt.Errorf("writing verdicts: %w", err)
		}
	}
	return written, nil
}
