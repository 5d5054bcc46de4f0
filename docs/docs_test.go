package docs

import (
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/breakerd/breakerd/daemon"
	"github.com/breakerd/breakerd/policy"
)

var update = flag.Bool("update", false, "rewrite configuration.md from the schema")

// TestConfigurationReference keeps configuration.md equal to what the
// schema generates.
func TestConfigurationReference(t *testing.T) {
	const path = "configuration.md"
	ref := policy.Reference()
	if *update {
		if err := os.WriteFile(path, []byte(ref), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (regenerate with go test ./docs -run TestConfigurationReference -update)", err)
	}
	if string(got) != ref {
		t.Fatal("docs/configuration.md differs from the schema; regenerate with go test ./docs -run TestConfigurationReference -update")
	}
}

// section returns the text of the markdown section headed exactly
// heading, up to the next heading of the same or a higher level.
func section(t *testing.T, file, heading string) string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	level := strings.Index(heading, " ")
	_, rest, ok := strings.Cut(string(data), "\n"+heading+"\n")
	if !ok {
		t.Fatalf("%s has no %q section", file, heading)
	}
	for i, line := range strings.Split(rest, "\n") {
		if n := strings.IndexFunc(line, func(r rune) bool { return r != '#' }); n > 0 && n <= level && line[n] == ' ' {
			return strings.Join(strings.Split(rest, "\n")[:i], "\n")
		}
	}
	return rest
}

// firstColumn returns the first cell of each row of the markdown tables
// in text, headers and separators left out.
func firstColumn(text string) []string {
	var out []string
	lines := strings.Split(text, "\n")
	for i, l := range lines {
		if !strings.HasPrefix(l, "|") || strings.HasPrefix(l, "|---") {
			continue
		}
		if i+1 < len(lines) && strings.HasPrefix(lines[i+1], "|---") {
			continue // a header row
		}
		cells := strings.Split(l, "|")
		if len(cells) > 1 {
			out = append(out, strings.TrimSpace(cells[1]))
		}
	}
	return out
}

var metricName = regexp.MustCompile("`(breakerd_[a-z0-9_]+)`")

// TestMetricsTable: operations.md's metrics table lists exactly the
// breakerd_* families the daemon's registry exports.
func TestMetricsTable(t *testing.T) {
	documented := map[string]bool{}
	for _, cell := range firstColumn(section(t, "operations.md", "## Metrics")) {
		for _, m := range metricName.FindAllStringSubmatch(cell, -1) {
			documented[m[1]] = true
		}
	}
	exported := map[string]bool{}
	for _, f := range daemon.MetricFamilies() {
		if strings.HasPrefix(f.Name, "breakerd_") {
			exported[f.Name] = true
		}
	}
	for name := range exported {
		if !documented[name] {
			t.Errorf("docs/operations.md's metrics table lacks %s", name)
		}
	}
	for name := range documented {
		if !exported[name] {
			t.Errorf("docs/operations.md's metrics table lists %s, which breakerd does not export", name)
		}
	}
}

// TestAlertsTable: operations.md's alerts table lists exactly the alerts
// of deploy/alerts.yml, each with its for: duration and severity.
func TestAlertsTable(t *testing.T) {
	data, err := os.ReadFile("../deploy/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert  string            `yaml:"alert"`
				For    string            `yaml:"for"`
				Labels map[string]string `yaml:"labels"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(data, &rules); err != nil {
		t.Fatalf("deploy/alerts.yml: %v", err)
	}
	shipped := map[string]string{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			shipped[r.Alert] = r.For + " " + r.Labels["severity"]
		}
	}
	documented := map[string]string{}
	for _, l := range strings.Split(section(t, "operations.md", "## Alerts"), "\n") {
		cells := strings.Split(l, "|")
		if len(cells) < 6 || !strings.HasPrefix(strings.TrimSpace(cells[1]), "`Breakerd") {
			continue
		}
		documented[strings.Trim(strings.TrimSpace(cells[1]), "`")] = strings.TrimSpace(cells[3]) + " " + strings.TrimSpace(cells[4])
	}
	if len(shipped) == 0 {
		t.Fatal("deploy/alerts.yml holds no alerts")
	}
	for name, want := range shipped {
		if got, ok := documented[name]; !ok {
			t.Errorf("docs/operations.md's alerts table lacks %s", name)
		} else if got != want {
			t.Errorf("docs/operations.md says %s fires after %q; deploy/alerts.yml says %q", name, got, want)
		}
	}
	for name := range documented {
		if _, ok := shipped[name]; !ok {
			t.Errorf("docs/operations.md's alerts table lists %s, which deploy/alerts.yml does not hold", name)
		}
	}
}

// yamlBlocks returns the ```yaml blocks of a markdown file.
func yamlBlocks(t *testing.T, file string) []string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	rest := string(data)
	for {
		var ok bool
		if _, rest, ok = strings.Cut(rest, "```yaml\n"); !ok {
			return out
		}
		var block string
		block, rest, _ = strings.Cut(rest, "```")
		out = append(out, block)
	}
}

