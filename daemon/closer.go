package daemon

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// close_established: when a circuit whose options ask for it opens, the
// protected processes' established TCP connections to its destinations
// are closed (maps.Closer), so a keep-alive pool reconnects and is
// rejected in connect(). The verdict is written first, in the event loop
// (apply, Force); the pass itself runs on a goroutine of its own (a pass
// enters every network namespace of the protected processes and takes
// milliseconds), which takes every queued circuit in one pass, so the
// event loop never waits for it. Nothing of this runs for a circuit
// without the option, nor on any healthy path: the kernel iterator runs
// only when the daemon reads it.
//
// What triggers a pass: a transition the running daemon makes into open
// or forced open from a state that is neither (closed → open, half-open →
// open, closed or half-open → forced open, by the state machine, the API
// or a reload's `state`), and a circuit made forced open after start-up.
// Not a circuit found open at start-up (adopted from the pinned verdicts,
// or forced open by the configuration or a kept override): its
// connections were closed when it opened, and whatever connected since
// was a probe the kernel admitted or was made before a restart and is
// left alone. Not half-open: the probes a half-open circuit admits are
// never closed while it is half-open (they are closed if it reopens).
//
// A circuit with a fallback that stops rejecting (open, half-open, forced
// or fleet open → closed, forced closed or disabled) runs a returning
// pass: the connections its connects were redirected to the fallback
// with, still connected there, are closed, so a pool reconnects to the
// recovered destination instead of staying on the fallback for as long as
// it keeps its connections. Only the iterator can tell them (it reads
// the socket's origins storage); with sock_diag they stay, said once.

// closeJob is one opened (or, returning, closed) circuit waiting for its
// pass.
type closeJob struct {
	circuit, target, workload string
	dests                     []maps.Dest
	workloads                 maps.CloseWorkloads
	at                        time.Time // the transition's time, to find its event
	// returning: the circuit closed; the pass closes the connections it
	// sent to its fallback (maps.Closer.CloseReturning).
	returning bool
}

// passKind is what one run of the closer does: a mode and a way to class
// sockets.
type passKind struct {
	returning bool
	workloads maps.CloseWorkloads
}

const closeQueue = 4096

// ensureCloser prepares the close pass when the configuration asks for it
// (once; a later configuration without the option keeps it, idle). Used
// in a step of the owner.
func (d *Daemon) ensureCloser(cfg *policy.Config) {
	if d.closer != nil || !wantsClose(cfg) {
		return
	}
	d.closer = d.k.NewCloser(d.opts.CloseMechanisms...)
	d.closeMech.Store(d.closer.Mechanism())
	reach, missing := maps.ProbeCloseReach()
	d.metrics.closeMechanism.WithLabelValues(string(d.closer.Mechanism()), string(reach)).Set(1)
	if d.closer.Mechanism() == maps.CloseNone {
		d.log.Error("close_established is configured, but no way to close established connections is available (none this kernel offers, or none --close-mechanism allows): they stay open when a circuit opens (new connects are still rejected)",
			"reason", d.closer.Reason())
		return
	}
	// The kernel can; whether these privileges reach the protected
	// processes' network namespaces is said as plainly (maps/closereach.go).
	switch reach {
	case maps.ReachOwn:
		d.log.Error("close_established is configured, but with these privileges a close pass can enter no network namespace but breakerd's own: connections of processes in any other stay open when a circuit opens (new connects are still rejected); in Kubernetes, add the close-established component (deploy/components/close-established)",
			"mechanism", string(d.closer.Mechanism()), "namespaces", string(reach), "missing", strings.Join(missing, "; "))
	case maps.ReachSome:
		d.log.Warn("close_established ready, but without CAP_SYS_PTRACE a close pass cannot enter the network namespaces of processes of other users or with capabilities breakerd lacks: their connections stay open when a circuit opens",
			"mechanism", string(d.closer.Mechanism()), "namespaces", string(reach), "missing", strings.Join(missing, "; "))
	default:
		d.log.Info("close_established ready", "mechanism", string(d.closer.Mechanism()), "namespaces", string(reach), "fallback_reason", d.closer.Reason())
	}
}

