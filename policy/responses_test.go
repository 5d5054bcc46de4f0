package policy

import (
	"strings"
	"testing"
	"time"
)

func TestResponseOptions(t *testing.T) {
	c, err := Parse([]byte(`
targets:
  web:
    match: {cidrs: [10.0.0.0/24], ports: ["80"]}
    protocol: http
    slow_response_duration: 200ms
    response_timeout: 2s
  custom:
    match: {cidrs: [10.0.1.0/24]}
    protocol: http
    failure_statuses: [503, "4XX"]
  timed:
    match: {cidrs: [10.0.2.0/24]}
    response_timeout: 1s
  cache:
    match: {cidrs: [10.0.4.0/24]}
    slow_response_duration: 100ms
    count_dropped: false
  counted:
    match: {cidrs: [10.0.5.0/24]}
    slow_response_duration: 100ms
    count_dropped: true
  plain:
    match: {cidrs: [10.0.3.0/24]}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	web := c.Targets["web"].Options.Responses
	if !web.HTTP || web.SlowResponseDuration != 200*time.Millisecond || web.ResponseTimeout != 2*time.Second || !web.Followed() {
		t.Fatalf("web %+v", web)
	}
	for st, want := range map[uint16]bool{500: true, 503: true, 599: true, 429: true, 404: false, 200: false, 100: false, 428: false} {
		if web.FailureStatuses.Has(st) != want {
			t.Errorf("default failure statuses: %d is %v, want %v", st, !want, want)
		}
	}
	custom := c.Targets["custom"].Options.Responses.FailureStatuses
	for st, want := range map[uint16]bool{503: true, 500: false, 404: true, 429: true, 200: false} {
		if custom.Has(st) != want {
			t.Errorf("[503, 4XX]: %d is %v, want %v", st, !want, want)
		}
	}
	// count_dropped's default: counted with protocol http only.
	if r := c.Targets["timed"].Options.Responses; r.HTTP || !r.Followed() || !r.IgnoreDropped {
		t.Errorf("timed (tcp, count_dropped unset: false) %+v", r)
	}
	if web.IgnoreDropped {
		t.Errorf("web (http, count_dropped unset: true) %+v", web)
	}
	if r := c.Targets["counted"].Options.Responses; r.IgnoreDropped {
		t.Errorf("counted (tcp, count_dropped: true) %+v", r)
	}
	if r := c.Targets["cache"].Options.Responses; !r.IgnoreDropped || !r.Followed() {
		t.Errorf("cache (count_dropped: false) %+v", r)
	}
	if r := c.Targets["plain"].Options.Responses; r.Followed() {
		t.Errorf("a target without response options is followed: %+v", r)
	}
	if c.All.Responses.Followed() {
		t.Error("all is followed by default")
	}
}

func TestResponseOptionsBadInput(t *testing.T) {
	got := strings.Join(problems(t, `
all:
  response_timeout: 1s
targets:
  neg:
    match: {cidrs: [10.0.0.0/24]}
    slow_response_duration: -1s
    response_timeout: 5
  dns:
    match: {cidrs: [10.0.1.0/24], protocol: udp}
    protocol: http
  any:
    match: {cidrs: [10.0.2.0/24], protocol: any}
    response_timeout: 1s
  badlist:
    match: {cidrs: [10.0.3.0/24]}
    protocol: http
    failure_statuses: [5xx, 700, "teapot"]
  info:
    match: {cidrs: [10.0.11.0/24]}
    protocol: http
    failure_statuses: [5xx, 103]
  infoclass:
    match: {cidrs: [10.0.12.0/24]}
    protocol: http
    failure_statuses: ["1XX"]
  upgrade:
    match: {cidrs: [10.0.13.0/24]}
    protocol: http
    failure_statuses: [5xx, 101]
  empty:
    match: {cidrs: [10.0.4.0/24]}
    protocol: http
    failure_statuses: []
  noproto:
    match: {cidrs: [10.0.5.0/24]}
    failure_statuses: [503]
  proto:
    match: {cidrs: [10.0.6.0/24]}
    protocol: grpc
  order:
    match: {cidrs: [10.0.7.0/24]}
    slow_response_duration: 2s
    response_timeout: 1s
  tiny:
    match: {cidrs: [10.0.8.0/24]}
    response_timeout: 10us
  dropped:
    match: {cidrs: [10.0.9.0/24]}
    count_dropped: false
  droppedbad:
    match: {cidrs: [10.0.10.0/24]}
    response_timeout: 1s
    count_dropped: sometimes
`), "\n")
	for _, want := range []string{
		"all.response_timeout: only a target can set it",
		"targets.neg.slow_response_duration: -1s is not in",
		"targets.neg.response_timeout: 5 is not a duration",
		"targets.dns.protocol: needs match.protocol tcp",
		"targets.any.response_timeout: needs match.protocol tcp",
		"targets.badlist.failure_statuses: [1]: 700 is not a status in [100, 599]",
		"targets.info.failure_statuses: [1]: 103: an informational status is never a response's status",
		"targets.infoclass.failure_statuses: [0]: 1XX: an informational status is never a response's status",
		"targets.empty.failure_statuses: an empty list",
		"targets.noproto.failure_statuses: needs protocol: http",
		"targets.proto.protocol: grpc is not tcp or http",
		"targets.order.slow_response_duration: 2s is not shorter than response_timeout 1s",
		"targets.tiny.response_timeout: 10µs is not 0 (off) or in [1ms, 1h0m0s]",
		"targets.dropped.count_dropped: needs slow_response_duration, response_timeout or protocol: http",
		`targets.droppedbad.count_dropped: "sometimes" is not true or false`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in:\n%s", want, got)
		}
	}
}
