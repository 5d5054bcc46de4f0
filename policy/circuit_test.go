package policy

import (
	"math/rand/v2"
	"testing"
	"time"
)

// clock is a fake clock for the state machine.
type clock struct{ t time.Time }

func newClock() *clock                   { return &clock{t: time.Unix(1_700_000_000, 0)} }
func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

func opts(mod func(*Options)) *Options {
	o := DefaultOptions()
	o.Jitter = 0
	if mod != nil {
		mod(&o)
	}
	return &o
}

var (
	ok   = Result{Kind: Success, Duration: time.Millisecond}
	fail = Result{Kind: Failure}
	slow = Result{Kind: Success, Duration: 2 * time.Second}
)

func feed(t *testing.T, c *Circuit, clk *clock, rs ...Result) []Transition {
	t.Helper()
	var out []Transition
	for _, r := range rs {
		if tr, ok := c.Record(clk.now(), r); ok {
			out = append(out, tr)
		}
	}
	return out
}

func repeat(r Result, n int) []Result {
	out := make([]Result, n)
	for i := range out {
		out[i] = r
	}
	return out
}

func TestOpensOnFailureRateOnlyWithMinRequests(t *testing.T) {
	clk := newClock()
	c := NewCircuit(opts(func(o *Options) { o.ConsecutiveFailures = 0; o.MinRequests = 10; o.WindowSize = 20 }), NoOverride, nil, clk.now(), nil)
	// A burst of 9 failures: below min_requests, stays closed.
	if trs := feed(t, c, clk, repeat(fail, 9)...); len(trs) != 0 {
		t.Fatalf("opened below min_requests: %+v", trs)
	}
	trs := feed(t, c, clk, fail)
	if len(trs) != 1 || trs[0].To != Open || trs[0].Reason != ReasonFailureRate || trs[0].FailureRate != 1 || trs[0].Calls != 10 {
		t.Fatalf("10th failure: %+v", trs)
	}
	if want := clk.now().Add(10 * time.Second); !trs[0].OpenUntil.Equal(want) {
		t.Fatalf("open until %v, want %v", trs[0].OpenUntil, want)
	}
}

func TestFailureRateBelowThresholdStaysClosed(t *testing.T) {
	clk := newClock()
	c := NewCircuit(opts(func(o *Options) { o.ConsecutiveFailures = 0; o.FailureRateThreshold = 0.5 }), NoOverride, nil, clk.now(), nil)
	for i := 0; i < 100; i++ {
		r := ok
		if i%3 == 0 {
			r = fail
		}
		if trs := feed(t, c, clk, r); len(trs) != 0 {
			t.Fatalf("opened at a 1/3 failure rate: %+v", trs)
		}
	}
}

func TestConsecutiveFailures(t *testing.T) {
	clk := newClock()
	c := NewCircuit(opts(func(o *Options) { o.ConsecutiveFailures = 3; o.MinRequests = 20 }), NoOverride, nil, clk.now(), nil)
	if trs := feed(t, c, clk, fail, fail, ok, fail, fail); len(trs) != 0 {
		t.Fatalf("a success must break the run: %+v", trs)
	}
	trs := feed(t, c, clk, fail)
	if len(trs) != 1 || trs[0].Reason != ReasonConsecutive {
		t.Fatalf("%+v", trs)
	}
}

func TestSlowCallRate(t *testing.T) {
	clk := newClock()
	c := NewCircuit(opts(func(o *Options) { o.SlowCallRateThreshold = 0.5; o.MinRequests = 4; o.SlowCallDuration = time.Second }), NoOverride, nil, clk.now(), nil)
	trs := feed(t, c, clk, ok, slow, ok, slow)
	if len(trs) != 1 || trs[0].Reason != ReasonSlowCallRate || trs[0].SlowRate != 0.5 {
		t.Fatalf("%+v", trs)
	}
}

