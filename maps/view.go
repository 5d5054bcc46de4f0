package maps

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
)

// View reads breakerd's maps: the verdicts, settings, counters and stats.
// A Kernel is a View of the maps it loaded; OpenPinned gives a read-only
// View of pinned maps without loading any program (breakerctl inspect,
// with or without a daemon).
type View struct {
	verdicts, config, counters, stats, limits, bulk, budgets, overrides *ebpf.Map
	workloads, inflight, rejections, respPorts, redirects               *ebpf.Map
	closers                                                             []*ebpf.Map
}

func viewOf(o *bpf.BreakerObjects) View {
	return View{verdicts: o.Verdicts, config: o.Config, counters: o.Counters, stats: o.Stats, limits: o.Limits, bulk: o.Bulk, budgets: o.ProbeBudgets, overrides: o.Overrides, workloads: o.Workloads, inflight: o.Inflight, rejections: o.Rejections, respPorts: o.RespPorts, redirects: o.Redirects}
}

// OpenPinned opens the pinned maps under dir (the base directory, like
// DefaultDir; the layout version is added) read-only.
func OpenPinned(dir string) (*View, error) {
	pins := PinDir(dir)
	v := &View{}
	for _, m := range []struct {
		name string
		dst  **ebpf.Map
	}{{bpf.BreakerMapVerdicts, &v.verdicts}, {bpf.BreakerMapConfig, &v.config}, {bpf.BreakerMapCounters, &v.counters}, {bpf.BreakerMapStats, &v.stats}, {bpf.BreakerMapLimits, &v.limits}, {bpf.BreakerMapBulk, &v.bulk}, {bpf.BreakerMapProbeBudgets, &v.budgets}, {bpf.BreakerMapOverrides, &v.overrides}, {bpf.BreakerMapWorkloads, &v.workloads}, {bpf.BreakerMapRejections, &v.rejections}, {bpf.BreakerMapRespPorts, &v.respPorts}, {bpf.BreakerMapRedirects, &v.redirects}} {
		mp, err := ebpf.LoadPinnedMap(filepath.Join(pins, m.name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			v.Close()
			return nil, fmt.Errorf("opening pinned map %s (is breakerd installed with --bpffs %s?): %w", m.name, dir, err)
		}
		*m.dst = mp
		v.closers = append(v.closers, mp)
	}
	return v, nil
}

// Close releases a View from OpenPinned; on a Kernel's View it does
// nothing (Kernel.Close does).
func (v *View) Close() error {
	var errs []error
	for _, m := range v.closers {
		errs = append(errs, m.Close())
	}
	v.closers = nil
	return errors.Join(errs...)
}
