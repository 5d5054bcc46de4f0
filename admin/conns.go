package admin

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/maps"
)

// connLimit is a listener that holds at most max connections open. At the
// limit it makes room by closing, first, an idle keep-alive connection,
// then the oldest connection that has not yet sent a whole request (a
// client that connects and sends nothing, or sends its header slowly): no
// slot is ever held by a client that asks for nothing, so such clients
// cannot keep a well-behaved one (a probe, a scrape) waiting in the
// kernel's accept queue. Only when every connection is busy serving a
// request do new ones wait there (costing the daemon no file descriptor)
// until one closes; a busy connection's writes are bounded by writeStall.
// Each server has its own, so TCP clients cannot use up the unix
// socket's connections.
type connLimit struct {
	net.Listener
	slots  chan struct{}
	accept func(net.Conn) bool // false: close the connection at once

	mu    sync.Mutex
	conns map[net.Conn]connPhase // open connections not serving a request
	done  chan struct{}
	once  sync.Once
}

// connPhase is where an open connection is between requests.
type connPhase struct {
	idle  bool      // false: no whole request read yet
	since time.Time // when it entered the phase
}

const (
	// writeStall is the longest one write may make no progress: each
	// chunk of writeChunk bytes must be taken by the peer within it (at
	// least 32 KiB/s). A client that asks for a large response and never
	// reads it loses its connection, and the request slot it held, a
	// couple of seconds after its socket buffers fill, not at the
	// server's WriteTimeout.
	writeStall = 2 * time.Second
	writeChunk = 64 << 10
)

func newConnLimit(l net.Listener, max int, accept func(net.Conn) bool) *connLimit {
	return &connLimit{Listener: l, slots: make(chan struct{}, max), accept: accept,
		conns: map[net.Conn]connPhase{}, done: make(chan struct{})}
}

var errListenerClosed = errors.New("admin listener closed")

// Accept waits for a free slot, then for a connection.
func (l *connLimit) Accept() (net.Conn, error) {
	for {
		if err := l.acquire(); err != nil {
			return nil, err
		}
		c, err := l.Listener.Accept()
		if err != nil {
			<-l.slots
			return nil, err
		}
		if l.accept != nil && !l.accept(c) {
			c.Close()
			<-l.slots
			continue
		}
		lc := &limitedConn{Conn: c, l: l}
		l.mu.Lock()
		l.conns[lc] = connPhase{since: time.Now()}
		l.mu.Unlock()
		return lc, nil
	}
}

func (l *connLimit) acquire() error {
	for {
		select {
		case l.slots <- struct{}{}:
			return nil
		case <-l.done:
			return errListenerClosed
		default:
		}
		if !l.evict() {
			select {
			case l.slots <- struct{}{}:
				return nil
			case <-l.done:
				return errListenerClosed
			case <-time.After(100 * time.Millisecond):
				// A connection may have turned idle meanwhile.
			}
		}
	}
}

// evict closes an idle keep-alive connection, or else the one that has
// waited longest without sending a whole request, if there is either.
func (l *connLimit) evict() bool {
	l.mu.Lock()
	var victim net.Conn
	var oldest time.Time
	for c, p := range l.conns {
		if p.idle {
			victim = c
			break
		}
		if victim == nil || p.since.Before(oldest) {
			victim, oldest = c, p.since
		}
	}
	delete(l.conns, victim)
	l.mu.Unlock()
	if victim == nil {
		return false
	}
	victim.Close()
	return true
}

// track is the server's ConnState hook: it keeps the phase of each
// connection that is not serving a request. The server reports
// StateActive once a request's header has been read, so a connection in
// StateNew has sent no whole request yet.
func (l *connLimit) track(c net.Conn, s http.ConnState) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch s {
	case http.StateNew:
		// Accept has added it (unless evict has closed it since).
	case http.StateIdle:
		l.conns[c] = connPhase{idle: true, since: time.Now()}
	default:
		delete(l.conns, c)
	}
}

// Close stops accepting.
func (l *connLimit) Close() error {
	l.once.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// limitedConn frees its slot once, when closed, and bounds how long each
// write may make no progress (writeStall) within the server's own write
// deadline.
type limitedConn struct {
	net.Conn
	l    *connLimit
	once sync.Once

	mu       sync.Mutex
	deadline time.Time // the write deadline the server set (zero: none)

	clientOnce sync.Once
	client     string
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.l.mu.Lock()
		delete(c.l.conns, c)
		c.l.mu.Unlock()
		<-c.l.slots
	})
	return err
}

func (c *limitedConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	c.deadline = t
	c.mu.Unlock()
	return c.Conn.SetDeadline(t)
}

func (c *limitedConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	c.deadline = t
	c.mu.Unlock()
	return c.Conn.SetWriteDeadline(t)
}

// Write writes b in chunks of writeChunk, each within writeStall (or the
// server's deadline, if sooner).
func (c *limitedConn) Write(b []byte) (int, error) {
	written := 0
	for len(b) > 0 {
		chunk := b[:min(len(b), writeChunk)]
		dl := time.Now().Add(writeStall)
		c.mu.Lock()
		if !c.deadline.IsZero() && c.deadline.Before(dl) {
			dl = c.deadline
		}
		c.mu.Unlock()
		if err := c.Conn.SetWriteDeadline(dl); err != nil {
			return written, err
		}
		n, err := c.Conn.Write(chunk)
		written += n
		b = b[n:]
		if err != nil {
			return written, err
		}
	}
	return written, nil
}

// clientKey names who is on the other end, for the per-client request
// limit: for TCP, the uid that owns the client's socket when it is in
// this network namespace (local users share 127.0.0.1 and this host's
// addresses, so an address would lump them together), else the client's
// address; for the unix socket (root only), the client's process.
func (c *limitedConn) clientKey() string {
	c.clientOnce.Do(func() { c.client = peerKey(c.Conn) })
	return c.client
}

func peerKey(c net.Conn) string {
	switch conn := c.(type) {
	case *net.TCPConn:
		local, _ := netip.ParseAddrPort(conn.LocalAddr().String())
		remote, _ := netip.ParseAddrPort(conn.RemoteAddr().String())
		if uid, err := maps.PeerUID(local, remote); err == nil {
			return fmt.Sprintf("uid %d", uid)
		}
		return "address " + remote.Addr().Unmap().String()
	case *net.UnixConn:
		raw, err := conn.SyscallConn()
		if err != nil {
			return "unix"
		}
		var cred *unix.Ucred
		_ = raw.Control(func(fd uintptr) {
			cred, _ = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		})
		if cred == nil {
			return "unix"
		}
		return fmt.Sprintf("pid %d", cred.Pid)
	}
	return c.RemoteAddr().String()
}
