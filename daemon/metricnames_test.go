package daemon

import "testing"

// TestMetricFamilies: the list the dashboard is checked against has every
// family, breakerd's histograms marked.
func TestMetricFamilies(t *testing.T) {
	got := map[string]bool{}
	for _, f := range MetricFamilies() {
		got[f.Name] = f.Histogram
	}
	for name, hist := range map[string]bool{"breakerd_transitions_total": false, "breakerd_circuit_state": false, "breakerd_kernel_rejections_total": false,
		"breakerd_handshake_duration_seconds": true, "breakerd_build_info": false, "process_resident_memory_bytes": false,
		"breakerd_fleet_report_write_errors_total": false, "breakerd_fleet_report_read_errors_total": false,
		"breakerd_slow_start_rejections_total": false, "breakerd_slow_start_circuits": false,
		"breakerd_limit": false, "breakerd_limit_changes_total": false} {
		if h, ok := got[name]; !ok || h != hist {
			t.Errorf("%s: listed %v, histogram %v", name, ok, h)
		}
	}
	if len(got) < 40 {
		t.Errorf("only %d families", len(got))
	}
}
