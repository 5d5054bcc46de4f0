package policy

// Call is what one outcome counts as: the one answer to "is this a
// failure?", which every path of the daemon asks Classify.
type Call struct {
	// Counts says the outcome is a call in the circuit's window (and a
	// probe's result); Failed and Slow what kind of call.
	Counts, Failed, Slow bool
	// Response is the response series the outcome is counted under
	// (Answered and NoResponse results; NotAResponse for the others).
	Response ResponseKind
}

// ResponseKind is what a response counts as: the value of the outcome
// label of the breakerd_outcomes_total series it adds to.
type ResponseKind uint8

// The response kinds.
const (
	NotAResponse      ResponseKind = iota
	ResponseAnswered               // response: a success (slow or not)
	ResponseStatus                 // response_status: a status in failure_statuses
	ResponseTimeout                // response_timeout: no byte within response_timeout
	ResponseDropped                // response_dropped: the peer closed or reset before any byte
	ResponseAbandoned              // response_abandoned: the client gave up before response_timeout
	ResponseKinds
)

var responseKindNames = [ResponseKinds]string{"", "response", "response_status", "response_timeout", "response_dropped", "response_abandoned"}

// String returns the kind's outcome label ("" for NotAResponse).
func (k ResponseKind) String() string { return responseKindNames[k] }

// Classify decides what r counts as under o. The kernel shares one part
// of it: with the default failure statuses it counts an ordinary success
// (no status among them, faster than slow_response_duration and
// response_timeout) itself and hands over their number as one Answered
// batch (bpf/breaker.h, enum http_failure; TestKernelFailureStatuses).
func Classify(o *Options, r Result) Call {
	switch r.Kind {
	case Success:
		if o.Responses.Followed() {
			return Call{} // its requests are the calls, a probe's first response its result
		}
		return Call{Counts: true, Slow: r.Duration >= o.SlowCallDuration}
	case Failure:
		return Call{Counts: true, Failed: true}
	case Abandoned:
		switch {
		case r.Duration >= o.ConnectTimeout:
			// The client gave up no earlier than connect_timeout: the
			// destination did not answer in time, a timeout whoever
			// noticed first (clients often give up at about the same
			// second as the kernel's first SYN retransmission).
			return Call{Counts: true, Failed: true}
		case r.Duration < o.SlowCallDuration:
			return Call{}
		case o.CountAbandoned:
			return Call{Counts: true, Failed: true}
		}
		return Call{Counts: true, Slow: true}
	case Reset:
		// A reset counts only soon after connect: later ones are most
		// often idle timeouts of pooled connections (NATs, load
		// balancers), not a failing service.
		if w := o.ResetFailureWindow; w == 0 || r.Duration > w {
			return Call{}
		}
		return Call{Counts: true, Failed: true}
	case Answered:
		resp := &o.Responses
		switch {
		case resp.ResponseTimeout > 0 && r.Duration >= resp.ResponseTimeout:
			// Late, or ended late, and not seen waiting by a tick.
			return Call{Counts: true, Failed: true, Response: ResponseTimeout}
		case resp.HTTP && r.HTTP && resp.FailureStatuses.Has(r.Status):
			return Call{Counts: true, Failed: true, Response: ResponseStatus}
		}
		d := resp.SlowResponseDuration
		return Call{Counts: true, Slow: d > 0 && r.Duration >= d, Response: ResponseAnswered}
	case NoResponse:
		resp := &o.Responses
		switch {
		case resp.ResponseTimeout > 0 && r.Duration >= resp.ResponseTimeout:
			return Call{Counts: true, Failed: true, Response: ResponseTimeout}
		case r.PeerClosed && resp.IgnoreDropped && !r.Err:
			// The peer's FIN, and count_dropped is off (a goodbye the
			// server answers by closing): counted, but not a call.
			return Call{Response: ResponseDropped}
		case r.PeerClosed:
			return Call{Counts: true, Failed: true, Response: ResponseDropped}
		}
		// The client gave up first: nothing anyone can say about the
		// target (the router's rule).
		return Call{Response: ResponseAbandoned}
	}
	return Call{}
}
