package policy

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"
)

// shadowLike is the shape of /etc/shadow (made-up hashes).
const shadowLike = `root:$y$j9T$Zm9vYmFy$c2VjcmV0aGFzaGVkcGFzc3dvcmQ:19700:0:99999:7:::
daemon:*:19700:0:99999:7:::
bin:*:19700:0:99999:7:::
nobody:*:19700:0:99999:7:::
`

// hostileFiles are the files of issue 16 and their kin: each must be
// refused with a problem that says what is wrong, and where.
var hostileFiles = []struct {
	name, yaml string
	want       []string
}{
	{"empty", "", []string{"(file): empty"}},
	{"only comments", "# nothing\n   # here\n", []string{"(file): empty"}},
	{"only a document marker", "---\n", []string{"(file): the top level must be a mapping", "nothing (null)"}},
	{"empty mapping", "{}\n", []string{"(file): empty mapping"}},
	// Its lines parse as keys with null values. The keys are not echoed
	// (they would put password hashes into the daemon's log).
	{"shadow-like", shadowLike, []string{"(key of 66 bytes on line 1): unknown key (line 1)", "(key of 26 bytes on line 2): no value (null); give it one or remove the key (line 2)", "(key of 26 bytes on line 4): unknown key (line 4)"}},
	{"bogus key", "bogus_key:\n", []string{"bogus_key: unknown key (line 1)", "bogus_key: no value (null)"}},
	{"bogus key with a value", "mode: enforce\nbogus_key: 1\n", []string{"bogus_key: unknown key (line 2)"}},
	{"misspelt option without a value", "all:\n  failure_rate_treshold:\n", []string{
		"all.failure_rate_treshold: unknown key (did you mean failure_rate_threshold?) (line 2)",
		"all.failure_rate_treshold: no value (null)"}},
	{"bad target name without a block", "targets:\n  Bad Name!:\n", []string{"targets.Bad Name!: target names must match [a-z0-9_-]+ (line 2)"}},
	{"multi-document", "mode: enforce\n---\nmode: shadow\n", []string{"(file): more than one YAML document; breakerd reads exactly one (line 2)"}},
	{"multi-document, empty second", "mode: enforce\n---\n", []string{"more than one YAML document"}},
	{"null mode", "mode:\n", []string{"mode: no value (null)"}},
	{"null targets", "targets:\n", []string{"targets: no value (null)"}},
	{"null all", "mode: enforce\nall: ~\n", []string{"all: no value (null); give it one or remove the key (line 2)"}},
	{"null exclude", "exclude: null\n", []string{"exclude: no value (null)"}},
	{"null target", "targets:\n  db:\n", []string{"targets.db: no value (null); give it one or remove the key (line 2)"}},
	{"null match", "targets:\n  db:\n    match:\n", []string{"targets.db.match: no value (null); give it one or remove the key (line 3)", "targets.db.match: names no cidrs, hosts or service"}},
	{"null ports", "targets:\n  db:\n    match:\n      cidrs: [10.0.0.1]\n      ports:\n", []string{"targets.db.match.ports: no value (null); give it one or remove the key (line 5)"}},
	{"null option", "targets:\n  db:\n    match: {cidrs: [10.0.0.1]}\n    open_duration:\n", []string{"targets.db.open_duration: no value (null); give it one or remove the key (line 4)"}},
	{"null list entry", "targets:\n  db:\n    match: {cidrs: [10.0.0.1, ~]}\n", []string{"targets.db.match.cidrs[1]: empty list entry (null) (line 3)"}},
	{"null exclude entry", "exclude:\n  -\n", []string{"exclude[0]: empty list entry (null) (line 2)"}},
	{"unknown key in match", "targets:\n  db:\n    match: {cidrs: [10.0.0.1], cidr: [10.0.0.2]}\n", []string{"targets.db.match.cidr: unknown key"}},
	{"capitalised key", "Mode: enforce\n", []string{"Mode: unknown key (did you mean mode?) (line 1)"}},
	{"duplicate key", "mode: enforce\nmode: shadow\n", []string{"mode: duplicate key (first at line 1) (line 2)"}},
	{"merge key", "targets:\n  db:\n    <<: {jitter: 0}\n    match: {cidrs: [10.0.0.1]}\n", []string{"targets.db: merge keys (<<) are not supported; write the keys out (line 3)"}},
	{"alias", "all: &a {jitter: 0}\nmode: *a\n", []string{"mode: aliases (*a) are not supported; write the value out (line 2)"}},
	{"list at the top", "- mode: enforce\n", []string{"(file): the top level must be a mapping", "not a list"}},
	{"nested list as an address", "targets:\n  db:\n    match: {cidrs: [[10.0.0.1]]}\n", []string{"targets.db.match.cidrs[0]: must be a single value, not a list"}},
	{"complex key", "? [a, b]\n: 1\n", []string{"(file): a key must be a plain name"}},
	{"reserved name all", "targets:\n  all: {match: {cidrs: [10.0.0.1]}}\n", []string{`targets.all: "all" is reserved`}},
	{"reserved name tcp", "targets:\n  tcp: {match: {cidrs: [10.0.0.1]}, scope: endpoint}\n", []string{`targets.tcp: "tcp" is reserved`, "tcp/addr:port"}},
	{"reserved name udp", "targets:\n  udp: {match: {cidrs: [10.0.0.1]}}\n", []string{`targets.udp: "udp" is reserved`}},
	{"deep flow nesting", "mode: " + strings.Repeat("[", 5000) + strings.Repeat("]", 5000) + "\n", []string{"(file): nested more than 16 levels deep (line 1)"}},
	{"deep flow mapping", "all: " + strings.Repeat("{a: ", 5000) + "1" + strings.Repeat("}", 5000) + "\n", []string{"nested more than 16 levels deep"}},
	{"deep compact lists", "exclude:\n  " + strings.Repeat("- ", 5000) + "x\n", []string{"nested more than 16 levels deep (line 2)"}},
	{"deep block nesting", deepBlock(200), []string{"nested more than 16 levels deep"}},
	// YAML takes CR, NEL, LS and PS as line breaks too: the check on the
	// text must not see one long line.
	{"deep lists after CR", "exclude:\r  " + strings.Repeat("- ", 5000) + "x\r", []string{"(file): nested more than 16 levels deep (line 2)"}},
	{"deep lists after CR LF", "exclude:\r\n  " + strings.Repeat("- ", 5000) + "x\r\n", []string{"(file): nested more than 16 levels deep (line 2)"}},
	{"deep lists after LS", "exclude:\u2028  " + strings.Repeat("- ", 5000) + "x\n", []string{"(file): nested more than 16 levels deep (line 2)"}},
	{"deep lists after NEL", "exclude:\u0085  " + strings.Repeat("- ", 5000) + "x\n", []string{"(file): nested more than 16 levels deep (line 2)"}},
	// Quotes and brackets that would mislead a naive count.
	{"brackets after a quote in a plain scalar", "mode: [x'" + strings.Repeat("[", 5000) + strings.Repeat("]", 5001) + "\n", []string{"(file): nested more than 16 levels deep"}},
	{"closing brackets in a quoted value", "mode: " + strings.Repeat(strings.Repeat("[", 10)+`{"a":"`+strings.Repeat("]", 10)+`", b: `, 100) + "1" + strings.Repeat("}"+strings.Repeat("]", 10), 100) + "\n", []string{"(file): nested more than 16 levels deep"}},
	{"unbalanced bracket in a block scalar", "mode: |\n  [\n" + deepBlock(200), []string{"(file): nested more than 16 levels deep"}},
	{"deep block nesting after CR", strings.ReplaceAll(deepBlock(200), "\n", "\r"), []string{"(file): nested more than 16 levels deep"}},
	{"not YAML", "all: [unclosed\n", []string{"(file): not valid YAML"}},
}

