package policy

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path"
	"regexp"
	"strings"
)

// MaxWorkloads bounds the workloads of a configuration. A workload's
// class travels in one byte of the kernel's destination key (class 0 is
// the shared one), and class names are metric label values, so the set
// stays small.
const MaxWorkloads = 64

// MaxCgroupPatterns bounds the cgroup patterns of one workload.
const MaxCgroupPatterns = 64

// MaxSourcePatterns bounds the distinct cgroup patterns written in
// targets' `source` (each is a workload of its own, see SourcePrefix), so
// with MaxWorkloads every class still fits the kernel key's byte.
const MaxSourcePatterns = 64

// SourcePrefix marks an entry of a target's `source` that is a cgroup
// pattern rather than a workload name (`cgroup:kubepods.slice/tenant-a/**`).
// Each distinct pattern is a workload of its own, named by SourceWorkload.
const SourcePrefix = "cgroup:"

// SourceWorkload is the name of the workload a pattern in a `source` makes:
// "cgroup." and the first 8 hex digits of the pattern's SHA-256, the same
// in every target and across reloads, and never a listed workload's name
// (those cannot hold a '.').
func SourceWorkload(pattern string) string {
	sum := sha256.Sum256([]byte(pattern))
	return "cgroup." + hex.EncodeToString(sum[:4])
}

// SharedWorkload is the workload label of circuits shared by every
// protected workload that is not isolated (and of every circuit when no
// workload is configured). It is reserved as a workload name.
const SharedWorkload = "shared"

// Workload is one entry of the top-level `workloads` list: the protected
// processes of some cgroups.
type Workload struct {
	// Name labels the workload's circuits.
	Name string
	// Cgroups are glob patterns of cgroup paths relative to the cgroup
	// v2 mount (see MatchCgroup).
	Cgroups []string
	// Isolate gives the workload circuits and bulkheads of its own for
	// every destination, apart from every other workload's.
	Isolate bool
	// Namespaces and PodLabels select Kubernetes pods of this node (a
	// namespace in the list, when there is one, and every label of
	// PodLabels): the cgroups of the selected pods, and of their
	// containers, belong to the workload. They need Kubernetes API access.
	Namespaces []string
	PodLabels  map[string]string
	// Criticality puts the workload in its shared circuits' criticality
	// pool (criticality.go): "" keeps a bulkhead of its own.
	Criticality Criticality
	// Share is a sheddable workload's share of each circuit's limit.
	Share float64
	// Pattern is set on a workload made for a cgroup pattern written in a
	// target's `source` (Cgroups holds just it). Such workloads follow the
	// listed ones in Config.Workloads, are matched before them (see
	// WorkloadOf), are always isolated, and do not turn scoping on.
	Pattern string
}

// Kubernetes reports whether the workload selects pods.
func (w *Workload) Kubernetes() bool { return len(w.Namespaces) > 0 || len(w.PodLabels) > 0 }

// WorkloadOfPod is WorkloadOf for a cgroup that may be a pod's: the
// first workload (see WorkloadOf for the order) one of whose patterns
// matches rel, or that selects pods and for which selected(name) reports
// the cgroup's pod selected.
func (c *Config) WorkloadOfPod(rel string, selected func(workload string) bool) (*Workload, bool) {
	return c.CgroupMatcher().WorkloadOf(rel, selected)
}

// CgroupMatcher classifies cgroup paths by the workloads of one
// configuration, its patterns split into elements once: a daemon that
// classifies every cgroup made on a busy node keeps one per configuration.
type CgroupMatcher struct {
	// order is the workloads in the order they are matched (those made
	// by source patterns first), each with its patterns split.
	order []matcherWorkload
}

type matcherWorkload struct {
	w        *Workload
	patterns [][]string
}

// CgroupMatcher returns a CgroupMatcher of c's workloads (c must not
// change after).
func (c *Config) CgroupMatcher() *CgroupMatcher {
	m := &CgroupMatcher{}
	for _, inline := range []bool{true, false} {
		for i := range c.Workloads {
			w := &c.Workloads[i]
			if (w.Pattern != "") != inline {
				continue
			}
			mw := matcherWorkload{w: w}
			for _, p := range w.Cgroups {
				mw.patterns = append(mw.patterns, strings.Split(p, "/"))
			}
			m.order = append(m.order, mw)
		}
	}
	return m
}

