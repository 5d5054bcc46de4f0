package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/internal/kubeapitest"
)

// clusterSubnet is the pods' network: a bridge in the node's network
// namespace with 198.18.250.1 on the node's side (the pods' gateway, the
// node's address, and the API server's advertised one).
const clusterSubnet = "198.18.250"

// clusterPolicy is the ConfigMap's policy in the cluster test: the pods of
// namespace default labelled role=client are protected; the Service
// default/backend is a target that opens after 3 failures in a row and
// rejects with ECONNABORTED (an errno nothing on the pods' path makes, so a
// rejection cannot be mistaken for the network's answer).
const clusterPolicy = `mode: enforce
failsafe_timeout: 10s
workloads:
  - name: clients
    namespaces: [default]
    pod_labels: {role: client}
targets:
  backend:
    match: {service: default/backend, ports: ["80"]}
    consecutive_failures: 3
    open_duration: 5m
    reject_errno: ECONNABORTED
`

// reloadedPolicy is clusterPolicy with a second workload: the control pod.
var reloadedPolicy = strings.Replace(clusterPolicy, "targets:\n",
	"  - name: controls\n    namespaces: [default]\n    pod_labels: {role: control}\ntargets:\n", 1)

// buildImage makes an image of one static binary from scratch with
// buildah, in the node's mount namespace (buildah keeps a blob cache in
// /var/lib/containers whatever its storage), and imports it into
// containerd's k8s.io namespace.
func buildImage(t *testing.T, node *nodeNamespace, ctd *containerdForTest, dir, name, binary string) {
	t.Helper()
	store := filepath.Join(dir, "buildah-"+filepath.Base(binary))
	b := []string{"--root", store + "/s", "--runroot", store + "/r", "--storage-driver", "vfs"}
	run := func(args ...string) string {
		var out []byte
		err := node.Mounts(func() (err error) {
			out, err = exec.Command("buildah", append(b, args...)...).CombinedOutput()
			return err
		})
		if err != nil {
			t.Fatalf("buildah %v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	c := run("from", "scratch")
	run("copy", c, binary, "/"+filepath.Base(binary))
	run("config", "--entrypoint", `["/`+filepath.Base(binary)+`"]`, c)
	run("commit", "--quiet", "--rm", c, name)
	tar := store + ".tar"
	run("push", "--quiet", name, "oci-archive:"+tar+":"+name)
	run("rm", "--all")
	os.RemoveAll(store)
	ctd.ctr("images", "import", tar)
}

// TestOneNodeCluster runs `kubectl apply -k` of the shipped kustomization
// on a one-node cluster made of real parts, all built from k8s.io/kubernetes
// v1.37.2 (kubetest/build, kubetest/build-cluster): etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, a kubelet with Debian's
// containerd (CRI) and runc and the CNI bridge plugin, kube-proxy in
// nftables mode, and kubectl. The DaemonSet controller makes breakerd's pod,
// the scheduler binds it, the kubelet runs it (the image from
// scripts/image); breakerd reaches the API server through the kubernetes
// Service's cluster IP (kube-proxy's DNAT) with the service account token
// bound to the shipped ClusterRole. The test then runs two client pods
// that connect every 200 ms to the cluster IP of a Service whose endpoint,
// on a test host, refuses: the one breakerd's workload selects by its
// labels (found through the pod informer) is refused three times, then
// rejected in connect() with the policy's ECONNABORTED on every connect;
// the other one sees every connect refused by the endpoint, never
// rejected. It asserts that breakerd's /v1/circuits names the client pod as
// the one that saw failures and the one rejected (the control pod in
// neither), that a CircuitOpened Event naming the pod is on the Service,
// that the pod was the DaemonSet's and bound by the scheduler, and that
// kube-proxy's nftables table and the kubelet's KUBE- chains are in the
// node's namespace while the machine's Kubernetes tables and chains are
// the same after as before. Then `kubectl rollout restart` replaces
// breakerd's pod (maxSurge 0: SIGTERM, the pins left, a new pod): the new
// breakerd logs that it adopted the open circuit, which keeps its open
// time and its count of the client's rejections, and every connect of the
// client across the update is rejected, none let through. Last, a policy
// edit applied the same way (kubectl apply -k of the overlay with a second
// workload that selects the control pod) reaches breakerd through the
// kubelet's swap of the ConfigMap's files: it reloads, and the control
// pod's connects are rejected too, by the same open circuit, which names
// it in rejected_by. (The kubelet's syncFrequency is 5 s so that the edit
// arrives within seconds, not the default minute.)
//
// The overlay the test applies (kustomize, on top of deploy/ unchanged)
// changes exactly what must differ on this machine, nothing else:
//   - the image: localhost/breakerd:<unique tag>, imported into containerd
//     (no registry here);
//   - --cgroup: /host/cgroup/unified/<test cgroup>, the kubelet's cgroup
//     root, instead of the machine's root cgroup (never attach there: a
//     hard rule on this shared machine);
//   - --bpffs: /sys/fs/bpf/<unique name>, so the pins are the test's own;
//   - the ConfigMap's policy: clusterPolicy above.
//
// Each patch tests the shipped value first (a JSON patch "test" op), so the
// overlay fails loudly when deploy/ changes under it.
//
// The node: every process of the cluster (etcd, the API server, the
// controller manager, the scheduler, containerd and its shims, the CNI
// plugins, the kubelet, kube-proxy, kubectl) runs in a network namespace
// the test makes (a kerneltest topology's client host, started from a
// thread inside it, so nothing remounts /sys), so kube-proxy's tables, the
// bridge, the pods' veths and the sandboxes' routes are the namespace's,
// and the machine's netfilter and links are untouched. The pods' only way
// out is the bridge to that namespace; its only route leads to the test's
// backend host (198.18.0.2), where nothing listens. The test's own clients
// dial the API server from a thread in the namespace, and read breakerd's
// admin socket through the kubelet's emptyDir (a tmpfs in the node's mount
// namespace, reached through /proc/<thread>/root).
//
// The node's daemons (containerd with its shims and CNI plugins, the
// kubelet, kube-proxy) and the image builds also run in a mount namespace
// of the node's (nodeNamespace), so that the test leaves the machine as it
// found it (checkMachineUnchanged, after every other cleanup): there, the
// machine-wide kernel settings the kubelet writes when it starts
// (kernel.panic=10, kernel.panic_on_oops=1, vm.overcommit_memory=1 and
// three more: kubeletSysctls) are files of the test's bound over their
// /proc/sys entries, and /etc, /opt, /run, /var/lib and /var/log are
// overlays whose writes land in the test's directory (the kubelet's device
// plugin socket and container log links, libcni's cache, containerd's shim
// sockets and runc's state have no setting). The kubelet's root,
// certificate and volume plugin directories are the test's by its
// settings. protectKernelDefaults is no way out: the kubelet then refuses
// to start unless the machine already has its values. All share the
// machine's cgroup namespace: the kubelet manages cgroups below its own
// cgroup root in every hierarchy.
//
// What this machine needed, all set by the test: failCgroupV1: false
// (kubelet 1.37 refuses the hybrid layout's cgroup v1 by default), the
// cgroupfs driver (PID 1 is not systemd), the kubelet's cgroup root made in
// every hierarchy first, containerd's restrict_oom_score_adj (root lacks
// CAP_SYS_RESOURCE in its bounding set, so runc could not lower a
// sandbox's oom_score_adj to -998). And, for the machine's sake,
// kube-proxy's conntrack settings left alone (maxPerCore 0, zero
// timeouts): by default it raises nf_conntrack_max and the nf_conntrack
// module's machine-wide hash size where they are below 32,768 per CPU
// (here they are 262,144, so it would not have) and sets the TCP timeouts
// (of its namespace).
//
// Opt-in (BREAKERD_CLUSTER_TEST=1): it builds four more Kubernetes
// binaries the first time (kubetest/build-cluster, minutes of both cores),
// and the kubelet manages cgroups in every hierarchy of the machine.
func TestOneNodeCluster(t *testing.T) {
	if os.Getenv("BREAKERD_CLUSTER_TEST") == "" {
		t.Skip("opt-in: BREAKERD_CLUSTER_TEST=1 runs a one-node cluster on this machine")
	}
	kerneltest.RequireKernel(t)
	// First, so that its check runs after every other cleanup.
	checkMachineUnchanged(t)
	bins, err := kubeapitest.Binaries()
	if err != nil {
		t.Fatal(err)
	}
	kubelet := filepath.Join(bins, "kubelet")
	if _, err := os.Stat(kubelet); err != nil {
		t.Fatalf("no kubelet (kubetest/build builds it): %v", err)
	}
	cbins, err := kubeapitest.ClusterBinaries()
	if err != nil {
		t.Fatal(err)
	}
	kubectlBin := filepath.Join(cbins, "kubectl")
	if _, err := exec.LookPath("nft"); err != nil {
		t.Fatalf("kube-proxy's nftables mode runs nft: %v", err)
	}
	name := kerneltest.UniqueName()
	pins := "/sys/fs/bpf/" + name
	hostBin := filepath.Join(t.TempDir(), "breakerd")
	if out, err := exec.Command("go", "build", "-o", hostBin, "../cmd/breakerd").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		exec.Command(hostBin, "uninstall", "--bpffs", pins).Run()
		os.RemoveAll(pins)
	})

	// The kubelet's cgroup root, in every hierarchy of this (hybrid or
	// unified) machine; removed depth first at the end.
	var roots []string
	ents, _ := os.ReadDir("/sys/fs/cgroup")
	for _, e := range ents {
		if e.IsDir() && e.Type()&os.ModeSymlink == 0 {
			roots = append(roots, filepath.Join("/sys/fs/cgroup", e.Name(), name))
		}
	}
	if len(roots) == 0 || !slices.Contains(roots, "/sys/fs/cgroup/unified/"+name) {
		t.Fatalf("this test knows the hybrid layout only (cgroup dirs %v)", roots)
	}
	t.Cleanup(func() {
		for _, r := range roots {
			exec.Command("find", r, "-depth", "-type", "d", "-exec", "rmdir", "{}", ";").Run()
		}
	})
	for _, r := range roots {
		if err := os.Mkdir(r, 0o755); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(r, "/cpuset/") {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, _ := os.ReadFile(filepath.Join(filepath.Dir(r), f))
				os.WriteFile(filepath.Join(r, f), v, 0o644)
			}
		}
	}

	// The node's network namespace (removed last), joined by veth to the
	// backend host; the bridge, addressed before any pod exists.
	topo := kerneltest.NewTopology(t, 1)
	node, backend := topo.Client, topo.Servers[0]
	run := func(h *kerneltest.Host, prog string, args ...string) string {
		t.Helper()
		out, err := h.Command(nil, prog, args...).Run(t)
		if err != nil {
			t.Fatalf("%s %v in %s: %v\n%s", prog, args, h.Name, err, out)
		}
		return string(out)
	}
	bridge := "bkb" + name[len(name)-8:]
	run(node, "ip", "link", "add", bridge, "type", "bridge")
	run(node, "ip", "addr", "add", clusterSubnet+".1/24", "dev", bridge)
	run(node, "ip", "link", "set", bridge, "up")
	if err := node.Sysctl("net/ipv4/ip_forward", "1"); err != nil { // the namespace's own
		t.Fatal(err)
	}
	run(backend, "ip", "route", "add", clusterSubnet+".0/24", "via", node.IPv4.String())
	// What Kubernetes' components keep in netfilter (kube-proxy's table,
	// the kubelet's KUBE- chains), in the machine's namespace: it must
	// not change.
	hostKube, err := kubeNetfilter(nil)
	if err != nil {
		t.Fatal(err)
	}

	api := kubeapitest.StartWith(t, kubeapitest.Options{Do: node.Do, AdvertiseAddress: clusterSubnet + ".1", Controllers: true})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("control plane log (last 8000 bytes):\n%s", tailString(api.Logs(), 8000))
		}
	})
	kubeconfig := api.Kubeconfig(t)
	dir, err := os.MkdirTemp("/tmp", "bkdt-cl-")
	if err != nil {
		t.Fatal(err)
	}
	// The CRI's network namespaces are mounted in the node's mount
	// namespace, on files in its overlay of /run: both go with it.
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, d := range []string{"cni", "logs", "kubelet", "ipam"} {
		os.MkdirAll(filepath.Join(dir, d), 0o755)
	}
	// Made after dir (removed after it ends) and before the processes in it
	// (which end before it does).
	nodeNS := newNodeNamespace(t, node, filepath.Join(dir, "node"))
	// isDefaultGateway: the pods' default route leads to the node's side of the
	// bridge, where kube-proxy translates cluster IPs.
	os.WriteFile(filepath.Join(dir, "cni", "10-bkdt.conflist"), fmt.Appendf(nil, `{"cniVersion": "1.0.0", "name": "%s", "plugins": [
  {"type": "bridge", "bridge": %q, "isGateway": true, "isDefaultGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "%s.0/24", "rangeStart": "%s.10", "gateway": "%s.1"}]], "dataDir": %q}}]}`,
		bridge, bridge, clusterSubnet, clusterSubnet, clusterSubnet, filepath.Join(dir, "ipam")), 0o644)
	ctd := startContainerdIn(t, fmt.Sprintf(`
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/bkdt-pause:1"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
`, filepath.Join(dir, "cni")), "k8s.io", nodeNS.Do)
	for _, prog := range []string{"pause", "client"} {
		out := filepath.Join(dir, prog)
		build := exec.Command("go", "build", "-o", out, "./testdata/"+prog)
		build.Env = append(os.Environ(), "CGO_ENABLED=0") // static: the images have nothing else
		if b, err := build.CombinedOutput(); err != nil {
			t.Fatalf("building %s: %v\n%s", prog, err, b)
		}
		buildImage(t, nodeNS, ctd, dir, "localhost/bkdt-"+prog+":1", out)
	}
	tag := strings.ReplaceAll(name, "-", "")
	tar := filepath.Join(dir, "breakerd.tar")
	var out []byte
	if err := nodeNS.Mounts(func() (err error) {
		out, err = exec.Command("../scripts/image", tar, "localhost/breakerd:"+tag).CombinedOutput()
		return err
	}); err != nil {
		t.Fatalf("scripts/image: %v\n%s", err, out)
	}
	ctd.ctr("images", "import", tar)

	node0 := "node-" + name
	os.WriteFile(filepath.Join(dir, "kubelet.yaml"), fmt.Appendf(nil, `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%s
enforceNodeAllocatable: []
failSwapOn: false
address: 127.0.0.1
port: 0
readOnlyPort: 0
healthzPort: 0
authentication: {anonymous: {enabled: false}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://%s
podLogsDir: %s
volumePluginDir: %s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {"memory.available": "1Mi"}
localStorageCapacityIsolation: false
resolvConf: ""
syncFrequency: 5s
`, name, ctd.sock, filepath.Join(dir, "logs"), filepath.Join(dir, "volume-plugins")), 0o644)
	cs := api.Clientset(t)
	ctx := context.Background()
	stopKubelet := nodeProcess(t, nodeNS, dir, kubelet, "--config", filepath.Join(dir, "kubelet.yaml"), "--kubeconfig", kubeconfig,
		"--root-dir", filepath.Join(dir, "kubelet"), "--cert-dir", filepath.Join(dir, "kubelet-pki"),
		"--hostname-override", node0, "--node-ip", clusterSubnet+".1")
	t.Cleanup(func() {
		// The DaemonSet first (its controller would make the pod again),
		// then the pods, through the kubelet, so the CRI tears their
		// sandboxes (and network namespaces) down; then the kubelet stops.
		zero := int64(0)
		cs.AppsV1().DaemonSets("breakerd").Delete(ctx, "breakerd", metav1.DeleteOptions{})
		for _, ns := range []string{"default", "breakerd"} {
			cs.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
		}
		kerneltest.WaitFor(30*time.Second, func() bool {
			out, _ := ctd.ctrOut("tasks", "ls", "-q")
			return strings.TrimSpace(out) == ""
		})
		stopKubelet()
	})

	// kube-proxy, nftables mode, in the node's namespace; conntrack left
	// as it is (maxPerCore 0 skips nf_conntrack_max and the module's
	// machine-wide hashsize; zero timeouts skip those sysctls).
	os.WriteFile(filepath.Join(dir, "kube-proxy.yaml"), fmt.Appendf(nil, `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %q}
hostnameOverride: %s
mode: nftables
clusterCIDR: %s.0/24
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
oomScoreAdj: 0
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
`, kubeconfig, node0, clusterSubnet), 0o644)
	t.Cleanup(nodeProcess(t, nodeNS, dir, filepath.Join(cbins, "kube-proxy"), "--config", filepath.Join(dir, "kube-proxy.yaml")))

	if !eventually(90*time.Second, func() bool {
		n, err := cs.CoreV1().Nodes().Get(ctx, node0, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	}) {
		t.Fatal("the node did not become Ready")
	}

	// The backend: a Service with no selector and one endpoint, on the
	// backend host, where nothing listens on 8080 (every connect refused).
	svc, err := cs.CoreV1().Services("default").Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "backend"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP}}}},
		metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ready, port, proto := true, int32(8080), corev1.ProtocolTCP
	portName := "http"
	if _, err := cs.DiscoveryV1().EndpointSlices("default").Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "backend-1", Labels: map[string]string{
			discoveryv1.LabelServiceName: "backend", discoveryv1.LabelManagedBy: "breakerd-cluster-test"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{backend.IPv4.String()}, Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &ready}}},
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &port, Protocol: &proto}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// kubectl apply -k: deploy/ through the overlay.
	overlay := filepath.Join(dir, "overlay")
	os.MkdirAll(overlay, 0o755)
	here, _ := os.Getwd()
	rel, err := filepath.Rel(overlay, here)
	if err != nil {
		t.Fatal(err)
	}
	kubectl := func(args ...string) string {
		t.Helper()
		out, err := node.Command(nil, kubectlBin, append([]string{"--kubeconfig", kubeconfig, "--cache-dir", filepath.Join(dir, "kubectl-cache")}, args...)...).Run(t)
		if err != nil {
			t.Fatalf("kubectl %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	applyOverlay := func(policyText string) string {
		t.Helper()
		policy, _ := json.Marshal(policyText)
		os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), fmt.Appendf(nil, `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [%s]
images:
  - {name: ghcr.io/breakerd/breakerd, newName: localhost/breakerd, newTag: %s}
patches:
  - target: {kind: DaemonSet, name: breakerd}
    patch: |-
      - {op: test, path: /spec/template/spec/containers/0/args/1, value: --cgroup=/host/cgroup}
      - {op: replace, path: /spec/template/spec/containers/0/args/1, value: --cgroup=/host/cgroup/unified/%s}
      - {op: test, path: /spec/template/spec/containers/0/args/2, value: --bpffs=/sys/fs/bpf/breakerd}
      - {op: replace, path: /spec/template/spec/containers/0/args/2, value: --bpffs=%s}
  - target: {kind: ConfigMap, name: breakerd-config}
    patch: |-
      - {op: replace, path: /data/breakerd.yaml, value: %s}
`, rel, tag, name, pins, policy), 0o644)
		return kubectl("apply", "-k", overlay)
	}
	t.Logf("kubectl apply -k:\n%s", applyOverlay(clusterPolicy))

	// The DaemonSet controller's pod, bound to the node by the scheduler
	// (the one pod of the DaemonSet, ready, and not the pod before).
	daemonPod := func(before types.UID) corev1.Pod {
		t.Helper()
		var p corev1.Pod
		if !eventually(120*time.Second, func() bool {
			l, err := cs.CoreV1().Pods("breakerd").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=breakerd"})
			if err != nil || len(l.Items) != 1 || l.Items[0].UID == before {
				return false
			}
			p = l.Items[0]
			return waitPodReady(cs, "breakerd", p.Name, time.Millisecond)
		}) {
			t.Fatalf("breakerd's pod not ready: %s", podStatus(cs, "breakerd", p.Name))
		}
		return p
	}
	bpod := daemonPod("")
	if o := metav1.GetControllerOf(&bpod); o == nil || o.Kind != "DaemonSet" || o.Name != "breakerd" {
		t.Errorf("breakerd's pod %s is not the DaemonSet's: controller %+v", bpod.Name, o)
	}
	if bpod.Spec.NodeName != node0 {
		t.Errorf("breakerd's pod is on %q, want %q", bpod.Spec.NodeName, node0)
	}
	if !hasEvent(cs, "breakerd", "Pod", bpod.Name, "Scheduled", "default-scheduler", node0) {
		t.Errorf("no Scheduled Event from the scheduler for %s: %s", bpod.Name, eventsOf(cs, "breakerd"))
	}
	get := adminAPI(t, nodeNS, dir, bpod)
	if !eventually(30*time.Second, func() bool {
		m, err := get("/metrics")
		return err == nil && strings.Contains(m, "\nbreakerd_kubernetes_api_reachable 1\n")
	}) {
		m, err := get("/metrics")
		t.Fatalf("breakerd does not reach the API server through the kubernetes Service (%v):\n%s\nbreakerd's log:\n%s",
			err, grepLines(m, "breakerd_kubernetes_"), tailString(strings.Join(podLog(dir, "breakerd", bpod.Name, "breakerd"), "\n"), 4000))
	}
	// The shipped ClusterRole allows every list and watch breakerd makes.
	m, _ := get("/metrics")
	for l := range strings.Lines(grepLines(m, "breakerd_kubernetes_watch_errors_total{")) {
		if strings.Contains(l, `reason="forbidden"`) && !strings.HasSuffix(l, " 0\n") {
			t.Errorf("breakerd was denied by RBAC: %s", l)
		}
	}

	// Two client pods, bound by the scheduler, to the backend's cluster IP.
	dest := net.JoinHostPort(svc.Spec.ClusterIP, "80")
	for pod, role := range map[string]string{"client": "client", "control": "control"} {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: pod, Namespace: "default", Labels: map[string]string{"role": role}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "client", Image: "localhost/bkdt-client:1",
				ImagePullPolicy: corev1.PullNever, Args: []string{dest}}}}}
		if _, err := cs.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	const rejected, refused = "connect: software caused connection abort", "connect: connection refused"
	count := func(lines []string, suffix string) int {
		n := 0
		for _, l := range lines {
			if strings.HasSuffix(l, suffix) {
				n++
			}
		}
		return n
	}
	if !eventually(90*time.Second, func() bool {
		return count(podLog(dir, "default", "client", "client"), rejected) >= 20 && len(podLog(dir, "default", "control", "client")) >= 20
	}) {
		t.Fatalf("client pods: %s / %s\nclient: %q\ncontrol: %q", podStatus(cs, "default", "client"), podStatus(cs, "default", "control"),
			podLog(dir, "default", "client", "client"), podLog(dir, "default", "control", "client"))
	}
	client, control := podLog(dir, "default", "client", "client"), podLog(dir, "default", "control", "client")
	first := slices.IndexFunc(client, func(l string) bool { return strings.HasSuffix(l, rejected) })
	for i, l := range client {
		if want := refused; i >= first {
			want = rejected
			if !strings.HasSuffix(l, want) {
				t.Errorf("client pod, connect %d after the circuit opened: %q, want %q", i, l, want)
			}
		} else if !strings.HasSuffix(l, want) {
			t.Errorf("client pod, connect %d before the circuit opened: %q, want %q", i, l, want)
		}
	}
	if first < 3 {
		t.Errorf("client pod: rejected from connect %d on; the circuit opens after 3 refused", first)
	}
	t.Logf("client pod: %d connects refused by the endpoint through kube-proxy, then %d rejected in connect()", first, len(client)-first)
	for _, l := range control {
		if !strings.HasSuffix(l, refused) {
			t.Errorf("control pod: %q, want every connect %q (it is no workload's)", l, refused)
		}
	}
	t.Logf("control pod: %d connects, every one %q", len(control), refused)

	// The kubelet wrote the kernel settings it wants into the node's
	// shadows of them, and the node's daemons wrote where they have no
	// setting for it into the overlays: libcni's result cache
	// (containerd), the kubelet's device plugin socket and its container
	// log links, runc's state. (The machine's settings and paths are
	// checked at the end.)
	for _, s := range kubeletSysctls {
		if v, err := os.ReadFile(nodeNS.sysctlFile(s.key)); err != nil || strings.TrimSpace(string(v)) != s.kubelet {
			t.Errorf("the node's %s is %q (%v), want the kubelet's %s", s.key, v, err, s.kubelet)
		}
	}
	for _, p := range []string{"/var/lib/cni/results", "/var/lib/kubelet/device-plugins/kubelet.sock", "/var/log/containers", "/run/containerd/runc"} {
		if _, err := os.Lstat(nodeNS.written(p)); err != nil {
			t.Errorf("the node's %s is not in its overlay: %v", p, err)
		}
	}

	// What breakerd says (its per-cgroup counts are read every second:
	// wait for them to catch up with the log), and what it posted.
	circuit, body := backendCircuit(t, get, uint64(len(client)-first))
	if circuit.State != "open" || !slices.Contains(circuit.FailedPods, "default/client") || slices.Contains(circuit.FailedPods, "default/control") ||
		len(circuit.RejectedBy) != 1 || circuit.RejectedBy[0].Pod != "default/client" || circuit.RejectedBy[0].Workload != "clients" ||
		circuit.RejectedBy[0].Rejected < uint64(len(client)-first) {
		t.Errorf("circuit backend: want open, failed_pods and rejected_by naming default/client alone (at least %d rejections): %s", len(client)-first, body)
	}
	if !slices.ContainsFunc(circuit.Destinations, func(d string) bool { return strings.Contains(d, dest) }) ||
		!slices.ContainsFunc(circuit.Destinations, func(d string) bool { return strings.Contains(d, backend.IPv4.String()+":8080") }) {
		t.Errorf("circuit backend: destinations %q, want the cluster IP %s and the endpoint %s:8080", circuit.Destinations, dest, backend.IPv4)
	}
	t.Logf("/v1/circuits/backend: %s", body)
	if !eventually(20*time.Second, func() bool {
		return hasEvent(cs, "default", "Service", "backend", "CircuitOpened", "", "default/client")
	}) {
		t.Errorf("no CircuitOpened Event on Service default/backend naming default/client: %s", eventsOf(cs, "default"))
	}

	// A rolling update (kubectl rollout restart): the DaemonSet controller
	// deletes the pod, whose breakerd leaves its pins on SIGTERM, then
	// makes the next one (maxSurge 0), which adopts them; the kernel keeps
	// rejecting in between, under the fail-safe heartbeat. The client
	// keeps connecting throughout.
	began := time.Now()
	kubectl("-n", "breakerd", "rollout", "restart", "daemonset/breakerd")
	npod := daemonPod(bpod.UID)
	t.Logf("rolling update: pod %s replaced by %s, ready %v after the restart began", bpod.Name, npod.Name, time.Since(began).Round(100*time.Millisecond))
	upTo := len(podLog(dir, "default", "client", "client"))
	if !eventually(30*time.Second, func() bool { return len(podLog(dir, "default", "client", "client")) >= upTo+10 }) {
		t.Fatalf("the client pod stopped connecting: %s", podStatus(cs, "default", "client"))
	}
	client = podLog(dir, "default", "client", "client")
	for i, l := range client[first:] {
		if !strings.HasSuffix(l, rejected) {
			t.Errorf("client pod, connect %d after the circuit opened (across the rolling update): %q, want %q", first+i, l, rejected)
		}
	}
	t.Logf("client pod: %d connects rejected across the rolling update, none let through", len(client)-first)
	if log := strings.Join(podLog(dir, "breakerd", npod.Name, "breakerd"), "\n"); !strings.Contains(log, `"msg":"adopted open circuit(s) from the pinned verdict map","count":1`) {
		t.Errorf("the new pod's breakerd did not adopt the open circuit from the pins:\n%s", tailString(log, 4000))
	}
	getNew := adminAPI(t, nodeNS, dir, npod)
	adopted, body := backendCircuit(t, getNew, uint64(len(client)-first))
	if adopted.State != "open" || adopted.OpenUntil.Sub(circuit.OpenUntil).Abs() > time.Second ||
		len(adopted.RejectedBy) != 1 || adopted.RejectedBy[0].Pod != "default/client" || adopted.RejectedBy[0].Rejected < uint64(len(client)-first) {
		t.Errorf("circuit backend after the rolling update: want it adopted, open until %v, its rejections of default/client counted on (at least %d): %s",
			circuit.OpenUntil, len(client)-first, body)
	}

	// A policy edit, applied the same way: the overlay's policy with a
	// second workload that selects the control pod. The kubelet swaps the
	// ConfigMap's files (syncFrequency 5 s), breakerd reloads, and the
	// control pod is now protected by the shared open circuit: its
	// connects, refused by the endpoint so far, are rejected.
	began = time.Now()
	if out := applyOverlay(reloadedPolicy); !strings.Contains(out, "configmap/breakerd-config configured") {
		t.Errorf("kubectl apply -k of the edited policy: %s", out)
	}
	if !eventually(60*time.Second, func() bool {
		l := podLog(dir, "default", "control", "client")
		return len(l) >= 5 && !slices.ContainsFunc(l[len(l)-5:], func(l string) bool { return !strings.HasSuffix(l, rejected) })
	}) {
		t.Fatalf("the control pod is not rejected after the policy edit: %q\nbreakerd's log:\n%s", podLog(dir, "default", "control", "client"),
			tailString(strings.Join(podLog(dir, "breakerd", npod.Name, "breakerd"), "\n"), 4000))
	}
	t.Logf("policy edit: the control pod rejected %v after kubectl apply -k", time.Since(began).Round(100*time.Millisecond))
	control = podLog(dir, "default", "control", "client")
	cfirst := slices.IndexFunc(control, func(l string) bool { return strings.HasSuffix(l, rejected) })
	for i, l := range control {
		if want := refused; i >= cfirst && !strings.HasSuffix(l, rejected) || i < cfirst && !strings.HasSuffix(l, want) {
			t.Errorf("control pod, connect %d (rejected from %d on): %q", i, cfirst, l)
		}
	}
	if log := strings.Join(podLog(dir, "breakerd", npod.Name, "breakerd"), "\n"); !strings.Contains(log, `"msg":"configuration reloaded"`) {
		t.Errorf("breakerd did not log the reload:\n%s", tailString(log, 4000))
	}
	if m, _ := getNew("/metrics"); !strings.Contains(m, "\nbreakerd_config_last_reload_successful 1\n") {
		t.Errorf("breakerd_config_last_reload_successful is not 1: %s", grepLines(m, "breakerd_config_"))
	}
	client = podLog(dir, "default", "client", "client")
	for i, l := range client[first:] {
		if !strings.HasSuffix(l, rejected) {
			t.Errorf("client pod, connect %d after the circuit opened (across the reload): %q, want %q", first+i, l, rejected)
		}
	}
	reloaded, body := backendCircuit(t, getNew, 0)
	if reloaded.State != "open" || !slices.ContainsFunc(reloaded.RejectedBy, func(r rejectedBy) bool {
		return r.Pod == "default/control" && r.Workload == "controls" && r.Rejected > 0
	}) {
		t.Errorf("circuit backend after the reload: want it open, rejecting default/control of workload controls: %s", body)
	}

	// kube-proxy's and the kubelet's rules are the node namespace's, not
	// the machine's.
	inNode, err := kubeNetfilter(node)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(inNode, "table ip kube-proxy") || !slices.Contains(inNode, "chain KUBE-KUBELET-CANARY") {
		t.Errorf("the node's namespace lacks kube-proxy's table or the kubelet's chains: %q", inNode)
	}
	if after, err := kubeNetfilter(nil); err != nil || !slices.Equal(after, hostKube) {
		t.Errorf("the machine's netfilter changed: Kubernetes' tables and chains were %q, now %q (%v)", hostKube, after, err)
	}
}

