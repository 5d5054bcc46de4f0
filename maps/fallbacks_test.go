package maps

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// The fallback tests run unmodified clients (curl, python3) in the test
// cgroup of the client host; server host 0 is the target whose circuit
// is open, server host 1 its fallback.

// answerHTTP serves one-shot HTTP/1.0 on port of h, answering body.
func answerHTTP(t *testing.T, h *kerneltest.Host, port uint16, body string) {
	t.Helper()
	h.Serve(t, port, func(c *net.TCPConn) {
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		r := bufio.NewReader(c)
		for {
			line, err := r.ReadString('\n')
			if err != nil || line == "\r\n" || line == "\n" {
				break
			}
		}
		fmt.Fprintf(c, "HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	})
}

// echoUDP answers every datagram to port of h with body.
func echoUDP(t *testing.T, h *kerneltest.Host, port uint16, body string) {
	t.Helper()
	pc := h.ListenPacket(t, "udp", port)
	go func() {
		buf := make([]byte, 512)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo([]byte(body), from)
		}
	}()
}

// curl fetches url from the test cgroup: the body, or curl's exit code
// (7: could not connect).
func (e *env) curl(t *testing.T, url string) (string, int) {
	t.Helper()
	out, err := e.topo.Client.Command(e.cg, "curl", "-sS", "--max-time", "3", "-g", url).Run(t)
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(out), ee.ExitCode()
	}
	if err != nil {
		t.Fatalf("curl %s: %v", url, err)
	}
	return string(out), 0
}

// peerScript connects (tcp: a stream socket; udp: connect, then sendto
// on a second, unconnected socket), sends a line and prints what the
// application sees: the socket's getpeername, and for UDP the source
// recvfrom gives, then the answer.
const peerScript = `
import socket, sys
proto, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = socket.AF_INET6 if ':' in host else socket.AF_INET
if proto == 'tcp':
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect((host, port))
    p = s.getpeername()
    s.sendall(b'GET / HTTP/1.0\r\n\r\n')
    body = s.recv(200).split(b'\r\n\r\n')[-1].decode()
    print('peer', p[0], p[1], body)
else:
    s = socket.socket(fam, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.connect((host, port))
    p = s.getpeername()
    s.send(b'x')
    print('peer', p[0], p[1], s.recv(200).decode())
    u = socket.socket(fam, socket.SOCK_DGRAM)
    u.settimeout(3)
    u.sendto(b'x', (host, port))
    data, src = u.recvfrom(200)
    print('from', src[0], src[1], data.decode())
`

// peer runs peerScript in the test cgroup and returns its lines.
func (e *env) peer(t *testing.T, proto string, host string, port uint16) []string {
	t.Helper()
	out, err := e.topo.Client.Command(e.cg, "python3", "-c", peerScript, proto, host, fmt.Sprint(port)).Run(t)
	if err != nil {
		t.Fatalf("python3 %s %s %d: %v: %s", proto, host, port, err, out)
	}
	return strings.Split(strings.TrimSpace(string(out)), "\n")
}

// openWithFallback opens the circuit of id over dst (epoch 7) and names fb
// its fallback.
func (e *env) openWithFallback(t *testing.T, id uint32, dst Dest, fb netip.AddrPort) {
	t.Helper()
	v := OpenVerdict(Now()+farFuture, 1, 1, 0, id)
	v.Epoch = 7
	if err := e.k.PutFallback(id, Fallback{Addr: fb, Proto: dst.Proto, Epoch: 7}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.PutVerdict(dst, v); err != nil {
		t.Fatal(err)
	}
}

func TestFallbackTakesTheOpenCircuitsConnects(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	answerHTTP(t, dead, 80, "real")
	answerHTTP(t, fb, 8080, "fallback")
	w := e.watch(t)
	cases := []struct {
		name    string
		dst, to netip.AddrPort
		url     string
		host    string // what the application connects to
	}{
		{"ipv4", netip.AddrPortFrom(dead.IPv4, 80), netip.AddrPortFrom(fb.IPv4, 8080), "http://198.18.0.2:80/", "198.18.0.2"},
		{"ipv6", netip.AddrPortFrom(dead.IPv6, 80), netip.AddrPortFrom(fb.IPv6, 8080), "http://[2001:db8::2]:80/", "2001:db8::2"},
		{"dual-stack socket to ipv4", netip.AddrPortFrom(dead.IPv4, 80), netip.AddrPortFrom(fb.IPv4, 8080), "", "::ffff:198.18.0.2"},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id := uint32(i + 1)
			d := Dest{Proto: TCP, Addr: c.dst}
			e.openWithFallback(t, id, d, c.to)
			defer e.k.DeleteVerdict(d)
			synsDead, synsFb := dead.SYNs(t), fb.SYNs(t)
			n := uint64(1)
			if c.url != "" {
				if body, code := e.curl(t, c.url); code != 0 || body != "fallback" {
					t.Fatalf("curl %s: %q, exit %d; want the fallback's answer", c.url, body, code)
				}
				n++
			}
			lines := e.peer(t, "tcp", c.host, 80)
			if want := fmt.Sprintf("peer %s 80 fallback", c.host); lines[0] != want {
				t.Fatalf("python3 saw %q, want %q (getpeername shows the address asked for)", lines[0], want)
			}
			if got := fb.SYNs(t) - synsFb; got != n {
				t.Fatalf("%d SYNs at the fallback, want %d", got, n)
			}
			if got := dead.SYNs(t) - synsDead; got != 0 {
				t.Fatalf("%d SYNs reached the target whose circuit is open", got)
			}
			cnt, err := e.k.Counters(id)
			if err != nil {
				t.Fatal(err)
			}
			if cnt.Redirected != n || cnt.Rejected != 0 {
				t.Fatalf("counters %+v, want %d redirected and none rejected", cnt, n)
			}
			// The outcome is the fallback's: sockops reports the socket's
			// peer, never the dead target.
			evs := w.wait(8080, int(n), 2*time.Second)
			if len(evs) < int(n) {
				t.Fatalf("%d records for the fallback, want %d", len(evs), n)
			}
			for _, ev := range evs {
				if ev.Dest.Addr != c.to || ev.Outcome != Established {
					t.Fatalf("record %v %v, want established at the fallback %v", ev.Dest, ev.Outcome, c.to)
				}
			}
			w.mu.Lock()
			for _, ev := range w.events {
				if ev.Dest.Addr.Port() == 80 {
					t.Errorf("a record names the target whose circuit is open: %+v", ev)
				}
			}
			w.events = nil
			w.mu.Unlock()
		})
	}
	t.Run("closed again, the real server answers", func(t *testing.T) {
		if body, code := e.curl(t, "http://198.18.0.2:80/"); code != 0 || body != "real" {
			t.Fatalf("curl: %q, exit %d; want the real server's answer", body, code)
		}
		if lines := e.peer(t, "tcp", "198.18.0.2", 80); lines[0] != "peer 198.18.0.2 80 real" {
			t.Fatalf("python3 saw %q", lines[0])
		}
	})
}

