// Command vmtest runs a Go test binary inside a qemu VM on another kernel,
// as `go test -exec`:
//
//	go test -exec "$PWD/vmtest/run.sh -kernel 6.1" ./maps
//
// "-append ARG" adds an argument to the kernel command line (repeatable).
// scripts/vmtest boots 6.1 with "-append possible_cpus=256": the kernel
// then reports 256 possible CPUs with 2 online, and per-CPU maps are sized
// by the possible CPUs. (6.12 ignores possible_cpus= above the CPUs the
// firmware lists, and qemu's -smp maxcpus= hot-pluggable CPUs as well: it
// logs "Allowing 2 present CPUs plus 0 hotplug CPUs".)
//
// It fetches the newest Debian cloud kernel of that series with apt-get
// download (cached under vmtest/cache), builds an initramfs with busybox,
// nft, bpftool, the kernel modules the harness needs (veth, nf_tables and
// friends, sch_netem) and the test binary, boots it with KVM when /dev/kvm
// is asked for (VMTEST_ACCEL=kvm) and TCG otherwise, streams the serial console, and exits with the
// test binary's exit status. A guest kernel that panics before the test
// binary reports is booted once more with the same binary (the panic is
// printed first); a second panic fails.
package main

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	code, err := run(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmtest:", err)
		os.Exit(2)
	}
	os.Exit(code)
}

func run(args []string) (int, error) {
	series := os.Getenv("VMTEST_KERNEL")
	var cmdline []string
	for len(args) >= 2 && (args[0] == "-kernel" || args[0] == "-append") {
		if args[0] == "-kernel" {
			series = args[1]
		} else {
			cmdline = append(cmdline, args[1])
		}
		args = args[2:]
	}
	if series == "" || len(args) == 0 {
		return 0, errors.New("usage: vmtest -kernel SERIES [-append KERNELARG]... TESTBINARY [ARGS...] (SERIES: 6.1, 6.12, …)")
	}
	root, err := repoRoot()
	if err != nil {
		return 0, err
	}
	cache := filepath.Join(root, "vmtest", "cache")
	k, base, err := prepare(cache, series)
	if err != nil {
		return 0, err
	}
	cwd, _ := os.Getwd()
	rel, err := filepath.Rel(root, cwd)
	if err != nil || strings.HasPrefix(rel, "..") {
		rel = "."
	}
	extra, err := testInitramfs(args, rel, filepath.Join(cache, helperName))
	if err != nil {
		return 0, err
	}
	defer os.Remove(extra)
	code, panicked, err := boot(k, base, extra, cmdline)
	if err != nil || !panicked {
		return code, err
	}
	// The guest kernel panicked before the test binary gave its result (one
	// CI run's 6.12 guest died in __kmalloc under TCG, with an impossible
	// EFLAGS value in its register dump), so the suite is booted once more;
	// the panic stays in the output above, and a second panic fails the
	// run. A panic the tests themselves cause every time still fails; one
	// they cause now and then passes on the second boot, visibly (the
	// guest runs with oops=panic, so an oops is a panic too).
	fmt.Fprintf(os.Stderr, "vmtest: the guest kernel %s panicked before the tests gave a result (its console is above); booting the suite once more\n", k.version)
	fmt.Printf("vmtest: ---- the suite again, on a second boot (the output above is from a boot whose kernel panicked) ----\n")
	code, panicked, err = boot(k, base, extra, cmdline)
	switch {
	case err != nil:
	case panicked:
		fmt.Fprintf(os.Stderr, "vmtest: the guest kernel %s panicked again: failing\n", k.version)
	case code == 0:
		fmt.Fprintf(os.Stderr, "vmtest: kernel %s: the suite passed on a second boot, after a guest kernel panic on the first\n", k.version)
	}
	return code, err
}