func wantsClose(cfg *policy.Config) bool {
	if cfg.All.CloseEstablished {
		return true
	}
	for _, t := range cfg.Targets {
		if t.Options.CloseEstablished {
			return true
		}
	}
	return false
}

// closeWorkloads is how a pass classes sockets under cfg, as the kernel
// programs do (the settings' Scoped and Classes).
func closeWorkloads(cfg *policy.Config) maps.CloseWorkloads {
	switch {
	case cfg.Scoped():
		return maps.CloseScoped
	case cfg.Classed():
		return maps.CloseClassed
	}
	return maps.CloseUnclassed
}

func isOpen(s policy.State) bool { return s == policy.Open || s == policy.ForcedOpen }

// closePasses queues the close passes c's transition from from to to
// asks for: opened's and returned's. Used in a step of the owner.
func (d *Daemon) closePasses(c *circuit, from, to policy.State, at time.Time) {
	d.opened(c, from, to, at)
	d.returned(c, from, to, at)
}

// returned queues c's returning pass when it has just stopped rejecting,
// has a fallback and asks for close_established. Used in a step of the
// owner.
func (d *Daemon) returned(c *circuit, from, to policy.State, at time.Time) {
	o := c.Machine.Options()
	if !from.Rejects() || to.Rejects() || !o.CloseEstablished || !o.HasFallback() || d.runCtx == nil {
		return
	}
	if d.closer == nil || !d.closer.CanReturn() {
		if !d.cannotReturnSaid {
			d.cannotReturnSaid = true
			mech := maps.CloseNone
			if d.closer != nil {
				mech = d.closer.Mechanism()
			}
			d.log.Warn("circuit closed; connections redirected to its fallback stay there until their clients close them: only bpf_sock_destroy can tell them (said once)",
				"circuit", c.Name(), "mechanism", string(mech))
		}
		return
	}
	d.queueClose(closeJob{circuit: c.Name(), target: c.Target(), workload: c.Workload(), dests: slices.Clone(c.Dests()), workloads: closeWorkloads(d.cfg), at: at, returning: true})
}

// queueClose hands j to the close goroutine.
func (d *Daemon) queueClose(j closeJob) {
	select {
	case d.closeJobs <- j:
	default:
		d.log.Error("close pass queue full; established connections of this circuit stay open", "circuit", j.circuit, "returning", j.returning)
	}
}

// opened queues c's close pass when it has just opened (from a state that
// does not reject) and asks for it. Used in a step of the owner.
func (d *Daemon) opened(c *circuit, from, to policy.State, at time.Time) {
	if !isOpen(to) || isOpen(from) || !c.Machine.Options().CloseEstablished || d.runCtx == nil {
		return
	}
	if d.eng.Unenforced(c) {
		// New connects are let through: closing the established ones
		// would only make them reconnect.
		d.log.Warn("circuit opened but is not enforced; its established connections are left open", "circuit", c.Name())
		return
	}
	if d.closer == nil || d.closer.Mechanism() == maps.CloseNone {
		d.log.Warn("circuit opened; this kernel cannot close its established connections (see the close_established start-up line)", "circuit", c.Name())
		return
	}
	d.queueClose(closeJob{circuit: c.Name(), target: c.Target(), workload: c.Workload(), dests: slices.Clone(c.Dests()), workloads: closeWorkloads(d.cfg), at: at})
}

// closeLoop runs the queued passes until ctx ends.
func (d *Daemon) closeLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case j := <-d.closeJobs:
			batch := []closeJob{j}
		drain:
			for {
				select {
				case j := <-d.closeJobs:
					batch = append(batch, j)
				default:
					break drain
				}
			}
			d.runClose(batch)
		}
	}
}