func deepBlock(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(strings.Repeat(" ", i) + "a:\n")
	}
	b.WriteString(strings.Repeat(" ", n) + "b: 1\n")
	return b.String()
}

func TestHostileFilesAreRefused(t *testing.T) {
	for _, tc := range hostileFiles {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse([]byte(tc.yaml), false)
			var ve *ValidationError
			if !errors.As(err, &ve) || len(ve.Problems) == 0 {
				t.Fatalf("accepted (%+v) or not a ValidationError: %v", c, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("missing %q in:\n%v", w, err)
				}
			}
			// Environment overrides never turn a hostile file valid.
			t.Setenv("BREAKERD_MODE", "enforce")
			if _, err := Parse([]byte(tc.yaml), true); err == nil {
				t.Fatal("accepted with environment overrides")
			}
		})
	}
}

func TestDeepNestingWithinTheParserIsReportedByKeyPath(t *testing.T) {
	// Nesting the pre-scan lets through is still bounded by the decoder,
	// which names the key path.
	got := problems(t, "targets:\n  db:\n    match:\n      cidrs: "+strings.Repeat("[", 12)+"1"+strings.Repeat("]", 12)+"\n")
	if !strings.Contains(strings.Join(got, "\n"), "targets.db.match.cidrs[0][0][0]") {
		t.Fatalf("%v", got)
	}
}

