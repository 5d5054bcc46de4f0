package main

import (
	"strings"
	"testing"
	"time"

	tea "github.com/charmbracelet/bubbletea"

	"github.com/breakerd/breakerd/api"
)

// TestTopModel drives top's model without a terminal: rates between two
// reads, the sort keys, names that cannot steer the terminal, and q.
func TestTopModel(t *testing.T) {
	m := &topModel{interval: time.Second, prev: map[string]sample{}, rate: map[string]float64{}, width: 160, height: 20}
	t0 := time.Now()
	read := func(at time.Time, rejected uint64) {
		m.Update(dataMsg{at: at, circuits: []api.CircuitInfo{
			{Name: "b-open", State: "open", FailureRate: 0.5, Rejected: rejected, Workload: "tenant-a",
				RejectedBy: []api.RejectedBy{{Pod: "shop/web-1", Rejected: 20}, {Pod: "shop/\x1b[31mweb-2", Rejected: 10}}},
			{Name: "a-closed", State: "closed", FailureRate: 0.9},
			{Name: "c-\x1b[2Jevil\x07", State: "half_open", FailureRate: 0.1, Rejected: 1},
		}})
	}
	read(t0, 10)
	read(t0.Add(2*time.Second), 30)
	if r := m.rate["b-open"]; r != 10 {
		t.Fatalf("rate %v, want 10/s", r)
	}
	order := func() string {
		var names []string
		for _, c := range m.circuits {
			names = append(names, c.Name[:1])
		}
		return strings.Join(names, "")
	}
	if o := order(); o != "bca" {
		t.Fatalf("by state: %s", o)
	}
	for key, want := range map[string]string{"f": "abc", "n": "abc", "r": "bac", "s": "bca"} {
		m.Update(tea.KeyMsg{Type: tea.KeyRunes, Runes: []rune(key)})
		if o := order(); o != want {
			t.Errorf("key %s: order %s, want %s", key, o, want)
		}
	}
	view := m.View()
	if strings.Contains(view, "\x1b[2J") || strings.Contains(view, "\x07") || !strings.Contains(view, "c-?[2Jevil?") {
		t.Errorf("a name's control characters reached the terminal:\n%q", view)
	}
	if !strings.Contains(view, "REJECTED BY") || !strings.Contains(view, "shop/web-1:20,shop/?[31mweb-2:10") {
		t.Errorf("no rejected pods:\n%s", view)
	}
	if !strings.Contains(view, "WORKLOAD") || !strings.Contains(view, "tenant-a") {
		t.Errorf("no workload column:\n%s", view)
	}
	if !strings.Contains(view, "\x1b[41;97mopen") {
		t.Errorf("open is not drawn in red:\n%q", view)
	}
	// A counter that went down (a reused id) gives no rate.
	read(t0.Add(3*time.Second), 5)
	if r := m.rate["b-open"]; r != 0 {
		t.Errorf("rate after a reset %v", r)
	}
	if _, cmd := m.Update(tea.KeyMsg{Type: tea.KeyRunes, Runes: []rune("q")}); cmd == nil || cmd() != tea.Quit() {
		t.Error("q does not quit")
	}
}

// An adaptive limit is shown at its current value, with its algorithm,
// in top's BULKHEAD column.
func TestTopShowsAdaptiveLimit(t *testing.T) {
	m := &topModel{interval: time.Second, prev: map[string]sample{}, rate: map[string]float64{}, width: 320, height: 20}
	m.Update(dataMsg{at: time.Now(), circuits: []api.CircuitInfo{
		{Name: "pool", State: "closed", Connections: 3, Options: map[string]any{"max_connections": map[string]any{"adaptive": "vegas", "min": 2.0, "initial": 20.0, "max": 40.0}},
			AdaptiveLimits: []api.AdaptiveLimit{{Kind: "max_connections", Algorithm: "vegas", Limit: 12, Min: 2, Max: 40}}},
		{Name: "fixed", State: "closed", Connections: 1, Options: map[string]any{"max_connections": 5.0}},
	}})
	view := m.View()
	if !strings.Contains(view, "3/12 vegas") || !strings.Contains(view, "1/5") {
		t.Fatalf("bulkheads not shown at their limits:\n%s", view)
	}
}
