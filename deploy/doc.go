// Package deploy holds breakerd's Kubernetes manifests, container build and
// alerting rules; its tests decode every manifest strictly with the
// Kubernetes API types, check the invariants operators rely on, run
// promtool on the alerts, and run the real breakerd binary with exactly the
// capabilities the DaemonSet grants.
package deploy
