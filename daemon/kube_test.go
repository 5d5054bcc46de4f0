package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/internal/kubeapitest"
	"github.com/breakerd/breakerd/kube"
)

// kubeFixture is a daemon fixture with a real kube-apiserver, a namespace
// of its own and a kube.Client the daemon uses.
type kubeFixture struct {
	*fixture
	api  *kubeapitest.Server
	cs   *kubernetes.Clientset
	ns   string
	node string
}

func newKubeFixture(t *testing.T, yaml string) *kubeFixture {
	t.Helper()
	kerneltest.RequireKernel(t)
	api := kubeapitest.Start(t)
	kf := &kubeFixture{api: api, cs: api.Clientset(t), ns: strings.ReplaceAll(kerneltest.UniqueName(), "bkdt", "bkdt-"), node: "node-" + kerneltest.UniqueName()}
	if _, err := kf.cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: kf.ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating namespace: %v", err)
	}
	kf.fixture = newFixture(t, strings.ReplaceAll(yaml, "NS", kf.ns))
	cl, err := kube.New(kube.Options{Config: api.Admin, NodeName: kf.node, ProbeInterval: 200 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(kf.logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	kf.cluster = cl
	return kf
}

func (kf *kubeFixture) createService(t *testing.T, name string, ports ...corev1.ServicePort) *corev1.Service {
	t.Helper()
	svc, err := kf.cs.CoreV1().Services(kf.ns).Create(context.Background(), &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       corev1.ServiceSpec{Ports: ports, Selector: map[string]string{"app": name}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating Service: %v", err)
	}
	return svc
}

type ep struct {
	addr    string
	serving bool
}

func endpointSlice(svc, name string, ports map[string]int32, eps ...ep) *discoveryv1.EndpointSlice {
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, n := range slices.Sorted(maps.Keys(ports)) {
		p, pn, proto := ports[n], n, corev1.ProtocolTCP
		es.Ports = append(es.Ports, discoveryv1.EndpointPort{Name: &pn, Port: &p, Protocol: &proto})
	}
	for _, e := range eps {
		serving, ready := e.serving, e.serving
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{e.addr},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &serving}})
	}
	return es
}

// verdictDests is the set of destinations with a verdict, as strings.
func (kf *kubeFixture) verdictDests(t *testing.T) []string {
	t.Helper()
	vs, err := kf.d.Kernel().AllVerdicts()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for d := range vs {
		out = append(out, d.Addr.String())
	}
	slices.Sort(out)
	return out
}

func (kf *kubeFixture) waitVerdicts(t *testing.T, want ...string) {
	t.Helper()
	slices.Sort(want)
	var got []string
	if !kerneltest.WaitFor(10*time.Second, func() bool { got = kf.verdictDests(t); return slices.Equal(got, want) }) {
		t.Fatalf("verdicts for %v, want %v (logs:\n%s)", got, want, kf.logs.String())
	}
}

