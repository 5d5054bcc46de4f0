/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Outcomes: sockops on the same cgroup watches how each TCP connection
 * ends and reports one record per outcome; tp_btf/tcp_receive_reset
 * reports the resets of the sockets sockops no longer follows; and
 * cgroup/sock_release gives back what a socket holds in a bulkhead.
 */
#ifndef BREAKERD_SOCKOPS_H
#define BREAKERD_SOCKOPS_H

/* sockops_port is the remote port in network order (remote_port holds it
 * in its upper half). */
static __always_inline __u16 sockops_port(struct bpf_sock_ops *ops)
{
	return (__u16)(ops->remote_port >> 16);
}

/* Every address field is read, unconditionally, with a load at its own
 * offset, and the family picks among the values: a compiler that merges
 * the IPv4 and IPv6 reads into one load through a chosen pointer makes a
 * load the verifier refuses ("dereference of modified ctx ptr"). */
static __always_inline void sockops_key(struct dest_key *k, struct bpf_sock_ops *ops)
{
	__u32 family = ops->family, ip4 = ops->remote_ip4;
	__u32 w0 = ops->remote_ip6[0], w1 = ops->remote_ip6[1];
	__u32 w2 = ops->remote_ip6[2], w3 = ops->remote_ip6[3];
	/* Use every value here, so no load can be moved into the branch. */
	asm volatile("" : "+r"(ip4), "+r"(w0), "+r"(w1), "+r"(w2), "+r"(w3));
	if (family == AF_INET)
		dest_ipv4(k, ip4);
	else
		dest_ipv6(k, w0, w1, w2, w3);
	k->port = sockops_port(ops);
	k->proto = IPPROTO_TCP;
	k->class = 0;
}

static __always_inline struct sock *full_sock(struct bpf_sock_ops *ops)
{
	struct bpf_sock *bsk = ops->sk;
	if (!bsk)
		return 0;
	return (struct sock *)bpf_skc_to_tcp_sock(bsk);
}

static __always_inline int sock_err(struct sock *sk)
{
	return sk ? sk->sk_err : 0;
}

/* The cgroup the socket was created in (its process's cgroup then), read
 * from the socket itself: right in softirq context, where the current
 * task is anyone's, and on kernels whose sockops may not ask for the
 * current cgroup (6.1). 0 when this kernel has no such field. */
static __always_inline __u64 sock_cgroup(struct sock *sk)
{
	if (!sk || !bpf_core_field_exists(sk->sk_cgrp_data.cgroup))
		return 0;
	struct cgroup *cg = sk->sk_cgrp_data.cgroup;
	if (!cg)
		return 0;
	struct kernfs_node *kn = cg->kn;
	return kn ? kn->id : 0;
}

/* A SYN_SENT socket sends no SYN longer than this (tcp_syn_retries at its
 * maximum of 127 ends near 36 minutes on the default RTO; 2^31 µs is the
 * bound of the microsecond reading below). */
#define MAX_CONNECTING_MS (35U * 60 * 1000)
#define MAX_CONNECTING_US 2000000000U /* within 2^31 µs, where a wrapped reading starts */

/* connect_age is how long ago a connecting socket sent its first SYN:
 * tcp_connect() stamps tcp_sock.retrans_stamp with the TCP clock (ktime,
 * as bpf_ktime_get_ns) in milliseconds — in microseconds on a 6.7+ route
 * with the tcp_usec_ts feature — and SYN retransmissions keep it. The
 * reading that gives a plausible age is the right one (the other is off by
 * a factor of 1000 and wraps far beyond it). 0 when unknown. */
static __always_inline __u64 connect_age(struct sock *sk, __u64 now)
{
	if (!sk)
		return 0;
	__u32 stamp = ((struct tcp_sock *)sk)->retrans_stamp;
	if (!stamp)
		return 0;
	__u32 ms = (__u32)(now / NSEC_PER_MSEC) - stamp;
	if (ms <= MAX_CONNECTING_MS)
		return (__u64)ms * NSEC_PER_MSEC;
	__u32 us = (__u32)(now / NSEC_PER_USEC) - stamp;
	if (us <= MAX_CONNECTING_US)
		return (__u64)us * NSEC_PER_USEC;
	return 0;
}