// breakerCircuit is what the test reads of a circuit in /v1/circuits.
type breakerCircuit struct {
	State        string       `json:"state"`
	OpenUntil    time.Time    `json:"open_until"`
	FailedPods   []string     `json:"failed_pods"`
	RejectedBy   []rejectedBy `json:"rejected_by"`
	Destinations []string     `json:"destinations"`
}

// rejectedBy is one entry of a circuit's rejected_by.
type rejectedBy struct {
	Pod      string `json:"pod"`
	Workload string `json:"workload"`
	Rejected uint64 `json:"rejected"`
}

// backendCircuit reads the circuit backend once its first rejecting pod's
// count reaches atLeast (the daemon reads the kernel's per-cgroup counts
// every second: they catch up with the client's log), or after 10 s.
func backendCircuit(t *testing.T, get func(string) (string, error), atLeast uint64) (breakerCircuit, string) {
	t.Helper()
	var c breakerCircuit
	var body string
	var err error
	eventually(10*time.Second, func() bool {
		if body, err = get("/v1/circuits/backend"); err != nil {
			return false
		}
		c = breakerCircuit{}
		if err = json.Unmarshal([]byte(body), &c); err != nil {
			return false
		}
		return len(c.RejectedBy) > 0 && c.RejectedBy[0].Rejected >= atLeast
	})
	if err != nil {
		t.Fatalf("/v1/circuits/backend: %v: %s", err, body)
	}
	return c, body
}

