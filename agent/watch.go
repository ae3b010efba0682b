package agent

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// maxWatchDirs bounds the directories one recursive watch follows: past
// it, a directory created below is not followed, and the client gets an
// overflow event.
const maxWatchDirs = 8192

// watch serves OpWatch: it replies once dir is watched (and, with
// recursive, every directory below it), then sends each change as a
// WatchEvent data frame until the client hangs up or ctx ends. It is
// inotify(7), with the names relative to dir.
func watch(ctx context.Context, c *Conn, dir string, recursive bool) error {
	st, err := os.Stat(dir)
	if err != nil {
		return opError("watch", dir, err)
	}
	if !st.IsDir() {
		return opError("watch", dir, unix.ENOTDIR)
	}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return opError("watch", dir, err)
	}
	// Non-blocking, so the runtime's poller reads it and Close ends a
	// Read in progress.
	f := os.NewFile(uintptr(fd), "inotify")
	defer f.Close()
	w := &watcher{f: f, fd: fd, root: dir, recursive: recursive, dirs: map[int32]string{}}
	if err := w.add(dir); err != nil {
		return opError("watch", dir, err)
	}
	if recursive {
		if err := w.addBelow(dir, nil); err != nil {
			return opError("watch", dir, err)
		}
	}
	if err := reply(c, Empty{}); err != nil {
		return nil
	}
	// The client hanging up (or ctx) ends the watch.
	go func() {
		c.ReadFrame()
		f.Close()
	}()
	stop := context.AfterFunc(ctx, func() { f.Close() })
	defer stop()
	return w.run(c)
}

// watcher is one OpWatch's inotify instance.
type watcher struct {
	f         *os.File
	fd        int
	root      string
	recursive bool
	dirs      map[int32]string // watch descriptor to directory
	full      bool             // maxWatchDirs reached
}

const watchMask = unix.IN_CREATE | unix.IN_MODIFY | unix.IN_DELETE | unix.IN_MOVED_FROM | unix.IN_MOVED_TO |
	unix.IN_ATTRIB | unix.IN_DELETE_SELF | unix.IN_ONLYDIR

// add watches directory dir.
func (w *watcher) add(dir string) error {
	if len(w.dirs) >= maxWatchDirs {
		w.full = true
		return nil
	}
	wd, err := unix.InotifyAddWatch(w.fd, dir, watchMask)
	if err != nil {
		return err
	}
	w.dirs[int32(wd)] = dir
	return nil
}

// addBelow watches every directory below dir (not following symlinks); a
// directory that goes meanwhile is skipped. With found, each file and
// directory it meets is reported there, named relative to the watch's
// root: what was made in a new directory before its watch began.
func (w *watcher) addBelow(dir string, found func(rel string)) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if p == dir {
			return nil
		}
		if found != nil {
			if rel, err := filepath.Rel(w.root, p); err == nil {
				found(rel)
			}
		}
		if !d.IsDir() {
			return nil
		}
		if err := w.add(p); err != nil && !errors.Is(err, unix.ENOENT) {
			return err
		}
		if w.full {
			return filepath.SkipAll
		}
		return nil
	})
}

// run reads events and sends them until the file is closed.
func (w *watcher) run(c *Conn) error {
	buf := make([]byte, 64<<10)
	for {
		n, err := w.f.Read(buf)
		if err != nil {
			return nil // closed: the client went
		}
		var out []WatchEvent
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			// struct inotify_event: wd, mask, cookie, len, then the
			// name, NUL-padded to len bytes.
			wd := int32(binary.NativeEndian.Uint32(buf[off:]))
			mask := binary.NativeEndian.Uint32(buf[off+4:])
			nameLen := int(binary.NativeEndian.Uint32(buf[off+12:]))
			end := off + unix.SizeofInotifyEvent + nameLen
			if end > n {
				break
			}
			name := strings.TrimRight(string(buf[off+unix.SizeofInotifyEvent:end]), "\x00")
			off = end
			out = append(out, w.events(wd, mask, name)...)
		}
		for _, e := range out {
			b, err := json.Marshal(e)
			if err != nil {
				return fmt.Errorf("watch %s: %w", w.root, err)
			}
			if err := c.WriteFrame(FrameData, b); err != nil {
				return nil
			}
		}
	}
}

// events are what one inotify event says, for the client.
func (w *watcher) events(wd int32, mask uint32, name string) []WatchEvent {
	if mask&unix.IN_Q_OVERFLOW != 0 {
		return []WatchEvent{{Op: WatchOverflow}}
	}
	dir, ok := w.dirs[wd]
	if !ok {
		return nil
	}
	if mask&unix.IN_IGNORED != 0 {
		delete(w.dirs, wd)
		return nil
	}
	if mask&unix.IN_DELETE_SELF != 0 {
		return nil // its parent reports the removal
	}
	path := filepath.Join(dir, name)
	rel, err := filepath.Rel(w.root, path)
	if err != nil {
		return nil
	}
	var op string
	switch {
	case mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0:
		op = WatchCreate
	case mask&unix.IN_MODIFY != 0:
		op = WatchWrite
	case mask&unix.IN_DELETE != 0:
		op = WatchRemove
	case mask&unix.IN_MOVED_FROM != 0:
		op = WatchRename
	case mask&unix.IN_ATTRIB != 0:
		op = WatchChmod
	default:
		return nil
	}
	evs := []WatchEvent{{Name: rel, Op: op}}
	// A directory made (or moved in) below a recursive watch is watched
	// too, with what it already holds: what was made in it before its
	// watch began is reported as made.
	if w.recursive && op == WatchCreate && mask&unix.IN_ISDIR != 0 {
		wasFull := w.full
		if err := w.add(path); err == nil {
			w.addBelow(path, func(rel string) { evs = append(evs, WatchEvent{Name: rel, Op: WatchCreate}) })
		}
		if w.full && !wasFull {
			evs = append(evs, WatchEvent{Op: WatchOverflow})
		}
	}
	return evs
}