// runClose runs one pass for every job of batch whose circuit is still
// as its transition left it (one that opened and closed again meanwhile
// is skipped: its connections are healthy ones; one that closed and
// opened again too: its redirects are current), and reports what each
// closed.
func (d *Daemon) runClose(batch []closeJob) {
	var closer *maps.Closer
	type owned struct {
		returning bool
		dst       maps.Dest
	}
	owner := map[owned]int{}
	dests := map[passKind][]maps.Dest{}
	d.do(func() {
		closer = d.closer
		for i, j := range batch {
			c, ok := d.eng.Get(j.circuit)
			if !ok || (j.returning && c.Machine.State().Rejects()) || (!j.returning && !isOpen(c.Machine.State())) {
				batch[i].dests = nil
				continue
			}
			kind := passKind{returning: j.returning, workloads: j.workloads}
			for _, dst := range j.dests {
				if at, _ := d.eng.At(dst); at != c {
					continue // it moved to another circuit since the job was queued
				}
				o := owned{j.returning, dst}
				if _, dup := owner[o]; !dup {
					dests[kind] = append(dests[kind], dst)
				}
				owner[o] = i
			}
		}
	})
	counts := map[owned]maps.CloseCount{}
	var stats maps.PassStats
	for kind, ds := range dests {
		run := closer.Close
		if kind.returning {
			run = closer.CloseReturning
		}
		got, st, err := run(ds, kind.workloads)
		if err != nil {
			d.log.Warn("closing established connections", "returning", kind.returning, "err", err)
		}
		for dst, n := range got {
			counts[owned{kind.returning, dst}] = n
		}
		stats.Namespaces = max(stats.Namespaces, st.Namespaces)
		stats.Skipped = max(stats.Skipped, st.Skipped)
		stats.Hidden = max(stats.Hidden, st.Hidden)
		stats.Unreadable = max(stats.Unreadable, st.Unreadable)
		stats.Duration += st.Duration
	}
	if stats.Hidden > 0 || stats.Unreadable > 0 {
		d.log.Warn("the close pass could not find the network namespaces of some processes below the cgroup: their connections stay open (see the close_established start-up line)",
			"hidden", stats.Hidden, "unreadable", stats.Unreadable, "namespaces", stats.Namespaces)
	} else if stats.Namespaces == 0 && stats.Skipped == 0 {
		d.log.Warn("the close pass found no process below the cgroup")
	}
	closed, failed := make([]uint64, len(batch)), make([]uint64, len(batch))
	for o, n := range counts {
		i := owner[o]
		closed[i] += uint64(n.Closed)
		failed[i] += uint64(n.Failed)
	}
	d.do(func() {
		for i, j := range batch {
			if j.dests == nil {
				continue
			}
			result := "closed"
			if j.returning {
				result = "returned"
			}
			d.metrics.closed.WithLabelValues(j.target, j.workload, result).Add(float64(closed[i]))
			d.metrics.closed.WithLabelValues(j.target, j.workload, "failed").Add(float64(failed[i]))
			if c, ok := d.eng.Get(j.circuit); ok {
				c.AddClosedEstablished(closed[i])
			}
			d.events.noteClosed(j.circuit, j.at, closed[i])
		}
	})
	for i, j := range batch {
		switch {
		case j.dests == nil && j.returning:
			d.log.Info("circuit rejects again; the connections it sent to its fallback are left alone", "circuit", j.circuit)
		case j.dests == nil:
			d.log.Info("circuit no longer open; its established connections are left alone", "circuit", j.circuit)
		default:
			msg := "closed established connections"
			if j.returning {
				msg = "closed connections redirected to the fallback"
			}
			d.log.Info(msg, "circuit", j.circuit, "target", j.target, "workload", j.workload,
				"closed", closed[i], "failed", failed[i], "mechanism", string(closer.Mechanism()),
				"namespaces", stats.Namespaces, "pass", stats.Duration.Round(time.Microsecond).String())
		}
	}
}
