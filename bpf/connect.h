/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The fast path: cgroup/connect4|6 and cgroup/sendmsg4|6 turn a connection
 * to a destination whose circuit is open away inside the system call,
 * before a packet leaves; when an open circuit is due they admit exactly
 * `probes` TCP connections per round of the circuit; a rejected one whose
 * circuit has a fallback goes there instead (redirect). They also apply a
 * destination's bulkhead limits, and hand sockops their decision on
 * whether (and in which class) the connecting process is protected.
 * sockops.h uses the handoff's helpers and bulk_release from here.
 */
#ifndef BREAKERD_CONNECT_H
#define BREAKERD_CONNECT_H

enum decision {
	ALLOW = 0,
	ALLOW_PROBE = 1,
	REJECT = 2,
};

#define ROUND_OF(w) ((__u32)((w) >> 32))
#define TOKENS_OF(w) ((__u32)(w))
#define BUDGET(round, tokens) (((__u64)(round) << 32) | (__u32)(tokens))
#define TAKE_ATTEMPTS 16

/* take_probe hands out one probe token of the verdict's round from the
 * circuit's budget, exactly: at most v->probes winners per round however
 * many race, because every change of the budget word is one
 * compare-and-exchange from the value just read. The first taker of a round
 * the budget has not reached yet begins it (full tokens, minus its own).
 * A verdict older than the budget's round (another destination of the
 * circuit already carries the next one) admits nothing. Each failed
 * exchange means another caller changed the word, which happens at most
 * probes + 1 times per round; after TAKE_ATTEMPTS the caller is rejected
 * (the token stays for the next one). Verified once: its attempts are
 * unrolled, and each ends on a path of its own. */
verified_once int take_probe(struct verdict *v, __u32 *round, __u32 *new_round)
{
	if (!v || !round || !new_round)
		return ALLOW;
	__u32 id = v->circuit_id;
	struct probe_budget *b = bpf_map_lookup_elem(&probe_budgets, &id);
	if (!b)
		return ALLOW; /* fail open */
	__u32 want = v->round;
	if (!v->probes)
		return REJECT;
#pragma unroll
	for (int i = 0; i < TAKE_ATTEMPTS; i++) {
		__u64 old = *(volatile __u64 *)&b->word;
		__s32 ahead = (__s32)(want - ROUND_OF(old));
		__u64 next;
		if (ahead > 0)
			next = BUDGET(want, v->probes - 1);
		else if (ahead == 0 && TOKENS_OF(old) > 0)
			next = old - 1;
		else
			return REJECT;
		if (__sync_val_compare_and_swap(&b->word, old, next) == old) {
			*round = want;
			*new_round = ahead > 0;
			return ALLOW_PROBE;
		}
	}
	return REJECT;
}

/* give_back_probe returns the probe token a connect took under verdict v
 * when the connect's limits then turned it away: a probe is a connection
 * that goes out and reports, and one turned away would leave the round
 * without it (a workload over its bulkhead, connecting first when the
 * circuit is due, would keep a recovered destination's circuit open for
 * every workload). Given back only while the budget is still in v's round
 * and short of a full one, so a round never admits more than v->probes
 * connections. Verified once, as take_probe. */
verified_once int give_back_probe(struct verdict *v)
{
	if (!v)
		return 0;
	__u32 id = v->circuit_id;
	struct probe_budget *b = bpf_map_lookup_elem(&probe_budgets, &id);
	if (!b)
		return 0;
#pragma unroll
	for (int i = 0; i < TAKE_ATTEMPTS; i++) {
		__u64 old = *(volatile __u64 *)&b->word;
		if (ROUND_OF(old) != v->round || TOKENS_OF(old) >= v->probes)
			return 0;
		if (__sync_val_compare_and_swap(&b->word, old, old + 1) == old)
			return 1;
	}
	return 0;
}

static __always_inline enum decision decide(struct verdict *v, struct dest_key *key, __u64 now,
					    __u32 *round, __u32 *new_round)
{
	switch (v->state) {
	case VERDICT_FORCED_OPEN:
		return REJECT;
	case VERDICT_OPEN:
		if (now < v->due_ns)
			return REJECT;
		/* Due: half-open. Only TCP connections probe (sockops reports
		 * how they end); a UDP send could never report, so it never
		 * takes a token and stays rejected until the circuit closes. */
		if (key->proto != IPPROTO_TCP)
			return REJECT;
		return (enum decision)take_probe(v, round, new_round);
	default:
		return ALLOW; /* unknown state: fail open */
	}
}

