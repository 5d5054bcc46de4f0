package fleet

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// The scale test is opt-in: it runs a thousand writers and informers on
// this machine's two cores for a minute, which CI's budget has no room
// for. Run it alone, under the shared lock:
//
//	BREAKERD_FLEET_SCALE=1 flock /tmp/breakerd-heavy.lock \
//	  go test -count=1 -v -timeout 30m -run 'TestFleetScale|TestFleetReportSize' ./fleet
const (
	// scaleEnv set (to anything) runs TestFleetScale and TestFleetReportSize.
	scaleEnv = "BREAKERD_FLEET_SCALE"
	// scaleNodesEnv is how many nodes TestFleetScale simulates (1000).
	scaleNodesEnv = "BREAKERD_FLEET_SCALE_NODES"
	// scaleSpreadEnv is the time over which the nodes would trip on their
	// own evidence, one by one (a Go duration, 5s).
	scaleSpreadEnv = "BREAKERD_FLEET_SCALE_SPREAD"
)

// simProcess names this process, the simulated nodes, in the figures.
const simProcess = "nodes (this process)"

// The failing dependency, and the quorum every node judges it by.
const (
	scaleKey    = "tcp/203.0.113.10:443"
	scaleQuorum = 2
)

func requireScale(t *testing.T) {
	t.Helper()
	if os.Getenv(scaleEnv) == "" {
		t.Skipf("opt-in: %s=1 runs the fleet's scale measurement (a minute of both cores)", scaleEnv)
	}
}

