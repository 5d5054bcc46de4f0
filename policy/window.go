package policy

import "time"

// window is a circuit's sliding window of calls, count-based (the last n
// calls, a ring) or time-based (the last d, in WindowBuckets buckets). Both
// use constant memory and keep running totals, so recording and reading are
// O(1) (O(WindowBuckets) to age a time-based window).
//
// A count-based window keeps its calls as a ring of two bits each
// (callFailed | callSlow), 32 calls a word: up to 32 calls (the default is
// 20) in bits, inside the window, so the default circuit needs no second
// allocation and a record no second cache line; a larger ring, and a
// time-based window's buckets, are in ext.
type window struct {
	bits uint64
	ext  *windowExt

	size, pos             int32 // count-based: calls the ring holds, next slot
	calls, failures, slow int32
	full                  bool
}

// windowExt is the part of a window the default one does not need.
type windowExt struct {
	ring []uint64 // count-based windows of more than 32 calls
	// Time-based windows (width > 0).
	width   time.Duration
	base    stamp
	aged    int64 // the epoch the buckets were last aged at
	buckets [WindowBuckets]bucket
}

func (w *window) timed() bool { return w.ext != nil && w.ext.width > 0 }

func (w *window) word(i int32) *uint64 {
	if w.ext == nil {
		return &w.bits
	}
	return &w.ext.ring[i/32]
}

func (w *window) slot(i int32) uint8 { return uint8(*w.word(i)>>(2*(i%32))) & 3 }

func (w *window) setSlot(i int32, bits uint8) {
	sh := 2 * uint(i%32)
	p := w.word(i)
	*p = *p&^(3<<sh) | uint64(bits)<<sh
}

const (
	callFailed = 1 << 0
	callSlow   = 1 << 1
)

type bucket struct {
	epoch                 int64
	calls, failures, slow int32
}

func newWindow(o *Options, now time.Time) window {
	if o.WindowDuration > 0 {
		return window{ext: &windowExt{width: o.WindowDuration / WindowBuckets, base: stampOf(now)}}
	}
	w := window{size: int32(o.WindowSize)}
	if o.WindowSize > 32 {
		w.ext = &windowExt{ring: make([]uint64, (o.WindowSize+31)/32)}
	}
	return w
}

func (w *window) record(now time.Time, failed, slow bool) {
	var bits uint8
	if failed {
		bits |= callFailed
	}
	if slow {
		bits |= callSlow
	}
	if !w.timed() {
		if w.full {
			w.drop(w.slot(w.pos))
		}
		w.setSlot(w.pos, bits)
		w.pos++
		if w.pos == w.size {
			w.pos, w.full = 0, true
		}
		w.add(bits)
		return
	}
	epoch := w.age(now)
	b := &w.ext.buckets[epoch%WindowBuckets]
	b.epoch = epoch
	b.calls++
	if failed {
		b.failures++
	}
	if slow {
		b.slow++
	}
	w.add(bits)
}

// recordN records n calls alike: the last ones a count-based window
// holds (after its size, more only turn the ring), all at once in a
// time-based window's bucket.
func (w *window) recordN(now time.Time, failed, slow bool, n int) {
	if w.timed() {
		w.addN(now, failed, slow, n)
		return
	}
	if w.size == 0 {
		return
	}
	for range min(n, int(w.size)) {
		w.record(now, failed, slow)
	}
	if rest := n - int(w.size); rest > 0 {
		w.pos = int32((int(w.pos) + rest) % int(w.size))
	}
}

// addN adds n calls alike to now's bucket of a time-based window.
func (w *window) addN(now time.Time, failed, slow bool, n int) {
	epoch := w.age(now)
	b := &w.ext.buckets[epoch%WindowBuckets]
	b.epoch = epoch
	k := int32(n)
	b.calls += k
	w.calls += k
	if failed {
		b.failures += k
		w.failures += k
	}
	if slow {
		b.slow += k
		w.slow += k
	}
}

func (w *window) add(bits uint8) {
	w.calls++
	if bits&callFailed != 0 {
		w.failures++
	}
	if bits&callSlow != 0 {
		w.slow++
	}
}

func (w *window) drop(bits uint8) {
	w.calls--
	if bits&callFailed != 0 {
		w.failures--
	}
	if bits&callSlow != 0 {
		w.slow--
	}
}

// age expires the buckets older than the window and returns now's epoch.
func (w *window) age(now time.Time) int64 {
	tw := w.ext
	epoch := int64(now.Sub(tw.base.time()) / tw.width)
	if epoch < 0 {
		epoch = 0
	}
	if epoch == tw.aged {
		return epoch
	}
	tw.aged = epoch
	for i := range tw.buckets {
		b := &tw.buckets[i]
		// Bucket i holds one epoch ≡ i (mod WindowBuckets); it has aged out
		// once it is a whole window behind, which is also the case for the
		// bucket about to be reused for now's epoch.
		if b.calls != 0 && b.epoch <= epoch-WindowBuckets {
			w.calls -= b.calls
			w.failures -= b.failures
			w.slow -= b.slow
			*b = bucket{}
		}
	}
	return epoch
}

// counts returns the calls, failures and slow calls in the window at now.
func (w *window) counts(now time.Time) (calls, failures, slow int) {
	if w.timed() {
		w.age(now)
	}
	return int(w.calls), int(w.failures), int(w.slow)
}

func (w *window) reset(now time.Time) {
	w.bits, w.pos, w.full = 0, 0, false
	if w.ext != nil {
		clear(w.ext.ring)
		if w.timed() {
			w.ext.buckets = [WindowBuckets]bucket{}
			w.ext.base, w.ext.aged = stampOf(now), 0
		}
	}
	w.calls, w.failures, w.slow = 0, 0, 0
}