// TestServiceTargetFollowsEndpointSlices runs a real daemon on a child
// cgroup against a real kube-apiserver: a Service target's verdicts cover
// the Service's cluster IP and its serving EndpointSlice endpoints on the
// selected (named) port only, and follow the slice as it changes and the
// Service as it goes; a connect from the cgroup to the endpoint is
// rejected while it is listed and goes through once it is not.
func TestServiceTargetFollowsEndpointSlices(t *testing.T) {
	kf := newKubeFixture(t, `
targets:
  pay:
    match: {service: NS/pay, ports: [http]}
    state: forced_open
`)
	ctx := context.Background()
	svc := kf.createService(t, "pay",
		corev1.ServicePort{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP},
		corev1.ServicePort{Name: "admin", Port: 9090, Protocol: corev1.ProtocolTCP})
	cip := svc.Spec.ClusterIP
	srv := kf.srv.IPv4.String()
	ports := map[string]int32{"http": 8080, "admin": 9090}
	es, err := kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Create(ctx,
		endpointSlice("pay", "pay-1", ports, ep{srv, true}, ep{"198.18.0.77", false}), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating EndpointSlice: %v", err)
	}
	kf.start()
	// The cluster IP on the Service port, the serving endpoint on the
	// target port; not the unselected admin port, not the endpoint that
	// is not serving.
	kf.waitVerdicts(t, cip+":80", srv+":8080")
	ln := kf.srv.Listen(t, "tcp4", 8080)
	_ = ln
	syns := kf.srv.SYNs(t)
	rs := kf.dial(8080, 5, time.Second)
	if n := errnos(rs)[unix.ECONNREFUSED]; n != 5 {
		t.Fatalf("connects to a forced-open Service endpoint: %v, want 5 refused", errnos(rs))
	}
	if got := kf.srv.SYNs(t) - syns; got != 0 {
		t.Fatalf("%d SYNs reached the endpoint of a forced-open Service", got)
	}

	// The endpoint leaves the slice, another arrives: the verdicts follow.
	es.Endpoints = endpointSlice("pay", "pay-1", ports, ep{"198.18.0.78", true}).Endpoints
	if _, err := kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	kf.waitVerdicts(t, cip+":80", "198.18.0.78:8080")
	rs = kf.dial(8080, 3, time.Second)
	if n := errnos(rs)[0]; n != 3 {
		t.Fatalf("connects to an endpoint no longer in the slice: %v, want 3 established", errnos(rs))
	}
	// A second slice adds endpoints; the circuit stays forced open.
	if _, err := kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Create(ctx,
		endpointSlice("pay", "pay-2", ports, ep{"198.18.0.79", true}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kf.waitVerdicts(t, cip+":80", "198.18.0.78:8080", "198.18.0.79:8080")
	if c, ok := kf.circuit("pay"); !ok || c.State != "forced_open" {
		t.Fatalf("circuit pay: %+v", c)
	}
	// The Service goes: nothing is left.
	if err := kf.cs.CoreV1().Services(kf.ns).Delete(ctx, "pay", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kf.waitVerdicts(t)
}

// TestServiceTargetWaitsForService: a Service named before it exists is
// waited for (a warning and a Node Event say so) and protected once it
// appears.
func TestServiceTargetWaitsForService(t *testing.T) {
	kf := newKubeFixture(t, `
targets:
  late:
    match: {service: NS/late}
    state: forced_open
`)
	kf.start()
	if !kerneltest.WaitFor(10*time.Second, func() bool { return strings.Contains(kf.logs.String(), "Service not found; waiting for it") }) {
		t.Fatalf("no warning for the missing Service:\n%s", kf.logs.String())
	}
	kf.waitEvent(t, "default", kf.node, kube.ReasonServiceNotFound, kf.ns+"/late")
	svc := kf.createService(t, "late", corev1.ServicePort{Name: "http", Port: 8081, Protocol: corev1.ProtocolTCP})
	kf.waitVerdicts(t, svc.Spec.ClusterIP+":8081")
}

// waitEvent waits for an Event with reason on the object name in ns whose
// message contains text.
func (kf *kubeFixture) waitEvent(t *testing.T, ns, name, reason, text string) corev1.Event {
	t.Helper()
	var found corev1.Event
	var seen []string
	ok := kerneltest.WaitFor(15*time.Second, func() bool {
		list, err := kf.cs.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
		if err != nil {
			return false
		}
		seen = seen[:0]
		for _, e := range list.Items {
			seen = append(seen, e.Reason+": "+e.Message)
			if e.Reason == reason && strings.Contains(e.Message, text) {
				found = e
				return true
			}
		}
		return false
	})
	if !ok {
		t.Fatalf("no Event %s on %s/%s containing %q; seen %v", reason, ns, name, text, seen)
	}
	return found
}

// TestCircuitEventsInKubernetes: a Service target's circuit that trips
// on real refused connects posts CircuitOpened on the Service and
// CircuitClosed when it recovers; a dynamic circuit's opening is posted
// on the Node.
func TestCircuitEventsInKubernetes(t *testing.T) {
	kf := newKubeFixture(t, `
all:
  consecutive_failures: 2
  open_duration: 1m
targets:
  pay:
    match: {service: NS/pay}
    consecutive_failures: 2
    min_requests: 2
    window_size: 4
    open_duration: 500ms
    jitter: 0
`)
	ctx := context.Background()
	kf.createService(t, "pay", corev1.ServicePort{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP})
	srv := kf.srv.IPv4.String()
	if _, err := kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Create(ctx,
		endpointSlice("pay", "pay-1", map[string]int32{"http": 8080}, ep{srv, true}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kf.start()
	kf.waitVerdicts(t) // nothing open yet
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		kf.d.hold()
		defer kf.d.release()
		return len(kf.d.services["pay"]) == 2
	}) {
		t.Fatalf("Service not resolved:\n%s", kf.logs.String())
	}
	kf.dial(8080, 3, time.Second) // nothing listens: refused
	kf.waitState("pay", "open", 5*time.Second)
	ev := kf.waitEvent(t, kf.ns, "pay", kube.ReasonCircuitOpened, "circuit pay (target pay) opened")
	if ev.InvolvedObject.Kind != "Service" || ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, "failure ratio 1.000") {
		t.Fatalf("opening Event: %+v", ev)
	}
	kf.srv.Listen(t, "tcp4", 8080)
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		kf.dial(8080, 1, time.Second)
		c, _ := kf.circuit("pay")
		return c.State == "closed"
	}) {
		t.Fatalf("circuit did not close:\n%s", kf.logs.String())
	}
	kf.waitEvent(t, kf.ns, "pay", kube.ReasonCircuitClosed, "closed (probes_succeeded)")

	// An unnamed destination's circuit: the Event goes on the Node.
	kf.dial(8099, 3, time.Second)
	name := fmt.Sprintf("tcp/%s", netip.AddrPortFrom(kf.srv.IPv4, 8099))
	kf.waitState(name, "open", 5*time.Second)
	ev = kf.waitEvent(t, "default", kf.node, kube.ReasonCircuitOpened, "circuit "+name+" (target all) opened")
	if ev.InvolvedObject.Kind != "Node" {
		t.Fatalf("dynamic circuit's Event: %+v", ev.InvolvedObject)
	}
}