/* workload_flags are the settings' CONFIG_SCOPED and CONFIG_CLASSES: with
 * either, sockops agrees with connect4/6 on whether and in which class a
 * socket is protected. */
static __always_inline __u32 workload_flags(void)
{
	struct settings *cfg = get_settings();
	return cfg ? cfg->flags & WORKLOAD_FLAGS : 0;
}

/* sock_workload is the workload entry of the cgroup the socket was made
 * in, or 0. */
static __always_inline struct workload *sock_workload(struct sock *sk)
{
	__u64 cg = sock_cgroup(sk);
	return bpf_map_lookup_elem(&workloads, &cg);
}

/* sock_class finds whether connect4/6 judged this socket's connect
 * protected, and its class: from the handoff when it names this connect
 * (the usual case). With has_sockops_current the entry names the thread
 * and is cleared once taken, and connect4/6 clear it when they reject;
 * an entry left by a connect that failed otherwise (another program's
 * rejection, a routing error) names the same thread, and is taken only
 * if that thread's next connect migrates to its CPU between connect4/6
 * and this callback: the earlier connect's decision, which differs only
 * if the thread changed cgroups in between. When the entry does not name
 * this thread (the task was preempted in between and another connect()
 * on this CPU overwrote it, or it migrated), this callback decides as
 * scope() did, by the cgroup the process is in now (it runs in the
 * connect() call). Without has_sockops_current the entry names the
 * socket (its cookie); when it does not, the socket's own cgroup decides
 * instead (no entry: protected in class 0 unless CONFIG_SCOPED): it
 * differs from the connect-time cgroup only for a socket made before its
 * process moved. */
static __always_inline int sock_class(struct bpf_sock_ops *ops, struct sock *sk, __u32 flags,
				      __u8 *class)
{
	struct connect_handoff *h = get_handoff();
	if (has_sockops_current) {
		__u64 e = h ? h->cookie : 0;
		if (e && (e & ~HANDOFF_CLASS) == handoff_thread(bpf_get_current_pid_tgid())) {
			h->cookie = 0;
			__u32 class1 = (__u32)e;
			if (!class1)
				return 0;
			*class = (__u8)(class1 - 1);
			return 1;
		}
		struct workload *cw = current_workload();
		if (!cw)
			return !(flags & CONFIG_SCOPED);
		*class = (__u8)cw->class;
		return 1;
	}
	if (h && h->cookie == bpf_get_socket_cookie(ops)) {
		if (!h->class1)
			return 0;
		*class = (__u8)(h->class1 - 1);
		return 1;
	}
	struct workload *w = sock_workload(sk);
	if (!w)
		return !(flags & CONFIG_SCOPED);
	*class = (__u8)w->class;
	return 1;
}

/* report_class is the class of a socket without tracked storage, as its
 * records carry it: its own cgroup's (0 without workloads, or for a cgroup
 * of none). Whether the socket is protected at all was decided at connect
 * (observed()). */
static __always_inline __u8 report_class(struct sock *sk)
{
	if (!workload_flags())
		return 0;
	struct workload *w = sock_workload(sk);
	return w ? (__u8)w->class : 0;
}

/* observed reports whether sockops follows this socket: with scoping, only
 * sockets whose connect was judged protected, which on_connect marks by
 * setting the callback flags (they are set on no other socket; the RTO
 * flag stays set for as long as the socket is followed). */
static __always_inline int observed(struct bpf_sock_ops *ops)
{
	return !(workload_flags() & CONFIG_SCOPED) || (ops->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_RTO_CB_FLAG);
}

static __always_inline void track(struct bpf_sock_ops *ops, struct sock_state *st, struct sock *sk,
				  __u64 start, __u8 class)
{
	sockops_key(&st->dest, ops);
	st->dest.class = class;
	st->flags = (st->flags & SOCK_PROBE) | SOCK_TRACKED;
	st->start_ns = start;
	st->cgroup_id = sock_cgroup(sk);
	st->rtos = 0;
}

