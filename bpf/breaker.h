/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * breakerd's kernel/user contract: every struct the kernel programs share
 * with the Go daemon. Layouts are explicit (no implicit padding; clang's
 * -Wpadded is on) and bpf2go exports them to Go with -type, so the Go mirror
 * is generated from this file's BTF, never written by hand.
 */
#ifndef BREAKER_H
#define BREAKER_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_endian.h>

/* Changing any struct or map below is a new layout: bump the layout version
 * in maps/ (it is part of the pin directory), so a new release never reuses
 * an incompatible pinned map. */

/* Destination of a connection. IPv4 is stored IPv4-mapped (::ffff:a.b.c.d),
 * so an IPv4 socket and a dual-stack IPv6 socket reaching the same host
 * share a key (and so a circuit). The family is implied by the address.
 * class is the workload class of the connecting process (the value of its
 * cgroup in the workloads map; 0, the shared class, when no workloads are
 * configured), so an isolated workload's circuits and bulkheads are
 * entries of their own. */
struct dest_key {
	__u8 addr[16];
	__u16 port; /* network byte order */
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 class; /* workload class */
};

/* dest_ipv6 sets k's address from its four 32-bit words (network order). */
static __always_inline void dest_ipv6(struct dest_key *k, __u32 w0, __u32 w1, __u32 w2, __u32 w3)
{
	__u32 w[4] = {w0, w1, w2, w3};
	__builtin_memcpy(k->addr, w, sizeof(w));
}

/* dest_ipv4 sets k's address to IPv4 address ip (network order), mapped:
 * ::ffff:a.b.c.d. */
static __always_inline void dest_ipv4(struct dest_key *k, __u32 ip)
{
	dest_ipv6(k, 0, 0, bpf_htonl(0xffff), ip);
}

/* Value of the origins socket storage (bpf/maps.h): the address a
 * redirected socket asked for (orig) and the fallback it was sent to
 * instead (via). getpeername4/6 and recvmsg4/6 show the application orig
 * where the kernel has via; the close pass of a circuit that closes
 * (destroy.c) finds by it the sockets still on the fallback. One pair per
 * socket (the last redirect of an unconnected UDP socket). */
struct origin {
	__u8 orig[16]; /* IPv4-mapped for IPv4, as in struct dest_key */
	__u8 via[16];
	__u16 orig_port; /* network byte order */
	__u16 via_port;
	__u32 _pad;
};

/* Value of the workloads map (key: cgroup id), written by the daemon for
 * every cgroup of a workload and removed with the cgroup. With
 * CONFIG_SCOPED set, a process whose cgroup has no entry is not protected:
 * never rejected, never counted, its outcomes not reported; with only
 * CONFIG_CLASSES, it is protected in class 0. */
struct workload {
	__u32 class;    /* the dest_key class of its connections (verdicts, records) */
	__u32 bulkhead; /* the dest_key class its bulkhead limits are looked up
			 * with: the workload's own, also when it shares circuits */
};

/* The one-entry per-CPU handoff from connect4/6 to sockops' connect
 * callback, which follows it in the same connect() call: who connects and
 * its workload class (plus one; 0: not protected). Where sockops can read
 * the current thread (has_sockops_current), cookie alone holds both: the
 * thread id in its upper half, the class in its lower (handoff_thread());
 * else cookie is the socket's cookie and class1 the class. */
struct connect_handoff {
	__u64 cookie;
	__u32 class1;
	__u32 _pad;
};

/* Verdict states. A destination whose circuit is closed has no entry. */
enum verdict_state {
	VERDICT_OPEN = 1,        /* reject until due_ns, then admit the round's probes */
	VERDICT_RAMP = 2,        /* closed after recovery (slow start): admit a share of new
				  * TCP connects rising from due_ns over ramp_ns, then all */
	VERDICT_FORCED_OPEN = 3, /* reject, never probe */
};

/* Slow start: a VERDICT_RAMP verdict's curve has RAMP_POINTS samples,
 * ramp[i] the share admitted at i/RAMP_POINTS of the ramp in 1/RAMP_UNIT
 * (ramp[0] is the floor); the kernel interpolates between them and
 * towards RAMP_UNIT (all) at the end. */
enum ramp {
	RAMP_POINTS = 8,
	RAMP_UNIT = 256,
};