// prepare fetches the kernel and builds its base initramfs, once, under a
// lock on the cache: VMs of one kernel started side by side (scripts/vmtest
// memory) on a machine that has neither would otherwise both fetch and
// build into the same paths.
func prepare(cache, series string) (*kernel, string, error) {
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return nil, "", err
	}
	lock, err := os.OpenFile(filepath.Join(cache, "lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, "", err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return nil, "", fmt.Errorf("locking %s: %w", lock.Name(), err)
	}
	k, err := fetchKernel(cache, series)
	if err != nil {
		return nil, "", err
	}
	base, err := baseInitramfs(cache, k)
	if err != nil {
		return nil, "", err
	}
	return k, base, nil
}

func repoRoot() (string, error) {
	out, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err == nil {
		return strings.TrimSpace(string(out)), nil
	}
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	return filepath.Dir(filepath.Dir(exe)), nil
}

type kernel struct {
	version string // uname -r
	vmlinuz string
	modules string // lib/modules/<version>
}

// fetchKernel downloads and unpacks the newest linux-image-<series>…
// -cloud-amd64-unsigned package, once.
func fetchKernel(cache, series string) (*kernel, error) {
	out, err := exec.Command("apt-cache", "search", "--names-only", "^linux-image-"+regexp.QuoteMeta(series)+`[.-].*cloud-amd64-unsigned$`).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-cache search (run apt-get update first): %w", err)
	}
	var pkgs []string
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			pkgs = append(pkgs, f[0])
		}
	}
	if len(pkgs) == 0 && !updated {
		// A machine whose package lists were never fetched.
		updated = true
		if out, err := exec.Command("apt-get", "update", "-qq").CombinedOutput(); err != nil {
			return nil, fmt.Errorf("apt-get update: %v: %s", err, out)
		}
		return fetchKernel(cache, series)
	}
	if len(pkgs) == 0 {
		return nil, fmt.Errorf("no linux-image-%s*-cloud-amd64-unsigned package is served", series)
	}
	sort.Slice(pkgs, func(i, j int) bool { return versionLess(pkgs[i], pkgs[j]) })
	pkg := pkgs[len(pkgs)-1]
	dir := filepath.Join(cache, pkg)
	if _, err := os.Stat(filepath.Join(dir, "ready")); err != nil {
		os.RemoveAll(dir)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		cmd := exec.Command("apt-get", "download", pkg)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("apt-get download %s: %v: %s", pkg, err, out)
		}
		debs, _ := filepath.Glob(filepath.Join(dir, "*.deb"))
		if len(debs) != 1 {
			return nil, fmt.Errorf("apt-get download %s left %d packages", pkg, len(debs))
		}
		if out, err := exec.Command("dpkg", "-x", debs[0], filepath.Join(dir, "root")).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("dpkg -x: %v: %s", err, out)
		}
		os.Remove(debs[0])
		if err := os.WriteFile(filepath.Join(dir, "ready"), nil, 0o644); err != nil {
			return nil, err
		}
	}
	mods, _ := filepath.Glob(filepath.Join(dir, "root", "lib", "modules", "*"))
	vmlinuz, _ := filepath.Glob(filepath.Join(dir, "root", "boot", "vmlinuz-*"))
	if len(mods) != 1 || len(vmlinuz) != 1 {
		return nil, fmt.Errorf("%s: unexpected package layout", pkg)
	}
	return &kernel{version: filepath.Base(mods[0]), vmlinuz: vmlinuz[0], modules: mods[0]}, nil
}

var (
	numRE   = regexp.MustCompile(`\d+`)
	updated bool
)

func versionLess(a, b string) bool {
	na, nb := numRE.FindAllString(a, -1), numRE.FindAllString(b, -1)
	for i := 0; i < len(na) && i < len(nb); i++ {
		x, _ := strconv.Atoi(na[i])
		y, _ := strconv.Atoi(nb[i])
		if x != y {
			return x < y
		}
	}
	return len(na) < len(nb)
}

// moduleDirs are the parts of the module tree the VM needs, and
// moduleNames single modules from elsewhere (any compression suffix).
var (
	moduleDirs  = []string{"kernel/net/netfilter/", "kernel/net/ipv4/netfilter/", "kernel/net/ipv6/netfilter/", "kernel/lib/", "kernel/crypto/"}
	moduleNames = []string{"veth", "sch_netem", "inet_diag", "tcp_diag"} // the diag pair: close_established's sock_diag path
)

