package policy

import (
	"errors"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestDefaultConfigIsValidAndMatchesBuiltInDefaults(t *testing.T) {
	c, err := Parse(DefaultYAML(), false)
	if err != nil {
		t.Fatal(err)
	}
	if c.All != DefaultOptions() {
		t.Fatalf("default.yaml's all block %+v differs from the built-in defaults %+v", c.All, DefaultOptions())
	}
	if c.Mode != Enforce || c.MaxCircuits != 100000 || c.FailsafeTimeout != 10*time.Second || c.MaxRTO != 3 {
		t.Fatalf("top level %+v", c)
	}
	// Every option appears in the embedded file, documented.
	for _, f := range optionFields {
		if !strings.Contains(string(DefaultYAML()), "  "+f.key+":") {
			t.Errorf("default.yaml does not show %s", f.key)
		}
	}
	if c2, err := LoadFile(""); err != nil || c2.All != c.All {
		t.Fatalf("LoadFile(\"\"): %v", err)
	}
}

func problems(t *testing.T, yaml string) []string {
	t.Helper()
	_, err := Parse([]byte(yaml), false)
	var ve *ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("want a ValidationError, got %v", err)
	}
	var out []string
	for _, p := range ve.Problems {
		out = append(out, p.Path+": "+p.Msg)
	}
	return out
}

func TestValidationReportsEveryProblemWithItsKeyPath(t *testing.T) {
	got := problems(t, `
mode: fast
all:
  failure_rate_treshold: 0.5
  window_size: ten
targets:
  payments:
    match: {cidrs: [10.0.0.0/24], ports: ["443"]}
    failure_rate_threshold: 1.5
    window_size: 100
    min_requests: 200
    reject_errno: EWHATEVER
    open_duration: 30
  Bad.Name:
    match: {cidrs: [10.1.0.0/16]}
  nomatch:
    scope: region
exclude:
  - cidrs: [not-a-cidr]
`)
	want := []string{
		"mode: fast is not enforce or shadow",
		"all.failure_rate_treshold: unknown key (did you mean failure_rate_threshold?)",
		`all.window_size: "ten" is not a number`,
		"targets.payments.failure_rate_threshold: 1.5 is not in (0, 1]",
		"targets.payments.min_requests: 200 exceeds window_size 100",
		`targets.payments.reject_errno: unknown errno "EWHATEVER"`,
		"targets.payments.open_duration: 30 is not a duration",
		"targets.nomatch.match: names no cidrs, hosts or service",
		"targets.nomatch.scope: region is not service or endpoint",
		`exclude[0].cidrs[0]: "not-a-cidr" is not an address or CIDR`,
	}
	joined := strings.Join(got, "\n")
	for _, w := range want {
		if !strings.Contains(joined, w) {
			t.Errorf("missing problem %q in:\n%s", w, joined)
		}
	}
	// Keys are case-sensitive and a dotted name is one key: reported
	// as it is written.
	if !strings.Contains(joined, "targets.Bad.Name: target names must match") {
		t.Errorf("the dotted target name is not reported:\n%s", joined)
	}
}

func TestOverlappingTargetsNameBoth(t *testing.T) {
	got := problems(t, `
targets:
  a:
    match: {cidrs: [10.0.0.0/24], ports: ["80"]}
  b:
    match: {cidrs: [10.0.0.0/24], ports: ["80", "443"]}
`)
	if len(got) != 1 || !strings.Contains(got[0], "targets.b.match") || !strings.Contains(got[0], "targets.a") {
		t.Fatalf("problems %v, want one naming targets.a and targets.b", got)
	}
	// More specific is fine.
	_, err := Parse([]byte(`
targets:
  a: {match: {cidrs: [10.0.0.0/16]}}
  b: {match: {cidrs: [10.0.0.0/24]}}
  c: {match: {cidrs: [10.0.0.0/24], ports: ["8000-8100"]}}
  d: {match: {cidrs: [10.0.0.0/24], ports: ["8080"]}}
`), false)
	if err != nil {
		t.Fatal(err)
	}
}

func TestTargetDoesNotInheritAll(t *testing.T) {
	c, err := Parse([]byte(`
all:
  open_duration: 1m
  min_requests: 3
  reject_errno: EHOSTUNREACH
targets:
  db:
    match: {cidrs: [192.0.2.10]}
    window_size: 50
`), false)
	if err != nil {
		t.Fatal(err)
	}
	def := DefaultOptions()
	db := c.Targets["db"].Options
	if db.OpenDuration != def.OpenDuration || db.MinRequests != def.MinRequests || db.RejectErrno != syscall.ECONNREFUSED {
		t.Fatalf("target took values from all: %+v", db)
	}
	if db.WindowSize != 50 || c.All.OpenDuration != time.Minute || c.All.RejectErrno != syscall.EHOSTUNREACH {
		t.Fatalf("own values lost: target %+v all %+v", db, c.All)
	}
	if c.Targets["db"].Scope != ServiceScope || c.Targets["db"].MaxEjectionPercent != 50 || c.Targets["db"].Match.Proto != "tcp" {
		t.Fatalf("target defaults: %+v", c.Targets["db"])
	}
}

