/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * What breaker.c needs of the kernel beyond the uapi headers: its
 * constants (address families, errnos, TCP states and flags, time units)
 * and minimal CO-RE views of the structs the programs read (the cgroup
 * ones are in cgroup.h). Only the fields read are declared: CO-RE
 * relocates each by name, so this is no copy of any kernel's layout.
 */
#ifndef BREAKERD_KERNEL_H
#define BREAKERD_KERNEL_H

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

#endif /* BREAKERD_KERNEL_H */