/* Value of the verdicts map, written by the daemon only. An open entry
 * rejects until due_ns; from then on its circuit is half-open and the
 * kernel admits up to `probes` TCP connections of round `round`, taking
 * them from the circuit's probe_budget (one budget per circuit, however
 * many destinations its verdicts cover). A new round is the daemon
 * writing a higher round number. */
struct verdict {
	__u64 due_ns;       /* bpf_ktime_get_ns() from which the circuit probes */
	__u32 state;        /* enum verdict_state */
	__u32 round;        /* the half-open round this verdict admits probes of */
	__u32 probes;       /* tokens per round (half_open_probes) */
	__u32 circuit_id;   /* index into the counters and probe_budgets maps */
	__u16 reject_errno; /* errno a rejected connect sees (with bpf_set_retval) */
	__u16 _pad0;
	__u32 epoch; /* which circuit holds circuit_id now: keys its rejections
		      * (0: none recorded) */
	/* VERDICT_RAMP only (0 otherwise): due_ns is when the ramp began,
	 * ramp_ns its length, ramp the curve (enum ramp); reject_errno is the
	 * overload errno of the connects it turns away. Past due_ns + ramp_ns
	 * the verdict admits everything, until the daemon deletes it. */
	__u64 ramp_ns;
	__u8 ramp[RAMP_POINTS];
};

/* Value of the fallbacks map (key: a circuit id), written by the daemon
 * for a circuit whose target names a fallback: while the circuit's verdict
 * rejects a connect or a send, connect4/6 and sendmsg4/6 send it here
 * instead, unless the fallback's own verdict rejects it too. The entry
 * counts only for a verdict of the same epoch, so an entry left by an
 * earlier holder of the id is never followed. Its own map, not a field of
 * struct verdict: a healthy connect never reads it. */
struct fallback {
	__u8 addr[16]; /* IPv4 stored IPv4-mapped, as in struct dest_key */
	__u16 port;    /* network byte order */
	__u8 proto;    /* IPPROTO_TCP or IPPROTO_UDP: only connects of it are
			* redirected (0: either); the fallback is reached with
			* the connect's own protocol */
	__u8 _pad0;
	__u32 epoch;   /* the circuit's verdict epoch (never 0) */
};

/* Value of the probe_budgets array, indexed by circuit id, written by the
 * kernel only: the circuit's current round and the probe tokens left in
 * it, in one word, so a token is taken with one compare-and-exchange that
 * also checks the round (a taker can never take from, or give back to,
 * another round than the one it read). */
struct probe_budget {
	__u64 word; /* round << 32 | tokens left */
};

/* Key and value of the overrides map: a circuit's override set through the
 * admin API, by circuit name, kept so it survives a restart. Only the
 * daemon reads and writes it; no program looks at it. */
struct override_key {
	char name[128]; /* the circuit's name, NUL-padded */
};

enum override_state {
	OVERRIDE_FORCED_OPEN = 1,
	OVERRIDE_FORCED_CLOSED = 2,
	OVERRIDE_DISABLED = 3,
};

struct override {
	__u32 state; /* enum override_state */
	__u32 _pad;
};

/* Global settings, one entry in the config array. */
enum config_flags {
	CONFIG_SHADOW = 1 << 0, /* count what would be rejected, reject nothing */
	CONFIG_LIMITS = 1 << 1, /* the limits map has entries: look them up */
	CONFIG_UDP = 1 << 2,    /* a target covers UDP: look UDP destinations up */
	CONFIG_SCOPED = 1 << 3, /* only cgroups in the workloads map are protected */
	CONFIG_CLASSES = 1 << 4, /* the workloads map classes some cgroups; the others
				  * are protected in class 0 (without CONFIG_SCOPED) */
	CONFIG_RESET_TRACE = 1 << 5, /* reset_seen is attached (set by the loader, not
				      * the daemon): sockops leaves an established
				      * socket without storage to it (see on_established) */
};

struct settings {
	__u64 heartbeat_ns; /* last daemon heartbeat, bpf_ktime_get_ns() clock */
	__u64 failsafe_ns;  /* verdicts are ignored when the heartbeat is older */
	__u32 flags;        /* enum config_flags */
	__u32 max_rto;      /* RTOs on an established socket that make it stalled */
	__u64 wake_slow_ns; /* an established record whose handshake took this long
			     * wakes the daemon at once (0: never); the others are
			     * read in batches */
	__u64 attach_cgroup_id; /* the protected cgroup (set by the loader, not the
				 * daemon): reset_seen, which sees every socket of the
				 * machine, keeps those made at or below it (0: all) */
	__u64 verdict_mask; /* bit verdict_bucket(key) is set while the verdicts
			     * map may hold an entry under it (set before such an
			     * entry is written, cleared after the last one under it
			     * is deleted; written by maps/, not the daemon's
			     * settings): a connect or send whose bit is clear skips
			     * the verdict lookup */
};