// TestREADMEExampleIsValid keeps the README's example policy loadable and
// meaning what the README says it means.
func TestREADMEExampleIsValid(t *testing.T) {
	blocks := yamlBlocks(t, "../README.md")
	if len(blocks) == 0 {
		t.Fatal("README.md has no yaml example")
	}
	c, err := policy.Parse([]byte(blocks[0]), false)
	if err != nil {
		t.Fatal(err)
	}
	p := c.Targets["payments"]
	if p == nil || p.Scope != policy.EndpointScope || p.MaxEjectionPercent != 40 || c.All.ConsecutiveFailures != 5 {
		t.Fatalf("example decoded to %+v", c.Targets)
	}
}

// TestGuideExamplesAreValid loads every policy example of the guides (a
// yaml block with a top-level policy key; kustomizations are left out).
func TestGuideExamplesAreValid(t *testing.T) {
	files, err := filepath.Glob("guides/*.md")
	if err != nil || len(files) == 0 {
		t.Fatalf("no guides: %v", err)
	}
	n := 0
	for _, f := range files {
		for i, b := range yamlBlocks(t, f) {
			if !regexp.MustCompile(`(?m)^(targets|all|workloads|mode|exclude):`).MatchString(b) {
				continue
			}
			n++
			if _, err := policy.Parse([]byte(b), false); err != nil {
				t.Errorf("%s, yaml block %d: %v", f, i+1, err)
			}
		}
	}
	if n < 5 {
		t.Errorf("only %d policy examples in the guides", n)
	}
	c, err := policy.Parse([]byte(yamlBlocks(t, "guides/responses.md")[0]), false)
	if err != nil {
		t.Fatal(err)
	}
	if w := c.Targets["web"]; w == nil || !w.Options.Responses.HTTP || w.Options.Responses.ResponseTimeout != 5*time.Second {
		t.Fatalf("the responses guide's example decoded to %+v", c.Targets)
	}
}

// markdownFiles are the files whose links TestLinks checks.
func markdownFiles(t *testing.T) []string {
	files := []string{"../README.md", "../CONTRIBUTING.md", "../BENCHMARKS.md"}
	for _, pattern := range []string{"*.md", "guides/*.md"} {
		m, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	return files
}

var (
	fence      = regexp.MustCompile("(?s)```.*?```")
	inlineCode = regexp.MustCompile("`[^`\n]*`")
	link       = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	heading    = regexp.MustCompile(`(?m)^#{1,6} +(.+?) *$`)
	notSlug    = regexp.MustCompile(`[^\p{L}\p{N} _-]`)
)

// anchors returns the anchors GitHub makes for a markdown file's
// headings: lower case, punctuation dropped, spaces as hyphens, and a
// repeated one numbered.
func anchors(text string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, m := range heading.FindAllStringSubmatch(fence.ReplaceAllString(text, ""), -1) {
		a := strings.ReplaceAll(notSlug.ReplaceAllString(strings.ToLower(m[1]), ""), " ", "-")
		if n := seen[a]; n > 0 {
			out[a+"-"+string(rune('0'+n))] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

// TestLinks: every relative link of the README, CONTRIBUTING.md,
// BENCHMARKS.md and docs/ names a file or directory that exists, and
// every anchor a heading of its file.
func TestLinks(t *testing.T) {
	texts := map[string]string{}
	read := func(path string) (string, bool) {
		path = filepath.Clean(path)
		if s, ok := texts[path]; ok {
			return s, true
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return "", false
		}
		texts[path] = string(b)
		return string(b), true
	}
	checked := 0
	for _, file := range markdownFiles(t) {
		text, ok := read(file)
		if !ok {
			t.Errorf("%s is missing", file)
			continue
		}
		prose := inlineCode.ReplaceAllString(fence.ReplaceAllString(text, ""), "")
		for _, m := range link.FindAllStringSubmatch(prose, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			checked++
			path, anchor, _ := strings.Cut(target, "#")
			dest := file
			if path != "" {
				dest = filepath.Join(filepath.Dir(file), path)
				if _, err := os.Stat(dest); err != nil {
					t.Errorf("%s links to %s, which does not exist", file, target)
					continue
				}
			}
			if anchor == "" {
				continue
			}
			destText, ok := read(dest)
			if !ok || !anchors(destText)[anchor] {
				t.Errorf("%s links to %s: no heading there makes #%s", file, target, anchor)
			}
		}
	}
	if checked < 20 {
		t.Errorf("only %d links checked", checked)
	}
}

// TestAnchors checks the slug rules TestLinks relies on.
func TestAnchors(t *testing.T) {
	got := anchors("# A\n## Kernel/user contract\n```\n# not a heading\n```\n### `close_established` in the DaemonSet\n## Responses (#19, response options)\n## A\n")
	want := []string{"a", "a-1", "close_established-in-the-daemonset", "kerneluser-contract", "responses-19-response-options"}
	var keys []string
	for k := range got {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if !slices.Equal(keys, want) {
		t.Fatalf("anchors %v, want %v", keys, want)
	}
}
