package daemon

import (
	"errors"
	"net"
	"net/http"
	"sync"
	"time"
)

// connLimit is a listener that holds at most max connections open. At the
// limit it closes an idle keep-alive connection to make room; when none
// is idle, new connections wait in the kernel's accept queue (costing the
// daemon no file descriptor) until one closes. Each server has its own, so
// TCP clients cannot use up the unix socket's connections.
type connLimit struct {
	net.Listener
	slots  chan struct{}
	accept func(net.Conn) bool // false: close the connection at once

	mu   sync.Mutex
	idle map[net.Conn]struct{}
	done chan struct{}
	once sync.Once
}

func newConnLimit(l net.Listener, max int, accept func(net.Conn) bool) *connLimit {
	return &connLimit{Listener: l, slots: make(chan struct{}, max), accept: accept,
		idle: map[net.Conn]struct{}{}, done: make(chan struct{})}
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
		return &limitedConn{Conn: c, l: l}, nil
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
		if !l.closeIdle() {
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

// closeIdle closes one idle keep-alive connection, if there is one.
func (l *connLimit) closeIdle() bool {
	l.mu.Lock()
	var victim net.Conn
	for c := range l.idle {
		victim = c
		delete(l.idle, c)
		break
	}
	l.mu.Unlock()
	if victim == nil {
		return false
	}
	victim.Close()
	return true
}

// track is the server's ConnState hook: it keeps the set of idle
// connections.
func (l *connLimit) track(c net.Conn, s http.ConnState) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s == http.StateIdle {
		l.idle[c] = struct{}{}
	} else {
		delete(l.idle, c)
	}
}

// Close stops accepting.
func (l *connLimit) Close() error {
	l.once.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// limitedConn frees its slot once, when closed.
type limitedConn struct {
	net.Conn
	l    *connLimit
	once sync.Once
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { <-c.l.slots })
	return err
}
