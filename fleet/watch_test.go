package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"
)

// TestCompact: the Watcher's cache keeps a report as a CircuitReport
// without managedFields, with its circuits; compacting twice changes
// nothing; a report that does not decode stays as it came, for the
// handler to log and skip.
func TestCompact(t *testing.T) {
	u, err := ToUnstructured(reportOf("node-a", circuitAt("payments"), circuitAt("tcp/192.0.2.7:443")))
	if err != nil {
		t.Fatal(err)
	}
	u.SetManagedFields([]metav1.ManagedFieldsEntry{{Manager: FieldManager, Operation: metav1.ManagedFieldsOperationApply}})
	u.SetResourceVersion("42")
	got, err := compact(u)
	if err != nil {
		t.Fatal(err)
	}
	r, ok := got.(*CircuitReport)
	if !ok {
		t.Fatalf("compact returned %T, want *CircuitReport", got)
	}
	if r.Name != "node-a" || r.ResourceVersion != "42" || r.ManagedFields != nil || len(r.Spec.Circuits) != 2 || r.Spec.Circuits[0].Key != "payments" {
		t.Fatalf("compacted report %+v", r)
	}
	if again, _ := compact(r); again != any(r) {
		t.Fatalf("compacting a compacted report returned %v", again)
	}

	bad := &unstructured.Unstructured{Object: map[string]any{"metadata": map[string]any{"name": "node-b"}, "spec": "not a spec"}}
	if got, err := compact(bad); err != nil || got != any(bad) {
		t.Fatalf("compact of an undecodable report: %v, %v; want it unchanged", got, err)
	}
}

// TestWatcherCountsFailedReads runs a Watcher against an endpoint that
// refuses streaming lists as invalid (as an API server without them
// does), lists, and then fails: each failed watch is counted as one, the
// refused streaming lists not at all, and each failed list once the
// lists fail too.
func TestWatcherCountsFailedReads(t *testing.T) {
	var listsFail atomic.Bool
	var lists atomic.Int64
	status := func(w http.ResponseWriter, code int, reason metav1.StatusReason) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		json.NewEncoder(w).Encode(metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
			Status: metav1.StatusFailure, Reason: reason, Code: int32(code)})
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		switch {
		case q.Get("watch") == "true" && q.Get("sendInitialEvents") == "true":
			status(w, http.StatusUnprocessableEntity, metav1.StatusReasonInvalid)
		case q.Get("watch") == "true":
			status(w, http.StatusServiceUnavailable, metav1.StatusReasonServiceUnavailable)
		case listsFail.Load():
			status(w, http.StatusInternalServerError, metav1.StatusReasonInternalError)
		default:
			lists.Add(1)
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"apiVersion":%q,"kind":"CircuitReportList","metadata":{"resourceVersion":"1"},"items":[]}`, Group+"/"+Version)
		}
	}))
	defer srv.Close()
	w, err := NewWatcher(&rest.Config{Host: srv.URL}, func(*CircuitReport) {}, func(string) {}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	if !waitFor(10*time.Second, func() bool { return w.Errors().Watch >= 1 }) {
		t.Fatalf("no failed watch counted: %+v after %d lists", w.Errors(), lists.Load())
	}
	if e := w.Errors(); e.List != 0 {
		t.Fatalf("the refused streaming lists counted as failed lists: %+v (%d lists served)", e, lists.Load())
	}
	listsFail.Store(true)
	if !waitFor(10*time.Second, func() bool { return w.Errors().List >= 1 }) {
		t.Fatalf("no failed list counted: %+v", w.Errors())
	}
}

func waitFor(limit time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}