// TestLoadFileReadsOnlyRegularFiles: a FIFO, a device or a directory is
// refused without blocking or reading; a symlink to a hostile file is
// refused for its content.
func TestLoadFileReadsOnlyRegularFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	shadow := filepath.Join(dir, "shadow")
	if err := os.WriteFile(shadow, []byte(shadowLike), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "config.yaml")
	if err := os.Symlink(shadow, link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ path, want string }{
		{fifo, "not a regular file (it is a FIFO)"},
		{"/dev/null", "not a regular file (it is a character device)"},
		{"/dev/urandom", "not a regular file (it is a character device)"},
		{"/dev/zero", "not a regular file (it is a character device)"},
		{dir, "not a regular file (it is a directory)"},
		{filepath.Join(dir, "missing.yaml"), "no such file"},
		{link, "(key of 66 bytes on line 1): unknown key (line 1)"},
	} {
		done := make(chan error, 1)
		go func() {
			_, err := LoadFile(tc.path)
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("LoadFile(%s): %v, want %q", tc.path, err, tc.want)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("LoadFile(%s) blocked", tc.path)
		}
	}
	if _, err := LoadFile(fifo); !errors.Is(err, ErrNotRegular) {
		t.Fatalf("not wrapped: %v", err)
	}
}

// TestLoadFileReadsAtMostTheLimit: a 10 GB (sparse) file is refused
// without reading it, and memory stays bounded.
func TestLoadFileReadsAtMostTheLimit(t *testing.T) {
	path := filepath.Join(t.TempDir(), "huge.yaml")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(10 << 30); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err = LoadFile(path)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), "the limit is 1048576") {
		t.Fatalf("LoadFile of 10 GB: %v", err)
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 4<<20 {
		t.Fatalf("allocated %d bytes refusing it", grew)
	}
	// Just over the limit, as bytes.
	if _, err := Parse(make([]byte, MaxFileBytes+1), false); err == nil || !strings.Contains(err.Error(), "the limit is 1048576") {
		t.Fatalf("Parse over the limit: %v", err)
	}
}

