/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The contract of destroy.c, the close pass of `close_established`: what
 * the daemon writes before it runs the TCP socket iterator and what it
 * reads back. Nothing here is pinned: the maps live as long as the
 * daemon's handle on the object, so this is not part of the layout
 * version (bpf/breaker.h is).
 */
#ifndef DESTROY_H
#define DESTROY_H

#include "breaker.h"

/* How the workloads map decides a socket's class in a pass (the main
 * object's CONFIG_SCOPED and CONFIG_CLASSES). */
enum close_workloads {
	CLOSE_UNCLASSED = 0, /* every socket is of class 0 */
	CLOSE_SCOPED = 1,    /* only sockets of cgroups in the workloads map, in their class */
	CLOSE_CLASSED = 2,   /* a cgroup in the map gives its class; the others class 0 */
};

/* Which sockets of close_targets' destinations a pass closes. */
enum close_mode {
	/* A circuit opened: the sockets whose peer is the destination. */
	CLOSE_BY_PEER = 0,
	/* A circuit with a fallback closed: the sockets that asked for the
	 * destination, were sent to the fallback (their origins storage) and
	 * are still connected there (its via is their peer), so that they
	 * reconnect to the destination. */
	CLOSE_RETURNING = 1,
};

/* Value of close_targets (key: struct dest_key): one entry per destination
 * of the circuits of the pass, counted by it. */
struct close_count {
	__u32 closed; /* sockets bpf_sock_destroy closed */
	__u32 failed; /* sockets it refused to close (its error) */
};


/* The one entry of close_settings, written before every pass. */
struct close_config {
	__u64 cgroup_id; /* the attach point (--cgroup): only sockets made below it */
	enum close_workloads workloads;
	__u32 max_depth; /* levels between the attach point and the deepest cgroup */
	enum close_mode mode;
	__u32 _pad;
};

/* Listening ports of the network namespace being walked, one bit per port
 * (host order), set by the pass as it meets the listeners (the iterator
 * walks them before the established sockets). An established socket
 * whose local port is a listening port is taken for server side and left
 * alone. */
#define LISTEN_WORDS 1024
struct listen_ports {
	__u64 bits[LISTEN_WORDS];
};

/* What list_accepted writes for each accepted established socket: the
 * start of sock_diag's struct inet_diag_sockid (ports in network order;
 * an IPv4 address in the first 4 bytes of its array), and the family. */
struct accepted_sock {
	__u8 family;
	__u8 _pad[3];
	__u16 sport;
	__u16 dport;
	__u8 src[16];
	__u8 dst[16];
};

#endif /* DESTROY_H */
