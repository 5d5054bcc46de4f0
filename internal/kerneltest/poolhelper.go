package kerneltest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// poolEnv carries a pool helper's spec (a re-exec of the test binary, as
// helperEnv does for Dial).
const poolEnv = "BREAKERD_KERNELTEST_POOL"

type poolSpec struct {
	// Mode is "hold" (connect and hold; "check" reports each connection)
	// or "http" (keep-alive HTTP/1.1 connections; "round" makes one GET
	// on each, reconnecting a connection that failed).
	Mode    string
	Targets []PoolTarget
	Listen  uint16
}

// runPool is the pool helper: plain blocking sockets, so what the kernel
// does to them is what the test sees.
func runPool(js string) int {
	var spec poolSpec
	if err := json.Unmarshal([]byte(js), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "bad pool spec:", err)
		return 2
	}
	_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 1 << 16, Max: 1 << 16})
	type conn struct {
		fd   int
		addr netip.AddrPort
	}
	var conns []*conn
	for _, t := range spec.Targets {
		for range t.N {
			c := &conn{fd: -1, addr: t.Addr}
			if spec.Mode == "hold" {
				fd, err := poolConnect(t.Addr)
				if err != nil {
					fmt.Fprintln(os.Stderr, "connect:", err)
					return 2
				}
				c.fd = fd
			}
			conns = append(conns, c)
		}
	}
	lfd := -1
	if spec.Listen != 0 {
		var err error
		if lfd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err == nil {
			_ = unix.SetsockoptInt(lfd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
			if err = unix.Bind(lfd, &unix.SockaddrInet4{Port: int(spec.Listen)}); err == nil {
				err = unix.Listen(lfd, 16)
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "listen:", err)
			return 2
		}
	}
	fmt.Println("ready")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch strings.TrimSpace(sc.Text()) {
		case "accept":
			fd, _, err := unix.Accept(lfd)
			if err != nil {
				fmt.Fprintln(os.Stderr, "accept:", err)
				return 2
			}
			conns = append(conns, &conn{fd: fd})
			fmt.Println("ok")
		case "close-listener":
			if err := unix.Close(lfd); err != nil {
				fmt.Fprintln(os.Stderr, "closing the listener:", err)
				return 2
			}
			lfd = -1
			fmt.Println("ok")
		case "check":
			out := make([]string, len(conns))
			for i, c := range conns {
				out[i] = sockState(c.fd)
			}
			js, _ := json.Marshal(out)
			fmt.Println(string(js))
		case "round":
			out := make([]string, len(conns))
			for i, c := range conns {
				if c.fd < 0 {
					fd, err := poolConnect(c.addr)
					if err != nil {
						out[i] = errName(err)
						continue
					}
					c.fd = fd
				}
				res, err := httpGet(c.fd, c.addr)
				if err != nil {
					unix.Close(c.fd)
					c.fd = -1
					out[i] = errName(err)
					continue
				}
				out[i] = res
			}
			js, _ := json.Marshal(out)
			fmt.Println(string(js))
		}
	}
	return 0
}

func poolConnect(a netip.AddrPort) (int, error) {
	family := unix.AF_INET
	if a.Addr().Is6() {
		family = unix.AF_INET6
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	tv := unix.NsecToTimeval(int64(3 * time.Second))
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	err = unix.Connect(fd, sockaddr(family, a))
	if err == unix.EINTR {
		// A signal during the handshake: it goes on; wait for its end.
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		if _, err = unix.Poll(pfd, 3000); err == nil {
			if e, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); e != 0 {
				err = unix.Errno(e)
			}
		}
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// sockState is "open" while a non-blocking peek would block, "eof" at the
// end of the stream, else the errno's name.
func sockState(fd int) string {
	var b [1]byte
	n, _, err := unix.Recvfrom(fd, b[:], unix.MSG_DONTWAIT|unix.MSG_PEEK)
	switch {
	case err == unix.EAGAIN:
		return "open"
	case err != nil:
		return errName(err)
	case n == 0:
		return "eof"
	}
	return "open"
}

func errName(err error) string {
	if e, ok := err.(unix.Errno); ok {
		if n := unix.ErrnoName(e); n != "" {
			return n
		}
	}
	return err.Error()
}

// httpGet makes one keep-alive GET on fd and reads the response (its
// body by Content-Length): "ok:STATUS:LOCALPORT".
func httpGet(fd int, a netip.AddrPort) (string, error) {
	req := "GET / HTTP/1.1\r\nHost: " + a.String() + "\r\n\r\n"
	if _, err := unix.Write(fd, []byte(req)); err != nil {
		return "", err
	}
	var buf []byte
	tmp := make([]byte, 4096)
	for {
		n, err := unix.Read(fd, tmp)
		if err != nil {
			return "", err
		}
		if n == 0 {
			return "", fmt.Errorf("eof")
		}
		buf = append(buf, tmp[:n]...)
		head, body, ok := strings.Cut(string(buf), "\r\n\r\n")
		if !ok {
			continue
		}
		length := 0
		for _, l := range strings.Split(head, "\r\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.EqualFold(k, "content-length") {
				length, _ = strconv.Atoi(strings.TrimSpace(v))
			}
		}
		if len(body) < length {
			continue
		}
		status := strings.Fields(head)
		if len(status) < 2 {
			return "", fmt.Errorf("bad status line %q", head)
		}
		sa, _ := unix.Getsockname(fd)
		port := 0
		switch s := sa.(type) {
		case *unix.SockaddrInet4:
			port = s.Port
		case *unix.SockaddrInet6:
			port = s.Port
		}
		return fmt.Sprintf("ok:%s:%d", status[1], port), nil
	}
}