func TestLimits(t *testing.T) {
	addrs := func(n int, base string) string {
		var s []string
		for i := range n {
			s = append(s, fmt.Sprintf("%s.%d.%d", base, i/250, i%250+1))
		}
		return strings.Join(s, ", ")
	}
	ports := func(n int) string {
		var s []string
		for i := range n {
			s = append(s, fmt.Sprintf("%q", fmt.Sprint(1000+i)))
		}
		return strings.Join(s, ", ")
	}
	var targets strings.Builder
	targets.WriteString("targets:\n")
	for i := range MaxTargets + 1 {
		fmt.Fprintf(&targets, "  t%d: {match: {cidrs: [10.%d.%d.1]}}\n", i, i/250, i%250)
	}
	var excl strings.Builder
	excl.WriteString("exclude:\n")
	for i := range MaxExclude + 1 {
		fmt.Fprintf(&excl, "  - {cidrs: [10.%d.%d.1]}\n", i/250, i%250)
	}
	var hosts []string
	for i := range MaxHosts + 1 {
		hosts = append(hosts, fmt.Sprintf("h%d.example", i))
	}
	var keys strings.Builder
	keys.WriteString("all:\n")
	for i := range 40_000 {
		fmt.Fprintf(&keys, "  k%d: 1\n", i)
	}
	var entries strings.Builder
	entries.WriteString("all:\n")
	for i := range MaxEntries + 1 {
		fmt.Fprintf(&entries, "  k%d: 1\n", i)
	}
	for _, tc := range []struct{ name, yaml, want string }{
		{"targets", targets.String(), "targets: 1001 targets; the limit is 1000"},
		{"exclude blocks", excl.String(), "exclude: 1001 exclude blocks; the limit is 1000"},
		{"addresses per block", "targets:\n  db: {match: {cidrs: [" + addrs(MaxAddresses+1, "10.1") + "]}}\n", "targets.db.match: 1001 cidrs and hosts; the limit is 1000 per match block"},
		{"ports per block", "targets:\n  db: {match: {cidrs: [10.0.0.1], ports: [" + ports(MaxPorts+1) + "]}}\n", "targets.db.match.ports: 101 ports and ranges; the limit is 100"},
		{"match entries", "targets:\n  a: {match: {cidrs: [" + addrs(1000, "10.1") + "], ports: [" + ports(60) + "]}}\n  b: {match: {cidrs: [" + addrs(1000, "10.2") + "], ports: [" + ports(60) + "]}}\n", "(file): targets and excludes name 120000 address × port pairs; the limit is 100000"},
		{"host names", "exclude:\n  - hosts: [" + strings.Join(hosts, ", ") + "]\n", "(file): 257 distinct host names; the limit is 256"},
		{"entries", entries.String(), "more than 50000 keys and list entries in the file"},
		{"problems are capped", keys.String(), "(file): and 39900 more problems"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml), false)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %.500v, want %q", err, tc.want)
			}
			var ve *ValidationError
			if errors.As(err, &ve) && len(ve.Problems) > maxProblems+1 {
				t.Fatalf("%d problems reported", len(ve.Problems))
			}
		})
	}
	// At the limits, a file is valid.
	if _, err := Parse([]byte(bigConfig(MaxTargets, 20, 0)), false); err != nil {
		t.Fatalf("1000 targets × 20 addresses: %.500v", err)
	}
}

// bigConfig has n targets of k addresses each (10.<t/250>.<t%250>.<a>, a
// /24 per target with distinct ports), and ex exclude addresses in blocks
// of MaxAddresses.
func bigConfig(n, k, ex int) string {
	var b strings.Builder
	b.WriteString("targets:\n")
	for t := range n {
		fmt.Fprintf(&b, "  t%d:\n    match:\n      ports: [\"%d\"]\n      cidrs: [", t, 1000+t%50)
		for a := range k {
			if a > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "10.%d.%d.%d", t/250, t%250, a+1)
		}
		b.WriteString("]\n")
	}
	if ex > 0 {
		b.WriteString("exclude:\n")
		for i := 0; i < ex; i += MaxAddresses {
			b.WriteString("  - cidrs: [")
			for j := i; j < min(ex, i+MaxAddresses); j++ {
				if j > i {
					b.WriteString(",")
				}
				fmt.Fprintf(&b, "172.%d.%d.%d", 16+j>>16, j>>8&255, j&255)
			}
			b.WriteString("]\n")
		}
	}
	return b.String()
}

// naiveMatch is the linear scan the matcher replaced: every entry, most
// specific first.
func naiveMatch(c *Config, resolved map[string][]netip.Addr, a netip.Addr, port uint16, proto string) (string, bool) {
	a = a.Unmap()
	for _, ex := range c.Exclude {
		for _, e := range entries("", ex, resolved) {
			if e.covers(a, port, proto) {
				return "", true
			}
		}
	}
	var all []entry
	for _, name := range sortedTargetNames(c) {
		all = append(all, entries(name, c.Targets[name].Match, resolved)...)
	}
	sort.SliceStable(all, func(i, j int) bool { return all[j].spec.less(all[i].spec) })
	for _, e := range all {
		if e.covers(a, port, proto) {
			return e.target, false
		}
	}
	return "", false
}

