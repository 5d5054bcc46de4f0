package kerneltest

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

const netnsDir = "/var/run/netns"

// Host is one network namespace of a test topology: the client host, or one
// of the server hosts it reaches over veth.
type Host struct {
	// Name is the namespace's name under /var/run/netns (ip netns list).
	Name string
	// IPv4 and IPv6 are the host's addresses on its veth link (for the
	// client, the address on its link to the first server).
	IPv4, IPv6 netip.Addr

	ns       netns.NsHandle
	nftTable string
	nftReady bool
}

// Topology is a client host whose only routes lead over veth links to its
// server hosts. Server i has 198.18.i.2 and 2001:db8:0:i::2; the client has
// .1 and ::1 on each link. Both ranges are reserved (benchmarking and
// documentation), so no test packet can reach a real network.
type Topology struct {
	// Client is where the protected processes run.
	Client *Host
	// Servers are the destination hosts.
	Servers []*Host
}

// NewTopology makes a client namespace and n server namespaces joined to it
// by veth, with loopback up everywhere, and removes all of them when the
// test ends (after every process the test started in them has been killed).
func NewTopology(tb testing.TB, n int) *Topology {
	tb.Helper()
	if n < 1 || n > 200 {
		tb.Fatalf("NewTopology: %d server hosts is out of range 1..200", n)
	}
	base := UniqueName()
	topo := &Topology{}
	tb.Cleanup(func() { topo.remove(tb) })

	client, err := newHost(base + "-c")
	if err != nil {
		tb.Fatal(err)
	}
	topo.Client = client
	clientLink, err := netlink.NewHandleAt(client.ns, unix.NETLINK_ROUTE)
	if err != nil {
		tb.Fatalf("netlink handle in client namespace: %v", err)
	}
	defer clientLink.Close()

	for i := 0; i < n; i++ {
		srv, err := newHost(fmt.Sprintf("%s-s%d", base, i))
		if err != nil {
			tb.Fatal(err)
		}
		topo.Servers = append(topo.Servers, srv)
		srv.IPv4 = netip.AddrFrom4([4]byte{198, 18, byte(i), 2})
		srv.IPv6 = netip.MustParseAddr(fmt.Sprintf("2001:db8:0:%x::2", i))
		cv4 := netip.AddrFrom4([4]byte{198, 18, byte(i), 1})
		cv6 := netip.MustParseAddr(fmt.Sprintf("2001:db8:0:%x::1", i))
		if i == 0 {
			client.IPv4, client.IPv6 = cv4, cv6
		}
		if err := link(clientLink, srv, fmt.Sprintf("s%d", i), cv4, cv6); err != nil {
			tb.Fatalf("linking server host %d: %v", i, err)
		}
	}
	return topo
}

func newHost(name string) (*Host, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return nil, fmt.Errorf("getting current netns: %w", err)
	}
	defer orig.Close()
	ns, err := netns.NewNamed(name)
	if err != nil {
		return nil, fmt.Errorf("making netns %s: %w", name, err)
	}
	if err := netns.Set(orig); err != nil {
		// This thread is stuck in the new namespace: leave it locked so
		// the runtime throws it away.
		runtime.LockOSThread()
		return nil, fmt.Errorf("returning to the original netns: %w", err)
	}
	h := &Host{Name: name, ns: ns, nftTable: strings.ReplaceAll(name, "-", "_")}
	err = h.Do(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetUp(lo)
	})
	if err != nil {
		return h, fmt.Errorf("loopback up in %s: %w", name, err)
	}
	return h, nil
}

// link makes a veth pair from the client (name c<i>) to srv (name eth0),
// addresses both ends and brings them up.
func link(client *netlink.Handle, srv *Host, peerName string, cv4, cv6 netip.Addr) error {
	cname := "c" + strings.TrimPrefix(peerName, "s")
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: cname},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(int(srv.ns)),
	}
	if err := client.LinkAdd(veth); err != nil {
		return fmt.Errorf("adding veth: %w", err)
	}
	srvLink, err := netlink.NewHandleAt(srv.ns, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netlink handle in %s: %w", srv.Name, err)
	}
	defer srvLink.Close()
	ends := []struct {
		h      *netlink.Handle
		name   string
		v4, v6 netip.Addr
	}{{client, cname, cv4, cv6}, {srvLink, "eth0", srv.IPv4, srv.IPv6}}
	for _, e := range ends {
		l, err := e.h.LinkByName(e.name)
		if err != nil {
			return fmt.Errorf("finding %s: %w", e.name, err)
		}
		for _, a := range []netip.Prefix{netip.PrefixFrom(e.v4, 24), netip.PrefixFrom(e.v6, 64)} {
			addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.Addr().AsSlice(), Mask: net.CIDRMask(a.Bits(), a.Addr().BitLen())}}
			if a.Addr().Is6() {
				addr.Flags = unix.IFA_F_NODAD
			}
			if err := e.h.AddrAdd(l, addr); err != nil {
				return fmt.Errorf("adding %s to %s: %w", a, e.name, err)
			}
		}
		if err := e.h.LinkSetUp(l); err != nil {
			return fmt.Errorf("bringing %s up: %w", e.name, err)
		}
	}
	return nil
}

