package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/breakerd/breakerd/bpf"
)

// Outcome is how a connection ended, as the kernel saw it.
type Outcome uint8

// Outcomes, as in bpf/breaker.h.
const (
	Established = Outcome(bpf.BreakerOutcomeOUTCOME_ESTABLISHED)
	Refused     = Outcome(bpf.BreakerOutcomeOUTCOME_REFUSED)
	TimedOut    = Outcome(bpf.BreakerOutcomeOUTCOME_TIMED_OUT)
	Unreachable = Outcome(bpf.BreakerOutcomeOUTCOME_UNREACHABLE)
	Reset       = Outcome(bpf.BreakerOutcomeOUTCOME_RESET)
	Stalled     = Outcome(bpf.BreakerOutcomeOUTCOME_STALLED)
	Abandoned   = Outcome(bpf.BreakerOutcomeOUTCOME_ABANDONED)
	SYNRetrans  = Outcome(bpf.BreakerOutcomeOUTCOME_SYN_RETRANS)
	Error       = Outcome(bpf.BreakerOutcomeOUTCOME_ERROR)
	ProbeRound  = Outcome(bpf.BreakerOutcomeOUTCOME_PROBE_ROUND)
	// Response is the first byte of a response (Duration: since its
	// request's first byte; Count: the turn; Status with HTTP).
	Response = Outcome(bpf.BreakerOutcomeOUTCOME_RESPONSE)
	// NoResponse is a connection that ended while a request awaited its
	// first response byte (PeerClosed: the peer closed or reset it).
	NoResponse = Outcome(bpf.BreakerOutcomeOUTCOME_NO_RESPONSE)
	// Answered is the successes the kernel counted for a circuit (RespBatch)
	// since it last wrote them out: AnsweredCount of them, for circuit id
	// Round under answered epoch Count. It has no destination or socket.
	Answered = Outcome(bpf.BreakerOutcomeOUTCOME_ANSWERED)
)

var outcomeNames = [...]string{
	Established: "established", Refused: "refused", TimedOut: "timed_out",
	Unreachable: "unreachable", Reset: "reset", Stalled: "stalled",
	Abandoned: "abandoned", SYNRetrans: "syn_retransmit", Error: "error",
	ProbeRound: "probe_round", Response: "response", NoResponse: "no_response",
	Answered: "answered",
}

// AnsweredCount is how many successes an Answered record stands for.
func (e *Event) AnsweredCount() uint64 { return uint64(e.Duration) }

// String returns the outcome's metric label (refused, timed_out, …).
func (o Outcome) String() string {
	if int(o) < len(outcomeNames) && outcomeNames[o] != "" {
		return outcomeNames[o]
	}
	return fmt.Sprintf("outcome(%d)", uint8(o))
}

// Event is one outcome record from the kernel.
type Event struct {
	// Dest is the connection's destination.
	Dest Dest
	// Outcome is what happened.
	Outcome Outcome
	// Probe is set when the socket was admitted as a half-open probe.
	Probe bool
	// NoAge is set when Duration is unknown (0): a reset of a socket the
	// kernel kept no start time for. Its established record (same Cookie)
	// dates it.
	NoAge bool
	// HTTP is set on a Response whose HTTP/1.x status line was read:
	// Status holds it.
	HTTP bool
	// Status is a Response's HTTP status (with HTTP).
	Status uint16
	// PeerClosed is set on a NoResponse when the peer closed or reset the
	// connection (not the application giving up).
	PeerClosed bool
	// Round is the half-open round of a probe or of a ProbeRound record.
	Round uint32
	// Count is the number of RTOs (stalled, syn_retransmit).
	Count uint32
	// Err is the socket's error when it failed.
	Err syscall.Errno
	// Duration is the handshake time (established), the time since connect
	// (failures, abandoned) or the connection's age (reset, stalled; 0
	// when the kernel kept no start time for the socket, see NoAge).
	Duration time.Duration
	// Cookie is the socket cookie; CgroupID the cgroup of the process that
	// connected.
	Cookie, CgroupID uint64
	// Time is when it happened, on the Now clock (a Response: when its
	// first byte came, so its request left at Time - Duration).
	Time time.Duration
}

// EventSize is the size of one kernel record.
const EventSize = int(unsafe.Sizeof(bpf.BreakerEvent{}))

// ErrShortRecord is returned for a record shorter than EventSize.
var ErrShortRecord = errors.New("short event record")