/* verdict_bucket is the bit of settings.verdict_mask that stands for
 * destination k: its five 32-bit words (little-endian) folded with xor,
 * multiplied by 2^32 / phi, top six bits. maps.verdictBucket computes the
 * same. */
_Static_assert(sizeof(struct dest_key) == 20, "verdict_bucket folds five words");

static __always_inline __u32 verdict_bucket(const struct dest_key *k)
{
	__u32 w[5];
	__builtin_memcpy(w, k, sizeof(w));
	__u32 h = w[0] ^ w[1] ^ w[2] ^ w[3] ^ w[4];
	return (h * 0x9E3779B1U) >> 26;
}

/* Per-circuit counters, one shared entry per circuit id, atomic adds. */
struct circuit_counters {
	__u64 rejected;        /* connects/sends turned away */
	__u64 shadow_rejected; /* would have been turned away (shadow mode) */
	__u64 probes;          /* half-open probes admitted */
	__u64 rounds;          /* half-open rounds begun */
	__u64 bulkhead_rejected; /* connects turned away by a concurrency limit */
	__u64 slow_start_rejected; /* connects turned away by a slow-start ramp */
	__u64 ramp_credit; /* a ramp's running sum of shares (see ramp_admits) */
};

/* Key of the rejections map: the cgroup a circuit or a bulkhead turned a
 * connect or a send away from. circuit_id and epoch come from the
 * rejecting verdict (open, half-open or a slow-start ramp), or from the
 * rejecting limit (its slot and epoch: a circuit's own slot is its
 * circuit id, and its limits carry the epoch its verdicts do, so every
 * kind of one circuit shares an entry; a sharing workload's bulkhead slot
 * has an epoch of its own). The epoch tells apart two holders of the same
 * id one after the other, so a reused id never inherits another circuit's
 * entries. */
struct rejection_key {
	__u64 cgroup_id; /* the rejected process's current cgroup */
	__u32 circuit_id;
	__u32 epoch;
};

/* Value of the rejections map, written by the kernel on the reject paths
 * only (atomic adds); the daemon deletes entries of gone cgroups and
 * circuits. An open circuit's rejections, a bulkhead's and a slow-start
 * ramp's are counted apart, each with its shadow-mode count beside it. */
struct rejection_count {
	__u64 rejected;        /* turned away by an open circuit */
	__u64 shadow_rejected; /* would have been turned away by it (shadow mode) */
	__u64 bulkhead_rejected;        /* turned away by a concurrency limit */
	__u64 bulkhead_shadow_rejected; /* would have been turned away by one (shadow mode) */
	__u64 slow_start_rejected;        /* turned away by a slow-start ramp */
	__u64 slow_start_shadow_rejected; /* would have been turned away by one (shadow mode) */
};

/* Concurrency limits of one destination (bulkheads), value of the limits
 * map. slot indexes the bulk counts; destinations of one service-scoped
 * target share a slot. A limit of 0 is off. */
struct limit {
	__u32 slot;
	__u32 max_connections; /* connecting + established sockets */
	__u32 max_connecting;  /* sockets in SYN_SENT */
	__u16 reject_errno;    /* errno a connect over the limit sees */
	__u16 responses;       /* enum response_flags: follow this destination's responses */
	__u32 epoch; /* which holder of slot this is: keys the cgroups the limit
		      * turns away in the rejections map (0: none recorded) */
	/* RESP_BATCH (see the answered map): */
	__u32 batch_id;    /* the circuit id whose answered word counts the successes */
	__u32 batch_epoch; /* the word's epoch they count under (never 0) */
	__u32 fast_us;     /* a response this slow or slower (microseconds) is
			    * recorded, not counted (0: none is too slow) */
};

/* What connect marks a socket to a destination with response options for
 * (limit.responses; an entry with both limits 0 only marks). The
 * cgroup_skb programs follow such sockets' request/response turns. */
