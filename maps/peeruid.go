package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"syscall"

	"golang.org/x/sys/unix"
)

// offsetMsgUID is where struct inet_diag_msg keeps idiag_uid: after the
// family, state, timer and retransmits bytes, the socket id, and the
// expires, rqueue and wqueue words.
const offsetMsgUID = offsetMsgSockID + sizeofSockID + 12

// ErrPeerNotLocal says a TCP peer's socket is not in this network
// namespace (a client on another host, or in another namespace): there is
// no local owner to name.
var ErrPeerNotLocal = errors.New("the peer's socket is not in this network namespace")

// PeerUID returns the uid that owns the client end of a TCP connection
// this process accepted, when that end is a socket in this network
// namespace (a loopback client, or a process of this host connecting to
// one of its own addresses). local is the accepted connection's own
// address, remote its peer's. The client socket is looked up by its
// 4-tuple over NETLINK_SOCK_DIAG (one request, no dump); a peer outside
// this namespace is ErrPeerNotLocal.
func PeerUID(local, remote netip.AddrPort) (uint32, error) {
	local, remote = netip.AddrPortFrom(local.Addr().Unmap(), local.Port()), netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port())
	family := uint8(unix.AF_INET6)
	if remote.Addr().Is4() {
		family = unix.AF_INET
	}
	if local.Addr().Is4() != remote.Addr().Is4() {
		return 0, ErrPeerNotLocal
	}
	// The client's socket: its source is our peer, its destination us.
	var id [sizeofSockID]byte
	binary.BigEndian.PutUint16(id[0:2], remote.Port())
	binary.BigEndian.PutUint16(id[2:4], local.Port())
	src, dst := remote.Addr().AsSlice(), local.Addr().AsSlice()
	copy(id[4:20], src)
	copy(id[20:36], dst)
	binary.NativeEndian.PutUint32(id[40:44], ^uint32(0)) // INET_DIAG_NOCOOKIE
	binary.NativeEndian.PutUint32(id[44:48], ^uint32(0))
	fd, err := diagSocket()
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	req := diagRequest(unix.SOCK_DIAG_BY_FAMILY, unix.NLM_F_REQUEST, family, ^uint32(0), &id)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, fmt.Errorf("asking for the peer's socket: %w", err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return 0, fmt.Errorf("reading the peer's socket: %w", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(buf[:n])
	if err != nil {
		return 0, fmt.Errorf("parsing the peer's socket: %w", err)
	}
	for _, m := range msgs {
		switch {
		case m.Header.Type == unix.NLMSG_ERROR:
			if err := nlError(m.Data); errors.Is(err, unix.ENOENT) {
				return 0, ErrPeerNotLocal
			} else if err != nil {
				return 0, fmt.Errorf("looking up the peer's socket: %w", err)
			}
		case len(m.Data) >= sizeofDiagMsg:
			// The lookup falls back to a listener on the peer's port:
			// only a connected socket whose peer is our end counts.
			s := diagSock{family: m.Data[0], state: m.Data[1]}
			copy(s.id[:], m.Data[offsetMsgSockID:offsetMsgSockID+sizeofSockID])
			if s.state == tcpListen || s.remote() != local {
				return 0, ErrPeerNotLocal
			}
			return binary.NativeEndian.Uint32(m.Data[offsetMsgUID : offsetMsgUID+4]), nil
		}
	}
	return 0, ErrPeerNotLocal
}
