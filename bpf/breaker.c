//go:build ignore
/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * breakerd's kernel programs: one compiled object, its parts in a header
 * per hook group, each included once, in this order:
 *
 *   kernel.h     the kernel's constants, CO-RE views of its structs
 *   maps.h       every map, the per-socket state, the maps' accessors
 *   record.h     records on the events ring and the answered words
 *   connect.h    cgroup/connect4|6, cgroup/sendmsg4|6: the fast path
 *   fallback.h   the redirect to a circuit's fallback, and
 *                cgroup/getpeername4|6, cgroup/recvmsg4|6 that show the
 *                application the address it asked for
 *   sockops.h    sockops, tp_btf/tcp_receive_reset, cgroup/sock_release:
 *                how each connection ends
 *   responses.h  cgroup_skb/egress|ingress, tc (answered_flush): responses
 *
 * breaker.h is the contract with the daemon: every struct and enum it
 * shares, exported to Go by bpf2go's -type.
 *
 * Fail-open, always: no config entry, a stale heartbeat, no verdict entry or
 * any failed lookup means allow.
 */
#include "breaker.h"

#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

#include "cgroup.h"
#include "kernel.h"

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
const enum ramp *unused_ramp __attribute__((unused));
const struct fallback *unused_fallback __attribute__((unused));

#include "maps.h"
#include "record.h"
#include "fallback.h"
#include "connect.h"
#include "sockops.h"
#include "responses.h"
