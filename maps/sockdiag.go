package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"syscall"

	"golang.org/x/sys/unix"
)

// The sock_diag fallback of the close pass, for kernels without
// bpf_sock_destroy (before 6.5): the same filter as bpf/destroy.c, in the
// daemon. Each network namespace's TCP sockets in LISTEN and ESTABLISHED
// are dumped over NETLINK_SOCK_DIAG with their cgroup id
// (INET_DIAG_CGROUP_ID), and its accepted sockets listed by list_accepted
// (an iterator that closes nothing); every established client socket to a wanted
// destination, made in a cgroup below the attach point, is destroyed by
// SOCK_DESTROY, addressed by its 4-tuple and cookie (so a socket that
// went away and whose tuple was reused is not hit). A socket made and
// closed between the dump and the destroy is missed: fail open.

const (
	tcpEstablished = 1
	tcpListen      = 10

	inetDiagCgroupID = 21 // INET_DIAG_CGROUP_ID (uapi/linux/inet_diag.h)

	sizeofDiagReq   = 56 // struct inet_diag_req_v2
	sizeofDiagMsg   = 72 // struct inet_diag_msg
	sizeofSockID    = 48 // struct inet_diag_sockid
	offsetMsgSockID = 4
)

// diagSock is one socket of a dump.
type diagSock struct {
	family uint8
	state  uint8
	id     [sizeofSockID]byte // inet_diag_sockid as the kernel sent it
	cgroup uint64
}

func (s *diagSock) localPort() uint16 { return binary.BigEndian.Uint16(s.id[0:2]) }

func (s *diagSock) remote() netip.AddrPort {
	port := binary.BigEndian.Uint16(s.id[2:4])
	var a netip.Addr
	if s.family == unix.AF_INET {
		a = netip.AddrFrom4([4]byte(s.id[20:24]))
	} else {
		a = netip.AddrFrom16([16]byte(s.id[20:36])).Unmap()
	}
	return netip.AddrPortFrom(a, port)
}

func diagRequest(typ uint16, flags uint16, family uint8, states uint32, id *[sizeofSockID]byte) []byte {
	b := make([]byte, unix.SizeofNlMsghdr+sizeofDiagReq)
	binary.NativeEndian.PutUint32(b[0:4], uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:6], typ)
	binary.NativeEndian.PutUint16(b[6:8], flags)
	binary.NativeEndian.PutUint32(b[8:12], 1) // seq
	r := b[unix.SizeofNlMsghdr:]
	r[0] = family
	r[1] = unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(r[4:8], states)
	if id != nil {
		copy(r[8:8+sizeofSockID], id[:])
	} else {
		// No cookie: INET_DIAG_NOCOOKIE.
		binary.NativeEndian.PutUint32(r[8+40:8+44], ^uint32(0))
		binary.NativeEndian.PutUint32(r[8+44:8+48], ^uint32(0))
	}
	return b
}

func diagSocket() (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_INET_DIAG)
	if err != nil {
		return -1, fmt.Errorf("opening a sock_diag socket: %w", err)
	}
	tv := unix.Timeval{Sec: 5}
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("binding a sock_diag socket: %w", err)
	}
	return fd, nil
}

// diagDump lists the TCP sockets of family in states (a bit per state).
func diagDump(fd int, family uint8, states uint32) ([]diagSock, error) {
	req := diagRequest(unix.SOCK_DIAG_BY_FAMILY, unix.NLM_F_REQUEST|unix.NLM_F_DUMP, family, states, nil)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("asking for the sockets: %w", err)
	}
	var out []diagSock
	buf := make([]byte, 1<<16)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return nil, fmt.Errorf("reading the sockets: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return nil, fmt.Errorf("parsing the sockets: %w", err)
		}
		for _, m := range msgs {
			switch m.Header.Type {
			case unix.NLMSG_DONE:
				return out, nil
			case unix.NLMSG_ERROR:
				return nil, fmt.Errorf("listing sockets: %w", nlError(m.Data))
			}
			if len(m.Data) < sizeofDiagMsg {
				continue
			}
			s := diagSock{family: m.Data[0], state: m.Data[1]}
			copy(s.id[:], m.Data[offsetMsgSockID:offsetMsgSockID+sizeofSockID])
			attrs := m.Data[sizeofDiagMsg:]
			for len(attrs) >= unix.SizeofRtAttr {
				l := int(binary.NativeEndian.Uint16(attrs[0:2]))
				t := binary.NativeEndian.Uint16(attrs[2:4])
				if l < unix.SizeofRtAttr || l > len(attrs) {
					break
				}
				if t == inetDiagCgroupID && l >= unix.SizeofRtAttr+8 {
					s.cgroup = binary.NativeEndian.Uint64(attrs[4:12])
				}
				attrs = attrs[min(len(attrs), (l+3)&^3):]
			}
			out = append(out, s)
		}
	}
}

