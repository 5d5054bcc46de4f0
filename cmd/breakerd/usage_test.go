package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		env  string // set to val ("" unless given) for this case
		val  string
		want string
	}{
		{[]string{"--bogus"}, "", "", "unknown flag: --bogus"},
		{[]string{"frobnicate"}, "", "", `unknown command "frobnicate"`},
		{[]string{"run", "extra"}, "", "", `unexpected argument "extra"`},
		{[]string{"--bpffs", ""}, "", "", "--bpffs (BREAKERD_BPFFS) is empty"},
		{[]string{"--cgroup="}, "", "", "--cgroup (BREAKERD_CGROUP) is empty"},
		{[]string{"uninstall", "--bpffs="}, "", "", "--bpffs (BREAKERD_BPFFS) is empty"},
		{nil, "BREAKERD_BPFFS", "", "--bpffs (BREAKERD_BPFFS) is empty"},
		{nil, "BREAKERD_CGROUP", "", "--cgroup (BREAKERD_CGROUP) is empty"},
		{[]string{"--log-level", "loud"}, "", "", `--log-level (BREAKERD_LOG_LEVEL): "loud" is not debug`},
		{nil, "BREAKERD_LOG_FORMAT", "xml", `--log-format (BREAKERD_LOG_FORMAT): "xml" is not text or json`},
		{[]string{"--close-mechanism", "iterator"}, "", "", `--close-mechanism (BREAKERD_CLOSE_MECHANISM): "iterator" is not auto, bpf_sock_destroy, sock_diag or none`},
		{nil, "BREAKERD_CLOSE_MECHANISM", "destroy", `--close-mechanism (BREAKERD_CLOSE_MECHANISM): "destroy" is not auto`},
		{[]string{"probe"}, "BREAKERD_CLOSE_MECHANISM", "destroy", `--close-mechanism (BREAKERD_CLOSE_MECHANISM): "destroy" is not auto`},
	} {
		t.Run(strings.Join(append(c.args, c.env+"="+c.val), " "), func(t *testing.T) {
			if c.env != "" {
				t.Setenv(c.env, c.val) // undone when the case ends
			}
			var out bytes.Buffer
			err := run(c.args, &out)
			var ue usageError
			if !errors.As(err, &ue) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%q %s=%q: %v, want a usage error with %q", c.args, c.env, c.val, err, c.want)
			}
		})
	}
}

// TestExitCodes runs the built binary: 2 for bad usage, 0 and the usage on
// stdout for --help.
func TestExitCodes(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "breakerd")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd: %v\n%s", err, out)
	}
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"--bogus"}, 2}, {[]string{"frobnicate"}, 2}, {[]string{"--bpffs", ""}, 2}, {[]string{"--cgroup", ""}, 2},
		{[]string{"--help"}, 0}, {[]string{"-h"}, 0}, {[]string{"run", "--help"}, 0},
	} {
		cmd := exec.Command(bin, c.args...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != c.code {
			t.Errorf("breakerd %q: exit %d, want %d (stderr %s)", c.args, code, c.code, stderr.String())
		}
		if c.code == 0 && (!strings.Contains(stdout.String(), "usage:") || !strings.Contains(stdout.String(), "--admin-socket") || stderr.Len() > 0) {
			t.Errorf("breakerd %q: stdout %q stderr %q", c.args, stdout.String(), stderr.String())
		}
	}
}

// TestNokubeRefusesKubeconfig builds breakerd as scripts/demo does (-tags
// nokube, without the Kubernetes client) and checks that it refuses
// --kubeconfig, naming the tag, rather than run without the API it was
// asked to use. It fails before touching the kernel.
func TestNokubeRefusesKubeconfig(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "breakerd")
	if out, err := exec.Command("go", "build", "-tags", "nokube", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building breakerd -tags nokube: %v\n%s", err, out)
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte("apiVersion: v1\nkind: Config\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// --cgroup names a directory that is no cgroup: nothing could attach
	// even if the refusal were missing.
	cmd := exec.Command(bin, "--kubeconfig", kubeconfig, "--cgroup", dir, "--bpffs", filepath.Join(dir, "pins"), "--admin-socket", "", "--admin-addr", "")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("breakerd -tags nokube --kubeconfig: %v, want exit 1 (stderr %s)", err, stderr.String())
	}
	if want := "--kubeconfig: this breakerd was built with -tags nokube"; !strings.Contains(stderr.String(), want) {
		t.Errorf("stderr %q, want it to say %q", stderr.String(), want)
	}
	if _, err := os.Stat(filepath.Join(dir, "pins")); !os.IsNotExist(err) {
		t.Errorf("pins %s: %v, want nothing made", filepath.Join(dir, "pins"), err)
	}
}
