package daemon

import (
	"context"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// watchConfig reloads when the configuration file changes. It watches the
// file's directory, not the file: a Kubernetes ConfigMap is replaced by
// swapping a symlink (..data), which a watch on the old file never sees.
// Bursts of events are folded into one reload.
// The watch is set up by configWatcher before Run says ready, so a change
// made right after is seen.
func (d *Daemon) watchConfig(ctx context.Context, w *fsnotify.Watcher) {
	if w == nil {
		return
	}
	defer w.Close()
	var fire <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-w.Events:
			if !ok {
				return
			}
			base := filepath.Base(ev.Name)
			if base == filepath.Base(d.opts.ConfigPath) || base == "..data" {
				fire = time.After(200 * time.Millisecond)
			}
		case err, ok := <-w.Errors:
			if !ok {
				return
			}
			d.log.Warn("watching the configuration", "err", err)
		case <-fire:
			fire = nil
			_ = d.Reload() // logged and counted by Reload
		}
	}
}

// configWatcher watches the configuration file's directory; nil when there
// is no file or it cannot be watched (reload with SIGHUP then).
func (d *Daemon) configWatcher() *fsnotify.Watcher {
	if d.opts.ConfigPath == "" {
		return nil
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		d.log.Warn("cannot watch the configuration; reload with SIGHUP", "err", err)
		return nil
	}
	dir := filepath.Dir(d.opts.ConfigPath)
	if err := w.Add(dir); err != nil {
		w.Close()
		d.log.Warn("cannot watch the configuration directory; reload with SIGHUP", "dir", dir, "err", err)
		return nil
	}
	return w
}