/* What turned a connect or a send away, and which field of its
 * rejection_count counts it. */
enum rejection_kind {
	REJ_VERDICT = 0,
	REJ_VERDICT_SHADOW = 1,
	REJ_BULKHEAD = 2,
	REJ_BULKHEAD_SHADOW = 3,
	REJ_SLOW_START = 4,
	REJ_SLOW_START_SHADOW = 5,
};

/* note_rejection counts a rejection (or a shadow one) of the given kind
 * against the calling process's cgroup (process context: connect and
 * sendmsg run in the caller), under the rejecting verdict's circuit id and
 * epoch or the rejecting limit's slot and epoch. Reached only on a reject
 * path; an epoch of 0 (written by a daemon that does not record them)
 * records nothing. A failed insert other than a racing one (EEXIST:
 * another CPU made the entry first) means the map is full: counted, and
 * the connect is rejected all the same. Verified once, not on each of
 * the reject paths. */
verified_once int note_rejection(__u32 id, __u32 epoch, __u32 kind)
{
	if (!epoch)
		return 0;
	struct rejection_key k = {
		.cgroup_id = bpf_get_current_cgroup_id(),
		.circuit_id = id,
		.epoch = epoch,
	};
	struct rejection_count *r = bpf_map_lookup_elem(&rejections, &k);
	if (!r) {
		struct rejection_count zero = {};
		long err = bpf_map_update_elem(&rejections, &k, &zero, BPF_NOEXIST);
		if (err && err != -EEXIST) {
			stat_inc(STAT_REJECTIONS_FULL);
			return 0;
		}
		r = bpf_map_lookup_elem(&rejections, &k);
		if (!r)
			return 0;
	}
	switch (kind) {
	case REJ_VERDICT:
		count(r->rejected);
		break;
	case REJ_VERDICT_SHADOW:
		count(r->shadow_rejected);
		break;
	case REJ_BULKHEAD:
		count(r->bulkhead_rejected);
		break;
	case REJ_BULKHEAD_SHADOW:
		count(r->bulkhead_shadow_rejected);
		break;
	case REJ_SLOW_START:
		count(r->slow_start_rejected);
		break;
	case REJ_SLOW_START_SHADOW:
		count(r->slow_start_shadow_rejected);
		break;
	}
	return 1;
}

/* A share in 1/RAMP_ALL: RAMP_ALL admits every connect. */
#define RAMP_ALL (RAMP_UNIT * RAMP_UNIT)

/* ramp_share is the share of new connects a slow-start verdict admits at
 * now: the daemon's curve, linear between its samples, RAMP_ALL from the
 * ramp's end on (so a finished ramp costs no write, whenever the daemon
 * deletes it). A start in the future (a clock mix-up) admits the floor. */
static __always_inline __u32 ramp_share(const struct verdict *v, __u64 now)
{
	if (now < v->due_ns)
		return (__u32)v->ramp[0] * RAMP_UNIT;
	__u64 elapsed = now - v->due_ns, len = v->ramp_ns;
	if (!len || elapsed >= len)
		return RAMP_ALL;
	/* elapsed < len, and the daemon bounds len to hours: no overflow. */
	__u64 pos = elapsed * RAMP_POINTS;
	__u32 i = (__u32)(pos / len);
	__u32 frac = (__u32)((pos - (__u64)i * len) * RAMP_UNIT / len);
	i &= RAMP_POINTS - 1;
	__u32 lo = v->ramp[i];
	__u32 hi = RAMP_UNIT;
	if (i + 1 < RAMP_POINTS)
		hi = v->ramp[(i + 1) & (RAMP_POINTS - 1)];
	/* Modular arithmetic: exact for a falling segment too. */
	return lo * RAMP_UNIT + (hi - lo) * frac;
}

/* ramp_admits decides one new connect under a slow-start verdict by error
 * diffusion over the circuit's ramp_credit: each connect adds the share
 * now, and it is admitted when the sum crosses a whole RAMP_ALL. So over
 * any run of connects the admitted ones are the sum of their shares, to
 * within one, spread evenly (not at random), however many CPUs race: one
 * atomic add. No counters entry: fail open. */
static __always_inline int ramp_admits(struct circuit_counters *c, __u32 share)
{
	if (share >= RAMP_ALL || !c)
		return 1;
	__u64 old = __sync_fetch_and_add(&c->ramp_credit, (__u64)share);
	return (old / RAMP_ALL) != ((old + share) / RAMP_ALL);
}

