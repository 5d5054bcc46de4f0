package kubeapitest

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"strings"
	"testing"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"
)

// Apply creates every object of the repository's file deploy/NAME (YAML
// documents separated by ---) with the admin's credentials, as `kubectl
// apply -f` would on a fresh cluster, refusing unknown fields.
func (s *Server) Apply(tb testing.TB, name string) {
	tb.Helper()
	data := deployFile(tb, name)
	dc, err := discovery.NewDiscoveryClientForConfig(s.Admin)
	if err != nil {
		tb.Fatal(err)
	}
	groups, err := restmapper.GetAPIGroupResources(dc)
	if err != nil {
		tb.Fatalf("discovering the API's resources: %v", err)
	}
	mapper := restmapper.NewDiscoveryRESTMapper(groups)
	dyn, err := dynamic.NewForConfig(s.Admin)
	if err != nil {
		tb.Fatal(err)
	}
	for i, doc := range strings.Split(string(data), "\n---\n") {
		var obj map[string]any
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			tb.Fatalf("decoding document %d of %s: %v", i, name, err)
		}
		if obj == nil {
			continue // only comments
		}
		u := &unstructured.Unstructured{Object: obj}
		gvk := u.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			tb.Fatalf("%s: %s %s: %v", name, gvk, u.GetName(), err)
		}
		// Strict, as kubectl: a field the API does not know is an error.
		if _, err := dyn.Resource(m.Resource).Namespace(u.GetNamespace()).Create(context.Background(), u,
			metav1.CreateOptions{FieldValidation: metav1.FieldValidationStrict}); err != nil {
			tb.Fatalf("%s: creating %s %s: %v", name, gvk.Kind, u.GetName(), err)
		}
	}
}

// NodeToken makes the Node node (unless it exists) and a pod of the
// service account namespace/account bound to it (spec.nodeName, as the
// scheduler binds a DaemonSet's pod), and returns a token bound to that
// pod, as the kubelet projects into it: the API server puts the node's
// name in its user info (authentication.kubernetes.io/node-name).
func (s *Server) NodeToken(tb testing.TB, namespace, account, node string) string {
	tb.Helper()
	token, err := s.nodeToken(context.Background(), namespace, account, node)
	if err != nil {
		tb.Fatal(err)
	}
	return token
}

func (s *Server) nodeToken(ctx context.Context, namespace, account, node string) (string, error) {
	cs, err := kubernetes.NewForConfig(s.Admin)
	if err != nil {
		return "", err
	}
	_, err = cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("creating node %s: %w", node, err)
	}
	pod, err := cs.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: account + "-"},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: account,
			Containers: []corev1.Container{{Name: account, Image: "kubeapitest.invalid/pause"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("creating a pod of %s/%s on node %s: %w", namespace, account, node, err)
	}
	tr, err := cs.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, account, &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("a token of %s/%s bound to pod %s: %w", namespace, account, pod.Name, err)
	}
	return tr.Status.Token, nil
}

// TokenKubeconfig writes a kubeconfig file that authenticates with token
// (NodeToken's) and returns its path; the file goes when the Server does.
func (s *Server) TokenKubeconfig(tb testing.TB, token string) string {
	tb.Helper()
	f, err := os.CreateTemp(s.dir, "token-*.kubeconfig")
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	fmt.Fprintf(f, `apiVersion: v1
kind: Config
clusters: [{name: t, cluster: {server: %q, certificate-authority-data: %s}}]
users: [{name: u, user: {token: %q}}]
contexts: [{name: c, context: {cluster: t, user: u}}]
current-context: c
`, s.URL, base64.StdEncoding.EncodeToString(s.CAData), token)
	if err := f.Close(); err != nil {
		tb.Fatal(err)
	}
	return f.Name()
}
