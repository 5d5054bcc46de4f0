//go:build ignore
/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * breakerd's kernel programs.
 *
 * cgroup/connect4|6 and cgroup/sendmsg4|6 turn connections to a destination
 * whose circuit is open away inside the system call, before a packet leaves;
 * when an open circuit is due they admit exactly `probes` TCP connections
 * per round of the circuit. sockops watches how each TCP connection
 * of the cgroup ends and reports one record per outcome on a ring buffer.
 *
 * Fail-open, always: no config entry, a stale heartbeat, no verdict entry or
 * any failed lookup means allow.
 */
#include "breaker.h"

#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

#include "cgroup.h"

#define AF_INET 2
#define AF_INET6 10
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define EAGAIN 11
#define EEXIST 17
#define EPIPE 32
#define ENETUNREACH 101
#define ECONNRESET 104
#define ETIMEDOUT 110
#define ECONNREFUSED 111
#define EHOSTUNREACH 113

#define TCP_ESTABLISHED 1
#define TCP_SYN_SENT 2
#define TCP_FIN_WAIT1 4
#define TCP_CLOSE 7
#define TCP_CLOSE_WAIT 8
#define TCP_LAST_ACK 9
#define TCP_CLOSING 11

#define NSEC_PER_SEC 1000000000LL
#define NSEC_PER_MSEC 1000000ULL
#define NSEC_PER_USEC 1000ULL

/* tcp_sock.srtt_us (bpf_sock_ops.srtt_us) holds the smoothed RTT times 8. */
#define SRTT_SHIFT 3

#define TCP_FLAG_FIN 0x01
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04

/* The maps' sizes are enum sizes in breaker.h. Every map but `stats` is the
 * same size on any number of CPUs, so a 256-CPU node costs what a 2-CPU
 * node does. */

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Set by the loader: whether bpf_set_retval exists (5.18+). Without it a
 * rejected connect sees EPERM. The verifier prunes the branch not taken, so
 * the helper is never seen by an older kernel. */
volatile const __u32 has_set_retval = 0;

/* Set by the loader: whether sockops may call bpf_get_current_pid_tgid
 * and bpf_get_current_cgroup_id (6.12, not 6.1). With them, connect4/6
 * hand sockops' connect callback their decision keyed by the connecting
 * thread, which both read for a few ns; without them, keyed by the
 * socket's cookie, which connect4/6 must make (scope(), sock_class()). */
volatile const __u32 has_sockops_current = 0;


/* Minimal CO-RE views of kernel structs: only the fields read here (the
 * cgroup ones in cgroup.h). */
struct in6_addr {
	__u32 u6_addr32[4];
};

/* The peer's address and port, and the state, as in the kernel's struct
 * sock_common (CO-RE finds the names inside its anonymous unions). */
struct sock_common {
	__u32 skc_daddr;
	__u16 skc_dport;
	__u16 skc_family;
	struct in6_addr skc_v6_daddr;
	unsigned char skc_state;
	unsigned char _pad[3];
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
	int sk_err; /* (CO-RE relocates by name; the local layout is only -Wpadded's) */
	struct sock_cgroup_data sk_cgrp_data;
} __attribute__((preserve_access_index));

struct tcp_sock {
	__u32 retrans_stamp;
	__u8 bpf_sock_ops_cb_flags;
	__u8 _pad[3];
} __attribute__((preserve_access_index));

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_DESTINATIONS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct dest_key);
	__type(value, struct verdict);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} verdicts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct settings);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} config SEC(".maps");

/* One shared entry per circuit, updated with atomic adds: a per-CPU array
 * would cost MAX_CIRCUIT_IDS * 40 B per possible CPU (2.5 GiB at 256). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CIRCUIT_IDS);
	__type(key, __u32);
	__type(value, struct circuit_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} counters SEC(".maps");

/* Overrides set through the admin API, by circuit name (daemon only). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_OVERRIDES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct override_key);
	__type(value, struct override);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} overrides SEC(".maps");

/* Each circuit's probe budget (round and tokens), written by the kernel
 * only; every verdict of a circuit points here through its circuit_id. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CIRCUIT_IDS);
	__type(key, __u32);
	__type(value, struct probe_budget);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} probe_budgets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_DESTINATIONS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct dest_key);
	__type(value, struct limit);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} limits SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CIRCUIT_IDS);
	__type(key, __u32);
	__type(value, struct bulk_count);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} bulk SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} stats SEC(".maps");

/* A healthy record wakes the daemon only while between one and two times
 * this much is unread (2048 to 4096 records): at any rate the daemon reads
 * in batches, and a failure behind them waits for at most that many to be
 * handled first. Past twice the watermark the reader is not reading (a
 * daemon restarting): a forced wake-up would only cost every connection a
 * self-interrupt, so healthy records stop asking for one. */
#define WAKE_WATERMARK (128 << 10)

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, EVENTS_SIZE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} events SEC(".maps");

/* What the kernel remembers about one socket that needs it. A healthy
 * connection has no storage (creating it costs more than everything else
 * breakerd does per connection): connect makes it for a half-open probe, a
 * bulkheaded destination or one whose responses are followed, and sockops
 * for a socket's first retransmission timeout. Everything else is read
 * from the socket. */
