package deploy

import (
	"bufio"
	"context"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/internal/kubeapitest"
)

// shippedRBAC decodes rbac.yaml strictly: the ClusterRole and its binding.
func shippedRBAC(t *testing.T) (*rbacv1.ClusterRole, *rbacv1.ClusterRoleBinding) {
	t.Helper()
	data, err := os.ReadFile("rbac.yaml")
	if err != nil {
		t.Fatal(err)
	}
	docs := strings.Split(string(data), "\n---\n")
	if len(docs) != 2 {
		t.Fatalf("rbac.yaml has %d documents, want the ClusterRole and its binding", len(docs))
	}
	var role rbacv1.ClusterRole
	var binding rbacv1.ClusterRoleBinding
	if err := yaml.UnmarshalStrict([]byte(docs[0]), &role); err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict([]byte(docs[1]), &binding); err != nil {
		t.Fatal(err)
	}
	return &role, &binding
}

// serviceAccountToken makes the service account (as serviceaccount.yaml
// ships it, in namespace ns) and returns a token for it.
func serviceAccountToken(t *testing.T, cs kubernetes.Interface, ns, name string) string {
	t.Helper()
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	var sa corev1.ServiceAccount
	decodeStrict(t, "serviceaccount.yaml", &sa)
	sa.Namespace, sa.Name = ns, name
	if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token request: %v", err)
	}
	return tr.Status.Token
}

// TestShippedRBACAgainstAPIServer binds the shipped ClusterRole to the
// shipped service account on a real kube-apiserver and checks, with that
// account's token, what it may and may not do.
func TestShippedRBACAgainstAPIServer(t *testing.T) {
	api := kubeapitest.Start(t)
	admin := api.Clientset(t)
	ctx := context.Background()
	role, binding := shippedRBAC(t)
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sub := binding.Subjects[0]
	token := serviceAccountToken(t, admin, sub.Namespace, sub.Name)
	cs, err := kubernetes.NewForConfig(api.TokenConfig(token))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "pay"}, Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 80}}}}
	if _, err := admin.CoreV1().Services("shop").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	allowed := map[string]func() error{
		"list services": func() error { _, err := cs.CoreV1().Services("").List(ctx, metav1.ListOptions{}); return err },
		"watch services": func() error {
			w, err := cs.CoreV1().Services("shop").Watch(ctx, metav1.ListOptions{})
			stop(w)
			return err
		},
		"list endpointslices": func() error {
			_, err := cs.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
			return err
		},
		"watch endpointslices": func() error {
			w, err := cs.DiscoveryV1().EndpointSlices("shop").Watch(ctx, metav1.ListOptions{})
			stop(w)
			return err
		},
		"create and patch events": func() error {
			ev, err := cs.CoreV1().Events("shop").Create(ctx, &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "breakerd-test"},
				InvolvedObject: corev1.ObjectReference{Kind: "Service", Namespace: "shop", Name: "pay"}, Reason: "CircuitOpened", Message: "m", Type: "Warning", Count: 1}, metav1.CreateOptions{})
			if err != nil {
				return err
			}
			_, err = cs.CoreV1().Events("shop").Patch(ctx, ev.Name, types.StrategicMergePatchType, []byte(`{"count":2}`), metav1.PatchOptions{})
			return err
		},
	}
	denied := map[string]func() error{
		"list secrets": func() error { _, err := cs.CoreV1().Secrets("").List(ctx, metav1.ListOptions{}); return err },
		"get a secret": func() error { _, err := cs.CoreV1().Secrets("shop").Get(ctx, "x", metav1.GetOptions{}); return err },
		"create services": func() error {
			_, err := cs.CoreV1().Services("shop").Create(ctx, svc.DeepCopy(), metav1.CreateOptions{})
			return err
		},
		"delete services": func() error { return cs.CoreV1().Services("shop").Delete(ctx, "pay", metav1.DeleteOptions{}) },
		"patch services": func() error {
			_, err := cs.CoreV1().Services("shop").Patch(ctx, "pay", types.MergePatchType, []byte(`{}`), metav1.PatchOptions{})
			return err
		},
		"create endpointslices": func() error {
			_, err := cs.DiscoveryV1().EndpointSlices("shop").Create(ctx, &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: "x"}, AddressType: "IPv4"}, metav1.CreateOptions{})
			return err
		},
		"list configmaps": func() error { _, err := cs.CoreV1().ConfigMaps("").List(ctx, metav1.ListOptions{}); return err },
		"get nodes":       func() error { _, err := cs.CoreV1().Nodes().Get(ctx, "n", metav1.GetOptions{}); return err },
		"delete events":   func() error { return cs.CoreV1().Events("shop").Delete(ctx, "breakerd-test", metav1.DeleteOptions{}) },
		"create pods": func() error {
			_, err := cs.CoreV1().Pods("shop").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "x"}}, metav1.CreateOptions{})
			return err
		},
		"escalate: create roles": func() error {
			_, err := cs.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "x"}}, metav1.CreateOptions{})
			return err
		},
	}
	for what, f := range allowed {
		if err := f(); err != nil {
			t.Errorf("%s: refused: %v", what, err)
		}
	}
	for what, f := range denied {
		if err := f(); !apierrors.IsForbidden(err) {
			t.Errorf("%s: want Forbidden, got %v", what, err)
		}
	}
}

