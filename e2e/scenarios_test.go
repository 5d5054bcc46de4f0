package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

// Every scenario drives unmodified programs (curl, redis-cli,
// redis-benchmark, dig, prometheus) against real servers on namespaced
// hosts, with the built breakerd binary running as a process. Traffic is
// bounded in count and time.

const svc = `
failsafe_timeout: 2s
targets:
  web:
    match: {cidrs: [SRV0], ports: ["8080"]}
    consecutive_failures: 3
    open_duration: 2s
    jitter: 0
    connect_timeout: 1s
    probe_timeout: 3s
    reject_errno: ECONNREFUSED
`

func webURL(w *world) string { return fmt.Sprintf("http://%s:8080/", w.topo.Servers[0].IPv4) }

// 1. Server down (refused): the circuit opens after the configured
// failures, then curl fails fast and no SYN reaches the host; the API, the
// metrics, the log and the bpftool dump agree.
func TestServerDownRefused(t *testing.T) {
	w := newWorld(t, 1, svc)
	w.start()
	srv := w.topo.Servers[0]
	for i := 0; i < 3; i++ {
		if r := w.curl(w.cg, webURL(w)); r.exit != 7 {
			t.Fatalf("curl to a dead server: exit %d %s", r.exit, r.out)
		}
	}
	w.waitState("web", "open", 2*time.Second)
	syns := srv.SYNs(t)
	for i := 0; i < 5; i++ {
		r := w.curl(w.cg, webURL(w))
		if r.exit != 7 || !strings.Contains(r.out, "Couldn't connect") {
			t.Fatalf("curl at an open circuit: exit %d %s", r.exit, r.out)
		}
	}
	if n := srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs reached the host after the circuit opened", n)
	}
	c := w.circuits()["web"]
	if c.State != "open" || c.Rejected != 5 || c.Failures != 3 {
		t.Fatalf("/v1/circuits: %+v", c)
	}
	m := w.metrics()
	for _, want := range []string{`breakerd_circuit_state{state="open",target="web"} 1`, `breakerd_kernel_rejections_total{target="web"} 5`,
		`breakerd_transitions_total{from="closed",reason="consecutive_failures",to="open",workload="shared"} 1`} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if !strings.Contains(w.logs.String(), "circuit=web target=web from=closed to=open reason=consecutive_failures") {
		t.Errorf("no transition log line:\n%s", w.logs.String())
	}
	status, err := exec.Command(bin(t, "breakerctl"), "status", "--socket", w.socket).CombinedOutput()
	if err != nil || !strings.Contains(string(status), "web") || !strings.Contains(string(status), "open") {
		t.Errorf("breakerctl status: %v\n%s", err, status)
	}
	out, err := exec.Command("bpftool", "-j", "map", "dump", "pinned", maps.PinDir(w.bpffs)+"/verdicts").Output()
	if err != nil {
		t.Fatal(err)
	}
	var dump []struct {
		Formatted struct {
			Value struct {
				State     int    `json:"state"`
				CircuitID uint32 `json:"circuit_id"`
			} `json:"value"`
		} `json:"formatted"`
	}
	if err := json.Unmarshal(out, &dump); err != nil || len(dump) != 1 || dump[0].Formatted.Value.State != 1 || dump[0].Formatted.Value.CircuitID != c.CircuitID {
		t.Fatalf("bpftool dump disagrees with /v1/circuits (%+v): %s", c, out)
	}
}

// 2. Black hole (timed out): with connect_timeout 1s the circuit opens in
// about the timeout times the failures needed; then curl returns at once.
func TestBlackHole(t *testing.T) {
	w := newWorld(t, 1, strings.Replace(strings.Replace(svc, "consecutive_failures: 3", "consecutive_failures: 2", 1), "open_duration: 2s", "open_duration: 1m", 1))
	w.topo.Servers[0].DropSYNs(t, 8080)
	w.start()
	t0 := time.Now()
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { w.curl(w.cg, webURL(w), "--connect-timeout", "4") })
	}
	w.waitState("web", "open", 5*time.Second)
	opened := time.Since(t0)
	wg.Wait()
	if opened > 3*time.Second {
		t.Fatalf("opened after %v; want about connect_timeout (1s) plus the first SYN retransmission", opened)
	}
	r := w.curl(w.cg, webURL(w), "--connect-timeout", "10")
	if r.exit != 7 || r.elapsed > 500*time.Millisecond {
		t.Fatalf("after the trip curl took %v (exit %d): want milliseconds", r.elapsed, r.exit)
	}
	t.Logf("opened %v after the first connect; a curl at the open circuit took %v (the process start included)", opened, r.elapsed)
}

