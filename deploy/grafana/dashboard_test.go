// Package grafana holds breakerd's Grafana dashboard and the test that
// keeps it true to the metrics breakerd exports. It is its own Go module so
// that Prometheus' PromQL parser (a large dependency) stays out of
// breakerd's go.mod; scripts/test runs it.
package grafana

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/promql/parser"
	"go.yaml.in/yaml/v3"

	"github.com/breakerd/breakerd/daemon"
)

// leftOut lists the breakerd_* families deliberately on no panel, each
// with the reason. (Empty today: every family is on a panel.)
var leftOut = map[string]string{}

// prometheusOwn are series Prometheus makes itself, not breakerd.
var prometheusOwn = map[string]bool{"up": true}

// grafanaVars are the dashboard's variables and Grafana's built-in
// intervals, replaced by sample values before parsing; any other $ in an
// expression fails the test.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "3h", "$instance", ".*", "$target", ".*", "$workload", ".*")

type dashboard struct {
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Definition string          `json:"definition"`
			Query      json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID      int     `json:"id"`
	Title   string  `json:"title"`
	Type    string  `json:"type"`
	Panels  []panel `json:"panels"` // a collapsed row's
	Targets []struct {
		Expr  string `json:"expr"`
		RefID string `json:"refId"`
	} `json:"targets"`
}

type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Record string `yaml:"record"`
			Alert  string `yaml:"alert"`
			Expr   string `yaml:"expr"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

var promql = parser.NewParser(parser.Options{})

// metricsOf parses a PromQL expression with Prometheus' parser and
// returns the metric names it selects.
func metricsOf(expr string) ([]string, error) {
	e := grafanaVars.Replace(expr)
	if i := strings.IndexByte(e, '$'); i >= 0 {
		return nil, fmt.Errorf("unknown Grafana variable at %q", e[i:])
	}
	ast, err := promql.ParseExpr(e)
	if err != nil {
		return nil, err
	}
	var names []string
	var missing error
	parser.Inspect(ast, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			if vs.Name == "" {
				missing = fmt.Errorf("selector %s names no metric", vs)
			}
			names = append(names, vs.Name)
		}
		return nil
	})
	return names, missing
}

// labelValues is a variable's label_values(selector, label) query.
var labelValues = regexp.MustCompile(`^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$`)

func readRules(t *testing.T, file string) ruleFile {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var rf ruleFile // the fields used here; promtool checks the rest
	if err := yaml.Unmarshal(b, &rf); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	return rf
}

// checker knows breakerd's metric names and finds unknown ones.
type checker struct {
	known   map[string]string // series name -> family
	records map[string]bool
}

func newChecker() *checker {
	c := &checker{known: map[string]string{}, records: map[string]bool{}}
	for _, f := range daemon.MetricFamilies() {
		c.known[f.Name] = f.Name
		if f.Histogram {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				c.known[f.Name+s] = f.Name
			}
		}
	}
	return c
}

// use checks one expression and returns the names it uses.
func (c *checker) use(where, expr string) ([]string, error) {
	names, err := metricsOf(expr)
	if err != nil {
		return nil, fmt.Errorf("%s: %q: %w", where, expr, err)
	}
	for _, n := range names {
		if _, ok := c.known[n]; !ok && !c.records[n] && !prometheusOwn[n] {
			return nil, fmt.Errorf("%s: %q uses %s, which breakerd does not export and no recording rule makes", where, expr, n)
		}
	}
	return names, nil
}

func TestCheckerCatchesUnknownMetrics(t *testing.T) {
	c := newChecker()
	if _, err := c.use("test", `sum(rate(breakerd_kernel_rejections_total[5m]))`); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{`rate(breakerd_no_such_thing_total[5m])`, `breakerd_circuit_state_count`, `sum(rate(x[5m])`, `rate(breakerd_events_lost_total[$__foo])`, `{job="x"}`} {
		if _, err := c.use("test", bad); err == nil {
			t.Errorf("%s passed the check", bad)
		}
	}
}

// TestDashboardMatchesMetrics parses every PromQL expression of the
// dashboard (panels and variables), the recording rules and the alerts
// with Prometheus' parser, checks that every metric they use is one
// breakerd exports (or a recording rule's output), and the reverse: every
// breakerd_* family is on some panel (directly or through a recording
// rule a panel shows), or in leftOut.
func TestDashboardMatchesMetrics(t *testing.T) {
	c := newChecker()
	rules := readRules(t, "../recording-rules.yml")
	ruleUses := map[string][]string{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Record == "" {
				t.Errorf("recording-rules.yml group %s holds a rule that records nothing (alert %q)", g.Name, r.Alert)
				continue
			}
			c.records[r.Record] = true
		}
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			names, err := c.use("recording rule "+r.Record, r.Expr)
			if err != nil {
				t.Error(err)
			}
			ruleUses[r.Record] = names
		}
	}
	for _, g := range readRules(t, "../alerts.yml").Groups {
		for _, r := range g.Rules {
			if _, err := c.use("alert "+r.Alert, r.Expr); err != nil {
				t.Error(err)
			}
		}
	}

	b, err := os.ReadFile("breakerd-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(strings.NewReader(string(b)))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("breakerd-dashboard.json: %v", err)
	}
	onPanels := map[string]bool{}
	usedRules := map[string]bool{}
	ids := map[int]string{}
	var walk func([]panel)
	exprs := 0
	walk = func(ps []panel) {
		for _, p := range ps {
			if other, dup := ids[p.ID]; dup {
				t.Errorf("panels %q and %q share id %d", other, p.Title, p.ID)
			}
			ids[p.ID] = p.Title
			if p.Type != "row" && len(p.Targets) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			for _, q := range p.Targets {
				exprs++
				names, err := c.use(fmt.Sprintf("panel %q (%s)", p.Title, q.RefID), q.Expr)
				if err != nil {
					t.Error(err)
				}
				for _, n := range names {
					onPanels[n] = true
					if c.records[n] {
						usedRules[n] = true
						for _, m := range ruleUses[n] {
							onPanels[m] = true
						}
					}
				}
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	if exprs < 20 {
		t.Fatalf("only %d expressions on the dashboard", exprs)
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Errorf("variable %s: %q is not label_values(selector, label)", v.Name, v.Definition)
			continue
		}
		if _, err := c.use("variable "+v.Name, m[1]); err != nil {
			t.Error(err)
		}
	}

	for r := range c.records {
		if !usedRules[r] {
			t.Errorf("recording rule %s is on no panel", r)
		}
	}
	var missing []string
	families := map[string]bool{}
	for _, f := range daemon.MetricFamilies() {
		if !strings.HasPrefix(f.Name, "breakerd_") {
			continue
		}
		families[f.Name] = true
		used := onPanels[f.Name]
		if f.Histogram {
			used = used || onPanels[f.Name+"_bucket"] || onPanels[f.Name+"_sum"] || onPanels[f.Name+"_count"]
		}
		if !used && leftOut[f.Name] == "" {
			missing = append(missing, f.Name)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("exported but on no panel (add a panel, or list them in leftOut with the reason): %s", strings.Join(missing, ", "))
	}
	for name := range leftOut {
		if !families[name] {
			t.Errorf("leftOut lists %s, which breakerd no longer exports", name)
		}
	}
	if len(families) < 20 {
		t.Fatalf("only %d breakerd_* families found: %v", len(families), slices.Sorted(maps.Keys(families)))
	}
}
