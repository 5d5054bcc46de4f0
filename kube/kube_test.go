package kube

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/breakerd/breakerd/internal/kubeapitest"
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
