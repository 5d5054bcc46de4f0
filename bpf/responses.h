/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
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
 *
 * answered_flush (tc), at the end, is no hook: the daemon runs it to write
 * out the successes the response programs counted.
 */
#ifndef BREAKERD_RESPONSES_H
#define BREAKERD_RESPONSES_H

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

#define METHOD_CONNECT_LEN 8 /* "CONNECT " */

/* is_connect reports whether a request begins with the CONNECT method. */
static __always_inline int is_connect(const __u8 *m)
{
	return m[0] == 'C' && m[1] == 'O' && m[2] == 'N' && m[3] == 'N' && m[4] == 'E' && m[5] == 'C' &&
	       m[6] == 'T' && m[7] == ' ';
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
	if (st->resp & RESP_HTTP) {
		/* A CONNECT's 2xx turns the connection into a tunnel (RFC 9110
		 * 9.3.6), whose bytes are no requests and answers. Only this
		 * program writes st->seq. */
		__u8 method[METHOD_CONNECT_LEN];
		if (s.len >= sizeof(method) && !bpf_skb_load_bytes(skb, s.off, method, sizeof(method)) &&
		    is_connect(method))
			st->seq |= SEQ_CONNECT;
		else
			st->seq &= ~SEQ_CONNECT;
	}
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
 * (PHASE_UPGRADED), as after a 2xx to a CONNECT (the tunnel's bytes are
 * no HTTP). After any other 1xx the turn keeps awaiting: its header
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

/* scan_chunk scans the SCAN_CHUNK bytes at packet offset pos from scan
 * state k, as info_scan's step: it returns INFO_FOUND | the offset after
 * the blank line << 2, or the offset after the chunk << 2 | the scan state
 * there, or -1 when the bytes are not within the packet. A global
 * function, so the verifier checks the unrolled bytes once, not in each
 * of info_scan's loop's turns. */
verified_once int scan_chunk(struct __sk_buff *skb, __u32 pos, __u32 k)
{
	__u8 b[SCAN_CHUNK];
	if (!skb || bpf_skb_load_bytes(skb, pos, b, SCAN_CHUNK))
		return -1;
	k &= INFO_STATE;
#pragma unroll
	for (int j = 0; j < SCAN_CHUNK; j++)
		if (info_byte(b[j], &k))
			return (int)(INFO_FOUND | ((pos + j + 1) << 2));
	return (int)(((pos + SCAN_CHUNK) << 2) | k);
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
		int got = scan_chunk(skb, pos, k);
		if (got < 0)
			return (int)((end << 2) | k); /* not within the packet: give the segment up */
		if (got & INFO_FOUND)
			return got;
		pos = (__u32)got >> 2;
		k = (__u32)got & INFO_STATE;
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

/* info_block scans a segment from packet offset pos to end for the end
 * of a 1xx header block, from scan state state, with up to SCAN_CALLS
 * info_scan calls: info_scan's result after the last. Global, so the
 * loop is checked once, not in each of informational's turns. */
verified_once int info_block(struct __sk_buff *skb, __u32 pos, __u32 end, __u32 state)
{
	__u32 got = state & INFO_STATE;
	for (int c = 0; c < SCAN_CALLS; c++) {
		got = (__u32)info_scan(skb, pos, end, got);
		pos = (got & ~INFO_FOUND) >> 2;
		if ((got & INFO_FOUND) || pos >= end)
			break;
	}
	return (int)got;
}

/* head_load copies n (at most STATUS_LINE) bytes at packet offset pos to
 * st->head from index have on: 0, or -1 when they are not within the
 * packet. The whole status line's start is one load of constant size (the
 * usual case); a part of it, split across segments, goes byte by byte (a
 * load of variable size loses its bounds on 6.1's verifier). Global, so
 * the unrolled bytes are checked once, not at each call. */
verified_once int head_load(struct __sk_buff *skb, struct sock_state *st, __u32 pos, __u32 have,
			    __u32 n)
{
	if (!skb || !st)
		return -1;
	if (have == 0 && n == STATUS_LINE)
		return bpf_skb_load_bytes(skb, pos, st->head, STATUS_LINE) ? -1 : 0;
#pragma unroll
	for (int i = 0; i < STATUS_LINE; i++)
		if ((__u32)i < n &&
		    bpf_skb_load_bytes(skb, pos + i, &st->head[(have + i) & (HEAD_BYTES - 1)], 1))
			return -1;
	return 0;
}

/* informational reads a segment on from pos, in a 1xx header block
 * (st->head_len holds HEAD_INFO and the scan state): past the block's end,
 * the next status line, and so on. seq is pos's sequence number. It
 * returns the final status (INFO_FINAL_NOT_HTTP when the bytes there are
 * no status line), or 0 when the segment ends first: the next one goes on
 * from st (st->rcv_end is past what was read). Verified once: its loops
 * would otherwise be walked again on each path to it. */
verified_once int informational(struct __sk_buff *skb, struct sock_state *st, __u32 pos, __u32 seq,
				__u64 now)
{
	if (!skb || !st)
		return 0;
	/* Taken again here: a BPF call has at most five arguments. */
	__u64 cookie = bpf_get_socket_cookie(skb);
	__u32 end = skb->len;
	__u32 seq_end = seq + (end - pos);
	for (int r = 0; r < INFO_MAX; r++) {
		if (st->head_len >= HEAD_INFO) {
			__u32 got = (__u32)info_block(skb, pos, end, st->head_len & INFO_STATE);
			pos = (got & ~INFO_FOUND) >> 2;
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
		if (n > STATUS_LINE)
			n = STATUS_LINE;
		if (head_load(skb, st, pos, 0, n)) {
			if (n == STATUS_LINE)
				break;
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
			if (head_load(skb, st, pos, have, n))
				return 1;
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
			status = (__u32)informational(skb, st, pos, s.seq + (pos - s.off), now);
			if (!status)
				return 1;
			if (status == HTTP_SWITCHING_PROTOCOLS)
				phase = PHASE_UPGRADED;
			else if (status == INFO_FINAL_NOT_HTTP)
				status = 0;
		}
		if (status)
			flags |= EVENT_HTTP;
		if ((st->seq & SEQ_CONNECT) && status / 100 == 2)
			phase = PHASE_UPGRADED; /* a tunnel from here */
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

#endif /* BREAKERD_RESPONSES_H */
