package policy

import "time"

// window is a circuit's sliding window of calls, count-based (the last n
// calls, a ring) or time-based (the last d, in WindowBuckets buckets). Both
// use constant memory and keep running totals, so recording and reading are
// O(1) (O(WindowBuckets) to age a time-based window).
type window struct {
	// count-based
	ring []uint8 // callFailed | callSlow per slot
	pos  int
	full bool
	// time-based
	width   time.Duration
	base    time.Time
	aged    int64                  // the epoch the buckets were last aged at
	buckets *[WindowBuckets]bucket // time-based windows only

	calls, failures, slow int
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
		return window{width: o.WindowDuration / WindowBuckets, base: now, buckets: new([WindowBuckets]bucket)}
	}
	return window{ring: make([]uint8, o.WindowSize)}
}

func (w *window) record(now time.Time, failed, slow bool) {
	var bits uint8
	if failed {
		bits |= callFailed
	}
	if slow {
		bits |= callSlow
	}
	if w.width == 0 {
		if w.full {
			w.drop(w.ring[w.pos])
		}
		w.ring[w.pos] = bits
		w.pos++
		if w.pos == len(w.ring) {
			w.pos, w.full = 0, true
		}
		w.add(bits)
		return
	}
	epoch := w.age(now)
	b := &w.buckets[epoch%WindowBuckets]
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
	epoch := int64(now.Sub(w.base) / w.width)
	if epoch < 0 {
		epoch = 0
	}
	if epoch == w.aged {
		return epoch
	}
	w.aged = epoch
	for i := range w.buckets {
		b := &w.buckets[i]
		// Bucket i holds one epoch ≡ i (mod WindowBuckets); it has aged out
		// once it is a whole window behind, which is also the case for the
		// bucket about to be reused for now's epoch.
		if b.calls != 0 && b.epoch <= epoch-WindowBuckets {
			w.calls -= int(b.calls)
			w.failures -= int(b.failures)
			w.slow -= int(b.slow)
			*b = bucket{}
		}
	}
	return epoch
}

// counts returns the calls, failures and slow calls in the window at now.
func (w *window) counts(now time.Time) (calls, failures, slow int) {
	if w.width != 0 {
		w.age(now)
	}
	return w.calls, w.failures, w.slow
}

func (w *window) reset(now time.Time) {
	clear(w.ring)
	w.pos, w.full = 0, false
	if w.buckets != nil {
		*w.buckets = [WindowBuckets]bucket{}
	}
	w.base, w.aged = now, 0
	w.calls, w.failures, w.slow = 0, 0, 0
}
