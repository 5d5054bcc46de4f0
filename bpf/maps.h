/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Every map of breaker.c, the per-socket state it keeps in socket storage,
 * and the one-line accessors of the maps (the settings, the handoff, the
 * statistics, the counters, resp_ports). The structs the daemon reads are
 * in breaker.h; what is defined here and pinned is layout too (maps'
 * TestLayoutVersionMatchesLayout).
 */
#ifndef BREAKERD_MAPS_H
#define BREAKERD_MAPS_H

/* The maps' sizes are enum sizes in breaker.h. Every map but `stats` is the
 * same size on any number of CPUs, so a 256-CPU node costs what a 2-CPU
 * node does. */

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
	/* 101 Switching Protocols (or a 2xx to CONNECT) answered the turn:
	 * the connection left HTTP and its bytes begin no more turns. Its bit of PHASE_AWAITING makes
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
	SEQ_SND = 1 << 0,     /* snd_end holds a sequence number */
	SEQ_CONNECT = 1 << 1, /* the turn's request is a CONNECT: a 2xx opens a tunnel */
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

/* Which cgroups each circuit, open, over a bulkhead's limit or ramping
 * up after recovery, turned away, and how often (struct rejection_key; the
 * three kinds counted apart in struct rejection_count). Written on the reject paths only: a connect
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

/* Circuit id -> where its rejected connects go instead (struct fallback),
 * written by the daemon for the rejecting circuits of targets with a
 * fallback, deleted when they close. Read only on the reject path, after
 * a verdict said no. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_FALLBACKS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct fallback);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fallbacks SEC(".maps");

/* Circuit id -> connects and sends sent to its fallback, atomic adds. An
 * array of its own beside counters (struct circuit_counters is left as it
 * is); the daemon zeroes an id's entry with its counters. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CIRCUIT_IDS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} redirects SEC(".maps");

/* The address a redirected socket asked for and the fallback it was sent
 * to instead (struct origin, breaker.h). Socket storage: it goes with the
 * socket, and a socket never redirected has none. Pinned, so the programs
 * of a restarted daemon still find it. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct origin);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} origins SEC(".maps");

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

#endif /* BREAKERD_MAPS_H */