// The offsets of struct event's fields in a record, from the generated
// bpf.BreakerEvent. DecodeEvent reads the record's bytes in place: a copy
// into the generated type costs 1.2 to 1.4 times the decode (BENCHMARKS.md).
const (
	evDest     = unsafe.Offsetof(bpf.BreakerEvent{}.Dest)
	evAddr     = evDest + unsafe.Offsetof(bpf.BreakerDestKey{}.Addr)
	evPort     = evDest + unsafe.Offsetof(bpf.BreakerDestKey{}.Port)
	evProto    = evDest + unsafe.Offsetof(bpf.BreakerDestKey{}.Proto)
	evClass    = evDest + unsafe.Offsetof(bpf.BreakerDestKey{}.Class)
	evOutcome  = unsafe.Offsetof(bpf.BreakerEvent{}.Outcome)
	evFlags    = unsafe.Offsetof(bpf.BreakerEvent{}.Flags)
	evErr      = unsafe.Offsetof(bpf.BreakerEvent{}.Err)
	evCount    = unsafe.Offsetof(bpf.BreakerEvent{}.Count)
	evRound    = unsafe.Offsetof(bpf.BreakerEvent{}.Round)
	evDuration = unsafe.Offsetof(bpf.BreakerEvent{}.DurationNs)
	evCookie   = unsafe.Offsetof(bpf.BreakerEvent{}.Cookie)
	evCgroup   = unsafe.Offsetof(bpf.BreakerEvent{}.CgroupId)
	evTime     = unsafe.Offsetof(bpf.BreakerEvent{}.TsNs)
)

// DecodeEvent decodes one kernel record (a struct event, little-endian as
// the programs are built) into e without allocating.
func DecodeEvent(b []byte, e *Event) error {
	if len(b) < EventSize {
		return fmt.Errorf("%w: %d bytes", ErrShortRecord, len(b))
	}
	le := binary.LittleEndian
	e.Dest = Dest{
		Proto: Proto(b[evProto]),
		Addr:  netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[evAddr:evAddr+16])).Unmap(), binary.BigEndian.Uint16(b[evPort:evPort+2])),
		Class: b[evClass],
	}
	e.Outcome = Outcome(b[evOutcome])
	flags := b[evFlags]
	e.Probe = flags&uint8(bpf.BreakerEventFlagsEVENT_PROBE) != 0
	e.NoAge = flags&uint8(bpf.BreakerEventFlagsEVENT_NO_AGE) != 0
	e.HTTP = flags&uint8(bpf.BreakerEventFlagsEVENT_HTTP) != 0
	e.PeerClosed = flags&uint8(bpf.BreakerEventFlagsEVENT_PEER_CLOSED) != 0
	e.Err, e.Status = syscall.Errno(le.Uint16(b[evErr:evErr+2])), 0
	if e.Outcome == Response {
		e.Err, e.Status = 0, le.Uint16(b[evErr:evErr+2])
	}
	e.Count = le.Uint32(b[evCount : evCount+4])
	e.Round = le.Uint32(b[evRound : evRound+4])
	e.Duration = time.Duration(le.Uint64(b[evDuration : evDuration+8]))
	e.Cookie = le.Uint64(b[evCookie : evCookie+8])
	e.CgroupID = le.Uint64(b[evCgroup : evCgroup+8])
	e.Time = time.Duration(le.Uint64(b[evTime : evTime+8]))
	return nil
}

// EventReader reads outcome records from the kernel's ring buffer.
//
// ReadBatch waits in Go's network poller, on a duplicate of the ring's
// file descriptor: the waiting goroutine holds no thread. (The ring
// reader's own wait is a blocking epoll_wait system call; a goroutine in a
// system call keeps its scheduler slot until the runtime's monitor thread
// takes it back, and each such retake puts that thread back to waking every
// 20 µs for a while: at every read, a daemon that is idle most of the time
// spent more on those wake-ups than on its records.) Where the poller does
// not take the descriptor, it waits in the ring reader as before.
type EventReader struct {
	rd  *ringbuf.Reader
	rec ringbuf.Record
	// f is the poller's duplicate of the ring's descriptor (nil: not
	// pollable); rc waits on it.
	f  *os.File
	rc syscall.RawConn
	// woken is set by Wake for the next or current wait.
	woken atomic.Bool
	// mu is held by ReadBatch's check of the ring and by Close: the
	// ring's memory is read only while it is mapped.
	mu     sync.Mutex
	closed bool
}

// ErrReaderClosed is returned by Read once the reader is closed.
var ErrReaderClosed = ringbuf.ErrClosed