// adminAPI returns a GET of breakerd's admin API over its socket in pod's
// /run (an emptyDir, a tmpfs the kubelet mounted in the node's mount
// namespace), through a symbolic link: its path from here is longer than a
// socket address holds.
func adminAPI(t *testing.T, node *nodeNamespace, dir string, pod corev1.Pod) func(path string) (string, error) {
	short := filepath.Join(dir, "admin-"+string(pod.UID)[:8])
	run := filepath.Join(dir, "kubelet", "pods", string(pod.UID), "volumes", "kubernetes.io~empty-dir", "run", "breakerd")
	if err := os.Symlink(node.Path(run), short); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(short, "admin.sock")
	admin := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	return func(path string) (string, error) {
		resp, err := admin.Get("http://breakerd" + path)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return string(b), fmt.Errorf("GET %s: %s", path, resp.Status)
		}
		return string(b), err
	}
}

// nodeProcess starts bin in the node's namespaces, its output in
// dir/<bin's name>.log, and returns what stops it: a kill by PID, a wait,
// and, when the test failed, the log's last lines in the test's.
func nodeProcess(t *testing.T, node *nodeNamespace, dir, bin string, args ...string) (stop func()) {
	t.Helper()
	path := filepath.Join(dir, filepath.Base(bin)+".log")
	log, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &unix.SysProcAttr{Pdeathsig: unix.SIGKILL}
	if err := node.Do(cmd.Start); err != nil {
		t.Fatal(err)
	}
	return func() {
		cmd.Process.Kill()
		cmd.Wait()
		log.Close()
		if t.Failed() {
			data, _ := os.ReadFile(path)
			t.Logf("%s log (last 6000 bytes):\n%s", filepath.Base(bin), tailString(string(data), 6000))
		}
	}
}

