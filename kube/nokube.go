//go:build nokube

package kube

import (
	"context"

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