func TestAbandoned(t *testing.T) {
	clk := newClock()
	o := opts(func(o *Options) {
		o.ConsecutiveFailures = 0
		o.MinRequests = 2
		o.SlowCallRateThreshold = 1
		o.FailureRateThreshold = 1
		o.ConnectTimeout = 10 * time.Second
	})
	c := NewCircuit(o, NoOverride, nil, clk.now(), nil)
	quick := Result{Kind: Abandoned, Duration: 10 * time.Millisecond}
	late := Result{Kind: Abandoned, Duration: 5 * time.Second}
	feed(t, c, clk, quick, quick, quick)
	if s := c.Status(clk.now()); s.Calls != 0 {
		t.Fatalf("quick abandons counted: %+v", s)
	}
	trs := feed(t, c, clk, late, late)
	if len(trs) != 1 || trs[0].Reason != ReasonSlowCallRate {
		t.Fatalf("late abandons should count as slow: %+v", trs)
	}
	o2 := *o
	o2.CountAbandoned = true
	c2 := NewCircuit(&o2, NoOverride, nil, clk.now(), nil)
	if trs := feed(t, c2, clk, late, late); len(trs) != 1 || trs[0].Reason != ReasonFailureRate {
		t.Fatalf("count_abandoned: %+v", trs)
	}
}

func TestTimeWindowAgesOut(t *testing.T) {
	clk := newClock()
	c := NewCircuit(opts(func(o *Options) {
		o.ConsecutiveFailures = 0
		o.WindowDuration = 10 * time.Second
		o.MinRequests = 5
	}), NoOverride, nil, clk.now(), nil)
	feed(t, c, clk, repeat(fail, 4)...)
	clk.advance(11 * time.Second)
	if s := c.Status(clk.now()); s.Calls != 0 || s.Failures != 0 {
		t.Fatalf("window did not age out: %+v", s)
	}
	// Four old failures are gone, so one more does not reach min_requests.
	if trs := feed(t, c, clk, fail); len(trs) != 0 {
		t.Fatalf("aged-out calls still counted: %+v", trs)
	}
	// Spread over the window they count.
	for i := 0; i < 4; i++ {
		clk.advance(time.Second)
		if trs := feed(t, c, clk, fail); i == 3 && len(trs) != 1 {
			t.Fatalf("5 failures within 10s did not open: %+v", trs)
		}
	}
}

func TestHalfOpenProbesAndGrowth(t *testing.T) {
	clk := newClock()
	o := opts(func(o *Options) {
		o.ConsecutiveFailures = 1
		o.OpenDuration = time.Second
		o.OpenDurationMultiplier = 2
		o.MaxOpenDuration = 5 * time.Second
		o.HalfOpenProbes = 2
		o.HalfOpenSuccessThreshold = 2
		o.ProbeTimeout = 3 * time.Second
	})
	c := NewCircuit(o, NoOverride, nil, clk.now(), nil)
	tr := feed(t, c, clk, fail)[0]
	want := []time.Duration{time.Second}
	got := []time.Duration{tr.OpenUntil.Sub(tr.At)}
	// Outcomes of connections from before the trip change nothing.
	if trs := feed(t, c, clk, fail, ok, fail); len(trs) != 0 || c.State() != Open {
		t.Fatalf("late outcomes moved an open circuit: %+v", trs)
	}
	// Four failed half-opens: 2s, 4s, 5s (capped), 5s.
	for _, d := range []time.Duration{2 * time.Second, 4 * time.Second, 5 * time.Second, 5 * time.Second} {
		clk.advance(tr.OpenUntil.Sub(clk.now()))
		if h, ok := c.BeginHalfOpen(clk.now(), c.Round()); !ok || h.To != HalfOpen {
			t.Fatalf("round: %+v", h)
		}
		trs := feed(t, c, clk, Result{Kind: Failure, Probe: true, Round: c.Round()})
		if len(trs) != 1 || trs[0].Reason != ReasonProbeFailed {
			t.Fatalf("probe failure: %+v", trs)
		}
		tr = trs[0]
		want = append(want, d)
		got = append(got, tr.OpenUntil.Sub(tr.At))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("open durations %v, want %v", got, want)
		}
	}
	// Recover: two successful probes close it; the next trip is back to 1s.
	clk.advance(tr.OpenUntil.Sub(clk.now()))
	c.BeginHalfOpen(clk.now(), c.Round())
	if trs := feed(t, c, clk, Result{Kind: Success, Probe: true, Round: c.Round()}); len(trs) != 0 {
		t.Fatalf("closed after 1 of 2 probes: %+v", trs)
	}
	trs := feed(t, c, clk, Result{Kind: Success, Probe: true, Round: c.Round()})
	if len(trs) != 1 || trs[0].To != Closed || trs[0].Reason != ReasonProbesOK {
		t.Fatalf("%+v", trs)
	}
	tr = feed(t, c, clk, fail)[0]
	if d := tr.OpenUntil.Sub(tr.At); d != time.Second {
		t.Fatalf("open duration after a clean close %v, want the base 1s", d)
	}
}