static __always_inline void on_connect(struct bpf_sock_ops *ops)
{
	if (ops->family != AF_INET && ops->family != AF_INET6)
		return;
	struct bpf_sock *sk = ops->sk;
	if (!sk)
		return;
	__u8 class = 0;
	__u32 flags = workload_flags();
	if (flags && !sock_class(ops, full_sock(ops), flags, &class))
		return; /* not a protected workload: no callbacks, not observed */
	bpf_sock_ops_cb_flags_set(ops, BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG);
	/* Storage exists only if connect made it (a probe, a bulkhead). */
	struct sock_state *st = bpf_sk_storage_get(&socks, sk, 0, 0);
	if (!st)
		return; /* the usual case: no clock read, nothing written */
	track(ops, st, full_sock(ops), bpf_ktime_get_ns(), class);
	if (st->resp) {
		__u64 bit;
		__u64 *bits = resp_port_word(bpf_ntohs(sockops_port(ops)), &bit);
		if (bits && !(*bits & bit))
			__sync_fetch_and_or(bits, bit);
	}
}

/* report writes record r of a socket sockops follows (st: its storage,
 * or 0): r holds what happened (outcome, flags, duration_ns, count, err;
 * ts_ns is now), report adds whose it is (dest, cookie, cgroup, and the
 * probe flag and round of a probe). Verified once, not on each path of
 * its callers that reaches it (on_close's outcomes, each a constant). */
verified_once int report(struct bpf_sock_ops *ops, struct sock_state *st, struct event *r,
			 __u32 wake)
{
	if (!ops || !r)
		return 0;
	struct sock *sk = full_sock(ops);
	struct dest_key k;
	__u64 cg;
	if (st && (st->flags & SOCK_TRACKED)) {
		__builtin_memcpy(&k, &st->dest, sizeof(k));
		cg = st->cgroup_id;
		/* Keep this load here: merged with sock_cgroup()'s below into one
		 * load through either pointer, it is refused ("same insn cannot
		 * be used with different pointers"). */
		barrier_var(cg);
	} else {
		sockops_key(&k, ops);
		k.class = report_class(sk);
		cg = sock_cgroup(sk);
	}
	/* The circuit's counted successes first (a success of another of its
	 * sockets may have come before this record; a handshake is no call
	 * where they are counted, so its record needs no flush). */
	if (r->outcome != OUTCOME_ESTABLISHED) {
		int ok;
		struct settings *c = get_settings();
		if (st && st->resp && (st->flags & SOCK_TRACKED))
			ok = flush_socket(st, r->ts_ns);
		else if (c && (c->flags & CONFIG_LIMITS))
			ok = flush_limit(&k, r->ts_ns);
		else
			ok = 1;
		if (!ok) {
			stat_inc(STAT_EVENTS_LOST);
			return 0;
		}
	}
	r->flags |= probe_flag(st);
	r->round = st ? st->round : 0;
	r->cookie = bpf_get_socket_cookie(ops);
	r->dest = k;
	r->cgroup_id = cg;
	return emit(r, wake);
}