enum response_flags {
	RESP_TIMED = 1 << 0,    /* time each turn: first request byte to first response byte */
	RESP_HTTP = 1 << 1,     /* read the HTTP/1.x status line at the start of each response */
	RESP_INFLIGHT = 1 << 2, /* keep the socket's turn in the inflight map (response_timeout) */
	RESP_BATCH = 1 << 3,    /* count an ordinary success in the circuit's answered
				 * word instead of writing its record */
};

/* The sizes the daemon shares with these programs: map capacities and the
 * bounds of what it hands them. Go checks its own constants against these
 * through the generated bindings (bpf2go -type sizes; maps'
 * TestSizesMatchTheKernel), so neither side copies the other's numbers
 * unchecked. */
enum sizes {
	MAX_DESTINATIONS = 1 << 18,     /* verdicts, limits: destinations */
	MAX_CIRCUIT_IDS = 1 << 18,      /* counters, probe_budgets, bulk: circuit ids */
	MAX_OVERRIDES = 4096,           /* overrides: circuit names */
	MAX_WORKLOAD_CGROUPS = 1 << 16, /* workloads: cgroups (the daemon may make it larger) */
	MAX_INFLIGHT = 1 << 16,         /* inflight: sockets awaiting a response */
	MAX_REJECTIONS = 1 << 15,       /* rejections: (cgroup, circuit) pairs */
	MAX_FALLBACKS = 1 << 14,        /* fallbacks: rejecting circuits with a fallback */
	ANSWERED_IDS = 1 << 16,         /* answered: circuit ids below it count successes */
	ANSWERED_SHIFT = 40,            /* answered: a word's count bits, below its epoch */
	ANSWERED_FLUSH_IDS = 64,        /* answered_flush: ids one run takes */
	ANSWERED_FLUSH_HEADER = 14,     /* answered_flush: bytes before the ids (an Ethernet
					 * header, which BPF_PROG_TEST_RUN of a tc program
					 * requires) */
	RESP_PORT_WORDS = 65536 / 64,   /* resp_ports: a bit per port, 64 to a word */
	EVENTS_SIZE = 1 << 22,          /* events: ring buffer bytes (4 MiB: 65536 records) */
};

/* The settings' defaults where the daemon leaves a field 0; each is also
 * policy's default (policy's TestKernelDefaults checks them through the
 * generated bindings). */
enum defaults {
	DEFAULT_MAX_RTO = 3, /* settings.max_rto: RTOs that make an established socket stalled */
};

/* The HTTP statuses the kernel itself treats as failures: policy's default
 * failure_statuses, 5xx and 429 (policy's TestKernelFailureStatuses checks
 * the two agree through the generated bindings). A circuit with that
 * default (RESP_BATCH) has every other final status counted as an ordinary
 * success in its answered word; these always wake the daemon. */
enum http_failure {
	HTTP_TOO_MANY_REQUESTS = 429,
	HTTP_SERVER_ERROR_MIN = 500,
	HTTP_SERVER_ERROR_MAX = 599,
};

static __always_inline int http_default_failure(__u32 status)
{
	return status == HTTP_TOO_MANY_REQUESTS ||
	       (status >= HTTP_SERVER_ERROR_MIN && status <= HTTP_SERVER_ERROR_MAX);
}

/* The answered map: per circuit id below ANSWERED_IDS, one word, epoch <<
 * ANSWERED_SHIFT | count: the successes the response programs counted for
 * the circuit (RESP_BATCH) and have not yet written out. The daemon writes
 * a word (a new epoch, count 0) before a limits entry names it, and again
 * when the circuit gives the id back or its options change; the kernel
 * adds only under the epoch its socket was marked with. */
#define ANSWERED_COUNT ((1ULL << ANSWERED_SHIFT) - 1)

enum inflight_flags {
	INFLIGHT_PROBE = 1 << 0, /* the turn is a half-open probe's first: its result */
};

/* Value of the inflight map (key: socket cookie), one entry per socket of a
 * destination with RESP_INFLIGHT, made at its first request and removed
 * when it closes. The kernel cannot time a turn out by itself: the daemon
 * scans this map every tick and counts a turn whose request waited longer
 * than response_timeout. req_ns is written in one store, so the daemon
 * reads it whole; 0 while no request awaits its first response byte. */
