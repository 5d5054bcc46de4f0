package admin

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/breakerd/breakerd/admin/admintest"

	"github.com/breakerd/breakerd/api"
)

// fakeBackend is a daemon with one circuit, svc. Its zero value is live
// and ready; starting, stale and notReady change that. It counts the
// forces it was asked for.
type fakeBackend struct {
	starting        string
	stale, notReady bool
	mu              sync.Mutex
	forced          []string
}

func (b *fakeBackend) Starting() string { return b.starting }
func (b *fakeBackend) Live() (bool, time.Duration) {
	if b.stale {
		return false, 3 * time.Second
	}
	return true, 0
}
func (b *fakeBackend) Ready() (bool, any) {
	if b.notReady {
		return false, []string{"pins removed"}
	}
	return true, nil
}
func (b *fakeBackend) Metrics() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "up 1\n") })
}
func (b *fakeBackend) Events() []api.TransitionEvent { return []api.TransitionEvent{} }
func (b *fakeBackend) Circuit(name string) (api.CircuitInfo, bool) {
	return api.CircuitInfo{Name: "svc"}, name == "svc"
}
func (b *fakeBackend) CircuitsPage(after string, limit int) ([]api.CircuitInfo, bool) {
	if after != "" {
		return nil, false
	}
	return []api.CircuitInfo{{Name: "svc"}}, false
}
func (b *fakeBackend) Force(name, action string) (api.CircuitInfo, error) {
	if name != "svc" {
		return api.CircuitInfo{}, fmt.Errorf("%w: %s", ErrNoCircuit, Quote(name))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.forced = append(b.forced, action)
	return api.CircuitInfo{Name: "svc", State: "forced_" + action}, nil
}

// forces returns the actions Force was asked for.
func (b *fakeBackend) forces() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.forced)
}

// do serves one request through h, from remote if given.
var do = admintest.Do