// WorkloadOf is Config.WorkloadOfPod.
func (m *CgroupMatcher) WorkloadOf(rel string, selected func(workload string) bool) (*Workload, bool) {
	if len(m.order) == 0 {
		return nil, false
	}
	name := splitPath(rel)
	for _, mw := range m.order {
		for _, p := range mw.patterns {
			if matchElems(p, name) {
				return mw.w, true
			}
		}
		if mw.w.Kubernetes() && selected != nil && selected(mw.w.Name) {
			return mw.w, true
		}
	}
	return nil, false
}

// MayMatchBelow reports whether a cgroup below rel (rel itself not
// included) could match one of the patterns: one can match a longer path
// that starts with rel. Pod selection is left out: a pod's cgroups below
// rel belong to the pod of rel, or are new pods' cgroups, each classified
// by itself. A cgroup made with its children already in it is handled
// first when they may be protected.
func (m *CgroupMatcher) MayMatchBelow(rel string) bool {
	name := splitPath(rel)
	for _, mw := range m.order {
		for _, p := range mw.patterns {
			if matchPrefix(p, name) {
				return true
			}
		}
	}
	return false
}

// matchPrefix reports whether pat can match a path of more elements than
// name that begins with name.
func matchPrefix(pat, name []string) bool {
	for len(name) > 0 {
		if len(pat) == 0 {
			return false
		}
		if pat[0] == "**" {
			return true
		}
		if ok, _ := path.Match(pat[0], name[0]); !ok {
			return false
		}
		pat, name = pat[1:], name[1:]
	}
	return len(pat) > 0
}

// Class is a workload's class in the kernel's destination key: 0 when its
// circuits are the shared ones, else its position in the list plus one.
// A workload is isolated when it says so or when a target's `source`
// names it (a workload with options of its own has circuits of its own).
type Class uint8

// Classes says, for every configured workload, the class its connections
// are keyed by in the kernel, and the workload label of each class.
type Classes struct {
	byName map[string]Class
	names  map[Class]string
	// bulkheads is each workload's bulkhead class (its position plus
	// one); shared lists those of the workloads of class 0.
	bulkheads map[string]Class
	shared    []Class
	// shares are the bulkhead classes of the sharing workloads with a
	// criticality, and each one's share of the limit (1: critical).
	shares map[Class]float64
}

// Classes computes the classes of c's workloads.
func (c *Config) Classes() Classes {
	cl := Classes{byName: map[string]Class{}, names: map[Class]string{0: SharedWorkload}, bulkheads: map[string]Class{}, shares: map[Class]float64{}}
	sourced := map[string]bool{}
	for _, t := range c.Targets {
		for _, s := range t.Source {
			sourced[s] = true
		}
	}
	for i, w := range c.Workloads {
		k := Class(0)
		if w.Isolate || sourced[w.Name] {
			k = Class(i + 1)
			cl.names[k] = w.Name
		}
		cl.byName[w.Name] = k
		cl.bulkheads[w.Name] = Class(i + 1)
		if k == 0 {
			cl.shared = append(cl.shared, Class(i+1))
			if w.Criticality != "" {
				cl.shares[Class(i+1)] = w.Criticality.share(w.Share)
			}
		}
	}
	return cl
}

// Bulkhead returns the class the named workload's bulkhead limits are
// keyed by in the kernel: its position in the list plus one, for an
// isolated workload its class. Every workload has a bulkhead of its own,
// also one that shares circuits (class 0); processes of no workload (no
// list) count in class 0's.
func (cl Classes) Bulkhead(workload string) Class { return cl.bulkheads[workload] }

// SharedBulkheads returns the bulkhead classes of the workloads that share
// circuits (class 0), in the list's order: a shared circuit's bulkhead is
// one per class here (and class 0's, for processes of no workload).
func (cl Classes) SharedBulkheads() []Class { return cl.shared }

