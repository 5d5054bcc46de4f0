/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Fallback destinations: the rewrite connect4/6 and sendmsg4/6 make when a
 * circuit's verdict rejects and its target names a fallback (the decision
 * itself, which needs the fallback's own verdict, is connect.h's
 * redirect()), and the programs that hide it from the application:
 * cgroup/getpeername4|6 for connected sockets and cgroup/recvmsg4|6 for
 * UDP replies show the address the application asked for, as socket-level
 * load balancers do, so its logs and TLS name checks see the destination
 * it chose. The original address is kept in the socket's own storage
 * (origins), so it goes when the socket does.
 */
#ifndef BREAKERD_FALLBACK_H
#define BREAKERD_FALLBACK_H

/* is_mapped reports an IPv4-mapped address (::ffff:a.b.c.d): an IPv4
 * destination, as struct dest_key stores it. */
static __always_inline int is_mapped(const __u8 *addr)
{
	__u32 w[3];
	__builtin_memcpy(w, addr, sizeof(w));
	return w[0] == 0 && w[1] == 0 && w[2] == bpf_htonl(0xffff);
}

/* addr_word is the i-th 32-bit word (network order) of a 16-byte address. */
static __always_inline __u32 addr_word(const __u8 *addr, int i)
{
	__u32 w;
	__builtin_memcpy(&w, addr + 4 * i, sizeof(w));
	return w;
}

/* rewrite_dest points the connect or send of ctx at fk (v6: the program
 * is connect6/sendmsg6). The caller has checked that fk's family is the
 * one ctx was given. Every field is written whole: the context takes no
 * narrower store. */
static __always_inline void rewrite_dest(struct bpf_sock_addr *ctx, const struct dest_key *fk, int v6)
{
	if (v6) {
		ctx->user_ip6[0] = addr_word(fk->addr, 0);
		ctx->user_ip6[1] = addr_word(fk->addr, 1);
		ctx->user_ip6[2] = addr_word(fk->addr, 2);
		ctx->user_ip6[3] = addr_word(fk->addr, 3);
	} else {
		ctx->user_ip4 = addr_word(fk->addr, 3);
	}
	ctx->user_port = (__u32)fk->port;
}

/* remember keeps, in the socket's storage, that it asked for key and was
 * sent to fk. Without storage (no memory) the redirect still happens: the
 * application is served, and only getpeername shows the fallback
 * (STAT_STORAGE_FAILED counts it). */
static __always_inline void remember(struct bpf_sock_addr *ctx, const struct dest_key *key,
				     const struct dest_key *fk)
{
	struct origin *o = bpf_sk_storage_get(&origins, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!o) {
		stat_inc(STAT_STORAGE_FAILED);
		return;
	}
	__builtin_memcpy(o->orig, key->addr, sizeof(o->orig));
	__builtin_memcpy(o->via, fk->addr, sizeof(o->via));
	o->orig_port = key->port;
	o->via_port = fk->port;
}

/* forget_origin makes a socket that connects again (UDP may, TCP after a
 * failed connect) forget what an earlier redirect remembered: its peer is
 * now what this connect decides, and a redirect remembers anew. Without
 * it, a socket redirected once that then connects to the fallback's own
 * address would be shown the destination it asked for first. Zeroed
 * rather than deleted (a zero via never matches a peer or a source); a
 * socket never redirected has no storage and costs one pointer test. */
static __always_inline void forget_origin(struct bpf_sock_addr *ctx)
{
	struct origin *o = bpf_sk_storage_get(&origins, ctx->sk, 0, 0);
	if (o) {
		__builtin_memset(o->via, 0, sizeof(o->via));
		o->via_port = 0;
	}
}

/* count_redirect adds one to circuit id's redirected connects. */
static __always_inline void count_redirect(__u32 id)
{
	__u64 *n = bpf_map_lookup_elem(&redirects, &id);
	if (n)
		__sync_fetch_and_add(n, 1);
}

/* reveal4 shows the application the address its socket asked for where
 * the kernel has the fallback's: getpeername4 (the peer of a connected
 * socket) and recvmsg4 (the source of a UDP datagram). A socket never
 * redirected has no storage and costs one pointer test; an address other
 * than the socket's fallback (a datagram from elsewhere) is left alone. */
static __always_inline int reveal4(struct bpf_sock_addr *ctx)
{
	struct origin *o = bpf_sk_storage_get(&origins, ctx->sk, 0, 0);
	if (!o)
		return 1;
	if (!is_mapped(o->via) || ctx->user_ip4 != addr_word(o->via, 3) ||
	    (__u16)ctx->user_port != o->via_port)
		return 1;
	ctx->user_ip4 = addr_word(o->orig, 3);
	ctx->user_port = (__u32)o->orig_port;
	return 1;
}

/* reveal6 is reveal4 for getpeername6 and recvmsg6 (a mapped address on a
 * dual-stack socket included). */
static __always_inline int reveal6(struct bpf_sock_addr *ctx)
{
	struct origin *o = bpf_sk_storage_get(&origins, ctx->sk, 0, 0);
	if (!o)
		return 1;
	if (ctx->user_ip6[0] != addr_word(o->via, 0) || ctx->user_ip6[1] != addr_word(o->via, 1) ||
	    ctx->user_ip6[2] != addr_word(o->via, 2) || ctx->user_ip6[3] != addr_word(o->via, 3) ||
	    (__u16)ctx->user_port != o->via_port)
		return 1;
	ctx->user_ip6[0] = addr_word(o->orig, 0);
	ctx->user_ip6[1] = addr_word(o->orig, 1);
	ctx->user_ip6[2] = addr_word(o->orig, 2);
	ctx->user_ip6[3] = addr_word(o->orig, 3);
	ctx->user_port = (__u32)o->orig_port;
	return 1;
}

SEC("cgroup/getpeername4")
int getpeername4(struct bpf_sock_addr *ctx)
{
	return reveal4(ctx);
}

SEC("cgroup/getpeername6")
int getpeername6(struct bpf_sock_addr *ctx)
{
	return reveal6(ctx);
}

SEC("cgroup/recvmsg4")
int recvmsg4(struct bpf_sock_addr *ctx)
{
	return reveal4(ctx);
}

SEC("cgroup/recvmsg6")
int recvmsg6(struct bpf_sock_addr *ctx)
{
	return reveal6(ctx);
}

#endif /* BREAKERD_FALLBACK_H */