// TestServiceEndpointScopeOverSliceMembers: in endpoint scope the group's
// endpoints are the Service's cluster IP and its serving slice endpoints,
// so max_ejection_percent counts them; the group follows the slice.
func TestServiceEndpointScopeOverSliceMembers(t *testing.T) {
	kf := newKubeFixture(t, `
targets:
  pay:
    match: {service: NS/pay}
    scope: endpoint
    max_ejection_percent: 40
    consecutive_failures: 2
    open_duration: 1m
`)
	ctx := context.Background()
	svc := kf.createService(t, "pay", corev1.ServicePort{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP})
	srv := kf.srv.IPv4.String()
	ports := map[string]int32{"http": 8080}
	es, err := kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Create(ctx, endpointSlice("pay", "pay-1", ports,
		ep{srv, true}, ep{"198.18.0.81", true}, ep{"198.18.0.82", true}, ep{"198.18.0.83", true}, ep{"198.18.0.84", false}), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kf.start()
	counts := func() (int, int) {
		kf.d.hold()
		defer kf.d.release()
		g := kf.d.eng.Group("pay")
		if g == nil {
			return 0, 0
		}
		return g.Counts()
	}
	// Four serving endpoints and the cluster IP; not the one not serving.
	if !kerneltest.WaitFor(10*time.Second, func() bool { n, _ := counts(); return n == 5 }) {
		n, _ := counts()
		t.Fatalf("group knows %d endpoints, want 5:\n%s", n, kf.logs.String())
	}
	kf.dial(8080, 3, time.Second) // refused: nothing listens
	kf.waitState("pay/"+srv+":8080", "open", 5*time.Second)
	kf.waitVerdicts(t, srv+":8080")
	if _, ej := counts(); ej != 1 {
		t.Fatalf("%d ejected, want 1", ej)
	}
	// Endpoints leave the slice: the group shrinks with it; the open
	// endpoint keeps its verdict.
	es.Endpoints = endpointSlice("pay", "pay-1", ports, ep{srv, true}, ep{"198.18.0.81", true}).Endpoints
	if es, err = kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { n, _ := counts(); return n == 3 }) {
		n, _ := counts()
		t.Fatalf("group knows %d endpoints after the slice shrank, want 3 (%s and the cluster IP %s)", n, srv, svc.Spec.ClusterIP)
	}
	kf.waitVerdicts(t, srv+":8080")
	// The open endpoint leaves too: its circuit and verdict go.
	es.Endpoints = endpointSlice("pay", "pay-1", ports, ep{"198.18.0.81", true}).Endpoints
	if _, err := kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	kf.waitVerdicts(t)
	if _, ok := kf.circuit("pay/" + srv + ":8080"); ok {
		t.Fatalf("the departed endpoint's circuit is still there")
	}
}