// SharedOfBulkhead returns the workload whose bulkhead class is k when it
// shares circuits, and "" otherwise.
func (cl Classes) SharedOfBulkhead(k Class) string {
	for w, b := range cl.bulkheads {
		if b == k && cl.byName[w] == 0 {
			return w
		}
	}
	return ""
}

// Of returns the class of the named workload.
func (cl Classes) Of(workload string) Class { return cl.byName[workload] }

// Name returns the workload label of class k: SharedWorkload for 0, the
// isolated workload's name otherwise, and "" for a class no workload has.
func (cl Classes) Name(k Class) string { return cl.names[k] }

// Scoped reports whether c selects protected workloads (a `workloads`
// list): with none, every process below the attach point is protected.
// Patterns in targets' sources do not make a configuration scoped.
func (c *Config) Scoped() bool {
	for i := range c.Workloads {
		if c.Workloads[i].Pattern == "" {
			return true
		}
	}
	return false
}

// Classed reports whether some cgroups have a workload, listed or made by
// a pattern in a source: then the kernel looks every connecting process's
// cgroup up in the workloads map.
func (c *Config) Classed() bool { return len(c.Workloads) > 0 }

// WorkloadOf returns the workload of the cgroup path rel (relative to the
// cgroup v2 mount, without a leading slash), and whether it has one: the
// first workload made by a source pattern that matches it, else the first
// listed workload (in the list's order) one of whose patterns matches it.
// A pattern written in a source is the more specific choice, so it wins.
func (c *Config) WorkloadOf(rel string) (*Workload, bool) {
	return c.WorkloadOfPod(rel, nil)
}

// MatchCgroup reports whether the cgroup path rel matches pattern. Both are
// slash-separated and relative to the cgroup v2 mount. Within one path
// element, `*`, `?` and `[…]` work as in path.Match; an element `**`
// matches any number of elements, none included, so `kubepods.slice/**`
// selects that cgroup and everything below it. A pattern without `**`
// selects exactly the cgroups it names, not their children.
func MatchCgroup(pattern, rel string) bool {
	return matchElems(strings.Split(pattern, "/"), splitPath(rel))
}

func splitPath(rel string) []string {
	if rel == "" || rel == "." {
		return nil
	}
	return strings.Split(rel, "/")
}

func matchElems(pat, name []string) bool {
	for len(pat) > 0 {
		if pat[0] == "**" {
			for len(pat) > 0 && pat[0] == "**" {
				pat = pat[1:]
			}
			if len(pat) == 0 {
				return true
			}
			for i := range name {
				if matchElems(pat, name[i:]) {
					return true
				}
			}
			return false
		}
		if len(name) == 0 {
			return false
		}
		if ok, _ := path.Match(pat[0], name[0]); !ok {
			return false
		}
		pat, name = pat[1:], name[1:]
	}
	return len(name) == 0
}

