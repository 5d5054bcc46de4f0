package deploy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/internal/kubeapitest"
)

// closeComponent is the kustomize Component that lets close_established
// reach the protected processes from the DaemonSet.
const closeComponent = "components/close-established"

// kustomizeDaemonSet builds deploy/ with the given components as an
// operator's overlay would (`kubectl kustomize`, kustomize v5 inside
// kubectl) and returns the DaemonSet of the output, decoded strictly.
func kustomizeDaemonSet(t *testing.T, components ...string) *appsv1.DaemonSet {
	t.Helper()
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		// None installed: the one kubetest builds from its pins for the
		// cluster test (minutes, once; cached).
		bins, berr := kubeapitest.ClusterBinaries()
		if berr != nil {
			t.Fatalf("kubectl is not installed and building it failed (its kustomize builds the deploy/ overlays): %v", berr)
		}
		kubectl = filepath.Join(bins, "kubectl")
	}
	here, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	rel := func(p string) string {
		r, err := filepath.Rel(dir, filepath.Join(here, p))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [" + rel(".") + "]\n"
	if len(components) > 0 {
		var cs []string
		for _, c := range components {
			cs = append(cs, rel(c))
		}
		k += "components: [" + strings.Join(cs, ", ") + "]\n"
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(kubectl, "kustomize", dir).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("kubectl kustomize %v: %v\n%s", components, err, stderr)
	}
	var found *appsv1.DaemonSet
	for _, doc := range strings.Split(string(out), "\n---\n") {
		var meta struct {
			Kind string `json:"kind"`
		}
		if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
			t.Fatalf("kustomize output: %v\n%s", err, doc)
		}
		if meta.Kind != "DaemonSet" {
			continue
		}
		if found != nil {
			t.Fatal("kustomize output has two DaemonSets")
		}
		found = &appsv1.DaemonSet{}
		if err := yaml.UnmarshalStrict([]byte(doc), found); err != nil {
			t.Fatalf("kustomize's DaemonSet: %v", err)
		}
	}
	if found == nil {
		t.Fatalf("no DaemonSet in the kustomize output:\n%s", out)
	}
	return found
}

// closeGrants is what the component adds to the base DaemonSet: its added
// capabilities, and "hostPID" when it turns that on.
func closeGrants(base, with *appsv1.DaemonSet) []string {
	var grants []string
	if with.Spec.Template.Spec.HostPID && !base.Spec.Template.Spec.HostPID {
		grants = append(grants, "hostPID")
	}
	had := base.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Add
	for _, c := range with.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Add {
		if !slices.Contains(had, c) {
			grants = append(grants, string(c))
		}
	}
	return grants
}

// withoutGrant returns ds with one of the component's grants taken away.
func withoutGrant(ds *appsv1.DaemonSet, grant string) *appsv1.DaemonSet {
	ds = ds.DeepCopy()
	pod := &ds.Spec.Template.Spec
	if grant == "hostPID" {
		pod.HostPID = false
		return ds
	}
	caps := pod.Containers[0].SecurityContext.Capabilities
	caps.Add = slices.DeleteFunc(caps.Add, func(c corev1.Capability) bool { return string(c) == grant })
	return ds
}

// TestCloseEstablishedComponent validates the component as the other
// manifests are (strictly decoded, the files it names present) and builds
// it with kustomize onto the base: the result differs from the base in
// exactly hostPID, CAP_SYS_ADMIN and CAP_SYS_PTRACE, and the base's own
// bounds (not privileged, no escalation, read-only root, RuntimeDefault
// seccomp, every other capability dropped, no host network) all hold.
func TestCloseEstablishedComponent(t *testing.T) {
	var comp struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Patches    []struct {
			Path string `json:"path"`
		} `json:"patches"`
	}
	decodeStrict(t, filepath.Join(closeComponent, "kustomization.yaml"), &comp)
	if comp.APIVersion != "kustomize.config.k8s.io/v1alpha1" || comp.Kind != "Component" {
		t.Fatalf("%s: %s %s, want a kustomize Component", closeComponent, comp.APIVersion, comp.Kind)
	}
	if len(comp.Patches) == 0 {
		t.Fatal("the component patches nothing")
	}
	for _, p := range comp.Patches {
		var ds appsv1.DaemonSet
		decodeStrict(t, filepath.Join(closeComponent, p.Path), &ds)
		if ds.Kind != "DaemonSet" || ds.Name != daemonSet(t).Name {
			t.Errorf("patch %s is of %s %s, want the DaemonSet %s", p.Path, ds.Kind, ds.Name, daemonSet(t).Name)
		}
	}

	base := kustomizeDaemonSet(t)
	if !reflect.DeepEqual(base.Spec, daemonSet(t).Spec) {
		t.Fatal("kustomize's build of deploy/ changed the DaemonSet's spec")
	}
	with := kustomizeDaemonSet(t, closeComponent)
	grants := closeGrants(base, with)
	slices.Sort(grants)
	if want := []string{"SYS_ADMIN", "SYS_PTRACE", "hostPID"}; !slices.Equal(grants, want) {
		t.Fatalf("the component grants %v, want %v", grants, want)
	}
	undone := with
	for _, g := range grants {
		undone = withoutGrant(undone, g)
	}
	if !reflect.DeepEqual(undone.Spec, base.Spec) {
		a, _ := yaml.Marshal(undone.Spec)
		b, _ := yaml.Marshal(base.Spec)
		t.Fatalf("the component changes more than it grants:\nwith it, grants undone:\n%s\nbase:\n%s", a, b)
	}
	if !slices.Equal(base.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Add,
		undone.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Add) {
		t.Fatal("the component does not keep the base's capabilities")
	}
}