func TestHalfOpenWithoutOutcomeTimesOut(t *testing.T) {
	clk := newClock()
	c := NewCircuit(opts(func(o *Options) { o.ConsecutiveFailures = 1; o.ProbeTimeout = 5 * time.Second }), NoOverride, nil, clk.now(), nil)
	feed(t, c, clk, fail)
	clk.advance(time.Minute)
	c.BeginHalfOpen(clk.now(), c.Round())
	clk.advance(4 * time.Second)
	if _, ok := c.Tick(clk.now()); ok {
		t.Fatal("timed out early")
	}
	// A non-probe outcome does not count in half-open.
	feed(t, c, clk, ok)
	clk.advance(time.Second)
	tr, ok := c.Tick(clk.now())
	if !ok || tr.To != Open || tr.Reason != ReasonProbeTimeout || tr.Trip != 1 {
		t.Fatalf("%+v %v", tr, ok)
	}
}

func TestLostRoundRecordProbeStillCounts(t *testing.T) {
	clk := newClock()
	c := NewCircuit(opts(func(o *Options) { o.ConsecutiveFailures = 1 }), NoOverride, nil, clk.now(), nil)
	feed(t, c, clk, fail)
	clk.advance(time.Minute)
	trs := feed(t, c, clk, Result{Kind: Success, Probe: true, Round: c.Round()})
	if len(trs) != 1 || trs[0].To != Closed {
		t.Fatalf("%+v", trs)
	}
}

func TestEndpointGroupEjectionLimit(t *testing.T) {
	clk := newClock()
	o := opts(func(o *Options) { o.ConsecutiveFailures = 2 })
	g := NewGroup(40)
	var cs []*Circuit
	for i := 0; i < 5; i++ {
		cs = append(cs, NewCircuit(o, NoOverride, g, clk.now(), nil))
	}
	for i := 0; i < 2; i++ {
		if trs := feed(t, cs[i], clk, fail, fail); len(trs) != 1 || trs[0].To != Open {
			t.Fatalf("endpoint %d: %+v", i, trs)
		}
	}
	trs := feed(t, cs[2], clk, fail, fail, fail, fail)
	if len(trs) != 1 || trs[0].To != Closed || trs[0].Reason != ReasonEjectionLimit {
		t.Fatalf("third endpoint: %+v (state %v)", trs, cs[2].State())
	}
	if _, ej := g.Counts(); ej != 2 {
		t.Fatalf("%d ejected, want 2", ej)
	}
	// One recovers: the third may now go.
	clk.advance(time.Minute)
	cs[0].BeginHalfOpen(clk.now(), cs[0].Round())
	feed(t, cs[0], clk, Result{Kind: Success, Probe: true, Round: cs[0].Round()})
	if trs := feed(t, cs[2], clk, fail); len(trs) != 1 || trs[0].To != Open {
		t.Fatalf("after a recovery: %+v", trs)
	}
	cs[1].Release()
	if n, ej := g.Counts(); n != 4 || ej != 1 {
		t.Fatalf("after release: %d endpoints %d ejected", n, ej)
	}
}

