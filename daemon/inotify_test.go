package daemon

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The watch's reads wait through the runtime's poller: a read deadline
// ends a wait with no event (run's rescans depend on it), and a read that
// must not wait returns nothing; events come parsed, directories only.
func TestInotifyReads(t *testing.T) {
	in, err := newInotify()
	if err != nil {
		t.Fatal(err)
	}
	defer in.close()
	dir := t.TempDir()
	if _, err := in.add(dir); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	if n, err := in.read(buf, false); n != 0 || err != nil {
		t.Fatalf("a read with nothing queued: %d, %v", n, err)
	}
	if err := in.f.SetReadDeadline(time.Now().Add(20 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if _, err := in.f.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a wait past its deadline: %v", err)
	}
	if err := os.Mkdir(filepath.Join(dir, "a"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "a")); err != nil {
		t.Fatal(err)
	}
	if err := in.f.SetReadDeadline(time.Now().Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	var evs []cgroupEvent
	for len(evs) < 2 {
		n, err := in.f.Read(buf)
		if err != nil {
			t.Fatalf("reading events: %v (so far %+v)", err, evs)
		}
		evs = parseEvents(evs, buf[:n])
	}
	if len(evs) != 2 || evs[0].name != "a" || evs[0].mask&unix.IN_CREATE == 0 || evs[1].name != "a" || evs[1].mask&unix.IN_DELETE == 0 {
		t.Fatalf("events %+v, want a made and removed (the file left out)", evs)
	}
}
