package daemon

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// TestServiceFallbackFollowsTheService: a fallback named by a Kubernetes
// Service is its cluster IP and the port, resolved from the informers as
// Service targets are; an open circuit's connects are sent there (the
// test's client has no route to the cluster range, so a redirected
// connect fails with ENETUNREACH instead of the rejection's
// ECONNREFUSED); the fallback goes with the Service, and comes back with
// a new one.
func TestServiceFallbackFollowsTheService(t *testing.T) {
	kf := newKubeFixture(t, `
targets:
  web:
    match: {cidrs: [SRV], ports: ["8080"]}
    state: forced_open
    fallback: {service: NS/house, port: 80}
`)
	ctx := context.Background()
	svc := kf.createService(t, "house", corev1.ServicePort{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP})
	kf.start()
	c, ok := kf.circuit("web")
	if !ok || c.State != "forced_open" || c.Fallback != kf.ns+"/house:80" {
		t.Fatalf("circuit web: %+v", c)
	}
	fallbackIs := func(want netip.AddrPort) {
		t.Helper()
		var got netip.AddrPort
		if !kerneltest.WaitFor(10*time.Second, func() bool {
			f, ok, err := kf.d.Kernel().FallbackOf(c.CircuitID)
			if err != nil {
				t.Fatal(err)
			}
			got = netip.AddrPort{}
			if ok {
				got = f.Addr
			}
			return got == want
		}) {
			t.Fatalf("the kernel's fallback of web is %v, want %v; logs:\n%s", got, want, kf.logs.String())
		}
	}
	fallbackIs(netip.MustParseAddrPort(svc.Spec.ClusterIP + ":80"))
	if got := errnos(kf.dial(8080, 2, time.Second)); got[unix.ENETUNREACH] != 2 {
		t.Fatalf("connects of web: %v, want 2 × ENETUNREACH (sent to the cluster IP)", got)
	}
	// The Service goes: so does the fallback, and web rejects.
	if err := kf.cs.CoreV1().Services(kf.ns).Delete(ctx, "house", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	fallbackIs(netip.AddrPort{})
	if got := errnos(kf.dial(8080, 2, time.Second)); got[unix.ECONNREFUSED] != 2 {
		t.Fatalf("connects of web without its Service fallback: %v, want 2 × ECONNREFUSED", got)
	}
	// A new Service of that name: its cluster IP.
	svc = kf.createService(t, "house", corev1.ServicePort{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP})
	fallbackIs(netip.MustParseAddrPort(svc.Spec.ClusterIP + ":80"))
}