func TestFallbacksOwnOpenCircuitRejects(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	if !e.k.Features().SetRetval {
		if kerneltest.InCI() {
			t.Fatal("this kernel has no bpf_set_retval; the errno tests need it")
		}
		t.Skip("no bpf_set_retval: rejections are EPERM")
	}
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	answerHTTP(t, fb, 8080, "fallback")
	d := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 80)}
	to := netip.AddrPortFrom(fb.IPv4, 8080)
	e.openWithFallback(t, 1, d, to)
	if body, code := e.curl(t, "http://198.18.0.2:80/"); code != 0 || body != "fallback" {
		t.Fatalf("curl: %q, exit %d; want the fallback's answer", body, code)
	}
	// The fallback's own circuit opens: redirects become rejections.
	if err := e.k.PutVerdict(Dest{Proto: TCP, Addr: to}, OpenVerdict(Now()+farFuture, 1, 1, 0, 2)); err != nil {
		t.Fatal(err)
	}
	before := fb.SYNs(t)
	res := e.dial(t, e.cg, kerneltest.DialSpec{Network: "tcp4", Addr: d.Addr, Count: 3})
	if got := errnos(res); got[0x6f] != 3 { // ECONNREFUSED
		t.Fatalf("errnos %v, want 3 × ECONNREFUSED", got)
	}
	if _, code := e.curl(t, "http://198.18.0.2:80/"); code != 7 {
		t.Fatalf("curl exit %d, want 7 (could not connect)", code)
	}
	if n := fb.SYNs(t) - before; n != 0 {
		t.Fatalf("%d SYNs at the fallback whose circuit is open", n)
	}
	cnt, err := e.k.Counters(1)
	if err != nil {
		t.Fatal(err)
	}
	if cnt.Redirected != 1 || cnt.Rejected != 4 {
		t.Fatalf("counters %+v, want 1 redirected, 4 rejected", cnt)
	}
	// The fallback half-open: a connect may be its probe, and goes there.
	if err := e.k.PutVerdict(Dest{Proto: TCP, Addr: to}, OpenVerdict(Now(), 2, 1, 0, 2)); err != nil {
		t.Fatal(err)
	}
	if body, code := e.curl(t, "http://198.18.0.2:80/"); code != 0 || body != "fallback" {
		t.Fatalf("curl: %q, exit %d; want the fallback's probe answered", body, code)
	}
	if c2, _ := e.k.Counters(2); c2.Probes != 1 {
		t.Fatalf("fallback's probes %d, want 1", c2.Probes)
	}
}

