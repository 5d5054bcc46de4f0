package maps

import (
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
)

// Settings are the kernel programs' global settings (the config map).
type Settings struct {
	// Heartbeat is the daemon's last heartbeat on the Now clock. Zero, or
	// older than FailSafe, makes the programs ignore every verdict.
	Heartbeat time.Duration
	// FailSafe is how old the heartbeat may grow before verdicts are
	// ignored.
	FailSafe time.Duration
	// Shadow makes the programs count what they would reject and reject
	// nothing.
	Shadow bool
	// MaxRTO is how many retransmission timeouts make an established
	// connection stalled (0: the kernel's default of 3).
	MaxRTO uint32
	// Limits makes connect look destinations up in the limits map
	// (bulkheads); off, the allow path skips that lookup.
	Limits bool
	// UDP makes connect and sendmsg look UDP destinations up in the
	// verdict map; off (no target covers UDP), a datagram costs no lookup.
	UDP bool
	// WakeSlow: an established record whose handshake took at least this
	// long wakes the daemon's reader at once, like a failure (0: never).
	// Other healthy records are read in batches.
	WakeSlow time.Duration
	// Scoped protects only processes whose cgroup is in the workloads
	// map (see PutWorkload); off, every process below the attach point.
	Scoped bool
	// Classes makes connect look every process's cgroup up in the
	// workloads map for its class, protecting those without an entry in
	// class 0 (a target's source names cgroups, no workloads are listed);
	// Scoped implies the lookup and leaves those unprotected instead.
	Classes bool
}

// SetSettings writes the settings. Whether reset_seen is attached
// (CONFIG_RESET_TRACE) and the cgroup attached to are the loader's to say,
// not the caller's, and the verdict mask is the verdict writes' (see
// verdictMask). It takes no lock that attaching or the ground check
// hold, so the heartbeat that calls it waits only for another write of
// the settings.
func (k *Kernel) SetSettings(s Settings) error {
	raw := bpf.BreakerSettings{
		HeartbeatNs: uint64(s.Heartbeat),
		FailsafeNs:  uint64(s.FailSafe),
		MaxRto:      s.MaxRTO,
		WakeSlowNs:  uint64(max(s.WakeSlow, 0)),
	}
	if s.Shadow {
		raw.Flags |= uint32(bpf.BreakerConfigFlagsCONFIG_SHADOW)
	}
	if s.Limits {
		raw.Flags |= uint32(bpf.BreakerConfigFlagsCONFIG_LIMITS)
	}
	if s.UDP {
		raw.Flags |= uint32(bpf.BreakerConfigFlagsCONFIG_UDP)
	}
	if s.Scoped {
		raw.Flags |= uint32(bpf.BreakerConfigFlagsCONFIG_SCOPED)
	}
	if s.Classes {
		raw.Flags |= uint32(bpf.BreakerConfigFlagsCONFIG_CLASSES)
	}
	k.cfgMu.Lock()
	defer k.cfgMu.Unlock()
	k.loaderSettings(&raw)
	if err := k.objs.Config.Put(uint32(0), &raw); err != nil {
		return fmt.Errorf("writing settings: %w", err)
	}
	return nil
}

// Settings reads the settings.
func (v *View) Settings() (Settings, error) {
	var raw bpf.BreakerSettings
	if err := v.config.Lookup(uint32(0), &raw); err != nil {
		return Settings{}, fmt.Errorf("reading settings: %w", err)
	}
	return Settings{
		Heartbeat: time.Duration(raw.HeartbeatNs),
		FailSafe:  time.Duration(raw.FailsafeNs),
		Shadow:    raw.Flags&uint32(bpf.BreakerConfigFlagsCONFIG_SHADOW) != 0,
		Limits:    raw.Flags&uint32(bpf.BreakerConfigFlagsCONFIG_LIMITS) != 0,
		UDP:       raw.Flags&uint32(bpf.BreakerConfigFlagsCONFIG_UDP) != 0,
		Scoped:    raw.Flags&uint32(bpf.BreakerConfigFlagsCONFIG_SCOPED) != 0,
		Classes:   raw.Flags&uint32(bpf.BreakerConfigFlagsCONFIG_CLASSES) != 0,
		MaxRTO:    raw.MaxRto,
		WakeSlow:  time.Duration(raw.WakeSlowNs),
	}, nil
}

// Heartbeat refreshes the heartbeat to Now, keeping the other settings.
func (k *Kernel) Heartbeat() error {
	s, err := k.Settings()
	if err != nil {
		return err
	}
	s.Heartbeat = Now()
	return k.SetSettings(s)
}

// Counters are one circuit's kernel counters.
type Counters struct {
	// Rejected counts connects and sends turned away.
	Rejected uint64
	// ShadowRejected counts those that would have been (shadow mode).
	ShadowRejected uint64
	// Probes counts half-open probes admitted.
	Probes uint64
	// Rounds counts half-open rounds begun.
	Rounds uint64
	// BulkheadRejected counts connects turned away by a concurrency limit.
	BulkheadRejected uint64
	// SlowStartRejected counts connects turned away by a slow-start ramp
	// (RampVerdict).
	SlowStartRejected uint64
	// Redirected counts connects and sends an open circuit sent to its
	// fallback instead of rejecting them (the redirects map; not filled in
	// by countersFromRaw).
	Redirected uint64
}

