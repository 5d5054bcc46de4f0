package policy

import (
	"strings"
	"testing"
	"time"
)

func TestAdaptiveLimitOptions(t *testing.T) {
	c, err := Parse([]byte(`
targets:
  a:
    match: {cidrs: [10.0.0.1]}
    max_connections: {adaptive: gradient2, min: 4, initial: 20, max: 200}
    max_connecting: {adaptive: vegas, max: 10}
  b:
    match: {cidrs: [10.0.0.2]}
    max_connections: 7
`), false)
	if err != nil {
		t.Fatal(err)
	}
	a := c.Targets["a"].Options
	if a.AdaptiveConnections != (Adaptive{Gradient2, 4, 20, 200}) || a.MaxConnections != 20 {
		t.Fatalf("max_connections: %+v, static %d", a.AdaptiveConnections, a.MaxConnections)
	}
	// min defaults to 1, initial to 20 clamped into [min, max].
	if a.AdaptiveConnecting != (Adaptive{Vegas, 1, 10, 10}) || a.MaxConnecting != 10 || !a.HasLimits() {
		t.Fatalf("max_connecting: %+v, static %d", a.AdaptiveConnecting, a.MaxConnecting)
	}
	if b := c.Targets["b"].Options; b.AdaptiveConnections.On() || b.MaxConnections != 7 {
		t.Fatalf("static: %+v", b)
	}
}

func TestAdaptiveLimitProblemsNameTheKey(t *testing.T) {
	for _, tc := range []struct{ value, want string }{
		{`{adaptive: gradient3, max: 10}`, "targets.a.max_connections.adaptive: gradient3 is not gradient2, vegas or aimd"},
		{`{adaptive: vegas, min: 0, max: 10}`, "targets.a.max_connections.min: 0 is not in [1, 10000000]"},
		{`{adaptive: vegas, min: 20, max: 10}`, "targets.a.max_connections.min: 20 is above max 10"},
		{`{adaptive: vegas, min: 2, initial: 30, max: 10}`, "targets.a.max_connections.initial: 30 is not within min 2 and max 10"},
		{`{adaptive: vegas}`, "targets.a.max_connections.max: missing: an adaptive limit needs a ceiling"},
		{`{min: 1, max: 10}`, "targets.a.max_connections.adaptive: missing"},
		{`{adaptive: aimd, max: 10, mni: 1}`, "targets.a.max_connections.mni: unknown key (adaptive, min, initial, max)"},
		{`{adaptive: aimd, max: ten}`, `targets.a.max_connections.max: "ten" is not a number`},
	} {
		got := strings.Join(problems(t, "targets:\n  a:\n    match: {cidrs: [10.0.0.1]}\n    max_connections: "+tc.value+"\n"), "\n")
		if !strings.Contains(got, tc.want) {
			t.Errorf("%s: got %q, want %q", tc.value, got, tc.want)
		}
	}
	got := strings.Join(problems(t, "all:\n  max_connecting: {adaptive: vegas, max: 10}\n"), "\n")
	if !strings.Contains(got, "all.max_connecting: an adaptive limit is a target's only") {
		t.Errorf("in all: %q", got)
	}
}

// fill gives l one window of LimitWindow samples of latency rtt and
// updates it with inflight calls in flight.
func fill(l *Limiter, rtt time.Duration, inflight int) (int, bool) {
	for range LimitWindow {
		l.Sample(rtt)
	}
	return l.Update(inflight)
}