/* ramp_allows applies a slow-start verdict: the circuit is closed, and
 * only the share of new TCP connects the ramp allows now goes through.
 * The rest see the overload errno (the bulkhead's), counted apart, and
 * against the caller's cgroup under the verdict's id and epoch; they make
 * no socket outcome, so none enters the failure window. A UDP send is
 * never held back (a datagram is no new connection), and in shadow mode
 * a connect the ramp would turn away is counted as a shadow rejection
 * (the cgroup's as a slow-start one) and admitted. */
static __always_inline int ramp_allows(struct dest_key *key, struct verdict *v, __u32 flags,
				       __u64 now)
{
	if (key->proto != IPPROTO_TCP)
		return 1;
	__u32 share = ramp_share(v, now);
	if (share >= RAMP_ALL)
		return 1; /* the ramp is over: no atomic add */
	struct circuit_counters *c = counters_of(v->circuit_id);
	if (ramp_admits(c, share))
		return 1;
	if (flags & CONFIG_SHADOW) {
		if (c)
			count(c->shadow_rejected);
		note_rejection(v->circuit_id, v->epoch, REJ_SLOW_START_SHADOW);
		return 1;
	}
	if (c)
		count(c->slow_start_rejected);
	note_rejection(v->circuit_id, v->epoch, REJ_SLOW_START);
	if (has_set_retval)
		bpf_set_retval(-(int)(v->reject_errno ? v->reject_errno : EAGAIN));
	return 0;
}

/* judge decides what an open, half-open or forced-open verdict says of
 * this connect: a probe it admits has its socket marked, a new round
 * recorded; a rejection is left to the caller (refuse, or a
 * redirect to the circuit's fallback). */