func TestOverrides(t *testing.T) {
	clk := newClock()
	o := opts(func(o *Options) { o.ConsecutiveFailures = 1 })
	c := NewCircuit(o, ForceOpen, nil, clk.now(), nil)
	if trs := feed(t, c, clk, fail, ok, Result{Kind: Success, Probe: true}); len(trs) != 0 || c.State() != ForcedOpen {
		t.Fatalf("forced open moved: %+v", trs)
	}
	if tr := c.Override(clk.now(), ForceClosed); tr.To != ForcedClosed || c.State().Rejects() {
		t.Fatalf("%+v", tr)
	}
	if trs := feed(t, c, clk, repeat(fail, 50)...); len(trs) != 0 {
		t.Fatalf("forced closed opened: %+v", trs)
	}
	if tr := c.Override(clk.now(), NoOverride); tr.To != Closed || tr.Reason != ReasonReleased {
		t.Fatalf("%+v", tr)
	}
	if trs := feed(t, c, clk, fail); len(trs) != 1 {
		t.Fatal("released circuit does not trip")
	}
	d := NewCircuit(o, DisableState, nil, clk.now(), nil)
	feed(t, d, clk, repeat(fail, 20)...)
	if s := d.Status(clk.now()); s.State != Disabled || s.Failures != 20 {
		t.Fatalf("disabled keeps metrics only: %+v", s)
	}
}

// TestInvariantsOverRandomSequences drives circuits with random events and
// checks what must always hold.
func TestInvariantsOverRandomSequences(t *testing.T) {
	for seed := uint64(1); seed <= 300; seed++ {
		rng := rand.New(rand.NewPCG(seed, seed*7))
		clk := newClock()
		o := opts(func(o *Options) {
			o.ConsecutiveFailures = rng.IntN(4)
			o.MinRequests = 1 + rng.IntN(5)
			o.WindowSize = o.MinRequests + rng.IntN(10)
			if rng.IntN(2) == 0 {
				o.WindowDuration = time.Duration(1+rng.IntN(20)) * time.Second
			}
			o.OpenDuration = time.Duration(1+rng.IntN(5)) * time.Second
			o.MaxOpenDuration = o.OpenDuration * time.Duration(1+rng.IntN(8))
			o.OpenDurationMultiplier = 1 + rng.Float64()*3
			o.Jitter = rng.Float64()
			o.HalfOpenProbes = 1 + rng.IntN(4)
			o.HalfOpenSuccessThreshold = 1 + rng.IntN(o.HalfOpenProbes)
		})
		g := NewGroup(1 + rng.IntN(100))
		var cs []*Circuit
		for i := 0; i < 1+rng.IntN(6); i++ {
			cs = append(cs, NewCircuit(o, NoOverride, g, clk.now(), rng.Float64))
		}
		probesInRound := make([]int, len(cs))
		for step := 0; step < 400; step++ {
			clk.advance(time.Duration(rng.IntN(2000)) * time.Millisecond)
			i := rng.IntN(len(cs))
			c := cs[i]
			var tr Transition
			var moved bool
			switch rng.IntN(6) {
			case 0:
				tr, moved = c.BeginHalfOpen(clk.now(), c.Round())
				if moved {
					probesInRound[i] = 0
				}
			case 1:
				tr, moved = c.Tick(clk.now())
			default:
				r := Result{Kind: Kind(rng.IntN(3)), Duration: time.Duration(rng.IntN(3000)) * time.Millisecond}
				if c.State() == HalfOpen && rng.IntN(2) == 0 {
					// The kernel never admits more than half_open_probes.
					if probesInRound[i] >= o.HalfOpenProbes {
						continue
					}
					probesInRound[i]++
					r.Probe, r.Round = true, c.Round()
				}
				before := c.State()
				tr, moved = c.Record(clk.now(), r)
				if before == Closed && c.State() == Closed && moved && tr.Reason != ReasonEjectionLimit {
					t.Fatalf("seed %d: closed→closed transition %+v", seed, tr)
				}
			}
			if moved && tr.To == Open {
				max := time.Duration(float64(o.MaxOpenDuration) * (1 + o.Jitter))
				if d := tr.OpenUntil.Sub(tr.At); d > max || d < o.OpenDuration {
					t.Fatalf("seed %d: open for %v, outside [%v, %v]", seed, d, o.OpenDuration, max)
				}
			}
			if c.State() == Closed && c.State().Rejects() {
				t.Fatalf("seed %d: a closed circuit rejects", seed)
			}
			n, ej := g.Counts()
			open := 0
			for _, x := range cs {
				if x.State() == Open || x.State() == HalfOpen {
					open++
				}
			}
			if open != ej || ej > max(1, g.MaxEjectionPercent*n/100) {
				t.Fatalf("seed %d: %d open (group says %d) of %d, limit %d%%", seed, open, ej, n, g.MaxEjectionPercent)
			}
		}
	}
}