// TestMatcherAgreesWithLinearScan compares the prefix index with the
// linear scan on random configurations and destinations.
func TestMatcherAgreesWithLinearScan(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	protos := []string{"tcp", "udp", "any"}
	randPrefix := func() string {
		if rng.IntN(4) == 0 {
			return fmt.Sprintf("2001:db8:%x::/%d", rng.IntN(4), 32+rng.IntN(97))
		}
		return fmt.Sprintf("10.%d.%d.%d/%d", rng.IntN(3), rng.IntN(3), rng.IntN(4), 8+rng.IntN(25))
	}
	randPorts := func() string {
		switch rng.IntN(3) {
		case 0:
			return ""
		case 1:
			return fmt.Sprintf(`, ports: ["%d"]`, 80+rng.IntN(4))
		}
		lo := 70 + rng.IntN(20)
		return fmt.Sprintf(`, ports: ["%d-%d"]`, lo, lo+rng.IntN(20))
	}
	accepted := 0
	for round := range 400 {
		var b strings.Builder
		b.WriteString("targets:\n")
		for i := range 1 + rng.IntN(6) {
			fmt.Fprintf(&b, "  t%d: {match: {cidrs: [%s, %s]%s, protocol: %s}}\n", i, randPrefix(), randPrefix(), randPorts(), protos[rng.IntN(3)])
		}
		if rng.IntN(2) == 0 {
			fmt.Fprintf(&b, "exclude:\n  - {cidrs: [%s]%s, protocol: %s}\n", randPrefix(), randPorts(), protos[rng.IntN(3)])
		}
		c, err := Parse([]byte(b.String()), false)
		if err != nil {
			continue // overlapping targets: the overlap test covers those
		}
		accepted++
		m := NewMatcher(c, nil)
		for range 200 {
			var a netip.Addr
			if rng.IntN(4) == 0 {
				a = netip.MustParseAddr(fmt.Sprintf("2001:db8:%x::%x", rng.IntN(4), rng.IntN(3)))
			} else {
				a = netip.MustParseAddr(fmt.Sprintf("10.%d.%d.%d", rng.IntN(3), rng.IntN(3), rng.IntN(6)))
			}
			port := uint16(65 + rng.IntN(40))
			proto := []string{"tcp", "udp"}[rng.IntN(2)]
			gt, ge := m.Match(a, port, proto)
			wt, we := naiveMatch(c, nil, a, port, proto)
			if gt != wt || ge != we {
				t.Fatalf("round %d: %s:%d/%s → (%q, %v), linear scan (%q, %v)\n%s", round, a, port, proto, gt, ge, wt, we, b.String())
			}
		}
	}
	if accepted < 50 {
		t.Fatalf("only %d random configurations were valid", accepted)
	}
}

// naiveOverlaps is the quadratic check the sweep replaced: target pairs
// with an entry of equal specificity in common.
func naiveOverlaps(c *Config) map[[2]string]bool {
	out := map[[2]string]bool{}
	names := sortedTargetNames(c)
	for i, a := range names {
		for _, b := range names[i+1:] {
			for _, x := range entries(a, c.Targets[a].Match, nil) {
				for _, y := range entries(b, c.Targets[b].Match, nil) {
					if x.spec == y.spec && x.prefix.Overlaps(y.prefix) && portsOverlap(x.ports, y.ports) && protosOverlap(x.proto, y.proto) {
						out[[2]string{a, b}] = true
					}
				}
			}
		}
	}
	return out
}

func TestOverlapSweepAgreesWithPairwiseCheck(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for round := range 2000 {
		c := &Config{Targets: map[string]*Target{}}
		for i := range 2 + rng.IntN(5) {
			m := Match{Proto: []string{"tcp", "udp", "any"}[rng.IntN(3)]}
			for range 1 + rng.IntN(3) {
				m.Prefixes = append(m.Prefixes, netip.MustParsePrefix(fmt.Sprintf("10.0.%d.0/%d", rng.IntN(2), 23+rng.IntN(2))).Masked())
			}
			for range rng.IntN(3) {
				lo := uint16(1 + rng.IntN(30))
				hi := lo
				if rng.IntN(2) == 0 {
					hi += uint16(rng.IntN(10))
				}
				m.Ports = append(m.Ports, PortRange{lo, hi})
			}
			name := fmt.Sprintf("t%d", i)
			c.Targets[name] = &Target{Name: name, Match: m}
		}
		d := &decoder{lines: map[string]int{}}
		d.overlaps(c)
		got := map[[2]string]bool{}
		for _, p := range d.problems {
			b := strings.TrimSuffix(strings.TrimPrefix(p.Path, "targets."), ".match")
			_, a, _ := strings.Cut(p.Msg, "as specifically as targets.")
			a, _, _ = strings.Cut(a, ";")
			got[[2]string{a, b}] = true
		}
		// The sweep names at least one conflicting pair per conflict (not
		// every pair: that output alone would be quadratic), and only
		// pairs that conflict.
		want := naiveOverlaps(c)
		subset := true
		for p := range got {
			subset = subset && want[p]
		}
		if !subset || (len(got) == 0) != (len(want) == 0) {
			t.Fatalf("round %d: sweep %v, pairwise %v\n%+v", round, got, want, c.Targets)
		}
	}
}