func TestEnvironmentOverridesFile(t *testing.T) {
	t.Setenv("BREAKERD_MODE", "shadow")
	t.Setenv("BREAKERD_ALL_OPEN_DURATION", "42s")
	t.Setenv("BREAKERD_TARGETS_DB_MIN_REQUESTS", "7")
	c, err := Parse([]byte("targets:\n  db:\n    match: {cidrs: [192.0.2.1]}\n    min_requests: 3\n"), true)
	if err != nil {
		t.Fatal(err)
	}
	if c.Mode != Shadow || c.All.OpenDuration != 42*time.Second || c.Targets["db"].Options.MinRequests != 7 {
		t.Fatalf("env not applied: mode %s open %v db.min %d", c.Mode, c.All.OpenDuration, c.Targets["db"].Options.MinRequests)
	}
	t.Setenv("BREAKERD_ALL_JITTER", "2")
	if _, err := Parse([]byte("mode: enforce\n"), true); err == nil || !strings.Contains(err.Error(), "all.jitter: 2 is not in [0, 1]") {
		t.Fatalf("bad env value: %v", err)
	}
}

func TestBadYAML(t *testing.T) {
	got := problems(t, "all: [unclosed")
	if len(got) != 1 || !strings.HasPrefix(got[0], "(file): not valid YAML") {
		t.Fatalf("%v", got)
	}
}

func TestMatchPrecedence(t *testing.T) {
	c, err := Parse([]byte(`
targets:
  wide: {match: {cidrs: [10.0.0.0/8]}}
  narrow: {match: {cidrs: [10.1.0.0/16]}}
  ranged: {match: {cidrs: [10.1.0.0/16], ports: ["8000-8100"]}}
  exact: {match: {cidrs: [10.1.0.0/16], ports: ["8080"]}}
  dns: {match: {hosts: [db.internal], protocol: any}}
  v6: {match: {cidrs: ["2001:db8::/32"]}}
exclude:
  - cidrs: [10.1.2.3]
    ports: ["8080"]
`), false)
	if err != nil {
		t.Fatal(err)
	}
	m := NewMatcher(c, map[string][]netip.Addr{"db.internal": {netip.MustParseAddr("192.0.2.5")}})
	cases := []struct {
		addr     string
		port     uint16
		proto    string
		target   string
		excluded bool
	}{
		{"10.9.9.9", 80, "tcp", "wide", false},
		{"10.1.9.9", 80, "tcp", "narrow", false},
		{"10.1.9.9", 8050, "tcp", "ranged", false},
		{"10.1.9.9", 8080, "tcp", "exact", false},
		{"10.1.2.3", 8080, "tcp", "", true},
		{"10.1.2.3", 8081, "tcp", "ranged", false},
		{"::ffff:10.1.9.9", 8080, "tcp", "exact", false},
		{"10.1.9.9", 8080, "udp", "", false},
		{"192.0.2.5", 53, "udp", "dns", false},
		{"2001:db8::1", 443, "tcp", "v6", false},
		{"192.0.2.6", 80, "tcp", "", false},
	}
	for _, tc := range cases {
		target, ex := m.Match(netip.MustParseAddr(tc.addr), tc.port, tc.proto)
		if target != tc.target || ex != tc.excluded {
			t.Errorf("%s:%d/%s → (%q, %v), want (%q, %v)", tc.addr, tc.port, tc.proto, target, ex, tc.target, tc.excluded)
		}
	}
}

func TestDiff(t *testing.T) {
	base := `
targets:
  a: {match: {cidrs: [10.0.0.1]}}
  b: {match: {cidrs: [10.0.0.2]}}
  c: {match: {cidrs: [10.0.0.3]}}
`
	old, err := Parse([]byte(base), false)
	if err != nil {
		t.Fatal(err)
	}
	same, _ := Parse([]byte(base), false)
	if ch := Diff(old, same); !ch.Empty() || len(ch.Unchanged) != 3 {
		t.Fatalf("identical reload: %+v", ch)
	}
	next, err := Parse([]byte(`
all: {open_duration: 20s}
targets:
  a: {match: {cidrs: [10.0.0.1]}}
  b: {match: {cidrs: [10.0.0.2]}, open_duration: 1m}
  d: {match: {cidrs: [10.0.0.4]}}
`), false)
	if err != nil {
		t.Fatal(err)
	}
	ch := Diff(old, next)
	if !ch.AllChanged || strings.Join(ch.Unchanged, ",") != "a" || strings.Join(ch.Changed, ",") != "b" ||
		strings.Join(ch.Added, ",") != "d" || strings.Join(ch.Removed, ",") != "c" {
		t.Fatalf("diff %+v", ch)
	}
}

