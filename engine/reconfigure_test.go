package engine_test

import (
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

const reloadBefore = `
all:
  consecutive_failures: 1
  open_duration: 121s
  jitter: 0
  reject_errno: EHOSTUNREACH
targets:
  pay:
    match: {cidrs: [SRV], ports: ["8101-8103"]}
    scope: endpoint
    max_ejection_percent: 34
    consecutive_failures: 1
    open_duration: 1m
  svc:
    match: {cidrs: [SRV], ports: ["9431"]}
    consecutive_failures: 1
    open_duration: 1m
  gone:
    match: {cidrs: [SRV], ports: ["9441"]}
    consecutive_failures: 1
    open_duration: 1m
`

// A reload keeps every circuit whose matching still holds, with its
// state, open time and verdict, and gives it the new options; it drops
// the circuits of a removed target and the dynamic circuit of a
// destination a target now matches; a changed `state` key wins over an
// override set by hand; an endpoint group follows a new
// max_ejection_percent while its ejected endpoint stays open.
func TestReloadKeepsWhatStillMatches(t *testing.T) {
	f := newFed(t, reloadBefore, nil)
	for _, p := range []uint16{7001, 9432, 8101, 9431, 9441} {
		f.refused(p, 1)
		f.wantState(p, policy.Open)
	}
	f.refused(8102, 1)
	f.wantState(8102, policy.Closed) // 34% of three: one ejected
	dyn, svc := f.at(7001), f.at(9431)
	before, dynVerdict := f.status(7001), f.verdict(dest(7001))
	f.e.Force(svc, "close", f.clk.Now())
	f.wantState(9431, policy.ForcedClosed)

	f.clk.Advance(10 * time.Second)
	after := strings.NewReplacer("121s", "122s", "34", "67", `["9431"]`, `["9431-9432"]`).Replace(reloadBefore)
	after = after[:strings.Index(after, "  gone:")] + "    state: forced_open\n"
	ch := f.reload(after)
	if !ch.AllChanged || len(ch.Removed) != 1 || ch.Removed[0] != "gone" {
		t.Fatalf("change %+v, want all changed and gone removed", ch)
	}

	// The dynamic circuit: the same one, open until the same time, its
	// verdict untouched, with the new options.
	if f.at(7001) != dyn || !f.status(7001).OpenUntil.Equal(before.OpenUntil) || f.verdict(dest(7001)) != dynVerdict {
		t.Fatalf("dynamic circuit after the reload: %+v, verdict %+v; before %+v, %+v", f.status(7001), f.verdict(dest(7001)), before, dynVerdict)
	}
	if o := dyn.Machine.Options(); o.OpenDuration != 122*time.Second {
		t.Fatalf("new options not applied: open_duration %v", o.OpenDuration)
	}
	// The removed target's circuit and verdict are gone.
	if f.at(9441) != nil && f.at(9441).Target() == "gone" || f.hasVerdict(dest(9441)) {
		t.Fatalf("removed target: circuit %v, verdict %v", f.at(9441), f.hasVerdict(dest(9441)))
	}
	// 9432 now belongs to svc: its dynamic circuit and verdict went, and
	// svc's circuit covers it, in the state the configuration now says
	// (over the override set by hand).
	if c := f.at(9432); c != svc {
		t.Fatalf("9432 belongs to %v after the reload, want svc's circuit", c)
	}
	f.wantState(9431, policy.ForcedOpen)
	if v := f.verdict(dest(9432)); v.State != maps.ForcedOpen {
		t.Fatalf("9432's verdict %+v, want svc's forced open", v)
	}
	for name := range f.k.Overrides() {
		if name == svc.Name() {
			t.Fatal("the override set by hand is still kept after the configuration set a state")
		}
	}
	// The endpoint group: the ejected endpoint stays open, and at 67%
	// a second may go.
	f.wantState(8101, policy.Open)
	f.refused(8102, 1)
	f.wantState(8102, policy.Open)
	f.refused(8103, 1)
	f.wantState(8103, policy.Closed)
}