// Do runs f on a locked OS thread inside the host's network namespace.
// Sockets f opens stay in that namespace; goroutines f starts do not run
// there.
func (h *Host) Do(f func() error) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("getting current netns: %w", err)
	}
	defer orig.Close()
	if err := netns.Set(h.ns); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("entering netns %s: %w", h.Name, err)
	}
	ferr := f()
	if err := netns.Set(orig); err != nil {
		// Leave the thread locked: the runtime ends it with the goroutine.
		return errors.Join(ferr, fmt.Errorf("leaving netns %s: %w", h.Name, err))
	}
	runtime.UnlockOSThread()
	return ferr
}

// Sysctl writes a network sysctl (for example "net/ipv4/tcp_syn_retries")
// inside the host's namespace.
func (h *Host) Sysctl(key, value string) error {
	return h.Do(func() error {
		return os.WriteFile(filepath.Join("/proc/sys", key), []byte(value), 0)
	})
}

// Command prepares a process that will start inside the host's namespace
// and, when cg is not nil, inside that cgroup from birth.
func (h *Host) Command(cg *Cgroup, name string, args ...string) *Process {
	return &Process{host: h, cg: cg, Cmd: exec.Command(name, args...)}
}

// Process is a real process started by a test inside a host (and a cgroup).
type Process struct {
	// Cmd is the command; set Stdout, Env and friends before Start.
	Cmd  *exec.Cmd
	host *Host
	cg   *Cgroup
}

// Start starts the process and makes sure it is killed, by its PID, when
// the test ends.
func (p *Process) Start(tb testing.TB) error {
	tb.Helper()
	if p.cg != nil {
		f, err := p.cg.Open()
		if err != nil {
			return err
		}
		defer f.Close()
		if p.Cmd.SysProcAttr == nil {
			p.Cmd.SysProcAttr = &syscall.SysProcAttr{}
		}
		p.Cmd.SysProcAttr.UseCgroupFD = true
		p.Cmd.SysProcAttr.CgroupFD = int(f.Fd())
	}
	// A forked child inherits the network namespace of the thread that
	// forks it, so start it from a thread inside the host.
	err := p.host.Do(p.Cmd.Start)
	if err != nil {
		return fmt.Errorf("starting %s in %s: %w", p.Cmd.Path, p.host.Name, err)
	}
	tb.Cleanup(func() {
		if p.Cmd.ProcessState == nil {
			_ = p.Cmd.Process.Kill()
			_ = p.Cmd.Wait()
		}
	})
	return nil
}

// Run starts the process, waits for it and returns its combined output.
func (p *Process) Run(tb testing.TB) ([]byte, error) {
	tb.Helper()
	var out bytes.Buffer
	if p.Cmd.Stdout == nil {
		p.Cmd.Stdout = &out
	}
	if p.Cmd.Stderr == nil {
		p.Cmd.Stderr = &out
	}
	if err := p.Start(tb); err != nil {
		return nil, err
	}
	err := p.Cmd.Wait()
	return out.Bytes(), err
}

// run runs a helper command (nft) in the host, without a cgroup, and
// returns its standard output.
func (h *Host) run(stdin string, name string, args ...string) ([]byte, error) {
	cmd := exec.Command(name, args...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := h.Do(cmd.Start); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	if err := cmd.Wait(); err != nil {
		return nil, fmt.Errorf("%s %s in %s: %w: %s", name, strings.Join(args, " "), h.Name, err, strings.TrimSpace(errOut.String()))
	}
	return out.Bytes(), nil
}

func (t *Topology) remove(tb testing.TB) {
	hosts := append([]*Host{t.Client}, t.Servers...)
	for _, h := range hosts {
		if h == nil {
			continue
		}
		h.ns.Close()
		if err := netns.DeleteNamed(h.Name); err != nil && !errors.Is(err, os.ErrNotExist) {
			tb.Errorf("removing netns %s: %v", h.Name, err)
		}
	}
}

// leftoverNetns lists named network namespaces whose name starts with prefix.
func leftoverNetns(prefix string) []string {
	entries, _ := os.ReadDir(netnsDir)
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			out = append(out, filepath.Join(netnsDir, e.Name()))
		}
	}
	return out
}

// WaitFor polls cond every 10 ms until it returns true or the timeout
// passes, and reports whether it became true.
func WaitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
}