// TestServiceTargetSurvivesAPIOutage: with the API server gone the
// verdicts of a Service target stay as last known, and
// breakerd_kubernetes_api_reachable says 0.
func TestServiceTargetSurvivesAPIOutage(t *testing.T) {
	kf := newKubeFixture(t, `
targets:
  pay:
    match: {service: NS/pay}
    state: forced_open
`)
	ctx := context.Background()
	svc := kf.createService(t, "pay", corev1.ServicePort{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP})
	srv := kf.srv.IPv4.String()
	if _, err := kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Create(ctx, endpointSlice("pay", "pay-1", map[string]int32{"http": 8080}, ep{srv, true}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kf.start()
	kf.waitVerdicts(t, svc.Spec.ClusterIP+":80", srv+":8080")
	reachable := func() float64 {
		mfs, err := kf.d.metrics.reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "breakerd_kubernetes_api_reachable" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return -1
	}
	if !kerneltest.WaitFor(5*time.Second, func() bool { return reachable() == 1 }) {
		t.Fatalf("api_reachable %v with the API up", reachable())
	}
	kf.api.Stop()
	if !kerneltest.WaitFor(10*time.Second, func() bool { return reachable() == 0 }) {
		t.Fatalf("api_reachable %v with the API gone", reachable())
	}
	// A resolution during the outage (as a change would start) keeps
	// the last known endpoints.
	kf.d.resolveServices()
	kf.waitVerdicts(t, svc.Spec.ClusterIP+":80", srv+":8080")
	rs := kf.dial(8080, 3, time.Second)
	if n := errnos(rs)[unix.ECONNREFUSED]; n != 3 {
		t.Fatalf("with the API gone: %v, want 3 refused", errnos(rs))
	}
	if !strings.Contains(kf.logs.String(), "keeping the last known Services and endpoints") {
		t.Fatalf("the outage is not logged:\n%s", kf.logs.String())
	}
}

// TestServiceTargetAcrossRestartAndReload: an open Service circuit stays
// open, and its endpoint rejected with no SYN let through, across a
// SIGTERM restart (the new daemon waits for the informers before it
// adopts, so the verdicts are matched to the Service, not dropped) and a
// reload that adds a second Service target.
func TestServiceTargetAcrossRestartAndReload(t *testing.T) {
	const conf = `
targets:
  pay:
    match: {service: NS/pay}
    consecutive_failures: 2
    open_duration: 1m
`
	kf := newKubeFixture(t, conf)
	ctx := context.Background()
	kf.createService(t, "pay", corev1.ServicePort{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP})
	srv := kf.srv.IPv4.String()
	if _, err := kf.cs.DiscoveryV1().EndpointSlices(kf.ns).Create(ctx, endpointSlice("pay", "pay-1", map[string]int32{"http": 8080}, ep{srv, true}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kf.start()
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		kf.d.hold()
		defer kf.d.release()
		return len(kf.d.services["pay"]) == 2
	}) {
		t.Fatalf("Service not resolved:\n%s", kf.logs.String())
	}
	kf.dial(8080, 3, time.Second)
	kf.waitState("pay", "open", 5*time.Second)
	kf.srv.Listen(t, "tcp4", 8080) // healthy now: only the open verdict rejects
	syns := kf.srv.SYNs(t)

	done := make(chan []kerneltest.DialResult, 1)
	go func() {
		done <- kf.topo.Client.Dial(t, kf.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(kf.srv.IPv4, 8080), Op: "rate", Rate: 200, For: 4 * time.Second, Timeout: time.Second})
	}()
	time.Sleep(500 * time.Millisecond)
	kf.restart()
	kf.waitState("pay", "open", 5*time.Second)
	createSvc := kf.createService(t, "late", corev1.ServicePort{Name: "http", Port: 81, Protocol: corev1.ProtocolTCP})
	kf.writeConfig(strings.ReplaceAll(conf+`
  late:
    match: {service: NS/late}
    state: forced_open
`, "NS", kf.ns))
	if err := kf.d.Reload(); err != nil {
		t.Fatal(err)
	}
	res := <-done
	counts := map[unix.Errno]int64{}
	for _, r := range res {
		counts[r.Errno] += r.Nanos
	}
	if len(counts) != 1 || counts[unix.ECONNREFUSED] < 300 {
		t.Fatalf("connects across the restart and the reload: %v, want only ECONNREFUSED\n%s", counts, kf.logs.String())
	}
	if n := kf.srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs let through to an open Service endpoint", n)
	}
	kf.waitState("pay", "open", time.Second)
	if !strings.Contains(kf.logs.String(), "adopted open circuit") {
		t.Fatalf("not adopted:\n%s", kf.logs.String())
	}
	// The reload's new Service target is resolved and enforced.
	vs := kf.verdictDests(t)
	if !kerneltest.WaitFor(10*time.Second, func() bool { vs = kf.verdictDests(t); return slices.Contains(vs, createSvc.Spec.ClusterIP+":81") }) {
		t.Fatalf("verdicts %v lack the reloaded target's cluster IP %s", vs, createSvc.Spec.ClusterIP)
	}
}

// cgroupTree makes cgroups below a root by relative path, each level once
// (removed when the test ends, children first).
type cgroupTree struct {
	t    *testing.T
	root *kerneltest.Cgroup
	made map[string]*kerneltest.Cgroup
}

func (ct *cgroupTree) at(rel string) *kerneltest.Cgroup {
	ct.t.Helper()
	cg, path := ct.root, ""
	for _, e := range strings.Split(rel, "/") {
		path += "/" + e
		next, ok := ct.made[path]
		if !ok {
			next = cg.Child(ct.t, e)
			ct.made[path] = next
		}
		cg = next
	}
	return cg
}

func (kf *kubeFixture) createPod(t *testing.T, name, node string, labels map[string]string) *corev1.Pod {
	t.Helper()
	p, err := kf.cs.CoreV1().Pods(kf.ns).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "example.invalid/c"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating pod: %v", err)
	}
	return p
}

