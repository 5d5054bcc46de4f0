package fleet

import (
	"context"
	"fmt"
	"slices"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
)

// FieldManager is the field manager of breakerd's server-side applies.
const FieldManager = "breakerd"

// KubeStore reads and writes reports in the Kubernetes API.
type KubeStore struct {
	client dynamic.NamespaceableResourceInterface
}

// NewKubeStore returns a store on the API server cfg reaches.
func NewKubeStore(cfg *rest.Config) (*KubeStore, error) {
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("fleet store client: %w", err)
	}
	return &KubeStore{client: dc.Resource(GroupVersionResource)}, nil
}

// Apply writes r with a server-side apply (breakerd's field manager,
// forced): one request that creates the report when it is missing and
// otherwise replaces its spec, with no read before and no conflict on a
// stale resource version.
func (s *KubeStore) Apply(ctx context.Context, r *CircuitReport) error {
	u, err := ToUnstructured(r)
	if err != nil {
		return err
	}
	if _, err := s.client.Apply(ctx, r.Name, u, metav1.ApplyOptions{FieldManager: FieldManager, Force: true}); err != nil {
		return fmt.Errorf("applying the CircuitReport of %s: %w", r.Name, err)
	}
	return nil
}

// Get reads the report of a node.
func (s *KubeStore) Get(ctx context.Context, node string) (*CircuitReport, error) {
	u, err := s.client.Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("reading the CircuitReport of %s: %w", node, err)
	}
	return FromUnstructured(u)
}

// List returns every report and the list's resource version (to watch
// from).
func (s *KubeStore) List(ctx context.Context) ([]*CircuitReport, string, error) {
	l, err := s.client.List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, "", fmt.Errorf("listing CircuitReports: %w", err)
	}
	out := make([]*CircuitReport, 0, len(l.Items))
	for i := range l.Items {
		r, err := FromUnstructured(&l.Items[i])
		if err != nil {
			return nil, "", err
		}
		out = append(out, r)
	}
	return out, l.GetResourceVersion(), nil
}

// Watch watches every report from resourceVersion.
func (s *KubeStore) Watch(ctx context.Context, resourceVersion string) (watch.Interface, error) {
	w, err := s.client.Watch(ctx, metav1.ListOptions{ResourceVersion: resourceVersion, AllowWatchBookmarks: true})
	if err != nil {
		return nil, fmt.Errorf("watching CircuitReports: %w", err)
	}
	return w, nil
}

// ToUnstructured converts a report for the dynamic client.
func ToUnstructured(r *CircuitReport) (*unstructured.Unstructured, error) {
	r = r.DeepCopy()
	r.APIVersion, r.Kind = Group+"/"+Version, Kind
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(r)
	if err != nil {
		return nil, fmt.Errorf("encoding the CircuitReport of %s: %w", r.Name, err)
	}
	return &unstructured.Unstructured{Object: m}, nil
}

// FromUnstructured converts what the dynamic client returned.
func FromUnstructured(u *unstructured.Unstructured) (*CircuitReport, error) {
	var r CircuitReport
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &r); err != nil {
		return nil, fmt.Errorf("decoding the CircuitReport %s: %w", u.GetName(), err)
	}
	return &r, nil
}

// DeepCopy returns a copy of r that shares nothing with it.
func (r *CircuitReport) DeepCopy() *CircuitReport {
	if r == nil {
		return nil
	}
	out := &CircuitReport{TypeMeta: r.TypeMeta, Spec: r.Spec}
	r.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	out.Spec.Circuits = slices.Clone(r.Spec.Circuits)
	return out
}
