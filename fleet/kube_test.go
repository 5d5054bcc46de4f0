package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/internal/kubeapitest"
)

// fleetAPI is a real API server with deploy/'s CRD, admission policy and
// RBAC installed, and breakerd's service account.
type fleetAPI struct {
	api   *kubeapitest.Server
	admin *kubernetes.Clientset
	dyn   dynamic.Interface
}

// startFleetAPI starts a real API server and applies the shipped CRD
// (waiting until it is served), breakerd's namespace and service account,
// its RBAC, and the admission policy and its binding.
func startFleetAPI(t *testing.T) *fleetAPI {
	t.Helper()
	api := kubeapitest.Start(t)
	f := &fleetAPI{api: api, admin: api.Clientset(t)}
	var err error
	if f.dyn, err = dynamic.NewForConfig(api.Admin); err != nil {
		t.Fatal(err)
	}
	api.InstallCRD(t, "fleet-crd.yaml")
	for _, file := range []string{"namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "fleet-policy.yaml"} {
		api.Apply(t, file)
	}
	return f
}

// nodeToken makes a Node and a pod of breakerd's service account bound to
// it (spec.nodeName, as the scheduler binds a DaemonSet's pod), and returns
// a token bound to that pod, as the kubelet projects into it.
func (f *fleetAPI) nodeToken(t *testing.T, node string) string {
	t.Helper()
	token, err := makeNodeToken(context.Background(), f.admin, node)
	if err != nil {
		t.Fatal(err)
	}
	return token
}

// makeNodeToken is nodeToken with admin's client, for callers that make
// many at once.
func makeNodeToken(ctx context.Context, admin kubernetes.Interface, node string) (string, error) {
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
		return "", fmt.Errorf("creating node %s: %w", node, err)
	}
	pod, err := admin.CoreV1().Pods("breakerd").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "breakerd-" + node},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: "breakerd",
			Containers: []corev1.Container{{Name: "breakerd", Image: "ghcr.io/breakerd/breakerd:latest"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("creating the pod of node %s: %w", node, err)
	}
	tr, err := admin.CoreV1().ServiceAccounts("breakerd").CreateToken(ctx, "breakerd", &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token bound to pod %s: %w", pod.Name, err)
	}
	return tr.Status.Token, nil
}

