package kube

import "testing"

func TestPodOfCgroup(t *testing.T) {
	const uid = "1f3e5a2b-0c4d-4e6f-8a9b-0123456789ab"
	const uidSD = "1f3e5a2b_0c4d_4e6f_8a9b_0123456789ab"
	const id = "4b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c"
	for _, tc := range []struct {
		rel, uid, id string
		ok           bool
	}{
		{"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidSD + ".slice/cri-containerd-" + id + ".scope", uid, id, true},
		{"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + uidSD + ".slice", uid, "", true},
		{"kubepods.slice/kubepods-pod" + uidSD + ".slice/crio-" + id + ".scope", uid, id, true},
		{"kubepods/burstable/pod" + uid + "/" + id, uid, id, true},
		{"kubepods/pod" + uid + "/" + id, uid, id, true},
		{"kubepods/besteffort/pod" + uid, uid, "", true},
		{"test.slice/kubepods/burstable/pod" + uid + "/" + id, uid, id, true}, // --cgroup-root
		{"kubepods/burstable", "", "", false},
		{"kubepods.slice", "", "", false},
		{"system.slice/containerd.service", "", "", false},
		{"user.slice/pod" + uid, "", "", false},                                                            // not under kubepods
		{"kubepods/burstable/pod" + uidSD, "", "", false},                                                  // cgroupfs keeps the dashes
		{"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uid + ".slice", "", "", false}, // systemd escapes them
	} {
		u, c, ok := PodOfCgroup(tc.rel)
		if u != tc.uid || c != tc.id || ok != tc.ok {
			t.Errorf("PodOfCgroup(%s) = %q %q %v, want %q %q %v", tc.rel, u, c, ok, tc.uid, tc.id, tc.ok)
		}
	}
}