enum sock_flags {
	SOCK_PROBE = 1 << 0,       /* admitted as a half-open probe */
	SOCK_TRACKED = 1 << 1,     /* dest, start_ns and cgroup_id are filled in */
	SOCK_ESTABLISHED = 1 << 2, /* handshake completed */
	SOCK_RETRANS_SENT = 1 << 3, /* early SYN retransmit record sent */
	SOCK_STALL_SENT = 1 << 4,  /* stalled record sent */
	SOCK_DONE = 1 << 5,        /* final record sent */
};

enum bulk_flags {
	BULK_CONNECTING = 1 << 0,  /* counted in bulk_count.connecting */
	BULK_CONNECTIONS = 1 << 1, /* counted in bulk_count.connections */
};

#define HEAD_BYTES 16 /* sock_state.head: a power of two (indexes are masked with it) */

struct sock_state {
	struct dest_key dest;
	__u32 flags; /* enum sock_flags */
	__u64 start_ns; /* when connect began; 0 if unknown */
	__u64 cgroup_id;
	__u32 rtos;
	__u32 bulk;      /* enum bulk_flags: what this socket holds */
	__u32 bulk_slot; /* which bulk_count it holds it in */
	__u32 round;     /* SOCK_PROBE: the half-open round that admitted it */
	/* Responses (resp != 0, set by connect from limit.responses): */
	__u32 resp;      /* enum response_flags */
	__u32 turn;      /* request/response turns begun */
	__u64 req_ns;    /* the current turn's first request byte */
	__u64 first_ns;  /* its first response byte (HTTP: while the status line is read) */
	__u32 snd_end;   /* sequence just past the last request byte sent (SEQ_SND) */
	__u32 rcv_end;   /* response bytes before this are old (the request's ack) */
	__u8 head[HEAD_BYTES]; /* the start of the response (HTTP/1.x status line) */
	__u8 phase;      /* enum turn_phase */
	__u8 head_len;   /* bytes in head */
	__u8 seq;        /* enum seq_flags */
	__u8 _pad0;
	/* RESP_BATCH, from the limits entry at connect: */
	__u32 batch_id;    /* the answered word's circuit id */
	__u32 batch_epoch; /* the epoch it adds under */
	__u32 fast_us;     /* responses at least this slow are recorded (0: none) */
};

/* Where a socket whose responses are followed is in its turn. */
enum turn_phase {
	PHASE_IDLE = 0,       /* no request yet */
	PHASE_AWAITING = 1,   /* request sent, no final status yet (1xx responses are read past) */
	PHASE_RESPONDING = 2, /* the response began; the next request sent begins a turn */
	/* 101 Switching Protocols answered the turn: the connection left HTTP
	 * and its bytes begin no more turns. Its bit of PHASE_AWAITING makes
	 * resp_egress treat what the socket sends as the turn's own. */
	PHASE_UPGRADED = 3,
};

/* sock_state.head_len while a turn awaits its final status: 0 to
 * STATUS_LINE - 1 bytes of a status line collected, or HEAD_INFO with a
 * scan state: in the header block of an informational (1xx) response,
 * whose end (a blank line) the next status line follows. */
#define HEAD_INFO 0x80
enum info_state {
	INFO_MID = 0,  /* within a line */
	INFO_LF = 1,   /* a line just ended (LF) */
	INFO_LFCR = 2, /* ... and a CR followed */
};
#define INFO_STATE 3 /* head_len's bits of enum info_state */

enum seq_flags {
	SEQ_SND = 1 << 0, /* snd_end holds a sequence number */
};

/* Pinned like every other map: a socket counted in a bulkhead before a
 * restart is released by the new daemon's programs from this same storage.
 * (Unpinned, the new programs would see no storage on such a socket and its
 * count would never come back.) */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sock_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} socks SEC(".maps");

/* Cgroup id -> workload class of every cgroup of a protected workload,
 * written by the daemon (empty unless CONFIG_SCOPED). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_WORKLOAD_CGROUPS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct workload);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} workloads SEC(".maps");

/* Socket cookie -> the turn a request of it awaits (struct inflight_turn),
 * sockets of destinations with response_timeout only. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_INFLIGHT);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct inflight_turn);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} inflight SEC(".maps");

/* Which cgroups each circuit, open or over a bulkhead's limit, turned
 * away, and how often (struct rejection_key; the two kinds counted apart
 * in struct rejection_count). Written on the reject paths only: a connect
 * that is allowed never touches it. Full, a new (circuit, cgroup) pair is
 * not recorded and STAT_REJECTIONS_FULL counts it; the circuit's own
 * counters still count the rejection. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_REJECTIONS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct rejection_key);
	__type(value, struct rejection_count);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rejections SEC(".maps");

/* connect4/6 -> sockops, within one connect() call (struct connect_handoff). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct connect_handoff);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} handoff SEC(".maps");

/* resp_ports holds one bit per remote port (host order: bit port % 64 of
 * word port / 64) of a socket the response programs follow: sockops' connect
 * callback sets it for a socket connect marked (st->resp), after every
 * connect program has run (one of another agent may have rewritten the
 * destination), before its SYN. A packet of a socket to any other port
 * leaves the programs after this array load, which the verifier inlines,
 * with no storage lookup. Bits are never cleared while the layout's pins
 * live: a port no target uses any more costs its packets the storage
 * lookup, as every packet did before. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RESP_PORT_WORDS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} resp_ports SEC(".maps");

/* See ANSWERED_IDS in breaker.h. Memory-mapped: the daemon reads a word
 * to know whether a flush would write anything. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, ANSWERED_IDS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} answered SEC(".maps");

#define RESP_PORT_BITS 64 /* ports per word of resp_ports */
_Static_assert(RESP_PORT_WORDS * RESP_PORT_BITS == 65536, "resp_ports has a bit per port");

