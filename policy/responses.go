package policy

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ResponseOptions say what a target's responses count as: with any of
// them set, the kernel follows the request/response turns of every
// connection to the target, and each turn is a call.
type ResponseOptions struct {
	// SlowResponseDuration: a response whose first byte came at least this
	// long after its request's first byte is a slow call (0: off).
	SlowResponseDuration time.Duration
	// ResponseTimeout: a request with no response byte this long after its
	// first byte is a failure, counted then (0: off).
	ResponseTimeout time.Duration
	// HTTP reads the HTTP/1.x status line of each response (protocol: http).
	HTTP bool
	// FailureStatuses are the HTTP statuses that are failures (with HTTP).
	FailureStatuses StatusSet
	// IgnoreDropped (count_dropped: false) counts a connection the peer
	// closed with a FIN while a request awaited its first response byte as
	// nothing instead of as a failure (a reset before any byte still is
	// one). Unless count_dropped is set, it is on for every protocol but
	// http (see droppedByProtocol).
	IgnoreDropped bool
	// droppedSet: count_dropped was set (not the default).
	droppedSet bool
}

// droppedByProtocol is count_dropped's default: an HTTP server answers
// every request, so its closing before any byte of an answer is a dropped
// request (a failure); in other protocols a request may be a goodbye the
// server answers by closing (memcached's quit, PostgreSQL's Terminate),
// which cannot be told from a dropped request without parsing, and a
// healthy client's goodbyes must not open its circuit.
const droppedByProtocol = "true with protocol: http, else false"

// Followed reports whether the kernel follows the target's responses.
func (r *ResponseOptions) Followed() bool {
	return r.SlowResponseDuration > 0 || r.ResponseTimeout > 0 || r.HTTP
}

// StatusSet is a set of HTTP statuses (100 to 599), as failure_statuses
// gives it.
type StatusSet struct {
	bits [10]uint64 // status - 100
	// text is the list as configured, for the API and the diff.
	text string
}

// Has reports whether status is in the set.
func (s *StatusSet) Has(status uint16) bool {
	i := int(status) - 100
	return i >= 0 && i < 500 && s.bits[i/64]&(1<<(i%64)) != 0
}

// OnlyServerErrorsAnd429 reports whether every status in the set is a 5xx
// or a 429 (the default set, or a narrower one): only then may the kernel
// count the other statuses as successes without a record each.
func (s *StatusSet) OnlyServerErrorsAnd429() bool {
	for st := 100; st < 500; st++ {
		if st != 429 && s.Has(uint16(st)) {
			return false
		}
	}
	return true
}

func (s *StatusSet) add(lo, hi int) {
	for st := lo; st <= hi; st++ {
		i := st - 100
		s.bits[i/64] |= 1 << (i % 64)
	}
}

// String is the list as configured.
func (s StatusSet) String() string { return s.text }

// defaultFailureStatuses are the router's: 5xx and 429.
const defaultFailureStatuses = `["5xx", "429"]`

var responseFields = []optionField{
	{"slow_response_duration", "0s", "duration", "Per connection, a response whose first byte comes at least this long after its request's first byte is a slow call (each request/response turn is one call; see *Responses*). 0 turns it off. Targets only.",
		func(o *Options, r any) error {
			return setOptionalDuration(&o.Responses.SlowResponseDuration, r, time.Millisecond, time.Hour)
		}},
	{"response_timeout", "0s", "duration", "A request with no response byte this long after its first byte is a failure, counted then (not when the client gives up). 0 turns it off. Targets only.",
		func(o *Options, r any) error {
			return setOptionalDuration(&o.Responses.ResponseTimeout, r, time.Millisecond, time.Hour)
		}},
	{"protocol", "tcp", "tcp | http", "`http`: the kernel reads the HTTP/1.x status line at the start of each response, and `failure_statuses` are failures, every other status a success. Plaintext HTTP/1.x only (TLS and HTTP/2 stay connection-level). `tcp`: responses are only timed. Targets only, TCP only.",
		func(o *Options, r any) error {
			s, ok := asString(r)
			switch {
			case ok && s == "http":
				o.Responses.HTTP = true
			case ok && s == "tcp":
				o.Responses.HTTP = false
			default:
				return fmt.Errorf("%v is not tcp or http", r)
			}
			return nil
		}},
	{"failure_statuses", defaultFailureStatuses, "list of statuses or classes", "With `protocol: http`: the statuses that are failures, as the router counts them by default (a 5xx or a 429); each entry a status (`503`) or a class (`5xx`). Every other status is a success; a 1xx other than 101 is never a response's status (see *Responses*) and cannot be listed.",
		func(o *Options, r any) error { return setStatuses(&o.Responses.FailureStatuses, r) }},
	{"count_dropped", droppedByProtocol, "bool", "`true`: a connection the peer closes (its FIN) while a request awaits its first response byte is a failure (`response_dropped`). `false`: it counts as nothing but that metric, for protocols whose goodbye the server answers by closing (memcached's `quit`, which libmemcached sends as it closes, PostgreSQL's Terminate; see *Responses*), so by default only `protocol: http` counts it (an HTTP server answers every request). A reset before any response byte is a failure either way. Targets only.",
		func(o *Options, r any) error {
			if r == droppedByProtocol {
				o.Responses.droppedSet = false
				return nil
			}
			var b bool
			err := setBool(&b, r)
			o.Responses.IgnoreDropped, o.Responses.droppedSet = !b, true
			return err
		}},
}