const containerID = "4b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c"

// systemdPod and cgroupfsPod make a pod's cgroup and one container's in
// the kubelet's two layouts, below the attach point.
func (ct *cgroupTree) systemdPod(p *corev1.Pod, qos string) (pod, ctr *kerneltest.Cgroup) {
	uid := strings.ReplaceAll(string(p.UID), "-", "_")
	rel := "kubepods.slice/kubepods-" + qos + ".slice/kubepods-" + qos + "-pod" + uid + ".slice"
	return ct.at(rel), ct.at(rel + "/cri-containerd-" + containerID + ".scope")
}

func (ct *cgroupTree) cgroupfsPod(p *corev1.Pod, qos string) (pod, ctr *kerneltest.Cgroup) {
	rel := "kubepods/" + qos + "/pod" + string(p.UID)
	return ct.at(rel), ct.at(rel + "/" + containerID)
}

// TestPodWorkloads selects the protected processes by namespace and pod
// labels through a real kube-apiserver: the cgroups of this node's
// selected pods, made here in both kubelet layouts (systemd and cgroupfs)
// with real processes in their container cgroups, are protected; a pod
// that does not match, or of another node, is not; a container started
// after its pod is; a pod whose labels change to match becomes protected,
// a terminating pod stays protected, and a deleted pod stops being
// protected. The circuit names the pod that saw the failures.
func TestPodWorkloads(t *testing.T) {
	kf := newKubeFixture(t, `
workloads:
  - name: shop
    namespaces: [NS]
    pod_labels: ["app=web"]
targets:
  svc:
    source: [shop]
    match: {cidrs: [SRV], ports: ["8400"]}
    consecutive_failures: 3
    open_duration: 1m
    reject_errno: EHOSTUNREACH
`)
	web1 := kf.createPod(t, "web-1", kf.node, map[string]string{"app": "web"})
	web2 := kf.createPod(t, "web-2", kf.node, map[string]string{"app": "web"})
	db := kf.createPod(t, "db-1", kf.node, map[string]string{"app": "db"})
	far := kf.createPod(t, "web-far", "another-node", map[string]string{"app": "web"})
	tree := &cgroupTree{t: t, root: kf.cg, made: map[string]*kerneltest.Cgroup{}}
	_, web1Ctr := tree.systemdPod(web1, "burstable")
	web2Pod, web2Ctr := tree.cgroupfsPod(web2, "besteffort")
	_, dbCtr := tree.cgroupfsPod(db, "burstable")
	_, farCtr := tree.systemdPod(far, "besteffort")
	kf.start()
	entries := func() int { return len(kf.workloadEntries()) }
	// web-1 and web-2: each pod's cgroup and its container's.
	if !kerneltest.WaitFor(10*time.Second, func() bool { return entries() == 4 }) {
		t.Fatalf("workloads map has %d entries, want 4:\n%s", entries(), kf.logs.String())
	}
	if got := kf.dialFrom(dbCtr, 8400, 5); got[unix.ECONNREFUSED] != 5 {
		t.Fatalf("unselected pod: %v", got)
	}
	kf.sentinel(web1Ctr, 8409) // a selected pod's record, read after theirs would be
	if c, _ := kf.circuit("svc@shop"); c.Calls != 0 {
		t.Fatalf("an unselected pod's failures counted: %+v", c)
	}
	if got := kf.dialFrom(web1Ctr, 8400, 3); got[unix.ECONNREFUSED] != 3 {
		t.Fatalf("selected pod (systemd layout): %v", got)
	}
	// The target's source is the pod workload: its circuit is the
	// workload's own.
	kf.waitState("svc@shop", "open", 5*time.Second)
	c, _ := kf.circuit("svc@shop")
	if c.Workload != "shop" {
		t.Errorf("circuit workload %q, want shop", c.Workload)
	}
	if !slices.Contains(c.FailedPods, kf.ns+"/web-1") {
		t.Errorf("circuit's failed pods %v lack %s/web-1", c.FailedPods, kf.ns)
	}
	syns := kf.srv.SYNs(t)
	for name, cg := range map[string]*kerneltest.Cgroup{"web-1 (systemd)": web1Ctr, "web-2 (cgroupfs)": web2Ctr} {
		if got := kf.dialFrom(cg, 8400, 3); got[unix.EHOSTUNREACH] != 3 {
			t.Fatalf("%s with the circuit open: %v, want 3 rejected", name, got)
		}
	}
	if n := kf.srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs of selected pods reached an open circuit's host", n)
	}
	for name, cg := range map[string]*kerneltest.Cgroup{"db-1": dbCtr, "web-far (another node)": farCtr} {
		if got := kf.dialFrom(cg, 8400, 2); got[unix.ECONNREFUSED] != 2 {
			t.Fatalf("%s with the circuit open: %v, want 2 refused by the server (never rejected)", name, got)
		}
	}

	// A container started after its pod.
	late := web2Pod.Child(t, "5c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d")
	if !kerneltest.WaitFor(5*time.Second, func() bool { return entries() == 5 }) {
		t.Fatalf("the late container's cgroup is not in the map (%d entries)", entries())
	}
	if got := kf.dialFrom(late, 8400, 2); got[unix.EHOSTUNREACH] != 2 {
		t.Fatalf("container started after its pod: %v, want rejected", got)
	}
	// db-1's labels change to match: protected.
	ctx := context.Background()
	if _, err := kf.cs.CoreV1().Pods(kf.ns).Patch(ctx, "db-1", types.MergePatchType, []byte(`{"metadata":{"labels":{"app":"web"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { return kf.dialFrom(dbCtr, 8400, 1)[unix.EHOSTUNREACH] == 1 }) {
		t.Fatalf("a pod relabelled to match is not protected (%d entries)", entries())
	}
	// web-1's deletion is requested with a grace period: no kubelet runs
	// to finish it, so it stays terminating (deletionTimestamp set), and
	// its processes, which still run, stay protected.
	grace := int64(300)
	if err := kf.cs.CoreV1().Pods(kf.ns).Delete(ctx, "web-1", metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
		t.Fatal(err)
	}
	if p, err := kf.cs.CoreV1().Pods(kf.ns).Get(ctx, "web-1", metav1.GetOptions{}); err != nil || p.DeletionTimestamp == nil {
		t.Fatalf("web-1 after a graceful delete: %v, %v; want it terminating", err, p)
	}
	// A later change of another pod (a label no selector asks for)
	// reaches the pod cache after the deletion's, one watch keeping the
	// order: once it is there, a resolution of the pods sees web-1
	// terminating.
	if _, err := kf.cs.CoreV1().Pods(kf.ns).Patch(ctx, "web-2", types.MergePatchType, []byte(`{"metadata":{"labels":{"seen":"after-delete"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		return len(kf.cluster.SelectPods(kube.PodSelector{Namespaces: []string{kf.ns}, Labels: map[string]string{"seen": "after-delete"}})) == 1
	}) {
		t.Fatal("the pod cache does not have a change made after web-1's graceful delete")
	}
	kf.d.resolvePods()
	if got := kf.dialFrom(web1Ctr, 8400, 1); got[unix.EHOSTUNREACH] != 1 {
		t.Fatalf("a terminating pod: %v, want still rejected (protected until it is gone)", got)
	}
	// Then deleted at once: its cgroups leave the workload.
	zero := int64(0)
	if err := kf.cs.CoreV1().Pods(kf.ns).Delete(ctx, "web-1", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { return kf.dialFrom(web1Ctr, 8400, 1)[unix.ECONNREFUSED] == 1 }) {
		t.Fatalf("a deleted pod's processes are still protected")
	}
	if n := entries(); n != 5 {
		t.Fatalf("%d entries after the deletion, want 5 (web-2's three, db-1's two)", n)
	}
}

// TestPodWorkloadsAcrossRestartAndReload: a selected pod's processes stay
// protected, with no connect to a forced-open destination let through,
// across a SIGTERM restart (the new daemon lists the pods before it
// classifies, so the pod's entries in the workloads map stay) and a reload
// that adds a workload.
func TestPodWorkloadsAcrossRestartAndReload(t *testing.T) {
	const conf = `
workloads:
  - name: shop
    namespaces: [NS]
targets:
  down:
    source: [shop]
    match: {cidrs: [SRV], ports: ["8401"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
`
	kf := newKubeFixture(t, conf)
	web := kf.createPod(t, "web-1", kf.node, nil)
	tree := &cgroupTree{t: t, root: kf.cg, made: map[string]*kerneltest.Cgroup{}}
	_, ctr := tree.cgroupfsPod(web, "burstable")
	kf.srv.Listen(t, "tcp4", 8401) // healthy: only the verdict rejects
	kf.start()
	if !kerneltest.WaitFor(10*time.Second, func() bool { return kf.dialFrom(ctr, 8401, 1)[unix.EHOSTUNREACH] == 1 }) {
		t.Fatalf("the pod is not protected:\n%s", kf.logs.String())
	}
	syns := kf.srv.SYNs(t)
	done := make(chan []kerneltest.DialResult, 1)
	go func() {
		done <- kf.topo.Client.Dial(t, ctr, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(kf.srv.IPv4, 8401), Op: "rate", Rate: 200, For: 4 * time.Second, Timeout: time.Second})
	}()
	time.Sleep(500 * time.Millisecond)
	kf.restart()
	// The workload is added before shop, so shop's class changes (the
	// verdicts are bridged to the new class: bridge.go).
	kf.writeConfig(strings.ReplaceAll(strings.Replace(conf, "workloads:\n", "workloads:\n  - name: other\n    namespaces: [elsewhere]\n", 1), "NS", kf.ns))
	if err := kf.d.Reload(); err != nil {
		t.Fatal(err)
	}
	counts := map[unix.Errno]int64{}
	for _, r := range <-done {
		counts[r.Errno] += r.Nanos
	}
	if len(counts) != 1 || counts[unix.EHOSTUNREACH] < 300 {
		t.Fatalf("connects from the pod across a restart and a reload: %v, want only EHOSTUNREACH\n%s", counts, kf.logs.String())
	}
	if n := kf.srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs let through from a protected pod", n)
	}
}

