/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * CO-RE views of the kernel's cgroup structs and the walk up a cgroup's
 * parents, shared by breaker.c (reset_seen) and destroy.c (the close
 * pass). Include after bpf_helpers.h and bpf_core_read.h.
 */
#ifndef BREAKERD_CGROUP_H
#define BREAKERD_CGROUP_H

/* Deepest cgroup nesting the ancestry walk follows below the attach point
 * (cgroup v2 allows more, but kubelet's deepest is five). A socket deeper
 * than that is taken as not below it: the fail-open direction. */
#define MAX_CGROUP_DEPTH 32

/* Minimal CO-RE views of kernel structs: only the fields read here. */
struct kernfs_node {
	__u64 id;
} __attribute__((preserve_access_index));

struct cgroup;

struct cgroup_subsys_state {
	struct cgroup *cgroup;
	struct cgroup_subsys_state *parent;
} __attribute__((preserve_access_index));

struct cgroup {
	struct cgroup_subsys_state self;
	struct kernfs_node *kn;
} __attribute__((preserve_access_index));

struct sock_cgroup_data {
	struct cgroup *cgroup;
} __attribute__((preserve_access_index));

/* cgroup_below reports whether cgroup cg is the cgroup with id attach or
 * below it, at most max_depth levels down (a walk up its parents). */
static __always_inline int cgroup_below(struct cgroup *cg, __u64 attach, __u32 max_depth)
{
	for (__u32 i = 0; i <= MAX_CGROUP_DEPTH; i++) {
		if (!cg || i > max_depth)
			return 0;
		if (BPF_CORE_READ(cg, kn, id) == attach)
			return 1;
		struct cgroup_subsys_state *parent = BPF_CORE_READ(cg, self.parent);
		if (!parent)
			return 0;
		cg = BPF_CORE_READ(parent, cgroup);
	}
	return 0;
}

#endif
