package fleet

import (
	"reflect"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

var t0 = time.Date(2026, 12, 6, 9, 0, 0, 0, time.UTC)

// at returns t0 plus s seconds.
func at(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }

// open is a circuit of key open until t0 + until seconds.
func open(key string, until float64) Circuit {
	return Circuit{Key: key, Target: "all", Workload: "shared", Since: metav1.NewMicroTime(t0),
		OpenUntil: metav1.NewMicroTime(at(until)), Reason: "consecutive_failures"}
}

func report(node string, cs ...Circuit) *CircuitReport {
	r := &CircuitReport{Spec: ReportSpec{Open: len(cs), Circuits: cs}}
	r.Name = node
	return r
}

func TestFleetTally(t *testing.T) {
	const pay, db = "tcp/192.0.2.7:443", "payments"
	q2 := func(string) int { return 2 }
	tests := []struct {
		name    string
		reports []*CircuitReport
		forget  []string
		now     float64
		quorum  func(string) int
		count   map[string]int
		want    []Verdict
	}{
		{name: "no reports", now: 0, quorum: q2, count: map[string]int{pay: 0}},
		{name: "one node is below a quorum of two",
			reports: []*CircuitReport{report("b", open(pay, 10))}, now: 0, quorum: q2,
			count: map[string]int{pay: 1}},
		{name: "two other nodes open it, until the earlier of theirs",
			reports: []*CircuitReport{report("b", open(pay, 10)), report("c", open(pay, 7))}, now: 0, quorum: q2,
			count: map[string]int{pay: 2},
			want:  []Verdict{{Key: pay, Nodes: 2, Quorum: 2, Until: at(7)}}},
		{name: "its own report never counts",
			reports: []*CircuitReport{report("self", open(pay, 10)), report("b", open(pay, 10))}, now: 0, quorum: q2,
			count: map[string]int{pay: 1}},
		{name: "an entry stops counting at its open-until",
			reports: []*CircuitReport{report("b", open(pay, 10)), report("c", open(pay, 5))}, now: 5, quorum: q2,
			count: map[string]int{pay: 1}},
		{name: "an entry counts until the instant before",
			reports: []*CircuitReport{report("b", open(pay, 10)), report("c", open(pay, 5))}, now: 4.999, quorum: q2,
			count: map[string]int{pay: 2},
			want:  []Verdict{{Key: pay, Nodes: 2, Quorum: 2, Until: at(5)}}},
		{name: "a key twice in one report is one node",
			reports: []*CircuitReport{report("b", open(pay, 10), open(pay, 20))}, now: 0, quorum: q2,
			count: map[string]int{pay: 1}},
		{name: "a node's latest entry of a key is its open-until",
			reports: []*CircuitReport{report("b", open(pay, 3), open(pay, 20)), report("c", open(pay, 30))}, now: 0, quorum: q2,
			want: []Verdict{{Key: pay, Nodes: 2, Quorum: 2, Until: at(20)}}},
		{name: "until is the quorum-th latest",
			reports: []*CircuitReport{report("b", open(pay, 10)), report("c", open(pay, 30)), report("d", open(pay, 20))}, now: 0,
			quorum: func(string) int { return 2 },
			count:  map[string]int{pay: 3},
			want:   []Verdict{{Key: pay, Nodes: 3, Quorum: 2, Until: at(20)}}},
		{name: "quorum three needs three",
			reports: []*CircuitReport{report("b", open(pay, 10)), report("c", open(pay, 30))}, now: 0,
			quorum: func(string) int { return 3 }, count: map[string]int{pay: 2}},
		{name: "a key without a fleet block is never opened",
			reports: []*CircuitReport{report("b", open(pay, 10), open(db, 10)), report("c", open(pay, 10), open(db, 10))}, now: 0,
			quorum: func(k string) int {
				if k == db {
					return 2
				}
				return 0
			},
			want: []Verdict{{Key: db, Nodes: 2, Quorum: 2, Until: at(10)}}},
		{name: "a quorum of one is taken as two",
			reports: []*CircuitReport{report("b", open(pay, 10))}, now: 0,
			quorum: func(string) int { return 1 }, count: map[string]int{pay: 1}},
		{name: "a later report of a node replaces its earlier one",
			reports: []*CircuitReport{report("b", open(pay, 10)), report("c", open(pay, 10)), report("b")}, now: 0, quorum: q2,
			count: map[string]int{pay: 1}},
		{name: "a deleted report is forgotten",
			reports: []*CircuitReport{report("b", open(pay, 10)), report("c", open(pay, 10))}, forget: []string{"c"}, now: 0, quorum: q2,
			count: map[string]int{pay: 1}},
		{name: "an entry without a key is ignored",
			reports: []*CircuitReport{report("b", open("", 10)), report("c", open("", 10))}, now: 0, quorum: q2,
			count: map[string]int{"": 0}},
		{name: "keys are counted apart, in key order",
			reports: []*CircuitReport{report("b", open(pay, 10), open(db, 12)), report("c", open(db, 11), open(pay, 9))}, now: 0, quorum: q2,
			want: []Verdict{{Key: db, Nodes: 2, Quorum: 2, Until: at(11)}, {Key: pay, Nodes: 2, Quorum: 2, Until: at(9)}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ta := NewTally("self")
			for _, r := range tt.reports {
				ta.Observe(r)
			}
			for _, n := range tt.forget {
				ta.Forget(n)
			}
			now := at(tt.now)
			for k, n := range tt.count {
				if got := ta.Count(k, now); got != n {
					t.Errorf("Count(%q) = %d, want %d", k, got, n)
				}
			}
			if got := ta.Open(now, tt.quorum); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Open = %+v\nwant   %+v", got, tt.want)
			}
		})
	}
}

func TestFleetTallyNextExpiry(t *testing.T) {
	ta := NewTally("self")
	if _, ok := ta.NextExpiry(t0); ok {
		t.Fatal("an empty tally has an expiry")
	}
	ta.Observe(report("self", open("a", 1)))
	ta.Observe(report("b", open("a", 5), open("b", 3)))
	ta.Observe(report("c", open("a", 4)))
	for _, tc := range []struct {
		now, want float64
		ok        bool
	}{{0, 3, true}, {3, 4, true}, {4, 5, true}, {5, 0, false}} {
		got, ok := ta.NextExpiry(at(tc.now))
		if ok != tc.ok || (ok && !got.Equal(at(tc.want))) {
			t.Errorf("NextExpiry(t0+%vs) = %v, %v; want t0+%vs, %v", tc.now, got, ok, tc.want, tc.ok)
		}
	}
}