// TestKubernetesSelectorsWithoutAPI: without API access the daemon runs;
// a Service target and a pod workload say they need it and match nothing,
// while cgroup and address selection work as before.
func TestKubernetesSelectorsWithoutAPI(t *testing.T) {
	f := newScopedFixture(t, `
workloads:
  - name: shop
    namespaces: [shop]
  - name: legacy
    cgroups: [CGROUP/legacy]
targets:
  pay:
    match: {service: shop/pay}
    state: forced_open
  down:
    match: {cidrs: [SRV], ports: ["8402"]}
    state: forced_open
`)
	legacy := f.cg.Child(t, "legacy")
	f.start()
	for _, want := range []string{"a Service target needs Kubernetes API access", "a workload that selects pods needs Kubernetes API access"} {
		if !strings.Contains(f.logs.String(), want) {
			t.Errorf("no warning %q:\n%s", want, f.logs.String())
		}
	}
	if n := len(f.workloadEntries()); n != 1 {
		t.Fatalf("workloads map has %d entries, want 1 (legacy)", n)
	}
	if got := f.dialFrom(legacy, 8402, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("cgroup workload, forced-open address target: %v", got)
	}
	if n := f.srv.SYNs(t); n != 0 {
		t.Fatalf("%d SYNs reached a forced-open destination", n)
	}
}