// closeRun is one breakerd container of TestCloseEstablishedInContainerd.
type closeRun struct {
	t      *testing.T
	ctd    *containerdForTest
	id     string
	logs   string
	cg     *kerneltest.Cgroup
	dest   netip.AddrPort
	srv    *kerneltest.Host
	client *kerneltest.Host
}

// logRecords are the container's JSON log lines with msg prefix.
func (r *closeRun) logRecords(prefix string) []map[string]any {
	data, _ := os.ReadFile(r.logs)
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var rec map[string]any
		if json.Unmarshal(sc.Bytes(), &rec) == nil && strings.HasPrefix(fmt.Sprint(rec["msg"]), prefix) {
			out = append(out, rec)
		}
	}
	return out
}

func (r *closeRun) waitLog(prefix string, d time.Duration) map[string]any {
	r.t.Helper()
	var rec map[string]any
	if !kerneltest.WaitFor(d, func() bool {
		recs := r.logRecords(prefix)
		if len(recs) > 0 {
			rec = recs[0]
		}
		return rec != nil
	}) {
		data, _ := os.ReadFile(r.logs)
		r.t.Fatalf("%s: no log line %q:\n%s", r.id, prefix, data)
	}
	return rec
}

// metrics scrapes the container's /metrics on its admin address, from
// inside its network namespace (the pod's own: no host network).
func (r *closeRun) metrics() string {
	r.t.Helper()
	out := r.ctd.ctr("tasks", "ls")
	pid := ""
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == r.id {
			pid = f[1]
		}
	}
	if pid == "" {
		r.t.Fatalf("no task %s:\n%s", r.id, out)
	}
	netns := "--net=/proc/" + pid + "/ns/net"
	// runc leaves the loopback of a new network namespace down (a CNI
	// plugin brings it up in a cluster).
	if b, err := exec.Command("nsenter", netns, "ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
		r.t.Fatalf("loopback of %s: %v\n%s", r.id, err, b)
	}
	b, err := exec.Command("nsenter", netns, "curl", "-sS", "--max-time", "5", "http://127.0.0.1:9677/metrics").CombinedOutput()
	if err != nil {
		r.t.Fatalf("scraping %s: %v\n%s", r.id, err, b)
	}
	return string(b)
}

