package policy

import (
	"testing"
	"time"
)

// TestClassify is the table of what each outcome counts as.
func TestClassify(t *testing.T) {
	http := func(mod func(o *Options)) *Options {
		return opts(func(o *Options) {
			o.SlowCallDuration = time.Second
			o.ConnectTimeout = 3 * time.Second
			o.ResetFailureWindow = 2 * time.Second
			o.Responses.HTTP = true
			if err := setStatuses(&o.Responses.FailureStatuses, []any{"5xx", "429"}); err != nil {
				t.Fatal(err)
			}
			if mod != nil {
				mod(o)
			}
		})
	}
	plain := http(func(o *Options) { o.Responses = ResponseOptions{} })
	timeouts := http(func(o *Options) {
		o.Responses.ResponseTimeout = 5 * time.Second
		o.Responses.SlowResponseDuration = time.Second
	})
	noDropped := http(func(o *Options) { o.Responses.IgnoreDropped = true })
	counting := http(func(o *Options) { o.CountAbandoned = true })
	const ms = time.Millisecond
	var (
		none    = Call{}
		success = Call{Counts: true}
		slow    = Call{Counts: true, Slow: true}
		failure = Call{Counts: true, Failed: true}
	)
	for _, tc := range []struct {
		name string
		o    *Options
		r    Result
		want Call
	}{
		{"handshake", plain, Result{Kind: Success, Duration: 5 * ms}, success},
		{"slow handshake", plain, Result{Kind: Success, Duration: time.Second}, slow},
		{"handshake of a target that follows responses", http(nil), Result{Kind: Success}, none},
		{"refused", plain, Result{Kind: Failure}, failure},
		{"abandoned quickly", plain, Result{Kind: Abandoned, Duration: 999 * ms}, none},
		{"abandoned late", plain, Result{Kind: Abandoned, Duration: time.Second}, slow},
		{"abandoned late, count_abandoned", counting, Result{Kind: Abandoned, Duration: time.Second}, failure},
		{"abandoned at connect_timeout", plain, Result{Kind: Abandoned, Duration: 3 * time.Second}, failure},
		{"reset soon after connect", plain, Result{Kind: Reset, Duration: 2 * time.Second}, failure},
		{"reset of an older connection", plain, Result{Kind: Reset, Duration: 2*time.Second + 1}, none},
		{"reset without a window", http(func(o *Options) { o.ResetFailureWindow = 0 }), Result{Kind: Reset}, none},
		{"200", http(nil), Result{Kind: Answered, HTTP: true, Status: 200}, Call{Counts: true, Response: ResponseAnswered}},
		{"1xx is no failure status", http(nil), Result{Kind: Answered, HTTP: true, Status: 103}, Call{Counts: true, Response: ResponseAnswered}},
		{"503", http(nil), Result{Kind: Answered, HTTP: true, Status: 503}, Call{Counts: true, Failed: true, Response: ResponseStatus}},
		{"429", http(nil), Result{Kind: Answered, HTTP: true, Status: 429}, Call{Counts: true, Failed: true, Response: ResponseStatus}},
		{"404", http(nil), Result{Kind: Answered, HTTP: true, Status: 404}, Call{Counts: true, Response: ResponseAnswered}},
		{"no status line read", http(nil), Result{Kind: Answered, Status: 503}, Call{Counts: true, Response: ResponseAnswered}},
		{"slow response", timeouts, Result{Kind: Answered, HTTP: true, Status: 200, Duration: time.Second}, Call{Counts: true, Slow: true, Response: ResponseAnswered}},
		{"response after response_timeout", timeouts, Result{Kind: Answered, HTTP: true, Status: 200, Duration: 5 * time.Second}, Call{Counts: true, Failed: true, Response: ResponseTimeout}},
		{"counted batch", http(nil), Result{Kind: Answered}, Call{Counts: true, Response: ResponseAnswered}},
		{"peer closed", http(nil), Result{Kind: NoResponse, PeerClosed: true}, Call{Counts: true, Failed: true, Response: ResponseDropped}},
		{"peer closed, count_dropped off", noDropped, Result{Kind: NoResponse, PeerClosed: true}, Call{Response: ResponseDropped}},
		{"peer reset, count_dropped off", noDropped, Result{Kind: NoResponse, PeerClosed: true, Err: true}, Call{Counts: true, Failed: true, Response: ResponseDropped}},
		{"client gave up", http(nil), Result{Kind: NoResponse}, Call{Response: ResponseAbandoned}},
		{"client gave up after response_timeout", timeouts, Result{Kind: NoResponse, Duration: 5 * time.Second}, Call{Counts: true, Failed: true, Response: ResponseTimeout}},
	} {
		if got := Classify(tc.o, tc.r); got != tc.want {
			t.Errorf("%s: Classify(%+v) = %+v, want %+v", tc.name, tc.r, got, tc.want)
		}
	}
}