/* resp_port_word is port's word of resp_ports (0 only if the lookup
 * failed) and *bit its bit in it. */
static __always_inline __u64 *resp_port_word(__u32 port, __u64 *bit)
{
	__u32 word = port / RESP_PORT_BITS;
	*bit = 1ULL << (port % RESP_PORT_BITS);
	return bpf_map_lookup_elem(&resp_ports, &word);
}

/* Keep the exported types in the object's BTF for bpf2go's -type. */
const struct event *unused_event __attribute__((unused));
const enum outcome *unused_outcome __attribute__((unused));
const enum verdict_state *unused_state __attribute__((unused));
const enum stat_index *unused_stat __attribute__((unused));
const enum config_flags *unused_config_flags __attribute__((unused));
const enum event_flags *unused_event_flags __attribute__((unused));
const struct limit *unused_limit __attribute__((unused));
const struct bulk_count *unused_bulk __attribute__((unused));
const struct probe_budget *unused_budget __attribute__((unused));
const enum override_state *unused_override_state __attribute__((unused));
const struct workload *unused_workload __attribute__((unused));
const struct connect_handoff *unused_handoff __attribute__((unused));
const enum response_flags *unused_response_flags __attribute__((unused));
const enum inflight_flags *unused_inflight_flags __attribute__((unused));
const struct rejection_key *unused_rejection_key __attribute__((unused));
const struct rejection_count *unused_rejection_count __attribute__((unused));
const enum sizes *unused_sizes __attribute__((unused));
const enum http_failure *unused_http_failure __attribute__((unused));
const enum defaults *unused_defaults __attribute__((unused));

/* count adds one to a shared counter. */
#define count(field) __sync_fetch_and_add(&(field), 1)

static __always_inline void stat_inc(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);
	if (v)
		*v += 1;
}

static __always_inline struct circuit_counters *counters_of(__u32 id)
{
	return bpf_map_lookup_elem(&counters, &id);
}

/* get_settings is the config array's one entry, or 0: every caller then
 * acts as with default settings (fail open). */
static __always_inline struct settings *get_settings(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&config, &zero);
}

/* get_handoff is this CPU's connect handoff entry, or 0. */
static __always_inline struct connect_handoff *get_handoff(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&handoff, &zero);
}

/* Wake-up flags of a record: see struct event. */
#define WAKE BPF_RB_FORCE_WAKEUP
#define LAZY 0

/* emit writes record r to the ring buffer: it wakes the reader (WAKE), or,
 * LAZY, leaves it for the next batch while the ring is between one and two
 * watermarks full. A full ring drops it (STAT_EVENTS_LOST). */
static __always_inline void emit(const struct event *r, __u32 wake)
{
	__u64 submit = BPF_RB_FORCE_WAKEUP;
	if (wake == LAZY) {
		__u64 unread = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
		if (unread < WAKE_WATERMARK || unread >= 2 * WAKE_WATERMARK)
			submit = BPF_RB_NO_WAKEUP;
	}
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		stat_inc(STAT_EVENTS_LOST);
		return;
	}
	__builtin_memcpy(e, r, sizeof(*e));
	bpf_ringbuf_submit(e, submit);
}

/* flush_answered writes circuit id's counted successes out, as one
 * OUTCOME_ANSWERED record, before a record that must come after them. The
 * count is taken out with one atomic and (another flush, or a success
 * counted meanwhile, is never lost or counted twice). It returns 0 only
 * when successes are waiting and the ring has no room for their record:
 * the caller then drops its own record too (counted lost), since written
 * alone it would be read before successes that came first. */
static __always_inline int flush_answered(__u32 id, __u64 now)
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
static __always_inline int flush_limit(const struct dest_key *k, __u64 now)
{
	struct limit *l = bpf_map_lookup_elem(&limits, k);
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
static __always_inline int flush_socket(struct sock_state *st, __u64 now)
{
	__u32 marked = (st->resp & RESP_BATCH) ? st->batch_id : ANSWERED_IDS;
	struct limit *l = bpf_map_lookup_elem(&limits, &st->dest);
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

/* ---------------------------------------------------------------------
 * Fast path: connect and sendmsg.
 */

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
 * (the token stays for the next one). */
static __always_inline enum decision take_probe(struct verdict *v, __u32 *round, __u32 *new_round)
{
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
		return take_probe(v, round, new_round);
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
};

/* note_rejection counts a rejection (or a shadow one) of the given kind
 * against the calling process's cgroup (process context: connect and
 * sendmsg run in the caller), under the rejecting verdict's circuit id and
 * epoch or the rejecting limit's slot and epoch. Reached only on a reject
 * path; an epoch of 0 (written by a daemon that does not record them)
 * records nothing. A failed insert other than a racing one (EEXIST:
 * another CPU made the entry first) means the map is full: counted, and
 * the connect is rejected all the same. */
static __always_inline void note_rejection(__u32 id, __u32 epoch, enum rejection_kind kind)
{
	if (!epoch)
		return;
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
			return;
		}
		r = bpf_map_lookup_elem(&rejections, &k);
		if (!r)
			return;
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
	}
}

