package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
	"github.com/breakerd/breakerd/maps"
)

// close_established across the lifecycle. web (healthy) and the
// forced-open down ask for it; flap opens by failures while it does not,
// with a pool holding connections to it, and then asks for it by a
// reload; sentinel, with no connections, is forced open at each step to
// mark where the step's passes end. Checked at every step (SIGTERM
// restart, reloads, SIGKILL, start after it, a refused second start):
//   - the lifecycle invariants (no healthy connect rejected, no connect to
//     the open circuit let through, the pinned verdicts exact);
//   - no healthy connection closed: the pool to web keeps its 4;
//   - a circuit open at start-up (adopted from the pins) is not closed
//     again: flap's pool keeps its 3, and no daemon logs a close pass;
//   - until flap opens anew (forced closed, then forced open through the
//     API): then its pool's 3 are closed, and web's stay.
const closeLifecycleConfig = `
failsafe_timeout: 30s
all:
  consecutive_failures: 1000
targets:
  down:
    match: {cidrs: [SRV], ports: ["8500"]}
    state: forced_open
    reject_errno: EHOSTUNREACH
    close_established: true
  web:
    match: {cidrs: [SRV], ports: ["8502"]}
    consecutive_failures: 1000
    close_established: true
  flap:
    match: {cidrs: [SRV], ports: ["8503"]}
    consecutive_failures: 3
    open_duration: 1h
    max_open_duration: 2h
    close_established: false
  sentinel:
    match: {cidrs: [SRV], ports: ["8509"]}
    close_established: true
`

func TestLifecycleCloseEstablished(t *testing.T) {
	l := newLifecycle(t)
	srv := l.topo.Servers[0]
	srv.ServeHold(t, 8503)
	flap := maps.Dest{Proto: maps.TCP, Addr: netip.AddrPortFrom(srv.IPv4, 8503)}
	l.open = map[maps.Dest]bool{}
	l.writeConfig(closeLifecycleConfig)
	p := l.start()
	procs := []*proc{p}
	l.clientLoop()
	webPool := l.topo.Client.StartPool(t, l.cg, []kerneltest.PoolTarget{{Addr: l.web.Addr, N: 4}}, 0)
	flapPool := l.topo.Client.StartPool(t, l.cg, []kerneltest.PoolTarget{{Addr: flap.Addr, N: 3}}, 0)
	four, three := []string{"open", "open", "open", "open"}, []string{"open", "open", "open"}

	// flap opens by failures (new connects refused; its pool's
	// connections go on), while it does not ask for close_established.
	srv.RefuseNewConnections(t, 8503)
	l.topo.Client.Dial(t, l.cg, kerneltest.DialSpec{Network: "tcp4", Addr: flap.Addr, Count: 3})
	if !kerneltest.WaitFor(3*time.Second, func() bool { return strings.Contains(p.logs.String(), "circuit=flap target=flap from=closed to=open") }) {
		t.Fatalf("flap did not open:\n%s", p.logs.String())
	}
	l.open[flap] = true

	// check checks the step's invariants; with a daemon running, after a
	// close pass of sentinel (a circuit with no connections, forced open
	// and released again): passes run in the order they are queued, so
	// one the step queued has run and logged by then.
	check := func(step string, running *proc) {
		t.Helper()
		if running != nil {
			passes := func() int {
				return strings.Count(running.logs.String(), "circuit=sentinel target=sentinel workload=shared closed=0")
			}
			before := passes()
			if err := force(l.socket, "sentinel", "open"); err != nil {
				t.Fatalf("%s: %v", step, err)
			}
			if !kerneltest.WaitFor(5*time.Second, func() bool { return passes() > before }) {
				t.Fatalf("%s: no close pass for sentinel:\n%s", step, running.logs.String())
			}
			if err := force(l.socket, "sentinel", "release"); err != nil {
				t.Fatalf("%s: %v", step, err)
			}
		}
		l.check(step, nil)
		if got := webPool.Check(t); !slices.Equal(got, four) {
			t.Fatalf("%s: the pool to the healthy web: %v, want its 4 connections open", step, got)
		}
		if got := flapPool.Check(t); !slices.Equal(got, three) {
			t.Fatalf("%s: the pool to the circuit open since before the step: %v, want its 3 connections kept", step, got)
		}
		for _, p := range procs {
			for line := range strings.Lines(p.logs.String()) {
				if strings.Contains(line, "closed established connections") && !strings.Contains(line, "circuit=sentinel") {
					t.Fatalf("%s: a close pass ran:\n%s", step, p.logs.String())
				}
			}
		}
	}
	check("start, flap opened without close_established", p)

	// A reload makes flap ask for it: an open circuit is not opened again.
	l.writeConfig(strings.Replace(closeLifecycleConfig, "close_established: false", "close_established: true", 1))
	p.cmd.Process.Signal(syscall.SIGHUP)
	if !kerneltest.WaitFor(3*time.Second, func() bool { return strings.Contains(p.logs.String(), "configuration reloaded") }) {
		t.Fatalf("no reload:\n%s", p.logs.String())
	}
	check("reload: flap asks for close_established", p)

	l.sigterm(p)
	p = l.start()
	procs = append(procs, p)
	check("SIGTERM restart", p)

	for range 5 {
		l.reload(p)
	}
	check("reloads", p)

	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
	check("SIGKILL (pins enforce on their own)", nil)
	p = l.start()
	procs = append(procs, p)
	check("start after SIGKILL", p)

	if out, err := l.run(l.args...); err == nil || !strings.Contains(out, "another breakerd") {
		t.Fatalf("a second breakerd on the same pins: %v\n%s", err, out)
	}
	check("second start refused", p)

	// flap opens anew: forced closed, then forced open. Its pool's
	// connections are closed now; web's stay.
	for _, action := range []string{"close", "open"} {
		if err := force(l.socket, "flap", action); err != nil {
			t.Fatal(err)
		}
	}
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		return strings.Contains(p.logs.String(), `msg="closed established connections" circuit=flap target=flap workload=shared closed=3 failed=0`)
	}) {
		t.Fatalf("no close pass for flap's 3 connections:\n%s", p.logs.String())
	}
	if got := flapPool.Check(t); !slices.Equal(got, []string{"ECONNABORTED", "ECONNABORTED", "ECONNABORTED"}) {
		t.Fatalf("flap's pool after it opened anew: %v, want its 3 closed", got)
	}
	if got := webPool.Check(t); !slices.Equal(got, four) {
		t.Fatalf("the pool to the healthy web after flap's pass: %v", got)
	}
	l.stop.Store(true)
	l.wg.Wait()
}

// force changes a circuit through the admin socket.
func force(socket, name, action string) error {
	c := http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", socket)
	}}}
	resp, err := c.Post("http://breakerd/v1/circuits/"+name, "application/json", strings.NewReader(fmt.Sprintf(`{"action": %q}`, action)))
	if err != nil {
		return fmt.Errorf("force %s %s: %w", action, name, err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("force %s %s: %s", action, name, resp.Status)
	}
	return nil
}