struct inflight_turn {
	struct dest_key dest;
	__u32 turn;         /* the turn's number on its socket (1, 2, …) */
	__u32 round;        /* with INFLIGHT_PROBE: the half-open round that admitted the socket */
	__u32 flags;        /* enum inflight_flags */
	__u64 req_ns;       /* bpf_ktime_get_ns() of the turn's first request byte; 0: none awaits */
	__u64 cgroup_id;    /* cgroup the socket was created in */
};

/* Live socket counts of one bulkhead slot, kept exact by the socket
 * lifecycle (incremented when connect admits a socket, decremented exactly
 * once when it leaves the counted state by any path). */
struct bulk_count {
	__s64 connections;
	__s64 connecting;
};

/* Global statistics, indexes into the per-CPU stats array. */
enum stat_index {
	STAT_EVENTS_LOST = 0,      /* ring buffer full: records dropped */
	STAT_FAILSAFE_ALLOWED = 1, /* verdicts ignored: heartbeat stale */
	STAT_STORAGE_FAILED = 2,   /* no socket storage: socket not observed */
	STAT_REJECTIONS_FULL = 3,  /* a rejection's cgroup not recorded: the rejections map is full */
	STAT_MAX = 8,
};

/* Outcome of a connection, as reported in an event. */
enum outcome {
	OUTCOME_ESTABLISHED = 1, /* handshake done; duration = handshake time */
	OUTCOME_REFUSED = 2,     /* RST in answer to the SYN */
	OUTCOME_TIMED_OUT = 3,   /* SYN retries exhausted */
	OUTCOME_UNREACHABLE = 4, /* ICMP host or network unreachable */
	OUTCOME_RESET = 5,       /* RST on an established connection */
	OUTCOME_STALLED = 6,     /* RTOs on an established connection (count) */
	OUTCOME_ABANDONED = 7,   /* closed by the application while connecting */
	OUTCOME_SYN_RETRANS = 8, /* early: the first SYN was retransmitted */
	OUTCOME_ERROR = 9,       /* connect failed with another errno (err) */
	OUTCOME_PROBE_ROUND = 10, /* kernel admitted the first probe of a round (no socket) */
	OUTCOME_RESPONSE = 11,    /* first byte of a response: duration = since the request's
				   * first byte, ts_ns = the byte's arrival, count = turn,
				   * err = HTTP status (EVENT_HTTP) */
	OUTCOME_NO_RESPONSE = 12, /* the connection ended while a request awaited its first
				   * response byte: duration = how long it waited, count =
				   * turn, err = the socket's errno, EVENT_PEER_CLOSED */
	OUTCOME_ANSWERED = 13,    /* successes counted in an answered word since it was last
				   * written out (no socket, no destination): duration =
				   * how many, round = the circuit id, count = the word's
				   * epoch. Written just before any other record of a
				   * socket that counts there, and when the daemon asks
				   * (answered_flush), so the ring keeps the calls' order */
};

enum event_flags {
	EVENT_PROBE = 1 << 0,  /* the socket was admitted as a half-open probe */
	EVENT_NO_AGE = 1 << 1, /* duration_ns is unknown (0): a reset of a socket the
				* kernel kept no start time for; the daemon dates it
				* by the socket's established record (cookie) */
	EVENT_HTTP = 1 << 2,   /* a response whose err holds a parsed HTTP/1.x status */
	EVENT_PEER_CLOSED = 1 << 3, /* no_response: the peer closed or reset the connection */
};

/* One ring buffer record per outcome: 64 bytes, fixed. Records that need a
 * prompt answer (failures, probes, the first probe of a round, a first SYN
 * retransmission, a slow handshake) wake the daemon; a healthy established
 * record does not, unless the ring is filling (WAKE_WATERMARK), and is read
 * with the next batch. The ring keeps them in order either way. */
struct event {
	struct dest_key dest;
	__u8 outcome; /* enum outcome */
	__u8 flags;   /* enum event_flags */
	__u16 err;    /* the socket's errno, when it failed; a response's HTTP status */
	__u32 count;  /* RTOs for stalled */
	__u32 round;  /* probes and probe-round records: the half-open round */
	__u64 duration_ns;
	__u64 cookie;    /* socket cookie */
	__u64 cgroup_id; /* cgroup the socket was created in (0 if unknown) */
	__u64 ts_ns;     /* bpf_ktime_get_ns() */
};

#endif /* BREAKER_H */