// store returns a KubeStore that authenticates with token.
func (f *fleetAPI) store(t *testing.T, token string) *KubeStore {
	t.Helper()
	s, err := NewKubeStore(f.api.TokenConfig(token))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// table returns the printer columns of a report, as the API server renders
// them for kubectl get ("Open=1 Omitted=0 …", Age left out).
func (f *fleetAPI) table(t *testing.T, node string) string {
	t.Helper()
	raw, err := f.admin.CoreV1().RESTClient().Get().AbsPath("/apis", Group, Version, Resource, node).
		SetHeader("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io").DoRaw(context.Background())
	if err != nil {
		t.Fatalf("table of %s: %v", node, err)
	}
	var tbl metav1.Table
	if err := json.Unmarshal(raw, &tbl); err != nil || len(tbl.Rows) != 1 {
		t.Fatalf("table of %s: %v: %s", node, err, raw)
	}
	var cols []string
	for i, c := range tbl.ColumnDefinitions {
		if c.Name != "Name" && c.Name != "Age" {
			cols = append(cols, fmt.Sprintf("%s=%v", c.Name, tbl.Rows[0].Cells[i]))
		}
	}
	return strings.Join(cols, " ")
}

// circuitAt is a well-formed entry, open from now for a minute.
func circuitAt(key string) Circuit {
	now := time.Now()
	return Circuit{Key: key, Target: "all", Workload: "shared", Since: metav1.NewMicroTime(now),
		OpenUntil: metav1.NewMicroTime(now.Add(time.Minute)), Reason: "consecutive_failures"}
}

func reportOf(node string, cs ...Circuit) *CircuitReport {
	r := &CircuitReport{Spec: ReportSpec{Open: len(cs), Circuits: cs}}
	r.Name = node
	if r.Spec.Circuits == nil {
		r.Spec.Circuits = []Circuit{}
	}
	return r
}

// TestFleetOwnReportOnly: with the shipped CRD, RBAC and admission policy
// on a real API server, a token bound to a pod on node A writes A's report
// (the Writer creates it, and creates it again once deleted) and reads
// every report; it is refused writing B's, by the admission policy; a
// token bound to no pod writes no report.
func TestFleetOwnReportOnly(t *testing.T) {
	f := startFleetAPI(t)
	ctx := context.Background()
	suffix := strings.ToLower(kerneltest.UniqueName())
	nodeA, nodeB := "fleet-a-"+suffix, "fleet-b-"+suffix
	storeA := f.store(t, f.nodeToken(t, nodeA))
	storeB := f.store(t, f.nodeToken(t, nodeB))

	// A's token carries A's node, as the policy expects.
	cs, err := kubernetes.NewForConfig(f.api.TokenConfig(f.nodeToken(t, "fleet-c-"+suffix)))
	if err != nil {
		t.Fatal(err)
	}
	self, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := self.Status.UserInfo.Extra["authentication.kubernetes.io/node-name"]; len(got) != 1 || got[0] != "fleet-c-"+suffix {
		t.Fatalf("a pod-bound token's user info has node name %v, want [fleet-c-%s]", got, suffix)
	}

	t.Run("a node writes its own report", func(t *testing.T) {
		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		w := NewWriter(nodeA, storeA, SystemClock{}, nil)
		done := make(chan struct{})
		go func() { w.Run(wctx); close(done) }()
		defer func() { cancel(); <-done }()

		w.Set([]Circuit{circuitAt("tcp/192.0.2.7:443"), circuitAt("payments")})
		var got *CircuitReport
		if !kerneltest.WaitFor(10*time.Second, func() bool {
			got, err = storeA.Get(ctx, nodeA)
			return err == nil && len(got.Spec.Circuits) == 2
		}) {
			t.Fatalf("A's report not written within 10 s: %+v, %v (writer %+v)", got, err, w.Stats())
		}
		if got.Spec.Circuits[0].Key != "payments" || got.Spec.Open != 2 {
			t.Fatalf("A's report %+v", got.Spec)
		}
		// Deleted (by an administrator), it is created again on the next
		// transition.
		if err := f.dyn.Resource(GroupVersionResource).Delete(ctx, nodeA, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.Set([]Circuit{circuitAt("payments")})
		if !kerneltest.WaitFor(10*time.Second, func() bool {
			got, err = storeA.Get(ctx, nodeA)
			return err == nil && len(got.Spec.Circuits) == 1
		}) {
			t.Fatalf("A's report not created again within 10 s: %+v, %v (writer %+v)", got, err, w.Stats())
		}
		// Its last circuit closed, it clears its report: the server-side
		// apply of an empty list, after a list of the same field manager.
		w.Set(nil)
		if !kerneltest.WaitFor(10*time.Second, func() bool {
			got, err = storeA.Get(ctx, nodeA)
			return err == nil && len(got.Spec.Circuits) == 0 && w.Stats().Writes == 3
		}) {
			t.Fatalf("A's report not cleared within 10 s: %+v, %v (writer %+v)", got, err, w.Stats())
		}
		if s := w.Stats(); s.Errors != 0 {
			t.Fatalf("writer stats %+v", s)
		}
		// Its next circuit lists again.
		w.Set([]Circuit{circuitAt("payments")})
		if !kerneltest.WaitFor(10*time.Second, func() bool {
			got, err = storeA.Get(ctx, nodeA)
			return err == nil && len(got.Spec.Circuits) == 1
		}) {
			t.Fatalf("A's report not listing again within 10 s: %+v, %v (writer %+v)", got, err, w.Stats())
		}
		// Every node reads every report (the Tally's input).
		if err := storeB.Apply(ctx, reportOf(nodeB, circuitAt("payments"))); err != nil {
			t.Fatalf("B writing its own report: %v", err)
		}
		all, _, err := storeA.List(ctx)
		if err != nil || len(all) != 2 {
			t.Fatalf("A lists %d reports (%v), want A's and B's", len(all), err)
		}
		ta := NewTally(nodeA)
		for _, r := range all {
			ta.Observe(r)
		}
		if n := ta.Count("payments", time.Now()); n != 1 {
			t.Fatalf("A counts %d other nodes with payments open, want 1 (B)", n)
		}
		// `kubectl get circuitreports` shows the printer columns.
		if got := f.table(t, nodeB); got != "Open=1 Omitted=0 Destinations=payments" {
			t.Fatalf("kubectl get's columns for B's report: %s", got)
		}
	})

	t.Run("a node is refused writing another node's report", func(t *testing.T) {
		want := "on node " + nodeA + " may write only the CircuitReport named " + nodeA + ", not " + nodeB
		err := storeA.Apply(ctx, reportOf(nodeB, circuitAt("payments")))
		if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), want) {
			t.Fatalf("A writing B's report: %v\nwant Forbidden by the admission policy: %q", err, want)
		}
		// Not by RBAC: it grants the write.
		if strings.Contains(err.Error(), "cannot patch resource") {
			t.Fatalf("refused by RBAC, not by the admission policy: %v", err)
		}
		// B's report is as B wrote it.
		got, err := storeB.Get(ctx, nodeB)
		if err != nil || len(got.Spec.Circuits) != 1 {
			t.Fatalf("B's report changed: %+v, %v", got, err)
		}
	})

	t.Run("a token bound to no pod writes no report", func(t *testing.T) {
		tr, err := f.admin.CoreV1().ServiceAccounts("breakerd").CreateToken(ctx, "breakerd", &authv1.TokenRequest{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		const want = "may write CircuitReports only with a token bound to a pod on a node"
		err = f.store(t, tr.Status.Token).Apply(ctx, reportOf(nodeA, circuitAt("payments")))
		if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), want) {
			t.Fatalf("an unbound token writing A's report: %v\nwant Forbidden: %q", err, want)
		}
	})
}