static __always_inline void on_established(struct bpf_sock_ops *ops, __u64 now)
{
	/* Called for every socket, callback flags or not. */
	struct sock_state *st = ops->sk ? bpf_sk_storage_get(&socks, ops->sk, 0, 0) : 0;
	if (!observed(ops)) {
		/* Not followed (sockops judged the connect unprotected, where
		 * connect did not: only when the handoff was lost and the
		 * process moved out of its workload in between, or, without
		 * has_sockops_current, the socket's own cgroup is of no
		 * workload). A count connect took is still given back; the
		 * rest is released when the socket is. */
		if (st)
			bulk_release(st, BULK_CONNECTING);
		return;
	}
	struct sock *sk = full_sock(ops);
	__u64 took;
	if (st && (st->flags & SOCK_TRACKED) && st->start_ns)
		took = now - st->start_ns;
	else if (!ops->total_retrans && ops->srtt_us)
		/* No SYN was retransmitted: the first RTT sample is the
		 * handshake (srtt_us holds 8 times it). */
		took = (__u64)(ops->srtt_us >> SRTT_SHIFT) * NSEC_PER_USEC;
	else
		took = connect_age(sk, now);
	__u32 wake = LAZY;
	if (st) {
		st->flags |= SOCK_ESTABLISHED;
		st->rtos = 0; /* from here on, RTOs mean a stall */
		bulk_release(st, BULK_CONNECTING);
		if (st->flags & SOCK_PROBE)
			wake = WAKE;
	}
	struct settings *c = get_settings();
	if (wake == LAZY && c && c->wake_slow_ns && took >= c->wake_slow_ns)
		wake = WAKE;
	report(ops, st,
	       &(struct event){.outcome = OUTCOME_ESTABLISHED, .duration_ns = took, .ts_ns = now},
	       wake);
	/* Without storage, nothing is left to follow but a reset (which
	 * reset_seen reports) and RTOs (which make storage, and turn the state
	 * callbacks on again): no state callback is needed, and the one at the
	 * application's close is saved. */
	if (!st && c && (c->flags & CONFIG_RESET_TRACE))
		bpf_sock_ops_cb_flags_set(ops, BPF_SOCK_OPS_RTO_CB_FLAG);
}

/* on_rto: the rare path that makes storage, to count the socket's RTOs and
 * send its early records once. */
static __always_inline void on_rto(struct bpf_sock_ops *ops, __u64 now)
{
	if (!ops->sk)
		return;
	/* Closing (the application closed it, or closed it after the peer):
	 * what the state callback at that change does for a socket that still
	 * has it. Only an established socket that on_established left with
	 * the RTO callback alone gets here in these states: its FIN's
	 * retransmissions are no failure anyone saw, and it has no storage
	 * and no bulkhead count. */
	__u32 state = ops->state;
	if (state == TCP_FIN_WAIT1 || state == TCP_LAST_ACK || state == TCP_CLOSING) {
		bpf_sock_ops_cb_flags_set(ops, 0);
		return;
	}
	struct sock_state *st = bpf_sk_storage_get(&socks, ops->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		stat_inc(STAT_STORAGE_FAILED);
		return;
	}
	struct sock *sk = full_sock(ops);
	int connecting = ops->state == TCP_SYN_SENT;
	if (!(st->flags & SOCK_TRACKED)) {
		__u64 age = connecting ? connect_age(sk, now) : 0;
		track(ops, st, sk, age ? now - age : 0, report_class(sk));
		if (!connecting) {
			st->flags |= SOCK_ESTABLISHED;
			/* With storage from here on: its close is followed
			 * again (on_close), and reset_seen leaves it alone. */
			bpf_sock_ops_cb_flags_set(ops, BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG);
		}
	}
	st->rtos += 1;
	if (!(st->flags & SOCK_ESTABLISHED)) {
		if (!(st->flags & SOCK_RETRANS_SENT)) {
			st->flags |= SOCK_RETRANS_SENT;
			report(ops, st,
			       &(struct event){.outcome = OUTCOME_SYN_RETRANS,
					       .duration_ns = st->start_ns ? now - st->start_ns : 0,
					       .count = st->rtos,
					       .ts_ns = now},
			       WAKE);
		}
	} else if (!(st->flags & SOCK_STALL_SENT)) {
		__u32 max_rto = DEFAULT_MAX_RTO;
		struct settings *c = get_settings();
		if (c && c->max_rto)
			max_rto = c->max_rto;
		if (st->rtos >= max_rto) {
			st->flags |= SOCK_STALL_SENT;
			report(ops, st,
			       &(struct event){.outcome = OUTCOME_STALLED,
					       .duration_ns = st->start_ns ? now - st->start_ns : 0,
					       .count = st->rtos,
					       .ts_ns = now},
			       WAKE);
		}
	}
}

/* end_turn runs as a followed connection ends: a request that still
 * awaited its first response byte is reported (no_response: the peer
 * reset it, or the application gave up on it; a peer's FIN is seen by
 * resp_ingress), and the socket's inflight entry goes. It reports whether
 * it sent a record. */