// NewEventReader opens a reader on the ring buffer. Only one reader
// should consume it at a time.
func (k *Kernel) NewEventReader() (*EventReader, error) {
	rd, err := ringbuf.NewReader(k.objs.Events)
	if err != nil {
		return nil, fmt.Errorf("opening ring buffer: %w", err)
	}
	r := &EventReader{rd: rd}
	if f, rc := pollable(k.objs.Events.FD()); f != nil {
		r.f, r.rc = f, rc
	}
	return r, nil
}

// pollable puts a duplicate of fd in Go's poller, or returns nil.
func pollable(fd int) (*os.File, syscall.RawConn) {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, nil
	}
	if err := unix.SetNonblock(dup, true); err != nil {
		unix.Close(dup)
		return nil, nil
	}
	f := os.NewFile(uintptr(dup), "ringbuf")
	// A file the poller took accepts deadlines.
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		f.Close()
		return nil, nil
	}
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, nil
	}
	return f, rc
}

// Read blocks until a record arrives (or the deadline passes:
// os.ErrDeadlineExceeded) and decodes it into e. After Close it returns
// an error wrapping ErrReaderClosed.
func (r *EventReader) Read(e *Event) error {
	if err := r.rd.ReadInto(&r.rec); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		return fmt.Errorf("reading ring buffer: %w", err)
	}
	return DecodeEvent(r.rec.RawSample, e)
}

// Wake makes a waiting ReadBatch return what the ring holds, if it holds
// anything (healthy records do not wake it themselves); with nothing to
// read it does nothing, so an idle daemon is never woken for nothing. It
// may be called from another goroutine than the reader's, but never after
// or during Close (it reads the ring's memory, which Close unmaps).
func (r *EventReader) Wake() {
	if r.rd.AvailableBytes() == 0 {
		return
	}
	if r.f == nil {
		_ = r.rd.Flush()
		return
	}
	r.woken.Store(true)
	_ = r.f.SetReadDeadline(time.Now())
}

// SetDeadline bounds the next Reads; the zero time removes the bound.
func (r *EventReader) SetDeadline(t time.Time) { r.rd.SetDeadline(t) }

// Close stops the reader; a blocked Read or ReadBatch returns.
func (r *EventReader) Close() error {
	if r.f != nil {
		r.f.Close() // a ReadBatch waiting in the poller returns
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	return r.rd.Close()
}

// ReadBatch waits until a record arrives, until wait has passed (wait ≤ 0:
// no bound), or until Wake, then decodes every record the ring holds
// without waiting again, up to len(evs), in the order the kernel wrote
// them. It returns how many it decoded: 0 and a nil error when it was woken
// or wait passed with nothing to read. Healthy established records do not
// wake a waiting reader (see struct event in bpf/breaker.h): a reader that
// calls ReadBatch in a loop, and Wake every interval, reads them at most an
// interval late, in batches, and every record that needs a prompt answer
// at once, with all that came before it.
func (r *EventReader) ReadBatch(evs []Event, wait time.Duration) (int, error) {
	var deadline time.Time
	if wait > 0 {
		deadline = time.Now().Add(wait)
	}
	if r.f == nil {
		r.rd.SetDeadline(deadline)
		return r.readAll(evs, true)
	}
	if err := r.f.SetReadDeadline(deadline); err != nil {
		return 0, fmt.Errorf("reading ring buffer: %w", ErrReaderClosed)
	}
	// Wait in the poller: the ring's descriptor is readable when the
	// kernel wakes its readers (a record that asks for it), or Wake
	// passes the deadline. The check runs under mu, so never on an
	// unmapped ring.
	err := r.rc.Read(func(uintptr) bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.closed || r.woken.Swap(false) || r.rd.AvailableBytes() > 0
	})
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		return 0, fmt.Errorf("reading ring buffer: %w", ErrReaderClosed)
	}
	r.rd.SetDeadline(time.Now())
	return r.readAll(evs, false)
}

// readAll decodes records into evs until the ring is empty or evs full;
// with block, the first read waits (until the ring reader's deadline).
func (r *EventReader) readAll(evs []Event, block bool) (int, error) {
	n := 0
	for n < len(evs) {
		// (Not AvailableBytes here: a concurrent Close unmaps the ring,
		// and only ReadInto holds the reader's lock.)
		if err := r.rd.ReadInto(&r.rec); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, ringbuf.ErrFlushed) {
				return n, nil
			}
			return n, fmt.Errorf("reading ring buffer: %w", err)
		}
		if err := DecodeEvent(r.rec.RawSample, &evs[n]); err != nil {
			return n, err
		}
		n++
		if n == 1 && block {
			// The rest of the batch: take what is there, never wait.
			r.rd.SetDeadline(time.Now())
		}
	}
	return n, nil
}