// TestFleetScale simulates a fleet of N nodes (default 1,000) in this
// process against a real API server with the shipped CRD, admission
// policy and RBAC, each node speaking the protocol the daemon speaks: its
// own pod-bound token, its own Writer of its own report, its own Watcher
// (an informer: list, then watch) feeding its own Tally.
//
// One dependency fails fleet-wide. Each node would trip on its own
// evidence at its moment, spread over a few seconds in a random order;
// a node that already sees the quorum then follows (it writes nothing, as
// the daemon does), the others trip and write a report of one circuit.
// Once every node sees the quorum, the reporting nodes recover and clear
// their reports at once, and every follower must see the key fall below
// the quorum.
//
// It measures, and logs as a table: the writes the API server took (and
// how fast), the watch events delivered (counted by the nodes and by the
// API server, with their bytes), the API server's and etcd's CPU time and
// resident memory from /proc, and the time from the quorum's second write
// to each follower's Tally seeing it, at failure and at recovery. It
// asserts what the protocol promises: one write per reporting node and
// transition (coalesced; a write that fails is retried and counted), and
// every node following.
//
// The nodes' clients share two TLS transports, one for the watches and
// one for the writes (client-go caches transports by TLS configuration;
// the bearer token sits above it), so N nodes cost this process a few
// connections, not N: the API server still authenticates, authorizes and
// admits every request under its node's own token.
func TestFleetScale(t *testing.T) {
	requireScale(t)
	n := envPositive(t, scaleNodesEnv, 1000, strconv.Atoi)
	spread := envPositive(t, scaleSpreadEnv, 5*time.Second, time.ParseDuration)
	if n < scaleQuorum+1 {
		t.Fatalf("%s=%d: the scenario needs at least %d nodes", scaleNodesEnv, n, scaleQuorum+1)
	}
	f := startFleetAPI(t)
	procs := map[string]int{"kube-apiserver": f.api.PID("kube-apiserver"), "etcd": f.api.PID("etcd"), simProcess: os.Getpid()}
	for name, pid := range procs {
		if pid == 0 {
			t.Fatalf("no PID for %s", name)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.WaitGroup
	t.Cleanup(func() { cancel(); running.Wait() })

	// Nodes, pods and tokens: three requests per node, made in parallel
	// with a client that is not rate limited.
	setupStart := time.Now()
	suffix := strings.ToLower(kerneltest.UniqueName())
	tokens := makeNodeTokens(t, f, n, suffix)
	t.Logf("%d nodes, pods and pod-bound tokens made in %v", n, time.Since(setupStart).Round(time.Millisecond))

	var writes writeLog
	before := sampleProcs(t, procs)
	nodes := make([]*simNode, n)
	for i := range nodes {
		node, err := newSimNode(f.api.TokenConfig(tokens[i].token), tokens[i].node, &writes)
		if err != nil {
			t.Fatal(err)
		}
		nodes[i] = node
		running.Add(2)
		go func() { defer running.Done(); node.writer.Run(ctx) }()
		go func() { defer running.Done(); node.watcher.Run(ctx) }()
	}
	if !kerneltest.WaitFor(5*time.Minute, func() bool {
		return !slices.ContainsFunc(nodes, func(n *simNode) bool { return !n.watcher.Synced() })
	}) {
		t.Fatalf("the %d informers have not listed within 5 minutes", n)
	}
	watching := sampleProcs(t, procs)
	t.Logf("%d informers listed and watching in %v; this process holds %d sockets", n,
		watching.at.Sub(before.at).Round(time.Millisecond), countSockets(t))

	// Other work on the machine slows every process here: the load
	// average says how much.
	loadStart := loadAverage(t)

	// Failure: node order[k] would trip at start + k·spread/n.
	rng := rand.New(rand.NewPCG(1, uint64(n)))
	order := rng.Perm(n)
	failure := startPhase(t, f, procs, nodes)
	start := time.Now()
	var reporters, followers []*simNode
	for k, i := range order {
		time.Sleep(time.Until(start.Add(spread * time.Duration(k) / time.Duration(n))))
		node := nodes[i]
		if node.sawQuorum() {
			followers = append(followers, node)
			continue
		}
		reporters = append(reporters, node)
		now := time.Now()
		node.writer.Set([]Circuit{{Key: scaleKey, Target: "all", Workload: "shared", Since: metav1.NewMicroTime(now),
			OpenUntil: metav1.NewMicroTime(now.Add(10 * time.Minute)), Reason: "consecutive_failures"}})
	}
	if !kerneltest.WaitFor(time.Minute, func() bool { return writes.count(true) == len(reporters) }) {
		t.Fatalf("%d of %d reports written within a minute", writes.count(true), len(reporters))
	}
	// Everyone but the quorum's two sees the quorum (those two do only
	// when a third node reports: a Tally counts other nodes).
	quorumAt, quorumNodes := writes.quorum(true, scaleQuorum)
	watchers := slices.DeleteFunc(slices.Clone(nodes), func(n *simNode) bool { return slices.Contains(quorumNodes, n.name) })
	if !kerneltest.WaitFor(time.Minute, func() bool { return allSee(watchers, (*simNode).openedAt) }) {
		t.Fatalf("not every node sees the quorum within a minute of the last write")
	}
	// A phase ends when every node has every event of its writes (each
	// write is one event to each of the n informers, the writer's own
	// included), so that its events, CPU and bytes are its own.
	delivered := func(writes int) {
		t.Helper()
		if !kerneltest.WaitFor(time.Minute, func() bool { return countEvents(nodes) >= writes*n }) {
			t.Fatalf("%d watch events delivered within a minute, want %d writes × %d nodes", countEvents(nodes), writes, n)
		}
	}
	delivered(len(reporters))
	failed := failure.end(t)
	openLatency := latencies(watchers, (*simNode).openedAt, quorumAt)

	// Recovery: every reporting node closes at once; the followers close
	// when fewer than the quorum of reports have the key open.
	recovery := startPhase(t, f, procs, nodes)
	for _, node := range reporters {
		node.writer.Set(nil)
	}
	if !kerneltest.WaitFor(time.Minute, func() bool { return writes.count(false) == len(reporters) }) {
		t.Fatalf("%d of %d cleared reports written within a minute", writes.count(false), len(reporters))
	}
	belowAt, _ := writes.quorum(false, len(reporters)-scaleQuorum+1)
	if !kerneltest.WaitFor(time.Minute, func() bool { return allSee(followers, (*simNode).closedAt) }) {
		t.Fatalf("not every follower sees the key close within a minute of the last write")
	}
	delivered(2 * len(reporters))
	recovered := recovery.end(t)
	closeLatency := latencies(followers, (*simNode).closedAt, belowAt)

	// A write that fails (a timeout, on a loaded machine) is retried with
	// the latest set, so each reporting node still writes its opening and
	// its clearing once: a failure is a figure, not an error.
	var writeErrors uint64
	for _, node := range nodes {
		writeErrors += node.writer.Stats().Errors
	}
	if want := 2 * len(reporters); writes.total() != want {
		t.Errorf("%d writes, want %d (one per reporting node and transition)", writes.total(), want)
	}
	t.Log("\n" + scaleRun{
		nodes: n, reported: len(reporters), followed: len(followers), spread: spread,
		loadStart: loadStart, loadEnd: loadAverage(t), writeErrors: writeErrors,
		before: before, watching: watching, writes: &writes,
		failure: failed, recovery: recovered, openLatency: openLatency, closeLatency: closeLatency,
	}.String())
}

// scaleRun is what TestFleetScale measured, for its log.
type scaleRun struct {
	nodes, reported, followed int
	spread                    time.Duration
	loadStart, loadEnd        string
	writeErrors               uint64
	before, watching          procSample // before the informers started, and once they listed
	writes                    *writeLog
	failure, recovery         phaseResult
	openLatency, closeLatency []time.Duration
}

// String formats the run as a table, a phase a line, and its notes.
func (r scaleRun) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "fleet scale: %d nodes (%d reported, %d followed), quorum %d, trips spread over %v\n",
		r.nodes, r.reported, r.followed, scaleQuorum, r.spread)
	fmt.Fprintf(&b, "load average %s at the start, %s at the end; %d writes failed and were retried (timeouts of %v)\n",
		r.loadStart, r.loadEnd, r.writeErrors, writeTimeout)
	fmt.Fprintf(&b, "set-up with %d informers watching: kube-apiserver RSS %s → %s, etcd RSS %s → %s\n", r.nodes,
		mib(r.before.rss["kube-apiserver"]), mib(r.watching.rss["kube-apiserver"]), mib(r.before.rss["etcd"]), mib(r.watching.rss["etcd"]))
	fmt.Fprintf(&b, "%-9s %5s %7s %9s %9s %9s %7s %6s %6s %6s %6s %s\n", "phase", "wall", "writes", "mean/peak", "apply p99",
		"events", "event B", "per s", "p50", "p99", "max", "CPU time over the phase / peak RSS")
	for _, p := range []struct {
		name  string
		usage phaseResult
		open  bool
		lat   []time.Duration
	}{{"failure", r.failure, true, r.openLatency}, {"recovery", r.recovery, false, r.closeLatency}} {
		w := r.writes.phase(p.open)
		fmt.Fprintf(&b, "%-9s %5.1f %7d %4.0f/%-4d %9v %9d %7.0f %6.0f %6v %6v %6v %s\n", p.name, p.usage.wall.Seconds(), len(w),
			writeRate(w), peakRate(w),
			percentile(applyTimes(w), 99), p.usage.events, p.usage.eventBytes/max(p.usage.apiEvents, 1),
			float64(p.usage.events)/p.usage.wall.Seconds(),
			percentile(p.lat, 50), percentile(p.lat, 99), percentile(p.lat, 100), p.usage.procs())
	}
	fmt.Fprintf(&b, "CPU per watch event: kube-apiserver %v sent, the nodes %v received (decoded and judged)\n",
		perEvent(r.failure.cpu["kube-apiserver"]+r.recovery.cpu["kube-apiserver"], r.failure.apiEvents+r.recovery.apiEvents),
		perEvent(r.failure.cpu[simProcess]+r.recovery.cpu[simProcess], float64(r.failure.events+r.recovery.events)))
	total := r.writes.total()
	fmt.Fprintf(&b, "events: delivered to the nodes' informers (%d writes × %d nodes = %d);", total, r.nodes, total*r.nodes)
	fmt.Fprintf(&b, " event B: the API server's bytes per event it sent (%.0f and %.0f events,\n"+
		"bookmarks included, %.0f and %.0f bytes); writes mean/peak: per second over the phase's writes, most in one second\n",
		r.failure.apiEvents, r.recovery.apiEvents, r.failure.eventBytes, r.recovery.eventBytes)
	fmt.Fprintf(&b, "latency: from the quorum's second write (request sent) to each other node's Tally at failure (%d nodes);\n"+
		"from the write that left fewer than %d reports (request sent) to each follower's Tally at recovery (%d nodes)",
		len(r.openLatency), scaleQuorum, len(r.closeLatency))
	return b.String()
}