func FuzzCircuitEvents(f *testing.F) {
	f.Add([]byte{0, 1, 1, 1, 1, 1, 2, 3, 4, 5, 0, 0})
	f.Add([]byte{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9, 9, 9, 2, 2})
	f.Fuzz(func(t *testing.T, ev []byte) {
		clk := newClock()
		o := opts(func(o *Options) {
			o.ConsecutiveFailures = 3
			o.MinRequests = 2
			o.WindowDuration = 5 * time.Second
			o.HalfOpenProbes = 2
		})
		g := NewGroup(50)
		c := NewCircuit(o, NoOverride, g, clk.now(), func() float64 { return 0.5 })
		NewCircuit(o, NoOverride, g, clk.now(), nil)
		for _, b := range ev {
			clk.advance(time.Duration(b>>4) * 700 * time.Millisecond)
			switch b % 8 {
			case 0, 1, 2:
				c.Record(clk.now(), Result{Kind: Kind(b % 3), Duration: time.Duration(b) * 10 * time.Millisecond})
			case 3:
				c.Record(clk.now(), Result{Kind: Kind(b % 2), Probe: true, Round: c.Round()})
			case 4:
				c.BeginHalfOpen(clk.now(), c.Round())
			case 5:
				c.Tick(clk.now())
			case 6:
				c.Override(clk.now(), []Override{NoOverride, ForceOpen, ForceClosed, DisableState}[b>>6])
			case 7:
				c.Reset(clk.now())
			}
			s := c.Status(clk.now())
			if s.Calls < 0 || s.Failures < 0 || s.Failures > s.Calls || s.Slow > s.Calls {
				t.Fatalf("window counts %+v", s)
			}
			if _, ej := g.Counts(); ej < 0 || ej > 1 {
				t.Fatalf("group ejected %d", ej)
			}
		}
	})
}

func BenchmarkRecord(b *testing.B) {
	for _, mode := range []string{"count", "time"} {
		b.Run(mode, func(b *testing.B) {
			clk := newClock()
			o := opts(func(o *Options) {
				o.ConsecutiveFailures = 0
				o.WindowSize = 100
				o.MinRequests = 10
				o.FailureRateThreshold = 1
				o.SlowCallRateThreshold = 1
				if mode == "time" {
					o.WindowDuration = 10 * time.Second
				}
			})
			c := NewCircuit(o, NoOverride, nil, clk.now(), nil)
			rs := []Result{ok, fail, slow, ok}
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				clk.t = clk.t.Add(time.Millisecond)
				c.Record(clk.t, rs[i&3])
			}
		})
	}
}

func BenchmarkStatus(b *testing.B) {
	clk := newClock()
	c := NewCircuit(opts(nil), NoOverride, nil, clk.now(), nil)
	b.ReportAllocs()
	for b.Loop() {
		_ = c.Status(clk.t)
	}
}

// One endpoint may always be ejected: with few endpoints a percentage
// rounds down to none (1 at 50%, 2 at 40%, 3 at 33%).
func TestEndpointGroupAlwaysEjectsOne(t *testing.T) {
	for _, tc := range []struct{ endpoints, pct, want int }{
		{1, 50, 1}, {2, 40, 1}, {3, 33, 1}, {3, 34, 1}, {3, 67, 2}, {5, 40, 2}, {10, 100, 10}, {4, 1, 1},
	} {
		clk := newClock()
		o := opts(func(o *Options) { o.ConsecutiveFailures = 1 })
		g := NewGroup(tc.pct)
		var cs []*Circuit
		for range tc.endpoints {
			cs = append(cs, NewCircuit(o, NoOverride, g, clk.now(), nil))
		}
		for _, c := range cs {
			feed(t, c, clk, fail)
		}
		if _, ej := g.Counts(); ej != tc.want {
			t.Errorf("%d endpoints at %d%%: %d ejected, want %d", tc.endpoints, tc.pct, ej, tc.want)
		}
	}
}