// 3. Recovery: the server comes back; after the open duration one probe
// reaches it, the circuit closes, clients succeed.
func TestRecovery(t *testing.T) {
	w := newWorld(t, 1, svc)
	w.start()
	for range 3 {
		w.curl(w.cg, webURL(w))
	}
	w.waitState("web", "open", 2*time.Second)
	w.serve(0, 8080)
	syns := w.topo.Servers[0].SYNs(t)
	time.Sleep(2100 * time.Millisecond)
	if r := w.curl(w.cg, webURL(w)); r.exit != 0 {
		t.Fatalf("probe: exit %d %s", r.exit, r.out)
	}
	w.waitState("web", "closed", 2*time.Second)
	for range 3 {
		if r := w.curl(w.cg, webURL(w)); r.exit != 0 {
			t.Fatalf("after recovery: exit %d", r.exit)
		}
	}
	if n := w.topo.Servers[0].SYNs(t) - syns; n != 4 {
		t.Fatalf("%d SYNs reached the server, want 1 probe + 3", n)
	}
}

// 4. Flapping: a server that fails every probe; the open durations grow by
// the multiplier up to the maximum, as /v1/events shows.
func TestFlapping(t *testing.T) {
	w := newWorld(t, 1, `
targets:
  web:
    match: {cidrs: [SRV0], ports: ["8080"]}
    consecutive_failures: 1
    open_duration: 500ms
    open_duration_multiplier: 2
    max_open_duration: 2s
    jitter: 0
    probe_timeout: 3s
    connect_timeout: 1s
`)
	w.start()
	deadline := time.Now().Add(9 * time.Second)
	for time.Now().Before(deadline) {
		w.curl(w.cg, webURL(w))
		time.Sleep(100 * time.Millisecond)
	}
	var got []time.Duration
	for _, e := range w.events() {
		if e.To == "open" {
			got = append(got, e.OpenUntil.Sub(e.Time).Round(100*time.Millisecond))
		}
	}
	want := []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second, 2 * time.Second}
	if len(got) < len(want) {
		t.Fatalf("open periods %v, want at least %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("open periods %v, want them to start %v", got, want)
		}
	}
}

// 5. Slow: handshakes slowed past slow_call_duration open the circuit on
// the slow-call rate.
func TestSlowCalls(t *testing.T) {
	w := newWorld(t, 1, `
targets:
  web:
    match: {cidrs: [SRV0], ports: ["8080"]}
    slow_call_duration: 500ms
    slow_call_rate_threshold: 0.5
    min_requests: 4
    window_size: 10
    consecutive_failures: 0
    open_duration: 1m
`)
	w.serve(0, 8080)
	w.start()
	// Half the requests go through a slowed port forwarded to the same
	// server: the first SYN of each connection is dropped (about 1 s).
	srv := w.topo.Servers[0]
	srv.SlowHandshakes(t, 8080, 1)
	for range 4 {
		if r := w.curl(w.cg, webURL(w)); r.exit != 0 {
			t.Fatalf("slow request: exit %d %s", r.exit, r.out)
		}
	}
	w.waitState("web", "open", 2*time.Second)
	evs := w.events()
	if len(evs) == 0 || evs[len(evs)-1].Reason != "slow_call_rate" || evs[len(evs)-1].SlowRate < 0.5 {
		t.Fatalf("events %+v", evs)
	}
}

// 6. Endpoint scope: five endpoints, three failing, max_ejection_percent
// 40: at most two are ejected, and the third's event says why.
func TestEndpointScope(t *testing.T) {
	w := newWorld(t, 5, `
targets:
  api:
    match: {cidrs: [SRV0, SRV1, SRV2, SRV3, SRV4], ports: ["8080"]}
    scope: endpoint
    max_ejection_percent: 40
    consecutive_failures: 2
    open_duration: 1m
`)
	w.serve(3, 8080)
	w.serve(4, 8080)
	w.start()
	for i := 0; i < 3; i++ {
		for range 3 {
			w.curl(w.cg, fmt.Sprintf("http://%s:8080/", w.topo.Servers[i].IPv4))
		}
	}
	open, kept := 0, ""
	for name, c := range w.circuits() {
		if c.State == "open" {
			open++
		}
		_ = name
	}
	for _, e := range w.events() {
		if e.Reason == "max_ejection_percent" {
			kept = e.Circuit
		}
	}
	if open != 2 || kept != fmt.Sprintf("api/%s:8080", w.topo.Servers[2].IPv4) {
		t.Fatalf("%d endpoints open (want 2), kept-closed event for %q; circuits %+v", open, kept, w.circuits())
	}
	if r := w.curl(w.cg, fmt.Sprintf("http://%s:8080/", w.topo.Servers[3].IPv4)); r.exit != 0 {
		t.Fatalf("a healthy endpoint: exit %d", r.exit)
	}
}

