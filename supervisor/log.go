package supervisor

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/store"
)

// rotatingLog is a log file with a size bound: at half the bound the file
// becomes NAME.1 (replacing the one before) and a new one starts, so at
// most the bound is on disk and the newest output is always there. It is
// written here rather than taken from a logging library because it holds
// raw process output, not log records.
type rotatingLog struct {
	path string
	half int64

	mu   sync.Mutex
	f    *os.File
	size int64
}

func newRotatingLog(path string, limit int64) (*rotatingLog, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("supervisor: log: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("supervisor: log: %w", err)
	}
	return &rotatingLog{path: path, half: max(limit/2, 1), f: f, size: fi.Size()}, nil
}

// Write appends p, rotating first when it would pass half the bound; a
// write larger than that keeps only its tail.
func (l *rotatingLog) Write(p []byte) (int, error) {
	n := len(p)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return 0, os.ErrClosed
	}
	if int64(len(p)) > l.half {
		p = p[int64(len(p))-l.half:]
	}
	if l.size+int64(len(p)) > l.half {
		if err := l.rotate(); err != nil {
			return 0, err
		}
	}
	m, err := l.f.Write(p)
	l.size += int64(m)
	if err != nil {
		return 0, fmt.Errorf("supervisor: log: %w", err)
	}
	return n, nil
}

func (l *rotatingLog) rotate() error {
	l.f.Close()
	l.f = nil
	if err := os.Rename(l.path, l.path+".1"); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("supervisor: rotate log: %w", err)
	}
	f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("supervisor: rotate log: %w", err)
	}
	l.f, l.size = f, 0
	return nil
}

// Close closes the file.
func (l *rotatingLog) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// logs writes a sandbox's log file (MainLog or ConsoleLog) to w: the
// rotated part and the live one, the last lines of it (all if lines < 0),
// then, with follow, what is written next until the sandbox ends or ctx
// does.
func logs(ctx context.Context, st *store.Store, name, file string, lines int, follow bool, w io.Writer) error {
	path := filepath.Join(st.SandboxDir(name), file)
	old, _ := os.ReadFile(path + ".1")
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("supervisor: logs of %s: %w", name, err)
	}
	defer func() { f.Close() }()
	cur, err := io.ReadAll(f)
	if err != nil {
		return fmt.Errorf("supervisor: logs of %s: %w", name, err)
	}
	data, offset := logStart(old, cur, lines, follow)
	if _, err := w.Write(data); err != nil || !follow {
		return err
	}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	buf := make([]byte, 64<<10)
	for {
		// Read to the end, then look again once the sandbox has ended:
		// what it wrote last is there by then.
		ended := false
		if r, err := st.Get(name); err != nil || !r.Alive() {
			ended = true
		}
		if fi, err := os.Stat(path); err == nil {
			if ffi, ferr := f.Stat(); ferr == nil && !os.SameFile(fi, ffi) {
				// Rotated: finish the old file, then start the new one.
				copyFrom(f, offset, buf, w)
				nf, err := os.Open(path)
				if err == nil {
					f.Close()
					f, offset = nf, 0
				}
			}
		}
		n, err := copyFrom(f, offset, buf, w)
		offset += n
		if err != nil {
			return err
		}
		if ended {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// logStart is what Logs writes first of a log whose rotated part is old
// and live part cur (the last lines of it, all if lines < 0), and, with
// follow, the offset in cur to follow from. Following the last lines, a
// last line still being written (no newline yet: the process's output
// arrives in pieces) is not one of them: following starts at its
// beginning, so that it comes out whole, never as a fragment read as a
// line of its own.
func logStart(old, cur []byte, lines int, follow bool) ([]byte, int64) {
	data := append(old, cur...)
	offset := int64(len(cur))
	if lines < 0 {
		return data, offset
	}
	if i := bytes.LastIndexByte(data, '\n'); follow && i+1 < len(data) {
		data = data[:i+1]
		// A line begun in old (the file rotated in its middle) is
		// followed from cur's start, its beginning lost.
		offset = max(0, int64(i+1-len(old)))
	}
	return lastLines(data, lines), offset
}

// copyFrom copies f from offset to its current end into w.
func copyFrom(f *os.File, offset int64, buf []byte, w io.Writer) (int64, error) {
	var total int64
	for {
		n, err := f.ReadAt(buf, offset+total)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return total, werr
			}
			total += int64(n)
		}
		if err != nil {
			return total, nil
		}
	}
}

// lastLines returns the last n lines of b.
func lastLines(b []byte, n int) []byte {
	if n == 0 {
		return nil
	}
	end := len(b)
	if end > 0 && b[end-1] == '\n' {
		end--
	}
	for i := end - 1; i >= 0; i-- {
		if b[i] == '\n' {
			n--
			if n == 0 {
				return b[i+1:]
			}
		}
	}
	return b
}
