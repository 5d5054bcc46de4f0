package policy

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Algorithm is how an adaptive limit follows measured latency.
type Algorithm uint8

// The adaptive algorithms (0: the limit is static).
const (
	NoAlgorithm Algorithm = iota
	// Gradient2 (Netflix concurrency-limits): the ratio of a long-term
	// average latency to the last window's moves the limit, with a fixed
	// allowance of queueing and smoothing.
	Gradient2
	// Vegas (TCP Vegas, as Netflix concurrency-limits has it): the queue
	// the last window's latency implies over the lowest latency seen
	// moves the limit by steps that grow with log10 of the limit.
	Vegas
	// AIMD: additive increase while nothing is dropped, multiplicative
	// decrease when something is (a timeout, an overload status).
	AIMD
)

var algorithmNames = map[string]Algorithm{"gradient2": Gradient2, "vegas": Vegas, "aimd": AIMD}

// String is the algorithm's configuration name ("" for none).
func (a Algorithm) String() string {
	for k, v := range algorithmNames {
		if v == a {
			return k
		}
	}
	return ""
}

// Adaptive is the adaptive form of max_connections or max_connecting:
// the limit starts at Initial and follows latency within [Min, Max].
// Its zero value is a static limit.
type Adaptive struct {
	Algorithm         Algorithm
	Min, Initial, Max int
}

// On reports whether the limit is adaptive.
func (a Adaptive) On() bool { return a.Algorithm != NoAlgorithm }

// Clamp returns n within [Min, Max].
func (a Adaptive) Clamp(n int) int { return max(a.Min, min(a.Max, n)) }

// adaptiveInitial is `initial`'s default, clamped into [min, max]: the
// default of Netflix concurrency-limits.
const adaptiveInitial = 20

// maxLimit bounds a limit, static or adaptive.
const maxLimit = 10_000_000

// keyError is a problem with one key of an option's mapping: the decoder
// reports it under the option's path and that key.
type keyError struct {
	key string
	err error
}

func (e *keyError) Error() string { return e.key + ": " + e.err.Error() }
func (e *keyError) Unwrap() error { return e.err }

