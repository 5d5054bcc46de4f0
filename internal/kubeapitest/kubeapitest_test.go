package kubeapitest

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestStart starts a real API server, writes and reads an object through
// it, and checks it started within a few seconds.
func TestStart(t *testing.T) {
	start := time.Now()
	s := Start(t)
	took := time.Since(start)
	t.Logf("etcd + kube-apiserver ready in %v", took.Round(time.Millisecond))
	cs := s.Clientset(t)
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kubeapitest-start"}}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating a namespace: %v", err)
	}
	got, err := cs.CoreV1().Namespaces().Get(ctx, ns.Name, metav1.GetOptions{})
	if err != nil || got.Name != ns.Name {
		t.Fatalf("reading it back: %v %v", got, err)
	}
	if took > 30*time.Second {
		t.Errorf("took %v to start", took)
	}
}