// 7. Thundering herd: 64 clients race at a circuit that has just become
// due: exactly half_open_probes SYNs reach the server.
func TestThunderingHerd(t *testing.T) {
	w := newWorld(t, 1, strings.Replace(strings.Replace(svc, "open_duration: 2s", "open_duration: 1s\n    half_open_probes: 2\n    half_open_success_threshold: 2", 1), "probe_timeout: 3s", "probe_timeout: 30s", 1))
	w.start()
	for range 3 {
		w.curl(w.cg, webURL(w))
	}
	w.waitState("web", "open", 2*time.Second)
	srv := w.topo.Servers[0]
	// The host now swallows SYNs, so the probes stay in flight (a refused
	// probe would reopen the circuit at once) while the herd races.
	srv.DropSYNs(t, 8080)
	syns := srv.SYNs(t)
	time.Sleep(1100 * time.Millisecond)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 64 {
		wg.Go(func() {
			<-start
			// Give up before the first SYN retransmission (1 s).
			w.curl(w.cg, webURL(w), "--connect-timeout", "0.5")
		})
	}
	close(start)
	wg.Wait()
	if n := srv.SYNs(t) - syns; n != 2 {
		t.Fatalf("%d SYNs reached the server from 64 racing clients, want exactly half_open_probes (2)", n)
	}
}

// 8. Shadow mode: nothing is rejected; metrics and log show what would
// have been.
func TestShadowMode(t *testing.T) {
	w := newWorld(t, 1, "mode: shadow\n"+svc)
	w.start()
	srv := w.topo.Servers[0]
	for range 3 {
		w.curl(w.cg, webURL(w))
	}
	w.waitState("web", "open", 2*time.Second)
	syns := srv.SYNs(t)
	for range 4 {
		if r := w.curl(w.cg, webURL(w)); r.exit != 7 {
			t.Fatalf("exit %d", r.exit)
		}
	}
	if n := srv.SYNs(t) - syns; n != 4 {
		t.Fatalf("shadow mode let %d of 4 SYNs through", n)
	}
	if m := w.metrics(); !strings.Contains(m, `breakerd_kernel_shadow_rejections_total{target="web"} 4`) || !strings.Contains(m, `breakerd_kernel_rejections_total{target="web"} 0`) {
		t.Fatalf("metrics:\n%s", m)
	}
	if !strings.Contains(w.logs.String(), "to=open") {
		t.Fatal("the would-be transition is not logged")
	}
}

// 9. Isolation: a client outside the protected cgroup is never rejected.
func TestIsolation(t *testing.T) {
	w := newWorld(t, 1, strings.Replace(svc, "open_duration: 2s", "open_duration: 1m", 1))
	w.start()
	for range 3 {
		w.curl(w.cg, webURL(w))
	}
	w.waitState("web", "open", 2*time.Second)
	srv := w.topo.Servers[0]
	syns := srv.SYNs(t)
	for range 3 {
		w.curl(nil, webURL(w))
	}
	if n := srv.SYNs(t) - syns; n != 3 {
		t.Fatalf("%d of 3 SYNs from outside the cgroup reached the host", n)
	}
}

