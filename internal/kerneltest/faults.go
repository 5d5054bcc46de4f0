package kerneltest

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"
)

// The failure makers below act on a server host. A port of 0 means every
// port. Each nftables change goes into the host's own table (named after
// the namespace), whose first rules count the SYNs and UDP datagrams that
// reach the host, so a test can assert what got through.

func (h *Host) nft(tb testing.TB, script string) {
	tb.Helper()
	if !h.nftReady {
		setup := fmt.Sprintf(`table inet %[1]s {
	counter syns {}
	counter dgrams {}
	set slow1 { type inet_service; flags dynamic, timeout; timeout 60s; }
	set slow2 { type inet_service; flags dynamic, timeout; timeout 60s; }
	set blackhole { type inet_service; }
	chain input {
		type filter hook input priority 0; policy accept;
		tcp flags & (syn|ack) == syn counter name "syns"
		meta l4proto udp counter name "dgrams"
		tcp dport @blackhole drop
	}
}
`, h.nftTable)
		if _, err := h.run(setup, "nft", "-f", "-"); err != nil {
			tb.Fatalf("setting up nftables on %s: %v", h.Name, err)
		}
		h.nftReady = true
	}
	if script == "" {
		return
	}
	if _, err := h.run(script, "nft", "-f", "-"); err != nil {
		tb.Fatalf("nftables on %s: %v", h.Name, err)
	}
}

func (h *Host) addRule(tb testing.TB, port uint16, rule string) {
	tb.Helper()
	match := ""
	if port != 0 {
		match = fmt.Sprintf("tcp dport %d ", port)
	}
	h.nft(tb, fmt.Sprintf("add rule inet %s input %s%s\n", h.nftTable, match, rule))
}

// DropSYNs makes the host drop every TCP SYN to port: a client's connect
// times out.
func (h *Host) DropSYNs(tb testing.TB, port uint16) {
	h.addRule(tb, port, "tcp flags & (syn|ack) == syn drop")
}

// BlackHole makes the host drop every TCP packet to port (on), or stop
// doing so (off): a destination that dies silently and comes back.
func (h *Host) BlackHole(tb testing.TB, port uint16, on bool) {
	tb.Helper()
	verb := "add"
	if !on {
		verb = "delete"
	}
	h.nft(tb, fmt.Sprintf("%s element inet %s blackhole { %d }\n", verb, h.nftTable, port))
}

// RejectUnreachable makes the host answer every TCP packet to port with
// ICMP host-unreachable: a client's connect fails with EHOSTUNREACH. Over
// veth the answer to the first SYN arrives while connect() still holds the
// socket lock, where the kernel keeps an ICMP error as a soft error; the
// answer to the SYN retransmitted 1 s later fails the connect.
func (h *Host) RejectUnreachable(tb testing.TB, port uint16) {
	tb.Helper()
	// The test host answers every time: no ICMP rate limit.
	for _, k := range []string{"net/ipv4/icmp_ratemask", "net/ipv4/icmp_ratelimit", "net/ipv6/icmp/ratelimit"} {
		if err := h.Sysctl(k, "0"); err != nil {
			tb.Fatalf("lifting the ICMP rate limit on %s: %v", h.Name, err)
		}
	}
	h.addRule(tb, port, "reject with icmpx type host-unreachable")
}

// DropAll makes the host drop every TCP packet to port from now on:
// established connections stall and retransmit.
func (h *Host) DropAll(tb testing.TB, port uint16) {
	h.addRule(tb, port, "drop")
}

// RejectOutgoing makes the host itself refuse its own connects to port
// with an nftables `reject with tcp reset` in its output hook: the
// in-kernel refusal breakerd's rejection is compared with.
func (h *Host) RejectOutgoing(tb testing.TB, port uint16) {
	tb.Helper()
	h.nft(tb, fmt.Sprintf("add chain inet %[1]s output { type filter hook output priority 0; policy accept; }\nadd rule inet %[1]s output tcp dport %[2]d reject with tcp reset\n", h.nftTable, port))
}

// SlowHandshakes makes the host drop the first drops (1 or 2) SYNs of every
// connection to port, keyed by the client's source port, so each handshake
// waits for the client's SYN retransmissions: about 1 s for one drop, about
// 3 s for two (the kernel's initial RTO is 1 s and doubles).
func (h *Host) SlowHandshakes(tb testing.TB, port uint16, drops int) {
	tb.Helper()
	if drops < 1 || drops > 2 {
		tb.Fatalf("SlowHandshakes: drops %d is not 1 or 2", drops)
	}
	for i := 1; i <= drops; i++ {
		h.addRule(tb, port, fmt.Sprintf("tcp flags & (syn|ack) == syn tcp sport != @slow%[1]d add @slow%[1]d { tcp sport } drop", i))
	}
}

