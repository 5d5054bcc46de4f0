package maps

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

func TestBPFRefusalNamesSeccomp(t *testing.T) {
	for _, c := range []struct {
		errno   unix.Errno
		seccomp string
		want    string // "" for no error
	}{
		{unix.EINVAL, "2", ""},
		{unix.EINVAL, "0", ""},
		{0, "0", ""},
		{unix.EPERM, "2", "a seccomp profile blocks it"},
		{unix.ENOSYS, "2", "a seccomp profile blocks it"},
		{unix.EPERM, "", "a seccomp profile blocks it"},
		{unix.EPERM, "0", "a security module"},
	} {
		err := bpfRefusal(c.errno, c.seccomp)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%v with Seccomp %q: %v, want none", c.errno, c.seccomp, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "CAP_BPF is held")):
			t.Errorf("%v with Seccomp %q: %v, want %q", c.errno, c.seccomp, err, c.want)
		}
	}
	if err := checkBPFSyscall(); os.Geteuid() == 0 && err != nil {
		t.Fatalf("as root without a filter: %v", err)
	}
}

const seccompHelperEnv = "BREAKERD_SECCOMP_HELPER"

func init() {
	if os.Getenv(seccompHelperEnv) != "" {
		os.Exit(seccompHelper())
	}
}

// seccompHelper installs a seccomp filter that answers bpf() with EPERM
// (as an old container runtime's default profile does for a process
// without CAP_SYS_ADMIN), then prints what CheckCapabilities says.
func seccompHelper() int {
	filter := []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}, // seccomp_data.nr
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 1, K: unix.SYS_BPF},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		os.Stdout.WriteString("prctl: " + err.Error())
		return 1
	}
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&prog))); e != 0 {
		os.Stdout.WriteString("seccomp: " + e.Error())
		return 1
	}
	if err := CheckCapabilities(); err != nil {
		os.Stdout.WriteString(err.Error())
	}
	return 0
}

// TestSeccompRefusalIsNamed runs CheckCapabilities under a real seccomp
// filter in a child process, with every capability held.
func TestSeccompRefusalIsNamed(t *testing.T) {
	kerneltest.RequireKernel(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), seccompHelperEnv+"=1")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helper: %v %s", err, out)
	}
	if !strings.Contains(string(out), "a seccomp profile blocks it") || !strings.Contains(string(out), "operation not permitted") {
		t.Fatalf("under a seccomp filter that refuses bpf(): %q", out)
	}
}
