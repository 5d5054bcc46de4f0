package engine

import "time"

// recentConns dates the resets of sockets the kernel kept no start time
// for (maps.Event.NoAge): healthy connections carry no per-socket state in
// the kernel, so their reset record cannot say how old the connection was.
// Each established record is remembered here by socket cookie with its
// kernel time; a reset record finds its connection's age from it.
//
// It is a fixed table of 2-way sets (no allocation, no pointers for the GC
// to scan, a few nanoseconds per record): a new entry takes the older slot
// of its set. An entry lost that way, or older than the longest
// reset_failure_window, dates nothing, and a reset it cannot date is not
// counted (the fail-open direction: a reset that would have counted is
// missed, never the reverse). At 2^16 sets the table holds some 130,000
// connections; at 10,000 new connections a second and a 5 s window (50,000
// live entries) few are lost. Used by the engine's goroutine.
type recentConns struct {
	sets []recentSet
}

type recentSet [2]struct {
	cookie uint64
	at     time.Duration // the established record's kernel time (maps.Now clock)
}

const recentSets = 1 << 16

func (r *recentConns) add(cookie uint64, at time.Duration) {
	if r.sets == nil {
		r.sets = make([]recentSet, recentSets)
	}
	s := &r.sets[recentIndex(cookie)]
	i := 0
	if s[1].at < s[0].at {
		i = 1
	}
	s[i].cookie, s[i].at = cookie, at
}

// established returns when the connection with this cookie was
// established, if it is still remembered.
func (r *recentConns) established(cookie uint64) (time.Duration, bool) {
	if r.sets == nil || cookie == 0 {
		return 0, false
	}
	s := &r.sets[recentIndex(cookie)]
	for i := range s {
		if s[i].cookie == cookie {
			return s[i].at, true
		}
	}
	return 0, false
}

// peek loads the set of cookie (see Engine.warm).
func (r *recentConns) peek(cookie uint64) uint8 {
	if r.sets == nil {
		return 0
	}
	return uint8(r.sets[recentIndex(cookie)][0].at)
}

// recentIndex is the set of a cookie: its low bits. The kernel hands out
// socket cookies from one counter, so records close in time fall in
// neighbouring sets (few cache lines, in order), and a set is reused only
// after 2^16 newer sockets.
func recentIndex(cookie uint64) uint64 {
	return cookie & (recentSets - 1)
}