// TestFleetReportSize measures what one report costs: its JSON as the
// Writer sends it, and the object as the API server stores it and sends
// it in every watch event (with the server-side apply's managedFields),
// with one circuit and with MaxCircuits.
func TestFleetReportSize(t *testing.T) {
	requireScale(t)
	f := startFleetAPI(t)
	store, err := NewKubeStore(f.api.Admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	now := time.Now()
	circuit := func(i int) Circuit {
		return Circuit{Key: fmt.Sprintf("tcp/10.%d.%d.%d:443", i/65536%256, i/256%256, i%256), Target: "all", Workload: "shared",
			Since: metav1.NewMicroTime(now), OpenUntil: metav1.NewMicroTime(now.Add(time.Minute)), Reason: "consecutive_failures"}
	}
	for _, size := range []int{1, MaxCircuits} {
		cs := make([]Circuit, size)
		for i := range cs {
			cs[i] = circuit(100_000 + i)
		}
		r := reportOf(fmt.Sprintf("fleet-size-%d", size), cs...)
		u, err := ToUnstructured(r)
		if err != nil {
			t.Fatal(err)
		}
		sent, err := json.Marshal(u.Object)
		if err != nil {
			t.Fatal(err)
		}
		if err := store.Apply(ctx, r); err != nil {
			t.Fatal(err)
		}
		stored, err := f.admin.CoreV1().RESTClient().Get().AbsPath("/apis", Group, Version, Resource, r.Name).DoRaw(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var back CircuitReport
		if err := json.Unmarshal(stored, &back); err != nil || len(back.Spec.Circuits) != size {
			t.Fatalf("read back %d circuits (%v), want %d", len(back.Spec.Circuits), err, size)
		}
		t.Logf("a report of %3d circuits: %6d bytes of JSON applied, %6d bytes as stored and watched (%d per circuit)",
			size, len(sent), len(stored), len(stored)/size)
	}
}

// simNode is one simulated node: a Writer of its own report, and a
// Watcher feeding its own Tally, which it judges after every event as the
// daemon does.
type simNode struct {
	name    string
	writer  *Writer
	watcher *Watcher

	mu     sync.Mutex
	tally  *Tally
	open   bool      // the Tally has the quorum now
	opened time.Time // when it first had it
	closed time.Time // when it first fell below it after that
	events int       // watch events delivered
}

// newSimNode makes a node that authenticates as cfg says. Its writes go
// over a transport of their own, which all the nodes' writes share (the
// configuration differs from the watches' in DisableCompression, which
// client-go's transport cache keys on): on the watches' connections a
// write's response would wait behind the events this process has not yet
// read, and the write's time would measure this process, not the API
// server.
func newSimNode(cfg *rest.Config, name string, writes *writeLog) (*simNode, error) {
	writeCfg := rest.CopyConfig(cfg)
	writeCfg.DisableCompression = true
	store, err := NewKubeStore(writeCfg)
	if err != nil {
		return nil, err
	}
	node := &simNode{name: name, tally: NewTally(name)}
	node.writer = NewWriter(name, &timedStore{store: store, log: writes}, SystemClock{}, nil)
	node.watcher, err = NewWatcher(cfg, node.observe, node.forget, nil)
	if err != nil {
		return nil, err
	}
	return node, nil
}

func (n *simNode) observe(r *CircuitReport) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.events++
	n.tally.Observe(r)
	n.judge()
}

func (n *simNode) forget(node string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.events++
	n.tally.Forget(node)
	n.judge()
}

// judge records when the Tally first has the quorum, and when it first
// falls below it after that.
func (n *simNode) judge() {
	now := time.Now()
	open := len(n.tally.Open(now, func(string) int { return scaleQuorum })) > 0
	switch {
	case open && n.opened.IsZero():
		n.opened = now
	case !open && n.open && n.closed.IsZero():
		n.closed = now
	}
	n.open = open
}

func (n *simNode) sawQuorum() bool { return !n.openedAt().IsZero() }

func (n *simNode) openedAt() time.Time { n.mu.Lock(); defer n.mu.Unlock(); return n.opened }

func (n *simNode) closedAt() time.Time { n.mu.Lock(); defer n.mu.Unlock(); return n.closed }

func (n *simNode) eventCount() int { n.mu.Lock(); defer n.mu.Unlock(); return n.events }

// allSee reports whether at(node) is set for every node.
func allSee(nodes []*simNode, at func(*simNode) time.Time) bool {
	return !slices.ContainsFunc(nodes, func(n *simNode) bool { return at(n).IsZero() })
}

// latencies returns, per node, at(node) − from.
func latencies(nodes []*simNode, at func(*simNode) time.Time, from time.Time) []time.Duration {
	out := make([]time.Duration, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, at(n).Sub(from))
	}
	return out
}

