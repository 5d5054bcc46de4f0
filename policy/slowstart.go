package policy

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// Bounds of the `slow_start` block.
const (
	MinSlowStart           = 100 * time.Millisecond
	MaxSlowStart           = time.Hour
	DefaultSlowStartFloor  = 0.1
	MaxSlowStartAggression = 10
)

// SlowStartOptions are a circuit's `slow_start` block: when it closes
// after being open (its probes succeeded), the kernel admits a share of
// new TCP connects that rises from Floor to all over Duration, and turns
// the rest away with the overload errno (BulkheadRejectErrno), counted
// apart and never entering the failure window. A zero Duration is off.
type SlowStartOptions struct {
	// Duration is the ramp's length (0: off).
	Duration time.Duration
	// Floor is the share admitted when the ramp begins.
	Floor float64
	// Aggression shapes the ramp as Envoy's slow_start_config does: the
	// share at x (the part of Duration elapsed) is max(Floor,
	// x^(1/Aggression)); 1 is linear, above 1 rises fast early, below 1
	// late.
	Aggression float64
}

// On reports whether slow start is configured.
func (s SlowStartOptions) On() bool { return s.Duration > 0 }

// Share is the share of new connects admitted at x in [0, 1], the part
// of the ramp elapsed: max(Floor, x^(1/Aggression)), and 1 from x = 1 on.
func (s SlowStartOptions) Share(x float64) float64 {
	if x >= 1 {
		return 1
	}
	a := s.Aggression
	if a <= 0 {
		a = 1
	}
	return math.Max(s.Floor, math.Pow(math.Max(x, 0), 1/a))
}

// slowStartFields document the block's keys.
var slowStartFields = []docField{
	{"slow_start", "(none: off)", "mapping", "Slow start after recovery: when the circuit closes on successful probes (half-open → closed), the kernel admits a share of **new TCP connects** that rises from `floor` to all over `duration`, and turns the rest away with `bulkhead_reject_errno` (the overload errno), counted apart (`breakerd_slow_start_rejections_total`) and never entering the failure window. A failure during the ramp is judged as always (the circuit can open again). See *Slow start*."},
	{"slow_start.duration", "0s", fmt.Sprintf("duration in [%v, %v], or 0", MinSlowStart, MaxSlowStart), "The ramp's length; 0 turns slow start off."},
	{"slow_start.floor", "0.1", "ratio in [0, 1)", "The share of new connects admitted as the ramp begins (Envoy's `min_weight_percent`, as a ratio)."},
	{"slow_start.aggression", "1", fmt.Sprintf("number in (0, %d]", MaxSlowStartAggression), "The ramp's shape, as Envoy's `aggression`: the share at x, the part of `duration` elapsed, is max(`floor`, x^(1/`aggression`)). 1 is linear; above 1 it rises fast early, below 1 late."},
}

var slowStartKeys = []string{"aggression", "duration", "floor"}

// slowStart decodes a `slow_start` block at path.
func (d *decoder) slowStart(path string, v any) SlowStartOptions {
	m, ok := asMap(v)
	if !ok {
		d.add(path, "must be a mapping (duration, floor, aggression), like `slow_start: {duration: 30s}`")
		return SlowStartOptions{}
	}
	s := SlowStartOptions{Floor: DefaultSlowStartFloor, Aggression: 1}
	for _, k := range sortedKeys(m) {
		if m[k] == nil {
			continue // reported as a null value
		}
		var err error
		switch k {
		case "duration":
			var d time.Duration
			if err = setDuration(&d, m[k], 0, MaxSlowStart); err == nil && d != 0 && d < MinSlowStart {
				err = fmt.Errorf("%v is not in [%v, %v] (0s turns slow start off)", d, MinSlowStart, MaxSlowStart)
			}
			if err == nil {
				s.Duration = d
			}
		case "floor":
			f := s.Floor
			if err = setRatio(&f, m[k], true); err == nil && f == 1 {
				err = fmt.Errorf("a floor of 1 admits every connect: no ramp (remove slow_start, or set duration: 0s, to turn it off)")
			}
			if err == nil {
				s.Floor = f
			}
		case "aggression":
			a := s.Aggression
			if err = setFloat(&a, m[k], 0, MaxSlowStartAggression); err == nil && a == 0 {
				err = fmt.Errorf("0 is not in (0, %d]", MaxSlowStartAggression)
			}
			if err == nil {
				s.Aggression = a
			}
		default:
			d.add(path+"."+k, "unknown key%s", d.suggest(k, slowStartKeys))
			continue
		}
		if err != nil {
			d.add(path+"."+k, "%v", err)
		}
	}
	if _, ok := m["duration"]; !ok {
		d.add(path+".duration", "missing: the ramp's length, like 30s (0s turns slow start off)")
	}
	return s
}

// writeSlowStartReference writes the configuration reference's section
// on slow start.
func writeSlowStartReference(b *strings.Builder) {
	b.WriteString("## Slow start\n\n")
	b.WriteString("A service that has just recovered is often cold (empty caches, a connection pool to refill, a JIT to warm), and every client sending it all its traffic at the same moment can knock it over again. With a `slow_start` block, a circuit that closes on successful probes does not let everything through at once: its verdict stays in the kernel as a *ramp* that records when the circuit closed, and `connect()` computes the share admitted now from it, with no round trip to the daemon. ")
	b.WriteString("Connects are admitted evenly, not at random: each adds the current share to a per-circuit sum, and one is admitted each time the sum passes a whole, so over any stretch of connects the admitted ones are the sum of their shares, to within one. ")
	b.WriteString("The kernel follows the curve through 8 points (the share at 0, 1/8, …, 7/8 of `duration`, to 1/256), linearly in between; from the end of `duration` on it admits everything without any write, and the daemon removes the ramp within a second.\n\n")
	b.WriteString("Only a close on successful probes ramps: not a forced close, a reset, the release of an override or the end of a fleet follow. Only new TCP connects are held back: established connections and UDP sends are not. ")
	b.WriteString("A connect turned away sees `bulkhead_reject_errno` (`EAGAIN` by default) and is counted in `breakerd_slow_start_rejections_total` (in shadow mode, with the shadow rejections, and admitted); it makes no connection, so it never counts as a failure. The admitted connects are judged as always: enough failures open the circuit again, and its next close ramps anew. ")
	b.WriteString("A ramp survives a restart, a crash and a reload like every verdict; a reload that changes `slow_start` applies from the next close. Like every verdict, a ramp is ignored when the daemon's heartbeat is stale.\n\n")
	b.WriteString("```yaml\ntargets:\n  payments:\n    match: {hosts: [payments.internal], ports: [\"443\"]}\n    slow_start: {duration: 30s, floor: 0.1}\n```\n\n")
	writeTable(b, slowStartFields)
	b.WriteString("\n")
}