static __always_inline int end_turn(struct bpf_sock_ops *ops, struct sock_state *st, __u32 err,
				    __u8 peer, __u64 now)
{
	if (!st || !st->resp || !(st->flags & SOCK_TRACKED))
		return 0;
	int reported = 0;
	__u64 cookie = bpf_get_socket_cookie(ops);
	if (st->phase == PHASE_AWAITING) {
		no_response(st, cookie, err, peer ? EVENT_PEER_CLOSED : 0, now);
		reported = 1;
	}
	if (st->resp & RESP_INFLIGHT)
		bpf_map_delete_elem(&inflight, &cookie);
	return reported;
}

static __always_inline void on_close(struct bpf_sock_ops *ops, __u64 now)
{
	struct sock_state *st = ops->sk ? bpf_sk_storage_get(&socks, ops->sk, 0, 0) : 0;
	int ended = 0;
	if (st && st->resp) {
		int e = sock_err(full_sock(ops));
		ended = end_turn(ops, st, e, e != 0, now);
	}
	if (st) {
		bulk_release(st, BULK_CONNECTING | BULK_CONNECTIONS);
		if (st->flags & SOCK_DONE)
			return;
		st->flags |= SOCK_DONE;
	}
	struct sock *sk = full_sock(ops);
	int err = sock_err(sk);
	__u64 start = (st && (st->flags & SOCK_TRACKED)) ? st->start_ns : 0;
	__u8 outcome = 0, flags = 0;
	__u64 took = start ? now - start : 0;
	if (ops->args[0] == TCP_SYN_SENT) {
		switch (err) {
		case 0:
			outcome = OUTCOME_ABANDONED;
			break;
		case ECONNREFUSED:
			outcome = OUTCOME_REFUSED;
			break;
		case ETIMEDOUT:
			outcome = OUTCOME_TIMED_OUT;
			break;
		case EHOSTUNREACH:
		case ENETUNREACH:
			outcome = OUTCOME_UNREACHABLE;
			break;
		default:
			outcome = OUTCOME_ERROR;
		}
		if (!start)
			took = connect_age(sk, now);
	} else if (err == ECONNRESET || err == EPIPE) {
		outcome = OUTCOME_RESET;
		if (!start)
			flags = EVENT_NO_AGE;
	} else if (err == ETIMEDOUT && !(st && (st->flags & SOCK_STALL_SENT))) {
		outcome = OUTCOME_STALLED;
	}
	if (ended && (outcome == OUTCOME_RESET || outcome == OUTCOME_STALLED))
		outcome = 0; /* the no_response record stands for it */
	if (outcome)
		report(ops, st,
		       &(struct event){.outcome = outcome,
				       .flags = flags,
				       .err = (__u16)err,
				       .duration_ns = took,
				       .count = st ? st->rtos : 0,
				       .ts_ns = now},
		       WAKE);
}

SEC("sockops")
int observe(struct bpf_sock_ops *ops)
{
	/* The cgroup hook is called for every callback type of every socket;
	 * leave the ones breakerd does not use before any helper call. Only
	 * sockets connect() set the callback flags on (TCP_CONNECT_CB) get
	 * state and RTO callbacks. */
	switch (ops->op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		on_connect(ops);
		break;
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		on_established(ops, bpf_ktime_get_ns());
		break;
	case BPF_SOCK_OPS_RTO_CB:
		on_rto(ops, bpf_ktime_get_ns());
		break;
	case BPF_SOCK_OPS_STATE_CB:
		switch (ops->args[1]) {
		case TCP_CLOSE:
			on_close(ops, bpf_ktime_get_ns());
			break;
		case TCP_FIN_WAIT1: /* the application closed it */
		case TCP_LAST_ACK:
		case TCP_CLOSING:
			if (ops->sk) {
				struct sock_state *st = bpf_sk_storage_get(&socks, ops->sk, 0, 0);
				if (st) {
					bulk_release(st, BULK_CONNECTING | BULK_CONNECTIONS);
					if (st->resp)
						end_turn(ops, st, 0, ops->args[1] != TCP_FIN_WAIT1,
							 bpf_ktime_get_ns());
				}
			}
			/* Closing: nothing from here on is a failure anyone saw
			 * (the application let go of the connection, or the peer
			 * did), and its bulkhead count is back. Its last state
			 * changes need not call this program. */
			bpf_sock_ops_cb_flags_set(ops, 0);
			break;
		}
		break;
	}
	return 1;
}

