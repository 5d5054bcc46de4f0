package kerneltest

import (
	"net/netip"
	"os"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { Main(m) }

func setup(t *testing.T) (*Cgroup, *Topology) {
	t.Helper()
	RequireKernel(t)
	return NewCgroup(t), NewTopology(t, 1)
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

func TestProcessStartsInCgroupAndNamespace(t *testing.T) {
	cg, topo := setup(t)
	p := topo.Client.Command(cg, "sleep", "30")
	if err := p.Start(t); err != nil {
		t.Fatal(err)
	}
	pid := p.Cmd.Process.Pid
	procs, err := cg.Procs()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(procs, pid) {
		t.Fatalf("pid %d not in cgroup %s (procs %v)", pid, cg.Path, procs)
	}
	if got, want := inode(t, "/proc/"+strconv.Itoa(pid)+"/ns/net"), inode(t, netnsDir+"/"+topo.Client.Name); got != want {
		t.Fatalf("process netns inode %d, want client namespace %d", got, want)
	}
	if got, root := inode(t, "/proc/"+strconv.Itoa(pid)+"/ns/net"), inode(t, "/proc/self/ns/net"); got == root {
		t.Fatal("process is in the host's network namespace")
	}
}

func TestFailureMakers(t *testing.T) {
	cg, topo := setup(t)
	srv := topo.Servers[0]
	const (
		refused  = 7001
		dropped  = 7002
		unreach  = 7003
		reset    = 7004
		slow     = 7005
		healthyP = 7006
	)
	srv.StartCounting(t)
	srv.DropSYNs(t, dropped)
	srv.RejectUnreachable(t, unreach)
	srv.ServeReset(t, reset)
	srv.SlowHandshakes(t, slow, 1)
	srv.ServeHold(t, slow)
	srv.ServeHold(t, healthyP)

	for _, network := range []string{"tcp4", "tcp6"} {
		addr := srv.IPv4
		if network == "tcp6" {
			addr = srv.IPv6
		}
		dial := func(port uint16, op string, timeout time.Duration) DialResult {
			t.Helper()
			res := topo.Client.Dial(t, cg, DialSpec{Network: network, Addr: netip.AddrPortFrom(addr, port), Op: op, Timeout: timeout})
			if len(res) != 1 {
				t.Fatalf("%d results, want 1", len(res))
			}
			return res[0]
		}
		t.Run(network, func(t *testing.T) {
			if r := dial(healthyP, "connect", 0); r.Errno != 0 {
				t.Errorf("healthy: errno %v", r.Errno)
			}
			if r := dial(refused, "connect", 0); r.Errno != unix.ECONNREFUSED {
				t.Errorf("no listener: errno %v, want ECONNREFUSED", r.Errno)
			}
			before := srv.SYNs(t)
			if r := dial(dropped, "connect", 1500*time.Millisecond); r.Errno != unix.EINPROGRESS {
				t.Errorf("dropped SYNs: errno %v, want no answer (EINPROGRESS after the deadline)", r.Errno)
			}
			// The first SYN and its retransmission 1 s later.
			if got := srv.SYNs(t) - before; got < 2 {
				t.Errorf("dropped SYNs: %d SYNs counted, want at least 2", got)
			}
			if r := dial(unreach, "connect", 0); r.Errno != unix.EHOSTUNREACH {
				t.Errorf("ICMP reject: errno %v, want EHOSTUNREACH", r.Errno)
			}
			if r := dial(reset, "connect-read", 0); r.Errno != unix.ECONNRESET {
				t.Errorf("linger-0 server: read errno %v, want ECONNRESET", r.Errno)
			}
			r := dial(slow, "connect", 5*time.Second)
			if r.Errno != 0 {
				t.Errorf("slow handshake: errno %v", r.Errno)
			}
			if d := time.Duration(r.Nanos); d < 900*time.Millisecond {
				t.Errorf("slow handshake took %v, want at least 900ms", d)
			}
		})
	}
}

func TestNothingLeftBehind(t *testing.T) {
	RequireKernel(t)
	t.Run("make", func(t *testing.T) {
		cg := NewCgroup(t)
		topo := NewTopology(t, 2)
		if err := topo.Client.Command(cg, "sleep", "30").Start(t); err != nil {
			t.Fatal(err)
		}
		topo.Servers[1].DropSYNs(t, 1)
		if len(Leftovers()) == 0 {
			t.Fatal("Leftovers sees nothing while a cgroup and namespaces exist")
		}
	})
	if left := Leftovers(); len(left) != 0 {
		t.Fatalf("left behind: %v", left)
	}
}

func TestCgroupMountFromProcMounts(t *testing.T) {
	m, err := CgroupV2Mount()
	if err != nil {
		t.Skip(err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(m, &st); err != nil || st.Type != unix.CGROUP2_SUPER_MAGIC {
		t.Fatalf("%s is not a cgroup2 mount: %v", m, err)
	}
}
