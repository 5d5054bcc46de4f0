package maps

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Capabilities breakerd needs, with why. CAP_SYS_ADMIN also grants what
// CAP_BPF and CAP_PERFMON grant (the kernel accepts either).
var neededCaps = []struct {
	bit  uint
	name string
	why  string
}{
	{39, "CAP_BPF", "for loading programs and creating maps"},
	{38, "CAP_PERFMON", "for the verifier's pointer access and bpf_skc_to_tcp_sock in the observation program"},
	{12, "CAP_NET_ADMIN", "for attaching to cgroup socket hooks"},
}

// Capabilities checked by number outside the list above: CAP_SYS_ADMIN
// (which implies the others on old kernels, and lets a close pass enter
// other network namespaces) and CAP_SYS_PTRACE (a close pass opening them).
const (
	capSysPtrace = 19
	capSysAdmin  = 21
)

// CheckCapabilities reports which capabilities the process lacks, naming
// each and why it is needed, so a misconfigured deployment fails with a
// clear message instead of a verifier error.
func CheckCapabilities() error {
	eff, err := effectiveCaps()
	if err != nil {
		return err
	}
	has := func(bit uint) bool { return eff&(1<<bit) != 0 }
	var missing []string
	for _, c := range neededCaps {
		if has(c.bit) || (c.bit != 12 && has(capSysAdmin)) {
			continue
		}
		missing = append(missing, fmt.Sprintf("%s (%s)", c.name, c.why))
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing capabilities: %s", strings.Join(missing, ", "))
	}
	return checkBPFSyscall()
}

// bpfUnknownCmd is no bpf() command: the kernel answers it with EINVAL
// once its own checks pass, without allocating or changing anything.
const bpfUnknownCmd = 0x7fffffff

// checkBPFSyscall makes one bpf() call that the kernel itself would answer
// with EINVAL. With the capabilities held, EPERM or ENOSYS means something
// in front of the kernel refused the system call, usually a seccomp
// profile; found here, that is said plainly instead of surfacing later as
// a missing kernel feature or a memory limit.
func checkBPFSyscall() error {
	_, _, errno := unix.Syscall(unix.SYS_BPF, bpfUnknownCmd, 0, 0)
	return bpfRefusal(errno, seccompMode())
}

// bpfRefusal classifies the errno of the probing bpf() call, made with
// CAP_BPF (or CAP_SYS_ADMIN) held, given the Seccomp field of
// /proc/self/status ("0" none, "1" strict, "2" filter, "" unknown).
func bpfRefusal(errno unix.Errno, seccomp string) error {
	if errno != unix.EPERM && errno != unix.ENOSYS {
		return nil // it reached the kernel's own checks
	}
	if seccomp == "0" {
		return fmt.Errorf("bpf() is refused (%w) although CAP_BPF is held, with no seccomp filter in place: "+
			"a security module (SELinux, AppArmor, lockdown) refuses it", errno)
	}
	return fmt.Errorf("bpf() is refused (%w) although CAP_BPF is held: a seccomp profile blocks it "+
		"(older container runtimes' default profiles allow bpf() only with CAP_SYS_ADMIN); "+
		"run breakerd with a seccomp profile that allows bpf(), such as the runtime's current default or Unconfined", errno)
}

// seccompMode is the Seccomp field of /proc/self/status ("" if unknown).
func seccompMode() string {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return ""
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "Seccomp:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func effectiveCaps() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, fmt.Errorf("reading capabilities: %w", err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return 0, fmt.Errorf("parsing CapEff: %w", err)
			}
			return n, nil
		}
	}
	return 0, fmt.Errorf("no CapEff in /proc/self/status")
}