// timedStore records each write that succeeded, with when it was sent
// and when it returned.
type timedStore struct {
	store Store
	log   *writeLog
}

func (s *timedStore) Apply(ctx context.Context, r *CircuitReport) error {
	sent := time.Now()
	err := s.store.Apply(ctx, r)
	if err == nil {
		s.log.add(write{node: r.Name, open: len(r.Spec.Circuits) > 0, sent: sent, done: time.Now()})
	}
	return err
}

// write is one report written: opening (one circuit) or clearing.
type write struct {
	node       string
	open       bool
	sent, done time.Time
}

// writeLog is every write of the run.
type writeLog struct {
	mu     sync.Mutex
	writes []write
}

func (l *writeLog) add(w write) { l.mu.Lock(); l.writes = append(l.writes, w); l.mu.Unlock() }

func (l *writeLog) total() int { l.mu.Lock(); defer l.mu.Unlock(); return len(l.writes) }

func (l *writeLog) count(open bool) int { return len(l.phase(open)) }

// phase returns the opening (or clearing) writes in the order they
// returned.
func (l *writeLog) phase(open bool) []write {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []write
	for _, w := range l.writes {
		if w.open == open {
			out = append(out, w)
		}
	}
	slices.SortFunc(out, func(a, b write) int { return a.done.Compare(b.done) })
	return out
}

