package maps

import (
	"testing"
	"time"

	"github.com/breakerd/breakerd/bpf"
)

// The heartbeat's write of the settings takes no lock that attaching, the
// ground check or a repair hold (k.mu), and keeps what the loader says in
// them: reset_seen's flag and the cgroup attached to.
func TestSetSettingsTakesNoLoaderLock(t *testing.T) {
	e := newEnv(t, Options{})
	e.k.mu.Lock()
	done := make(chan error, 1)
	go func() { done <- e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, MaxRTO: 7}) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(10 * time.Second):
		e.k.mu.Unlock()
		<-done
		t.Fatal("SetSettings waited for the kernel's lock (held by attaching, the ground check and repairs)")
	}
	tracing, id := e.k.tracing(), e.k.cgroupID
	e.k.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	var raw bpf.BreakerSettings
	if err := e.k.objs.Config.Lookup(uint32(0), &raw); err != nil {
		t.Fatal(err)
	}
	if raw.MaxRto != 7 {
		t.Fatalf("max_rto %d: the write did not land", raw.MaxRto)
	}
	if raw.AttachCgroupId != id || id == 0 {
		t.Errorf("attach_cgroup_id %d, want the attached cgroup's %d", raw.AttachCgroupId, id)
	}
	if got := raw.Flags&uint32(bpf.BreakerConfigFlagsCONFIG_RESET_TRACE) != 0; got != tracing {
		t.Errorf("CONFIG_RESET_TRACE %v, want %v (reset_seen attached)", got, tracing)
	}
}