// 10. Crash and restart: SIGKILL with a circuit open lets traffic flow
// after the fail-safe timeout; a restart adopts the open circuit; SIGTERM +
// start leaves no gap.
func TestCrashAndRestart(t *testing.T) {
	w := newWorld(t, 1, strings.Replace(strings.Replace(svc, "open_duration: 2s", "open_duration: 1m", 1), "failsafe_timeout: 2s", "failsafe_timeout: 1s", 1))
	w.start()
	srv := w.topo.Servers[0]
	for range 3 {
		w.curl(w.cg, webURL(w))
	}
	w.waitState("web", "open", 2*time.Second)
	w.signal(syscall.SIGKILL)
	time.Sleep(1300 * time.Millisecond)
	syns := srv.SYNs(t)
	w.curl(w.cg, webURL(w))
	if n := srv.SYNs(t) - syns; n != 1 {
		t.Fatalf("after SIGKILL and the fail-safe timeout %d SYNs got out, want 1", n)
	}
	w.start()
	if w.circuits()["web"].State != "open" {
		t.Fatalf("restart did not adopt the open circuit: %+v", w.circuits())
	}
	// For the planned restart, a fail-safe that outlasts it (a ConfigMap
	// change, reloaded live).
	w.swapConfig(strings.Replace(strings.Replace(svc, "open_duration: 2s", "open_duration: 1m", 1), "failsafe_timeout: 2s", "failsafe_timeout: 30s", 1))
	if !kerneltest.WaitFor(3*time.Second, func() bool { return strings.Contains(w.logs.String(), "configuration reloaded") }) {
		t.Fatalf("reload not seen:\n%s", w.logs.String())
	}
	// SIGTERM + start under a hammering client: rejected throughout.
	var res []kerneltest.DialResult
	var done atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		res = w.topo.Client.Dial(t, w.cg, kerneltest.DialSpec{Network: "tcp4", Addr: srvAddr(w), Count: 400000, Parallel: 2})
		done.Store(true)
	})
	time.Sleep(100 * time.Millisecond)
	w.signal(syscall.SIGTERM)
	w.start()
	if done.Load() {
		t.Fatal("the client finished before the restart (raise Count)")
	}
	wg.Wait()
	for _, r := range res {
		if r.Errno != unix.ECONNREFUSED {
			t.Fatalf("a connect saw %v during SIGTERM + start", r.Errno)
		}
	}
	if n := srv.SYNs(t) - syns; n != 1 {
		t.Fatalf("%d SYNs got out during the restart", n-1)
	}
}

// 11. Reload: a bad ConfigMap-style swap is refused with the key path in
// the log, the old configuration and circuit state stay; a good one takes
// effect without a restart.
func TestReload(t *testing.T) {
	cfg := strings.Replace(svc, "open_duration: 2s", "open_duration: 1m", 1)
	w := newWorld(t, 1, cfg)
	w.start()
	for range 3 {
		w.curl(w.cg, webURL(w))
	}
	w.waitState("web", "open", 2*time.Second)
	w.swapConfig(cfg + "    min_requests: 500\n")
	if !kerneltest.WaitFor(3*time.Second, func() bool {
		return strings.Contains(w.logs.String(), "targets.web.min_requests: 500 exceeds window_size 20")
	}) {
		t.Fatalf("bad swap not refused with its key path:\n%s", w.logs.String())
	}
	if c := w.circuits()["web"]; c.State != "open" {
		t.Fatalf("bad reload changed the circuit: %+v", c)
	}
	if !strings.Contains(w.metrics(), "breakerd_config_last_reload_successful 0") {
		t.Fatal("reload failure not in metrics")
	}
	w.swapConfig(cfg + "  db:\n    match: {cidrs: [SRV0], ports: [\"6379\"]}\n    state: forced_open\n")
	if !kerneltest.WaitFor(3*time.Second, func() bool { return w.circuits()["db"].State == "forced_open" }) {
		t.Fatalf("good swap not applied:\n%s", w.logs.String())
	}
	if c := w.circuits()["web"]; c.State != "open" {
		t.Fatalf("an unchanged target lost its state: %+v", c)
	}
}