// TestCloseEstablishedInContainerd runs the image in containerd as
// TestImageInContainerd does (the securityContext, mounts and arguments
// read from the DaemonSet; containerd's default seccomp profile; the
// read-only root), once with the close-established component applied by
// kustomize, once more so with --close-mechanism=sock_diag (the fallback
// of kernels before 6.5, chosen on this one), once as the base ships, and
// once for each of the component's grants taken away. Each time a Python http.client pool in a protected
// cgroup of its own holds two keep-alive connections to a destination
// whose circuit then opens by failures (the server refuses new
// connections; its pool's connections go on):
//   - with the component, breakerd says at start-up that a pass reaches
//     every namespace (log and breakerd_close_established_mechanism
//     namespaces="all"), the pass closes both connections, the pool's
//     next request fails and its reconnect is rejected in connect() with
//     the target's errno, no SYN reaching the destination;
//   - without it, or without any one of its grants, breakerd says at
//     start-up that a pass cannot reach them (log and metric), the pass
//     says what it could not find, and the pool's connections stay
//     (requests on them still answered), while new connects are rejected
//     all the same.
func TestCloseEstablishedInContainerd(t *testing.T) {
	kerneltest.RequireKernel(t)
	base := kustomizeDaemonSet(t)
	with := kustomizeDaemonSet(t, closeComponent)
	host := filepath.Join(t.TempDir(), "breakerd")
	if out, err := exec.Command("go", "build", "-o", host, "../cmd/breakerd").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	ctd := startContainerd(t)
	tar := filepath.Join(t.TempDir(), "breakerd.tar")
	image := "localhost/breakerd:" + ctd.ns
	if out, err := exec.Command("../scripts/image", tar, image).CombinedOutput(); err != nil {
		t.Fatalf("scripts/image: %v\n%s", err, out)
	}
	ctd.ctr("images", "import", tar)
	topo := kerneltest.NewTopology(t, 1)
	srv := topo.Servers[0]
	srv.StartCounting(t)

	type variant struct {
		name   string
		ds     *appsv1.DaemonSet
		reach  string // what breakerd must report at start-up
		missed string // what its pass must say it missed
		mech   string // --close-mechanism, and the mechanism it must report ("": auto)
	}
	variants := []variant{{"with the component", with, "all", "", ""}, {"as shipped", base, "own", "hidden", ""},
		// The fallback of kernels before 6.5, chosen on this one.
		{"with the component and sock_diag", with, "all", "", "sock_diag"}}
	// What each grant taken away leaves: no view of the processes
	// (hostPID: the pool is listed as 0), no setns (CAP_SYS_ADMIN: the
	// namespace is found, not entered), or no ptrace read of a process
	// with capabilities breakerd lacks (CAP_SYS_PTRACE: the pool runs as
	// root with the test's; its namespace cannot be opened).
	without := map[string]variant{"hostPID": {reach: "own", missed: "hidden"}, "SYS_ADMIN": {reach: "own", missed: "not entered"}, "SYS_PTRACE": {reach: "some", missed: "unreadable"}}
	for _, g := range closeGrants(base, with) {
		v, ok := without[g]
		if !ok {
			t.Fatalf("the component grants %s: say here what breakerd reaches without it", g)
		}
		v.name, v.ds = "the component without "+g, withoutGrant(with, g)
		variants = append(variants, v)
	}
	mount := "/sys/fs/cgroup"
	for i, v := range variants {
		port := uint16(8300 + i)
		t.Run(v.name, func(t *testing.T) {
			pins := kerneltest.UniqueName()
			bpffs := filepath.Join(kerneltest.BPFFSRoot, pins)
			t.Cleanup(func() {
				if out, err := exec.Command(host, "uninstall", "--bpffs", bpffs).CombinedOutput(); err != nil {
					t.Errorf("uninstall: %v\n%s", err, out)
				}
				os.RemoveAll(bpffs)
			})
			cg := kerneltest.NewCgroup(t)
			rel, err := filepath.Rel(mount, cg.Path)
			if err != nil || strings.HasPrefix(rel, "..") {
				t.Fatalf("test cgroup %s is not under %s", cg.Path, mount)
			}
			srv.ServeHTTP(t, port)
			config := t.TempDir()
			yml := fmt.Sprintf(`failsafe_timeout: 30s
targets:
  pay:
    match: {cidrs: [%s], ports: ["%d"]}
    consecutive_failures: 3
    open_duration: 5m
    reject_errno: EHOSTUNREACH
    close_established: true
`, srv.IPv4, port)
			if err := os.WriteFile(filepath.Join(config, "breakerd.yaml"), []byte(yml), 0o644); err != nil {
				t.Fatal(err)
			}
			r := &closeRun{t: t, ctd: ctd, id: fmt.Sprintf("breakerd-close-%d", i), cg: cg, dest: netip.AddrPortFrom(srv.IPv4, port), srv: srv, client: topo.Client}
			r.logs = filepath.Join(ctd.dir, r.id+".log")
			args := append([]string{"run", "-d", "--log-uri", "file://" + r.logs}, ctrRunArgsOf(t, v.ds, config)...)
			args = append(args, image, r.id, "/usr/bin/breakerd")
			args = append(args, containerArgsOf(v.ds, filepath.Join("/host/cgroup", rel), "/sys/fs/bpf/"+pins)...)
			if v.mech != "" {
				args = append(args, "--close-mechanism="+v.mech)
			}
			ctd.ctr(args...)
			t.Cleanup(func() {
				ctd.ctrOut("tasks", "kill", "-s", "SIGKILL", r.id)
				kerneltest.WaitFor(10*time.Second, func() bool {
					out, _ := ctd.ctrOut("tasks", "ls")
					return !strings.Contains(out, r.id) || strings.Contains(out, "STOPPED")
				})
				ctd.ctrOut("tasks", "delete", "-f", r.id)
				ctd.ctrOut("containers", "delete", r.id)
				if t.Failed() {
					data, _ := os.ReadFile(r.logs)
					t.Logf("%s log:\n%s", r.id, data)
				}
			})
			r.waitLog("breakerd ready", 20*time.Second)
			r.check(v.reach, v.missed, v.mech)
		})
	}
}

