package main

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	tea "github.com/charmbracelet/bubbletea"

	"github.com/breakerd/breakerd/api"
)

// top is `breakerctl top`: the status page's view in a terminal. It reads
// /v1/circuits (every page) and /v1/events each interval, computes each
// circuit's rejections per second between two reads, and redraws. Keys:
// s, f, r, n sort by state, failure ratio, rejections per second, name;
// the arrows and PgUp/PgDn scroll; q (or Ctrl-C) quits. It runs on the
// terminal's alternate screen, which is restored on exit.
func top(c *client, interval time.Duration) error {
	if interval < 200*time.Millisecond {
		return usageError{fmt.Sprintf("--interval %v is below 200ms", interval)}
	}
	m := &topModel{c: c, interval: interval, sort: sortState, prev: map[string]sample{}, rate: map[string]float64{}}
	p := tea.NewProgram(m, tea.WithAltScreen(), tea.WithInput(os.Stdin), tea.WithOutput(os.Stdout))
	if _, err := p.Run(); err != nil {
		return fmt.Errorf("top: %w", err)
	}
	return nil
}

type sortKey int

const (
	sortState sortKey = iota
	sortFailure
	sortRate
	sortName
)

var sortNames = map[sortKey]string{sortState: "state", sortFailure: "failure ratio", sortRate: "rejections/s", sortName: "name"}

// stateRank orders circuits that turn traffic away first.
var stateRank = map[string]int{"open": 0, "forced_open": 1, "half_open": 2, "forced_closed": 3, "disabled": 4, "closed": 5}

// stateColour is each state's ANSI colour (background), as on the page.
var stateColour = map[string]string{"open": "41;97", "forced_open": "45;97", "half_open": "43;30", "forced_closed": "44;97", "disabled": "100;97", "closed": "42;97"}

type sample struct {
	rejected uint64
	at       time.Time
}

type topModel struct {
	c        *client
	interval time.Duration
	sort     sortKey
	offset   int
	width    int
	height   int

	circuits []api.CircuitInfo
	events   []api.TransitionEvent
	prev     map[string]sample
	rate     map[string]float64
	err      error
	updated  time.Time
	polls    int
}

type dataMsg struct {
	circuits []api.CircuitInfo
	events   []api.TransitionEvent
	err      error
	at       time.Time
}

type tickMsg struct{}

func (m *topModel) fetch() tea.Msg {
	cs, err := m.c.circuits()
	var evs []api.TransitionEvent
	if err == nil {
		err = m.c.get("/v1/events", &evs)
	}
	return dataMsg{circuits: cs, events: evs, err: err, at: time.Now()}
}

func (m *topModel) Init() tea.Cmd { return m.fetch }

func (m *topModel) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case tea.KeyMsg:
		switch msg.String() {
		case "q", "ctrl+c", "esc":
			return m, tea.Quit
		case "s":
			m.sort, m.offset = sortState, 0
		case "f":
			m.sort, m.offset = sortFailure, 0
		case "r":
			m.sort, m.offset = sortRate, 0
		case "n":
			m.sort, m.offset = sortName, 0
		case "down", "j":
			m.offset++
		case "up", "k":
			m.offset--
		case "pgdown", " ":
			m.offset += max(1, m.rows())
		case "pgup":
			m.offset -= max(1, m.rows())
		case "home", "g":
			m.offset = 0
		}
		m.sortCircuits() // at once, not at the next read
		m.offset = max(0, min(m.offset, len(m.circuits)-1))
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
	case dataMsg:
		m.err = msg.err
		if msg.err == nil {
			m.observe(msg)
		}
		return m, tea.Tick(m.interval, func(time.Time) tea.Msg { return tickMsg{} })
	case tickMsg:
		return m, m.fetch
	}
	return m, nil
}

func (m *topModel) observe(msg dataMsg) {
	seen := make(map[string]bool, len(msg.circuits))
	for _, ci := range msg.circuits {
		seen[ci.Name] = true
		if p, ok := m.prev[ci.Name]; ok && msg.at.After(p.at) && ci.Rejected >= p.rejected {
			m.rate[ci.Name] = float64(ci.Rejected-p.rejected) / msg.at.Sub(p.at).Seconds()
		} else {
			m.rate[ci.Name] = 0
		}
		m.prev[ci.Name] = sample{ci.Rejected, msg.at}
	}
	for name := range m.prev {
		if !seen[name] {
			delete(m.prev, name)
			delete(m.rate, name)
		}
	}
	m.circuits, m.events, m.updated = msg.circuits, msg.events, msg.at
	m.polls++
	m.sortCircuits()
	m.offset = max(0, min(m.offset, len(m.circuits)-1))
}

