package deploy

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/breakerd/breakerd/internal/cgroup2"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

// containerdForTest runs a containerd of the test's own (root, state and
// socket in a temporary directory, the CRI plugin off), stopped by PID at
// the end.
type containerdForTest struct {
	t    *testing.T
	dir  string
	sock string
	ns   string
}

func startContainerd(t *testing.T) *containerdForTest {
	t.Helper()
	return startContainerdWith(t, "", "")
}

// startContainerdWith runs containerd with the CRI plugin configured by
// cri (a TOML fragment), or off when cri is empty, and ctr in namespace ns
// (a unique one when empty).
func startContainerdWith(t *testing.T, cri, ns string) *containerdForTest {
	t.Helper()
	return startContainerdIn(t, cri, ns, nil)
}

// startContainerdIn is startContainerdWith with containerd started by do
// (on a thread in a network namespace: kerneltest.Host.Do), so its shims,
// its sandboxes' CNI plugins and their bridge live there; nil: here.
func startContainerdIn(t *testing.T, cri, ns string, do func(func() error) error) *containerdForTest {
	t.Helper()
	for _, bin := range []string{"containerd", "ctr", "runc", "buildah", "containerd-shim-runc-v2"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s is needed (scripts/setup installs buildah, containerd and runc): %v", bin, err)
		}
	}
	// A short path: the socket's must fit in sun_path.
	dir, err := os.MkdirTemp("/tmp", "bkdt-ctd-")
	if err != nil {
		t.Fatal(err)
	}
	if ns == "" {
		ns = strings.ReplaceAll(kerneltest.UniqueName(), "-", "")
	}
	c := &containerdForTest{t: t, dir: dir, sock: filepath.Join(dir, "c.sock"), ns: ns}
	plugins := `disabled_plugins = ["io.containerd.grpc.v1.cri"]`
	if cri != "" {
		plugins = ""
	}
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
%s
[grpc]
  address = %q
