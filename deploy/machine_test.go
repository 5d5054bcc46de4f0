package deploy

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// kubeletSysctls are the machine-wide kernel settings a kubelet checks when
// it starts (setupKernelTunables in its container manager) and, unless
// protectKernelDefaults is set, writes to the values it wants.
var kubeletSysctls = []struct{ key, kubelet string }{
	{"vm/overcommit_memory", "1"},
	{"vm/panic_on_oom", "0"},
	{"kernel/panic", "10"},
	{"kernel/panic_on_oops", "1"},
	{"kernel/keys/root_maxkeys", "1000000"},
	{"kernel/keys/root_maxbytes", "25000000"},
}

// nodePaths are where a kubelet, containerd with its CRI plugin, runc and
// buildah write by default, outside the directories a test gives them: the
// kubelet's root and certificate directories, its device plugin socket (a
// constant in the kubelet, not below --root-dir), its flexvolume plugin
// directory and its container log links; libcni's result cache and lock;
// containerd's /opt directory and its shims' sockets with runc's state;
// buildah's blob cache.
var nodePaths = []string{
	"/var/lib/kubelet",
	"/var/lib/kubelet/pki",
	"/var/lib/kubelet/device-plugins/kubelet.sock",
	"/usr/libexec/kubernetes",
	"/var/log/containers",
	"/var/log/pods",
	"/var/lib/cni",
	"/var/lib/cni/results",
	"/etc/cni",
	"/opt/containerd",
	"/run/containerd",
	"/var/lib/containers",
}

// machineState is what of the machine a node's daemons could change
// outside a test's directories.
type machineState struct {
	sysctls map[string]string // kubeletSysctls' values
	paths   map[string]bool   // whether each of nodePaths exists
}

func readMachineState() (machineState, error) {
	s := machineState{sysctls: map[string]string{}, paths: map[string]bool{}}
	for _, k := range kubeletSysctls {
		v, err := os.ReadFile(filepath.Join("/proc/sys", k.key))
		if err != nil {
			return s, err
		}
		s.sysctls[k.key] = strings.TrimSpace(string(v))
	}
	for _, p := range nodePaths {
		_, err := os.Lstat(p)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return s, err
		}
		s.paths[p] = err == nil
	}
	return s, nil
}

// checkMachineUnchanged records kubeletSysctls and nodePaths now and, when
// the test ends (after every cleanup registered later), fails it for each
// setting that changed, which it then puts back (a kernel.panic_on_oops=1
// left behind would make any later oops panic the machine), and for each
// path that appeared. It leaves the path: something else on the machine
// may have made it meanwhile.
func checkMachineUnchanged(t *testing.T) {
	t.Helper()
	before, err := readMachineState()
	if err != nil {
		t.Fatalf("reading the machine's kernel settings and node paths: %v", err)
	}
	t.Cleanup(func() {
		after, err := readMachineState()
		if err != nil {
			t.Errorf("reading the machine's kernel settings and node paths: %v", err)
			return
		}
		for _, s := range kubeletSysctls {
			k := s.key
			if after.sysctls[k] == before.sysctls[k] {
				continue
			}
			name := strings.ReplaceAll(k, "/", ".")
			t.Errorf("the machine's %s changed from %s to %s", name, before.sysctls[k], after.sysctls[k])
			if err := os.WriteFile(filepath.Join("/proc/sys", k), []byte(before.sysctls[k]), 0); err != nil {
				t.Errorf("restoring %s to %s: %v", name, before.sysctls[k], err)
			}
		}
		for _, p := range nodePaths {
			if after.paths[p] && !before.paths[p] {
				t.Errorf("%s appeared on the machine during the test", p)
			}
		}
	})
}
