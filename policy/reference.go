package policy

import (
	"fmt"
	"strings"
)

// limitRows are the documented limits, from the constants themselves.
var limitRows = []struct {
	what  string
	limit int
}{
	{"file size (bytes; at most one more byte is read)", MaxFileBytes},
	{"nesting of mappings and lists", MaxDepth},
	{"keys plus list entries in the file", MaxEntries},
	{"targets", MaxTargets},
	{"exclude blocks", MaxExclude},
	{"cidrs plus hosts in one match block (a target's or an exclude's)", MaxAddresses},
	{"ports and ranges in one match block", MaxPorts},
	{"address × port pairs of all targets and excludes together", MaxMatchEntries},
	{"distinct host names (each re-resolved every resolve interval)", MaxHosts},
	{"Service targets (each watched through the Kubernetes API)", MaxServices},
}

// Reference renders the configuration reference (docs/configuration.md)
// from the schema, so the document cannot drift from the decoder.
func Reference() string {
	var b strings.Builder
	b.WriteString("# Configuration reference\n\n")
	b.WriteString("<!-- Generated from policy/options.go and policy/config.go by `go test ./docs -run TestConfigurationReference -update`; do not edit. -->\n\n")
	b.WriteString("breakerd reads one YAML file (`--config`; the embedded `policy/default.yaml` when none is given). ")
	b.WriteString("Every key has a default. Environment variables `BREAKERD_<KEY PATH>` override the file, with `.` written as `_` ")
	b.WriteString("(`BREAKERD_MODE=shadow`, `BREAKERD_ALL_OPEN_DURATION=30s`; a target's key only when the file has it). ")
	b.WriteString("Durations are strings like `250ms`, `30s`, `5m`. Keys are case-sensitive. ")
	b.WriteString("Validation reports every problem at once (the first 100, then how many more), each with its key path and line, at start-up, on every reload ")
	b.WriteString("(an invalid reload changes nothing: the running configuration, forced states included, stays) and in `breakerctl config validate`.\n\n")
	b.WriteString("## What is refused\n\n")
	b.WriteString("The file must be a regular file (symlinks are followed): a FIFO, a device or a directory is refused without being read. ")
	b.WriteString("It must hold exactly one YAML document whose top level is a mapping with at least one key. These are errors: ")
	b.WriteString("an empty file or one of only comments; a second document (`---`); an unknown key, with or without a value; ")
	b.WriteString("a key with no value or `null` (`bogus_key:`); an empty list entry; a duplicate key; anchors' aliases (`*a`) and merge keys (`<<`); ")
	b.WriteString("a value of the wrong shape (a list where a mapping belongs, a mapping in a list of addresses). ")
	b.WriteString("A key that cannot be a name (longer than 64 bytes, or with `:`, `$`, `*`, `/`, quotes or control characters) is reported by its length and line, not echoed, so a wrong file such as `/etc/shadow` never reaches the log.\n\n")
	b.WriteString("## Limits\n\n")
	b.WriteString("They bound what reading, validating and matching a file can cost. Nesting is checked on the text before the YAML parser sees it.\n\n")
	b.WriteString("| what | at most |\n|---|---|\n")
	for _, l := range limitRows {
		fmt.Fprintf(&b, "| %s | %d |\n", l.what, l.limit)
	}
	b.WriteString("\n")
	b.WriteString("## Top level\n\n")
	writeTable(&b, topFields)
	b.WriteString("| `all` | (the options below) | mapping | Options for every destination no target names; each such address and port gets its own circuit. |\n")
	b.WriteString("| `targets.<name>` | none | mapping | A named service: the target keys below plus its own options. |\n")
	b.WriteString("| `exclude` | `[]` | list of match blocks | Destinations never protected (`cidrs`, `hosts`, `ports`, `protocol` as in a target's `match`). Exclude wins over every target. |\n\n")
	b.WriteString("## Options (in `all` and in each target)\n\n")
	b.WriteString("A target's block **stands in for** `all` rather than layering over it: an option the target leaves out takes the built-in default below, not the value from `all`.\n\n")
	opts := make([]docField, len(optionFields))
	for i, f := range optionFields {
		opts[i] = docField{f.key, f.def, f.unit, f.doc}
	}
	writeTable(&b, opts)
	b.WriteString("\nContradictions are errors too: `min_requests` above `window_size` (count-based), `half_open_success_threshold` above `half_open_probes`, `max_open_duration` below `open_duration`, `probe_timeout` below `connect_timeout`.\n\n")
	b.WriteString("## Target keys\n\n")
	writeTable(&b, targetFields)
	b.WriteString("\nTarget names are lowercase `[a-z0-9_-]+`; `all`, `tcp` and `udp` are reserved (they name the dynamic circuits of `all`, `tcp/addr:port` and `udp/addr:port`, and their metric label). ")
	b.WriteString("A destination belongs to the most specific match: the longest prefix, then an exact port over a range over any port (a longest-prefix lookup whose cost does not grow with the number of targets). ")
	b.WriteString("Two targets matching a destination equally specifically is an error that names both.\n\n")
	b.WriteString("## What counts\n\n")
	b.WriteString("A call is one outbound TCP connection. Established is a success (slow when its handshake took at least `slow_call_duration`); refused, timed out (`connect_timeout`), unreachable and stalled (`max_rto`) are failures, and so is a reset of an established connection within `reset_failure_window` of its `connect()` (a later reset counts as nothing); a connect the application abandons counts as nothing before `slow_call_duration` and as slow (or failed, with `count_abandoned`) after, and always as timed out (a failure) once it waited at least `connect_timeout`. breakerd's own rejections never enter the window.\n\n")
	b.WriteString(responsesReference)
	writeFleetReference(&b)
	writeSlowStartReference(&b)
	b.WriteString("## States\n\n")
	b.WriteString("closed → open when, with at least `min_requests` calls in the window, the failure rate reaches `failure_rate_threshold` or the slow-call rate reaches `slow_call_rate_threshold`, or after `consecutive_failures` failures in a row. ")
	b.WriteString("open → half-open when `open_duration` has passed and a connection comes: the kernel admits `half_open_probes` of them in a round. ")
	b.WriteString("half-open → closed after `half_open_success_threshold` successful probes (counted across rounds); → open again on a failed probe, or `probe_timeout` after a round began when no probe of that round succeeded, for `open_duration × open_duration_multiplier^n` (capped at `max_open_duration`, plus up to `jitter` of it at random). ")
	b.WriteString("A clean close returns the open duration to its base. `forced_open` always rejects and never probes, `forced_closed` never rejects, `disabled` keeps metrics only.\n\n")
	b.WriteString("## Half-open rounds\n\n")
	b.WriteString("A circuit probes in numbered rounds, and has one probe budget whatever its scope: a service-scope target with N addresses admits `half_open_probes` per round in total, not per address. ")
	b.WriteString("The kernel hands a round's tokens out exactly (one compare-and-exchange on the round number and the tokens left together), marks each probe with its round, and reports the round's first probe; ")
	b.WriteString("the daemon counts only outcomes of the circuit's current round, so a late probe of an earlier round neither reopens nor closes it. ")
	b.WriteString("Only TCP connections probe: a UDP datagram to a half-open destination (`protocol: udp` or `any`) is rejected like in open, since it could never report. ")
	b.WriteString("`probe_timeout` is decided by the daemon alone (the kernel never re-issues tokens on its own): when a round began that long ago, a round where no probe succeeded (none reported, or only late ones) reopens, which counts a trip and grows the open duration; ")
	b.WriteString("a round where some probes succeeded and none failed does not: the circuit stays half-open with its count of successes and a new round of `half_open_probes` tokens begins (log line `new half-open round`), so with `half_open_success_threshold` above 1 a little traffic closes it. ")
	b.WriteString("A round no connection has begun waits for one, without a time limit. ")
	b.WriteString("When the kernel loses records (a full ring buffer), the daemon compares each open circuit with its probe budget, so a round whose records were lost still begins and times out.\n\n")
	b.WriteString("## Endpoint groups\n\n")
	b.WriteString("With `scope: endpoint` each address and port of a target has its own circuit, and the target's endpoints form a group. ")
	b.WriteString("An endpoint is ejected (opened) only while the ejected endpoints stay within `max_ejection_percent` of the endpoints the group knows, rounded down, except that one endpoint may always be ejected (Envoy's rule: at 33% a group of 3 would otherwise never eject any). ")
	b.WriteString("An endpoint the cap keeps closed is logged (`circuit kept closed`, reason `max_ejection_percent`) once per run of failures, keeps taking traffic and counting its calls, and is ejected as soon as another endpoint recovers. ")
	b.WriteString("This is breakerd's panic mode, the counterpart of Envoy's panic threshold: when most endpoints fail at once, the cause is more often shared (the network, a dependency, breakerd's own view) than in every endpoint, so breakerd keeps sending to the rest rather than rejecting everything; to reject the whole service, use `scope: service`. ")
	b.WriteString("The group knows the endpoints enumerated from its `match` (single addresses and resolved host names, times listed ports) and those seen in traffic; an endpoint leaves it when it no longer matches (removed from the configuration, or gone from the host name's addresses) or, seen only in traffic, when it has been closed and idle for 10 minutes. ")
	b.WriteString("A reload that changes `max_ejection_percent` applies to the next ejection; endpoints already ejected stay open until they recover.\n\n")
	b.WriteString("## Kubernetes Services\n\n")
	b.WriteString("A target with `match: {service: NAMESPACE/NAME}` follows the Service live, through informers on the API server (needs API access: in a pod, the service account; elsewhere `--kubeconfig`; without either it matches nothing and a warning says so). ")
	b.WriteString("Its destinations are the Service's cluster IPs times its selected ports (`ports` names Service port numbers or names; none: every port whose protocol `protocol` admits), and the addresses of its EndpointSlices' serving endpoints (`serving` true: ready, or terminating and still serving; not-serving endpoints are not the target's) times the slice's port of the same name. ")
	b.WriteString("When a slice changes, the verdicts follow: a departed endpoint's verdict is removed (a service-scope circuit keeps its state and its other destinations; an endpoint-scope circuit of the departed endpoint is dropped and leaves its group), a new endpoint is covered at once, with the circuit's verdict if it rejects. ")
	b.WriteString("In endpoint scope the endpoints of the group, and so the denominator of `max_ejection_percent`, are the slices' serving endpoints plus the cluster IPs. ")
	b.WriteString("A Service that does not exist yet matches nothing until it appears (a warning, and a `ServiceNotFound` Event on the Node); an unreachable API server leaves the last known destinations in force. ")
	b.WriteString("ExternalName Services have no addresses to resolve; name their host in `hosts` instead.\n\n")
	b.WriteString("**What a connect-level breaker sees.** breakerd sees the destination that `connect()` is given, before any NAT. ")
	b.WriteString("With kube-proxy (iptables, IPVS or nftables) a client connects to the cluster IP, and the backend pod is chosen after the cgroup `connect4` hook has run (DNAT in the netfilter path of the first packet): breakerd sees only `clusterIP:port`, so every backend's failures count in the cluster IP's one circuit, and an open verdict rejects the whole Service; endpoint scope cannot tell the pods apart there. ")
	b.WriteString("Clients of a headless Service (`clusterIP: None`: DNS returns the pod IPs) and clients that connect to pod IPs directly (gRPC client-side balancing, StatefulSet peers) connect to the endpoints themselves, which is where endpoint scope and `max_ejection_percent` eject single pods. ")
	b.WriteString("kube-proxy replacements that rewrite the address in a cgroup connect hook of their own (Cilium's socket-level load balancing) may run before or after breakerd's, depending on where each is attached: breakerd then sees the Service's or the backend's address; check which on such a cluster.\n\n")
	b.WriteString("## Reloads and restarts\n\n")
	b.WriteString("A reload keeps every circuit whose matching still holds — also when its target's or `all`'s options changed: its state, window, trips, open time, and an override set through the API stay, and the new options apply from its next call and transition (an open verdict keeps the `reject_errno` and probe settings it was written with until the circuit next opens). ")
	b.WriteString("A changed `window_size` or `window_duration` starts an empty window. A circuit is dropped, and its verdict removed, only when its target is removed, its `scope` changes, or one of its destinations now matches another target or an exclude. A target whose `state` changed takes the new state at once. ")
	b.WriteString("A restarted daemon adopts the open circuits from the pinned verdict map with their remaining open time and round. ")
	b.WriteString("An override set through the API (`breakerctl force open|close`) is kept by circuit name in the pinned `overrides` map beside the verdicts, so it lasts across reloads and restarts until it is released (`release`), the configuration changes that target's `state`, or the circuit goes (its target removed, or its destination no longer matching it); `reset` keeps it. A circuit name longer than 128 bytes cannot be kept: its override then lasts until the next restart, and a warning says so. ")
	b.WriteString("A `state` in the configuration applies at every start and reload that changes it.\n\n")
	b.WriteString("## Workloads\n\n")
	b.WriteString("`workloads` chooses the protected processes. Each entry has a `name` (lowercase `[a-z0-9_-]+`; `shared` is reserved), `cgroups`, a list of glob patterns of cgroup paths relative to the cgroup v2 mount, and `isolate` (default `false`):\n\n")
	b.WriteString("```yaml\nworkloads:\n  - name: legacy\n    cgroups: [system.slice/legacy-*.service]\n  - name: tenant-a\n    cgroups: [kubepods.slice/tenant-a/**]\n    isolate: true\ntargets:\n  payments-a:\n    source: [tenant-a]\n    match: {cidrs: [10.20.0.0/16], ports: [\"443\"]}\n    max_connections: 50\n```\n\n")
	b.WriteString("In a pattern, `*`, `?` and `[…]` match within one path element (as Go's `path.Match`), and an element `**` matches any number of elements, none included: `kubepods.slice/**` selects `kubepods.slice` and every cgroup below it; `system.slice/legacy-*.service` selects those service cgroups but not their children. ")
	b.WriteString("Patterns are matched against every cgroup below `--cgroup` that exists when breakerd starts or reloads and every cgroup created later; a cgroup belongs to the first workload in the list one of whose patterns matches it. ")
	b.WriteString("A process is judged by the cgroup it is in when it calls `connect()` (or sends a datagram). A process of no workload is never rejected, never counted in a bulkhead, and its outcomes are not reported. With no `workloads` (the default), every process below `--cgroup` is protected. At most 64 workloads of 64 patterns each.\n\n")
	b.WriteString("**What is shared.** Workloads share circuits by default: one circuit per destination (per target in service scope) for the node, so every workload's failures count toward it and an open circuit protects them all. ")
	b.WriteString("Bulkheads are per workload by default: each workload has a count of its own against the circuit's `max_connections` and `max_connecting`, so one workload's connections never use up another's (`/v1/circuits` lists them under the circuit's `bulkheads`, by workload; `connections` is their sum). Without a `workloads` list, the processes of no workload share one bulkhead per circuit, as before. ")
	b.WriteString("An **isolated** workload (`isolate: true`, or named in a target's `source`) has circuits of its own for every destination, and so bulkheads: its failures open only its circuits, and its options may differ. ")
	b.WriteString("A target with a `source` applies only to the workloads it names, and for them it wins over a target without one that matches a destination as specifically (two targets with a common workload in their sources, or both without a source, matching equally specifically is an error). ")
	b.WriteString("The circuits of an isolated workload are named with `@` and the workload (`payments@tenant-a`, `tcp/192.0.2.7:443@tenant-a`), and carry its name as their `workload` in the API, the transition log and metrics; shared circuits carry `shared`. ")
	b.WriteString("A reload that isolates a workload or stops isolating it moves its connections to the other circuits: from then on they are judged by those circuits' state.\n\n")
	b.WriteString(criticalityReference)
	b.WriteString("**Patterns in a source.** A `source` entry may also be a cgroup pattern, written after `cgroup:` (`source: [\"cgroup:kubepods.slice/tenant-a/**\"]`; the same patterns as `cgroups`). Each distinct pattern is a workload of its own, isolated, named `cgroup.` and the first 8 hex digits of the pattern's SHA-256 (`cgroup.88542360` for `shop/tenant-a/**`): the same in every target that writes it and across reloads and restarts, so circuit names and metric labels stay stable and bounded (at most 64 distinct patterns). ")
	b.WriteString("Precedence: a cgroup that a source pattern matches belongs to that pattern's workload, whatever the `workloads` list says (the pattern is the more specific choice; among patterns, the first in the order of target names and then of `source` entries wins); a cgroup no source pattern matches belongs to the first listed workload that selects it, as before. ")
	b.WriteString("A source pattern never leaves a process unprotected: with no `workloads` list every process below `--cgroup` stays protected, those of no pattern in the shared circuits; with a list, the cgroups a source pattern matches are protected too. A configuration with neither a list nor source patterns looks nothing up (the kernel tests one flag).\n\n")
	b.WriteString("**Pods.** A workload may select Kubernetes pods instead of (or besides) cgroup patterns: `namespaces`, a list of namespace names (none: every namespace), and `pod_labels`, the labels a pod must all carry (none: every pod), as a list of `KEY=VALUE` or as a mapping the way a `matchLabels` is written; for example `{name: shop, namespaces: [shop], pod_labels: [\"app.kubernetes.io/name=web\"]}`, or `pod_labels: {app.kubernetes.io/name: web}` (quote a value YAML reads as a number or a boolean: `{version: \"2\"}`). ")
	b.WriteString("breakerd watches this node's pods (a field selector on `spec.nodeName`, from `--node-name`/`NODE_NAME`) and gives the workload the cgroups of the selected pods and of their containers, found in either kubelet layout below `--cgroup`: the systemd driver's `kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice/cri-containerd-<id>.scope` (Guaranteed pods without the QoS level; `crio-<id>.scope` under CRI-O) and the cgroupfs driver's `kubepods/<qos>/pod<uid>/<id>`. ")
	b.WriteString("A container started after its pod is protected when its cgroup is made, like any new cgroup; a pod whose labels change is selected or let go at once; a deleted pod's cgroups leave the workload. A terminating pod (its deletion requested, its containers in their grace period) stays protected until it is gone: its processes still run and connect, and letting them go mid-shutdown would change how their connects fail; a pod that has finished (`Succeeded`, `Failed`) has no process left to protect, and its cgroups leave the map when the kubelet removes them. ")
	b.WriteString("Workloads are matched in the list's order: a cgroup pattern or pod selection of an earlier workload wins. Selecting pods needs Kubernetes API access; without it such a workload selects no pod, and a warning says so, as it does when a workload selects no pod on the node. ")
	b.WriteString("A circuit's `failed_pods` in the API (and `breakerctl status`) names the pods whose connections to it failed most recently (up to 8), and its `rejected_by` the pods it turned away and how often (the kernel counts rejections per cgroup; a pod's containers are summed; read every second), most first; `breakerctl status` and `top` show both, and a `CircuitClosed` Event names the pods rejected.\n\n")
	b.WriteString("## Bulkheads\n\n")
	b.WriteString("`max_connections` and `max_connecting` are concurrency limits (Envoy's circuit breakers, resilience4j's bulkhead, HAProxy's `maxconn`) that the kernel enforces in `connect()` for every process of the cgroup, with no proxy. The count is per circuit: per target in service scope, per address and port in endpoint scope and for `all`, and within a circuit per workload (see *Workloads*; each workload's bulkhead of a circuit takes one of the circuit ids `max_circuits` leaves free). The kernel keeps it exact over the socket lifecycle: a socket is counted when connect admits it and released exactly once when it fails, is closed or its process dies. A lowered limit never closes existing connections; new ones wait for the count to fall. Destinations of `all` are counted from the first outcome the daemon sees for them. Like verdicts, limits are ignored when the daemon's heartbeat is stale.\n")
	b.WriteString(adaptiveReference)
	b.WriteString(fallbackReference)
	b.WriteString("## Closing established connections\n\n")
	b.WriteString("An open circuit rejects new connects; a client with a keep-alive pool would go on sending requests over the connections it already has (HAProxy's `on-marked-down shutdown-sessions` is the remedy there). ")
	b.WriteString("With `close_established: true` (a target's option, or `all`'s), when the circuit opens breakerd closes the established TCP connections of the protected processes to the circuit's destinations, so the pool's next request fails (`ECONNABORTED`, and the server gets a reset), the pool reconnects, and the reconnect is rejected in `connect()`. ")
	b.WriteString("It is an error on a target with `protocol: udp`. ")
	b.WriteString("**When**: on every opening the running daemon makes, from a state that lets connections through: closed → open, half-open → open (the probes of the failed round are closed too), closed or half-open → `forced_open`, whether by the state machine, `breakerctl force open`, or a reload that sets `state: forced_open` (or adds such a target). ")
	b.WriteString("Not while half-open: the probes a half-open circuit admits are never closed then. Not for a circuit already open when breakerd starts (adopted from the pinned verdicts, or forced open by the configuration or a kept override): its connections were closed when it opened, and one made since (a connection from before a restart, or one let through while the fail-safe ignored the verdicts) is left alone until the circuit opens anew. A reload that turns the option on for an open circuit closes nothing until its next opening. ")
	b.WriteString("**What**: only sockets in `ESTABLISHED` whose peer is one of the circuit's destinations (address and port), made in a cgroup below `--cgroup`, and with `workloads`, in a cgroup of a protected workload whose class is the circuit's (an isolated workload's circuit closes only that workload's connections; a shared circuit closes those of the workloads sharing it). ")
	b.WriteString("Never a listening socket, nor a server-side one: a socket that was accepted is left alone, judged by how it was made (it keeps its listener's backlog), so also after a draining server closed its listener (with `sock_diag`, an iterator that closes nothing lists them; should it not load, only the next rule applies and breakerd says so at start-up); and an established socket whose local port is a port that some socket of its network namespace listens on is taken for server side and left alone (a client socket that happens to be bound to such a port is left alone too; so is one accepted from a listener made with a backlog of 0, while that listener is open). ")
	b.WriteString("A socket is judged by the cgroup it was made in (as outcome records are): a connection made before its process moved into a protected cgroup is not closed. ")
	b.WriteString("**How**: on Linux 6.5 and later, a TCP socket iterator program calls `bpf_sock_destroy` in the kernel, filtering by destination, class and cgroup there; on older kernels (6.1) the daemon lists the sockets over `NETLINK_SOCK_DIAG` with their cgroup ids and destroys the matching ones with `SOCK_DESTROY` (needs `CONFIG_INET_DIAG_DESTROY`, which Debian's kernels have); with neither, connections stay open, which breakerd says at start-up and in `breakerd_close_established_mechanism{mechanism=\"none\"}`. ")
	b.WriteString("`breakerd --close-mechanism` chooses one of the two (`bpf_sock_destroy` or `sock_diag`), or `none`, instead of the best this kernel offers (`auto`); a mechanism chosen but missing here is `none`, said the same way. ")
	b.WriteString("The pass runs once per network namespace of the processes below `--cgroup` (found through their `cgroup.procs` and `/proc/PID/ns/net`, and entered with `setns`: that needs the processes' PID namespace, `CAP_SYS_ADMIN` and, for a process of another user or with a capability breakerd lacks, `CAP_SYS_PTRACE`; in Kubernetes the `deploy/components/close-established` component grants them, and breakerd says at start-up which namespaces it can enter, in its log and `breakerd_close_established_mechanism{namespaces}`), on a goroutine of its own after the verdict is written, so the event loop never waits for it. ")
	b.WriteString("Each opening's count is in its log line (`closed established connections`, with `closed` and `failed`), its event in `/v1/events` (`closed_established`), the circuit's `closed_established` in `/v1/circuits`, and `breakerd_established_closed_total{target,workload,result}`.\n\n")
	b.WriteString("**With a fallback**, a circuit's open time sends its connects to the fallback (see *Fallbacks*), and a pool's connections made then stay there after the circuit closes. With `close_established`, when a circuit with a `fallback` stops rejecting (open, half-open, `forced_open` or `fleet_open` → closed, `forced_closed` or `disabled`), breakerd also closes the established connections it sent to its fallback that are still connected there, so the pools reconnect to the recovered target; without the option they stay on the fallback until their clients close them. ")
	b.WriteString("Only sockets the kernel redirected are closed: those whose per-socket record (kept by the redirect) says they asked for one of the circuit's destinations and were sent to the peer they are connected to now. A connection made to the fallback's own address is left alone, as is everything an opening's pass leaves alone (the cgroup, workload and server-side rules above). ")
	b.WriteString("This needs `bpf_sock_destroy` (the iterator reads that record; `sock_diag` cannot): with `sock_diag` or none, nothing is closed and breakerd says so once. ")
	b.WriteString("Each such pass logs `closed connections redirected to the fallback` (with `closed` and `failed`), sets `closed_established` on the closing transition's event and adds to the circuit's, and counts in `breakerd_established_closed_total` with `result` `returned` (and `failed` for sockets the kernel refused to close). ")
	b.WriteString("A circuit that rejects again before its pass runs skips it: its redirects are current.\n\n")
	return b.String()
}

func writeTable(b *strings.Builder, fields []docField) {
	b.WriteString("| key | default | unit | meaning |\n|---|---|---|---|\n")
	for _, f := range fields {
		fmt.Fprintf(b, "| `%s` | `%s` | %s | %s |\n", f.key, f.def, f.unit, f.doc)
	}
}
