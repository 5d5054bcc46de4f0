package policy

import (
	"fmt"
	"math"
	"net/netip"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Options are the settings of one circuit: those of `all`, or of one
// target. A target's block stands in for `all`: an option it leaves out takes
// the built-in default below, never the value from `all`.
type Options struct {
	// FailureRateThreshold opens the circuit when the share of failed calls
	// in the window reaches it (with at least MinRequests calls).
	FailureRateThreshold float64
	// WindowSize is the count-based window: the last N calls.
	WindowSize int
	// WindowDuration, when not zero, makes the window time-based: the calls
	// of the last WindowDuration, in WindowBuckets buckets.
	WindowDuration time.Duration
	// MinRequests is how many calls the window needs before a rate counts.
	MinRequests int
	// ConsecutiveFailures opens the circuit after that many failures in a
	// row, whatever the window says (0: off).
	ConsecutiveFailures int
	// SlowCallDuration is the handshake time from which a call is slow.
	SlowCallDuration time.Duration
	// SlowCallRateThreshold opens the circuit when the share of slow calls
	// reaches it.
	SlowCallRateThreshold float64
	// ConnectTimeout is how long a connection may stay connecting before the
	// daemon counts it as timed out.
	ConnectTimeout time.Duration
	// OpenDuration is how long the circuit stays open after its first trip.
	OpenDuration time.Duration
	// OpenDurationMultiplier grows the open duration on each trip that
	// follows a failed half-open.
	OpenDurationMultiplier float64
	// MaxOpenDuration caps the grown open duration (before jitter).
	MaxOpenDuration time.Duration
	// Jitter adds up to this share of the open duration, at random, so a
	// fleet does not probe in step.
	Jitter float64
	// HalfOpenProbes is how many connections a half-open circuit admits.
	HalfOpenProbes int
	// HalfOpenSuccessThreshold is how many probes must succeed to close.
	HalfOpenSuccessThreshold int
	// ProbeTimeout is how long a half-open round lasts: then it reopens
	// when none of its probes succeeded, else a new round begins.
	ProbeTimeout time.Duration
	// RejectErrno is the errno a rejected connect sees.
	RejectErrno syscall.Errno
	// ResetFailureWindow: an RST on an established connection counts as a
	// failure only when it comes within this time of the connection's
	// connect(); a later reset counts as nothing (0: resets never count).
	ResetFailureWindow time.Duration
	// CountAbandoned counts a connect the application gave up on after
	// SlowCallDuration as a failure instead of as slow.
	CountAbandoned bool
	// MaxConnections caps connecting plus established sockets from the
	// protected cgroup to the circuit's destinations (0: off). A bulkhead,
	// enforced by the kernel in connect.
	MaxConnections int
	// MaxConnecting caps the circuit's sockets still in SYN_SENT (0: off).
	MaxConnecting int
	// AdaptiveConnections and AdaptiveConnecting, when on, make
	// MaxConnections and MaxConnecting follow measured latency (their
	// static values are then the initial limits; adaptive.go).
	AdaptiveConnections Adaptive
	AdaptiveConnecting  Adaptive
	// BulkheadRejectErrno is what a connect over a bulkhead limit sees.
	BulkheadRejectErrno syscall.Errno
	// CloseEstablished: when the circuit opens, the daemon closes the
	// protected processes' established TCP connections to its
	// destinations, so a connection pool reconnects and is rejected.
	CloseEstablished bool
	// Responses are a target's response options (responses.go).
	Responses ResponseOptions
	// Fleet is the `fleet` block (fleet.go): the circuit's state is
	// shared with the other nodes.
	Fleet FleetOptions
	// SlowStart is the `slow_start` block (slowstart.go): the ramp the
	// kernel applies when the circuit closes after being open.
	SlowStart SlowStartOptions
	// Fallback is where the kernel sends the circuit's connects while it
	// rejects them (fallback.go); the zero value is none. Targets only.
	Fallback netip.AddrPort
	// FallbackService is a fallback named by a Kubernetes Service instead
	// (at most one of the two is set).
	FallbackService ServiceFallback
}

// HasLimits reports whether the options set a bulkhead limit.
func (o *Options) HasLimits() bool { return o.MaxConnections > 0 || o.MaxConnecting > 0 }

// WindowBuckets is the number of buckets of a time-based window.
const WindowBuckets = 10

// optionField describes one option: its key, default, unit and meaning.
// The table is the single source of the decoder, the defaults and the
// configuration reference.
type optionField struct {
	key  string
	def  string
	unit string
	doc  string
	set  func(o *Options, raw any) error
}

var optionFields = []optionField{
	{"failure_rate_threshold", "0.5", "ratio in (0, 1]", "Open when the share of failed calls in the window reaches this (with at least `min_requests` calls).",
		func(o *Options, r any) error { return setRatio(&o.FailureRateThreshold, r, false) }},
	{"window_size", "20", "calls", "Count-based window: the last N calls. Ignored when `window_duration` is set.",
		func(o *Options, r any) error { return setInt(&o.WindowSize, r, 1, 100000) }},
	{"window_duration", "0s", "duration", "When not 0, the window is time-based: the calls of the last `window_duration`, kept in 10 buckets (constant memory).",
		func(o *Options, r any) error { return setDuration(&o.WindowDuration, r, 0, 24*time.Hour) }},
	{"min_requests", "10", "calls", "Calls the window needs before a failure or slow-call rate can open the circuit.",
		func(o *Options, r any) error { return setInt(&o.MinRequests, r, 1, 100000) }},
	{"consecutive_failures", "5", "calls", "Open after this many failures in a row, whatever the rates (Linkerd's failure accrual). 0 turns it off.",
		func(o *Options, r any) error { return setInt(&o.ConsecutiveFailures, r, 0, 100000) }},
	{"slow_call_duration", "1s", "duration", "A handshake that takes at least this long is a slow call.",
		func(o *Options, r any) error { return setDuration(&o.SlowCallDuration, r, time.Millisecond, time.Hour) }},
	{"slow_call_rate_threshold", "1", "ratio in (0, 1]", "Open when the share of slow calls in the window reaches this.",
		func(o *Options, r any) error { return setRatio(&o.SlowCallRateThreshold, r, false) }},
	{"connect_timeout", "3s", "duration", "A connection still connecting after this counts as timed out then, not when the kernel gives up (~127 s).",
		func(o *Options, r any) error {
			return setDuration(&o.ConnectTimeout, r, time.Millisecond, 10*time.Minute)
		}},
	{"open_duration", "10s", "duration", "How long the circuit stays open after a trip, before probing.",
		func(o *Options, r any) error { return setDuration(&o.OpenDuration, r, time.Millisecond, 24*time.Hour) }},
	{"open_duration_multiplier", "2", "factor ≥ 1", "The open duration grows by this factor on each trip that follows a failed half-open; it returns to `open_duration` after a clean close.",
		func(o *Options, r any) error { return setFloat(&o.OpenDurationMultiplier, r, 1, 100) }},
	{"max_open_duration", "5m", "duration", "Cap of the grown open duration (jitter comes on top).",
		func(o *Options, r any) error {
			return setDuration(&o.MaxOpenDuration, r, time.Millisecond, 7*24*time.Hour)
		}},
	{"jitter", "0.1", "ratio in [0, 1]", "Up to this share of the open duration is added at random, so a fleet does not probe in step.",
		func(o *Options, r any) error { return setRatio(&o.Jitter, r, true) }},
	{"half_open_probes", "1", "connections", "Connections a half-open circuit admits per round (one budget per circuit, whatever its scope), handed out exactly by the kernel. TCP only.",
		func(o *Options, r any) error { return setInt(&o.HalfOpenProbes, r, 1, 1000) }},
	{"half_open_success_threshold", "1", "connections", "Successful probes needed to close, counted across rounds; one failed probe reopens.",
		func(o *Options, r any) error { return setInt(&o.HalfOpenSuccessThreshold, r, 1, 1000) }},
	{"probe_timeout", "5s", "duration", "How long a half-open round lasts once its first probe is admitted: then, with no successful probe in the round, the circuit reopens; with some, a new round begins. See *Half-open rounds*.",
		func(o *Options, r any) error { return setDuration(&o.ProbeTimeout, r, time.Millisecond, time.Hour) }},
	{"reject_errno", "ECONNREFUSED", "errno name", "What a rejected connect sees (needs bpf_set_retval, kernel 5.18+; EPERM before). One of " + strings.Join(errnoNames(), ", ") + ".",
		func(o *Options, r any) error { return setErrno(&o.RejectErrno, r) }},
	{"reset_failure_window", "5s", "duration", "An RST on an established connection counts as a failure only when it comes within this time of the connection's `connect()` (handshake included): a service that accepts and then resets is failing, while a pooled connection reset later by an idle timeout (a NAT, a load balancer) or by the peer's restart counts as nothing. 0: resets never count. breakerd does not see requests, so it cannot tell whether one was outstanding.",
		func(o *Options, r any) error { return setDuration(&o.ResetFailureWindow, r, 0, time.Hour) }},
	{"count_abandoned", "false", "bool", "A connect the application abandons after `slow_call_duration` counts as a failure instead of as slow (before that it counts as nothing).",
		func(o *Options, r any) error { return setBool(&o.CountAbandoned, r) }},
	{"max_connections", "0", "sockets", "Bulkhead: at most this many connecting plus established sockets from the protected cgroup to the circuit's destinations (service scope: the whole target), counted exactly by the kernel and enforced in connect. 0 turns it off. Or adaptive, following measured latency: `{adaptive: gradient2 | vegas | aimd, min, initial, max}` (targets only; see *Adaptive limits*).",
		func(o *Options, r any) error { return setLimit(&o.MaxConnections, &o.AdaptiveConnections, r) }},
	{"max_connecting", "0", "sockets", "Bulkhead: at most this many sockets still connecting (SYN_SENT), Envoy's pending requests. 0 turns it off. Adaptive as `max_connections` can be.",
		func(o *Options, r any) error { return setLimit(&o.MaxConnecting, &o.AdaptiveConnecting, r) }},
	{"bulkhead_reject_errno", "EAGAIN", "errno name", "What a connect over a bulkhead limit sees: the overload errno, distinct from `reject_errno`, and counted apart in metrics. Bulkhead rejections never enter the failure window.",
		func(o *Options, r any) error { return setErrno(&o.BulkheadRejectErrno, r) }},
	{"close_established", "false", "bool", "When the circuit opens (from closed or half-open, or forced open), close the established TCP connections protected processes hold to its destinations, so a keep-alive pool reconnects and is rejected in `connect()`; with a `fallback`, when the circuit closes again, close the connections it redirected to the fallback, so the pool reconnects to the target. TCP only. See *Closing established connections*.",
		func(o *Options, r any) error { return setBool(&o.CloseEstablished, r) }},
}

// DefaultOptions returns the built-in defaults.
func DefaultOptions() Options {
	var o Options
	for _, f := range optionFields {
		if err := f.set(&o, f.def); err != nil {
			panic(fmt.Sprintf("default of %s: %v", f.key, err))
		}
	}
	return o
}

var errnos = map[string]syscall.Errno{
	"ECONNREFUSED":  syscall.ECONNREFUSED,
	"EHOSTUNREACH":  syscall.EHOSTUNREACH,
	"ENETUNREACH":   syscall.ENETUNREACH,
	"ETIMEDOUT":     syscall.ETIMEDOUT,
	"ECONNRESET":    syscall.ECONNRESET,
	"ECONNABORTED":  syscall.ECONNABORTED,
	"EPERM":         syscall.EPERM,
	"EACCES":        syscall.EACCES,
	"EAGAIN":        syscall.EAGAIN,
	"ENOBUFS":       syscall.ENOBUFS,
	"EADDRNOTAVAIL": syscall.EADDRNOTAVAIL,
	"EBUSY":         syscall.EBUSY,
}

func errnoNames() []string {
	var n []string
	for k := range errnos {
		n = append(n, k)
	}
	sort.Strings(n)
	return n
}

// ErrnoName returns the configuration name of e.
func ErrnoName(e syscall.Errno) string {
	for k, v := range errnos {
		if v == e {
			return k
		}
	}
	return strconv.Itoa(int(e))
}

// The setters accept the YAML-native type or a string (environment
// variables arrive as strings), and say what was wrong.

func asString(r any) (string, bool) {
	s, ok := r.(string)
	return strings.TrimSpace(s), ok
}

func toFloat(r any) (float64, error) {
	switch v := r.(type) {
	case int:
		return float64(v), nil
	case int64:
		return float64(v), nil
	case float64:
		return v, nil
	case string:
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil {
			return 0, fmt.Errorf("%q is not a number", v)
		}
		return f, nil
	}
	return 0, fmt.Errorf("%v is a %T, not a number", r, r)
}

func setRatio(dst *float64, r any, zeroOK bool) error {
	f, err := toFloat(r)
	if err != nil {
		return err
	}
	if math.IsNaN(f) || f > 1 || f < 0 || (!zeroOK && f == 0) {
		if zeroOK {
			return fmt.Errorf("%v is not in [0, 1]", f)
		}
		return fmt.Errorf("%v is not in (0, 1]", f)
	}
	*dst = f
	return nil
}

func setFloat(dst *float64, r any, lo, hi float64) error {
	f, err := toFloat(r)
	if err != nil {
		return err
	}
	if math.IsNaN(f) || f < lo || f > hi {
		return fmt.Errorf("%v is not in [%v, %v]", f, lo, hi)
	}
	*dst = f
	return nil
}

func setInt(dst *int, r any, lo, hi int) error {
	f, err := toFloat(r)
	if err != nil {
		return err
	}
	if f != math.Trunc(f) {
		return fmt.Errorf("%v is not a whole number", f)
	}
	if f < float64(lo) || f > float64(hi) {
		// %g would write 1048577 as 1.048577e+06.
		return fmt.Errorf("%s is not in [%d, %d]", strconv.FormatFloat(f, 'f', -1, 64), lo, hi)
	}
	*dst = int(f)
	return nil
}

func setDuration(dst *time.Duration, r any, lo, hi time.Duration) error {
	s, ok := asString(r)
	if !ok {
		if f, err := toFloat(r); err == nil && f == 0 {
			s = "0s"
		} else {
			return fmt.Errorf("%v is not a duration (write it like 30s or 250ms)", r)
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is not a duration (write it like 30s or 250ms)", s)
	}
	if d != 0 && (d < lo || d > hi) || d < 0 || (d == 0 && lo > 0) {
		return fmt.Errorf("%v is not in [%v, %v]", d, lo, hi)
	}
	*dst = d
	return nil
}

func setBool(dst *bool, r any) error {
	switch v := r.(type) {
	case bool:
		*dst = v
		return nil
	case string:
		b, err := strconv.ParseBool(strings.TrimSpace(v))
		if err != nil {
			return fmt.Errorf("%q is not true or false", v)
		}
		*dst = b
		return nil
	}
	return fmt.Errorf("%v is a %T, not true or false", r, r)
}

func setErrno(dst *syscall.Errno, r any) error {
	s, ok := asString(r)
	if !ok {
		return fmt.Errorf("%v is not an errno name", r)
	}
	e, ok := errnos[strings.ToUpper(s)]
	if !ok {
		return fmt.Errorf("unknown errno %q (one of %s)", s, strings.Join(errnoNames(), ", "))
	}
	*dst = e
	return nil
}
