/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Records on the events ring: emit; the successes counted in answered
 * words, written out before any record that follows them (flush_*) or
 * counted without one (answered_add); and the no_response record, which
 * sockops and the response programs both write.
 */
#ifndef BREAKERD_RECORD_H
#define BREAKERD_RECORD_H

/* A function marked verified_once is a global function: the verifier
 * checks its body once per program that calls it, with its arguments
 * unknown, rather than again at every call and on every path that reaches
 * one (the bulk of a load's time on 6.1, and under the CI's emulation). Its
 * arguments may be only scalars, the program's context, and pointers to
 * memory of their type's size, which it checks against null itself; it
 * returns a scalar. */
#define verified_once __attribute__((noinline))

/* Wake-up flags of a record: see struct event. */
#define WAKE BPF_RB_FORCE_WAKEUP
#define LAZY 0

/* emit writes record r to the ring buffer: it wakes the reader (WAKE), or,
 * LAZY, leaves it for the next batch while the ring is between one and two
 * watermarks full. A full ring drops it (STAT_EVENTS_LOST). */
verified_once int emit(const struct event *r, __u32 wake)
{
	if (!r)
		return 0;
	__u64 submit = BPF_RB_FORCE_WAKEUP;
	if (wake == LAZY) {
		__u64 unread = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
		if (unread < WAKE_WATERMARK || unread >= 2 * WAKE_WATERMARK)
			submit = BPF_RB_NO_WAKEUP;
	}
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		stat_inc(STAT_EVENTS_LOST);
		return 0;
	}
	__builtin_memcpy(e, r, sizeof(*e));
	bpf_ringbuf_submit(e, submit);
	return 1;
}

/* flush_answered writes circuit id's counted successes out, as one
 * OUTCOME_ANSWERED record, before a record that must come after them. The
 * count is taken out with one atomic and (another flush, or a success
 * counted meanwhile, is never lost or counted twice). It returns 0 only
 * when successes are waiting and the ring has no room for their record:
 * the caller then drops its own record too (counted lost), since written
 * alone it would be read before successes that came first. */
verified_once int flush_answered(__u32 id, __u64 now)
{
	__u64 *w = bpf_map_lookup_elem(&answered, &id);
	if (!w || !(*(volatile __u64 *)w & ANSWERED_COUNT))
		return 1;
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e)
		return 0; /* the count stays for the next flush */
	__u64 old = __sync_fetch_and_and(w, ~ANSWERED_COUNT);
	if (!(old & ANSWERED_COUNT)) {
		bpf_ringbuf_discard(e, BPF_RB_NO_WAKEUP); /* another flush took it */
		return 1;
	}
	__builtin_memset(e, 0, sizeof(*e));
	e->outcome = OUTCOME_ANSWERED;
	e->round = id;
	e->count = (__u32)(old >> ANSWERED_SHIFT);
	e->duration_ns = old & ANSWERED_COUNT;
	e->ts_ns = now;
	bpf_ringbuf_submit(e, BPF_RB_NO_WAKEUP);
	return 1;
}

/* flush_limit flushes the answered word destination k's limits entry
 * names, for a record of a socket connect did not mark for it (made before
 * the entry, or without storage): the same order for its records. Only
 * failure paths call it. */
verified_once int flush_limit(const struct dest_key *k, __u64 now)
{
	if (!k)
		return 1;
	/* The key copied to the stack: 6.1 takes a map key from no memory
	 * a global function's argument points to. */
	struct dest_key key;
	__builtin_memcpy(&key, k, sizeof(key));
	struct limit *l = bpf_map_lookup_elem(&limits, &key);
	if (!l || !(l->responses & RESP_BATCH))
		return 1;
	return flush_answered(l->batch_id, now);
}

#define TAKE_ATTEMPTS_ANSWERED 16

/* flush_socket writes out, before a record of a followed socket, the
 * successes counted for the circuit its destination belongs to now (the
 * word its limits entry names) and for the one connect marked it with, if
 * that was another (the destination moved, or the socket was marked
 * before its circuit counted successes): either may hold successes of
 * other sockets that came before this record. */
verified_once int flush_socket(struct sock_state *st, __u64 now)
{
	if (!st)
		return 1;
	__u32 marked = (st->resp & RESP_BATCH) ? st->batch_id : ANSWERED_IDS;
	struct dest_key key; /* on the stack, as in flush_limit */
	__builtin_memcpy(&key, &st->dest, sizeof(key));
	struct limit *l = bpf_map_lookup_elem(&limits, &key);
	if (l && (l->responses & RESP_BATCH) && l->batch_id != marked &&
	    !flush_answered(l->batch_id, now))
		return 0;
	return marked < ANSWERED_IDS ? flush_answered(marked, now) : 1;
}

/* answered_add counts one success in the socket's answered word, if the
 * word is still under the epoch the socket was marked with (else the
 * caller writes the success's record, as without RESP_BATCH). */
static __always_inline int answered_add(struct sock_state *st)
{
	__u32 id = st->batch_id;
	__u64 *w = bpf_map_lookup_elem(&answered, &id);
	if (!w)
		return 0;
	for (int i = 0; i < TAKE_ATTEMPTS_ANSWERED; i++) {
		__u64 old = *(volatile __u64 *)w;
		if ((old >> ANSWERED_SHIFT) != st->batch_epoch ||
		    (old & ANSWERED_COUNT) == ANSWERED_COUNT)
			return 0;
		if (__sync_val_compare_and_swap(w, old, old + 1) == old)
			return 1;
	}
	return 0;
}

/* probe_flag is EVENT_PROBE for a record of a socket admitted as a
 * half-open probe (st may be 0: a socket without storage). */
static __always_inline __u8 probe_flag(struct sock_state *st)
{
	return (st && (st->flags & SOCK_PROBE)) ? EVENT_PROBE : 0;
}

/* turn_probe_flag is EVENT_PROBE for a record of the first turn of a
 * half-open probe: its result. */
static __always_inline __u8 turn_probe_flag(struct sock_state *st)
{
	return st->turn == 1 ? probe_flag(st) : 0;
}

/* no_response reports the turn the socket awaits a response to as
 * unanswered (OUTCOME_NO_RESPONSE: how long it waited, err the socket's
 * errno, flags EVENT_PEER_CLOSED when the peer ended it) and leaves the
 * socket with no turn awaiting (PHASE_IDLE). */
verified_once int no_response(struct sock_state *st, __u64 cookie, __u32 err, __u32 flags,
				__u64 now)
{
	if (!st)
		return 0;
	st->phase = PHASE_IDLE;
	if (!flush_socket(st, now)) {
		stat_inc(STAT_EVENTS_LOST);
		return 0;
	}
	emit(&(struct event){.dest = st->dest,
			     .outcome = OUTCOME_NO_RESPONSE,
			     .flags = (__u8)flags | turn_probe_flag(st),
			     .err = (__u16)err,
			     .count = st->turn,
			     .round = st->round,
			     .duration_ns = now - st->req_ns,
			     .cookie = cookie,
			     .cgroup_id = st->cgroup_id,
			     .ts_ns = now},
	     WAKE);
	return 1;
}

#endif /* BREAKERD_RECORD_H */
