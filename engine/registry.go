package engine

import (
	"errors"
	"fmt"
	"iter"
	"math/rand/v2"
	"strings"

	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

// registry holds every circuit: dynamic ones by destination only, named
// ones also by name. It is the engine's own: the daemon reaches it only
// through the Engine's methods.
//
// Besides the indexes by name and destination it keeps the few circuits
// periodic work visits, so that this work does not grow with the number of
// closed circuits: active (open, half-open or forced open: the tick and
// the reconciliation after lost records), endpoints (the departed-endpoint
// sweep), and the idle list, the closed dynamic circuits in the order they
// were queued, from whose front eviction takes its victim (second chance,
// see Victim).
type registry struct {
	byName    map[string]*Circuit // named circuits only: use Get and All
	byDest    DestIndex[Circuit]  // use At to look up
	active    map[*Circuit]struct{}
	endpoints map[*Circuit]struct{}
	idle      idleList
	groups    map[string]*policy.Group // endpoint groups, by target@workload
	ids       *IDs
	classes   *policy.Classes // the workloads' classes, for the names of isolated workloads' circuits
	version   uint64          // counts the changes of byDest and byName
	dynamic   int
	// adopting is set while start-up rebuilds the circuits of the pinned
	// verdicts: max_circuits does not refuse those (an open verdict is
	// never dropped for want of room; eviction brings the count back).
	adopting bool
	// recording holds the circuits that have an epoch, by id (only the
	// circuits that ever wrote a rejecting verdict or a limit), and the
	// circuits of the sharing workloads' bulkhead slots, by slot id.
	recording map[uint32]*Circuit
	nextEpoch uint32
}

// newRegistry returns an empty registry whose ids (limit of them, see
// NewIDs) read their bulkhead counts from k.
func newRegistry(k Kernel, limit uint32) *registry {
	return &registry{byName: map[string]*Circuit{}, groups: map[string]*policy.Group{},
		active: map[*Circuit]struct{}{}, endpoints: map[*Circuit]struct{}{}, ids: NewIDs(k, limit), recording: map[uint32]*Circuit{}}
}

// Get returns the circuit named name.
func (r *registry) Get(name string) (*Circuit, bool) {
	if c, ok := r.byName[name]; ok {
		return c, true
	}
	// A dynamic circuit: its destination's name, and @workload for an
	// isolated workload's (see Classed).
	base, class := name, policy.Class(0)
	if i := strings.LastIndexByte(name, '@'); i >= 0 && r.classes != nil {
		w := name[i+1:]
		class = r.classes.Of(w)
		if class == 0 || r.classes.Name(class) != w {
			return nil, false
		}
		base = name[:i]
	}
	if dst, ok := ParseDynamicName(base); ok {
		dst.Class = uint8(class)
		if c, ok := r.At(dst); ok && !c.IsNamed() {
			return c, true
		}
	}
	return nil, false
}

// All yields every circuit once, in no order.
func (r *registry) All() iter.Seq[*Circuit] {
	return func(yield func(*Circuit) bool) {
		for _, c := range r.byName {
			if !yield(c) {
				return
			}
		}
		for _, c := range r.byDest.All() {
			if !c.IsNamed() && !yield(c) {
				return
			}
		}
	}
}

// Count is the number of circuits.
func (r *registry) Count() int { return len(r.byName) + r.dynamic }

// At returns the circuit of destination dst.
func (r *registry) At(dst maps.Dest) (*Circuit, bool) {
	c := r.byDest.Get(dst.Compact())
	return c, c != nil
}

// Attach indexes dst as a destination of c (named circuits keep any
// number; a dynamic one has its first only).
func (r *registry) Attach(c *Circuit, dst maps.Dest) {
	c.addDest(dst)
	r.byDest.Put(dst.Compact(), c)
	r.version++
}

// Detach removes dst from the index (the circuit's own list is the
// caller's: Circuit.RemoveDest).
func (r *registry) Detach(dst maps.Dest) {
	r.byDest.Del(dst.Compact())
	r.version++
}

// Track files c under the sets its state puts it in; call it whenever c's
// state may have changed.
func (r *registry) Track(c *Circuit) {
	s := c.Machine.State()
	if s.Rejects() {
		r.active[c] = struct{}{}
	} else {
		delete(r.active, c)
	}
	if c.Target() == AllTarget && s == policy.Closed {
		if c.inIdle {
			c.referenced = true
		} else {
			r.idle.touch(c)
		}
	} else {
		r.idle.remove(c)
	}
}

// Untrack removes c from every set (it is being dropped).
func (r *registry) Untrack(c *Circuit) {
	delete(r.active, c)
	delete(r.endpoints, c)
	r.idle.remove(c)
}

// Victim returns the least recently active closed dynamic circuit, in
// amortized O(1), by second chance (the CLOCK algorithm): the idle list
// is in the order circuits were queued; a circuit that recorded a call
// since (referenced) is queued again at the back instead of chosen, so a
// record costs one flag, not a move in the list that touches two other
// circuits' memory. Every circuit passed over loses its flag, so the loop
// ends within one pass. nil: there is none.
func (r *registry) Victim() *Circuit {
	l := &r.idle
	victim := l.head
	for victim != nil && victim.referenced {
		victim.referenced = false
		l.touch(victim)
		victim = l.head
	}
	return victim
}

// NewEpoch returns an epoch no live circuit has (never 0). Epochs start
// at a random point, so a daemon after a restart does not repeat the
// previous one's for the ids it does not inherit.
func (r *registry) NewEpoch() uint32 {
	if r.nextEpoch == 0 {
		r.nextEpoch = rand.Uint32()
	}
	for {
		r.nextEpoch++
		if e := r.nextEpoch; e != 0 {
			return e
		}
	}
}

// idleList is an intrusive doubly linked list of circuits, least recently
// touched first.
type idleList struct{ head, tail *Circuit }

// touch moves c to the back (most recent), adding it if needed, and
// clears its referenced flag.
func (l *idleList) touch(c *Circuit) {
	c.referenced = false
	if c.inIdle {
		if l.tail == c {
			return
		}
		l.remove(c)
	}
	c.prev, c.next, c.inIdle = l.tail, nil, true
	if l.tail != nil {
		l.tail.next = c
	} else {
		l.head = c
	}
	l.tail = c
}

func (l *idleList) remove(c *Circuit) {
	if !c.inIdle {
		return
	}
	if c.prev != nil {
		c.prev.next = c.next
	} else {
		l.head = c.next
	}
	if c.next != nil {
		c.next.prev = c.prev
	} else {
		l.tail = c.prev
	}
	c.prev, c.next, c.inIdle = nil, nil, false
}

// checkSets reports the first way the registry's sets disagree with its
// circuits' states (nil: none): active holds exactly the circuits that
// reject, the idle list exactly the closed dynamic ones, linked both ways,
// endpoints exactly the endpoint-scoped ones.
func (r *registry) checkSets() error {
	var errs []error
	active, idle, endpoints := 0, 0, 0
	for c := range r.All() {
		s := c.Machine.State()
		if _, in := r.active[c]; in != s.Rejects() {
			errs = append(errs, fmt.Errorf("%s (%s): in active %v", c.Name(), s, in))
		}
		if s.Rejects() {
			active++
		}
		if want := c.Target() == AllTarget && s == policy.Closed; c.inIdle != want {
			errs = append(errs, fmt.Errorf("%s (%s): in idle %v", c.Name(), s, c.inIdle))
		} else if want {
			idle++
		}
		if _, in := r.endpoints[c]; in != (c.Scope() == policy.EndpointScope) {
			errs = append(errs, fmt.Errorf("%s: in endpoints %v", c.Name(), in))
		} else if in {
			endpoints++
		}
	}
	n := 0
	for c := r.idle.head; c != nil; c = c.next {
		n++
		if c.next != nil && c.next.prev != c {
			return errors.Join(append(errs, fmt.Errorf("idle list broken at %s", c.Name()))...)
		}
	}
	if n != idle || len(r.active) != active || len(r.endpoints) != endpoints {
		errs = append(errs, fmt.Errorf("idle list %d (want %d), active %d (want %d), endpoints %d (want %d)", n, idle, len(r.active), active, len(r.endpoints), endpoints))
	}
	return errors.Join(errs...)
}