var (
	labelNameRE   = regexp.MustCompile(`^([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$`)
	labelValueRE  = regexp.MustCompile(`^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$`)
	labelPrefixRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$`)
)

// checkLabel says what is wrong with a Kubernetes label key and value, or
// "".
func checkLabel(key, value string) string {
	name := key
	if prefix, n, ok := strings.Cut(key, "/"); ok {
		if !labelPrefixRE.MatchString(prefix) {
			return fmt.Sprintf("label key prefix %q is not a DNS subdomain", quoteShort(prefix))
		}
		name = n
	}
	if !labelNameRE.MatchString(name) {
		return fmt.Sprintf("label key %q is not a label name (alphanumerics, '-', '_', '.', at most 63)", quoteShort(key))
	}
	if !labelValueRE.MatchString(value) {
		return fmt.Sprintf("label value %q is not a label value (alphanumerics, '-', '_', '.', at most 63)", quoteShort(value))
	}
	return ""
}

// checkPattern says what is wrong with a cgroup pattern, or "".
func checkPattern(p string) string {
	switch {
	case p == "":
		return "empty pattern"
	case strings.HasPrefix(p, "/"):
		return fmt.Sprintf("%q starts with /: patterns are relative to the cgroup v2 mount (system.slice/legacy-*.service)", p)
	case len(p) > 4096:
		return fmt.Sprintf("pattern of %d bytes; the limit is 4096", len(p))
	}
	for _, e := range strings.Split(p, "/") {
		switch {
		case e == "":
			return fmt.Sprintf("%q has an empty path element (//, or a trailing /)", p)
		case e == "." || e == "..":
			return fmt.Sprintf("%q has a %s element; write the path out", p, e)
		case e != "**" && strings.Contains(e, "**"):
			return fmt.Sprintf("%q: ** must be a whole path element (a/**/b)", p)
		}
		if _, err := path.Match(e, ""); err != nil {
			return fmt.Sprintf("%q is not a valid glob: %v", p, err)
		}
	}
	return ""
}

var workloadKeys = []string{"name", "cgroups", "isolate", "namespaces", "pod_labels", "criticality", "share"}

// workloads decodes the top-level `workloads` list.
func (d *decoder) workloads(val any) []Workload {
	list, ok := val.([]any)
	if !ok {
		d.add("workloads", "must be a list of workloads (name, cgroups, isolate)")
		return nil
	}
	if len(list) > MaxWorkloads {
		d.add("workloads", "%d workloads; the limit is %d", len(list), MaxWorkloads)
		return nil
	}
	var out []Workload
	seen := map[string]int{}
	for i, e := range list {
		p := fmt.Sprintf("workloads[%d]", i)
		if e == nil {
			continue // reported as an empty entry
		}
		m, ok := asMap(e)
		if !ok {
			d.add(p, "must be a mapping (name, cgroups, isolate)")
			continue
		}
		w := Workload{}
		for _, k := range sortedKeys(m) {
			v := m[k]
			if v == nil {
				continue // reported as a null value
			}
			switch k {
			case "name":
				s, _ := v.(string)
				switch {
				case !nameRE.MatchString(s):
					d.add(p+".name", "workload names must match [a-z0-9_-]+")
				case s == SharedWorkload:
					d.add(p+".name", "%q is reserved: it labels the circuits shared by every workload that is not isolated", s)
				default:
					w.Name = s
				}
			case "cgroups":
				patterns := d.strings(p+".cgroups", v)
				if _, isList := v.([]any); isList && len(patterns) == 0 {
					d.add(p+".cgroups", "empty: a workload needs at least one cgroup pattern")
				}
				for j, s := range patterns {
					if msg := checkPattern(s); msg != "" {
						d.add(fmt.Sprintf("%s.cgroups[%d]", p, j), "%s", msg)
						continue
					}
					w.Cgroups = append(w.Cgroups, s)
				}
				if len(w.Cgroups) > MaxCgroupPatterns {
					d.add(p+".cgroups", "%d patterns; the limit is %d", len(w.Cgroups), MaxCgroupPatterns)
				}
			case "namespaces":
				for j, ns := range d.strings(p+".namespaces", v) {
					if !dnsLabelRE.MatchString(ns) {
						d.add(fmt.Sprintf("%s.namespaces[%d]", p, j), "%q is not a namespace name (a DNS-1123 label)", quoteShort(ns))
						continue
					}
					w.Namespaces = append(w.Namespaces, ns)
				}
			case "pod_labels":
				w.PodLabels = map[string]string{}
				if lm, ok := asMap(v); ok {
					// The mapping form, as a matchLabels is written.
					for _, lk := range sortedKeys(lm) {
						lp := p + ".pod_labels." + lk
						lv, ok := lm[lk].(string)
						switch lm[lk].(type) {
						case map[string]any, []any:
							d.add(lp, "must be a label value (a string), not a mapping or a list")
							continue
						}
						if !ok {
							if lm[lk] != nil {
								d.add(lp, "%v is not a string: quote a label value that YAML reads as a number or a boolean (\"1\", \"true\")", lm[lk])
							}
							continue
						}
						if msg := checkLabel(lk, lv); msg != "" {
							d.add(lp, "%s", msg)
							continue
						}
						w.PodLabels[lk] = lv
					}
					break
				}
				for j, kv := range d.strings(p+".pod_labels", v) {
					lk, lv, ok := strings.Cut(kv, "=")
					msg := fmt.Sprintf("%q is not KEY=VALUE", quoteShort(kv))
					if ok {
						msg = checkLabel(lk, lv)
					}
					if msg != "" {
						d.add(fmt.Sprintf("%s.pod_labels[%d]", p, j), "%s", msg)
						continue
					}
					w.PodLabels[lk] = lv
				}
			case "isolate":
				b, ok := asBool(v)
				if !ok {
					d.add(p+".isolate", "%v is not true or false", v)
				}
				w.Isolate = b
			case "criticality":
				s, _ := asString(v)
				switch Criticality(s) {
				case Critical, Sheddable:
					w.Criticality = Criticality(s)
				default:
					d.add(p+".criticality", "%v is not critical or sheddable", v)
				}
			case "share":
				if err := setRatio(&w.Share, v, false); err != nil {
					d.add(p+".share", "%v", err)
				}
			default:
				d.add(p+"."+k, "unknown key%s", d.suggest(k, workloadKeys))
			}
		}
		if _, ok := m["name"]; !ok {
			d.add(p+".name", "missing: every workload needs a name")
		}
		_, hasNS := m["namespaces"]
		_, hasLabels := m["pod_labels"]
		if _, ok := m["cgroups"]; !ok && !hasNS && !hasLabels {
			d.add(p+".cgroups", "missing: a workload needs at least one cgroup pattern, or namespaces or pod_labels")
		}
		d.checkCriticality(p, m, &w)
		if w.Name != "" {
			if j, dup := seen[w.Name]; dup {
				d.add(p+".name", "%q is also the name of workloads[%d]", w.Name, j)
				continue
			}
			seen[w.Name] = i
		}
		out = append(out, w)
	}
	return out
}

func asBool(v any) (bool, bool) {
	switch b := v.(type) {
	case bool:
		return b, true
	case string: // from an environment variable
		switch strings.ToLower(b) {
		case "true":
			return true, true
		case "false":
			return false, true
		}
	}
	return false, false
}

// source decodes a target's `source`: names of workloads, and cgroup
// patterns after SourcePrefix.
func (d *decoder) source(path string, v any) []string {
	names := d.strings(path, v)
	if len(names) == 0 {
		d.add(path, "empty: name the workloads the target applies to, or remove source")
	}
	var out []string
	for i, s := range names {
		if p, ok := strings.CutPrefix(s, SourcePrefix); ok {
			if msg := checkPattern(p); msg != "" {
				d.add(fmt.Sprintf("%s[%d]", path, i), "%s", msg)
				continue
			}
		}
		out = append(out, s)
	}
	return out
}

// checkSources checks that every target's source names configured
// workloads, and turns each cgroup pattern in a source into the workload
// it makes (appended to c.Workloads once per distinct pattern, in the
// order of target names).
func (d *decoder) checkSources(c *Config) {
	known := map[string]bool{}
	var names []string
	for _, w := range c.Workloads {
		known[w.Name] = true
		names = append(names, w.Name)
	}
	made := 0
	for _, tn := range sortedTargetNames(c) {
		t := c.Targets[tn]
		for i, s := range t.Source {
			if p, ok := strings.CutPrefix(s, SourcePrefix); ok {
				name := SourceWorkload(p)
				t.Source[i] = name
				if !known[name] {
					if made++; made > MaxSourcePatterns {
						d.add(fmt.Sprintf("targets.%s.source[%d]", tn, i), "more than %d distinct cgroup patterns in sources", MaxSourcePatterns)
						continue
					}
					known[name] = true
					c.Workloads = append(c.Workloads, Workload{Name: name, Cgroups: []string{p}, Pattern: p})
				}
				continue
			}
			if !known[s] {
				d.add(fmt.Sprintf("targets.%s.source[%d]", tn, i), "%q is not a workload%s", s, d.suggest(s, names))
			}
		}
	}
}

// appliesTo reports whether t applies to the workload named w ("" for the
// shared class, which only targets without a source apply to).
func (t *Target) appliesTo(w string) bool {
	if len(t.Source) == 0 {
		return true
	}
	for _, s := range t.Source {
		if s == w {
			return true
		}
	}
	return false
}