// quorum returns when the k-th opening (or clearing) write, by the order
// they returned, was sent, and the nodes of the first k.
func (l *writeLog) quorum(open bool, k int) (time.Time, []string) {
	ws := l.phase(open)
	if len(ws) < k {
		return time.Time{}, nil
	}
	var names []string
	for _, w := range ws[:k] {
		names = append(names, w.node)
	}
	return ws[k-1].sent, names
}

// writeRate is the writes per second from the first sent to the last
// returned.
func writeRate(ws []write) float64 {
	if len(ws) == 0 {
		return 0
	}
	first := slices.MinFunc(ws, func(a, b write) int { return a.sent.Compare(b.sent) }).sent
	return float64(len(ws)) / ws[len(ws)-1].done.Sub(first).Seconds()
}

// peakRate is the most writes that returned within one second.
func peakRate(ws []write) int {
	peak := 0
	for i, w := range ws { // ordered by when they returned
		j := i
		for j < len(ws) && ws[j].done.Sub(w.done) < time.Second {
			j++
		}
		peak = max(peak, j-i)
	}
	return peak
}

func applyTimes(ws []write) []time.Duration {
	out := make([]time.Duration, len(ws))
	for i, w := range ws {
		out[i] = w.done.Sub(w.sent)
	}
	return out
}