// TestReferenceListsEveryOption: the reference names every option key
// (docs/docs_test.go keeps docs/configuration.md equal to it).
func TestReferenceListsEveryOption(t *testing.T) {
	ref := Reference()
	for _, f := range optionFields {
		if !strings.Contains(ref, "`"+f.key+"`") {
			t.Errorf("reference lacks %s", f.key)
		}
	}
}

// FuzzLoad checks that no input makes the loader panic or hang, that a
// refused file says what is wrong (every problem with a path and a
// reason), and that an accepted configuration is internally consistent and
// within the limits. The seeds are the hostile files of issue 16; with the
// seed corpus it runs in every go test.
func FuzzLoad(f *testing.F) {
	f.Add(DefaultYAML())
	f.Add([]byte("targets:\n  a: {match: {cidrs: [10.0.0.0/8], ports: ['1-9']}, scope: endpoint}\n"))
	f.Add([]byte("all: {window_duration: 1s, min_requests: 0}\nexclude: [{hosts: [x]}]\n"))
	for _, h := range hostileFiles {
		f.Add([]byte(h.yaml))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse(data, false)
		if err != nil {
			var ve *ValidationError
			if !errors.As(err, &ve) || len(ve.Problems) == 0 {
				t.Fatalf("error without problems: %v", err)
			}
			if len(ve.Problems) > maxProblems+1 {
				t.Fatalf("%d problems", len(ve.Problems))
			}
			for _, p := range ve.Problems {
				if p.Path == "" || p.Msg == "" {
					t.Fatalf("problem without a path or a reason: %+v", p)
				}
			}
			return
		}
		if len(data) == 0 || len(c.Targets) > MaxTargets || len(c.Exclude) > MaxExclude {
			t.Fatalf("accepted %q: %d targets, %d excludes", data, len(c.Targets), len(c.Exclude))
		}
		for name := range c.Targets {
			if reservedNames[name] || !nameRE.MatchString(name) {
				t.Fatalf("accepted target name %q", name)
			}
		}
		for _, o := range append([]Options{c.All}, func() (os []Options) {
			for _, t := range c.Targets {
				os = append(os, t.Options)
			}
			return
		}()...) {
			if o.HalfOpenSuccessThreshold > o.HalfOpenProbes || o.MaxOpenDuration < o.OpenDuration || o.FailureRateThreshold <= 0 {
				t.Fatalf("accepted inconsistent options %+v", o)
			}
		}
		NewMatcher(c, nil).Match(netip.MustParseAddr("10.1.2.3"), 80, "tcp")
	})
}

// max_ejection_percent: 0 would silently never eject (or, with one
// endpoint always ejectable, mean one): it is an error.
func TestMaxEjectionPercentZeroIsAnError(t *testing.T) {
	got := strings.Join(problems(t, "targets:\n  pay:\n    match: {cidrs: [10.0.0.0/24]}\n    scope: endpoint\n    max_ejection_percent: 0\n"), "\n")
	if !strings.Contains(got, "targets.pay.max_ejection_percent: 0 is not in [1, 100]") {
		t.Fatalf("problems: %s", got)
	}
}

// max_circuits goes up to 2^20 (closed dynamic circuits hold no kernel id)
// and no further; the value past it is named.
func TestMaxCircuitsBounded(t *testing.T) {
	for _, v := range []string{"131072", "131073", "1048576"} {
		if _, err := Parse([]byte("max_circuits: "+v+"\n"), false); err != nil {
			t.Fatalf("max_circuits: %s: %v", v, err)
		}
	}
	for _, v := range []string{"1048577", "10000000"} {
		_, err := Parse([]byte("max_circuits: "+v+"\n"), false)
		if err == nil || !strings.Contains(err.Error(), "max_circuits: "+v+" is not in [1, 1048576]") {
			t.Fatalf("max_circuits: %s: %v, want an error naming max_circuits and its limit", v, err)
		}
	}
}

// close_established closes TCP connections: on a UDP-only target it is an
// error naming the key; a value that is not a boolean names it too.
func TestCloseEstablishedValidation(t *testing.T) {
	got := strings.Join(problems(t, `
targets:
  dns:
    match: {cidrs: [10.0.0.10], ports: ["53"], protocol: udp}
    close_established: true
  web:
    match: {cidrs: [10.0.0.0/24]}
    close_established: sometimes
`), "\n")
	for _, want := range []string{
		"targets.dns.close_established: closes TCP connections, but match.protocol is udp",
		`targets.web.close_established: "sometimes" is not true or false`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("problems:\n%s\nwant %q", got, want)
		}
	}
	cfg, err := Parse([]byte("targets:\n  web:\n    match: {cidrs: [10.0.0.0/24], protocol: any}\n    close_established: true\n"), false)
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.Targets["web"].Options.CloseEstablished || cfg.All.CloseEstablished {
		t.Fatalf("close_established: target %v, all %v; want true, false", cfg.Targets["web"].Options.CloseEstablished, cfg.All.CloseEstablished)
	}
}
