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

// Registry holds every circuit: dynamic ones by destination only, named
// ones also by name. It is used by one goroutine at a time (the daemon's
// lock).
//
// Besides the indexes by name and destination it keeps the few circuits
// periodic work visits, so that this work does not grow with the number of
// closed circuits: Active (open, half-open or forced open: the tick and
// the reconciliation after lost records), Endpoints (the departed-endpoint
// sweep), and the idle list, the closed dynamic circuits in the order they
// were queued, from whose front eviction takes its victim (second chance,
// see Victim).
type Registry struct {
	ByName    map[string]*Circuit // named circuits only: use Get and All
	ByDest    DestIndex[Circuit]  // use At to look up
	Active    map[*Circuit]struct{}
	Endpoints map[*Circuit]struct{}
	idle      idleList
	Groups    map[string]*policy.Group
	IDs       *IDs
	Classes   *policy.Classes // the workloads' classes, for the names of isolated workloads' circuits
	Version   uint64          // counts the changes of ByDest and ByName
	Dynamic   int
	// Adopting is set while start-up rebuilds the circuits of the pinned
	// verdicts: max_circuits does not refuse those (an open verdict is
	// never dropped for want of room; eviction brings the count back).
	Adopting bool
	// Recording holds the circuits that have an epoch, by id (only the
	// circuits that ever wrote a rejecting verdict or a limit), and the
	// circuits of the sharing workloads' bulkhead slots, by slot id.
	Recording map[uint32]*Circuit
	nextEpoch uint32
}

// NewRegistry returns an empty registry whose ids (limit of them, see
// NewIDs) read their bulkhead counts from k.
func NewRegistry(k Kernel, limit uint32) *Registry {
	return &Registry{ByName: map[string]*Circuit{}, Groups: map[string]*policy.Group{},
		Active: map[*Circuit]struct{}{}, Endpoints: map[*Circuit]struct{}{}, IDs: NewIDs(k, limit), Recording: map[uint32]*Circuit{}}
}

// Get returns the circuit named name.
func (r *Registry) Get(name string) (*Circuit, bool) {
	if c, ok := r.ByName[name]; ok {
		return c, true
	}
	// A dynamic circuit: its destination's name, and @workload for an
	// isolated workload's (see Classed).
	base, class := name, policy.Class(0)
	if i := strings.LastIndexByte(name, '@'); i >= 0 && r.Classes != nil {
		w := name[i+1:]
		class = r.Classes.Of(w)
		if class == 0 || r.Classes.Name(class) != w {
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
func (r *Registry) All() iter.Seq[*Circuit] {
	return func(yield func(*Circuit) bool) {
		for _, c := range r.ByName {
			if !yield(c) {
				return
			}
		}
		for _, c := range r.ByDest.All() {
			if !c.IsNamed() && !yield(c) {
				return
			}
		}
	}
}

// Count is the number of circuits.
func (r *Registry) Count() int { return len(r.ByName) + r.Dynamic }

// At returns the circuit of destination dst.
func (r *Registry) At(dst maps.Dest) (*Circuit, bool) {
	c := r.ByDest.Get(dst.Compact())
	return c, c != nil
}

// Attach indexes dst as a destination of c (named circuits keep any
// number; a dynamic one has its first only).
func (r *Registry) Attach(c *Circuit, dst maps.Dest) {
	c.addDest(dst)
	r.ByDest.Put(dst.Compact(), c)
	r.Version++
}

// Detach removes dst from the index (the circuit's own list is the
// caller's: Circuit.RemoveDest).
func (r *Registry) Detach(dst maps.Dest) {
	r.ByDest.Del(dst.Compact())
	r.Version++
}

// Track files c under the sets its state puts it in; call it whenever c's
// state may have changed.
func (r *Registry) Track(c *Circuit) {
	s := c.Machine.State()
	if s.Rejects() {
		r.Active[c] = struct{}{}
	} else {
		delete(r.Active, c)
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
func (r *Registry) Untrack(c *Circuit) {
	delete(r.Active, c)
	delete(r.Endpoints, c)
	r.idle.remove(c)
}

// Victim returns the least recently active closed dynamic circuit, in
// amortized O(1), by second chance (the CLOCK algorithm): the idle list
// is in the order circuits were queued; a circuit that recorded a call
// since (referenced) is queued again at the back instead of chosen, so a
// record costs one flag, not a move in the list that touches two other
// circuits' memory. Every circuit passed over loses its flag, so the loop
// ends within one pass. nil: there is none.
func (r *Registry) Victim() *Circuit {
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
func (r *Registry) NewEpoch() uint32 {
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

// CheckSets reports the first way the registry's sets disagree with its
// circuits' states (nil: none): Active holds exactly the circuits that
// reject, the idle list exactly the closed dynamic ones, linked both ways,
// Endpoints exactly the endpoint-scoped ones. For tests.
func (r *Registry) CheckSets() error {
	var errs []error
	active, idle, endpoints := 0, 0, 0
	for c := range r.All() {
		s := c.Machine.State()
		if _, in := r.Active[c]; in != s.Rejects() {
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
		if _, in := r.Endpoints[c]; in != (c.Scope() == policy.EndpointScope) {
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
	if n != idle || len(r.Active) != active || len(r.Endpoints) != endpoints {
		errs = append(errs, fmt.Errorf("idle list %d (want %d), active %d (want %d), endpoints %d (want %d)", n, idle, len(r.Active), active, len(r.Endpoints), endpoints))
	}
	return errors.Join(errs...)
}
