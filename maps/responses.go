package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/breakerd/breakerd/bpf"
)

// MaxInflight is the inflight map's capacity: sockets of destinations
// with response_timeout that sent a request. A socket past it is still
// timed turn by turn, but its response_timeout counts only when its
// response (or the connection's end) comes.
const MaxInflight = 1 << 16

// ResponseFlags say what the response programs do for a destination's
// sockets (Limit.Responses).
type ResponseFlags uint16

// The response flags, as in bpf/breaker.h.
const (
	// RespTimed times each request/response turn.
	RespTimed = ResponseFlags(bpf.BreakerResponseFlagsRESP_TIMED)
	// RespHTTP reads the HTTP/1.x status line at the start of each response.
	RespHTTP = ResponseFlags(bpf.BreakerResponseFlagsRESP_HTTP)
	// RespInflight keeps the socket's awaiting turn in the inflight map,
	// for the daemon's response_timeout.
	RespInflight = ResponseFlags(bpf.BreakerResponseFlagsRESP_INFLIGHT)
	// RespBatch counts an ordinary success (not a probe's, not a 5xx or
	// a 429, faster than Limit.FastBound) in the answered word of
	// Limit.BatchID instead of writing its record; see Answered.
	RespBatch = ResponseFlags(bpf.BreakerResponseFlagsRESP_BATCH)
)

// AnsweredIDs is the answered map's size: only circuits with an id below
// it can have their successes counted in the kernel (RespBatch).
const AnsweredIDs = 1 << 16

// AnsweredEpochs bounds an answered word's epoch: 1 .. AnsweredEpochs-1.
const AnsweredEpochs = 1 << (64 - answeredShift)

// answeredShift is the answered word's count bits, below its epoch.
const answeredShift = 40

// answeredFlushIDs is how many ids one run of answered_flush takes, and
// answeredFlushHeader how many bytes its data carries before them (an
// Ethernet header's, which BPF_PROG_TEST_RUN requires of a tc program).
const (
	answeredFlushIDs    = 64
	answeredFlushHeader = 14
)

// Answered reads circuit id's answered word: the epoch it counts under and
// the successes counted and not yet written out. It reads the kernel's
// memory directly (the map is memory-mapped): no system call.
func (k *Kernel) Answered(id uint32) (epoch uint32, count uint64, err error) {
	if id >= AnsweredIDs {
		return 0, 0, fmt.Errorf("circuit id %d is not below %d", id, AnsweredIDs)
	}
	mem, err := k.answeredMemory()
	if err != nil {
		return 0, 0, err
	}
	var b [8]byte
	if _, err := mem.ReadAt(b[:], int64(id)*8); err != nil {
		return 0, 0, fmt.Errorf("reading the answered word of circuit id %d: %w", id, err)
	}
	w := binary.LittleEndian.Uint64(b[:])
	return uint32(w >> answeredShift), w & (1<<answeredShift - 1), nil
}

func (k *Kernel) answeredMemory() (*ebpf.Memory, error) {
	k.answeredOnce.Do(func() {
		k.answeredMem, k.answeredErr = k.objs.Answered.Memory()
		if k.answeredErr != nil {
			k.answeredErr = fmt.Errorf("mapping the answered map: %w", k.answeredErr)
		}
	})
	return k.answeredMem, k.answeredErr
}

// SetAnswered gives circuit id's answered word a new epoch (1 ..
// AnsweredEpochs-1) and a count of 0. Sockets marked with another epoch
// write a record for each success from then on; what the word held is
// dropped. Write it before any limits entry names the epoch.
func (k *Kernel) SetAnswered(id, epoch uint32) error {
	if id >= AnsweredIDs {
		return fmt.Errorf("circuit id %d is not below %d", id, AnsweredIDs)
	}
	if epoch == 0 || epoch >= AnsweredEpochs {
		return fmt.Errorf("answered epoch %d is not in 1..%d", epoch, AnsweredEpochs-1)
	}
	if err := k.objs.Answered.Put(id, uint64(epoch)<<answeredShift); err != nil {
		return fmt.Errorf("writing the answered word of circuit id %d: %w", id, err)
	}
	return nil
}