[ttrpc]
  address = %q
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = %q
%s`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), plugins, c.sock, c.sock+".ttrpc", filepath.Join(dir, "opt"), cri)
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	logs, err := os.Create(filepath.Join(dir, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = os.Lstat("/opt/containerd")
	optBefore := err == nil
	cmd := exec.Command("containerd", "--config", filepath.Join(dir, "config.toml"))
	cmd.Stdout, cmd.Stderr = logs, logs
	cmd.SysProcAttr = &unix.SysProcAttr{Pdeathsig: unix.SIGKILL}
	if do == nil {
		do = func(f func() error) error { return f() }
	}
	if err := do(cmd.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Containers first (their shims and mounts), then containerd.
		out, _ := c.ctrOut("containers", "ls", "-q")
		for _, id := range strings.Fields(out) {
			c.ctrOut("tasks", "kill", "-s", "SIGKILL", id)
			time.Sleep(200 * time.Millisecond)
			c.ctrOut("tasks", "delete", "-f", id)
			c.ctrOut("containers", "delete", id)
		}
		cmd.Process.Kill()
		cmd.Wait()
		logs.Close()
		// ctr puts containers in cgroups /<namespace>/<id> of every
		// hierarchy; runc removes <id>, the namespace's directory stays.
		if dirs, _ := filepath.Glob("/sys/fs/cgroup/*/" + c.ns); len(dirs) > 0 {
			for _, d := range dirs {
				exec.Command("find", d, "-depth", "-type", "d", "-exec", "rmdir", "{}", ";").Run()
			}
		}
		if dirs, _ := filepath.Glob("/sys/fs/cgroup/" + c.ns); len(dirs) > 0 { // unified layout
			exec.Command("find", dirs[0], "-depth", "-type", "d", "-exec", "rmdir", "{}", ";").Run()
		}
		if t.Failed() {
			data, _ := os.ReadFile(filepath.Join(dir, "containerd.log"))
			t.Logf("containerd log:\n%s", data)
		}
		os.RemoveAll(dir)
	})
	if !kerneltest.WaitFor(10*time.Second, func() bool { _, err := c.ctrOut("version"); return err == nil }) {
		t.Fatal("containerd did not start")
	}
	// Its opt plugin made its directory in the test's, not /opt/containerd.
	if _, err := os.Stat(filepath.Join(dir, "opt")); err != nil {
		t.Errorf("containerd's opt directory is not the test's: %v", err)
	}
	if _, err := os.Lstat("/opt/containerd"); err == nil && !optBefore {
		t.Error("containerd made /opt/containerd on the machine")
	}
	return c
}

func (c *containerdForTest) ctrOut(args ...string) (string, error) {
	out, err := exec.Command("ctr", append([]string{"--address", c.sock, "--namespace", c.ns}, args...)...).CombinedOutput()
	return string(out), err
}

func (c *containerdForTest) ctr(args ...string) string {
	c.t.Helper()
	out, err := c.ctrOut(args...)
	if err != nil {
		c.t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// ctrRunArgs turns the DaemonSet's container (securityContext, volumes,
// mounts, env, memory limit) into `ctr run` flags. config is the host
// directory that stands in for the ConfigMap.
func ctrRunArgs(t *testing.T, config string) []string {
	t.Helper()
	return ctrRunArgsOf(t, daemonSet(t), config)
}

// ctrRunArgsOf is ctrRunArgs for the DaemonSet ds (the base, or a build
// with components), hostPID and hostNetwork included.
func ctrRunArgsOf(t *testing.T, ds *appsv1.DaemonSet, config string) []string {
	t.Helper()
	pod := ds.Spec.Template.Spec
	c := pod.Containers[0]
	sc := c.SecurityContext
	var args []string
	if pod.HostPID {
		// The test's PID namespace is the host's (containerd's too); PID 1's
		// may not be opened here (it holds CAP_SYS_RESOURCE, which root
		// lacks on this machine).
		args = append(args, "--with-ns", fmt.Sprintf("pid:/proc/%d/ns/pid", os.Getpid()))
	}
	if pod.HostNetwork {
		args = append(args, "--net-host")
	}
	if sc.Privileged != nil && *sc.Privileged {
		args = append(args, "--privileged")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		args = append(args, "--allow-new-privs")
	}
	if sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem {
		args = append(args, "--read-only")
	}
	for _, d := range sc.Capabilities.Drop {
		args = append(args, "--cap-drop", "CAP_"+string(d))
	}
	for _, a := range sc.Capabilities.Add {
		args = append(args, "--cap-add", "CAP_"+string(a))
	}
	switch sc.SeccompProfile.Type {
	case corev1.SeccompProfileTypeRuntimeDefault:
		args = append(args, "--seccomp") // containerd's default profile
	default:
		t.Fatalf("seccomp %v: not handled here", sc.SeccompProfile.Type)
	}
	switch sc.AppArmorProfile.Type {
	case corev1.AppArmorProfileTypeUnconfined:
	case corev1.AppArmorProfileTypeRuntimeDefault:
		args = append(args, "--apparmor-default-profile", "cri-containerd.apparmor.d")
	}
	if m := c.Resources.Limits.Memory(); !m.IsZero() {
		args = append(args, "--memory-limit", fmt.Sprint(m.Value()))
	}
	vols := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		vols[v.Name] = v
	}
	for _, m := range c.VolumeMounts {
		v := vols[m.Name]
		mode := "rw"
		if m.ReadOnly {
			mode = "ro"
		}
		switch {
		case v.HostPath != nil:
			args = append(args, "--mount", fmt.Sprintf("type=bind,src=%s,dst=%s,options=rbind:%s", v.HostPath.Path, m.MountPath, mode))
		case v.ConfigMap != nil:
			args = append(args, "--mount", fmt.Sprintf("type=bind,src=%s,dst=%s,options=rbind:ro", config, m.MountPath))
		case v.EmptyDir != nil && v.EmptyDir.Medium == corev1.StorageMediumMemory:
			args = append(args, "--mount", fmt.Sprintf("type=tmpfs,src=tmpfs,dst=%s,options=nosuid:nodev:mode=0777", m.MountPath))
		default:
			t.Fatalf("volume %s: not handled here", m.Name)
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			args = append(args, "--env", e.Name+"="+e.Value)
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName":
			args = append(args, "--env", e.Name+"=test-node")
		}
	}
	return args
}

// containerArgs are the DaemonSet's breakerd arguments, with the protected
// cgroup and the pin directory moved to the test's own (under the same
// mounts).
func containerArgs(t *testing.T, cgroup, bpffs string) []string {
	t.Helper()
	return containerArgsOf(daemonSet(t), cgroup, bpffs)
}

// containerArgsOf is containerArgs for the DaemonSet ds.
func containerArgsOf(ds *appsv1.DaemonSet, cgroup, bpffs string) []string {
	var out []string
	for _, a := range ds.Spec.Template.Spec.Containers[0].Args {
		switch {
		case strings.HasPrefix(a, "--cgroup="):
			a = "--cgroup=" + cgroup
		case strings.HasPrefix(a, "--bpffs="):
			a = "--bpffs=" + bpffs
		}
		out = append(out, a)
	}
	return out
}

// TestImageInContainerd builds the image with scripts/image (buildah, from
// scratch), imports it into a containerd of the test's own, and runs it
// with the DaemonSet's securityContext and mounts (its three capabilities,
// read-only root, containerd's default seccomp profile, bpffs and the
// host's cgroup tree): it loads, protects a test cgroup, and a second
// container takes over from the first on SIGTERM while a client loop
// against a forced-open destination stays rejected throughout, with no SYN
// reaching the destination.
func TestImageInContainerd(t *testing.T) {
	kerneltest.RequireKernel(t)
	pins := kerneltest.UniqueName()
	bpffs := filepath.Join(kerneltest.BPFFSRoot, pins)
	host := filepath.Join(t.TempDir(), "breakerd")
	if out, err := exec.Command("go", "build", "-o", host, "../cmd/breakerd").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		// The containers leave their pins (as on a node); take them away
		// once containerd's cleanup (registered later, run first) has
		// stopped them.
		if out, err := exec.Command(host, "uninstall", "--bpffs", bpffs).CombinedOutput(); err != nil {
			t.Errorf("uninstall: %v\n%s", err, out)
		}
		os.RemoveAll(bpffs)
	})
	ctd := startContainerd(t)
	tar := filepath.Join(t.TempDir(), "breakerd.tar")
	name := "localhost/breakerd:" + ctd.ns
	if out, err := exec.Command("../scripts/image", tar, name).CombinedOutput(); err != nil {
		t.Fatalf("scripts/image: %v\n%s", err, out)
	}
	ctd.ctr("images", "import", tar)

	cg := kerneltest.NewCgroup(t)
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	srv.StartCounting(t)
	srv.Listen(t, "tcp4", 8080) // healthy: only the forced-open verdict rejects
	config := t.TempDir()
	yaml := fmt.Sprintf("targets:\n  down:\n    match: {cidrs: [%s], ports: [\"8080\"]}\n    state: forced_open\n", srv.IPv4)
	if err := os.WriteFile(filepath.Join(config, "breakerd.yaml"), []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	mount, err := cgroup2.Mount()
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel("/sys/fs/cgroup", cg.Path)
	if err != nil || strings.HasPrefix(rel, "..") {
		t.Fatalf("test cgroup %s is not under /sys/fs/cgroup (mount %s)", cg.Path, mount)
	}
	run := func(id string) string {
		logFile := filepath.Join(ctd.dir, id+".log")
		args := append([]string{"run", "-d", "--log-uri", "file://" + logFile}, ctrRunArgs(t, config)...)
		args = append(args, name, id, "/usr/bin/breakerd")
		args = append(args, containerArgs(t, filepath.Join("/host/cgroup", rel), "/sys/fs/bpf/"+pins)...)
		ctd.ctr(args...)
		return logFile
	}
	readLog := func(f string) string { data, _ := os.ReadFile(f); return string(data) }
	dest := netip.AddrPortFrom(srv.IPv4, 8080)

	logA := run("breakerd-a")
	if !kerneltest.WaitFor(20*time.Second, func() bool {
		r := topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dest, Count: 1, Timeout: time.Second})
		return r[0].Errno == unix.ECONNREFUSED
	}) {
		t.Fatalf("the container does not protect the cgroup:\n%s", readLog(logA))
	}
	// The programs attach before the daemon's last start-up steps, so the
	// cgroup is protected a moment before the ready line is written.
	if !kerneltest.WaitFor(10*time.Second, func() bool { return strings.Contains(readLog(logA), "breakerd ready") }) {
		t.Fatalf("no ready line:\n%s", readLog(logA))
	}
	syns := srv.SYNs(t)

	// A client loop across the handover: SIGTERM to the first container,
	// then (maxSurge 0) the second starts on the same pins.
	done := make(chan []kerneltest.DialResult, 1)
	go func() {
		done <- topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: dest, Op: "rate", Rate: 200, For: 8 * time.Second, Timeout: time.Second})
	}()
	time.Sleep(time.Second)
	ctd.ctr("tasks", "kill", "-s", "SIGTERM", "breakerd-a")
	if !kerneltest.WaitFor(15*time.Second, func() bool {
		out, _ := ctd.ctrOut("tasks", "ls")
		return !strings.Contains(out, "breakerd-a") || strings.Contains(out, "STOPPED")
	}) {
		t.Fatalf("first container did not stop on SIGTERM:\n%s", readLog(logA))
	}
	if !strings.Contains(readLog(logA), "links and maps stay pinned") {
		t.Fatalf("first container did not hand over:\n%s", readLog(logA))
	}
	ctd.ctr("tasks", "delete", "breakerd-a")
	ctd.ctr("containers", "delete", "breakerd-a")
	logB := run("breakerd-b")
	res := <-done
	counts := map[unix.Errno]int64{}
	for _, r := range res {
		counts[r.Errno] += r.Nanos // "rate": one entry per errno, the count in Nanos
	}
	if len(counts) != 1 || counts[unix.ECONNREFUSED] < 500 {
		t.Fatalf("connects across the handover: %v (errno: count), want only ECONNREFUSED\nA:\n%s\nB:\n%s", counts, readLog(logA), readLog(logB))
	}
	if n := srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs reached the forced-open destination during the handover", n)
	}
	if !kerneltest.WaitFor(10*time.Second, func() bool { return strings.Contains(readLog(logB), "breakerd ready") }) ||
		!strings.Contains(readLog(logB), `"adopted":true`) {
		t.Fatalf("second container did not adopt the pins:\n%s", readLog(logB))
	}
	t.Logf("%d connects across the handover, all refused in connect(); 0 SYNs", counts[unix.ECONNREFUSED])
}