func nlError(data []byte) error {
	if len(data) < 4 {
		return errors.New("short netlink error")
	}
	code := int32(binary.NativeEndian.Uint32(data[0:4]))
	if code == 0 {
		return nil
	}
	return syscall.Errno(-code)
}

// diagDestroy destroys one socket by its id (tuple and cookie).
func diagDestroy(fd int, family uint8, id *[sizeofSockID]byte) error {
	req := diagRequest(unix.SOCK_DESTROY, unix.NLM_F_REQUEST|unix.NLM_F_ACK, family, ^uint32(0), id)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("sending SOCK_DESTROY: %w", err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return fmt.Errorf("reading SOCK_DESTROY's answer: %w", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(buf[:n])
	if err != nil {
		return fmt.Errorf("parsing SOCK_DESTROY's answer: %w", err)
	}
	for _, m := range msgs {
		if m.Header.Type == unix.NLMSG_ERROR {
			return nlError(m.Data)
		}
	}
	return errors.New("no answer to SOCK_DESTROY")
}

// probeSockDiagDestroy reports whether SOCK_DESTROY works here: a dump
// must work (tcp_diag), and destroying a socket that does not exist must
// fail with ENOENT (EOPNOTSUPP: the kernel lacks CONFIG_INET_DIAG_DESTROY).
func probeSockDiagDestroy() error {
	fd, err := diagSocket()
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if _, err := diagDump(fd, unix.AF_INET, 1<<tcpListen); err != nil {
		return err
	}
	var id [sizeofSockID]byte
	binary.NativeEndian.PutUint32(id[40:44], ^uint32(0))
	binary.NativeEndian.PutUint32(id[44:48], ^uint32(0))
	switch err := diagDestroy(fd, unix.AF_INET, &id); {
	case errors.Is(err, unix.ENOENT):
		return nil
	case errors.Is(err, unix.EOPNOTSUPP):
		return fmt.Errorf("SOCK_DESTROY is not supported (the kernel lacks CONFIG_INET_DIAG_DESTROY): %w", err)
	case err == nil:
		return errors.New("SOCK_DESTROY of no socket succeeded")
	default:
		return fmt.Errorf("probing SOCK_DESTROY: %w", err)
	}
}

// sockDiagPass closes, in the calling thread's network namespace, the
// sockets the iterator would: established, not server side, made in a
// cgroup of ids (the tree below the attach point), of the class w says
// (CloseScoped: only cgroups in the workloads map), to a destination of
// want in that class.
func (c *Closer) sockDiagPass(want map[Dest]bool, ids map[uint64]bool, w CloseWorkloads, out map[Dest]CloseCount) error {
	fd, err := diagSocket()
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	var errs []error
	accepted, err := c.acceptedSocks()
	if err != nil {
		errs = append(errs, err) // judged by listening ports alone
	}
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		socks, err := diagDump(fd, family, 1<<tcpEstablished|1<<tcpListen)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		listening := map[uint16]bool{}
		for i := range socks {
			if socks[i].state == tcpListen {
				listening[socks[i].localPort()] = true
			}
		}
		for i := range socks {
			s := &socks[i]
			if s.state != tcpEstablished || listening[s.localPort()] || !ids[s.cgroup] {
				continue
			}
			if accepted[acceptedKey{family: s.family, id: [36]byte(s.id[:36])}] {
				continue // server side, its listener closed
			}
			d := Dest{Proto: TCP, Addr: s.remote()}
			if w != CloseUnclassed {
				class, ok, err := c.k.Workload(s.cgroup)
				if err != nil || (!ok && w == CloseScoped) {
					continue
				}
				d.Class = class
			}
			if !want[d] {
				continue
			}
			n := out[d]
			if err := diagDestroy(fd, s.family, &s.id); err != nil && !errors.Is(err, unix.ENOENT) {
				n.Failed++
			} else if err == nil {
				n.Closed++
			}
			out[d] = n
		}
	}
	return errors.Join(errs...)
}
