package daemon

import (
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Responses: for a target with response options the kernel follows every
// connection's request/response turns (bpf/responses.h, cgroup_skb) and
// reports each response's first byte (maps.Response) and each connection
// that ended while a request awaited one (maps.NoResponse). Each turn is
// one call of the target's circuit; the handshake is not a call of its own
// (its failures still are). response_timeout is the daemon's: the kernel
// cannot time out by itself, so every tick the daemon reads the inflight
// map (one entry per socket with a request awaiting its first byte, with
// the request's start) and counts a request older than response_timeout
// as failed then. A late answer to it, or the connection's end, is not
// counted again (timedOut remembers the turn by its start).

// followsResponses reports whether some target of cfg has response options
// (only then are the response programs attached).
func followsResponses(cfg *policy.Config) bool {
	for _, t := range cfg.Targets {
		if t.Options.Responses.Followed() {
			return true
		}
	}
	return false
}

// setResponses attaches or detaches the response programs as cfg needs
// them. A request whose turn began before they were last attached is
// never counted (respSince): its socket may carry a stale turn. Called in
// a step of the owner.
func (d *Daemon) setResponses(cfg *policy.Config) {
	on := followsResponses(cfg)
	if on && !d.k.Responses() {
		d.eng.RespondingSince(maps.Now())
	}
	if err := d.k.SetResponses(on); err != nil {
		d.log.Error("response programs (responses are not followed until the next reload)", "err", err)
	}
}

// minSlowResponse is the shortest slow_response_duration of cfg (0: none).
func minSlowResponse(cfg *policy.Config) time.Duration {
	var m time.Duration
	for _, t := range cfg.Targets {
		if s := t.Options.Responses.SlowResponseDuration; s > 0 && (m == 0 || s < m) {
			m = s
		}
	}
	return m
}

// responseOptions adds a target's response options to its options in the
// API (only when it follows responses).
func responseOptions(m map[string]any, r *policy.ResponseOptions) {
	if !r.Followed() {
		return
	}
	m["slow_response_duration"] = r.SlowResponseDuration.String()
	m["response_timeout"] = r.ResponseTimeout.String()
	m["protocol"] = "tcp"
	if r.HTTP {
		m["protocol"] = "http"
		m["failure_statuses"] = r.FailureStatuses.String()
	}
	m["count_dropped"] = !r.IgnoreDropped
}

// flushAnswered has the kernel write out the successes counted for every
// batched circuit whose word holds some (engine.Unflushed), outside the
// owner's steps, so a circuit that went quiet has them read within a
// tick, after its earlier records.
func (d *Daemon) flushAnswered() {
	var ids []uint32
	d.do(func() { ids = d.eng.Unflushed() })
	if len(ids) == 0 {
		return
	}
	if err := d.kernel.FlushAnswered(ids); err != nil {
		d.do(func() {
			d.eng.ErrorEverySecond("answered-flush", "writing out counted successes (they stay counted for the next try)", "err", err)
		})
	}
}