/* verdict_allows applies an open, half-open or forced-open verdict. */
static __always_inline int verdict_allows(struct bpf_sock_addr *ctx, struct dest_key *key,
					  struct verdict *v, __u32 flags, __u64 now)
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

	switch (d) {
	case ALLOW_PROBE:
		if (c)
			count(c->probes);
		/* Mark the socket so its outcome is reported as a probe of
		 * its round (probes are TCP only). */
		{
			struct sock_state *st = bpf_sk_storage_get(&socks, ctx->sk, 0,
								   BPF_SK_STORAGE_GET_F_CREATE);
			if (st) {
				st->flags |= SOCK_PROBE;
				st->round = round;
			} else {
				stat_inc(STAT_STORAGE_FAILED);
			}
		}
		return 1;
	case REJECT:
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
	default:
		return 1;
	}
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

static __always_inline int enforce(struct bpf_sock_addr *ctx, struct dest_key *key)
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
	int allowed = 1;
	if (v && !verdict_allows(ctx, key, v, flags, now))
		allowed = 0;
	else if (l)
		allowed = bulkhead_admits(ctx, l, flags);
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
	return enforce(ctx, &k);
}

SEC("cgroup/connect6")
int connect6(struct bpf_sock_addr *ctx)
{
	struct dest_key k;
	key6(&k, ctx);
	return enforce(ctx, &k);
}

SEC("cgroup/sendmsg4")
int sendmsg4(struct bpf_sock_addr *ctx)
{
	struct dest_key k;
	key4(&k, ctx);
	return enforce(ctx, &k);
}

SEC("cgroup/sendmsg6")
int sendmsg6(struct bpf_sock_addr *ctx)
{
	struct dest_key k;
	key6(&k, ctx);
	return enforce(ctx, &k);
}

/* ---------------------------------------------------------------------
 * Outcomes: sockops on the same cgroup.
 */

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

static __always_inline __u8 probe_flag(struct sock_state *st)
{
	return (st && (st->flags & SOCK_PROBE)) ? EVENT_PROBE : 0;
}

/* report writes record r of a socket sockops follows: r holds what
 * happened (outcome, flags, duration_ns, count, err; ts_ns is now), report
 * adds whose it is (dest, cookie, cgroup, and the probe flag and round of
 * a probe). */
