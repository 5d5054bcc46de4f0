package daemon

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// inotify is one inotify instance on the cgroup tree, read in batches:
// a blocking read waits for the first event through the runtime's poller,
// then reads that do not wait take what else the kernel has queued. Every
// event of a read is handled from one buffer, without a channel send or
// a lock per event (fsnotify's Watcher costs both, and a path string for
// events breakerd drops).
type inotify struct {
	f  *os.File
	rc syscall.RawConn
	fd int
}

// cgroupWatchMask is what a watched cgroup directory reports: its child
// directories made and removed (cgroup v2 directories cannot be renamed:
// EPERM). Files come and go too (a controller enabled above), and are
// dropped at once by the reader.
const cgroupWatchMask = unix.IN_CREATE | unix.IN_DELETE | unix.IN_ONLYDIR | unix.IN_DONT_FOLLOW

func newInotify() (*inotify, error) {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify_init1: %w", err)
	}
	f := os.NewFile(uintptr(fd), "inotify")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("inotify: %w", err)
	}
	return &inotify{f: f, rc: rc, fd: fd}, nil
}

// add watches the directory at path and returns the watch's descriptor.
// The caller keeps it from racing close (cgroupWatch.mu).
func (in *inotify) add(path string) (int32, error) {
	wd, err := unix.InotifyAddWatch(in.fd, path, cgroupWatchMask)
	return int32(wd), err
}

// remove ends a watch. A removed cgroup's directory stays watched (the
// watch holds its inode, so the kernel never ends it) until this is
// called.
func (in *inotify) remove(wd int32) {
	if wd < 0 {
		return // never watched (noWatch)
	}
	_, _ = unix.InotifyRmWatch(in.fd, uint32(wd))
}

func (in *inotify) close() error { return in.f.Close() }

// read fills buf with events: it waits for the first when wait is set,
// and returns 0 when none is queued otherwise.
func (in *inotify) read(buf []byte, wait bool) (int, error) {
	if wait {
		return in.f.Read(buf)
	}
	var n int
	var rerr error
	err := in.rc.Read(func(fd uintptr) bool {
		n, rerr = unix.Read(int(fd), buf)
		return true // do not wait
	})
	if err != nil {
		return 0, err
	}
	if errors.Is(rerr, unix.EAGAIN) {
		return 0, nil
	}
	return n, rerr
}

// cgroupEvent is one event of a watched cgroup directory that the watch
// acts on: a child directory made or removed, or the queue overflowing.
type cgroupEvent struct {
	wd   int32
	mask uint32
	name string
	// done marks a creation handled ahead of its turn (it may hold a
	// protected cgroup).
	done bool
}

// parseEvents appends the events in buf to evs, leaving out those about
// files and watches ending.
func parseEvents(evs []cgroupEvent, buf []byte) []cgroupEvent {
	for off := 0; off+unix.SizeofInotifyEvent <= len(buf); {
		raw := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
		nameAt := off + unix.SizeofInotifyEvent
		off = nameAt + int(raw.Len)
		switch {
		case raw.Mask&unix.IN_Q_OVERFLOW != 0:
			evs = append(evs, cgroupEvent{wd: -1, mask: raw.Mask})
		case raw.Mask&unix.IN_ISDIR == 0 || raw.Mask&(unix.IN_CREATE|unix.IN_DELETE) == 0 || off > len(buf):
		default:
			name := buf[nameAt:off]
			if i := bytes.IndexByte(name, 0); i >= 0 {
				name = name[:i]
			}
			evs = append(evs, cgroupEvent{wd: raw.Wd, mask: raw.Mask, name: string(name)})
		}
	}
	return evs
}
