package maps

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/breakerd/breakerd/bpf"
)

// Fallback is where a circuit's rejected connects go instead: while a
// verdict of the circuit's id and Epoch rejects a connect or a send of
// protocol Proto (0: of either), the kernel rewrites its destination to
// Addr, reached with the connect's own protocol, unless
// Addr's own verdict rejects it too (then it is rejected as without a
// fallback).
type Fallback struct {
	Addr  netip.AddrPort
	Proto Proto
	// Epoch is the circuit's verdict epoch (Verdict.Epoch, never 0): an
	// entry counts only for verdicts of the same epoch, so one left by an
	// earlier holder of the id is never followed.
	Epoch uint32
}

// MaxFallbacks is the capacity of the fallbacks map (MAX_FALLBACKS in
// bpf/breaker.h): how many circuits with a fallback can reject at once.
// Past it, a circuit's connects are rejected as without a fallback.
const MaxFallbacks = 1 << 14

// fallbackHooks are the optional hooks PutFallback attaches.
var fallbackHooks = map[string]bool{"getpeername4": true, "getpeername6": true, "recvmsg4": true, "recvmsg6": true}

// PutFallback writes circuit id's fallback. The hooks that show a
// redirected socket's application the address it asked for
// (getpeername4/6, recvmsg4/6) are attached first, so no connect is
// redirected before they run.
func (k *Kernel) PutFallback(id uint32, f Fallback) error {
	if id == 0 || id >= MaxCircuitIDs {
		return fmt.Errorf("fallback of circuit id %d: not in 1..%d", id, MaxCircuitIDs-1)
	}
	if f.Epoch == 0 {
		return fmt.Errorf("fallback of circuit id %d: epoch 0 matches no verdict", id)
	}
	for _, h := range hooks {
		if fallbackHooks[h.name] {
			if err := k.ensureHook(h.name); err != nil {
				return fmt.Errorf("attaching the fallback's hooks: %w", err)
			}
		}
	}
	v := bpf.BreakerFallback{
		Addr:  netip.AddrFrom16(f.Addr.Addr().As16()).As16(),
		Port:  htons(f.Addr.Port()),
		Proto: uint8(f.Proto),
		Epoch: f.Epoch,
	}
	if err := k.objs.Fallbacks.Put(id, &v); err != nil {
		return fmt.Errorf("writing the fallback of circuit id %d: %w", id, err)
	}
	return nil
}

// DeleteFallback removes circuit id's fallback (none is fine).
func (k *Kernel) DeleteFallback(id uint32) error {
	if err := k.objs.Fallbacks.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("deleting the fallback of circuit id %d: %w", id, err)
	}
	return nil
}

// FallbackOf reads circuit id's fallback; ok is false without one.
func (k *Kernel) FallbackOf(id uint32) (f Fallback, ok bool, err error) {
	var v bpf.BreakerFallback
	if err := k.objs.Fallbacks.Lookup(id, &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return Fallback{}, false, nil
		}
		return Fallback{}, false, fmt.Errorf("reading the fallback of circuit id %d: %w", id, err)
	}
	return Fallback{
		Addr:  netip.AddrPortFrom(netip.AddrFrom16(v.Addr).Unmap(), ntohs(v.Port)),
		Proto: Proto(v.Proto),
		Epoch: v.Epoch,
	}, true, nil
}

// FallbackIDs lists the circuit ids with a fallback.
func (k *Kernel) FallbackIDs() ([]uint32, error) {
	var ids []uint32
	var id uint32
	it := k.objs.Fallbacks.Iterate()
	var v bpf.BreakerFallback
	for it.Next(&id, &v) {
		ids = append(ids, id)
	}
	if err := it.Err(); err != nil {
		return ids, fmt.Errorf("listing fallbacks: %w", err)
	}
	return ids, nil
}
