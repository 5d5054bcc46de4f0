package engine

import (
	"math/rand/v2"
	"time"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// batch is what the kernel was told about a circuit whose ordinary
// successes it counts in the circuit's answered word (maps.RespBatch)
// instead of writing a record for each: the word's epoch, and the bound
// it was written with. prev is the epoch before (0: none), whose records
// still in the ring are the circuit's too; off says the circuit counts
// under no epoch now (its options changed so, while it lives on).
type batch struct {
	id, epoch, prev uint32
	fast            time.Duration
	off             bool
}

// batchable says whether the kernel may count c's ordinary successes, and
// the response time from which one is recorded instead (0: none is): c
// follows responses, has a circuit id the answered map holds, and its
// failure statuses are among those the kernel records anyway (5xx, 429).
func batchable(c *Circuit, o *policy.Options) (time.Duration, bool) {
	r := &o.Responses
	if !r.Followed() || c.ID == 0 || o.AdaptiveConnections.On() || o.AdaptiveConnecting.On() || c.ID >= maps.AnsweredIDs || (r.HTTP && !r.FailureStatuses.OnlyServerErrorsAnd429()) {
		return 0, false
	}
	fast := r.SlowResponseDuration
	if t := r.ResponseTimeout; t > 0 && (fast == 0 || t < fast) {
		fast = t
	}
	return fast, true
}

// batchOf returns c's batch, giving its answered word a new epoch first
// when c had none or had it under other options: a socket marked under
// other options (or for the id's former holder) then records every
// response, as without batching, and what was counted under the old
// epoch is written out first and still credited to c. false: c's
// successes are recorded one by one. The caller writes the limits entries
// after it.
func (e *Engine) batchOf(c *Circuit, o *policy.Options) (batch, bool) {
	fast, ok := batchable(c, o)
	b, had := e.batched[c]
	if had && !b.off && ok && b.id == c.ID && b.fast == fast {
		return b, true
	}
	if !ok {
		if had && !b.off {
			e.retireBatch(c)
		}
		return batch{}, false
	}
	var prev uint32
	if had && b.id == c.ID {
		if !b.off {
			e.retireBatch(c)
		}
		prev = e.batched[c].prev
	} else if had {
		e.unbatch(c)
	}
	epoch, err := e.nextAnsweredEpoch(c.ID)
	if err != nil {
		e.ErrorEverySecond("answered", "counting successes in the kernel (each response is recorded instead)", "circuit", c.Name(), "err", err)
		return batch{}, false
	}
	b = batch{id: c.ID, epoch: epoch, prev: prev, fast: fast}
	e.batched[c] = b
	e.batchedIDs[c.ID] = c
	return b, true
}

// retireBatch stops counting c's successes under its current epoch, c
// living on (its options changed): the count is written out first (into
// the ring, after every record before it) and the word gets a new epoch
// no limits entry names; records of the old epoch are still credited to
// c (prev).
func (e *Engine) retireBatch(c *Circuit) {
	b := e.batched[c]
	if err := e.k.FlushAnswered([]uint32{b.id}); err != nil {
		e.ErrorEverySecond("answered", "writing out a circuit's counted successes before its options change (they are dropped)", "circuit", c.Name(), "err", err)
	}
	if _, err := e.nextAnsweredEpoch(b.id); err != nil {
		e.ErrorEverySecond("answered", "retiring a circuit's counted successes", "circuit", c.Name(), "err", err)
	}
	e.batched[c] = batch{id: b.id, prev: b.epoch, off: true}
}

// RetirePinnedBatches gives a new epoch to every answered word a pinned
// limits entry names, at start-up, before any limits entry is written:
// sockets a previous daemon marked then record each response, whether or
// not this daemon counts their circuit's successes (it may not, its
// options having changed), and what they counted is dropped, as no turn
// begun before a start counts.
func (e *Engine) RetirePinnedBatches(limits map[maps.Dest]maps.Limit) {
	done := map[uint32]bool{}
	for _, l := range limits {
		if l.Responses&maps.RespBatch == 0 || done[l.BatchID] || l.BatchID >= maps.AnsweredIDs {
			continue
		}
		done[l.BatchID] = true
		if _, err := e.nextAnsweredEpoch(l.BatchID); err != nil {
			e.log.Error("retiring a previous daemon's counted successes (its sockets may go on counting them unread)", "circuit_id", l.BatchID, "err", err)
		}
	}
}

// nextAnsweredEpoch writes id's answered word anew under the epoch after
// its current one, and returns it. A word never written (epoch 0: a map
// made anew, perhaps beside sockets marked under the one it replaced)
// starts at a random epoch, which such a socket is unlikely to carry.
func (e *Engine) nextAnsweredEpoch(id uint32) (uint32, error) {
	cur, _, err := e.k.Answered(id)
	if err != nil {
		return 0, err
	}
	next := cur + 1
	if cur == 0 {
		next = 1 + rand.Uint32N(maps.AnsweredEpochs-1)
	}
	if next >= maps.AnsweredEpochs {
		next = 1
	}
	if err := e.k.SetAnswered(id, next); err != nil {
		return 0, err
	}
	return next, nil
}

// unbatch forgets c's batch, c going (dropped, or giving its id back):
// the word gets a new epoch no limits entry names if c still holds it, so
// c's sockets add nothing more, and what it held is dropped with c.
func (e *Engine) unbatch(c *Circuit) {
	b, ok := e.batched[c]
	if !ok {
		return
	}
	delete(e.batched, c)
	if e.batchedIDs[b.id] != c {
		return // the id is another circuit's now: its word is not c's
	}
	delete(e.batchedIDs, b.id)
	if _, err := e.nextAnsweredEpoch(b.id); err != nil {
		e.ErrorEverySecond("answered", "retiring a circuit's counted successes", "circuit", c.Name(), "err", err)
	}
}

// unbatchAll retires every batch: the response programs were attached
// again, and sockets marked before may carry stale turns, whose successes
// must not count (respSince). The next limits writes give new epochs.
func (e *Engine) unbatchAll() {
	for c := range e.batched {
		e.unbatch(c)
	}
}

// creditAnswered feeds an Answered record's successes to their circuit,
// in the record's place among the circuit's other records. A record of an
// epoch that is not the circuit's (current or previous: a daemon before
// this one, or the id's former holder), or of a circuit that no longer
// follows responses, is dropped, as a stale turn's record is.
func (e *Engine) creditAnswered(ev *maps.Event, now time.Time) {
	c := e.batchedIDs[ev.Round]
	if c == nil || !c.Machine.Options().Responses.Followed() {
		return
	}
	if b := e.batched[c]; ev.Count == 0 || (ev.Count != b.prev && (b.off || ev.Count != b.epoch)) {
		return
	}
	n := ev.AnsweredCount()
	c.Metrics.Response(policy.ResponseAnswered).Add(float64(n))
	r := policy.Result{Kind: policy.Answered}
	e.record(c, r, policy.Classify(c.Machine.Options(), r), int(n), now)
}

// Unflushed returns the ids of the batched circuits whose answered
// words hold successes (read from the mapped map, no system call for the
// others): the daemon has the kernel write them out (Kernel.FlushAnswered)
// outside the engine's steps every tick, so a circuit that went quiet has them
// read within a tick, after its earlier records.
func (e *Engine) Unflushed() []uint32 {
	var ids []uint32
	for id, c := range e.batchedIDs {
		if e.batched[c].off {
			continue
		}
		if _, n, err := e.k.Answered(id); err == nil && n > 0 {
			ids = append(ids, id)
		}
	}
	return ids
}

// Counting is the number of circuits whose ordinary successes the kernel
// counts now.
func (e *Engine) Counting() int {
	n := 0
	for _, b := range e.batched {
		if !b.off {
			n++
		}
	}
	return n
}