// responseKeys are the keys only a target may set.
var responseKeys = map[string]bool{"slow_response_duration": true, "response_timeout": true, "protocol": true, "failure_statuses": true, "count_dropped": true}

func init() { optionFields = append(optionFields, responseFields...) }

// setOptionalDuration is setDuration where 0 means off and anything else
// must be within [lo, hi].
func setOptionalDuration(dst *time.Duration, r any, lo, hi time.Duration) error {
	var d time.Duration
	if err := setDuration(&d, r, 0, hi); err != nil {
		return err
	}
	if d != 0 && d < lo {
		return fmt.Errorf("%v is not 0 (off) or in [%v, %v]", d, lo, hi)
	}
	*dst = d
	return nil
}

// informationalNote says why a 1xx other than 101 cannot be a failure
// status: the kernel never counts one (see responsesReference).
const informationalNote = "an informational status is never a response's status (the kernel reads past it to the final one); of the 1xx only 101 can be listed"

// setStatuses reads a list of statuses ("503", 503) and classes ("5xx"),
// YAML's or an environment variable's comma-separated string.
func setStatuses(dst *StatusSet, r any) error {
	var items []any
	switch v := r.(type) {
	case []any:
		items = v
	case string:
		s := strings.TrimSpace(v)
		if strings.HasPrefix(s, "[") && strings.HasSuffix(s, "]") {
			s = s[1 : len(s)-1]
		}
		for _, f := range strings.Split(s, ",") {
			if f = strings.Trim(strings.TrimSpace(f), `"'`); f != "" {
				items = append(items, f)
			}
		}
	default:
		return fmt.Errorf("%v is not a list of statuses (like [\"5xx\", 429])", r)
	}
	if len(items) == 0 {
		return fmt.Errorf("an empty list: every response would be a success (leave protocol at tcp to only time responses)")
	}
	if len(items) > 100 {
		return fmt.Errorf("%d entries; the limit is 100", len(items))
	}
	var set StatusSet
	var text []string
	for i, it := range items {
		var s string
		switch v := it.(type) {
		case int:
			s = strconv.Itoa(v)
		case string:
			s = strings.TrimSpace(v)
		default:
			return fmt.Errorf("[%d]: %v is not a status (503) or a class (5xx)", i, it)
		}
		switch {
		case len(s) == 3 && s[0] == '1' && strings.ToLower(s[1:]) == "xx":
			return fmt.Errorf("[%d]: %s: %s", i, quoteShort(s), informationalNote)
		case len(s) == 3 && s[0] >= '2' && s[0] <= '5' && strings.ToLower(s[1:]) == "xx":
			lo := int(s[0]-'0') * 100
			set.add(lo, lo+99)
			s = strings.ToLower(s)
		default:
			n, err := strconv.Atoi(s)
			if err != nil || n < 100 || n > 599 {
				return fmt.Errorf("[%d]: %s is not a status in [100, 599] or a class (2xx … 5xx)", i, quoteShort(s))
			}
			if n < 200 && n != 101 {
				return fmt.Errorf("[%d]: %d: %s", i, n, informationalNote)
			}
			set.add(n, n)
		}
		text = append(text, s)
	}
	set.text = "[" + strings.Join(text, ", ") + "]"
	*dst = set
	return nil
}