// TestRejectedPods: one open circuit rejects two pods of a workload
// (their containers' cgroups in both kubelet layouts, real processes in
// them), and the workload's bulkhead of another circuit, full with one of
// web-1's connections, turns both away: /v1/circuits names both pods with
// their exact counts of each kind, a pod of no workload is neither
// rejected nor listed, the counts carry on across a SIGTERM restart and a
// reload, and the CircuitClosed Event names the pods it rejected.
func TestRejectedPods(t *testing.T) {
	const conf = `
failsafe_timeout: 30s
workloads:
  - name: shop
    namespaces: [NS]
    pod_labels: ["app=web"]
targets:
  svc:
    match: {cidrs: [SRV], ports: ["8407"]}
    consecutive_failures: 2
    open_duration: 3s
    jitter: 0
    half_open_probes: 1
    half_open_success_threshold: 1
    reject_errno: EHOSTUNREACH
  pool:
    match: {cidrs: [SRV], ports: ["8408"]}
    max_connections: 1
`
	kf := newKubeFixture(t, conf)
	kf.srv.ServeHold(t, 8408)
	web1 := kf.createPod(t, "web-1", kf.node, map[string]string{"app": "web"})
	web2 := kf.createPod(t, "web-2", kf.node, map[string]string{"app": "web"})
	db := kf.createPod(t, "db-1", kf.node, map[string]string{"app": "db"})
	tree := &cgroupTree{t: t, root: kf.cg, made: map[string]*kerneltest.Cgroup{}}
	_, ctr1 := tree.systemdPod(web1, "burstable")
	_, ctr2 := tree.cgroupfsPod(web2, "besteffort")
	_, dbCtr := tree.cgroupfsPod(db, "burstable")
	kf.start()
	if !kerneltest.WaitFor(10*time.Second, func() bool { return len(kf.workloadEntries()) == 4 }) {
		t.Fatalf("workloads map has %d entries, want 4:\n%s", len(kf.workloadEntries()), kf.logs.String())
	}
	if got := kf.dialFrom(ctr1, 8407, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("nothing listens: %v", got)
	}
	kf.waitState("svc", "open", 5*time.Second)
	reject := func(cg *kerneltest.Cgroup, n int) { kf.rejectFrom(cg, 8407, n) }
	reject(ctr1, 5)
	reject(ctr2, 3)
	if got := kf.dialFrom(dbCtr, 8407, 2); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("a pod of no workload: %v, want refused by the host, not rejected", got)
	}
	w1, w2 := kf.ns+"/web-1", kf.ns+"/web-2"
	kf.waitRejectedBy("svc", map[string]uint64{w1: 5, w2: 3})
	// The workload's bulkhead of pool, full with web-1's one connection.
	holder := kf.topo.Client.StartDial(t, ctr1, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(kf.srv.IPv4, 8408), Hold: time.Minute})
	t.Cleanup(func() { kill(holder) })
	kf.waitConnections("pool", 1)
	over := func(cg *kerneltest.Cgroup, n int) { kf.overFrom(cg, 8408, n) }
	over(ctr2, 2)
	over(ctr1, 1)
	if got := kf.dialFrom(dbCtr, 8408, 2); got[0] != 2 {
		t.Fatalf("a pod of no workload to the bulkheaded pool: %v, want connected (not counted, not limited)", got)
	}
	kf.waitRejectedKinds("pool", map[string]kinds{w1: {0, 1}, w2: {0, 2}})
	for _, name := range []string{"svc", "pool"} {
		c, _ := kf.circuit(name)
		for _, r := range c.RejectedBy {
			if r.Workload != "shop" || r.Cgroup != "" {
				t.Fatalf("%s rejected_by %+v: want workload shop and the pod, not a cgroup path", name, r)
			}
		}
	}
	// SIGTERM restart and a reload: the counts carry on.
	kf.restart()
	reject(ctr2, 1)
	kf.writeConfig(strings.ReplaceAll(strings.Replace(conf, "workloads:\n", "workloads:\n  - name: other\n    namespaces: [elsewhere]\n", 1), "NS", kf.ns))
	if err := kf.d.Reload(); err != nil {
		t.Fatal(err)
	}
	reject(ctr1, 1)
	over(ctr2, 1)
	kf.waitRejectedBy("svc", map[string]uint64{w1: 6, w2: 4})
	kf.waitRejectedKinds("pool", map[string]kinds{w1: {0, 1}, w2: {0, 3}})
	// The host comes back; a probe closes the circuit; its Event names
	// the pods it rejected.
	kf.srv.Listen(t, "tcp4", 8407)
	if !kerneltest.WaitFor(15*time.Second, func() bool {
		kf.dialFrom(ctr1, 8407, 1)
		c, _ := kf.circuit("svc")
		return c.State == "closed"
	}) {
		t.Fatalf("circuit did not close:\n%s", kf.logs.String())
	}
	kf.waitEvent(t, "default", kf.node, kube.ReasonCircuitClosed, "pods it rejected (times): "+w1+" (")
	ev := kf.waitEvent(t, "default", kf.node, kube.ReasonCircuitClosed, w2+" (4)")
	t.Logf("closing Event: %s", ev.Message)
}

