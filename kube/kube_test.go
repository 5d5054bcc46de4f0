package kube

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/breakerd/breakerd/internal/kubeapitest"
	"github.com/breakerd/breakerd/policy"
)

// TestEventsRateLimited: a burst of circuit Events about one object (here
// the Node, as dynamic circuits post) does not reach the API server whole:
// client-go's correlator combines similar Events (same object and reason)
// past the tenth in 10 minutes into one, whose count it patches, and its
// spam filter allows a burst of 25 per object, then one every 5 minutes.
// Posting never blocks.
func TestEventsRateLimited(t *testing.T) {
	api := kubeapitest.Start(t)
	c, err := New(Options{Config: api.Admin, NodeName: "node-burst", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	for i := range 200 {
		c.CircuitEvent(Transition{Circuit: fmt.Sprintf("tcp/192.0.2.%d:80", i), Target: "all", Opened: true, Reason: "consecutive_failures", Calls: 5, FailureRatio: 1})
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("queueing 200 Events took %v", took)
	}
	cs := api.Clientset(t)
	list := func() []string {
		l, err := cs.CoreV1().Events("default").List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=node-burst"})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range l.Items {
			out = append(out, e.Message)
		}
		return out
	}
	// Wait until nothing more arrives for 2 s.
	var got []string
	for last, stable := -1, time.Now(); time.Since(stable) < 2*time.Second && time.Since(start) < 30*time.Second; time.Sleep(200 * time.Millisecond) {
		if got = list(); len(got) != last {
			last, stable = len(got), time.Now()
		}
	}
	t.Logf("200 Events queued; %d reached the API server", len(got))
	combined := false
	for _, m := range got {
		combined = combined || strings.Contains(m, "combined from similar events")
	}
	if len(got) < 1 || len(got) > 26 || !combined {
		t.Fatalf("%d Events reached the API server (combined: %v), want them combined and cut to the filter's burst:\n%s", len(got), combined, strings.Join(got, "\n"))
	}
}

// TestResolve: what a Service match resolves to, from a real API
// server's objects: cluster IPs (none for a headless Service) times the
// selected Service ports (by number or name, of the match's protocol), and
// serving endpoints (ready; terminating and serving; ready unset) times
// the slice port of the same name; not endpoints that are not serving, not
// FQDN slices, not another Service's slices.
func TestResolve(t *testing.T) {
	api := kubeapitest.Start(t)
	cs := api.Clientset(t)
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tcp, udp := corev1.ProtocolTCP, corev1.ProtocolUDP
	svc, err := cs.CoreV1().Services("shop").Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "pay"}, Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{
		{Name: "http", Port: 80, Protocol: tcp}, {Name: "dns", Port: 53, Protocol: udp}, {Name: "admin", Port: 9000, Protocol: tcp}}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().Services("shop").Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "db"},
		Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, Ports: []corev1.ServicePort{{Port: 5432, Protocol: tcp}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	yes, no := true, false
	port := func(name string, p int32, proto corev1.Protocol) discoveryv1.EndpointPort {
		return discoveryv1.EndpointPort{Name: &name, Port: &p, Protocol: &proto}
	}
	mk := func(name, service string, at discoveryv1.AddressType, ports []discoveryv1.EndpointPort, eps ...discoveryv1.Endpoint) {
		t.Helper()
		if _, err := cs.DiscoveryV1().EndpointSlices("shop").Create(ctx, &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
			AddressType: at, Ports: ports, Endpoints: eps}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	ep := func(addr string, ready, serving, terminating *bool) discoveryv1.Endpoint {
		return discoveryv1.Endpoint{Addresses: []string{addr}, Conditions: discoveryv1.EndpointConditions{Ready: ready, Serving: serving, Terminating: terminating}}
	}
	mk("pay-a", "pay", discoveryv1.AddressTypeIPv4, []discoveryv1.EndpointPort{port("http", 8080, tcp), port("dns", 5353, udp), port("admin", 9001, tcp)},
		ep("10.1.0.1", &yes, &yes, &no), // ready
		ep("10.1.0.2", &no, &yes, &yes), // terminating, still serving
		ep("10.1.0.3", nil, nil, nil),   // no conditions: counted
		ep("10.1.0.4", &no, &no, &no),   // not serving
		ep("10.1.0.5", &no, &no, &yes))  // terminating, no longer serving
	mk("pay-fqdn", "pay", discoveryv1.AddressTypeFQDN, []discoveryv1.EndpointPort{port("http", 8080, tcp)}, ep("pay.example.com", &yes, &yes, &no))
	mk("db-a", "db", discoveryv1.AddressTypeIPv4, []discoveryv1.EndpointPort{port("", 5432, tcp)}, ep("10.2.0.1", &yes, &yes, &no))

	c, err := New(Options{Config: api.Admin, NodeName: "n", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Watch([]string{"shop/pay", "shop/db", "shop/gone"})
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if !c.WaitSynced(wctx) {
		t.Fatal("not synced")
	}
	cip := svc.Spec.ClusterIP
	for _, tc := range []struct {
		name  string
		match policy.Match
		want  []string
		found bool
	}{
		{"named port", policy.Match{Service: "shop/pay", PortNames: []string{"http"}, Proto: "tcp"},
			[]string{"tcp/10.1.0.1:8080", "tcp/10.1.0.2:8080", "tcp/10.1.0.3:8080", "tcp/" + cip + ":80"}, true},
		{"numbered port", policy.Match{Service: "shop/pay", Ports: []policy.PortRange{{Lo: 9000, Hi: 9000}}, Proto: "tcp"},
			[]string{"tcp/10.1.0.1:9001", "tcp/10.1.0.2:9001", "tcp/10.1.0.3:9001", "tcp/" + cip + ":9000"}, true},
		{"udp only", policy.Match{Service: "shop/pay", Proto: "udp"},
			[]string{"udp/10.1.0.1:5353", "udp/10.1.0.2:5353", "udp/10.1.0.3:5353", "udp/" + cip + ":53"}, true},
		{"headless", policy.Match{Service: "shop/db", Proto: "tcp"}, []string{"tcp/10.2.0.1:5432"}, true},
		{"missing", policy.Match{Service: "shop/gone", Proto: "tcp"}, nil, false},
	} {
		dests, found := c.Resolve(tc.match)
		var got []string
		for _, d := range dests {
			got = append(got, d.Proto+"/"+d.Addr.String())
		}
		slices.Sort(got)
		slices.Sort(tc.want)
		if !slices.Equal(got, tc.want) || found != tc.found {
			t.Errorf("%s: %v (found %v), want %v (found %v)", tc.name, got, found, tc.want, tc.found)
		}
	}
}
