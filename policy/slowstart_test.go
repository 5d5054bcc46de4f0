package policy

import (
	"math"
	"strings"
	"testing"
	"time"
)

// TestSlowStartConfig: the `slow_start` block of `all` and of a target,
// its defaults, and what validation refuses, each problem under its key
// path.
func TestSlowStartConfig(t *testing.T) {
	const target = "targets:\n  pay:\n    match: {cidrs: [10.0.0.0/24]}\n"
	valid := []struct {
		name, yaml  string
		all, target SlowStartOptions
	}{
		{"no block: off", "mode: enforce\n" + target, SlowStartOptions{}, SlowStartOptions{}},
		{"a duration takes the default floor and shape", "all:\n  slow_start: {duration: 30s}\n", SlowStartOptions{Duration: 30 * time.Second, Floor: 0.1, Aggression: 1}, SlowStartOptions{}},
		{"0s is off", "all:\n  slow_start: {duration: 0s}\n", SlowStartOptions{Floor: 0.1, Aggression: 1}, SlowStartOptions{}},
		{"a target's own block", target + "    slow_start: {duration: 1m, floor: 0, aggression: 2.5}\n", SlowStartOptions{}, SlowStartOptions{Duration: time.Minute, Aggression: 2.5}},
	}
	for _, tc := range valid {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse([]byte(tc.yaml), false)
			if err != nil {
				t.Fatal(err)
			}
			if c.All.SlowStart != tc.all {
				t.Errorf("all.slow_start = %+v, want %+v", c.All.SlowStart, tc.all)
			}
			if p := c.Targets["pay"]; p != nil && p.Options.SlowStart != tc.target {
				t.Errorf("targets.pay.slow_start = %+v, want %+v", p.Options.SlowStart, tc.target)
			}
		})
	}
	invalid := []struct{ name, yaml, want string }{
		{"no duration", "all:\n  slow_start: {floor: 0.2}\n", "all.slow_start.duration: missing"},
		{"too short", "all:\n  slow_start: {duration: 10ms}\n", "all.slow_start.duration: 10ms is not in [100ms, 1h0m0s]"},
		{"too long", target + "    slow_start: {duration: 2h}\n", "targets.pay.slow_start.duration: 2h0m0s is not in"},
		{"not a duration", "all:\n  slow_start: {duration: soon}\n", "all.slow_start.duration: \"soon\" is not a duration"},
		{"a floor of one", "all:\n  slow_start: {duration: 30s, floor: 1}\n", "all.slow_start.floor: a floor of 1 admits every connect"},
		{"a floor above one", "all:\n  slow_start: {duration: 30s, floor: 1.5}\n", "all.slow_start.floor: 1.5 is not in [0, 1]"},
		{"no aggression", "all:\n  slow_start: {duration: 30s, aggression: 0}\n", "all.slow_start.aggression: 0 is not in (0, 10]"},
		{"too much aggression", "all:\n  slow_start: {duration: 30s, aggression: 11}\n", "all.slow_start.aggression: 11 is not in [0, 10]"},
		{"a misspelt key", "all:\n  slow_start: {duration: 30s, flor: 0.2}\n", "all.slow_start.flor: unknown key (did you mean floor?)"},
		{"not a mapping", "all:\n  slow_start: 30s\n", "all.slow_start: must be a mapping"},
		{"a misspelt block", "all:\n  slowstart: {duration: 30s}\n", "all.slowstart: unknown key (did you mean slow_start?)"},
	}
	for _, tc := range invalid {
		t.Run(tc.name, func(t *testing.T) {
			got := problems(t, tc.yaml)
			if len(got) != 1 || !strings.HasPrefix(got[0], tc.want) {
				t.Fatalf("problems %q, want one starting %q", got, tc.want)
			}
		})
	}
}

// TestSlowStartShare: the curve is Envoy's, max(floor, x^(1/aggression)),
// and all from the ramp's end on.
func TestSlowStartShare(t *testing.T) {
	for _, tc := range []struct {
		s    SlowStartOptions
		x    float64
		want float64
	}{
		{SlowStartOptions{Floor: 0.1, Aggression: 1}, 0, 0.1},
		{SlowStartOptions{Floor: 0.1, Aggression: 1}, 0.05, 0.1},
		{SlowStartOptions{Floor: 0.1, Aggression: 1}, 0.5, 0.5},
		{SlowStartOptions{Floor: 0, Aggression: 2}, 0.25, 0.5},
		{SlowStartOptions{Floor: 0, Aggression: 0.5}, 0.5, 0.25},
		{SlowStartOptions{Floor: 0.3, Aggression: 1}, 1, 1},
		{SlowStartOptions{Floor: 0.3, Aggression: 1}, 7, 1},
	} {
		if got := tc.s.Share(tc.x); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("%+v.Share(%v) = %v, want %v", tc.s, tc.x, got, tc.want)
		}
	}
}