func TestFallbackOfAnotherEpochIsNotFollowed(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	answerHTTP(t, fb, 8080, "fallback")
	d := Dest{Proto: TCP, Addr: netip.AddrPortFrom(dead.IPv4, 80)}
	e.openWithFallback(t, 1, d, netip.AddrPortFrom(fb.IPv4, 8080))
	if _, code := e.curl(t, "http://198.18.0.2:80/"); code != 0 {
		t.Fatalf("curl exit %d, want the fallback's answer", code)
	}
	// Another holder of id 1 (epoch 8) has no fallback: its verdict rejects.
	v := OpenVerdict(Now()+farFuture, 1, 1, 0, 1)
	v.Epoch = 8
	if err := e.k.PutVerdict(d, v); err != nil {
		t.Fatal(err)
	}
	if _, code := e.curl(t, "http://198.18.0.2:80/"); code != 7 {
		t.Fatalf("curl exit %d, want 7: a fallback of another epoch was followed", code)
	}
	// An IPv4 connect is never sent to an IPv6 fallback.
	if err := e.k.PutFallback(1, Fallback{Addr: netip.AddrPortFrom(fb.IPv6, 8080), Proto: TCP, Epoch: 8}); err != nil {
		t.Fatal(err)
	}
	if _, code := e.curl(t, "http://198.18.0.2:80/"); code != 7 {
		t.Fatalf("curl exit %d, want 7: an IPv4 socket was sent to an IPv6 fallback", code)
	}
}

func TestFallbackTakesUDP(t *testing.T) {
	e := newEnvHosts(t, Options{}, 2)
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, UDP: true}); err != nil {
		t.Fatal(err)
	}
	dead, fb := e.topo.Servers[0], e.topo.Servers[1]
	fb.StartCounting(t)
	echoUDP(t, dead, 53, "real")
	echoUDP(t, fb, 5353, "fallback")
	for i, v6 := range []bool{false, true} {
		a, to, host := dead.IPv4, fb.IPv4, "198.18.0.2"
		if v6 {
			a, to, host = dead.IPv6, fb.IPv6, "2001:db8::2"
		}
		d := Dest{Proto: UDP, Addr: netip.AddrPortFrom(a, 53)}
		id := uint32(i + 1)
		e.openWithFallback(t, id, d, netip.AddrPortFrom(to, 5353))
		before := dead.UDPDatagrams(t)
		lines := e.peer(t, "udp", host, 53)
		want := []string{"peer " + host + " 53 fallback", "from " + host + " 53 fallback"}
		if len(lines) != 2 || lines[0] != want[0] || lines[1] != want[1] {
			t.Fatalf("python3 saw %q, want %q", lines, want)
		}
		if n := dead.UDPDatagrams(t) - before; n != 0 {
			t.Fatalf("%d datagrams reached the target whose circuit is open", n)
		}
		if cnt, _ := e.k.Counters(id); cnt.Redirected != 2 {
			t.Fatalf("redirected %d, want 2 (a connect and a sendto)", cnt.Redirected)
		}
		if err := e.k.DeleteVerdict(d); err != nil {
			t.Fatal(err)
		}
		if lines := e.peer(t, "udp", host, 53); lines[0] != "peer "+host+" 53 real" || lines[1] != "from "+host+" 53 real" {
			t.Fatalf("closed: python3 saw %q", lines)
		}
	}
}