// kubeNetfilter lists the nftables tables named kube-proxy and the chains
// named KUBE-… (iptables-nft's, from the kubelet or kube-proxy) in h's
// network namespace, or the machine's when h is nil, sorted.
func kubeNetfilter(h *kerneltest.Host) ([]string, error) {
	cmd := exec.Command("nft", "list", "ruleset")
	var out strings.Builder
	cmd.Stdout = &out
	start := cmd.Start
	if h != nil {
		start = func() error { return h.Do(cmd.Start) }
	}
	if err := start(); err != nil {
		return nil, err
	}
	if err := cmd.Wait(); err != nil {
		return nil, fmt.Errorf("nft list ruleset: %w", err)
	}
	var found []string
	for l := range strings.Lines(out.String()) {
		l = strings.TrimSuffix(strings.TrimSpace(l), " {")
		if strings.HasPrefix(l, "table ") && strings.HasSuffix(l, " kube-proxy") || strings.HasPrefix(l, "chain KUBE-") {
			found = append(found, l)
		}
	}
	slices.Sort(found)
	return found, nil
}

// eventually polls cond every 250 ms until it holds or d has passed.
func eventually(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(250 * time.Millisecond)
	}
	return true
}

// hasEvent reports whether namespace ns has an Event on the object kind/name
// with the reason, from component (any when empty), whose message contains
// text.
func hasEvent(cs kubernetes.Interface, ns, kind, name, reason, component, text string) bool {
	l, err := cs.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return false
	}
	return slices.ContainsFunc(l.Items, func(e corev1.Event) bool {
		return e.InvolvedObject.Kind == kind && e.InvolvedObject.Name == name && e.Reason == reason &&
			(component == "" || e.Source.Component == component || e.ReportingController == component) && strings.Contains(e.Message, text)
	})
}