// TestFleetSchemaRefusesMalformedReports: the CRD's structural schema
// refuses what no breakerd writes, whoever writes it.
func TestFleetSchemaRefusesMalformedReports(t *testing.T) {
	f := startFleetAPI(t)
	ctx := context.Background()
	client := f.dyn.Resource(GroupVersionResource)
	valid := func() map[string]any {
		u, err := ToUnstructured(reportOf("fleet-schema", circuitAt("payments")))
		if err != nil {
			t.Fatal(err)
		}
		return u.Object
	}
	if _, err := client.Create(ctx, &unstructured.Unstructured{Object: valid()}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("a well-formed report is refused: %v", err)
	}
	if err := client.Delete(ctx, "fleet-schema", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	entry := func(m map[string]any) map[string]any {
		return m["spec"].(map[string]any)["circuits"].([]any)[0].(map[string]any)
	}
	many := make([]Circuit, MaxCircuits+1)
	for i := range many {
		many[i] = circuitAt(fmt.Sprintf("k%d", i))
	}
	cases := []struct {
		name, want string
		edit       func(m map[string]any)
	}{
		{"no spec", "spec: Required value", func(m map[string]any) { delete(m, "spec") }},
		{"an entry without a key", "key: Required value", func(m map[string]any) { delete(entry(m), "key") }},
		{"an empty key", "key: Invalid value", func(m map[string]any) { entry(m)["key"] = "" }},
		{"open-until not a time", "openUntil: Invalid value", func(m map[string]any) { entry(m)["openUntil"] = "in a minute" }},
		{"open-until before since", "openUntil must be after since", func(m map[string]any) {
			entry(m)["openUntil"] = "2020-01-01T00:00:00.000000Z"
		}},
		{"a negative count", "open: Invalid value", func(m map[string]any) { m["spec"].(map[string]any)["open"] = int64(-1) }},
		{"a reason that is no reason", "reason: Invalid value", func(m map[string]any) { entry(m)["reason"] = "Because!" }},
		{"a key twice", "Duplicate value", func(m map[string]any) {
			spec := m["spec"].(map[string]any)
			spec["circuits"] = append(spec["circuits"].([]any), spec["circuits"].([]any)[0])
		}},
		{"more circuits than the bound", "must have at most 128 items", func(m map[string]any) {
			u, err := ToUnstructured(reportOf("fleet-schema", many...))
			if err != nil {
				t.Fatal(err)
			}
			m["spec"] = u.Object["spec"]
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := valid()
			tc.edit(m)
			_, err := client.Create(ctx, &unstructured.Unstructured{Object: m}, metav1.CreateOptions{})
			if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("created: %v\nwant Invalid with %q", err, tc.want)
			}
		})
	}
}