static __always_inline enum decision judge(struct bpf_sock_addr *ctx, struct dest_key *key,
					   struct verdict *v, __u64 now)
{
	__u32 round = 0, new_round = 0;
	enum decision d = decide(v, key, now, &round, &new_round);
	struct circuit_counters *c = counters_of(v->circuit_id);
	if (new_round) {
		if (c)
			count(c->rounds);
		emit(&(struct event){.dest = *key,
				     .outcome = OUTCOME_PROBE_ROUND,
				     .round = round,
				     .cgroup_id = bpf_get_current_cgroup_id(),
				     .ts_ns = now},
		     WAKE);
	}
	if (d == ALLOW_PROBE) {
		/* Mark the socket so its outcome is reported as a probe of
		 * its round (probes are TCP only); the caller counts it once
		 * its limits admit it. */
		struct sock_state *st = bpf_sk_storage_get(&socks, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
		if (st) {
			st->flags |= SOCK_PROBE;
			st->round = round;
		} else {
			stat_inc(STAT_STORAGE_FAILED);
		}
	}
	return d;
}

/* refuse turns a connect away under verdict v (shadow mode: counts it and
 * lets it through), and returns whether it is allowed. */
static __always_inline int refuse(struct verdict *v, __u32 flags)
{
	struct circuit_counters *c = counters_of(v->circuit_id);
	if (flags & CONFIG_SHADOW) {
		if (c)
			count(c->shadow_rejected);
		note_rejection(v->circuit_id, v->epoch, REJ_VERDICT_SHADOW);
		return 1;
	}
	if (c)
		count(c->rejected);
	note_rejection(v->circuit_id, v->epoch, REJ_VERDICT);
	if (has_set_retval)
		bpf_set_retval(-(int)(v->reject_errno ? v->reject_errno : ECONNREFUSED));
	return 0;
}

/* redirect sends a connect or send that verdict v rejects to the
 * fallback of v's circuit, if it has one (an entry of the verdict's epoch,
 * for this protocol or any, of the family ctx was given: v6, the program is
 * connect6/sendmsg6), and the fallback's own verdict does not reject it
 * too: the fallback is a destination with a circuit of its own, judged
 * here as any destination is (a half-open fallback may take this connect
 * as its probe). Redirected, the socket remembers what it asked for
 * (getpeername) and *key is the fallback's: its limits apply (the caller
 * counts the redirect once they admit it), and sockops reports the
 * outcome under the socket's peer, the fallback, never the dead target.
 * It returns whether the connect was redirected (*probed: the fallback's
 * verdict, when the connect is its probe); if not, nothing was changed
 * and the caller rejects as without a fallback. Never followed
 * further: a fallback's own fallback is not looked at (configuration
 * refuses chains). */
static __always_inline int redirect(struct bpf_sock_addr *ctx, struct dest_key *key, struct verdict *v,
				    struct settings *cfg, __u64 now, int v6, struct verdict **probed)
{
	__u32 id = v->circuit_id;
	struct fallback *f = bpf_map_lookup_elem(&fallbacks, &id);
	if (!f || !f->epoch || f->epoch != v->epoch || (f->proto && f->proto != key->proto))
		return 0;
	struct dest_key fk;
	__builtin_memcpy(fk.addr, f->addr, sizeof(fk.addr));
	fk.port = f->port;
	fk.proto = key->proto;
	fk.class = key->class;
	/* An IPv4 socket cannot be sent to an IPv6 fallback, nor an IPv6
	 * destination to an IPv4 one: rejected as without a fallback. */
	if (is_mapped(fk.addr) != is_mapped(key->addr) || (!v6 && !is_mapped(fk.addr)))
		return 0;
	if (cfg->verdict_mask & (1ULL << verdict_bucket(&fk))) {
		struct verdict *fv = bpf_map_lookup_elem(&verdicts, &fk);
		if (fv && fv->state == VERDICT_RAMP) {
			/* The fallback in slow start: its ramp's share, as for a
			 * connect of its own (a datagram is never held back). */
			if (fk.proto == IPPROTO_TCP &&
			    !ramp_admits(counters_of(fv->circuit_id), ramp_share(fv, now)))
				return 0;
		} else if (fv) {
			enum decision fd = judge(ctx, &fk, fv, now);
			if (fd == REJECT)
				return 0; /* the fallback's circuit is open too */
			if (fd == ALLOW_PROBE)
				*probed = fv; /* the fallback's probe */
		}
	}
	rewrite_dest(ctx, &fk, v6);
	remember(ctx, key, &fk);
	*key = fk;
	return 1;
}

/* take_slot counts one socket in *n if that stays within max; exact
 * however many race (a loser gives back what it took). */
static __always_inline int take_slot(__s64 *n, __u32 max)
{
	__s64 old = __sync_fetch_and_add(n, 1);
	if (old < (__s64)max)
		return 1;
	__sync_fetch_and_add(n, -1);
	return 0;
}

static __always_inline void bulk_release(struct sock_state *st, __u32 bits)
{
	__u32 took = __sync_fetch_and_and(&st->bulk, ~bits) & bits;
	if (!took)
		return;
	__u32 slot = st->bulk_slot;
	struct bulk_count *b = bpf_map_lookup_elem(&bulk, &slot);
	if (!b)
		return;
	if (took & BULK_CONNECTING)
		__sync_fetch_and_add(&b->connecting, -1);
	if (took & BULK_CONNECTIONS)
		__sync_fetch_and_add(&b->connections, -1);
}

/* bulkhead_admits applies a destination's concurrency limits to a TCP
 * connect and marks the socket with what it holds. */
static __always_inline int bulkhead_admits(struct bpf_sock_addr *ctx, struct limit *l, __u32 flags)
{
	struct sock_state *st = bpf_sk_storage_get(&socks, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		stat_inc(STAT_STORAGE_FAILED);
		return 1;
	}
	if (l->responses) {
		st->resp = l->responses; /* the cgroup_skb programs follow its turns */
		st->batch_id = l->batch_id;
		st->batch_epoch = l->batch_epoch;
		st->fast_us = l->fast_us;
	}
	if (!l->max_connecting && !l->max_connections)
		return 1; /* an entry for responses only */
	if (st->bulk)
		return 1; /* connect() called again on a counted socket */
	__u32 slot = l->slot;
	struct bulk_count *b = bpf_map_lookup_elem(&bulk, &slot);
	if (!b)
		return 1;
	__u32 took = 0;
	if (l->max_connecting) {
		if (!take_slot(&b->connecting, l->max_connecting))
			goto over;
		took |= BULK_CONNECTING;
	}
	if (l->max_connections) {
		if (!take_slot(&b->connections, l->max_connections)) {
			if (took & BULK_CONNECTING)
				__sync_fetch_and_add(&b->connecting, -1);
			goto over;
		}
		took |= BULK_CONNECTIONS;
	}
	st->bulk_slot = slot;
	st->bulk = took;
	return 1;
over:;
	/* Only here, past the limit, is the rejections map touched: an
	 * admitted connect costs what it did before. */
	struct circuit_counters *c = counters_of(slot);
	if (flags & CONFIG_SHADOW) {
		if (c)
			count(c->shadow_rejected);
		note_rejection(slot, l->epoch, REJ_BULKHEAD_SHADOW);
		return 1;
	}
	if (c)
		count(c->bulkhead_rejected);
	note_rejection(slot, l->epoch, REJ_BULKHEAD);
	if (has_set_retval)
		bpf_set_retval(-(int)(l->reject_errno ? l->reject_errno : EAGAIN));
	return 0;
}

/* WORKLOAD_FLAGS: the workloads map is looked up (CONFIG_SCOPED or
 * CONFIG_CLASSES). */
#define WORKLOAD_FLAGS (CONFIG_SCOPED | CONFIG_CLASSES)

#define HANDOFF_CLASS 0xffffffffULL /* the lower half: the class (plus one) */

/* handoff_thread is the handoff's name of the calling thread where sockops
 * can read it (has_sockops_current): its id in the upper half, the class
 * (plus one) in the lower half written with it. A thread id is never 0,
 * so neither is the entry while it names one. */
static __always_inline __u64 handoff_thread(__u64 pid_tgid)
{
	return (pid_tgid & 0xffffffffULL) << 32; /* pid_tgid's lower half is the thread id */
}

/* current_workload is the workload entry of the cgroup the calling
 * process is in now, or 0 (process context: connect4/6, and sockops'
 * connect callback with has_sockops_current). */
static __always_inline struct workload *current_workload(void)
{
	__u64 cg = bpf_get_current_cgroup_id();
	return bpf_map_lookup_elem(&workloads, &cg);
}

/* scope decides, with WORKLOAD_FLAGS, whether the calling process is
 * protected and its classes: by the cgroup it is in now
 * (bpf_get_current_cgroup_id; this is process context). A cgroup with an
 * entry gives the key its workload class and *bulkhead the class its
 * limits are looked up with; one without is not protected under
 * CONFIG_SCOPED, and protected in class 0 otherwise. A TCP connect hands
 * the decision to sockops' connect callback, which runs next in the same
 * connect() call, through the per-CPU handoff (a plain map write: no
 * socket storage is made), keyed by the connecting thread where sockops
 * can read it (has_sockops_current), else by the socket's cookie (which
 * is made here: the filter's dearest part). */
static __always_inline int scope(struct bpf_sock_addr *ctx, struct dest_key *key, __u32 flags,
				 __u8 *bulkhead)
{
	struct workload *w = current_workload();
	int protected = w || !(flags & CONFIG_SCOPED);
	if (key->proto == IPPROTO_TCP) {
		struct connect_handoff *h = get_handoff();
		__u32 class1 = w ? w->class + 1 : (__u32)protected;
		if (h && has_sockops_current) {
			/* One 8-byte store: never half of another connect's. */
			h->cookie = handoff_thread(bpf_get_current_pid_tgid()) | class1;
		} else if (h) {
			h->cookie = bpf_get_socket_cookie(ctx);
			h->class1 = class1;
		}
	}
	if (w) {
		key->class = (__u8)w->class;
		*bulkhead = (__u8)w->bulkhead;
	}
	return protected;
}

/* A heartbeat this far ahead of the clock read here still counts: the
 * NMI-safe clock may lag the daemon's CLOCK_MONOTONIC by a tick or so;
 * more is a clock mix-up. */
#define HEARTBEAT_AHEAD_NS NSEC_PER_SEC

static __always_inline int enforce(struct bpf_sock_addr *ctx, struct dest_key *key, int v6)
{
	struct settings *cfg = get_settings();
	if (!cfg)
		return 1;
	/* Only a target can cover UDP (no outcome of a datagram is ever seen,
	 * so no dynamic circuit is UDP): without one, a datagram costs no
	 * lookup. */
	if (key->proto != IPPROTO_TCP && !(cfg->flags & CONFIG_UDP))
		return 1;
	__u8 bulkhead = 0;
	if ((cfg->flags & WORKLOAD_FLAGS) && !scope(ctx, key, cfg->flags, &bulkhead))
		return 1; /* not a protected workload */
	/* The verdict lookup only where the mask says an entry may be: with
	 * no circuit open (the usual case) a connect makes none. */
	struct verdict *v = 0;
	if (cfg->verdict_mask & (1ULL << verdict_bucket(key)))
		v = bpf_map_lookup_elem(&verdicts, key);
	struct limit *l = 0;
	if ((cfg->flags & CONFIG_LIMITS) && key->proto == IPPROTO_TCP) {
		/* The limits are the workload's own (its bulkhead class), also
		 * when it shares the verdict's circuit. */
		__u8 class = key->class;
		key->class = bulkhead;
		l = bpf_map_lookup_elem(&limits, key);
		key->class = class;
	}
	if (!v && !l)
		return 1;

	__u64 now = bpf_ktime_get_ns();
	/* Stale: never written, older than the fail-safe timeout, or from the
	 * future beyond HEARTBEAT_AHEAD_NS: fail open. */
	__s64 age = (__s64)(now - cfg->heartbeat_ns);
	if (!cfg->heartbeat_ns || age > (__s64)cfg->failsafe_ns || age < -HEARTBEAT_AHEAD_NS) {
		stat_inc(STAT_FAILSAFE_ALLOWED);
		return 1;
	}
	__u32 flags = cfg->flags;
	int allowed = 1, redirected = 0;
	struct verdict *probed = 0; /* the verdict whose probe this connect is */
	enum decision d = ALLOW;
	if (v && v->state == VERDICT_RAMP) {
		/* Slow start: the circuit is closed; a connect its ramp turns
		 * away sees the overload errno, never a fallback. */
		allowed = ramp_allows(key, v, flags, now);
	} else if (v && (d = judge(ctx, key, v, now)) == ALLOW_PROBE) {
		probed = v;
	} else if (v && d == REJECT) {
		if (!(flags & CONFIG_SHADOW) && redirect(ctx, key, v, cfg, now, v6, &probed)) {
			/* Sent to the fallback: its limits, not the dead target's. */
			redirected = 1;
			l = 0;
			if ((flags & CONFIG_LIMITS) && key->proto == IPPROTO_TCP) {
				__u8 class = key->class;
				key->class = bulkhead;
				l = bpf_map_lookup_elem(&limits, key);
				key->class = class;
			}
		} else {
			allowed = refuse(v, flags);
		}
	}
	if (allowed && l)
		allowed = bulkhead_admits(ctx, l, flags);
	/* Counted only once the fallback's limits took it: a connect its
	 * bulkhead turns away reached no one. */
	if (redirected && allowed && v)
		count_redirect(v->circuit_id);
	if (probed && allowed) {
		struct circuit_counters *pc = counters_of(probed->circuit_id);
		if (pc)
			count(pc->probes);
	} else if (probed) {
		/* A probe its limits turned away: the round keeps its token,
		 * and the socket is no probe. */
		give_back_probe(probed);
		struct sock_state *st = bpf_sk_storage_get(&socks, ctx->sk, 0, 0);
		if (st)
			st->flags &= ~SOCK_PROBE;
	}
	if (!allowed && (flags & WORKLOAD_FLAGS) && key->proto == IPPROTO_TCP) {
		/* Rejected: no connect callback will take this handoff. */
		struct connect_handoff *h = get_handoff();
		if (h)
			h->cookie = 0;
	}
	return allowed;
}

static __always_inline void key4(struct dest_key *k, struct bpf_sock_addr *ctx)
{
	__builtin_memset(k, 0, sizeof(*k));
	dest_ipv4(k, ctx->user_ip4);
	k->port = (__u16)ctx->user_port;
	k->proto = (__u8)ctx->protocol;
}

static __always_inline void key6(struct dest_key *k, struct bpf_sock_addr *ctx)
{
	__builtin_memset(k, 0, sizeof(*k));
	dest_ipv6(k, ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]);
	k->port = (__u16)ctx->user_port;
	k->proto = (__u8)ctx->protocol;
}

SEC("cgroup/connect4")
int connect4(struct bpf_sock_addr *ctx)
{
	struct dest_key k;
	key4(&k, ctx);
	forget_origin(ctx);
	return enforce(ctx, &k, 0);
}

SEC("cgroup/connect6")
int connect6(struct bpf_sock_addr *ctx)
{
	struct dest_key k;
	key6(&k, ctx);
	forget_origin(ctx);
	return enforce(ctx, &k, 1);
}

SEC("cgroup/sendmsg4")
int sendmsg4(struct bpf_sock_addr *ctx)
{
	struct dest_key k;
	key4(&k, ctx);
	return enforce(ctx, &k, 0);
}

SEC("cgroup/sendmsg6")
int sendmsg6(struct bpf_sock_addr *ctx)
{
	struct dest_key k;
	key6(&k, ctx);
	return enforce(ctx, &k, 1);
}

#endif /* BREAKERD_CONNECT_H */