// A changed max_ejection_percent applies to the next ejection; a released
// (departed) endpoint leaves the denominator.
func TestEndpointGroupFollowsItsPercentAndDepartures(t *testing.T) {
	clk := newClock()
	o := opts(func(o *Options) { o.ConsecutiveFailures = 1 })
	g := NewGroup(50)
	var cs []*Circuit
	for range 4 {
		cs = append(cs, NewCircuit(o, NoOverride, g, clk.now(), nil))
	}
	feed(t, cs[0], clk, fail)
	feed(t, cs[1], clk, fail)
	if trs := feed(t, cs[2], clk, fail); len(trs) != 1 || trs[0].Reason != ReasonEjectionLimit {
		t.Fatalf("third of four at 50%%: %+v", trs)
	}
	g.MaxEjectionPercent = 75
	if trs := feed(t, cs[2], clk, fail); len(trs) != 1 || trs[0].To != Open {
		t.Fatalf("at 75%%: %+v", trs)
	}
	// Two more endpoints arrive and depart: the denominator follows.
	extra := []*Circuit{NewCircuit(o, NoOverride, g, clk.now(), nil), NewCircuit(o, NoOverride, g, clk.now(), nil)}
	if n, _ := g.Counts(); n != 6 {
		t.Fatalf("%d endpoints, want 6", n)
	}
	for _, c := range extra {
		c.Release()
	}
	if n, ej := g.Counts(); n != 4 || ej != 3 {
		t.Fatalf("after departures: %d endpoints, %d ejected", n, ej)
	}
	// 4 endpoints at 75%: the fourth stays closed.
	if trs := feed(t, cs[3], clk, fail); len(trs) != 1 || trs[0].Reason != ReasonEjectionLimit {
		t.Fatalf("fourth of four at 75%%: %+v", trs)
	}
}

