package daemon

import (
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// Each breakerd's reset_seen sees the resets of every socket on the
// machine that some breakerd left to it without state callbacks, its own
// and those of other daemons on other cgroups and pins. A daemon cannot
// date another's reset (it has no established record of that socket
// cookie): it must make no circuit for it and count no outcome, while
// the daemon whose connection it was counts it.
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
