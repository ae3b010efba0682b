package e2b

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"
)

// jsonFile is a list of T kept as a JSON file (mode 0600) that several
// processes change (capsa serve, and the commands that manage what it
// serves): a change holds a lock on the file, and a read takes the file
// again when it changed. A library such as bbolt would hold its database
// open, locked, in one process at a time, which the server and the
// commands beside it cannot share.
type jsonFile[T any] struct {
	path string
	what string // for errors

	mu      sync.Mutex
	items   []T
	loaded  bool
	modTime time.Time
	size    int64
}

// maxJSONFile bounds a jsonFile's size.
const maxJSONFile = 4 << 20

// load reads the file again if it changed, and returns the items.
func (f *jsonFile[T]) load() ([]T, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := os.Stat(f.path)
	if errors.Is(err, os.ErrNotExist) {
		f.items, f.loaded, f.modTime, f.size = nil, true, time.Time{}, 0
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("e2b: %s: %w", f.what, err)
	}
	if f.loaded && st.ModTime().Equal(f.modTime) && st.Size() == f.size {
		return f.items, nil
	}
	if st.Size() > maxJSONFile {
		return nil, fmt.Errorf("e2b: %s: %s is %d bytes, over %d", f.what, f.path, st.Size(), maxJSONFile)
	}
	b, err := os.ReadFile(f.path)
	if err != nil {
		return nil, fmt.Errorf("e2b: %s: %w", f.what, err)
	}
	var items []T
	if err := json.Unmarshal(b, &items); err != nil {
		return nil, fmt.Errorf("e2b: %s: %s: %w", f.what, f.path, err)
	}
	f.items, f.loaded, f.modTime, f.size = items, true, st.ModTime(), st.Size()
	return items, nil
}

// list returns a copy of the items.
func (f *jsonFile[T]) list() ([]T, error) {
	items, err := f.load()
	return slices.Clone(items), err
}

// change changes the items with fn under the file's lock.
func (f *jsonFile[T]) change(fn func([]T) ([]T, error)) error {
	lock, err := os.OpenFile(f.path+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("e2b: %s: %w", f.what, err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("e2b: %s: lock: %w", f.what, err)
	}
	items, err := f.load()
	if err != nil {
		return err
	}
	items, err = fn(slices.Clone(items))
	if err != nil {
		return err
	}
	b, err := json.MarshalIndent(items, "", "  ")
	if err != nil {
		return err
	}
	tmp := f.path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("e2b: %s: %w", f.what, err)
	}
	if err := os.Rename(tmp, f.path); err != nil {
		return fmt.Errorf("e2b: %s: %w", f.what, err)
	}
	_, err = f.load()
	return err
}