static __always_inline void report(struct bpf_sock_ops *ops, struct sock_state *st,
				   struct sock *sk, struct event *r, __u32 wake)
{
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
			return;
		}
	}
	r->flags |= probe_flag(st);
	r->round = st ? st->round : 0;
	r->cookie = bpf_get_socket_cookie(ops);
	r->dest = k;
	r->cgroup_id = cg;
	emit(r, wake);
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
	report(ops, st, sk,
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
			report(ops, st, sk,
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
			report(ops, st, sk,
			       &(struct event){.outcome = OUTCOME_STALLED,
					       .duration_ns = st->start_ns ? now - st->start_ns : 0,
					       .count = st->rtos,
					       .ts_ns = now},
			       WAKE);
		}
	}
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
static __always_inline void no_response(struct sock_state *st, __u64 cookie, __u32 err, __u8 flags,
					__u64 now)
{
	st->phase = PHASE_IDLE;
	if (!flush_socket(st, now)) {
		stat_inc(STAT_EVENTS_LOST);
		return;
	}
	emit(&(struct event){.dest = st->dest,
			     .outcome = OUTCOME_NO_RESPONSE,
			     .flags = flags | turn_probe_flag(st),
			     .err = (__u16)err,
			     .count = st->turn,
			     .round = st->round,
			     .duration_ns = now - st->req_ns,
			     .cookie = cookie,
			     .cgroup_id = st->cgroup_id,
			     .ts_ns = now},
	     WAKE);
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
		report(ops, st, sk,
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

/* ---------------------------------------------------------------------
 * Responses: cgroup_skb on the same cgroup, attached only while some
 * target has response options (slow_response_duration, response_timeout,
 * protocol: http). Every packet of the cgroup's sockets passes them; a
 * socket to a port of no marked destination leaves after one array load
 * (resp_ports), and one connect did not mark (st->resp) after one storage
 * lookup.
 *
 * A turn is one request and its response, without parsing the protocol:
 * it begins with the first new byte the socket sends while no turn awaits
 * its response, and its response begins with the first new byte received
 * after it. Retransmissions (data the socket already sent, data it had
 * already received when the request left) begin nothing. Pipelined
 * requests sent before their first response byte are one turn.
 */

/* A TCP segment's sequence number, ack, and where and how long its payload
 * is, read from the packet (cgroup_skb sees it from the IP header on). */
struct segment {
	__u32 seq;
	__u32 ack;
	__u32 off; /* payload offset from the IP header */
	__u32 len; /* payload bytes (0: none, a FIN's) */
	__u32 fin; /* the FIN flag */
};

/* What tcp_segment reads of the IP and TCP headers: byte offsets, and the
 * fields packed into a byte. */
#define IP_VERSION(b) ((b) >> 4) /* the first byte's upper half, in either family */
#define IPV4_IHL(b) (((b) & 0xf) * 4) /* the first byte's lower half: header bytes / 4 */
#define IPV4_HLEN 20                  /* an IPv4 header without options */
#define IPV4_FRAG_OFF 6               /* flags and fragment offset (16 bits) */
#define IP_MF_OFFSET 0x3fff           /* ... the more-fragments flag and the offset */
#define IPV4_PROTOCOL 9
#define IPV6_HLEN 40
#define IPV6_NEXTHDR 6
#define TCP_SEQ 4
#define TCP_ACK_SEQ 8
#define TCP_DOFF 12 /* upper half: the TCP header's length / 4 */
#define TCP_DOFF_BYTES(b) (((b) >> 4) * 4)
#define TCP_FLAGS 13
#define TCP_HEAD 14 /* the TCP header's bytes read: through its flags */

static __always_inline __u32 be16_at(const __u8 *p)
{
	return (__u32)p[0] << 8 | p[1];
}

static __always_inline __u32 be32_at(const __u8 *p)
{
	return (__u32)p[0] << 24 | (__u32)p[1] << 16 | (__u32)p[2] << 8 | p[3];
}

/* tcp_segment reads the headers with as few loads as it can: the first 34
 * bytes hold an IPv4 header without options and the TCP header's first 14
 * (IPV4_HLEN + TCP_HEAD), or the start of an IPv6 header, whose TCP header
 * a second load reads (a TCP packet of either family is at least 40 bytes
 * long). Only an IPv4 header with options needs a second load too. */
static __always_inline int tcp_segment(struct __sk_buff *skb, struct segment *s)
{
	__u8 h[IPV4_HLEN + TCP_HEAD];
	__u8 th6[TCP_HEAD];
	const __u8 *th;
	__u32 iplen;
	if (bpf_skb_load_bytes(skb, 0, h, sizeof(h)))
		return 0;
	if (IP_VERSION(h[0]) == 4) {
		if (h[IPV4_PROTOCOL] != IPPROTO_TCP || (be16_at(&h[IPV4_FRAG_OFF]) & IP_MF_OFFSET))
			return 0;
		iplen = IPV4_IHL(h[0]);
		if (iplen == IPV4_HLEN) {
			th = &h[IPV4_HLEN];
		} else {
			if (iplen < IPV4_HLEN || bpf_skb_load_bytes(skb, iplen, th6, sizeof(th6)))
				return 0;
			th = th6;
		}
	} else if (IP_VERSION(h[0]) == 6) {
		if (h[IPV6_NEXTHDR] != IPPROTO_TCP)
			return 0; /* extension headers: not followed */
		iplen = IPV6_HLEN;
		if (bpf_skb_load_bytes(skb, iplen, th6, sizeof(th6)))
			return 0;
		th = th6;
	} else {
		return 0;
	}
	if (th[TCP_FLAGS] & (TCP_FLAG_SYN | TCP_FLAG_RST))
		return 0;
	__u32 off = iplen + TCP_DOFF_BYTES(th[TCP_DOFF]);
	s->fin = th[TCP_FLAGS] & TCP_FLAG_FIN;
	if (skb->len <= off && !s->fin)
		return 0;
	s->seq = be32_at(&th[TCP_SEQ]);
	s->ack = be32_at(&th[TCP_ACK_SEQ]);
	s->off = off;
	s->len = skb->len > off ? skb->len - off : 0;
	return 1;
}

/* followed is the storage of a socket whose responses are followed, or 0:
 * the whole cost of every other packet (for a socket to a port of no marked
 * destination, one inlined array load). */
static __always_inline struct sock_state *followed(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return 0;
	__u64 bit;
	__u64 *bits = resp_port_word(bpf_ntohs(sk->dst_port), &bit);
	if (!bits || !(*bits & bit))
		return 0;
	/* No bpf_sk_fullsock first: the storage helper takes the socket as
	 * it is and finds nothing on a request or time-wait socket. */
	struct sock_state *st = bpf_sk_storage_get(&socks, sk, 0, 0);
	if (!st || !st->resp || !(st->flags & SOCK_TRACKED))
		return 0;
	return st;
}

SEC("cgroup_skb/egress")
int resp_egress(struct __sk_buff *skb)
{
	struct sock_state *st = followed(skb);
	if (!st)
		return 1;
	struct segment s;
	if (!tcp_segment(skb, &s) || !s.len)
		return 1;
	__u32 end = s.seq + s.len;
	if ((st->seq & SEQ_SND) && (__s32)(end - st->snd_end) <= 0)
		return 1; /* a retransmission */
	st->snd_end = end;
	st->seq |= SEQ_SND;
	if (st->phase & PHASE_AWAITING)
		return 1; /* more of the request (or a pipelined one); or upgraded */
	__u64 now = bpf_ktime_get_ns();
	st->phase = PHASE_AWAITING;
	st->turn += 1;
	st->req_ns = now;
	st->head_len = 0;
	st->rcv_end = s.ack; /* what was received before this request */
	if (st->resp & RESP_INFLIGHT) {
		__u64 cookie = bpf_get_socket_cookie(skb);
		struct inflight_turn *f = bpf_map_lookup_elem(&inflight, &cookie);
		__u32 probe = (st->turn == 1 && (st->flags & SOCK_PROBE)) ? INFLIGHT_PROBE : 0;
		if (f) {
			f->turn = st->turn;
			f->round = st->round;
			f->flags = probe;
			f->req_ns = now;
		} else {
			struct inflight_turn n = {.turn = st->turn, .round = st->round, .flags = probe,
						  .req_ns = now, .cgroup_id = st->cgroup_id};
			__builtin_memcpy(&n.dest, &st->dest, sizeof(n.dest));
			bpf_map_update_elem(&inflight, &cookie, &n, BPF_NOEXIST);
		}
	}
	return 1;
}

/* inflight_arm sets the socket's inflight entry's request start: the
 * request's own after a 1xx (response_timeout runs to the final status),
 * 0 at the final status's first byte (or when the turn ends unanswered). */
static __always_inline void inflight_arm(struct sock_state *st, __u64 cookie, __u64 req_ns)
{
	if (!(st->resp & RESP_INFLIGHT))
		return;
	struct inflight_turn *f = bpf_map_lookup_elem(&inflight, &cookie);
	if (f)
		f->req_ns = req_ns;
}

/* peer_closed reports a request the peer closed the connection on before
 * any byte of its answer (no_response, EVENT_PEER_CLOSED). */
static __always_inline void peer_closed(struct __sk_buff *skb, struct sock_state *st)
{
	__u64 now = bpf_ktime_get_ns();
	__u64 cookie = bpf_get_socket_cookie(skb);
	no_response(st, cookie, 0, EVENT_PEER_CLOSED, now);
	inflight_arm(st, cookie, 0);
}

#define STATUS_LINE 12 /* "HTTP/1.1 503" */
_Static_assert(STATUS_LINE <= HEAD_BYTES, "sock_state.head holds a status line's start");

#define HTTP_CONTINUE 100 /* the first informational (1xx) status */
#define HTTP_SWITCHING_PROTOCOLS 101

/* http_1xx reports whether status is informational (0, no status, is not). */
static __always_inline int http_1xx(__u32 status)
{
	return status - HTTP_CONTINUE < 100;
}

/* http_status parses the status line's start: "HTTP/1.x NNN" (0: not one). */
static __always_inline __u32 http_status(const __u8 *h)
{
	if (h[0] != 'H' || h[1] != 'T' || h[2] != 'T' || h[3] != 'P' || h[4] != '/' || h[5] != '1' ||
	    h[6] != '.' || h[8] != ' ')
		return 0;
	__u32 d0 = h[9] - '0', d1 = h[10] - '0', d2 = h[11] - '0';
	if (d0 < 1 || d0 > 5 || d1 > 9 || d2 > 9)
		return 0;
	return d0 * 100 + d1 * 10 + d2;
}

/* ---------------------------------------------------------------------
 * Informational responses. A 1xx (100 Continue, 103 Early Hints) is not
 * the response: the status that counts is the turn's first status that is
 * not 1xx. 101 Switching Protocols is final (the connection leaves HTTP):
 * it is the turn's response, counted by its status (a success unless
 * failure_statuses lists 101), and the socket begins no more turns
 * (PHASE_UPGRADED). After any other 1xx the turn keeps awaiting: its header
 * block is scanned for its end (a blank line, CRLF or bare LF lines, split
 * across segments or not), and the next status line is read from there.
 * Only a 1xx leads here; a final status costs one comparison more.
 * Segments are read in the order they arrive, as status lines are: one
 * that arrives ahead of a lost one is scanned as if it followed on.
 */

#define SCAN_CHUNK 16 /* bytes a scan step loads at once */
#define SCAN_CHUNKS 16 /* loads of one info_scan call (256 bytes) */
#define SCAN_CALLS 16 /* info_scan calls per header block in one segment (4 KiB) */
#define INFO_MAX 4 /* status lines read after a 1xx in one segment */
#define INFO_FOUND (1 << 30) /* info_scan: the blank line was found */
#define INFO_FINAL_NOT_HTTP 1000 /* the bytes after a 1xx are no status line */

/* info_next is the scan's step: indexed by the scan state << 8 | a byte,
 * the next state, or INFO_END when the byte ends the blank line. A table,
 * so a step is two loads and no branch the verifier would follow once per
 * state. (Read-only and never set from Go: a constant.) */
#define INFO_END 0x80
volatile const __u8 info_next[4 << 8] = {
	[INFO_MID << 8 | '\n'] = INFO_LF,
	[INFO_LF << 8 | '\n'] = INFO_END,
	[INFO_LF << 8 | '\r'] = INFO_LFCR,
	[INFO_LFCR << 8 | '\n'] = INFO_END,
};

/* info_byte feeds one byte to the scan for a 1xx header block's end: it
 * returns 1 when the byte ends the blank line, else moves *k on. */
static __always_inline int info_byte(__u8 ch, __u32 *k)
{
	__u64 i = (__u64)(*k & INFO_STATE) << 8 | ch;
	/* Bounded again after a barrier: 6.1's verifier loses the bounds of
	 * an OR (which the compiler makes of this add too), and the compiler
	 * would drop a mask it can prove redundant. */
	asm volatile("" : "+r"(i));
	i &= sizeof(info_next) - 1;
	__u8 next = info_next[i];
	*k = next & INFO_STATE;
	return next & INFO_END;
}

/* info_scan scans a segment's bytes from packet offset pos to end for the
 * blank line that ends a 1xx header block, from scan state state (enum
 * info_state): SCAN_CHUNK bytes a load, at most SCAN_CHUNKS loads, then
 * what is left of the segment (less than a chunk) byte by byte. It
 * returns INFO_FOUND | the offset after the blank line << 2, or the
 * offset it reached << 2 | the scan state there. A global function, so
 * the verifier checks its loop once, not at every call; a bounded loop
 * rather than bpf_loop, which needs Linux 5.17. */
__attribute__((noinline)) int info_scan(struct __sk_buff *skb, __u32 pos, __u32 end, __u32 state)
{
	__u32 k = state & INFO_STATE;
	if (!skb || pos > end)
		return (int)((end << 2) | k);
	for (int i = 0; i < SCAN_CHUNKS; i++) {
		if (end - pos < SCAN_CHUNK)
			break;
		__u8 b[SCAN_CHUNK];
		if (bpf_skb_load_bytes(skb, pos, b, SCAN_CHUNK))
			return (int)((end << 2) | k); /* not within the packet: give the segment up */
#pragma unroll
		for (int j = 0; j < SCAN_CHUNK; j++)
			if (info_byte(b[j], &k))
				return (int)(INFO_FOUND | ((pos + j + 1) << 2));
		pos += SCAN_CHUNK;
	}
	if (end - pos >= SCAN_CHUNK)
		return (int)((pos << 2) | k); /* SCAN_CHUNKS loads: the caller calls again */
	__u32 n = end - pos;
#pragma unroll
	for (int j = 0; j < SCAN_CHUNK - 1; j++) {
		__u8 ch;
		if ((__u32)j < n && !bpf_skb_load_bytes(skb, pos + j, &ch, 1) && info_byte(ch, &k))
			return (int)(INFO_FOUND | ((pos + j + 1) << 2));
	}
	return (int)((end << 2) | k);
}

/* informational reads a segment on from pos, in a 1xx header block
 * (st->head_len holds HEAD_INFO and the scan state): past the block's end,
 * the next status line, and so on. seq is pos's sequence number. It
 * returns the final status (INFO_FINAL_NOT_HTTP when the bytes there are
 * no status line), or 0 when the segment ends first: the next one goes on
 * from st (st->rcv_end is past what was read). */
static __always_inline __u32 informational(struct __sk_buff *skb, struct sock_state *st, __u32 pos,
					   __u32 seq, __u64 now, __u64 cookie)
{
	__u32 end = skb->len;
	__u32 seq_end = seq + (end - pos);
	for (int r = 0; r < INFO_MAX; r++) {
		if (st->head_len >= HEAD_INFO) {
			__u32 got = st->head_len & INFO_STATE;
			for (int c = 0; c < SCAN_CALLS; c++) {
				got = (__u32)info_scan(skb, pos, end, got);
				pos = (got & ~INFO_FOUND) >> 2;
				if ((got & INFO_FOUND) || pos >= end)
					break;
			}
			if (!(got & INFO_FOUND)) {
				st->head_len = HEAD_INFO | (__u8)(got & INFO_STATE);
				break;
			}
			st->head_len = 0;
			if (pos >= end)
				break; /* the next status line starts in the next segment */
		}
		/* The final status's first byte (unless it is a 1xx again). */
		st->first_ns = now;
		inflight_arm(st, cookie, 0);
		__u32 n = end - pos;
		if (n >= STATUS_LINE) {
			if (bpf_skb_load_bytes(skb, pos, st->head, STATUS_LINE))
				break;
			n = STATUS_LINE;
		} else {
#pragma unroll
			for (int i = 0; i < STATUS_LINE; i++)
				if ((__u32)i < n && bpf_skb_load_bytes(skb, pos + i, &st->head[i & (HEAD_BYTES - 1)], 1))
					return 0;
		}
		st->head_len = (__u8)n;
		if (n < STATUS_LINE)
			break; /* the status line goes on in the next segment */
		__u32 status = http_status(st->head);
		if (!http_1xx(status) || status == HTTP_SWITCHING_PROTOCOLS) {
			st->rcv_end = seq_end - (end - pos - STATUS_LINE);
			return status ? status : INFO_FINAL_NOT_HTTP;
		}
		/* Another 1xx. */
		st->head_len = HEAD_INFO | INFO_MID;
		inflight_arm(st, cookie, st->req_ns);
		pos += STATUS_LINE;
	}
	/* A segment with more than INFO_MAX status lines after a 1xx, or more
	 * than SCAN_CALLS calls' bytes of a header block, leaves the rest of
	 * it unread, scanned as if the next segment followed on. */
	st->rcv_end = seq_end;
	return 0;
}

SEC("cgroup_skb/ingress")
int resp_ingress(struct __sk_buff *skb)
{
	struct sock_state *st = followed(skb);
	if (!st || st->phase != PHASE_AWAITING)
		return 1; /* in a response, or no request: nothing to read */
	struct segment s;
	if (!tcp_segment(skb, &s))
		return 1;
	if (!s.len) {
		/* A FIN while the request awaits its first byte: the peer
		 * closed without answering (before any byte of the status line,
		 * or after an informational response). */
		if ((st->head_len == 0 || st->head_len >= HEAD_INFO) && (__s32)(s.seq - st->rcv_end) >= 0)
			peer_closed(skb, st);
		return 1;
	}
	__u32 skip = 0;
	__s32 old = (__s32)(st->rcv_end - s.seq);
	if (old > 0) {
		if ((__u32)old >= s.len)
			return 1; /* received before the request */
		skip = (__u32)old;
	}
	__u64 now = bpf_ktime_get_ns();
	__u64 cookie = bpf_get_socket_cookie(skb);
	if (st->head_len == 0) {
		st->first_ns = now;
		inflight_arm(st, cookie, 0);
	}
	__u32 status = 0;
	__u8 flags = 0;
	__u8 phase = PHASE_RESPONDING;
	if (st->resp & RESP_HTTP) {
		/* Collect the status line's first 12 bytes, across segments. */
		__u32 have = st->head_len;
		__u32 pos = s.off + skip;
		if (have < STATUS_LINE) {
			__u32 n = s.len - skip;
			if (n > STATUS_LINE - have)
				n = STATUS_LINE - have;
			if (have == 0 && n == STATUS_LINE) {
				/* The usual case: the whole status line's start in
				 * this segment, one load of constant size. */
				if (bpf_skb_load_bytes(skb, pos, st->head, STATUS_LINE))
					return 1;
			} else {
				/* Split across segments: byte by byte (a load of
				 * variable size loses its bounds on 6.1's verifier). */
#pragma unroll
				for (int i = 0; i < STATUS_LINE; i++)
					if ((__u32)i < n &&
					    bpf_skb_load_bytes(skb, pos + i, &st->head[(have + i) & (HEAD_BYTES - 1)], 1))
						return 1;
			}
			st->head_len = (__u8)(have + n);
			st->rcv_end = s.seq + skip + n;
			if (have + n < STATUS_LINE)
				return 1; /* the status line goes on in the next segment */
			status = http_status(st->head);
			if (http_1xx(status)) {
				if (status == HTTP_SWITCHING_PROTOCOLS) {
					phase = PHASE_UPGRADED;
				} else {
					/* Informational: read on to the final status. */
					st->head_len = HEAD_INFO | INFO_MID;
					inflight_arm(st, cookie, st->req_ns);
					pos += n;
					have = HEAD_INFO;
				}
			}
		} else if (have < HEAD_INFO) {
			return 1;
		}
		if (have >= HEAD_INFO) {
			/* After a 1xx, in this segment or an earlier one. */
			status = informational(skb, st, pos, s.seq + (pos - s.off), now, cookie);
			if (!status)
				return 1;
			if (status == HTTP_SWITCHING_PROTOCOLS)
				phase = PHASE_UPGRADED;
			else if (status == INFO_FINAL_NOT_HTTP)
				status = 0;
		}
		if (status)
			flags |= EVENT_HTTP;
	}
	st->phase = phase;
	flags |= turn_probe_flag(st);
	__u64 took = st->first_ns - st->req_ns;
	/* An ordinary success of a circuit that counts them (RESP_BATCH: the
	 * default failure statuses) is one atomic add, no record: not a
	 * probe's, not a default failure status, faster than the target's
	 * slow_response_duration and response_timeout. */
	if ((st->resp & RESP_BATCH) && !(flags & EVENT_PROBE) && !http_default_failure(status) &&
	    (!st->fast_us || took < (__u64)st->fast_us * 1000) && answered_add(st))
		return 1;
	if (!flush_socket(st, now)) {
		stat_inc(STAT_EVENTS_LOST);
		return 1;
	}
	__u32 wake = LAZY;
	/* The default failure statuses (5xx, 429) and probes wake the daemon;
	 * other responses, a custom list's failures among them, are read
	 * with the next batch (at most a tick later). */
	if ((flags & EVENT_PROBE) || http_default_failure(status)) {
		wake = WAKE;
	} else {
		struct settings *c = get_settings();
		if (c && c->wake_slow_ns && took >= c->wake_slow_ns)
			wake = WAKE;
	}
	emit(&(struct event){.dest = st->dest,
			     .outcome = OUTCOME_RESPONSE,
			     .flags = flags,
			     .err = (__u16)status,
			     .count = st->turn,
			     .round = st->round,
			     .duration_ns = took,
			     .cookie = cookie,
			     .cgroup_id = st->cgroup_id,
			     .ts_ns = st->first_ns},
	     wake);
	return 1;
}

/* answered_flush writes out the counted successes of the circuit ids in
 * its packet (after ANSWERED_FLUSH_HEADER bytes, an Ethernet header: up to
 * ANSWERED_FLUSH_IDS little-endian 32-bit ids), each as one
 * OUTCOME_ANSWERED record. The
 * daemon runs it (BPF_PROG_TEST_RUN, never attached) every tick for the
 * circuits whose word holds a count: successes of a circuit that went
 * quiet reach it through the ring too, in their order. */

SEC("tc")
int answered_flush(struct __sk_buff *skb)
{
	__u64 now = bpf_ktime_get_ns();
	for (int i = 0; i < ANSWERED_FLUSH_IDS; i++) {
		__u32 id;
		if (bpf_skb_load_bytes(skb, ANSWERED_FLUSH_HEADER + i * sizeof(id), &id, sizeof(id)))
			break;
		flush_answered(id, now);
	}
	return 0;
}
