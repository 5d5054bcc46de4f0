package maps

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// What a close pass can reach with the privileges breakerd runs with. A
// pass closes sockets in the network namespaces of the processes below
// the attach point (a socket iterator and a sock_diag socket each see one
// namespace): it finds the processes in cgroup.procs, their namespaces as
// /proc/PID/ns/net, and enters each with setns. Each step needs something
// that a least-privilege container does not have:
//   - seeing the processes: cgroup.procs lists a process outside the
//     reader's PID namespace as 0, so breakerd must share the protected
//     processes' PID namespace (in Kubernetes, the host's: hostPID);
//   - opening /proc/PID/ns/net: the kernel's ptrace read check
//     (PTRACE_MODE_READ_FSCREDS; a pidfd given to setns is checked the
//     same way), which a process of another user, or one with a
//     capability breakerd lacks, passes only with CAP_SYS_PTRACE;
//   - entering it: setns(CLONE_NEWNET) needs CAP_SYS_ADMIN, and a seccomp
//     profile that allows setns (the runtimes' defaults allow it only
//     with CAP_SYS_ADMIN).
// Sockets in breakerd's own network namespace need none of these.

// CloseReach says which network namespaces a close pass can enter.
type CloseReach string

// The reaches.
const (
	// ReachAll: every protected process's (setns allowed, the host's PID
	// namespace, CAP_SYS_PTRACE).
	ReachAll CloseReach = "all"
	// ReachSome: setns allowed in the host's PID namespace, but without
	// CAP_SYS_PTRACE only the namespaces of processes of breakerd's own
	// user whose capabilities are within its own.
	ReachSome CloseReach = "some"
	// ReachOwn: only breakerd's own network namespace (and those of the
	// processes of its own PID namespace, when it may enter them).
	ReachOwn CloseReach = "own"
)

// initPIDNamespace is the inode number the kernel gives the initial
// (the host's) PID namespace (PROC_PID_INIT_INO, include/linux/proc_ns.h).
const initPIDNamespace = 0xEFFFFFFC

// ProbeCloseReach says which network namespaces a close pass of this
// process can enter, and, when not all, what is missing for the rest (one
// sentence each).
func ProbeCloseReach() (CloseReach, []string) {
	eff, _ := effectiveCaps()
	var missing []string
	own := false
	if err := probeSetns(); err != nil {
		own = true
		if eff&(1<<capSysAdmin) == 0 {
			missing = append(missing, fmt.Sprintf("setns is refused (%v): entering another network namespace needs CAP_SYS_ADMIN", err))
		} else {
			missing = append(missing, fmt.Sprintf("setns is refused (%v) although CAP_SYS_ADMIN is held: a seccomp profile or security module blocks it", err))
		}
	}
	if ino, err := nsIno("/proc/self/ns/pid"); err != nil || ino != initPIDNamespace {
		own = true
		missing = append(missing, "breakerd runs in a PID namespace of its own, not the host's (in Kubernetes: hostPID): the protected processes, and so their network namespaces, are out of its sight")
	}
	if eff&(1<<capSysPtrace) == 0 {
		missing = append(missing, "without CAP_SYS_PTRACE the network namespace of a process of another user, or of one holding a capability breakerd lacks, cannot be opened")
		if !own {
			return ReachSome, missing
		}
	}
	if own {
		return ReachOwn, missing
	}
	return ReachAll, nil
}

// probeSetns enters the calling thread's own network namespace again: the
// kernel checks CAP_SYS_ADMIN and a seccomp filter setns itself as for
// any other namespace, and nothing changes when it succeeds.
func probeSetns() error {
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return err
	}
	defer self.Close()
	err = inNetns(self, func() error { return nil })
	if errors.Is(err, unix.EPERM) {
		return unix.EPERM
	}
	return err
}
