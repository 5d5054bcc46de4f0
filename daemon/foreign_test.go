package daemon

import (
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// Two breakerds on sibling cgroups, each with its own pins: a reset on
// one's connection is counted by it and never by the other. Two guards
// keep it so: reset_seen, a tracepoint that sees every socket on the
// machine, records only those made at or below its daemon's attach
// point; and the engine counts no reset of a socket cookie it has no
// established record of (it could not date it).
func TestForeignResetNotCounted(t *testing.T) {
	const cfg = "all:\n  consecutive_failures: 1\n"
	a := newFixture(t, cfg)
	a.start()
	b := newFixture(t, cfg)
	b.start()
	b.srv.ServeReset(t, 9140)
	dst := netip.AddrPortFrom(b.srv.IPv4, 9140)
	b.topo.Client.Dial(t, b.cg, kerneltest.DialSpec{Network: "tcp4", Addr: dst, Op: "connect-read"})
	name := "tcp/" + dst.String()
	b.waitState(name, "open", 3*time.Second) // its own reset, dated and counted
	if got := testutil.ToFloat64(b.d.metrics.outcomes.WithLabelValues("reset", allTarget, "shared")); got != 1 {
		t.Errorf("the connection's daemon counted %v resets, want 1", got)
	}
	// A later record of the other daemon's own: once it is counted, the
	// other has read whatever the reset wrote to its ring.
	a.sentinel(a.cg, 9141)
	if c, ok := a.circuit(name); ok {
		t.Errorf("another daemon's reset made a circuit here: %+v", c)
	}
	if got := testutil.ToFloat64(a.d.metrics.outcomes.WithLabelValues("reset", allTarget, "shared")); got != 0 {
		t.Errorf("another daemon's reset counted here: %v resets", got)
	}
}
