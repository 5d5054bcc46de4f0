//go:build ignore
/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The close pass of `close_established` (issue #19): a TCP socket iterator
 * (iter/tcp, 6.5+ for bpf_sock_destroy) that the daemon runs once per
 * network namespace of the protected processes when a circuit opens, and
 * when a circuit with a fallback closes. It closes, with bpf_sock_destroy
 * (the peer gets an RST, the owner sees ECONNABORTED), every established
 * client socket that
 *   - goes to a destination of close_targets (address, port and the
 *     socket's workload class), or with CLOSE_RETURNING, asked for one and
 *     was sent to a fallback it is still connected to (origins), and
 *   - was made in a cgroup below the attach point (sk_cgrp_data, CO-RE),
 *     and when scoped, in a cgroup of the workloads map (whose entry
 *     gives the socket its class), and
 *   - is not server side: not accepted (see accepted below), and its
 *     local port is not a listening port.
 * Anything else is left alone. No program of this object is attached to a
 * hook: it runs only when the daemon reads the iterator, so the healthy
 * path pays nothing.
 */
#include "destroy.h"

#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>

#include "cgroup.h"

#define AF_INET 2
#define AF_INET6 10
#define IPPROTO_TCP 6
#define TCP_ESTABLISHED 1
#define TCP_LISTEN 10

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Minimal CO-RE views of kernel structs: only the fields read here (the
 * cgroup ones in cgroup.h). */

struct in6_addr {
	union {
		__u8 u6_addr8[16];
	} in6_u;
} __attribute__((preserve_access_index));

struct sock_common {
	__u32 skc_daddr;
	__u32 skc_rcv_saddr;
	__u16 skc_dport;
	__u16 skc_num;
	__u16 skc_family;
	__u8 skc_state;
	__u8 _pad;
	struct in6_addr skc_v6_daddr;
	struct in6_addr skc_v6_rcv_saddr; /* (CO-RE relocates by name; the local layout is only -Wpadded's) */
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
	struct sock_cgroup_data sk_cgrp_data;
	__u32 sk_max_ack_backlog;
	__u32 _pad2;
} __attribute__((preserve_access_index));

struct bpf_iter_meta {
	void *seq;
} __attribute__((preserve_access_index));

struct bpf_iter__tcp {
	struct bpf_iter_meta *meta;
	struct sock_common *sk_common;
} __attribute__((preserve_access_index));

extern int bpf_sock_destroy(struct sock_common *sk) __ksym;

struct tcp_sock;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct dest_key);
	__type(value, struct close_count);
} close_targets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct close_config);
} close_settings SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct listen_ports);
} listeners SEC(".maps");

/* The main object's workloads map (bpf/maps.h), handed to this object
 * at load (the same definition, so the loader accepts it). */
#define MAX_WORKLOAD_CGROUPS (1 << 16)
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_WORKLOAD_CGROUPS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct workload);
} workloads SEC(".maps");

/* The main object's origins socket storage (bpf/maps.h), handed to this
 * object at load as workloads is. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct origin);
} origins SEC(".maps");

/* same_addr compares two 16-byte addresses. */
static __always_inline int same_addr(const __u8 *a, const __u8 *b)
{
	__u64 a0, a1, b0, b1;
	__builtin_memcpy(&a0, a, 8);
	__builtin_memcpy(&a1, a + 8, 8);
	__builtin_memcpy(&b0, b, 8);
	__builtin_memcpy(&b1, b + 8, 8);
	return a0 == b0 && a1 == b1;
}

/* returning turns key, the peer of an established socket, into the
 * destination the socket asked for when a redirect sent it to that peer
 * (its origins storage, whose via is the peer), and reports whether it
 * did. A socket never redirected has no storage; one whose via is not
 * its peer connected again after its redirect (forget_origin zeroes
 * via): both connected to their peer themselves and are left alone. */
static __always_inline int returning(struct sock_common *skc, struct dest_key *key)
{
	/* sk storage takes a struct sock: a tcp_sock is one (its first member). */
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0;
	struct origin *o = bpf_sk_storage_get(&origins, tp, 0, 0);
	if (!o || o->via_port != key->port || !same_addr(o->via, key->addr))
		return 0;
	__builtin_memcpy(key->addr, o->orig, sizeof(key->addr));
	key->port = o->orig_port;
	return 1;
}

/* accepted reports whether an established socket was made by accept():
 * a listener's child is a copy of the listener (sk_clone_lock) and keeps
 * its sk_max_ack_backlog, the backlog listen() set, also after the
 * listener is closed; a socket that connected never listened, so its
 * backlog is 0. (A listener made with a backlog of 0 gives children of 0:
 * those are still told by their listening port, while it is open.) */
