package kube

import (
	"regexp"
	"strings"
)

// The kubelet's cgroup layouts, relative to the cgroup v2 mount:
//
//	systemd driver:  kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope
//	                 kubepods.slice/kubepods-pod<uid>.slice/crio-<id>.scope   (Guaranteed: no QoS level)
//	cgroupfs driver: kubepods/burstable/pod<uid>/<id>
//	                 kubepods/pod<uid>/<id>                                   (Guaranteed)
//
// In the systemd layout the pod UID's dashes are written as underscores
// (systemd uses '-' for nesting). The kubelet may sit below a parent of
// its own (--cgroup-root), so the kubepods element is looked for at any
// depth.
var (
	systemdPodRE   = regexp.MustCompile(`^kubepods(?:-[a-z]+)?-pod([0-9a-f_]{36})\.slice$`)
	cgroupfsPodRE  = regexp.MustCompile(`^pod([0-9a-f-]{36})$`)
	systemdScopeRE = regexp.MustCompile(`^(?:cri-containerd|crio|docker|containerd)-([0-9a-f]{12,128})\.scope$`)
	plainIDRE      = regexp.MustCompile(`^[0-9a-f]{12,128}$`)
)

// PodOfCgroup returns the pod UID (and, for a container's cgroup, the
// container ID) a cgroup path belongs to, in either kubelet layout; ok is
// false for a cgroup that is not a pod's or below one.
func PodOfCgroup(rel string) (podUID, containerID string, ok bool) {
	elems := strings.Split(strings.Trim(rel, "/"), "/")
	for i, e := range elems {
		if e != "kubepods" && e != "kubepods.slice" {
			continue
		}
		systemd := e == "kubepods.slice"
		for j := i + 1; j < len(elems) && j <= i+2; j++ {
			if systemd {
				if m := systemdPodRE.FindStringSubmatch(elems[j]); m != nil {
					podUID = strings.ReplaceAll(m[1], "_", "-")
				}
			} else if m := cgroupfsPodRE.FindStringSubmatch(elems[j]); m != nil {
				podUID = m[1]
			}
			if podUID == "" {
				continue
			}
			if j+1 < len(elems) {
				c := elems[j+1]
				if m := systemdScopeRE.FindStringSubmatch(c); m != nil {
					containerID = m[1]
				} else if plainIDRE.MatchString(c) {
					containerID = c
				}
			}
			return podUID, containerID, true
		}
		return "", "", false
	}
	return "", "", false
}
