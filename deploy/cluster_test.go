package deploy

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/internal/kubeapitest"
)

// clusterSubnet is the pods' network: a bridge of the test's own with
// 198.18.250.1 on the host side, so the kubelet's probes of pod IPs stay
// on this machine (198.18.0.0/15 is the tests' range).
const clusterSubnet = "198.18.250"

// buildImage makes an image of one static binary from scratch with
// buildah and imports it into containerd's k8s.io namespace.
func buildImage(t *testing.T, ctd *containerdForTest, dir, name, binary string) {
	t.Helper()
	store := filepath.Join(dir, "buildah-"+filepath.Base(binary))
	b := []string{"--root", store + "/s", "--runroot", store + "/r", "--storage-driver", "vfs"}
	run := func(args ...string) string {
		out, err := exec.Command("buildah", append(b, args...)...).CombinedOutput()
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

// TestOneNodeCluster runs a real kubelet (built from k8s.io/kubernetes
// v1.37.2) against a real kube-apiserver, with Debian's containerd (CRI)
// and runc, and the CNI bridge plugin on a bridge of the test's own. It
// starts breakerd from the DaemonSet's pod template (its image, built here
// from scratch; the ConfigMap; its securityContext and mounts) and two
// client pods: the one whose destination the policy forces open is
// rejected in connect() with the configured errno, the other is not.
//
// What it changes from a cluster: no DaemonSet controller runs (the pod is
// made from the template, bound to the node), the pods' network is a bridge
// with no route out, and breakerd protects the kubelet's own cgroup root
// instead of the machine's root cgroup. This machine's hybrid cgroup layout
// needs failCgroupV1: false (kubelet 1.37 refuses cgroup v1 by default), the
// cgroupfs driver (PID 1 is not systemd), and containerd's
// restrict_oom_score_adj (root lacks CAP_SYS_RESOURCE in its bounding set,
// so runc cannot lower a sandbox's oom_score_adj to -998).
//
// Opt-in (BREAKERD_CLUSTER_TEST=1): the kubelet manages cgroups in every
// hierarchy, network namespaces and a bridge on the host, which a shared
// CI machine is not given by default.
func TestOneNodeCluster(t *testing.T) {
	if os.Getenv("BREAKERD_CLUSTER_TEST") == "" {
		t.Skip("opt-in: BREAKERD_CLUSTER_TEST=1 runs a kubelet on this machine")
	}
	kerneltest.RequireKernel(t)
	bins, err := kubeapitest.Binaries()
	if err != nil {
		t.Fatal(err)
	}
	kubelet := filepath.Join(bins, "kubelet")
	if _, err := os.Stat(kubelet); err != nil {
		t.Fatalf("no kubelet (kubetest/build builds it): %v", err)
	}
	name := kerneltest.UniqueName()
	pins := "/sys/fs/bpf/" + name
	host := filepath.Join(t.TempDir(), "breakerd")
	if out, err := exec.Command("go", "build", "-o", host, "../cmd/breakerd").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		exec.Command(host, "uninstall", "--bpffs", pins).Run()
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
	// The bridge, with the host's address on it before any pod exists.
	bridge := "bkb" + name[len(name)-8:]
	ip := func(args ...string) {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v\n%s", args, err, out)
		}
	}
	ip("link", "add", bridge, "type", "bridge")
	t.Cleanup(func() { exec.Command("ip", "link", "del", bridge).Run() })
	ip("addr", "add", clusterSubnet+".1/24", "dev", bridge)
	ip("link", "set", bridge, "up")
	netnsBefore, _ := os.ReadDir("/var/run/netns")

	api := kubeapitest.Start(t)
	dir, err := os.MkdirTemp("/tmp", "bkdt-cl-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		exec.Command("umount", "-R", filepath.Join(dir, "kubelet")).Run()
		os.RemoveAll(dir)
		// Network namespaces the CRI made and did not remove.
		after, _ := os.ReadDir("/var/run/netns")
		for _, e := range after {
			if strings.HasPrefix(e.Name(), "cni-") && !slices.ContainsFunc(netnsBefore, func(b os.DirEntry) bool { return b.Name() == e.Name() }) {
				exec.Command("ip", "netns", "del", e.Name()).Run()
			}
		}
	})
	for _, d := range []string{"cni", "logs", "kubelet", "ipam"} {
		os.MkdirAll(filepath.Join(dir, d), 0o755)
	}
	os.WriteFile(filepath.Join(dir, "cni", "10-bkdt.conflist"), fmt.Appendf(nil, `{"cniVersion": "1.0.0", "name": "%s", "plugins": [
  {"type": "bridge", "bridge": %q, "isGateway": false, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "%s.0/24", "rangeStart": "%s.10"}]], "dataDir": %q}}]}`,
		bridge, bridge, clusterSubnet, clusterSubnet, filepath.Join(dir, "ipam")), 0o644)
	ctd := startContainerdWith(t, fmt.Sprintf(`
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/bkdt-pause:1"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
`, filepath.Join(dir, "cni")), "k8s.io")
	for _, prog := range []string{"pause", "client"} {
		out := filepath.Join(dir, prog)
		build := exec.Command("go", "build", "-o", out, "./testdata/"+prog)
		build.Env = append(os.Environ(), "CGO_ENABLED=0") // static: the images have nothing else
		if b, err := build.CombinedOutput(); err != nil {
			t.Fatalf("building %s: %v\n%s", prog, err, b)
		}
		buildImage(t, ctd, dir, "localhost/bkdt-"+prog+":1", out)
	}
	image := "localhost/breakerd:" + strings.ReplaceAll(name, "-", "")
	tar := filepath.Join(dir, "breakerd.tar")
	if out, err := exec.Command("../scripts/image", tar, image).CombinedOutput(); err != nil {
		t.Fatalf("scripts/image: %v\n%s", err, out)
	}
	ctd.ctr("images", "import", tar)

	kubeconfig := filepath.Join(dir, "kubeconfig")
	os.WriteFile(kubeconfig, fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters: [{name: t, cluster: {server: %q, certificate-authority-data: %s}}]
users: [{name: u, user: {client-certificate-data: %s, client-key-data: %s}}]
contexts: [{name: c, context: {cluster: t, user: u}}]
current-context: c
`, api.URL, base64.StdEncoding.EncodeToString(api.CAData), base64.StdEncoding.EncodeToString(api.Admin.CertData), base64.StdEncoding.EncodeToString(api.Admin.KeyData)), 0o600)
	node := "node-" + name
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
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {"memory.available": "1Mi"}
localStorageCapacityIsolation: false
resolvConf: ""
`, name, ctd.sock, filepath.Join(dir, "logs")), 0o644)
	klog, _ := os.Create(filepath.Join(dir, "kubelet.log"))
	kcmd := exec.Command(kubelet, "--config", filepath.Join(dir, "kubelet.yaml"), "--kubeconfig", kubeconfig,
		"--root-dir", filepath.Join(dir, "kubelet"), "--hostname-override", node)
	kcmd.Stdout, kcmd.Stderr = klog, klog
	if err := kcmd.Start(); err != nil {
		t.Fatal(err)
	}
	cs := api.Clientset(t)
	ctx := context.Background()
	t.Cleanup(func() {
		// Pods go through the kubelet first, so the CRI tears their
		// sandboxes (and network namespaces) down; then the kubelet stops.
		zero := int64(0)
		for _, ns := range []string{"default", "breakerd"} {
			cs.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
		}
		kerneltest.WaitFor(30*time.Second, func() bool {
			out, _ := ctd.ctrOut("tasks", "ls", "-q")
			return strings.TrimSpace(out) == ""
		})
		kcmd.Process.Kill()
		kcmd.Wait()
		klog.Close()
		if t.Failed() {
			data, _ := os.ReadFile(filepath.Join(dir, "kubelet.log"))
			t.Logf("kubelet log (last 6000 bytes):\n%s", tailString(string(data), 6000))
		}
	})
	if !kerneltest.WaitFor(60*time.Second, func() bool {
		n, err := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
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

	// breakerd from the shipped manifests: namespace, service account,
	// ConfigMap (its policy replaced), and a pod of the DaemonSet's
	// template bound to the node.
	var ns corev1.Namespace
	decodeStrict(t, "namespace.yaml", &ns)
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var sa corev1.ServiceAccount
	decodeStrict(t, "serviceaccount.yaml", &sa)
	if _, err := cs.CoreV1().ServiceAccounts(ns.Name).Create(ctx, &sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var cm corev1.ConfigMap
	decodeStrict(t, "configmap.yaml", &cm)
	cm.Namespace = ns.Name
	cm.Data["breakerd.yaml"] = "targets:\n  down:\n    match: {cidrs: [127.0.0.1], ports: [\"9999\"]}\n    state: forced_open\n    reject_errno: EHOSTUNREACH\n"
	if _, err := cs.CoreV1().ConfigMaps(ns.Name).Create(ctx, &cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ds := daemonSet(t)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "breakerd-" + node, Namespace: ns.Name, Labels: ds.Spec.Template.Labels},
		Spec: *ds.Spec.Template.Spec.DeepCopy()}
	pod.Spec.NodeName = node
	pod.Spec.PriorityClassName = "" // the Priority admission plugin's classes are not set up here
	c := &pod.Spec.Containers[0]
	c.Image, c.ImagePullPolicy = image, corev1.PullNever
	for i, a := range c.Args {
		switch {
		case strings.HasPrefix(a, "--cgroup="):
			c.Args[i] = "--cgroup=/host/cgroup/unified/" + name // the kubelet's pods, not the machine
		case strings.HasPrefix(a, "--bpffs="):
			c.Args[i] = "--bpffs=" + pins
		}
	}
	if _, err := cs.CoreV1().Pods(ns.Name).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if !waitPodReady(cs, ns.Name, pod.Name, 90*time.Second) {
		t.Fatalf("breakerd's pod not ready: %s", podStatus(cs, ns.Name, pod.Name))
	}
	for name, dest := range map[string]string{"client": "127.0.0.1:9999", "control": "127.0.0.1:9998"} {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}, Spec: corev1.PodSpec{NodeName: node,
			Containers: []corev1.Container{{Name: "client", Image: "localhost/bkdt-client:1", ImagePullPolicy: corev1.PullNever, Args: []string{dest}}}}}
		if _, err := cs.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	logOf := func(pod string) []string {
		m, _ := filepath.Glob(filepath.Join(dir, "logs", "default_"+pod+"_*", "client", "0.log"))
		if len(m) == 0 {
			return nil
		}
		data, _ := os.ReadFile(m[0])
		return strings.Split(strings.TrimSpace(string(data)), "\n")
	}
	if !kerneltest.WaitFor(60*time.Second, func() bool { return len(logOf("client")) >= 20 && len(logOf("control")) >= 20 }) {
		t.Fatalf("client pods: %s / %s", podStatus(cs, "default", "client"), podStatus(cs, "default", "control"))
	}
	for pod, want := range map[string]string{"client": "connect: no route to host", "control": "connect: connection refused"} {
		lines := logOf(pod)
		for _, l := range lines {
			if !strings.HasSuffix(l, want) {
				t.Fatalf("%s pod: %q, want every connect to end %q", pod, l, want)
			}
		}
		t.Logf("%s pod: %d connects, every one %q", pod, len(lines), want)
	}
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