// setLimit sets a bulkhead limit from a number (static) or a mapping
// {adaptive: gradient2|vegas|aimd, min, initial, max} (adaptive; its
// static value is then initial, what the kernel enforces before the
// first move). Problems of the mapping's keys are keyErrors.
func setLimit(static *int, adaptive *Adaptive, r any) error {
	m, ok := r.(map[string]any)
	if !ok {
		*adaptive = Adaptive{}
		return setInt(static, r, 0, maxLimit)
	}
	var errs []error
	bad := func(key string, err error) { errs = append(errs, &keyError{key, err}) }
	a := Adaptive{Min: 1}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	initialSet := false
	for _, k := range keys {
		v := m[k]
		switch k {
		case "adaptive":
			s, _ := asString(v)
			alg, ok := algorithmNames[strings.ToLower(s)]
			if !ok {
				bad(k, fmt.Errorf("%v is not gradient2, vegas or aimd", v))
				continue
			}
			a.Algorithm = alg
		case "min":
			if err := setInt(&a.Min, v, 1, maxLimit); err != nil {
				bad(k, err)
			}
		case "initial":
			initialSet = true
			if err := setInt(&a.Initial, v, 1, maxLimit); err != nil {
				bad(k, err)
			}
		case "max":
			if err := setInt(&a.Max, v, 1, maxLimit); err != nil {
				bad(k, err)
			}
		default:
			bad(k, errors.New("unknown key (adaptive, min, initial, max)"))
		}
	}
	if _, ok := m["adaptive"]; !ok {
		bad("adaptive", errors.New("missing: name the algorithm (gradient2, vegas or aimd), or give a number for a static limit"))
	}
	if _, ok := m["max"]; !ok {
		bad("max", errors.New("missing: an adaptive limit needs a ceiling"))
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if a.Min > a.Max {
		return &keyError{"min", fmt.Errorf("%d is above max %d", a.Min, a.Max)}
	}
	if !initialSet {
		a.Initial = a.Clamp(adaptiveInitial)
	} else if a.Initial < a.Min || a.Initial > a.Max {
		return &keyError{"initial", fmt.Errorf("%d is not within min %d and max %d", a.Initial, a.Min, a.Max)}
	}
	*adaptive, *static = a, a.Initial
	return nil
}

// LimitWindow is how many samples (latencies and drops) an adaptive
// limit's window needs before the limit may move: fewer say nothing a
// single slow call would not outweigh.
const LimitWindow = 10

// Limiter is one adaptive limit: it is fed the latency of calls that show
// the destination's capacity (Sample) and the calls it dropped for want of
// it (Drop), and moves the limit (Update) once its window holds
// LimitWindow samples; the caller calls Update at most once a tick, so
// the limit moves at most once a tick. It keeps no clock: windows are
// counted in samples. The zero value is not ready: use NewLimiter.
type Limiter struct {
	spec  Adaptive
	limit float64 // the estimate; the limit is its integer part
	// The window being filled.
	n     int
	sum   time.Duration
	drops int
	// Gradient2: the long-term latency, an average of the first
	// longWarmup windows, then exponentially smoothed over longWindow.
	long  float64
	longN int
	// Vegas: the lowest latency seen (no load), and the samples since it
	// was last taken afresh.
	noLoad time.Duration
	probe  int
	// last is the last window's average latency (0: none yet).
	last time.Duration
}

// Tuning of the algorithms, as in Netflix concurrency-limits' defaults.
const (
	gradientTolerance = 1.0 // long/short at or above which nothing queues
	gradientQueue     = 4   // the limit's allowance of queueing
	gradientSmoothing = 0.2
	longWindow        = 600 // windows the long-term latency is smoothed over
	longWarmup        = 10  // windows averaged plainly first
	vegasProbe        = 30  // Vegas takes its no-load latency afresh after 30 × limit samples
	aimdBackoff       = 0.9
)

// NewLimiter returns a limiter following spec whose limit starts at
// start, clamped into [spec.Min, spec.Max] (spec.Initial when start is 0).
func NewLimiter(spec Adaptive, start int) *Limiter {
	if start == 0 {
		start = spec.Initial
	}
	return &Limiter{spec: spec, limit: float64(spec.Clamp(start))}
}

// Spec is what the limiter follows.
func (l *Limiter) Spec() Adaptive { return l.spec }

// Limit is the current limit.
func (l *Limiter) Limit() int { return int(l.limit) }

// Latency is the last window's average latency (0 before the first).
func (l *Limiter) Latency() time.Duration { return l.last }

// Reshape makes the limiter follow spec (a reload): the limit stays,
// clamped into the new bounds, and with another algorithm what was
// measured is forgotten.
func (l *Limiter) Reshape(spec Adaptive) {
	if spec.Algorithm != l.spec.Algorithm {
		*l = Limiter{limit: l.limit}
	}
	l.spec = spec
	l.limit = float64(spec.Clamp(int(l.limit)))
}

// Sample adds the latency of one call that showed capacity (a handshake,
// or a response that is not a refusal).
func (l *Limiter) Sample(d time.Duration) {
	if d <= 0 {
		d = time.Microsecond // a latency below the clock's resolution
	}
	l.n++
	l.sum += d
}

// Drop adds one call dropped for want of capacity (a timeout, an
// overload status).
func (l *Limiter) Drop() { l.drops++ }

// Pending is the number of samples in the window being filled.
func (l *Limiter) Pending() int { return l.n + l.drops }

// Update closes the window when it holds LimitWindow samples and moves the
// limit by it; inflight is how many calls are in flight now (the
// bulkhead's count): a limit twice that or more is not what holds calls
// back, and none of the algorithms raises it then. It reports the limit
// and whether it moved.
func (l *Limiter) Update(inflight int) (int, bool) {
	if l.n+l.drops < LimitWindow {
		return l.Limit(), false
	}
	var rtt time.Duration
	if l.n > 0 {
		rtt = l.sum / time.Duration(l.n)
		l.last = rtt
	}
	drops := l.drops
	samples := l.n
	l.n, l.sum, l.drops = 0, 0, 0
	before := l.Limit()
	limited := inflight*2 >= before // the limit holds calls back
	switch l.spec.Algorithm {
	case Gradient2:
		l.gradient2(rtt, limited)
	case Vegas:
		l.vegas(rtt, samples, drops, limited)
	case AIMD:
		l.aimd(drops > 0, limited)
	}
	l.limit = math.Max(float64(l.spec.Min), math.Min(float64(l.spec.Max), l.limit))
	return l.Limit(), l.Limit() != before
}

// gradient2 moves the limit by the gradient of the long-term latency over
// the window's: at or above 1 nothing queues and the limit grows by the
// queue allowance; below, it shrinks (by at most half), smoothed.
func (l *Limiter) gradient2(rtt time.Duration, limited bool) {
	if rtt == 0 {
		return // drops alone say nothing to gradient2
	}
	short := float64(rtt)
	if l.longN < longWarmup {
		l.longN++
		l.long += (short - l.long) / float64(l.longN)
	} else {
		f := 2.0 / (longWindow + 1)
		l.long = l.long*(1-f) + short*f
	}
	// Latency back to normal after a long overload: bring the long-term
	// average down faster than smoothing would.
	if l.long/short > 2 {
		l.long *= 0.9
	}
	if !limited {
		return
	}
	gradient := math.Max(0.5, math.Min(1, gradientTolerance*l.long/short))
	next := l.limit*gradient + gradientQueue
	l.limit = l.limit*(1-gradientSmoothing) + next*gradientSmoothing
}

// vegasStep is Vegas' unit of change at limit n: log10 of it, at least 1.
func vegasStep(n float64) float64 { return math.Max(1, math.Floor(math.Log10(n))) }

// vegas estimates the queue the window's latency implies over the lowest
// seen (limit × (1 − noLoad/rtt)) and keeps it between alpha and beta (3
// and 6 steps): no queue, grow by beta; a short one, grow by a step; a
// long one or a drop, shrink by a step. Netflix's Vegas decides on every
// sample; here the decision is made once per sample of the window (at
// most LimitWindow times), each on the window's average (a window with
// a drop shrinks the limit every time) and the limit the
// one before left, so a window moves the limit as far as its samples one
// by one would have.
func (l *Limiter) vegas(rtt time.Duration, samples, drops int, limited bool) {
	dropped := drops > 0
	l.probe += samples
	if rtt > 0 && float64(l.probe) >= vegasProbe*l.limit {
		// Take the no-load latency afresh now and then: the lowest one
		// seen may be from a faster time of the destination.
		l.probe, l.noLoad = 0, rtt
		return
	}
	if rtt > 0 && (l.noLoad == 0 || rtt < l.noLoad) {
		l.noLoad = rtt
		if !dropped {
			return
		}
	}
	for range min(samples+drops, LimitWindow) {
		step := vegasStep(l.limit)
		switch {
		case dropped:
			l.limit -= step
		case !limited || rtt == 0:
			return
		default:
			queue := math.Ceil(l.limit * (1 - float64(l.noLoad)/float64(rtt)))
			switch {
			case queue <= step:
				l.limit += 6 * step
				return
			case queue < 3*step:
				l.limit += step
				return
			case queue > 6*step:
				l.limit -= step
			default:
				return
			}
		}
		l.limit = math.Max(float64(l.spec.Min), math.Min(float64(l.spec.Max), l.limit))
	}
}

// aimd grows the limit by one while it holds calls back and none was
// dropped, and takes a tenth off when one was.
func (l *Limiter) aimd(dropped, limited bool) {
	switch {
	case dropped:
		l.limit = math.Floor(l.limit * aimdBackoff)
	case limited:
		l.limit++
	}
}

// addKeyErrors reports err under path, or each keyError in it under its
// key below path.
func (d *decoder) addKeyErrors(path string, err error) {
	var errs []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	} else {
		errs = []error{err}
	}
	for _, e := range errs {
		if ke, ok := e.(*keyError); ok {
			d.add(path+"."+ke.key, "%v", ke.err)
			continue
		}
		d.add(path, "%v", e)
	}
}