// TestFleetWatchFeedsTally: node C follows the reports A and B write, with
// its own pod-bound token, through a Watcher into its Tally: the quorum
// of two opens once both reports are in, expires with the entries'
// open-until (no write needed), and a deleted report is forgotten.
func TestFleetWatchFeedsTally(t *testing.T) {
	f := startFleetAPI(t)
	ctx, cancel := context.WithCancel(context.Background())
	suffix := strings.ToLower(kerneltest.UniqueName())
	nodeA, nodeB, nodeC := "fleet-a-"+suffix, "fleet-b-"+suffix, "fleet-c-"+suffix
	storeA := f.store(t, f.nodeToken(t, nodeA))
	storeB := f.store(t, f.nodeToken(t, nodeB))
	tokenC := f.nodeToken(t, nodeC)

	var mu sync.Mutex
	tally := NewTally(nodeC)
	forgotten := map[string]bool{}
	w, err := NewWatcher(f.api.TokenConfig(tokenC),
		func(r *CircuitReport) { mu.Lock(); tally.Observe(r); mu.Unlock() },
		func(node string) { mu.Lock(); tally.Forget(node); forgotten[node] = true; mu.Unlock() }, nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	if !kerneltest.WaitFor(10*time.Second, w.Synced) {
		t.Fatal("C's watch has not listed the reports within 10 s (RBAC?)")
	}
	open := func() []Verdict {
		mu.Lock()
		defer mu.Unlock()
		return tally.Open(time.Now(), func(string) int { return 2 })
	}

	const key = "tcp/192.0.2.7:443"
	c := circuitAt(key)
	c.OpenUntil = metav1.NewMicroTime(time.Now().Add(4 * time.Second))
	if err := storeA.Apply(ctx, reportOf(nodeA, c)); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return tally.Count(key, time.Now()) == 1 }) {
		t.Fatal("C does not see A's report within 10 s")
	}
	if v := open(); len(v) != 0 {
		t.Fatalf("one node's report opened %+v on C", v)
	}
	written := time.Now()
	if err := storeB.Apply(ctx, reportOf(nodeB, circuitAt(key))); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { return len(open()) == 1 }) {
		t.Fatal("the quorum of A and B does not open the key on C within 10 s")
	}
	t.Logf("C opened %s %v after B's report was written", key, time.Since(written).Round(time.Millisecond))
	if v := open()[0]; v.Key != key || v.Nodes != 2 || !v.Until.Equal(c.OpenUntil.Time.Truncate(time.Microsecond)) {
		t.Fatalf("verdict %+v, want 2 nodes until A's open-until %v", v, c.OpenUntil.Time)
	}
	// A writes nothing more: its entry expires by itself, and the key
	// falls below the quorum at A's open-until.
	if !kerneltest.WaitFor(10*time.Second, func() bool { return len(open()) == 0 }) {
		t.Fatal("A's entry has not expired on C")
	}
	if late := time.Since(c.OpenUntil.Time); late < 0 {
		t.Fatalf("closed %v before A's open-until", -late)
	}
	// A deleted report is forgotten.
	if err := f.dyn.Resource(GroupVersionResource).Delete(ctx, nodeB, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return forgotten[nodeB] }) {
		t.Fatal("C has not forgotten B's deleted report")
	}
	if n := func() int { mu.Lock(); defer mu.Unlock(); return tally.Count(key, time.Now()) }(); n != 0 {
		t.Fatalf("C still counts %d nodes", n)
	}
}