// BenchmarkMatch measures one lookup with 1 target, 1,000 targets × 20
// addresses, and with as many exclude addresses as MaxEntries allows
// beside them (24,000), or alone (48,000).
func BenchmarkMatch(b *testing.B) {
	for _, bc := range []struct {
		name        string
		targets, ex int
	}{
		{"targets=1", 1, 0},
		{"targets=1000x20", 1000, 0},
		{"targets=1000x20,exclude=24000", 1000, 24_000},
		{"targets=1,exclude=48000", 1, 48_000},
	} {
		c, err := Parse([]byte(bigConfig(bc.targets, 20, bc.ex)), false)
		if err != nil {
			b.Fatalf("%.300v", err)
		}
		m := NewMatcher(c, nil)
		// A destination of the last target, one of `all`, and an excluded one.
		dests := []netip.Addr{
			netip.MustParseAddr(fmt.Sprintf("10.%d.%d.7", (bc.targets-1)/250, (bc.targets-1)%250)),
			netip.MustParseAddr("192.0.2.1"),
			netip.MustParseAddr("172.16.0.9"),
		}
		b.Run(bc.name, func(b *testing.B) {
			i := 0
			for b.Loop() {
				m.Match(dests[i%3], uint16(1000+(bc.targets-1)%50), "tcp")
				i++
			}
		})
	}
}

// BenchmarkParse measures loading (decoding, validating, the overlap
// check) of the same configurations.
func BenchmarkParse(b *testing.B) {
	for _, bc := range []struct {
		name        string
		targets, ex int
	}{
		{"targets=1", 1, 0},
		{"targets=1000x20", 1000, 0},
		{"targets=1000x20,exclude=24000", 1000, 24_000},
		{"targets=1,exclude=48000", 1, 48_000},
	} {
		data := []byte(bigConfig(bc.targets, 20, bc.ex))
		b.Run(bc.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := Parse(data, false); err != nil {
					b.Fatalf("%.300v", err)
				}
			}
		})
	}
}

// BenchmarkMatchLinearScan is the lookup the prefix index replaced (every
// entry, most specific first), on the same configurations, for comparison.
func BenchmarkMatchLinearScan(b *testing.B) {
	for _, bc := range []struct {
		name        string
		targets, ex int
	}{
		{"targets=1", 1, 0},
		{"targets=1000x20", 1000, 0},
		{"targets=1000x20,exclude=24000", 1000, 24_000},
	} {
		c, err := Parse([]byte(bigConfig(bc.targets, 20, bc.ex)), false)
		if err != nil {
			b.Fatalf("%.300v", err)
		}
		var exclude, targets []entry
		for _, ex := range c.Exclude {
			exclude = append(exclude, entries("", ex, nil)...)
		}
		for _, name := range sortedTargetNames(c) {
			targets = append(targets, entries(name, c.Targets[name].Match, nil)...)
		}
		sort.SliceStable(targets, func(i, j int) bool { return targets[j].spec.less(targets[i].spec) })
		match := func(a netip.Addr, port uint16, proto string) string {
			for _, e := range exclude {
				if e.covers(a, port, proto) {
					return ""
				}
			}
			for _, e := range targets {
				if e.covers(a, port, proto) {
					return e.target
				}
			}
			return ""
		}
		dests := []netip.Addr{
			netip.MustParseAddr(fmt.Sprintf("10.%d.%d.7", (bc.targets-1)/250, (bc.targets-1)%250)),
			netip.MustParseAddr("192.0.2.1"),
			netip.MustParseAddr("172.16.0.9"),
		}
		b.Run(bc.name, func(b *testing.B) {
			i := 0
			for b.Loop() {
				match(dests[i%3], uint16(1000+(bc.targets-1)%50), "tcp")
				i++
			}
		})
	}
}
