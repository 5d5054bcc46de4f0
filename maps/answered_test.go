package maps

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// sequence lists, in ring order, port's response records and every
// Answered record (as "answered(N)@epoch").
func (w *watcher) sequence(port uint16) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, ev := range w.events {
		switch {
		case ev.Outcome == Answered:
			out = append(out, fmt.Sprintf("answered(%d)@%d/%d", ev.AnsweredCount(), ev.Count, ev.Round))
		case ev.Dest.Addr.Port() == port && ev.Outcome == Response:
			out = append(out, statuses([]Event{ev})[0])
		}
	}
	return out
}

func (w *watcher) waitSequence(t *testing.T, port uint16, want ...string) {
	t.Helper()
	var got []string
	if !kerneltest.WaitFor(5*time.Second, func() bool {
		got = w.sequence(port)
		return strings.Join(got, " ") == strings.Join(want, " ")
	}) {
		t.Fatalf("records %v, want %v", got, want)
	}
}

// TestAnsweredCountsSuccessesInOrder: with RespBatch the kernel counts an
// ordinary success in the circuit's answered word, no record, and writes
// the count out just before the circuit's next record (a failure status,
// a slow response), or when answered_flush asks: the ring keeps the order
// of successes and failures. A socket marked under an epoch the word no
// longer has records each response.
func TestAnsweredCountsSuccessesInOrder(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	w := e.watch(t)
	e.srv.ServeHTTPCases(t, 8090)
	const id, epoch = 9, 5
	if err := e.k.SetAnswered(id, epoch); err != nil {
		t.Fatal(err)
	}
	if err := e.k.PutLimit(e.dest(8090, false), Limit{Slot: 7, Responses: RespTimed | RespHTTP | RespBatch,
		BatchID: id, BatchEpoch: epoch, FastBound: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	if err := e.k.SetSettings(Settings{Heartbeat: Now(), FailSafe: time.Hour, Limits: true}); err != nil {
		t.Fatal(err)
	}
	// 404 is a success; /slow answers after 150 ms, past the bound.
	for i, r := range e.requests(t, 8090, 5*time.Second, gets("/ok", "/404", "/ok", "/503", "/ok", "/slow", "/ok", "/429")...) {
		if r.Errno != 0 {
			t.Fatalf("request %d: %v", i, r.Errno)
		}
	}
	w.waitSequence(t, 8090, "answered(3)@5/9", "503", "answered(1)@5/9", "200", "answered(1)@5/9", "429")
	if ep, n, err := e.k.Answered(id); err != nil || ep != epoch || n != 0 {
		t.Fatalf("answered word after the records: epoch %d count %d (%v), want %d and 0", ep, n, err, epoch)
	}

	// Successes with nothing after them stay counted until a flush.
	e.requests(t, 8090, 5*time.Second, gets("/ok", "/ok")...)
	if !kerneltest.WaitFor(5*time.Second, func() bool { _, n, _ := e.k.Answered(id); return n == 2 }) {
		_, n, _ := e.k.Answered(id)
		t.Fatalf("answered count %d, want 2", n)
	}
	if err := e.k.FlushAnswered([]uint32{id, 10}); err != nil {
		t.Fatal(err)
	}
	w.waitSequence(t, 8090, "answered(3)@5/9", "503", "answered(1)@5/9", "200", "answered(1)@5/9", "429", "answered(2)@5/9")

	// The daemon moved the word to another epoch: sockets marked with the
	// old one record every response.
	if err := e.k.SetAnswered(id, epoch+1); err != nil {
		t.Fatal(err)
	}
	e.requests(t, 8090, 5*time.Second, gets("/ok", "/503")...)
	w.waitSequence(t, 8090, "answered(3)@5/9", "503", "answered(1)@5/9", "200", "answered(1)@5/9", "429", "answered(2)@5/9", "200", "503")
	if ep, n, _ := e.k.Answered(id); ep != epoch+1 || n != 0 {
		t.Fatalf("answered word: epoch %d count %d, want %d and 0", ep, n, epoch+1)
	}
}

// TestAnsweredLimitChecked: a limits entry that asks for counting names a
// word the map has and an epoch the word can hold.
func TestAnsweredLimitChecked(t *testing.T) {
	e := newEnv(t, Options{Responses: true})
	for _, l := range []Limit{
		{Responses: RespTimed | RespBatch, BatchID: AnsweredIDs, BatchEpoch: 1},
		{Responses: RespTimed | RespBatch, BatchID: 1, BatchEpoch: 0},
		{Responses: RespTimed | RespBatch, BatchID: 1, BatchEpoch: AnsweredEpochs},
	} {
		if err := e.k.PutLimit(e.dest(8091, false), l); err == nil || !strings.Contains(err.Error(), "counted successes") {
			t.Errorf("PutLimit(%+v): %v, want a refusal naming counted successes", l, err)
		}
	}
	if err := e.k.SetAnswered(AnsweredIDs, 1); err == nil {
		t.Error("SetAnswered past the map: no error")
	}
	if err := e.k.SetAnswered(1, 0); err == nil {
		t.Error("SetAnswered with epoch 0: no error")
	}
}