// Redis: a long-lived-connection client and a reconnect storm against a
// dead server fail fast once the circuit is open.
func TestRedisReconnectStorm(t *testing.T) {
	need(t, "redis-server", "redis-cli", "redis-benchmark")
	w := newWorld(t, 1, `
targets:
  redis:
    match: {cidrs: [SRV0], ports: ["6379"]}
    consecutive_failures: 5
    open_duration: 1m
`)
	srv := w.topo.Servers[0]
	rs := srv.Command(nil, "redis-server", "--port", "6379", "--bind", "0.0.0.0", "--save", "", "--appendonly", "no", "--protected-mode", "no")
	if err := rs.Start(t); err != nil {
		t.Fatal(err)
	}
	w.start()
	ip := srv.IPv4.String()
	ok := kerneltest.WaitFor(5*time.Second, func() bool {
		out, _ := w.topo.Client.Command(w.cg, "timeout", "5", "redis-cli", "-h", ip, "PING").Run(t)
		return strings.Contains(string(out), "PONG")
	})
	if !ok {
		t.Fatal("redis not up")
	}
	rs.Cmd.Process.Kill()
	rs.Cmd.Wait()
	// A storm of reconnects: 50 clients, 2000 requests. redis-benchmark
	// retries a dead server forever, so it is bounded to 5 s.
	t0 := time.Now()
	out, _ := w.topo.Client.Command(w.cg, "timeout", "-s", "KILL", "5", "redis-benchmark", "-h", ip, "-c", "50", "-n", "2000", "-t", "ping", "-q").Run(t)
	elapsed := time.Since(t0)
	w.waitState("redis", "open", 2*time.Second)
	syns := srv.SYNs(t)
	for range 5 {
		out, _ := w.topo.Client.Command(w.cg, "timeout", "5", "redis-cli", "-h", ip, "PING").Run(t)
		if !strings.Contains(string(out), "Connection refused") {
			t.Fatalf("redis-cli at an open circuit: %s", out)
		}
	}
	if n := srv.SYNs(t) - syns; n != 0 {
		t.Fatalf("%d SYNs reached the dead redis host while open", n)
	}
	t.Logf("redis-benchmark storm against the dead server ended in %v: %s", elapsed, strings.TrimSpace(string(out)))
}

// UDP: dig against a forced-open UDP target never sends a datagram.
func TestForcedOpenUDP(t *testing.T) {
	need(t, "dig")
	w := newWorld(t, 1, `
targets:
  dns:
    match: {cidrs: [SRV0], ports: ["5353"], protocol: udp}
    state: forced_open
`)
	w.topo.Servers[0].ListenPacket(t, "udp", 5353)
	w.start()
	out, err := w.topo.Client.Command(w.cg, "timeout", "10", "dig", "@"+w.topo.Servers[0].IPv4.String(), "-p", "5353", "+tries=1", "+time=1", "breakerd.test").Run(t)
	if err == nil {
		t.Fatalf("dig succeeded against a forced-open target: %s", out)
	}
	if n := w.topo.Servers[0].UDPDatagrams(t); n != 0 {
		t.Fatalf("%d datagrams reached a forced-open UDP target (dig said %s)", n, out)
	}
}

func srvAddr(w *world) netip.AddrPort { return netip.AddrPortFrom(w.topo.Servers[0].IPv4, 8080) }

// 12. Observability with real parts: a real Prometheus scrapes breakerd
// every second; PromQL through its HTTP API returns the open circuit and
// the rejection rate. (The alerting rules are checked with promtool in
// package deploy.)
func TestPrometheusScrapes(t *testing.T) {
	need(t, "prometheus")
	w := newWorld(t, 1, strings.Replace(svc, "open_duration: 2s", "open_duration: 1m", 1))
	w.start()
	dir := t.TempDir()
	promAddr := kerneltest.FreeLoopbackAddr(t)
	conf := filepath.Join(dir, "prometheus.yml")
	os.WriteFile(conf, []byte(fmt.Sprintf(`global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: breakerd
    static_configs: [{targets: ["%s"]}]
`, w.admin)), 0o644)
	prom := exec.Command("prometheus", "--config.file="+conf, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+promAddr, "--log.level=warn")
	if err := prom.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prom.Process.Kill(); prom.Wait() })
	for range 3 {
		w.curl(w.cg, webURL(w))
	}
	w.waitState("web", "open", 2*time.Second)
	stop := time.Now().Add(20 * time.Second)
	query := func(q string) (float64, bool) {
		resp, err := http.Get("http://" + promAddr + "/api/v1/query?query=" + url.QueryEscape(q))
		if err != nil {
			return 0, false
		}
		defer resp.Body.Close()
		var r struct {
			Data struct {
				Result []struct {
					Value [2]any `json:"value"`
				} `json:"result"`
			} `json:"data"`
		}
		if json.NewDecoder(resp.Body).Decode(&r) != nil || len(r.Data.Result) == 0 {
			return 0, false
		}
		var v float64
		fmt.Sscan(r.Data.Result[0].Value[1].(string), &v)
		return v, true
	}
	var open, rate float64
	for time.Now().Before(stop) {
		w.curl(w.cg, webURL(w))
		var ok1, ok2 bool
		open, ok1 = query(`breakerd_circuit_state{target="web",state="open"}`)
		rate, ok2 = query(`rate(breakerd_kernel_rejections_total{target="web"}[5s])`)
		if ok1 && ok2 && open == 1 && rate > 0 {
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Fatalf("PromQL: open=%v rejection rate=%v", open, rate)
}