// percentile returns the p-th percentile of ds (nearest rank), rounded to
// the millisecond; p = 100 is the maximum.
func percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := max((len(s)*p+99)/100-1, 0)
	return s[i].Round(time.Millisecond)
}

// nodeToken is a simulated node's name and its pod-bound token.
type nodeToken struct{ node, token string }

// makeNodeTokens makes n nodes, their pods and tokens, 16 at a time.
func makeNodeTokens(t *testing.T, f *fleetAPI, n int, suffix string) []nodeToken {
	t.Helper()
	cfg := rest.CopyConfig(f.api.Admin)
	cfg.QPS, cfg.Burst = 10_000, 10_000
	admin, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]nodeToken, n)
	errs := make([]error, n)
	next := make(chan int)
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				out[i].node = fmt.Sprintf("fleet-scale-%04d-%s", i, suffix)
				out[i].token, errs[i] = makeNodeToken(context.Background(), admin, out[i].node)
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// procSample is the CPU time and resident memory of the measured
// processes at one moment.
type procSample struct {
	at  time.Time
	cpu map[string]time.Duration
	rss map[string]int64
}

// sampleProcs reads /proc/PID/stat (user and system time) and
// /proc/PID/status (VmRSS) of each process.
func sampleProcs(t *testing.T, pids map[string]int) procSample {
	t.Helper()
	s := procSample{at: time.Now(), cpu: map[string]time.Duration{}, rss: map[string]int64{}}
	for name, pid := range pids {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Fatalf("CPU time of %s: %v", name, err)
		}
		// The fields after the command's closing parenthesis start at
		// the third (state); utime and stime are the 14th and 15th, in
		// clock ticks of 1/100 s (USER_HZ on Linux).
		fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
		utime, err1 := strconv.ParseInt(fields[11], 10, 64)
		stime, err2 := strconv.ParseInt(fields[12], 10, 64)
		if err1 != nil || err2 != nil {
			t.Fatalf("parsing /proc/%d/stat: %v, %v", pid, err1, err2)
		}
		s.cpu[name] = time.Duration(utime+stime) * 10 * time.Millisecond
		status, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			t.Fatalf("memory of %s: %v", name, err)
		}
		sc := bufio.NewScanner(status)
		for sc.Scan() {
			if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
				kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
				if err != nil {
					t.Fatalf("parsing VmRSS of %s: %v", name, err)
				}
				s.rss[name] = kb << 10
			}
		}
		status.Close()
	}
	return s
}

// phase measures one phase of the run: the processes' CPU time and peak
// memory (sampled every 100 ms), the watch events the nodes counted, and
// the API server's own counts of watch events and their bytes.
type phase struct {
	f      *fleetAPI
	pids   map[string]int
	nodes  []*simNode
	start  procSample
	events int
	api    apiCounts
	peak   map[string]int64
	stop   chan struct{}
	done   chan struct{}
}

// phaseResult is what a phase measured.
type phaseResult struct {
	wall       time.Duration
	cpu        map[string]time.Duration
	peak       map[string]int64
	events     int     // watch events the nodes' informers delivered
	apiEvents  float64 // watch events the API server sent
	eventBytes float64 // and their bytes
}

// procs formats each process's mean CPU use and peak memory.
func (r phaseResult) procs() string {
	var parts []string
	for _, name := range []string{"kube-apiserver", "etcd", simProcess} {
		parts = append(parts, fmt.Sprintf("%s %.1f s = %.2f cores / %s", name, r.cpu[name].Seconds(),
			r.cpu[name].Seconds()/r.wall.Seconds(), mib(r.peak[name])))
	}
	return strings.Join(parts, ", ")
}