static __always_inline int accepted(struct sock_common *skc)
{
	return BPF_CORE_READ((struct sock *)skc, sk_max_ack_backlog) != 0;
}

SEC("iter/tcp")
int close_established(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc)
		return 0;
	__u32 zero = 0;
	struct listen_ports *lp = bpf_map_lookup_elem(&listeners, &zero);
	struct close_config *cfg = bpf_map_lookup_elem(&close_settings, &zero);
	if (!lp || !cfg)
		return 0;

	__u16 family = BPF_CORE_READ(skc, skc_family);
	if (family != AF_INET && family != AF_INET6)
		return 0;
	__u8 state = BPF_CORE_READ(skc, skc_state);
	__u16 lport = BPF_CORE_READ(skc, skc_num);
	__u32 word = (lport >> 6) & (LISTEN_WORDS - 1);
	__u64 bit = 1ULL << (lport & 63);
	if (state == TCP_LISTEN) {
		lp->bits[word] |= bit;
		return 0;
	}
	if (state != TCP_ESTABLISHED || (lp->bits[word] & bit) || accepted(skc))
		return 0;

	struct dest_key key = {.proto = IPPROTO_TCP, .port = BPF_CORE_READ(skc, skc_dport)};
	if (family == AF_INET) {
		dest_ipv4(&key, BPF_CORE_READ(skc, skc_daddr));
	} else {
		BPF_CORE_READ_INTO(&key.addr, skc, skc_v6_daddr.in6_u.u6_addr8);
	}

	/* ESTABLISHED is a full socket: its cgroup is the one it was made in. */
	struct sock *sk = (struct sock *)skc;
	struct cgroup *cg = BPF_CORE_READ(sk, sk_cgrp_data.cgroup);
	if (!cg || !cgroup_below(cg, cfg->cgroup_id, cfg->max_depth))
		return 0;
	if (cfg->workloads != CLOSE_UNCLASSED) {
		__u64 id = BPF_CORE_READ(cg, kn, id);
		struct workload *w = bpf_map_lookup_elem(&workloads, &id);
		if (w)
			key.class = (__u8)w->class;
		else if (cfg->workloads == CLOSE_SCOPED)
			return 0;
	}
	if (cfg->mode == CLOSE_RETURNING && !returning(skc, &key))
		return 0;
	struct close_count *cnt = bpf_map_lookup_elem(&close_targets, &key);
	if (!cnt)
		return 0;
	if (bpf_sock_destroy(skc) == 0)
		__sync_fetch_and_add(&cnt->closed, 1);
	else
		__sync_fetch_and_add(&cnt->failed, 1);
	return 0;
}

/* For bpf2go's -type: accepted_sock is only a local variable's type. */
const struct accepted_sock *unused_accepted __attribute__((unused));

/* list_accepted writes out the established sockets of the namespace that
 * were accepted (struct accepted_sock, one after another), for the
 * sock_diag close pass: sock_diag cannot tell how a socket was made. It
 * needs no bpf_sock_destroy (iter/tcp is 5.9+), so it loads where the
 * pass above does not; it closes nothing. */
SEC("iter/tcp")
int list_accepted(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc)
		return 0;
	__u16 family = BPF_CORE_READ(skc, skc_family);
	if (family != AF_INET && family != AF_INET6)
		return 0;
	if (BPF_CORE_READ(skc, skc_state) != TCP_ESTABLISHED || !accepted(skc))
		return 0;
	struct accepted_sock a;
	__builtin_memset(&a, 0, sizeof(a));
	a.family = (__u8)family;
	a.sport = bpf_htons(BPF_CORE_READ(skc, skc_num));
	a.dport = BPF_CORE_READ(skc, skc_dport);
	if (family == AF_INET) {
		__u32 src = BPF_CORE_READ(skc, skc_rcv_saddr), dst = BPF_CORE_READ(skc, skc_daddr);
		__builtin_memcpy(a.src, &src, 4);
		__builtin_memcpy(a.dst, &dst, 4);
	} else {
		BPF_CORE_READ_INTO(&a.src, skc, skc_v6_rcv_saddr.in6_u.u6_addr8);
		BPF_CORE_READ_INTO(&a.dst, skc, skc_v6_daddr.in6_u.u6_addr8);
	}
	bpf_seq_write(ctx->meta->seq, &a, sizeof(a));
	return 0;
}