// checkResponses reports response options where they cannot apply: in
// `all` (every connection would be followed), on a target that covers no
// TCP, failure_statuses without protocol http, a slow threshold at or past
// the timeout.
func (d *decoder) checkResponses(path string, m map[string]any, t *Target) {
	if t == nil {
		for _, k := range sortedKeys(m) {
			if responseKeys[k] {
				d.add(path+"."+k, "only a target can set it (the kernel would follow every request of every connection); set it on the targets whose responses count")
			}
		}
		return
	}
	r := &t.Options.Responses
	if !r.droppedSet {
		r.IgnoreDropped = !r.HTTP
	}
	if _, ok := m["failure_statuses"]; ok && !r.HTTP {
		d.add(path+".failure_statuses", "needs protocol: http (without it no status is read)")
	}
	if _, ok := m["count_dropped"]; ok && !r.Followed() {
		d.add(path+".count_dropped", "needs slow_response_duration, response_timeout or protocol: http (without them no response is followed)")
	}
	if r.Followed() && t.Match.Proto != "tcp" {
		for _, k := range sortedKeys(m) {
			if responseKeys[k] {
				d.add(path+"."+k, "needs match.protocol tcp (responses are followed on TCP connections; this target's protocol is %s)", t.Match.Proto)
			}
		}
	}
	if s, to := r.SlowResponseDuration, r.ResponseTimeout; s > 0 && to > 0 && s >= to {
		d.add(path+".slow_response_duration", "%v is not shorter than response_timeout %v (no response could be slow)", s, to)
	}
}

// responsesReference is the configuration reference's section on responses.
const responsesReference = "## Responses\n\n" +
	"A target with `slow_response_duration`, `response_timeout` or `protocol: http` counts its responses, not only its connections. " +
	"The kernel follows every connection of the protected cgroup to the target, with no proxy and no change to the client: per connection, a **turn** begins with the first new byte the client sends while no earlier request awaits its answer, and its response begins with the first new byte received after it. " +
	"Each turn is one call of the target's circuit: a response is a success (slow when its first byte came `slow_response_duration` or more after its request's first byte), a failure when its status is in `failure_statuses` (`protocol: http`), and a failure when no byte of it came within `response_timeout`, counted at that moment by the daemon, not when the client gives up. " +
	"A connection the peer resets while a request awaits its first response byte is a failure too, and one it closes is with `count_dropped`; one the client closes first counts as nothing (unless it waited `response_timeout`), also after a goodbye that has no answer (PostgreSQL's Terminate, memcached's `quit`) when the client closes or shuts its side before the server closes. A server that closes first (memcached mostly does, a PostgreSQL backend seldom) cannot be told from one that drops the request without parsing: with `count_dropped: false`, the default on every target but `protocol: http` ones, a peer's close before any response byte counts as nothing (a reset still fails). " +
	"The handshake is then not a call of its own (refused, timed-out and other failed connects still are), so a client that opens a connection per request and one that keeps it alive count the same; a half-open probe's result is its first response. " +
	"Timing needs no parsing: it works for HTTP/1, Redis, PostgreSQL, memcached and any protocol where the client speaks first and waits for an answer (a server's greeting before any request, as MySQL's, is not a turn).\n\n" +
	"With `protocol: http` the kernel reads the status line (`HTTP/1.1 503`) at the start of each response, also when it is split across segments; bodies are never read, so a body holding `HTTP/1.1 500` changes nothing, whether plain, chunked or many segments long. " +
	"By default a 5xx or a 429 is a failure and every other status a success, as the router counts them; `failure_statuses` lists statuses (`503`) and classes (`5xx`). " +
	"An informational response is not the response: after a 1xx (`100 Continue`, also one sent before the request body, `103 Early Hints`) the kernel reads on, past its header block, to the turn's first status that is not 1xx, whether it comes in the same segment or later, and times the response to it (`response_timeout` runs until it; a peer's close before it is a dropped request). In one segment the kernel reads up to 4 status lines after a 1xx and up to 4 KiB of a 1xx's header block (a server sends one or two short ones); the rest of such a segment is not read. " +
	"`101 Switching Protocols` is final: it is the turn's response (a success unless `failure_statuses` lists 101), and the connection, no longer HTTP, begins no more turns; so is a `2xx` to a `CONNECT`, after which the connection is a tunnel. A response that does not start with an HTTP/1.x status line is a success. " +
	"**Plaintext HTTP/1.x only**: over TLS or HTTP/2 no status line is visible in the bytes, so those stay connection-level (with `protocol: http` their turns are timed and every answer is a success; prefer `protocol: tcp` and the timing options there). " +
	"**Pipelined requests** (several sent before the first answer) are one turn: timed from the first request's first byte to the first response byte, judged by the first response's status; the following responses are not read.\n\n" +
	"Response options are a target's only (in `all` they would make the kernel follow every connection) and need `match.protocol: tcp`. `failure_statuses` needs `protocol: http`; `slow_response_duration` must be shorter than `response_timeout`. " +
	"The programs that follow responses run only while some target has these options (see *Cost* in [the Responses guide](guides/responses.md)). " +
	"A connection is marked for them when it connects: options a reload adds or changes apply to connections made from then on (a connection made before keeps what it was marked with; records of a target that no longer has the options are ignored), and the daemon counts no turn begun before it started or before the programs were last attached.\n\n"