func eventsOf(cs kubernetes.Interface, ns string) string {
	l, err := cs.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range l.Items {
		fmt.Fprintf(&b, "\n%s/%s %s (%s%s): %s", e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Source.Component, e.ReportingController, e.Message)
	}
	return b.String()
}

// podLog is the lines a container of a pod wrote so far, from the kubelet's
// log files (the CRI's format: time, stream, tag, then the line).
func podLog(dir, ns, pod, container string) []string {
	m, _ := filepath.Glob(filepath.Join(dir, "logs", ns+"_"+pod+"_*", container, "0.log"))
	if len(m) == 0 {
		return nil
	}
	data, _ := os.ReadFile(m[0])
	s := strings.TrimSpace(string(data))
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

func grepLines(s, sub string) string {
	var b strings.Builder
	for l := range strings.Lines(s) {
		if strings.Contains(l, sub) {
			b.WriteString(l)
		}
	}
	return b.String()
}

func tailString(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func waitPodReady(cs kubernetes.Interface, ns, name string, d time.Duration) bool {
	return kerneltest.WaitFor(d, func() bool {
		p, err := cs.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
}

func podStatus(cs kubernetes.Interface, ns, name string) string {
	p, err := cs.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("%s %+v", p.Status.Phase, p.Status.ContainerStatuses)
}
