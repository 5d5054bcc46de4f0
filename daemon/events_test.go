package daemon

import "testing"

func TestEventRingNeverGrows(t *testing.T) {
	var r eventRing
	if got := r.list(); got == nil || len(got) != 0 {
		t.Fatalf("empty ring lists %#v, want an empty non-nil slice", got)
	}
	for i := range maxEvents + 5 {
		r.add(TransitionEvent{Calls: i})
	}
	got := r.list()
	if len(got) != maxEvents || got[0].Calls != 5 || got[maxEvents-1].Calls != maxEvents+4 {
		t.Fatalf("after %d adds: %d events, first %d, last %d", maxEvents+5, len(got), got[0].Calls, got[len(got)-1].Calls)
	}
}
