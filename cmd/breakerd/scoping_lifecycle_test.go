package main

import (
	"os"
	"path/filepath"
	"slices"
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

// The lifecycle invariants with workloads selected: a selected process is
// never rejected on its healthy destination and always on the open
// circuit; an unselected sibling is never rejected at all and never counted
// in a bulkhead; the workloads map holds exactly the selected cgroups (sel
// and sel2, sharing circuits) and the cgroup of a target's source pattern
// (pat, whose pool has a limit of its own); each workload has its own
// bulkhead, sel and sel2 included, counting exactly its own sockets; the
// rejections map holds exactly one entry per rejected cgroup (sel and sel2
// under the one shared open circuit, pat under its own), under the id and
// epoch of that circuit's verdict, counting exactly the rejections the
// client saw, and one per cgroup its pool's bulkhead turned away (sel and
// sel2 each under its workload's bulkhead slot, pat under its own
// circuit's), under the id and epoch of that pool limit, counting exactly
// the bulkhead rejections the client saw, apart. Checked across a SIGTERM
// restart, reloads, a SIGKILL and a second start on the same pins.
const scopedLifecycleConfig = lifecycleConfig + `  pool-p:
    source: ["cgroup:CGROUP/pat"]
    match: {cidrs: [SRV], ports: ["8501"]}
    consecutive_failures: 1000
    max_connections: 2
workloads:
  - name: sel
    cgroups: [CGROUP/sel]
  - name: sel2
    cgroups: [CGROUP/sel2]
`

type scopedLoop struct {
	healthyRejected, openAdmitted, unselRejected, rounds atomic.Int64
	openRejected                                         map[*kerneltest.Cgroup]uint64 // under mu
	bulkRejected                                         map[*kerneltest.Cgroup]uint64 // by the pools' bulkheads, under mu
	stop                                                 atomic.Bool
	wg                                                   sync.WaitGroup
	mu                                                   sync.Mutex // held for a round: check reads the counts between rounds
}

func TestLifecycleScoped(t *testing.T) {
	l := newLifecycle(t)
	root, err := kerneltest.CgroupV2Mount()
	if err != nil {
		t.Fatal(err)
	}
	rel, _ := filepath.Rel(root, l.cg.Path)
	cfg := strings.ReplaceAll(scopedLifecycleConfig, "CGROUP", rel)
	l.writeConfig(cfg)
	sel, unsel, pat, sel2 := l.cg.Child(t, "sel"), l.cg.Child(t, "unsel"), l.cg.Child(t, "pat"), l.cg.Child(t, "sel2")
	selID, err := sel.ID()
	if err != nil {
		t.Fatal(err)
	}
	sel2ID, err := sel2.ID()
	if err != nil {
		t.Fatal(err)
	}
	patID, err := pat.ID()
	if err != nil {
		t.Fatal(err)
	}
	p := l.start()

	lp := scopedLoop{openRejected: map[*kerneltest.Cgroup]uint64{}, bulkRejected: map[*kerneltest.Cgroup]uint64{}}
	lp.wg.Go(func() {
		for !lp.stop.Load() {
			lp.mu.Lock()
			for _, cg := range []*kerneltest.Cgroup{sel, sel2, pat} {
				for _, r := range l.topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.web.Addr, Count: 10}) {
					if r.Errno != 0 {
						lp.healthyRejected.Add(1)
					}
				}
				for _, r := range l.topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.down.Addr, Count: 10}) {
					if r.Errno != unix.EHOSTUNREACH {
						lp.openAdmitted.Add(1)
					} else {
						lp.openRejected[cg]++
					}
				}
			}
			for _, r := range l.topo.Client.Dial(t, unsel, kerneltest.DialSpec{Network: "tcp4", Addr: l.down.Addr, Count: 10}) {
				if r.Errno != 0 {
					lp.unselRejected.Add(1)
				}
			}
			lp.rounds.Add(1)
			lp.mu.Unlock()
		}
	})
	t.Cleanup(func() { lp.stop.Store(true); lp.wg.Wait() })

	// The unselected sibling holds 5 connections to the limited pool (3):
	// none is counted, so the selected process still gets its 3.
	uholder := l.topo.Client.StartDial(t, unsel, kerneltest.DialSpec{Network: "tcp4", Addr: l.pool.Addr, Count: 5, Parallel: 5, Hold: time.Minute})
	holder := l.topo.Client.StartDial(t, sel, kerneltest.DialSpec{Network: "tcp4", Addr: l.pool.Addr, Count: 3, Parallel: 3, Hold: time.Minute})
	// The pattern's workload holds its own limit of 2 to the same pool,
	// and sel2, sharing the pool's circuit with sel, its own 3.
	pholder := l.topo.Client.StartDial(t, pat, kerneltest.DialSpec{Network: "tcp4", Addr: l.pool.Addr, Count: 2, Parallel: 2, Hold: time.Minute})
	s2holder := l.topo.Client.StartDial(t, sel2, kerneltest.DialSpec{Network: "tcp4", Addr: l.pool.Addr, Count: 3, Parallel: 3, Hold: time.Minute})
	t.Cleanup(func() {
		for _, h := range []*kerneltest.Process{uholder, holder, pholder, s2holder} {
			h.Cmd.Process.Kill()
			h.Cmd.Wait()
		}
	})

	check := func(step string) {
		t.Helper()
		before := lp.rounds.Load()
		if !kerneltest.WaitFor(15*time.Second, func() bool { return lp.rounds.Load() >= before+2 }) {
			t.Fatalf("%s: the client loop made no progress", step)
		}
		if n := lp.healthyRejected.Load(); n != 0 {
			t.Fatalf("%s: %d connects of the selected process to the healthy destination were rejected", step, n)
		}
		if n := lp.openAdmitted.Load(); n != 0 {
			t.Fatalf("%s: %d connects of the selected process to the open circuit got through", step, n)
		}
		if n := lp.unselRejected.Load(); n != 0 {
			t.Fatalf("%s: %d connects of the unselected process were rejected", step, n)
		}
		v, err := maps.OpenPinned(l.bpffs)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		defer v.Close()
		w, err := v.Workloads()
		if err != nil || len(w) != 3 || w[selID] != 0 || w[sel2ID] != 0 || w[patID] == 0 {
			t.Fatalf("%s: workloads map %v (%v), want exactly the selected cgroups %d and %d (shared, class 0) and pat %d (a class of its own)", step, w, err, selID, sel2ID, patID)
		}
		bulk, err := v.WorkloadBulkheads()
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		selPool, sel2Pool, patPool := l.pool, l.pool, l.pool
		selPool.Class, sel2Pool.Class, patPool.Class = bulk[selID], bulk[sel2ID], w[patID]
		if selPool.Class == sel2Pool.Class {
			t.Fatalf("%s: sel and sel2 share bulkhead class %d", step, selPool.Class)
		}
		all, err := v.AllLimits()
		if err != nil || len(all) != 3 {
			t.Fatalf("%s: pinned limits %v (%v), want the pool's of sel, sel2 and pat only", step, all, err)
		}
		lp.mu.Lock()
		rejected := map[*kerneltest.Cgroup]uint64{sel: lp.openRejected[sel], sel2: lp.openRejected[sel2], pat: lp.openRejected[pat]}
		bulkRejected := map[*kerneltest.Cgroup]uint64{sel: lp.bulkRejected[sel], sel2: lp.bulkRejected[sel2], pat: lp.bulkRejected[pat]}
		rs, err := v.Rejections()
		lp.mu.Unlock()
		wantEntries := 3
		for _, n := range bulkRejected {
			if n > 0 {
				wantEntries++
			}
		}
		if err != nil || len(rs) != wantEntries {
			t.Fatalf("%s: rejections map %+v (%v), want %d entries: one each for sel, sel2 and pat, and one for each the pool's bulkhead turned away (%v)", step, rs, err, wantEntries, bulkRejected)
		}
		for _, who := range []struct {
			cg   *kerneltest.Cgroup
			id   uint64
			pool maps.Dest
		}{{sel, selID, selPool}, {sel2, sel2ID, sel2Pool}, {pat, patID, patPool}} {
			down := l.down
			down.Class = w[who.id] // pat's connects have circuits of its class
			dv, ok, verr := v.Verdict(down)
			i := slices.IndexFunc(rs, func(r maps.Rejection) bool {
				return r.CgroupID == who.id && r.CircuitID == dv.CircuitID && r.Epoch == dv.Epoch
			})
			if verr != nil || !ok || dv.Epoch == 0 || i < 0 || rs[i].Rejected != rejected[who.cg] || rs[i].BulkheadRejected != 0 {
				t.Fatalf("%s: rejections map %+v, verdict %+v (%v); want cgroup %d's entry under the verdict's id and epoch with %d rejections, as the client saw", step, rs, dv, verr, who.id, rejected[who.cg])
			}
			lim := all[who.pool]
			j := slices.IndexFunc(rs, func(r maps.Rejection) bool {
				return r.CgroupID == who.id && r.CircuitID == lim.Slot && r.Epoch == lim.Epoch
			})
			if lim.Epoch == 0 || (bulkRejected[who.cg] == 0) != (j < 0) || (j >= 0 && (rs[j].BulkheadRejected != bulkRejected[who.cg] || rs[j].Rejected != 0)) {
				t.Fatalf("%s: rejections map %+v, pool limit %+v; want cgroup %d's entry under the limit's slot and epoch with %d bulkhead rejections, as the client saw", step, rs, lim, who.id, bulkRejected[who.cg])
			}
		}
		for _, want := range []struct {
			who  string
			dst  maps.Dest
			held int64
		}{{"sel", selPool, 3}, {"sel2", sel2Pool, 3}, {"pat", patPool, 2}} {
			lim, ok := all[want.dst]
			if !ok {
				t.Fatalf("%s: no pinned limit of %s (%v) in %v", step, want.who, want.dst, all)
			}
			var got maps.BulkCount
			if !kerneltest.WaitFor(3*time.Second, func() bool { got, _ = v.BulkCount(lim.Slot); return got.Connections == want.held }) {
				t.Fatalf("%s: %s's pool slot counts %+v; it holds %d (the unselected process's 5 must not count)", step, want.who, got, want.held)
			}
		}
	}
	check("start")
	// Over their pools' limits (each holds its limit): sel once, sel2
	// twice, pat three times.
	overPools := func(step string) {
		t.Helper()
		for i, cg := range []*kerneltest.Cgroup{sel, sel2, pat} {
			lp.mu.Lock()
			got := errnos(l.topo.Client.Dial(t, cg, kerneltest.DialSpec{Network: "tcp4", Addr: l.pool.Addr, Count: i + 1}))
			lp.bulkRejected[cg] += uint64(got[unix.EAGAIN])
			lp.mu.Unlock()
			if got[unix.EAGAIN] != i+1 {
				t.Fatalf("%s: %s over its pool's limit: %v, want %d × EAGAIN", step, cg.Path, got, i+1)
			}
		}
	}
	overPools("running")
	check("over the pools' limits")

	l.sigterm(p)
	overPools("between SIGTERM and the next start") // the pinned programs count them
	p = l.start()
	check("SIGTERM restart")

	for range 6 {
		l.writeConfig(cfg)
		l.reload(p)
	}
	check("reloads")

	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
	overPools("after SIGKILL")
	check("SIGKILL (pins enforce on their own)")
	p = l.start()
	check("start after SIGKILL")

	if out, err := l.run(l.args...); err == nil || !strings.Contains(out, "another breakerd") {
		t.Fatalf("a second breakerd on the same pins: %v\n%s", err, out)
	}
	overPools("after a second start was refused")
	check("second start refused")

	// A cgroup removed while the daemon is down leaves no entry once a
	// new daemon starts.
	gone := l.cg.Child(t, "sel-gone")
	cfg2 := strings.Replace(scopedLifecycleConfig, "[CGROUP/sel]", "[CGROUP/sel, CGROUP/sel-gone]", 1)
	cfg2 = strings.ReplaceAll(cfg2, "CGROUP", rel)
	l.writeConfig(cfg2)
	p.cmd.Process.Signal(syscall.SIGHUP)
	goneID, _ := gone.ID()
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		v, err := maps.OpenPinned(l.bpffs)
		if err != nil {
			return false
		}
		defer v.Close()
		w, _ := v.Workloads()
		_, in := w[goneID]
		return in
	}) {
		t.Fatalf("a reload did not add the newly selected cgroup:\n%s", p.logs.String())
	}
	l.sigterm(p)
	if err := os.Remove(gone.Path); err != nil {
		t.Fatal(err)
	}
	p = l.start()
	check("cgroup removed while the daemon was down")
	// End the loop before the test's clean-up kills helpers under it.
	lp.stop.Store(true)
	lp.wg.Wait()
	l.sigterm(p)
}