// TestLimiters runs each algorithm through the same story, one window a
// tick with the limit always full: latency at its base for a while, then
// rising as a queue forms (the latency a limit of n gives a server that
// handles k at a time: n/k × base), then falling back.
func TestLimiters(t *testing.T) {
	const base = 20 * time.Millisecond
	for _, tc := range []struct {
		alg Algorithm
		// within is how many ticks of queueing bring the limit to at
		// most down; back how many without it bring it to at least up.
		within, back int
		down, up     int
	}{
		{Gradient2, 40, 80, 30, 60},
		{Vegas, 40, 20, 20, 80},
	} {
		t.Run(tc.alg.String(), func(t *testing.T) {
			spec := Adaptive{Algorithm: tc.alg, Min: 4, Initial: 50, Max: 100}
			l := NewLimiter(spec, 0)
			if l.Limit() != 50 {
				t.Fatalf("starts at %d", l.Limit())
			}
			// Not enough samples: nothing moves.
			l.Sample(base)
			if _, moved := l.Update(50); moved {
				t.Fatal("moved on one sample")
			}
			for range 20 {
				fill(l, base, l.Limit())
			}
			if l.Limit() < 50 {
				t.Fatalf("no queue, yet the limit fell to %d", l.Limit())
			}
			// A server that handles 10 at a time: a limit above 10 queues.
			const k = 10
			queued := func() time.Duration { return max(base, base*time.Duration(l.Limit())/k) }
			ticks := 0
			for l.Limit() > tc.down && ticks < tc.within {
				fill(l, queued(), l.Limit())
				ticks++
			}
			if l.Limit() > tc.down {
				t.Fatalf("queueing for %d ticks left the limit at %d, want at most %d", ticks, l.Limit(), tc.down)
			}
			for range 200 {
				fill(l, queued(), l.Limit())
				if l.Limit() < spec.Min || l.Limit() > spec.Max {
					t.Fatalf("limit %d outside [%d, %d]", l.Limit(), spec.Min, spec.Max)
				}
			}
			low := l.Limit()
			// The server handles everything at once again.
			ticks = 0
			for l.Limit() < tc.up && ticks < tc.back {
				fill(l, base, l.Limit())
				ticks++
			}
			if l.Limit() < tc.up {
				t.Fatalf("latency back to base for %d ticks took the limit from %d to %d, want at least %d", ticks, low, l.Limit(), tc.up)
			}
			for range 200 {
				fill(l, base/2, l.Limit())
			}
			if l.Limit() != spec.Max {
				t.Fatalf("falling latency: %d, want the max %d", l.Limit(), spec.Max)
			}
		})
	}
}

// A limit well above what is in flight is not what holds calls back: no
// algorithm raises it then, whatever the latency.
func TestLimitersDoNotGrowUnused(t *testing.T) {
	for _, alg := range []Algorithm{Gradient2, Vegas, AIMD} {
		l := NewLimiter(Adaptive{Algorithm: alg, Min: 1, Initial: 40, Max: 100}, 0)
		for range 50 {
			fill(l, time.Millisecond, 5)
		}
		if l.Limit() != 40 {
			t.Errorf("%s: %d calls in flight took the limit from 40 to %d", alg, 5, l.Limit())
		}
	}
}

// Drops (timeouts, overload statuses) bring AIMD and Vegas down; a
// window without them lets AIMD grow by one.
func TestLimitersFollowDrops(t *testing.T) {
	for _, tc := range []struct {
		alg        Algorithm
		afterDrops int
	}{
		{AIMD, 36},  // 40 × 0.9
		{Vegas, 30}, // a step for each drop
	} {
		l := NewLimiter(Adaptive{Algorithm: tc.alg, Min: 1, Initial: 40, Max: 100}, 0)
		fill(l, 10*time.Millisecond, 40) // Vegas learns its no-load latency
		before := l.Limit()
		for range LimitWindow {
			l.Drop()
		}
		if got, moved := l.Update(40); !moved || got != tc.afterDrops {
			t.Errorf("%s: a window of drops took the limit from %d to %d, want %d", tc.alg, before, got, tc.afterDrops)
		}
	}
	l := NewLimiter(Adaptive{Algorithm: AIMD, Min: 1, Initial: 40, Max: 100}, 0)
	if got, _ := fill(l, time.Second, 40); got != 41 {
		t.Errorf("aimd without drops: %d, want 41", got)
	}
}

// A reload keeps the limit, clamped into the new bounds; a restart
// begins at the limit the kernel enforced.
func TestLimiterReshapeAndResume(t *testing.T) {
	l := NewLimiter(Adaptive{Algorithm: Vegas, Min: 1, Initial: 40, Max: 100}, 0)
	l.Reshape(Adaptive{Algorithm: Vegas, Min: 1, Initial: 40, Max: 30})
	if l.Limit() != 30 {
		t.Fatalf("reshaped to max 30: %d", l.Limit())
	}
	l.Reshape(Adaptive{Algorithm: Gradient2, Min: 1, Initial: 10, Max: 100})
	if l.Limit() != 30 || l.Spec().Algorithm != Gradient2 {
		t.Fatalf("another algorithm: %d, %v", l.Limit(), l.Spec())
	}
	if got := NewLimiter(Adaptive{Algorithm: Vegas, Min: 5, Initial: 40, Max: 100}, 3).Limit(); got != 5 {
		t.Fatalf("resumed at 3 under min 5: %d", got)
	}
}