func wantModule(rel string) bool {
	for _, d := range moduleDirs {
		if strings.HasPrefix(rel, d) {
			return true
		}
	}
	base := filepath.Base(rel)
	for _, n := range moduleNames {
		if base == n+".ko" || strings.HasPrefix(base, n+".ko.") {
			return true
		}
	}
	return false
}

const initScript = `#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mount -t tmpfs run /run
mkdir -p /run/netns /var /sys/fs/cgroup
ln -s /run /var/run
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
for m in veth nf_tables nft_reject_inet nft_reject nf_reject_ipv4 nf_reject_ipv6 nft_ct sch_netem inet_diag tcp_diag; do modprobe $m 2>/dev/null; done
ip link set lo up
echo 1 > /proc/sys/kernel/panic_on_oops
. /test/env
cd /test/$VMTEST_PKG
echo VMTEST_BEGIN
/test/testbin "$@" $VMTEST_ARGS
echo "VMTEST_EXIT=$?"
poweroff -f
`

// baseInitramfs builds (once per kernel) the archive with busybox, nft,
// bpftool, their libraries and the modules.
func baseInitramfs(cache string, k *kernel) (string, error) {
	// The name carries what goes in (modules, init script), so a change
	// to either builds a new archive instead of reusing a stale one.
	sum := sha256.Sum256([]byte(strings.Join(moduleDirs, ",") + "|" + strings.Join(moduleNames, ",") + "|" + initScript))
	out := filepath.Join(cache, fmt.Sprintf("%s.base-%x.cpio.gz", k.version, sum[:4]))
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	stage, err := os.MkdirTemp("", "vmtest-base-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(stage)
	for _, d := range []string{"bin", "sbin", "etc", "proc", "sys", "dev", "tmp", "run", "test", "lib", "lib64", "usr"} {
		os.MkdirAll(filepath.Join(stage, d), 0o755)
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return "", errors.New("busybox not found (apt-get install busybox-static)")
	}
	if err := copyFile(bb, filepath.Join(stage, "bin", "busybox")); err != nil {
		return "", err
	}
	applets, _ := exec.Command(bb, "--list").Output()
	for _, a := range strings.Fields(string(applets)) {
		os.Symlink("busybox", filepath.Join(stage, "bin", a))
	}
	os.Symlink("../bin/modprobe", filepath.Join(stage, "sbin", "modprobe"))
	for _, prog := range []string{"nft", "bpftool"} {
		p, err := exec.LookPath(prog)
		if err != nil {
			return "", fmt.Errorf("%s not found (scripts/setup installs it)", prog)
		}
		if err := copyWithLibs(p, stage, filepath.Join("bin", prog)); err != nil {
			return "", err
		}
	}
	os.WriteFile(filepath.Join(stage, "etc", "hosts"), []byte("127.0.0.1 localhost\n::1 localhost\n"), 0o644)
	os.WriteFile(filepath.Join(stage, "etc", "nsswitch.conf"), []byte("hosts: files\n"), 0o644)
	os.WriteFile(filepath.Join(stage, "init"), []byte(initScript), 0o755)
	// Modules: copied, decompressed (busybox cannot read .ko.xz), indexed.
	mroot := filepath.Join(stage, "lib", "modules", k.version)
	err = filepath.WalkDir(filepath.Join(k.modules, "kernel"), func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(k.modules, p)
		if !wantModule(rel) {
			return nil
		}
		dst := filepath.Join(mroot, rel)
		os.MkdirAll(filepath.Dir(dst), 0o755)
		if strings.HasSuffix(p, ".xz") {
			out, err := exec.Command("xz", "-dc", p).Output()
			if err != nil {
				return fmt.Errorf("xz -d %s: %w", p, err)
			}
			return os.WriteFile(strings.TrimSuffix(dst, ".xz"), out, 0o644)
		}
		return copyFile(p, dst)
	})
	if err != nil {
		return "", fmt.Errorf("copying modules: %w", err)
	}
	for _, f := range []string{"modules.builtin", "modules.order", "modules.builtin.modinfo"} {
		copyFile(filepath.Join(k.modules, f), filepath.Join(mroot, f))
	}
	if out, err := exec.Command("depmod", "-b", stage, k.version).CombinedOutput(); err != nil {
		return "", fmt.Errorf("depmod: %v: %s", err, out)
	}
	// Written aside and renamed, so that a build cut short leaves no
	// archive that a later run would take as whole.
	tmp := out + ".tmp"
	if err := writeCPIO(stage, tmp, true); err != nil {
		os.Remove(tmp)
		return "", err
	}
	if err := os.Rename(tmp, out); err != nil {
		return "", err
	}
	return out, nil
}

