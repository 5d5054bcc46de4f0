package fleet

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
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