// TestHalfOpenRounds drives a circuit (probes 2, success threshold 2,
// probe_timeout 5s, open 10s) through rounds with their numbers: each step
// is an event (a round record or a probe outcome, of a round given
// relative to the circuit's first open round R), and the state after it.
func TestHalfOpenRounds(t *testing.T) {
	type step struct {
		after time.Duration // time since the previous step
		ev    string        // "round", "ok", "fail", "tick", "call-fail"
		round int           // relative to R (the first open's round)
		want  State
		trip  int    // trips so far (0: the first open)
		why   Reason // the transition's reason, "" for none
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"every probe that came succeeded: a new round, then close", []step{
			{10 * time.Second, "round", 0, HalfOpen, 0, ReasonDue},
			{time.Second, "ok", 0, HalfOpen, 0, ""},
			{4 * time.Second, "tick", 0, HalfOpen, 0, ReasonNewRound}, // no reopen, no growth
			{20 * time.Second, "tick", 0, HalfOpen, 0, ""},            // no connection yet: waits
			{time.Second, "round", 1, HalfOpen, 0, ""},
			{time.Second, "ok", 1, Closed, 0, ReasonProbesOK},
		}},
		{"no probe succeeded in the round: reopen and grow", []step{
			{10 * time.Second, "round", 0, HalfOpen, 0, ReasonDue},
			{5 * time.Second, "tick", 0, Open, 1, ReasonProbeTimeout},
		}},
		{"late failure of an earlier round changes nothing", []step{
			{10 * time.Second, "round", 0, HalfOpen, 0, ReasonDue},
			{5 * time.Second, "tick", 0, Open, 1, ReasonProbeTimeout},
			{time.Second, "fail", 0, Open, 1, ""},
			{20 * time.Second, "round", 1, HalfOpen, 1, ReasonDue},
			{time.Second, "fail", 0, HalfOpen, 1, ""},
			{time.Second, "ok", 1, HalfOpen, 1, ""},
			{time.Second, "ok", 1, Closed, 0, ReasonProbesOK},
		}},
		{"late success of an earlier round does not close", []step{
			{10 * time.Second, "round", 0, HalfOpen, 0, ReasonDue},
			{time.Second, "fail", 0, Open, 1, ReasonProbeFailed},
			{time.Second, "ok", 0, Open, 1, ""},
			{time.Second, "ok", 0, Open, 1, ""},
		}},
		{"a second destination's round record does not restart the round", []step{
			{10 * time.Second, "round", 0, HalfOpen, 0, ReasonDue},
			{4 * time.Second, "round", 0, HalfOpen, 0, ""},
			{time.Second, "tick", 0, Open, 1, ReasonProbeTimeout},
		}},
		{"a stale round record is ignored", []step{
			{10 * time.Second, "round", 0, HalfOpen, 0, ReasonDue},
			{time.Second, "fail", 0, Open, 1, ReasonProbeFailed},
			{time.Second, "round", 0, Open, 1, ""},
			{10 * time.Second, "tick", 0, Open, 1, ""},
		}},
		{"lost round record: the probe begins the round", []step{
			{10 * time.Second, "ok", 0, HalfOpen, 0, ""},
			{time.Second, "ok", 0, Closed, 0, ReasonProbesOK},
		}},
		{"a failure in a later round after successes reopens", []step{
			{10 * time.Second, "round", 0, HalfOpen, 0, ReasonDue},
			{time.Second, "ok", 0, HalfOpen, 0, ""},
			{4 * time.Second, "tick", 0, HalfOpen, 0, ReasonNewRound},
			{time.Second, "round", 1, HalfOpen, 0, ""},
			{time.Second, "fail", 1, Open, 1, ReasonProbeFailed},
		}},
		{"a non-probe failure in half-open counts nothing", []step{
			{10 * time.Second, "round", 0, HalfOpen, 0, ReasonDue},
			{time.Second, "call-fail", 0, HalfOpen, 0, ""},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			clk := newClock()
			c := NewCircuit(opts(func(o *Options) {
				o.ConsecutiveFailures = 1
				o.OpenDuration = 10 * time.Second
				o.HalfOpenProbes = 2
				o.HalfOpenSuccessThreshold = 2
				o.ProbeTimeout = 5 * time.Second
			}), NoOverride, nil, clk.now(), nil)
			c.SeedRound(41)
			first := feed(t, c, clk, fail)[0]
			r0 := c.Round()
			if r0 != 42 || first.Round != 42 {
				t.Fatalf("first open round %d (transition %d), want 42 after the seed 41", r0, first.Round)
			}
			for i, s := range tc.steps {
				clk.advance(s.after)
				round := r0 + uint32(s.round)
				var tr Transition
				var moved bool
				switch s.ev {
				case "round":
					tr, moved = c.BeginHalfOpen(clk.now(), round)
				case "ok":
					tr, moved = c.Record(clk.now(), Result{Kind: Success, Probe: true, Round: round})
				case "fail":
					tr, moved = c.Record(clk.now(), Result{Kind: Failure, Probe: true, Round: round})
				case "call-fail":
					tr, moved = c.Record(clk.now(), fail)
				case "tick":
					tr, moved = c.Tick(clk.now())
				}
				st := c.Status(clk.now())
				if c.State() != s.want || st.Trip != s.trip || (moved && tr.Reason != s.why) || (!moved && s.why != "") {
					t.Fatalf("step %d (%s of round R+%d): state %v trip %d transition %v %+v; want %v trip %d reason %q",
						i, s.ev, s.round, c.State(), st.Trip, moved, tr, s.want, s.trip, s.why)
				}
				if moved && tr.Reason == ReasonNewRound && tr.Round != c.Round() {
					t.Fatalf("new round transition carries round %d, circuit is at %d", tr.Round, c.Round())
				}
				if moved && tr.To == Open {
					if d := tr.OpenUntil.Sub(tr.At); d != c.Options().OpenDurationOf(s.trip) {
						t.Fatalf("open for %v at trip %d", d, s.trip)
					}
				}
			}
		})
	}
}