// copyWithLibs copies a dynamically linked program and every library ldd
// names, at the same paths.
func copyWithLibs(prog, stage, dst string) error {
	if err := copyFile(prog, filepath.Join(stage, dst)); err != nil {
		return err
	}
	out, err := exec.Command("ldd", prog).Output()
	if err != nil {
		return nil // not a dynamic executable
	}
	for _, line := range strings.Split(string(out), "\n") {
		for _, f := range strings.Fields(line) {
			if strings.HasPrefix(f, "/") {
				real, err := filepath.EvalSymlinks(f)
				if err != nil {
					continue
				}
				if err := copyFile(real, filepath.Join(stage, f)); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	os.MkdirAll(filepath.Dir(dst), 0o755)
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, fi.Mode().Perm())
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// helperName is internal/kerneltest/helper's binary in the cache, built by
// run.sh and scripts/vmtest beside vmtest's own.
const helperName = "kerneltest-helper"

// testInitramfs packs the test binary, its arguments and the environment
// the tests need (CI) into a second gzipped archive, appended to the base
// one; and the kernel test harness's helper binary when it was built, so
// that a test's client processes need not start the whole test binary.
func testInitramfs(args []string, pkg, helper string) (string, error) {
	stage, err := os.MkdirTemp("", "vmtest-test-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(stage)
	os.MkdirAll(filepath.Join(stage, "test", pkg), 0o755)
	// go test builds with cgo where a C compiler exists: bring the
	// binary's libraries along (a static binary has none).
	if err := copyWithLibs(args[0], stage, filepath.Join("test", "testbin")); err != nil {
		return "", err
	}
	var env bytes.Buffer
	fmt.Fprintf(&env, "export VMTEST_PKG=%s\nexport VMTEST_ARGS=%q\nexport BREAKERD_VMTEST=1\nexport PATH=/bin:/sbin\nexport HOME=/tmp\n", shellQuote(pkg), strings.Join(args[1:], " "))
	if _, err := os.Stat(helper); err == nil {
		if err := copyWithLibs(helper, stage, filepath.Join("test", "helper")); err != nil {
			return "", err
		}
		fmt.Fprintf(&env, "export BREAKERD_KERNELTEST_HELPER_BIN=/test/helper\n")
	}
	if v := os.Getenv("CI"); v != "" {
		fmt.Fprintf(&env, "export CI=%s\n", shellQuote(v))
	}
	os.WriteFile(filepath.Join(stage, "test", "env"), env.Bytes(), 0o644)
	f, err := os.CreateTemp("", "vmtest-*.cpio")
	if err != nil {
		return "", err
	}
	f.Close()
	return f.Name(), writeCPIO(stage, f.Name(), true)
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// writeCPIO writes dir as a newc cpio archive (what the kernel unpacks
// into its initramfs), gzipped or not.
func writeCPIO(dir, out string, gz bool) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	var w io.Writer = f
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(f)
		w = zw
	}
	bw := bufio.NewWriter(w)
	ino := 1
	err = filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		var data []byte
		mode := uint32(fi.Mode().Perm())
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			t, _ := os.Readlink(p)
			data, mode = []byte(t), mode|0o120000
		case fi.IsDir():
			mode |= 0o040000
		default:
			data, err = os.ReadFile(p)
			if err != nil {
				return err
			}
			mode |= 0o100000
		}
		ino++
		return cpioEntry(bw, rel, mode, ino, data)
	})
	if err != nil {
		return err
	}
	if err := cpioEntry(bw, "TRAILER!!!", 0, 0, nil); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	if zw != nil {
		return zw.Close()
	}
	return nil
}