// checkAdaptive reports adaptive limits in `all`: each dynamic circuit
// would move its own limit every tick, and its metric has no target of
// its own.
func (d *decoder) checkAdaptive(path string, o *Options) {
	if o.AdaptiveConnections.On() {
		d.add(path+".max_connections", "an adaptive limit is a target's only; set it on the targets whose latency it follows")
	}
	if o.AdaptiveConnecting.On() {
		d.add(path+".max_connecting", "an adaptive limit is a target's only; set it on the targets whose latency it follows")
	}
}

// adaptiveReference is the configuration reference's section on adaptive
// limits.
var adaptiveReference = "\n## Adaptive limits\n\n" +
	"A static limit is right for one latency only. A target's `max_connections` or `max_connecting` may instead follow the destination's measured latency: " +
	"`max_connections: {adaptive: vegas, min: 4, initial: 20, max: 200}`. `adaptive` names the algorithm (required), `max` the ceiling (required), `min` the floor (default 1), `initial` where the limit starts (default 20, within `min` and `max`). " +
	"The kernel enforces the current limit exactly as a static one (the limits entry is rewritten when it moves); the daemon moves it at most once a tick, when at least " + strconv.Itoa(LimitWindow) + " calls have been measured since the last move. " +
	"`gradient2` and `vegas` follow latency, as Netflix's concurrency-limits has them: `gradient2` shrinks the limit while the last calls' average latency is above a long-term average (smoothed over 600 moves) and grows it by 4 while it is not; " +
	"`vegas` estimates the queue the latency implies over the lowest latency seen (limit × (1 − lowest/latest)) and keeps it between 3 and 6 steps of log10(limit), taking the lowest latency afresh every 30 × limit calls. " +
	"`aimd` follows drops only: one less tenth of the limit when a call was dropped, one more otherwise. None of them raises a limit that is not what holds calls back (fewer than half of it in flight). " +
	"**What is measured**: the handshake time of each connection, or, on a target that follows responses (*Responses*), each response's time instead. " +
	"Drops are connects that time out (`connect_timeout`) and, with responses, `response_timeout` and the overload statuses 429, 503 and 504. " +
	"What says nothing of the destination's capacity is not fed to the limit: connects breakerd itself turned away (the circuit open, a bulkhead full), refused, reset and unreachable connects, 4xx and other 5xx responses. " +
	"A target whose limit is adaptive has every response recorded (the kernel's batching of ordinary successes is off for it, so each response costs a record). " +
	"With workloads, each workload's bulkhead of a shared circuit is held to the circuit's current limit, and the limit moves with the fullest of them. " +
	"`/v1/circuits` shows each adaptive limit under `adaptive_limits` (the current limit, its bounds, the last window's latency and the moves), `breakerctl status` and `top` show the current limit, and metrics have `breakerd_limit{target,kind}` (summed over a target's circuits; `kind` is `max_connections` or `max_connecting`) and `breakerd_limit_changes_total{target,kind}`. " +
	"**Across reloads and restarts** the current limit is kept: a reload keeps it (clamped into new bounds; another algorithm starts its measurements afresh; a limit made adaptive starts at `initial`), and a restarted daemon (SIGTERM, SIGKILL, or a second start on the same pins) takes it back from the pinned limits entry the kernel was enforcing, clamped into the configuration's bounds, with its measurements begun afresh. " +
	"Adaptive limits are a target's only (an error in `all`).\n\n"
