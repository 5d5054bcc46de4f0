// Package bpf holds breakerd's kernel programs (breaker.c, one object
// built from a header per hook group, with the kernel/user contract in
// breaker.h) and their bpf2go bindings. The
// generated breaker_x86_bpfel.go and .o are committed, so building needs no
// clang; `go generate ./bpf` rebuilds them with Debian's clang.
package bpf

//go:generate go tool bpf2go -tags linux -target amd64 -type event -type dest_key -type verdict -type settings -type circuit_counters -type outcome -type verdict_state -type ramp -type stat_index -type config_flags -type event_flags -type limit -type bulk_count -type probe_budget -type override_key -type override -type override_state -type workload -type connect_handoff -type response_flags -type inflight_flags -type inflight_turn -type rejection_key -type rejection_count -type sizes -type http_failure -type defaults -type fallback Breaker breaker.c -- -I/usr/include/x86_64-linux-gnu -O2 -g -Wall -Werror -Wpadded -mcpu=v3

// The close pass of close_established (destroy.c): its own object, loaded
// only when a target asks for it and the kernel has bpf_sock_destroy.
//go:generate go tool bpf2go -tags linux -target amd64 -type close_count -type close_config -type close_workloads -type close_mode -type listen_ports -type accepted_sock Destroy destroy.c -- -I/usr/include/x86_64-linux-gnu -O2 -g -Wall -Werror -Wpadded -mcpu=v3