func cpioEntry(w *bufio.Writer, name string, mode uint32, ino int, data []byte) error {
	nlink := 1
	if mode&0o040000 != 0 {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
	w.WriteString(hdr)
	w.WriteString(name)
	w.WriteByte(0)
	pad(w, len(hdr)+len(name)+1)
	w.Write(data)
	pad(w, len(data))
	return nil
}

func pad(w *bufio.Writer, n int) {
	for n%4 != 0 {
		w.WriteByte(0)
		n++
	}
}

// boot runs qemu once, with cmdline added to the kernel's command line,
// relays the test's output, and returns the test binary's exit status (1
// when it reported none) and whether the guest kernel panicked before the
// binary reported one.
func boot(k *kernel, base, extra string, cmdline []string) (code int, panicked bool, err error) {
	initrd, err := os.CreateTemp("", "vmtest-initrd-*")
	if err != nil {
		return 0, false, err
	}
	defer os.Remove(initrd.Name())
	for _, part := range []string{base, extra} {
		b, err := os.ReadFile(part)
		if err != nil {
			return 0, false, err
		}
		initrd.Write(b)
		// Archives are concatenated at 4-byte boundaries; the kernel skips
		// the zero padding between them.
		initrd.Write(make([]byte, (4-len(b)%4)%4))
	}
	initrd.Close()
	// TCG by default: these machines expose /dev/kvm but nested KVM does
	// not boot here. VMTEST_ACCEL=kvm opts in where it works.
	accel := []string{"-accel", "tcg,thread=multi", "-cpu", "max"}
	if os.Getenv("VMTEST_ACCEL") == "kvm" {
		accel = []string{"-accel", "kvm", "-cpu", "host"}
	}
	timeout := 40 * time.Minute
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	args := append(accel, "-m", "1536M", "-smp", "2", "-nographic", "-no-reboot", "-nodefaults", "-serial", "stdio",
		"-kernel", k.vmlinuz, "-initrd", initrd.Name(),
		"-append", strings.Join(append([]string{"console=ttyS0 panic=-1 oops=panic quiet loglevel=3 rdinit=/init"}, cmdline...), " "))
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return 0, false, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return 0, false, fmt.Errorf("starting qemu (apt-get install qemu-system-x86): %w", err)
	}
	code, begun := -1, false
	var early bytes.Buffer
	s := bufio.NewScanner(stdout)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		line := strings.TrimRight(s.Text(), "\r")
		if strings.Contains(line, "Kernel panic - not syncing") {
			panicked = true
		}
		switch {
		case strings.Contains(line, "VMTEST_BEGIN"):
			begun = true
		case strings.Contains(line, "VMTEST_EXIT="):
			code, _ = strconv.Atoi(line[strings.Index(line, "VMTEST_EXIT=")+len("VMTEST_EXIT="):])
		case begun && code < 0:
			fmt.Println(line)
		default:
			early.WriteString(line + "\n")
		}
	}
	cmd.Wait()
	if code != 0 && os.Getenv("VMTEST_DEBUG") != "" {
		fmt.Fprintf(os.Stderr, "vmtest: console before the test:\n%s", early.String())
	}
	if code < 0 {
		fmt.Fprintf(os.Stderr, "vmtest: the VM (kernel %s) ended without a test result; its console said:\n%s", k.version, early.String())
		return 1, panicked, nil
	}
	fmt.Fprintf(os.Stderr, "vmtest: kernel %s %s\n", k.version, strings.Join(cmdline, " "))
	return code, false, nil
}
