package main

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestHostOnlyListNamesTests checks that every name in vmtest/host-only
// is a test of the daemon package, so a renamed test does not silently
// come back into (or a deleted one linger in) the list of those the VMs
// leave out.
func TestHostOnlyListNamesTests(t *testing.T) {
	names, err := hostOnly("host-only")
	if err != nil {
		t.Fatal(err)
	}
	if len(names) == 0 {
		t.Fatal("vmtest/host-only names no test")
	}
	files, err := filepath.Glob("../daemon/*_test.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("daemon's test files: %v %v", files, err)
	}
	tests := map[string]bool{}
	decl := regexp.MustCompile(`(?m)^func ((?:Test|Fuzz)\w+)\(`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range decl.FindAllSubmatch(b, -1) {
			tests[string(m[1])] = true
		}
	}
	seen := map[string]bool{}
	for _, n := range names {
		if !tests[n] {
			t.Errorf("vmtest/host-only: %s is no test of the daemon package", n)
		}
		if seen[n] {
			t.Errorf("vmtest/host-only: %s is listed twice", n)
		}
		seen[n] = true
	}
}

// hostOnly reads the test names of a host-only list: one a line, with
// blank lines and # comments ignored.
func hostOnly(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var names []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		names = append(names, line)
	}
	return names, s.Err()
}