// FlushAnswered has the kernel write out the successes counted for each of
// ids, as one Answered record each, into the ring (after every record
// already there, so the daemon reads them in their order). It runs the
// answered_flush program once per 64 ids.
func (k *Kernel) FlushAnswered(ids []uint32) error {
	for len(ids) > 0 {
		n := min(len(ids), answeredFlushIDs)
		data := make([]byte, answeredFlushHeader+4*n)
		for i, id := range ids[:n] {
			binary.LittleEndian.PutUint32(data[answeredFlushHeader+4*i:], id)
		}
		if _, err := k.objs.AnsweredFlush.Run(&ebpf.RunOptions{Data: data}); err != nil {
			return fmt.Errorf("writing out counted successes: %w", err)
		}
		ids = ids[n:]
	}
	return nil
}

// SetResponses attaches (on) or detaches the response programs, the
// cgroup_skb ingress and egress hooks that follow request/response turns.
// They run for every packet of the cgroup, so they are attached only while
// some target has response options. Detaching removes their pinned links.
func (k *Kernel) SetResponses(on bool) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.responses == on {
		return nil
	}
	k.responses = on
	if k.cgroup == "" {
		return nil
	}
	var errs []error
	for _, h := range hooks {
		if !h.responses {
			continue
		}
		pin := filepath.Join(k.dir, "link_"+h.name)
		if !on {
			if l := k.links[h.name]; l != nil {
				errs = append(errs, l.Unpin(), l.Close())
				delete(k.links, h.name)
			}
			errs = append(errs, detachPinned(pin))
			continue
		}
		l, err := attachLink(k.cgroup, h, h.prog(&k.objs))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := pinReplacing(l, pin); err != nil {
			l.Close()
			errs = append(errs, fmt.Errorf("pinning %s: %w", h.name, err))
			continue
		}
		k.links[h.name] = l
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("response programs: %w", err)
	}
	k.log.Info("response programs", "attached", on)
	return nil
}

// Responses reports whether the response programs are wanted.
func (k *Kernel) Responses() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.responses
}

// detachPinned detaches the link pinned at pin, if any, and removes the pin.
func detachPinned(pin string) error {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer l.Close()
	if err := l.Detach(); err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
		return fmt.Errorf("detaching %s: %w", pin, err)
	}
	if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing %s: %w", pin, err)
	}
	return nil
}

// Awaiting is one request that awaits its first response byte, as the
// inflight map holds it.
type Awaiting struct {
	// Cookie is the socket's cookie.
	Cookie uint64
	// Dest is the connection's destination.
	Dest Dest
	// Turn is the turn's number on its socket.
	Turn uint32
	// Probe is set when the turn is a half-open probe's first (its
	// result); Round is then the round that admitted the probe.
	Probe bool
	Round uint32
	// Since is when the request's first byte left, on the Now clock; 0
	// while no request of the socket awaits its answer.
	Since time.Duration
	// CgroupID is the cgroup the socket was made in.
	CgroupID uint64
}

// Awaiting appends to out every entry of the inflight map, read in
// batches: one per socket with response_timeout that has sent a request and
// is not closed yet, with the request that awaits its first response byte
// (Since 0: none awaits).
func (v *View) Awaiting(out []Awaiting) ([]Awaiting, error) {
	if v.inflight == nil {
		return out, nil
	}
	keys := make([]uint64, batchSize)
	vals := make([]bpf.BreakerInflightTurn, batchSize)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := v.inflight.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			v := &vals[i]
			out = append(out, Awaiting{Cookie: keys[i], Dest: DestFromKey(&v.Dest), Turn: v.Turn,
				Probe: v.Flags&uint32(bpf.BreakerInflightFlagsINFLIGHT_PROBE) != 0, Round: v.Round,
				Since: time.Duration(v.ReqNs), CgroupID: v.CgroupId})
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if err != nil {
			return out, fmt.Errorf("reading in-flight requests: %w", err)
		}
	}
}
