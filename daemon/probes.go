package daemon

import (
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// startPhase is what the start-up is doing, or "" once Run has begun.
func (d *Daemon) startPhase() string {
	if p := d.phase.Load(); p != nil {
		return *p
	}
	return ""
}

// setPhase says what the start-up does now ("" once it is over).
func (d *Daemon) setPhase(phase string) {
	if phase == "" {
		d.phase.Store(nil)
		return
	}
	d.phase.Store(&phase)
}

// Starting says what the start-up is doing, or "" once Run has begun
// (admin.Backend).
func (d *Daemon) Starting() string { return d.startPhase() }

// Live reports whether the heartbeat is fresh, and its age
// (admin.Backend).
func (d *Daemon) Live() (bool, time.Duration) { return d.healthy() }

// Ready reports whether the daemon runs with protection in place and the
// heartbeat written; when not, the problems the ground check found, if
// any (admin.Backend).
func (d *Daemon) Ready() (bool, any) {
	if d.ready.Load() && d.beat.last.Load() != 0 {
		return true, nil
	}
	if p := d.shownProblems.Load(); p != nil {
		return false, *p
	}
	return false, nil
}

// Metrics serves the Prometheus scrape of the daemon's registry
// (admin.Backend).
func (d *Daemon) Metrics() http.Handler {
	return promhttp.HandlerFor(d.metrics.reg, promhttp.HandlerOpts{})
}