func (m *topModel) sortCircuits() {
	rank := func(s string) int {
		if r, ok := stateRank[s]; ok {
			return r
		}
		return 9
	}
	slices.SortStableFunc(m.circuits, func(a, b api.CircuitInfo) int {
		var d int
		switch m.sort {
		case sortState:
			d = rank(a.State) - rank(b.State)
			if d == 0 {
				d = cmpFloat(b.FailureRate, a.FailureRate)
			}
		case sortFailure:
			d = cmpFloat(b.FailureRate, a.FailureRate)
		case sortRate:
			d = cmpFloat(m.rate[b.Name], m.rate[a.Name])
		}
		if d == 0 {
			d = strings.Compare(a.Name, b.Name)
		}
		return d
	})
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// eventLines is how many recent transitions are shown under the table.
const eventLines = 5

// rows is how many circuit rows fit: the screen less the header (3
// lines) and the transitions (a title and eventLines).
func (m *topModel) rows() int {
	h := m.height
	if h == 0 {
		h = 24
	}
	return max(1, h-4-(eventLines+1))
}

func (m *topModel) View() string {
	w := m.width
	if w == 0 {
		w = 120
	}
	var b strings.Builder
	counts := map[string]int{}
	total := 0.0
	for _, ci := range m.circuits {
		counts[ci.State]++
		total += m.rate[ci.Name]
	}
	head := fmt.Sprintf("breakerd top  %d circuits", len(m.circuits))
	for _, s := range []string{"open", "forced_open", "half_open", "forced_closed", "disabled", "closed"} {
		if counts[s] > 0 {
			head += fmt.Sprintf("  %s %d", s, counts[s])
		}
	}
	head += fmt.Sprintf("  rejecting %.1f/s", total)
	b.WriteString(fit(head, w) + "\n")
	status := fmt.Sprintf("sort: %s (s state, f failure, r rejections/s, n name; arrows scroll; q quits)", sortNames[m.sort])
	if !m.updated.IsZero() {
		status += "  updated " + m.updated.Format(time.TimeOnly)
	}
	if m.err != nil {
		status = "error: " + m.err.Error()
	} else if m.polls == 0 {
		status = "reading breakerd…"
	}
	b.WriteString(fit(status, w) + "\n")

	// Columns: fixed widths, the name takes what is left; WORKLOAD only
	// when some circuit has one.
	workloadW := 0
	for _, ci := range m.circuits {
		if ci.Workload != "" {
			workloadW = 12
			break
		}
	}
	// REJECTED BY (the pods or cgroups a circuit rejected) last, only when
	// some circuit names whom it rejected.
	rejectedW := 0
	for _, ci := range m.circuits {
		if len(ci.RejectedBy) > 0 {
			rejectedW = 32
			break
		}
	}
	fixed := 13 + 1 + 14 + 1 + 6 + 1 + 6 + 1 + 6 + 1 + 7 + 1 + 10 + 1 + 8 + 1 + 11 + 1
	if workloadW > 0 {
		fixed += workloadW + 1
	}
	if rejectedW > 0 {
		fixed += rejectedW + 1
	}
	nameW := max(16, w-fixed)
	column := func(s string) string {
		if workloadW == 0 {
			return ""
		}
		return " " + pad(clean(s), workloadW)
	}
	cols := fmt.Sprintf("%-13s %-*s %-14s%s %6s %6s %6s %7s %10s %8s %-11s", "STATE", nameW, "CIRCUIT", "TARGET", column("WORKLOAD"), "FAIL", "SLOW", "CALLS", "OPEN", "REJECTED", "REJ/S", "BULKHEAD")
	if rejectedW > 0 {
		cols += " " + pad("REJECTED BY", rejectedW)
	}
	b.WriteString(fit(cols, w) + "\n")
	n := m.rows()
	end := min(len(m.circuits), m.offset+n)
	for _, ci := range m.circuits[m.offset:end] {
		open := "-"
		if !ci.OpenUntil.IsZero() {
			open = time.Until(ci.OpenUntil).Round(time.Second).String()
		}
		bulk := "-"
		if s, ok := bulkheadOf(ci, "max_connections"); ok {
			bulk = s
		} else if s, ok := bulkheadOf(ci, "max_connecting"); ok {
			bulk = s
		}
		state := fmt.Sprintf("%-13s", clean(ci.State))
		if col, ok := stateColour[ci.State]; ok {
			state = "\x1b[" + col + "m" + state + "\x1b[0m"
		}
		rest := fmt.Sprintf(" %s %s%s %6s %6s %6d %7s %10d %8.1f %-11s", pad(clean(ci.Name), nameW), pad(clean(ci.Target), 14), column(ci.Workload),
			pct(ci.FailureRate), pct(ci.SlowRate), ci.Calls, open, ci.Rejected, m.rate[ci.Name], bulk)
		if rejectedW > 0 {
			rest += " " + pad(clean(rejectedBy(ci)), rejectedW)
		}
		b.WriteString(state + fit(rest, w-13) + "\n")
	}
	for range n - (end - m.offset) {
		b.WriteString("\n")
	}
	b.WriteString(fit(fmt.Sprintf("recent transitions (%d of %d circuits shown, from row %d)", end-m.offset, len(m.circuits), m.offset+1), w) + "\n")
	evs := m.events[max(0, len(m.events)-eventLines):]
	for i := len(evs) - 1; i >= 0; i-- {
		e := evs[i]
		b.WriteString(fit(fmt.Sprintf("%s  %s  %s -> %s  %s  failure %s", e.Time.Local().Format(time.TimeOnly), clean(e.Circuit), clean(e.From), clean(e.To), clean(e.Reason), pct(e.FailureRate)), w) + "\n")
	}
	return b.String()
}

func pct(x float64) string { return fmt.Sprintf("%.0f%%", 100*x) }

// clean replaces control characters (escape sequences included) so a
// name can never steer the terminal.
func clean(s string) string {
	return strings.Map(func(r rune) rune {
		if r == utf8.RuneError || unicode.IsControl(r) || r == '\u2028' || r == '\u2029' {
			return '?'
		}
		return r
	}, s)
}

// pad cuts or pads s to exactly n runes.
func pad(s string, n int) string {
	r := []rune(s)
	if len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s + strings.Repeat(" ", n-len(r))
}

// fit cuts a line to the screen's width (in runes).
func fit(s string, w int) string {
	if r := []rune(s); len(r) > w {
		return string(r[:max(0, w)])
	}
	return s
}
