// Package docs holds breakerd's documentation and the tests that keep it
// true: the generated configuration reference, the metrics and alerts
// tables against what breakerd exports and ships, the examples against
// the configuration loader, and every relative link and anchor.
package docs