// SYNs returns how many TCP SYNs have reached the host since its first
// failure maker or counter read.
func (h *Host) SYNs(tb testing.TB) uint64 { return h.counter(tb, "syns") }

// UDPDatagrams returns how many UDP datagrams have reached the host.
func (h *Host) UDPDatagrams(tb testing.TB) uint64 { return h.counter(tb, "dgrams") }

// StartCounting sets up the host's counters without adding a failure.
func (h *Host) StartCounting(tb testing.TB) { h.nft(tb, "") }

func (h *Host) counter(tb testing.TB, name string) uint64 {
	tb.Helper()
	h.nft(tb, "")
	out, err := h.run("", "nft", "-j", "list", "counter", "inet", h.nftTable, name)
	if err != nil {
		tb.Fatalf("reading counter %s: %v", name, err)
	}
	var doc struct {
		Nftables []struct {
			Counter *struct {
				Packets uint64 `json:"packets"`
			} `json:"counter"`
		} `json:"nftables"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		tb.Fatalf("parsing counter %s: %v", name, err)
	}
	for _, e := range doc.Nftables {
		if e.Counter != nil {
			return e.Counter.Packets
		}
	}
	tb.Fatalf("counter %s not in nft output %s", name, out)
	return 0
}

// Listen opens a listener inside the host. network is "tcp", "tcp4",
// "tcp6", "udp" … as for net.Listen; it is closed when the test ends.
func (h *Host) Listen(tb testing.TB, network string, port uint16) net.Listener {
	tb.Helper()
	var l net.Listener
	err := h.Do(func() (err error) {
		l, err = net.Listen(network, fmt.Sprintf(":%d", port))
		return err
	})
	if err != nil {
		tb.Fatalf("listening on %s port %d in %s: %v", network, port, h.Name, err)
	}
	tb.Cleanup(func() { l.Close() })
	return l
}

// ListenPacket opens a UDP socket inside the host, closed when the test ends.
func (h *Host) ListenPacket(tb testing.TB, network string, port uint16) net.PacketConn {
	tb.Helper()
	var c net.PacketConn
	err := h.Do(func() (err error) {
		c, err = net.ListenPacket(network, fmt.Sprintf(":%d", port))
		return err
	})
	if err != nil {
		tb.Fatalf("listening on %s port %d in %s: %v", network, port, h.Name, err)
	}
	tb.Cleanup(func() { c.Close() })
	return c
}

// Serve accepts connections on a dual-stack TCP listener in the host and
// hands each to handle in its own goroutine, until the test ends.
func (h *Host) Serve(tb testing.TB, port uint16, handle func(*net.TCPConn)) {
	tb.Helper()
	l := h.Listen(tb, "tcp", port)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				if !errors.Is(err, net.ErrClosed) {
					tb.Logf("accept: %v", err)
				}
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				handle(c.(*net.TCPConn))
			}()
		}
	}()
	tb.Cleanup(func() { l.Close(); wg.Wait() })
}

// ServeHold accepts connections on port and holds them open, reading and
// discarding, until the peer or the test closes them.
func (h *Host) ServeHold(tb testing.TB, port uint16) {
	var mu sync.Mutex
	var conns []*net.TCPConn
	h.Serve(tb, port, func(c *net.TCPConn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				c.Close()
				return
			}
		}
	})
	tb.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
}

// ServeReset accepts connections on port and closes each at once with
// SO_LINGER 0, so the client receives a RST on an established connection.
func (h *Host) ServeReset(tb testing.TB, port uint16) { h.ServeResetAfter(tb, port, 0) }

// ServeResetAfter accepts connections on port, keeps each for d, then
// closes it with SO_LINGER 0: the client receives a RST on a connection
// that has been established for d (an idle timeout's reset).
func (h *Host) ServeResetAfter(tb testing.TB, port uint16, d time.Duration) {
	h.Serve(tb, port, func(c *net.TCPConn) {
		time.Sleep(d)
		_ = c.SetLinger(0)
		c.Close()
	})
}

// RedirectPorts makes the host answer TCP connections to every port from
// lo to hi on port to (nftables redirect in its prerouting hook): one
// listener serves as many distinct destinations as there are ports. The
// client's connect (and breakerd) still sees the port it dialled.
func (h *Host) RedirectPorts(tb testing.TB, lo, hi, to uint16) {
	tb.Helper()
	h.nft(tb, fmt.Sprintf(`table ip %[1]s-nat {
	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		tcp dport %[2]d-%[3]d redirect to :%[4]d
	}
}
`, h.nftTable, lo, hi, to))
}
