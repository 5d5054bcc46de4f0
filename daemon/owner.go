package daemon

import (
	"sync"

	"github.com/breakerd/breakerd/kube"
	"github.com/breakerd/breakerd/policy"
)

// stepOwner runs the engine's steps one at a time on one goroutine, the
// owner's: handling a batch of records, the tick, a reload, a resolution,
// an operator's change, a page of the admin API. The engine and what the
// daemon keeps beside it (the configuration, the classes, what names and
// Services resolved to, the fleet's follower, the close jobs' circuits)
// are touched only in those steps, so they need no lock, and no other
// goroutine can hold them up: the heartbeat, the probes and the metrics
// read what the owner published (engine.Summary, atomics), never wait for
// it.
//
// Before Run starts the owner, and once it has stopped, steps run on the
// caller's goroutine, one at a time: New's start-up and a test's checks
// after Run need no owner.
type stepOwner struct {
	jobs chan func()
	// mu is held while a step runs on its caller's goroutine, and while
	// running changes.
	mu      sync.Mutex
	running bool
	stopped chan struct{}
}

// do runs step on the owner's goroutine (or, with no owner running, on
// this one) and returns once it is done and what it changed is published
// for the metrics. A step must not call do: it would wait for itself.
func (d *Daemon) do(step func()) {
	o := &d.own
	o.mu.Lock()
	if !o.running {
		defer o.mu.Unlock()
		step()
		d.publish()
		return
	}
	stopped := o.stopped
	o.mu.Unlock()
	done := make(chan struct{})
	select {
	case o.jobs <- func() { step(); d.publish(); close(done) }:
		<-done
	case <-stopped:
		d.do(step) // the owner stopped first: run it here
	}
}

// shown is what the owner published after its last step for readers on
// other goroutines (the metrics' collectors), besides engine.Summary.
type shown struct {
	cfg      *policy.Config
	scope    *cgroupWatch
	link     *kube.Fleet
	followed int // circuits open by the fleet's quorum
}

// publish makes what the last step changed visible to the readers.
func (d *Daemon) publish() {
	if d.eng == nil {
		return
	}
	d.eng.Publish()
	s := &shown{cfg: d.cfg, scope: d.scope, link: d.fleet.link}
	if d.fleet.follower != nil {
		s.followed = d.fleet.follower.Count()
	}
	d.shown.Store(s)
}

// doErr is do for a step that can fail: it returns the step's error.
func (d *Daemon) doErr(step func() error) error {
	var err error
	d.do(func() { err = step() })
	return err
}

// runOwner serves steps until stop is closed; do runs them on the
// caller's goroutine afterwards.
func (d *Daemon) runOwner(stop <-chan struct{}) {
	o := &d.own
	for {
		select {
		case job := <-o.jobs:
			job()
		case <-stop:
			o.mu.Lock()
			o.running = false
			close(o.stopped)
			o.mu.Unlock()
			return
		}
	}
}

// startOwner makes the owner run on a goroutine of its own until stop is
// closed; the returned channel is closed once it has stopped.
func (d *Daemon) startOwner(stop <-chan struct{}) <-chan struct{} {
	o := &d.own
	o.mu.Lock()
	o.jobs, o.stopped, o.running = make(chan func()), make(chan struct{}), true
	o.mu.Unlock()
	done := make(chan struct{})
	go func() { defer close(done); d.runOwner(stop) }()
	return done
}