// TestRecordNIsNRecords feeds the same random histories to two circuits,
// one call at a time and in runs of equal results, and checks that they
// end in the same state with the same transitions: a counted batch of the
// kernel's successes decides as its calls one by one would, in count-
// and time-based windows, in and out of an endpoint group that may not
// eject, and in runs longer than the window.
func TestRecordNIsNRecords(t *testing.T) {
	answered := Result{Kind: Answered}
	kinds := []Result{ok, fail, slow, answered}
	for seed := uint64(0); seed < 400; seed++ {
		rnd := rand.New(rand.NewPCG(seed, 1))
		o := opts(func(o *Options) {
			o.ConsecutiveFailures = rnd.IntN(4)
			o.MinRequests = 1 + rnd.IntN(30)
			o.WindowSize = 5 + rnd.IntN(40)
			if rnd.IntN(2) == 0 {
				o.WindowDuration = time.Duration(1+rnd.IntN(20)) * time.Second
			}
			o.FailureRateThreshold = 0.2 + rnd.Float64()*0.6
			o.SlowCallRateThreshold = 0.3 + rnd.Float64()*0.7
		})
		clk := newClock()
		// In a group, a peer open first: the group then ejects no more.
		group := func() *Group {
			if seed%3 != 0 {
				return nil
			}
			g := NewGroup(50)
			po := opts(func(o *Options) { o.ConsecutiveFailures = 1 })
			peer := NewCircuit(po, NoOverride, g, clk.now(), nil)
			NewCircuit(po, NoOverride, g, clk.now(), nil)
			if tr, _ := peer.Record(clk.now(), fail); tr.To != Open {
				t.Fatalf("the peer did not open: %+v", tr)
			}
			return g
		}
		one := NewCircuit(o, NoOverride, group(), clk.now(), nil)
		many := NewCircuit(o, NoOverride, group(), clk.now(), nil)
		for step := 0; step < 60; step++ {
			r, n := kinds[rnd.IntN(len(kinds))], 1+rnd.IntN(8)
			if rnd.IntN(8) == 0 {
				n = 1 + rnd.IntN(200)
			}
			var want []Transition
			for range n {
				if tr, moved := one.Record(clk.now(), r); moved {
					want = append(want, tr)
				}
			}
			tr, moved := many.RecordN(clk.now(), r, Classify(o, r), n, nil)
			if len(want) > 1 && want[0].To != Closed {
				t.Fatalf("seed %d step %d: one batch moved twice: %+v", seed, step, want)
			}
			if moved != (len(want) > 0) || moved && tr != want[0] {
				t.Fatalf("seed %d step %d: RecordN(%+v, %d) = %+v, %v; one by one: %+v", seed, step, r, n, tr, moved, want)
			}
			if a, b := one.Status(clk.now()), many.Status(clk.now()); a != b {
				t.Fatalf("seed %d step %d: status %+v, one by one %+v", seed, step, b, a)
			}
			clk.advance(time.Duration(rnd.IntN(3)) * time.Second)
			if tr, moved := one.Tick(clk.now()); moved {
				if tr2, moved2 := many.Tick(clk.now()); !moved2 || tr2 != tr {
					t.Fatalf("seed %d step %d: tick %+v, one by one %+v", seed, step, tr2, tr)
				}
			}
		}
	}
}

// seatAt is a Seat that hands out a slot whose probe budget is at round.
type seatAt struct {
	round uint32
	asked int
}

func (s *seatAt) Seat() (uint32, bool) { s.asked++; return s.round, true }

// A circuit given a slot as it opens continues that slot's rounds: the
// open transition's round, the one its verdict is written with, follows
// the slot's budget; the seat is asked only when the circuit opens.
func TestRecordSeatsBeforeOpening(t *testing.T) {
	o := opts(func(o *Options) { o.ConsecutiveFailures = 3 })
	clk := newClock()
	c := NewCircuit(o, NoOverride, nil, clk.now(), nil)
	s := &seatAt{round: 41}
	for range 2 {
		if _, moved := c.RecordN(clk.now(), fail, Classify(o, fail), 1, s); moved || s.asked != 0 {
			t.Fatalf("moved %v, seat asked %d times before the circuit opened", moved, s.asked)
		}
	}
	tr, moved := c.RecordN(clk.now(), fail, Classify(o, fail), 1, s)
	if !moved || tr.To != Open || s.asked != 1 {
		t.Fatalf("third failure: %+v, %v, seat asked %d times", tr, moved, s.asked)
	}
	if tr.Round != 42 || c.Round() != 42 {
		t.Fatalf("opened in round %d (circuit %d), want 42: after the slot's 41", tr.Round, c.Round())
	}
}