func countersFromRaw(p *bpf.BreakerCircuitCounters) Counters {
	return Counters{Rejected: p.Rejected, ShadowRejected: p.ShadowRejected, Probes: p.Probes, Rounds: p.Rounds,
		BulkheadRejected: p.BulkheadRejected, SlowStartRejected: p.SlowStartRejected}
}

// Counters reads the counters of circuit id.
func (v *View) Counters(id uint32) (Counters, error) {
	var p bpf.BreakerCircuitCounters
	if err := v.counters.Lookup(id, &p); err != nil {
		return Counters{}, fmt.Errorf("reading counters of circuit %d: %w", id, err)
	}
	c := countersFromRaw(&p)
	if err := v.redirects.Lookup(id, &c.Redirected); err != nil {
		return Counters{}, fmt.Errorf("reading redirects of circuit %d: %w", id, err)
	}
	return c, nil
}

// CountersUpTo reads the counters of circuit ids 0 to n-1 in batches
// (one system call per 4096 ids), indexed by id.
func (v *View) CountersUpTo(n uint32) ([]Counters, error) {
	n = min(n, v.counters.MaxEntries())
	out := make([]Counters, 0, n)
	keys := make([]uint32, batchSize)
	vals := make([]bpf.BreakerCircuitCounters, batchSize)
	var cursor ebpf.MapBatchCursor
	for uint32(len(out)) < n {
		want := min(int(n)-len(out), batchSize)
		got, err := v.counters.BatchLookup(&cursor, keys[:want], vals[:want], nil)
		for i := range vals[:got] {
			out = append(out, countersFromRaw(&vals[i]))
		}
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, fmt.Errorf("reading counters: %w", err)
		}
		if got == 0 || err != nil {
			break
		}
	}
	return out, v.redirectsUpTo(out)
}

// redirectsUpTo fills in the Redirected counts of out, indexed by id, in
// batches.
func (v *View) redirectsUpTo(out []Counters) error {
	keys := make([]uint32, batchSize)
	vals := make([]uint64, batchSize)
	var cursor ebpf.MapBatchCursor
	for done := 0; done < len(out); {
		want := min(len(out)-done, batchSize)
		got, err := v.redirects.BatchLookup(&cursor, keys[:want], vals[:want], nil)
		for i, n := range vals[:got] {
			out[done+i].Redirected = n
		}
		done += got
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("reading redirects: %w", err)
		}
		if got == 0 || err != nil {
			break
		}
	}
	return nil
}

// ResetCounters zeroes the counters of circuit id, before the id is given
// to a new circuit.
func (k *Kernel) ResetCounters(id uint32) error {
	var zero bpf.BreakerCircuitCounters
	if err := k.objs.Counters.Put(id, &zero); err != nil {
		return fmt.Errorf("resetting counters of circuit %d: %w", id, err)
	}
	if err := k.objs.Redirects.Put(id, uint64(0)); err != nil {
		return fmt.Errorf("resetting redirects of circuit %d: %w", id, err)
	}
	return nil
}

// Stats are the kernel's global statistics, summed over CPUs.
type Stats struct {
	// EventsLost counts outcome records dropped because the ring buffer
	// was full.
	EventsLost uint64
	// FailsafeAllowed counts verdicts ignored because the heartbeat was
	// stale.
	FailsafeAllowed uint64
	// StorageFailed counts sockets that could not be observed (no socket
	// storage).
	StorageFailed uint64
	// RejectionsFull counts rejections whose cgroup was not recorded:
	// the rejections map was full.
	RejectionsFull uint64
}

// Stats reads the global statistics.
func (v *View) Stats() (Stats, error) {
	read := func(i bpf.BreakerStatIndex) (uint64, error) {
		var per []uint64
		if err := v.stats.Lookup(uint32(i), &per); err != nil {
			return 0, fmt.Errorf("reading stat %d: %w", i, err)
		}
		var sum uint64
		for _, v := range per {
			sum += v
		}
		return sum, nil
	}
	var s Stats
	var err error
	if s.EventsLost, err = read(bpf.BreakerStatIndexSTAT_EVENTS_LOST); err != nil {
		return s, err
	}
	if s.FailsafeAllowed, err = read(bpf.BreakerStatIndexSTAT_FAILSAFE_ALLOWED); err != nil {
		return s, err
	}
	if s.StorageFailed, err = read(bpf.BreakerStatIndexSTAT_STORAGE_FAILED); err != nil {
		return s, err
	}
	s.RejectionsFull, err = read(bpf.BreakerStatIndexSTAT_REJECTIONS_FULL)
	return s, err
}

// ProgramStats returns each attached program's run count and total run
// time. The kernel keeps them only while stats are enabled
// (kernel.bpf_stats_enabled, or ebpf.EnableStats).
func (k *Kernel) ProgramStats() (map[string]*ebpf.ProgramStats, error) {
	out := map[string]*ebpf.ProgramStats{}
	for _, h := range hooks {
		st, err := h.prog(&k.objs).Stats()
		if err != nil {
			return nil, fmt.Errorf("reading stats of %s: %w", h.name, err)
		}
		out[h.name] = st
	}
	return out, nil
}