// check runs the trip against the running container and asserts what
// reach (all, some, own) implies, that the pass says what it missed
// ("hidden" or "unreadable" processes, or a namespace "not entered"), and,
// when given, that breakerd reports mech as its mechanism.
func (r *closeRun) check(reach, missed, mech string) {
	t := r.t
	var start map[string]any
	switch reach {
	case "all":
		start = r.waitLog("close_established ready", time.Second)
	case "some":
		start = r.waitLog("close_established ready, but without CAP_SYS_PTRACE", time.Second)
	default:
		start = r.waitLog("close_established is configured, but with these privileges", time.Second)
		if start["level"] != "ERROR" {
			t.Fatalf("start-up line at level %v, want ERROR: %v", start["level"], start)
		}
	}
	got := fmt.Sprint(start["mechanism"])
	if start["namespaces"] != reach || got == "none" || got == "" || (mech != "" && got != mech) {
		t.Fatalf("start-up line %v: want namespaces=%s and a mechanism (%q if given)", start, reach, mech)
	}
	mech = got
	series := fmt.Sprintf(`breakerd_close_established_mechanism{mechanism=%q,namespaces=%q} 1`, mech, reach)
	if m := r.metrics(); !strings.Contains(m, series) {
		t.Fatalf("metrics lack %s:\n%s", series, m)
	}

	pool := r.client.StartHTTPPool(t, r.cg, r.dest, 2)
	first := pool.Round(t)
	if len(first) != 2 || !strings.HasPrefix(first[0], "ok:200:") || !strings.HasPrefix(first[1], "ok:200:") {
		t.Fatalf("the pool before: %v", first)
	}
	// The server refuses new connections; three refused connects open
	// the circuit; the pool's established connections go on meanwhile.
	r.srv.RefuseNewConnections(t, r.dest.Port())
	for _, d := range r.client.Dial(t, r.cg, kerneltest.DialSpec{Network: "tcp4", Addr: r.dest, Count: 3, Timeout: time.Second}) {
		if d.Errno != unix.ECONNREFUSED {
			t.Fatalf("a connect to the refusing server: %v, want ECONNREFUSED (from its reset)", d.Errno)
		}
	}
	pass := r.waitLog("closed established connections", 5*time.Second)
	syns := r.srv.SYNs(t)
	if reach == "all" {
		if pass["closed"] != float64(2) || pass["failed"] != float64(0) {
			t.Fatalf("the pass: %v, want the pool's 2 closed", pass)
		}
		t.Logf("start-up: %v; the pass: %v", start, pass)
		next := pool.Round(t)
		for _, s := range next {
			if strings.HasPrefix(s, "ok") || s == "TimeoutError" || s == "EAGAIN" {
				t.Fatalf("a request on a connection of the open circuit: %v (want each connection closed)", next)
			}
		}
		if again := pool.Round(t); !slices.Equal(again, []string{"EHOSTUNREACH", "EHOSTUNREACH"}) {
			t.Fatalf("the pool's reconnects: %v, want each rejected in connect() with EHOSTUNREACH", again)
		}
		if m := r.metrics(); !strings.Contains(m, `breakerd_established_closed_total{result="closed",target="pay",workload="shared"} 2`) {
			t.Fatalf("no breakerd_established_closed_total of 2 closed:\n%s", m)
		}
	} else {
		if pass["closed"] != float64(0) {
			t.Fatalf("the pass: %v, want nothing closed", pass)
		}
		// What the pass says it missed: the pool's process outside its
		// PID namespace, its namespace unreadable, or not entered.
		said := r.logRecords("the close pass could not find the network namespaces")
		if missed == "not entered" {
			said = r.logRecords("closing established connections")
		}
		ok := len(said) == 1
		switch {
		case !ok:
		case missed == "not entered":
			ok = strings.Contains(fmt.Sprint(said[0]["err"]), "entering it: operation not permitted")
		default:
			n, _ := said[0][missed].(float64)
			ok = n >= 1 // the pool (a Dial helper of the trip may not have exited yet)
		}
		if !ok {
			data, _ := os.ReadFile(r.logs)
			t.Fatalf("the pass did not say the pool's processes were %s (%v):\n%s", missed, said, data)
		}
		next := pool.Round(t)
		if !slices.Equal(ports(next), ports(first)) || !strings.HasPrefix(next[0], "ok:200:") || !strings.HasPrefix(next[1], "ok:200:") {
			t.Fatalf("the pool after the opening: %v, want its connections kept (%v): nothing could close them", next, first)
		}
		for _, d := range r.client.Dial(t, r.cg, kerneltest.DialSpec{Network: "tcp4", Addr: r.dest, Count: 2, Timeout: time.Second}) {
			if d.Errno != unix.EHOSTUNREACH {
				t.Fatalf("a new connect to the open circuit: %v, want EHOSTUNREACH", d.Errno)
			}
		}
		t.Logf("kept: %v; the pass said %v", next, said)
	}
	if n := r.srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs reached the open circuit's destination", n)
	}
}

