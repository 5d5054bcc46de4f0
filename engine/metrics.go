package engine

import (
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// Counter is a count the engine adds to: a Prometheus counter in the
// daemon (prometheus.Counter has these methods), a plain number in tests.
type Counter interface {
	Inc()
	Add(float64)
}

// Observer takes one measurement: a Prometheus histogram in the daemon.
type Observer interface {
	Observe(float64)
}

// Metrics makes the series the engine counts in. The daemon implements it
// with its Prometheus vectors, so the engine counts without knowing how
// its counts are exported. A series is asked for once and kept (Series),
// so a record costs an add, not a label lookup.
type Metrics interface {
	// Outcome is the series of outcome (a maps.Outcome's name, or a
	// policy.ResponseKind's) of target's circuits of workload.
	Outcome(outcome, target, workload string) Counter
	// Handshake is the series of target's handshake durations, in
	// seconds.
	Handshake(target string) Observer
	// Transition is the count of transitions from, to, for reason, of
	// circuits of workload.
	Transition(from, to, reason, workload string) Counter
	// Refused is the count of target's new destinations left
	// unprotected (max_circuits reached with nothing to evict, or no
	// circuit id free).
	Refused(target string) Counter
	// Evicted is the count of idle closed dynamic circuits evicted.
	Evicted() Counter
	// VerdictWriteErrors is the count of verdict and limits writes that
	// failed.
	VerdictWriteErrors() Counter
	// LimitChanges is the count of the moves of target's adaptive
	// limits of kind (KindConnections, KindConnecting).
	LimitChanges(target, kind string) Counter
}

// Series are one target's outcome series of one workload's circuits,
// made on first use; every circuit of the target and workload holds the
// same Series.
type Series struct {
	target    string
	workload  string
	m         Metrics
	outcomes  [16]Counter                   // by maps.Outcome
	responses [policy.ResponseKinds]Counter // by policy.ResponseKind
	handshake Observer
}

// NewSeries returns the series of target's circuits of workload, made
// from m as they are first used.
func NewSeries(m Metrics, target, workload string) *Series {
	return &Series{target: target, workload: workload, m: m, handshake: m.Handshake(target)}
}

// Target is the series' target (AllTarget for dynamic circuits).
func (s *Series) Target() string { return s.target }

// Workload is the series' workload: policy.SharedWorkload, or an
// isolated workload's name.
func (s *Series) Workload() string { return s.workload }

// Outcome is the count of records of outcome o.
func (s *Series) Outcome(o maps.Outcome) Counter {
	if int(o) >= len(s.outcomes) {
		return s.m.Outcome(o.String(), s.target, s.workload)
	}
	c := s.outcomes[o]
	if c == nil {
		c = s.m.Outcome(o.String(), s.target, s.workload)
		s.outcomes[o] = c
	}
	return c
}

// Response is the count of responses of kind k.
func (s *Series) Response(k policy.ResponseKind) Counter {
	c := s.responses[k]
	if c == nil {
		c = s.m.Outcome(k.String(), s.target, s.workload)
		s.responses[k] = c
	}
	return c
}

// Handshake is the series of handshake durations, in seconds.
func (s *Series) Handshake() Observer { return s.handshake }
