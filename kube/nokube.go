//go:build nokube

package kube

import (
	"context"
	"errors"
	"net/netip"
	"time"

	"github.com/breakerd/breakerd/policy"
)

// Client stands in for the Kubernetes client in a nokube build. There is
// no New: none is ever made, so the daemon's Cluster is always nil and
// every method here only keeps the daemon compiling (each does nothing,
// as with no API access). Like the real client, it is a
// prometheus.Collector of the client's metric families.
type Client struct {
	metrics
}

// Close does nothing.
func (c *Client) Close() {}

// Changed returns a channel that is never signalled.
func (c *Client) Changed() <-chan struct{} { return nil }

// Watch does nothing.
func (c *Client) Watch(refs []string) {}

// WaitSynced reports false: nothing is ever listed.
func (c *Client) WaitSynced(ctx context.Context) bool { return false }

// Resolve finds nothing.
func (c *Client) Resolve(m policy.Match) (dests []policy.ServiceDest, found bool) { return nil, false }

// ClusterAddr finds no Service without a client.
func (c *Client) ClusterAddr(f policy.ServiceFallback) (netip.AddrPort, bool) {
	return netip.AddrPort{}, false
}

// CircuitEvent posts nothing.
func (c *Client) CircuitEvent(t Transition) {}

// WatchPods does nothing.
func (c *Client) WatchPods() {}

// WaitPodsSynced reports false: nothing is ever listed.
func (c *Client) WaitPodsSynced(ctx context.Context) bool { return false }

// SelectPods selects no pod.
func (c *Client) SelectPods(s PodSelector) map[string]string { return nil }

// PodName knows no pod.
func (c *Client) PodName(uid string) (string, bool) { return "", false }

// Fleet stands in for the link to the fleet's reports: a nokube build
// has none (NewFleet is never reached: there is no Client).
type Fleet struct{}

// NewFleet returns no link.
func (c *Client) NewFleet() (*Fleet, error) {
	return nil, errors.New("built with -tags nokube: no Kubernetes client")
}

// Run returns at once.
func (f *Fleet) Run(ctx context.Context) {}

// Changed returns a channel that is never signalled.
func (f *Fleet) Changed() <-chan struct{} { return nil }

// Synced reports false.
func (f *Fleet) Synced() bool { return false }

// Publish does nothing.
func (f *Fleet) Publish(open []FleetCircuit) {}

// Open finds nothing open.
func (f *Fleet) Open(now time.Time, quorum func(key string) int) ([]FleetOpen, time.Time, bool) {
	return nil, time.Time{}, false
}

// Nodes returns 0.
func (f *Fleet) Nodes(key string, now time.Time) int { return 0 }

// Stats returns zeros.
func (f *Fleet) Stats() FleetStats { return FleetStats{} }