// ports are the local ports of a pool round's "ok:STATUS:PORT" results.
func ports(round []string) []string {
	var out []string
	for _, s := range round {
		f := strings.Split(s, ":")
		out = append(out, f[len(f)-1])
	}
	return out
}

// TestProbeCloseReach runs `breakerd probe` with the base DaemonSet's
// capabilities, adding the component's one by one (setpriv bounds them as
// TestLeastPrivilege does), and in a PID namespace of its own: it names
// which network namespaces a close pass could enter, and what is missing.
func TestProbeCloseReach(t *testing.T) {
	kerneltest.RequireKernel(t)
	for _, bin := range []string{"setpriv", "unshare"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s (util-linux) is needed: %v", bin, err)
		}
	}
	bin := filepath.Join(t.TempDir(), "breakerd")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/breakerd").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	with := kustomizeDaemonSet(t, closeComponent)
	var caps []string
	for _, c := range with.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Add {
		caps = append(caps, string(c))
	}
	bounded := func(caps ...string) []string {
		b := "-all"
		for _, c := range caps {
			b += ",+" + strings.ToLower(c)
		}
		return []string{"setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=" + b, "--", bin, "probe"}
	}
	base := grantedCaps(t)
	for _, c := range []struct {
		name    string
		argv    []string
		reach   string
		missing []string // each in one of the missing sentences
	}{
		{"the component's capabilities", bounded(caps...), "all", nil},
		{"the base's capabilities", bounded(base...), "own", []string{"CAP_SYS_ADMIN", "CAP_SYS_PTRACE"}},
		{"the base's and CAP_SYS_ADMIN", bounded(append(slices.Clone(base), "SYS_ADMIN")...), "some", []string{"CAP_SYS_PTRACE"}},
		{"the base's and CAP_SYS_PTRACE", bounded(append(slices.Clone(base), "SYS_PTRACE")...), "own", []string{"CAP_SYS_ADMIN"}},
		{"a PID namespace of its own", []string{"unshare", "--pid", "--fork", "--mount-proc", bin, "probe"}, "own", []string{"PID namespace"}},
	} {
		out, err := exec.Command(c.argv[0], c.argv[1:]...).Output()
		if err != nil {
			t.Fatalf("%s: %v\n%s", c.name, err, out)
		}
		var probe struct {
			Reach   string   `json:"close_established_namespaces"`
			Missing []string `json:"close_established_missing"`
		}
		if err := json.Unmarshal(out, &probe); err != nil {
			t.Fatalf("%s: %v\n%s", c.name, err, out)
		}
		if probe.Reach != c.reach || len(probe.Missing) != len(c.missing) {
			t.Errorf("%s: namespaces %q missing %q, want %q and %d sentences (%v)", c.name, probe.Reach, probe.Missing, c.reach, len(c.missing), c.missing)
			continue
		}
		for _, m := range c.missing {
			if !slices.ContainsFunc(probe.Missing, func(s string) bool { return strings.Contains(s, m) }) {
				t.Errorf("%s: missing %q does not name %s", c.name, probe.Missing, m)
			}
		}
	}
}