func startPhase(t *testing.T, f *fleetAPI, pids map[string]int, nodes []*simNode) *phase {
	t.Helper()
	p := &phase{f: f, pids: pids, nodes: nodes, api: scrapeWatchCounts(t, f), events: countEvents(nodes),
		peak: map[string]int64{}, stop: make(chan struct{}), done: make(chan struct{})}
	p.start = sampleProcs(t, pids)
	go func() {
		defer close(p.done)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			for name, rss := range p.readRSS() {
				p.peak[name] = max(p.peak[name], rss)
			}
			select {
			case <-p.stop:
				return
			case <-tick.C:
			}
		}
	}()
	return p
}

// readRSS is sampleProcs' memory, for the sampling goroutine (which must
// not call t.Fatal): a process that cannot be read is left out.
func (p *phase) readRSS() map[string]int64 {
	out := map[string]int64{}
	for name, pid := range p.pids {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/statm", pid))
		if err != nil {
			continue
		}
		fields := strings.Fields(string(data))
		if pages, err := strconv.ParseInt(fields[1], 10, 64); err == nil {
			out[name] = pages * int64(os.Getpagesize())
		}
	}
	return out
}

func (p *phase) end(t *testing.T) phaseResult {
	t.Helper()
	close(p.stop)
	<-p.done
	end := sampleProcs(t, p.pids)
	api := scrapeWatchCounts(t, p.f)
	r := phaseResult{wall: end.at.Sub(p.start.at), cpu: map[string]time.Duration{}, peak: p.peak,
		events: countEvents(p.nodes) - p.events, apiEvents: api.events - p.api.events, eventBytes: api.bytes - p.api.bytes}
	for name := range p.pids {
		r.cpu[name] = end.cpu[name] - p.start.cpu[name]
		r.peak[name] = max(r.peak[name], end.rss[name])
	}
	return r
}

func countEvents(nodes []*simNode) int {
	total := 0
	for _, n := range nodes {
		total += n.eventCount()
	}
	return total
}

// apiCounts are the API server's counters of watch events sent for
// CircuitReports, and their bytes.
type apiCounts struct{ events, bytes float64 }

// scrapeWatchCounts reads apiserver_watch_events_total and
// apiserver_watch_events_sizes_sum for circuitreports from /metrics.
func scrapeWatchCounts(t *testing.T, f *fleetAPI) apiCounts {
	t.Helper()
	raw, err := f.admin.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
	if err != nil {
		t.Fatalf("scraping the API server's metrics: %v", err)
	}
	var c apiCounts
	for _, line := range strings.Split(string(raw), "\n") {
		if !strings.Contains(line, `resource="`+Resource+`"`) {
			continue
		}
		name, _, _ := strings.Cut(line, "{")
		value, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			t.Fatalf("parsing the metric line %q: %v", line, err)
		}
		switch name {
		case "apiserver_watch_events_total":
			c.events += value
		case "apiserver_watch_events_sizes_sum":
			c.bytes += value
		}
	}
	return c
}

// countSockets counts this process's open sockets (its connections to
// the API server, mostly).
func countSockets(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, fd := range fds {
		if target, err := os.Readlink("/proc/self/fd/" + fd.Name()); err == nil && strings.HasPrefix(target, "socket:") {
			n++
		}
	}
	return n
}

// perEvent is cpu divided among events, to the microsecond.
func perEvent(cpu time.Duration, events float64) time.Duration {
	return time.Duration(float64(cpu) / max(events, 1)).Round(time.Microsecond)
}

// loadAverage is the machine's load average over the last minute.
func loadAverage(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(data))[0]
}

func mib(b int64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

// envPositive returns the environment variable name as parse reads it,
// or def when it is unset; a value that does not parse or is not positive
// fails the test.
func envPositive[T int | time.Duration](t *testing.T, name string, def T, parse func(string) (T, error)) T {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := parse(s)
	if err != nil || v <= 0 {
		t.Fatalf("%s=%q: want a positive value (%v)", name, s, err)
	}
	return v
}
