// Command breakerd is the circuit breaker daemon: a thin main over package
// daemon.
//
//	breakerd [run] [flags]   run the daemon (the default)
//	breakerd uninstall       detach the programs and remove breakerd's pins (no config needed)
//	breakerd probe           print what the running kernel offers
//
// Every flag is also a BREAKERD_… environment variable (--admin-addr is
// BREAKERD_ADMIN_ADDR).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spf13/pflag"
	"github.com/spf13/viper"

	"github.com/breakerd/breakerd/daemon"
	"github.com/breakerd/breakerd/internal/cgroup2"
	"github.com/breakerd/breakerd/maps"
)

// Exit codes: 0 success (and --help), 1 failure, 2 bad usage (unknown
// flag or command, a flag's bad value).
func main() {
	err := run(os.Args[1:], os.Stdout)
	var ue usageError
	switch {
	case err == nil:
	case errors.As(err, &ue):
		fmt.Fprintln(os.Stderr, "breakerd:", err)
		fmt.Fprintln(os.Stderr, "usage: breakerd [run|uninstall|probe] [flags] (see breakerd --help)")
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "breakerd:", err)
		os.Exit(1)
	}
}

// usageError is bad usage: exit status 2.
type usageError struct{ msg string }

func (u usageError) Error() string { return u.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

const usageHead = `breakerd is the circuit breaker daemon.

usage:
  breakerd [run] [flags]   run the daemon (the default)
  breakerd uninstall       detach the programs and remove every pin
  breakerd probe           print what the running kernel offers

Every flag is also a BREAKERD_... environment variable (--admin-addr is
BREAKERD_ADMIN_ADDR); a flag given on the command line wins.

flags:
`

func run(args []string, stdout io.Writer) error {
	cmd := "run"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	fs := pflag.NewFlagSet("breakerd", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.String("config", "", "configuration file (default: the embedded default)")
	fs.String("cgroup", "", "cgroup v2 directory whose processes are protected (default: the cgroup v2 root, from /proc/mounts)")
	fs.String("bpffs", maps.DefaultDir, "bpffs directory for pins")
	fs.String("admin-addr", "127.0.0.1:9677", "address of the admin HTTP API: metrics and health for anyone, circuits and events for loopback clients or with the token (empty: off)")
	fs.String("probe-addr", "", "address of a listener that answers only /healthz and /readyz, for the kubelet's probes: no other client can hold them up (empty: off; the admin address answers them too)")
	fs.String("admin-socket", "/run/breakerd/admin.sock", "unix socket of the admin API (mode 0600, root only), where changes by hand are allowed (empty: off)")
	fs.String("admin-token-file", "", "file with a bearer token that allows changes over the TCP admin API")
	fs.String("kubeconfig", "", "kubeconfig file for the Kubernetes API (default: the pod's service account when in a cluster; neither: no API, Service targets match nothing)")
	fs.String("node-name", "", "this node's name, for Kubernetes Events (default: $NODE_NAME, then the host name)")
	fs.String("close-mechanism", "auto", "how close_established closes connections: auto (the best this kernel offers), bpf_sock_destroy, sock_diag, or none (never)")
	fs.String("log-level", "info", "debug, info, warn or error")
	fs.String("log-format", "text", "text or json")
	if err := fs.Parse(args); errors.Is(err, pflag.ErrHelp) {
		fmt.Fprint(stdout, usageHead+fs.FlagUsages())
		return nil
	} else if err != nil {
		return usageError{err.Error()}
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	switch cmd {
	case "run", "uninstall", "probe":
	default:
		return usagef("unknown command %q (run, uninstall, probe)", cmd)
	}
	v := viper.New()
	v.SetEnvPrefix("BREAKERD")
	v.SetEnvKeyReplacer(strings.NewReplacer("-", "_"))
	// An empty variable means empty (as an empty flag does), not "unset".
	v.AllowEmptyEnv(true)
	v.AutomaticEnv()
	if err := v.BindPFlags(fs); err != nil {
		return err
	}
	// An explicitly empty --bpffs or --cgroup would silently mean the
	// default (for --cgroup the whole machine): refuse it.
	for _, name := range []string{"bpffs", "cgroup"} {
		if explicitlyEmpty(fs, name) {
			return usagef("--%s (%s) is empty; leave it out for the default", name, envName(name))
		}
	}

	var closeMechs []maps.CloseMechanism
	switch m := v.GetString("close-mechanism"); m {
	case "auto":
	case string(maps.CloseIterator), string(maps.CloseSockDiag), string(maps.CloseNone):
		closeMechs = []maps.CloseMechanism{maps.CloseMechanism(m)}
	default:
		return usagef("--close-mechanism (%s): %q is not auto, bpf_sock_destroy, sock_diag or none", envName("close-mechanism"), m)
	}

	var level slog.Level
	if err := level.UnmarshalText([]byte(v.GetString("log-level"))); err != nil {
		return usagef("--log-level (%s): %q is not debug, info, warn or error", envName("log-level"), v.GetString("log-level"))
	}
	hopts := &slog.HandlerOptions{Level: level}
	var log *slog.Logger
	switch v.GetString("log-format") {
	case "text":
		log = slog.New(slog.NewTextHandler(os.Stderr, hopts))
	case "json":
		log = slog.New(slog.NewJSONHandler(os.Stderr, hopts))
	default:
		return usagef("--log-format (%s): %q is not text or json", envName("log-format"), v.GetString("log-format"))
	}
	slog.SetDefault(log)

	switch cmd {
	case "probe":
		if err := maps.CheckKernel(); err != nil {
			return err
		}
		f := maps.ProbeFeatures()
		mech, why := maps.ProbeClose(closeMechs...)
		probe := map[string]any{
			"set_retval":        f.SetRetval,
			"sockops_current":   f.SockOpsCurrent, // connect4/6 hand sockops their workload decision keyed by thread, not by a socket cookie they must make
			"close_established": string(mech),     // bpf_sock_destroy, sock_diag or none
		}
		if why != "" {
			probe["close_established_fallback"] = why
		}
		// Which network namespaces a close pass could enter with this
		// process's privileges (all, some, own), and what the rest need.
		reach, missing := maps.ProbeCloseReach()
		probe["close_established_namespaces"] = string(reach)
		if len(missing) > 0 {
			probe["close_established_missing"] = missing
		}
		out, _ := json.MarshalIndent(probe, "", "  ")
		fmt.Fprintln(stdout, string(out))
		return nil
	}

	if cmd == "uninstall" {
		// No configuration, no cgroup, no attach: only what is pinned.
		removed, err := maps.Uninstall(v.GetString("bpffs"))
		if err != nil {
			return fmt.Errorf("uninstalling: %w", err)
		}
		if len(removed) == 0 {
			log.Info("nothing to uninstall: no breakerd pins", "bpffs", v.GetString("bpffs"))
			return nil
		}
		log.Info("uninstalled: programs detached, pins removed", "bpffs", v.GetString("bpffs"), "layouts", removed)
		return nil
	}

	cg := v.GetString("cgroup")
	if cg == "" {
		root, err := cgroup2.Mount()
		if err != nil {
			return err
		}
		cg = root
	} else if tree := v2Tree(cg); tree != cg {
		log.Info("hybrid cgroup layout: protecting the cgroup v2 tree under the given directory", "cgroup", cg, "v2", tree)
		cg = tree
	}
	cluster, err := kubeClient(v.GetString("kubeconfig"), v.GetString("node-name"), log)
	if err != nil {
		return err
	}
	if cluster != nil {
		defer cluster.Close()
	}
	opts := daemon.Options{
		ConfigPath: v.GetString("config"), Cgroup: cg, BPFFS: v.GetString("bpffs"),
		AdminAddr: v.GetString("admin-addr"), AdminSocket: v.GetString("admin-socket"), ProbeAddr: v.GetString("probe-addr"),
		TokenFile: v.GetString("admin-token-file"), Logger: log, Cluster: cluster,
		CloseMechanisms: closeMechs,
	}
	d, err := daemon.New(opts)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				_ = d.Reload() // logged with every key path when refused
			}
		}
	}()
	if err := d.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// v2Tree returns where the cgroup v2 tree is at --cgroup DIR: DIR itself,
// or, on a hybrid node (cgroup v1 controllers on a tmpfs at
// /sys/fs/cgroup, the v2 tree mounted at its unified/), DIR/unified. The
// DaemonSet mounts the host's /sys/fs/cgroup at /host/cgroup (a recursive
// bind, so unified/ comes along) and passes --cgroup=/host/cgroup, which
// works on both layouts this way. Anything else is returned as given (and
// refused later if it is not cgroup v2).
func v2Tree(dir string) string {
	if maps.CheckCgroup(dir) == nil {
		return dir
	}
	if u := filepath.Join(dir, "unified"); maps.CheckCgroup(u) == nil {
		return u
	}
	return dir
}

func envName(flag string) string {
	return "BREAKERD_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// explicitlyEmpty reports whether flag name was given as "" on the
// command line, or (when not given there) its environment variable is set
// and empty.
func explicitlyEmpty(fs *pflag.FlagSet, name string) bool {
	if fs.Changed(name) {
		return fs.Lookup(name).Value.String() == ""
	}
	v, ok := os.LookupEnv(envName(name))
	return ok && v == ""
}