func stop(w interface{ Stop() }) {
	if w != nil {
		w.Stop()
	}
}

// writeKubeconfig writes a kubeconfig for the API server with a bearer token.
func writeKubeconfig(t *testing.T, api *kubeapitest.Server, token string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: %q, certificate-authority-data: %s}}]
users: [{name: breakerd, user: {token: %q}}]
contexts: [{name: test, context: {cluster: test, user: breakerd}}]
current-context: test
`, api.URL, base64.StdEncoding.EncodeToString(api.CAData), token)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// metricValue reads one series from a Prometheus text exposition.
func metricValue(t *testing.T, addr, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return -1
}

// TestBreakerdWithShippedRBAC runs the real breakerd binary on a child
// cgroup with a kubeconfig holding a token of the shipped service account
// bound to the shipped ClusterRole: it resolves a Service target and
// rejects connects to its endpoint, and posts a ServiceNotFound Event for
// a Service that does not exist. With a token of an account that has no
// binding, it reports the RBAC denial and backs off instead of retrying in
// a hot loop.
func TestBreakerdWithShippedRBAC(t *testing.T) {
	kerneltest.RequireKernel(t)
	api := kubeapitest.Start(t)
	admin := api.Clientset(t)
	ctx := context.Background()
	role, binding := shippedRBAC(t)
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sub := binding.Subjects[0]
	token := serviceAccountToken(t, admin, sub.Namespace, sub.Name)
	unbound := serviceAccountToken(t, admin, sub.Namespace, "unbound")

	dir := t.TempDir()
	bin := filepath.Join(dir, "breakerd")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/breakerd").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	cg := kerneltest.NewCgroup(t)
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	srv.StartCounting(t)
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Services("shop").Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "pay"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pn, port, proto, yes := "http", int32(8080), corev1.ProtocolTCP, true
	if _, err := admin.DiscoveryV1().EndpointSlices("shop").Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "pay-1", Labels: map[string]string{discoveryv1.LabelServiceName: "pay"}}, AddressType: discoveryv1.AddressTypeIPv4,
		Ports:     []discoveryv1.EndpointPort{{Name: &pn, Port: &port, Protocol: &proto}},
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{srv.IPv4.String()}, Conditions: discoveryv1.EndpointConditions{Ready: &yes, Serving: &yes}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "b.yaml")
	os.WriteFile(cfg, []byte("targets:\n  pay:\n    match: {service: shop/pay}\n    state: forced_open\n  gone:\n    match: {service: shop/gone}\n"), 0o644)

	start := func(t *testing.T, token, node, bpffs string) (*exec.Cmd, string, *kerneltest.LogBuffer) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		cmd := exec.Command(bin, "--config", cfg, "--cgroup", cg.Path, "--bpffs", bpffs, "--admin-addr", addr,
			"--admin-socket", filepath.Join(dir, kerneltest.UniqueName()+".sock"), "--kubeconfig", writeKubeconfig(t, api, token), "--node-name", node)
		logs := &kerneltest.LogBuffer{}
		cmd.Stderr = logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if cmd.ProcessState == nil {
				cmd.Process.Signal(unix.SIGTERM)
				cmd.Wait()
			}
		})
		return cmd, addr, logs
	}
	waitReady := func(t *testing.T, addr string, logs *kerneltest.LogBuffer) {
		t.Helper()
		if !kerneltest.WaitFor(20*time.Second, func() bool {
			resp, err := http.Get("http://" + addr + "/readyz")
			if err != nil {
				return false
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK
		}) {
			t.Fatalf("breakerd not ready:\n%s", logs.String())
		}
	}
	run := func(t *testing.T, token, node string) (*exec.Cmd, string, string, *kerneltest.LogBuffer) {
		bpffs := filepath.Join(kerneltest.BPFFSRoot, kerneltest.UniqueName())
		t.Cleanup(func() {
			exec.Command(bin, "uninstall", "--bpffs", bpffs).Run()
			os.RemoveAll(bpffs)
		})
		cmd, addr, logs := start(t, token, node, bpffs)
		waitReady(t, addr, logs)
		return cmd, bpffs, addr, logs
	}

	dest := netip.AddrPortFrom(srv.IPv4, 8080)
	t.Run("bound to the shipped ClusterRole", func(t *testing.T) {
		first, bpffs, _, logs := run(t, token, "node-a")
		var res []kerneltest.DialResult
		if !kerneltest.WaitFor(10*time.Second, func() bool {
			res = topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dest, Count: 1, Timeout: time.Second})
			return res[0].Errno == unix.ECONNREFUSED
		}) {
			t.Fatalf("the Service's endpoint is not rejected: %v\n%s", res, logs.String())
		}
		if n := srv.SYNs(t); n != 0 {
			t.Fatalf("%d SYNs reached a forced-open Service's endpoint", n)
		}
		if !kerneltest.WaitFor(10*time.Second, func() bool {
			list, err := admin.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=node-a"})
			if err != nil {
				return false
			}
			for _, e := range list.Items {
				if e.Reason == "ServiceNotFound" && strings.Contains(e.Message, "shop/gone") && e.Source.Component == "breakerd" {
					return true
				}
			}
			return false
		}) {
			t.Fatalf("no ServiceNotFound Event on the Node:\n%s", logs.String())
		}
		if strings.Contains(logs.String(), "RBAC denies") {
			t.Fatalf("denied with the shipped role:\n%s", logs.String())
		}

		// A second breakerd on the same pins is refused; after a SIGKILL
		// of the first, a new one adopts the pins and resolves the Service
		// again, and a client loop across both stays rejected.
		second, _, secondLogs := start(t, token, "node-a", bpffs)
		if err := second.Wait(); err == nil || !strings.Contains(secondLogs.String(), "another breakerd is running on these pins") {
			t.Fatalf("second breakerd on the same pins: %v\n%s", err, secondLogs.String())
		}
		srv.Listen(t, "tcp4", 8080) // healthy: only the verdict rejects
		done := make(chan []kerneltest.DialResult, 1)
		go func() {
			done <- topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dest, Op: "rate", Rate: 200, For: 4 * time.Second, Timeout: time.Second})
		}()
		time.Sleep(500 * time.Millisecond)
		first.Process.Kill()
		first.Wait()
		_, addr, thirdLogs := start(t, token, "node-a", bpffs)
		waitReady(t, addr, thirdLogs)
		counts := map[unix.Errno]int64{}
		for _, r := range <-done {
			counts[r.Errno] += r.Nanos
		}
		if len(counts) != 1 || counts[unix.ECONNREFUSED] < 300 {
			t.Fatalf("connects across a SIGKILL and a new start: %v, want only ECONNREFUSED\n%s", counts, thirdLogs.String())
		}
		if n := srv.SYNs(t); n != 0 {
			t.Fatalf("%d SYNs reached a forced-open Service's endpoint", n)
		}
	})

	t.Run("without a binding", func(t *testing.T) {
		_, _, addr, logs := run(t, unbound, "node-b")
		if !kerneltest.WaitFor(10*time.Second, func() bool { return strings.Contains(logs.String(), "RBAC denies listing or watching services") }) {
			t.Fatalf("the denial is not reported:\n%s", logs.String())
		}
		series := `breakerd_kubernetes_watch_errors_total{reason="forbidden",resource="services"}`
		before := metricValue(t, addr, series)
		time.Sleep(6 * time.Second)
		after := metricValue(t, addr, series)
		t.Logf("forbidden lists of services: %v, then %v six seconds later", before, after)
		if before < 1 || after-before > 8 {
			t.Fatalf("forbidden lists: %v then %v over 6 s: want them reported and backed off", before, after)
		}
		if n := strings.Count(logs.String(), "RBAC denies listing or watching services"); n > 2 {
			t.Fatalf("the denial is logged %d times in a few seconds", n)
		}
	})
}
