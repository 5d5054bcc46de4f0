package daemon

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// held are the steps tests hold the owner in, by daemon (hold).
var held sync.Map

type heldStep struct{ release, finished chan struct{} }

// hold makes the owner wait in a step until release, so a test can look
// at and change the engine from its own goroutine as a step would.
func (d *Daemon) hold() {
	h := heldStep{make(chan struct{}), make(chan struct{})}
	entered := make(chan struct{})
	go func() {
		defer close(h.finished)
		d.do(func() {
			close(entered)
			<-h.release
		})
	}()
	<-entered
	held.Store(d, h)
}

// release ends the step hold began, once what it changed is published.
func (d *Daemon) release() {
	v, _ := held.LoadAndDelete(d)
	h := v.(heldStep)
	close(h.release)
	<-h.finished
}

// While the owner is held in a step, as a long reload would hold it, the
// metrics are scraped and the probes and the event list answered: they
// read what the owner published and never wait for it. The scrape shows
// the circuit that opened before, and the steps asked for meanwhile run
// once the owner is free.
func TestReadersDoNotWaitForTheOwner(t *testing.T) {
	f := newFixture(t, `
all:
  consecutive_failures: 1
  open_duration: 1m
`)
	d := f.start()
	f.dial(9000, 1, 0)
	f.waitState(f.dynName(9000), "open", 2*time.Second)

	d.hold()
	held := true
	defer func() {
		if held {
			d.release()
		}
	}()
	read := make(chan string, 1)
	go func() {
		code, _ := f.readyz()
		read <- fmt.Sprintf("open %v, events %d, readyz %d",
			f.gauge("breakerd_dynamic_circuits", map[string]string{"state": "open"}), len(d.Events()), code)
	}()
	page := make(chan int, 1)
	go func() { page <- len(d.Circuits()) }()
	select {
	case got := <-read:
		if want := "open 1, events 1, readyz 200"; got != want {
			t.Fatalf("while the owner was busy: %s, want %s", got, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the scrape, /readyz or the event list waited for the owner")
	}
	select {
	case n := <-page:
		t.Fatalf("a page of circuits (%d) was copied while the owner was held in a step", n)
	default:
	}
	d.release()
	held = false
	if n := <-page; n != 1 {
		t.Fatalf("the page asked for while the owner was busy lists %d circuits, want 1", n)
	}
}
