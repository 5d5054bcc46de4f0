package engine

import (
	"net/netip"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// syncFallback makes the kernel's fallbacks map hold c's fallback while c
// rejects (rejects) and none otherwise: the entry carries c's epoch, which
// its verdicts carry, so an entry of an earlier holder of c's id is never
// followed. The map is written only when what it holds for c's id changes
// (e.fallbacks), so a circuit's many destinations cost one write. A failed
// write is logged: the kernel then rejects as without a fallback.
func (e *Engine) syncFallback(c *Circuit, rejects bool) {
	if c.ID == 0 {
		return
	}
	o := c.Machine.Options()
	have, had := e.fallbacks[c.ID]
	addr := e.fallbackAddr(o)
	if rejects && addr.IsValid() {
		// Proto 0: the fallback takes the circuit's connects of either
		// protocol, reached with their own (a target of protocol any).
		want := maps.Fallback{Addr: addr, Epoch: e.EpochOf(c)}
		if had && have == want {
			return
		}
		if err := e.k.PutFallback(c.ID, want); err != nil {
			delete(e.fallbacks, c.ID)
			e.ErrorEverySecond("fallback", "writing fallback (the circuit's connects are rejected until it is written)", "circuit", c.Name(), "fallback", addr, "err", err)
			return
		}
		e.fallbacks[c.ID] = want
		return
	}
	if !had {
		return
	}
	if err := e.k.DeleteFallback(c.ID); err != nil {
		e.ErrorEverySecond("fallback", "deleting fallback", "circuit", c.Name(), "err", err)
		return
	}
	delete(e.fallbacks, c.ID)
}

// fallbackAddr is where o's fallback is now: its address, or what its
// Service resolved to (none while it has not).
func (e *Engine) fallbackAddr(o *policy.Options) netip.AddrPort {
	if o.Fallback.IsValid() {
		return o.Fallback
	}
	if o.FallbackService.Service != "" {
		return e.matching.Fallbacks[o.FallbackService]
	}
	return netip.AddrPort{}
}

// SyncFallback writes or removes c's fallback as its options and state
// say: after a reload changed its options, or its Service fallback
// resolved anew.
func (e *Engine) SyncFallback(c *Circuit) { e.syncFallback(c, c.Machine.State().Rejects()) }

// SyncFallbacks makes the kernel's fallbacks map hold exactly the
// fallbacks of the rejecting circuits, at start-up once the pinned
// circuits are adopted: an entry a previous daemon left for a circuit that
// now has none, or no longer rejects, or for an id no circuit holds, goes.
func (e *Engine) SyncFallbacks() {
	pinned, err := e.k.FallbackIDs()
	if err != nil {
		e.log.Warn("listing pinned fallbacks", "err", err)
	}
	for _, id := range pinned {
		if _, ok := e.fallbacks[id]; !ok {
			// Unknown to this engine: written by another daemon. Deleted
			// now unless a circuit below writes it again.
			e.fallbacks[id] = maps.Fallback{}
		}
	}
	for c := range e.reg.All() {
		e.SyncFallback(c)
	}
	for id, f := range e.fallbacks {
		if f == (maps.Fallback{}) {
			if err := e.k.DeleteFallback(id); err != nil {
				e.log.Warn("deleting a stale fallback", "circuit_id", id, "err", err)
				continue
			}
			delete(e.fallbacks, id)
		}
	}
}