/* reset_seen reports an incoming reset of an established connection that
 * sockops no longer follows with state callbacks: one without storage,
 * whose callback flags on_established left at exactly the RTO flag (a
 * socket with storage has the state flag too, and its reset is reported
 * by on_close). The tracepoint fires in tcp_reset() for every socket of
 * the machine, before the reset is applied, so the state is still the
 * one it came in: only ESTABLISHED and CLOSE_WAIT count, as on_close
 * counts ECONNRESET and EPIPE (a reset after the application closed is no
 * failure anyone saw), and only for sockets made at or below the attach
 * point (settings.attach_cgroup_id; another breakerd's are its own). The
 * record carries EVENT_NO_AGE: the daemon dates it by the socket's
 * established record, and drops it if it has none. */
SEC("tp_btf/tcp_receive_reset")
int reset_seen(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	if (!sk)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp || tp->bpf_sock_ops_cb_flags != BPF_SOCK_OPS_RTO_CB_FLAG)
		return 0;
	__u8 state = sk->__sk_common.skc_state;
	if (state != TCP_ESTABLISHED && state != TCP_CLOSE_WAIT)
		return 0;
	struct settings *cfg = get_settings();
	if (!cfg || !(cfg->flags & CONFIG_RESET_TRACE))
		return 0;
	__u64 attach = cfg->attach_cgroup_id;
	if (attach && !cgroup_below(sk->sk_cgrp_data.cgroup, attach, MAX_CGROUP_DEPTH))
		return 0; /* another breakerd's socket, or no one's */
	struct dest_key k;
	__builtin_memset(&k, 0, sizeof(k));
	struct sock_common *skc = &sk->__sk_common;
	if (skc->skc_family == AF_INET)
		dest_ipv4(&k, skc->skc_daddr);
	else
		dest_ipv6(&k, skc->skc_v6_daddr.u6_addr32[0], skc->skc_v6_daddr.u6_addr32[1],
			  skc->skc_v6_daddr.u6_addr32[2], skc->skc_v6_daddr.u6_addr32[3]);
	k.port = skc->skc_dport;
	k.proto = IPPROTO_TCP;
	k.class = report_class(sk);
	__u64 now = bpf_ktime_get_ns();
	if ((cfg->flags & CONFIG_LIMITS) && !flush_limit(&k, now)) {
		stat_inc(STAT_EVENTS_LOST);
		return 0;
	}
	emit(&(struct event){.dest = k,
			     .outcome = OUTCOME_RESET,
			     .flags = EVENT_NO_AGE,
			     .err = state == TCP_CLOSE_WAIT ? EPIPE : ECONNRESET,
			     .cookie = bpf_get_socket_cookie(sk),
			     .cgroup_id = sock_cgroup(sk),
			     .ts_ns = now},
	     WAKE);
	return 0;
}

/* sock_release runs when a socket of the cgroup is released (close(), or
 * the process exits or is killed): whatever it still holds in a bulkhead is
 * given back. With the sockops paths above this releases each count exactly
 * once, also for sockets that never reached the network (a connect that
 * failed before sending its SYN). */
SEC("cgroup/sock_release")
int sock_release(struct bpf_sock *sk)
{
	struct sock_state *st = bpf_sk_storage_get(&socks, sk, 0, 0);
	if (st) {
		bulk_release(st, BULK_CONNECTING | BULK_CONNECTIONS);
		if (st->resp & RESP_INFLIGHT) {
			__u64 cookie = bpf_get_socket_cookie(sk);
			bpf_map_delete_elem(&inflight, &cookie);
		}
	}
	return 1;
}

#endif /* BREAKERD_SOCKOPS_H */