// TestProbesAnswerWhileWaitingOnTheAPI: while the start-up waits on the
// Kubernetes API (a server that takes connections and never answers a
// byte), the admin and probe ports answer at once: /readyz 503 saying the
// start-up waits on the API, /healthz 200 "starting". The wait is
// bounded (serviceSyncTimeout): then the daemon runs and is ready, its
// Service target matching nothing until the API answers.
func TestProbesAnswerWhileWaitingOnTheAPI(t *testing.T) {
	kerneltest.RequireKernel(t)
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var held []net.Conn
	t.Cleanup(func() {
		silent.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	f := newFixture(t, `
targets:
  pay:
    match: {service: default/pay}
`)
	cl, err := kube.New(kube.Options{Config: &rest.Config{Host: "http://" + silent.Addr().String()}, NodeName: "node-" + kerneltest.UniqueName(),
		ProbeInterval: 200 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(f.logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	f.cluster = cl
	f.admin, f.probe = kerneltest.FreeLoopbackAddr(t), kerneltest.FreeLoopbackAddr(t)
	begun := time.Now()
	start := startAsync(t, f, nil)

	c := probeClient(2 * time.Second)
	for _, addr := range []string{f.admin, f.probe} {
		probesSayStarting(t, c, addr, "waiting on the Kubernetes API")
	}
	if start.returned() {
		t.Fatal("the start-up did not wait on the API: the test proves nothing")
	}
	d, err := start.wait()
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if took := time.Since(begun); took > serviceSyncTimeout+5*time.Second {
		t.Fatalf("the start-up took %v with the API silent, want about %v", took, serviceSyncTimeout)
	}
	f.run(d)
	for _, addr := range []string{f.admin, f.probe} {
		if code, body, _, err := getTimed(c, "http://"+addr+"/readyz"); err != nil || code != http.StatusOK {
			t.Fatalf("GET %s/readyz once running: %d %s %v", addr, code, body, err)
		}
	}
	if !strings.Contains(f.logs.String(), "were not listed in time") {
		t.Fatalf("the bounded wait on the API is not logged:\n%s", f.logs.String())
	}
}
