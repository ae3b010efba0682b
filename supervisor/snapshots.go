package supervisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/snapshot"
)

// The Manager's snapshot catalog: the named snapshots of its state
// directory (store.SnapshotsDir), which `capsa snapshot` and the MCP
// snapshot tools list, inspect, restore and remove.

// SnapshotManifest is what a snapshot says of itself (package snapshot's
// manifest).
type SnapshotManifest = snapshot.Manifest

// SnapshotInfo is a named snapshot as the catalog lists it.
type SnapshotInfo struct {
	Name        string    `json:"name"`
	Created     time.Time `json:"created"`
	CPUs        int       `json:"cpus"`
	MemoryBytes uint64    `json:"memory_bytes"`
	DiskBytes   int64     `json:"disk_bytes"` // what its files take on disk
	Command     string    `json:"command"`
	// Parent is the snapshot a layer lies over (its memory holds only
	// what differs from it), and Chain how many snapshots a restore maps.
	Parent string `json:"parent,omitempty"`
	Chain  int    `json:"chain,omitempty"`
	// DiskOnly: it holds a sandbox's disk alone, no memory (a suspension
	// without it): it boots again, and cannot be restored.
	DiskOnly bool   `json:"disk_only,omitempty"`
	Err      string `json:"error,omitempty"` // why it cannot be read
}

// SnapshotDir is the directory of snap: a snapshot's name in the state
// directory, or (allowPath, for the local CLI) a path to a snapshot
// directory, anything with a slash.
func (m *Manager) SnapshotDir(snap string, allowPath bool) (string, error) {
	if allowPath && strings.Contains(snap, "/") {
		return filepath.Abs(snap)
	}
	if err := CheckSnapshotName(snap); err != nil {
		return "", err
	}
	return m.st.SnapshotDir(snap), nil
}

// Diff says what changed from the snapshot from to the snapshot to (names
// in the catalog, or paths), each taken with an inventory, as
// sandbox.DiffSnapshots does.
func (m *Manager) Diff(from, to string) (*sandbox.Diff, error) {
	a, err := m.SnapshotDir(from, true)
	if err != nil {
		return nil, err
	}
	b, err := m.SnapshotDir(to, true)
	if err != nil {
		return nil, err
	}
	return sandbox.DiffSnapshots(a, b)
}

// DiffSince says what changed in the running sandbox name since the
// snapshot from (a name in the catalog, or a path), as
// sandbox.Guest.DiffSince does.
func (m *Manager) DiffSince(ctx context.Context, from, name string) (*sandbox.Diff, error) {
	dir, err := m.SnapshotDir(from, true)
	if err != nil {
		return nil, err
	}
	h, err := m.Open(ctx, name)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	return h.DiffSince(ctx, dir)
}

// Snapshots lists the named snapshots; one that cannot be read is listed
// with why.
func (m *Manager) Snapshots() ([]SnapshotInfo, error) {
	entries, err := os.ReadDir(m.st.SnapshotsDir())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	out := []SnapshotInfo{}
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		dir := m.st.SnapshotDir(e.Name())
		info := SnapshotInfo{Name: e.Name(), DiskBytes: diskUsage(dir)}
		if s, err := snapshot.Open(dir); err != nil {
			info.Err = err.Error()
		} else {
			s.Close()
			mf := s.Manifest
			info.Created, info.CPUs, info.MemoryBytes, info.Chain, info.DiskOnly = mf.Created, mf.CPUs, mf.MemoryBytes, s.Chain(), mf.DiskOnly
			if mf.Parent != nil {
				info.Parent = mf.Parent.Name
			}
			var spec sandbox.Spec
			if json.Unmarshal(mf.Spec, &spec) == nil {
				info.Command = CommandLine(spec)
			}
		}
		out = append(out, info)
	}
	return out, nil
}

// diskUsage is what the files in dir take on disk (a sparse memory file
// only its written pages).
func diskUsage(dir string) int64 {
	var n int64
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if fi, err := e.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
	}
	return n
}

// InspectSnapshot opens the snapshot in dir (SnapshotDir) and returns its
// manifest; with verify it also reads every file and checks its checksum.
func (m *Manager) InspectSnapshot(dir string, verify bool) (*SnapshotManifest, error) {
	s, err := snapshot.Open(dir)
	if err != nil {
		return nil, err
	}
	s.Close()
	if verify {
		if err := snapshot.Verify(dir); err != nil {
			return nil, err
		}
	}
	return &s.Manifest, nil
}

// RemoveSnapshot removes the named snapshot. Sandboxes restored from it
// keep its memory mapped: removing the files does not disturb them. A
// snapshot that layers lie over is not removed: they would not restore.
func (m *Manager) RemoveSnapshot(name string) error {
	dir, err := m.namedSnapshot(name)
	if err != nil {
		return err
	}
	if kids := m.layersOver(name); len(kids) > 0 {
		return fmt.Errorf("snapshot %s: %s lie over it (capsa snapshot squash or rm them first)", name, strings.Join(kids, ", "))
	}
	return os.RemoveAll(dir)
}

// namedSnapshot is the directory of the catalog's snapshot name, which
// must exist.
func (m *Manager) namedSnapshot(name string) (string, error) {
	if err := CheckSnapshotName(name); err != nil {
		return "", err
	}
	dir := m.st.SnapshotDir(name)
	if _, err := os.Stat(filepath.Join(dir, snapshot.ManifestFile)); errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("no snapshot called %s", name)
	} else if err != nil {
		return "", err
	}
	return dir, nil
}

// layersOver names the catalog's snapshots that are layers over name:
// each manifest (read alone, bounded and checked: snapshot.ReadManifest)
// names it and its manifest's checksum as its parent.
func (m *Manager) layersOver(name string) []string {
	_, sum, err := snapshot.ReadManifest(m.st.SnapshotDir(name))
	if err != nil {
		return nil // no layer can name a snapshot unread
	}
	entries, _ := os.ReadDir(m.st.SnapshotsDir())
	var kids []string
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") || e.Name() == name {
			continue
		}
		mf, _, err := snapshot.ReadManifest(m.st.SnapshotDir(e.Name()))
		if err == nil && mf.Parent != nil && mf.Parent.Name == name && mf.Parent.ManifestSHA256 == sum {
			kids = append(kids, e.Name())
		}
	}
	return kids
}

// SquashSnapshot writes the named snapshot's flattened copy (a layer's
// memory whole: snapshot.Squash) as the snapshot into, or ("") in its
// place, which a snapshot that layers lie over refuses (their parent
// would change). It returns the snapshot written.
func (m *Manager) SquashSnapshot(name, into string) (string, error) {
	dir, err := m.namedSnapshot(name)
	if err != nil {
		return "", err
	}
	out := into
	if into == "" {
		if kids := m.layersOver(name); len(kids) > 0 {
			return "", fmt.Errorf("snapshot %s: %s lie over it: squash it into a new snapshot instead", name, strings.Join(kids, ", "))
		}
		out = "." + name + ".squash"
		os.RemoveAll(m.st.SnapshotDir(out)) // a squash interrupted before
	} else if err := CheckSnapshotName(into); err != nil {
		return "", err
	}
	s, err := snapshot.Open(dir)
	if err != nil {
		return "", err
	}
	defer s.Close()
	if into == "" && s.Parent == nil {
		return name, nil // whole already
	}
	if err := snapshot.Squash(s, m.st.SnapshotDir(out)); err != nil {
		return "", err
	}
	if into != "" {
		return into, nil
	}
	// In place: the squashed copy and the layer change places at once,
	// then the layer goes.
	if err := unix.Renameat2(unix.AT_FDCWD, m.st.SnapshotDir(out), unix.AT_FDCWD, dir, unix.RENAME_EXCHANGE); err != nil {
		os.RemoveAll(m.st.SnapshotDir(out))
		return "", fmt.Errorf("snapshot %s: squash: %w", name, err)
	}
	return name, os.RemoveAll(m.st.SnapshotDir(out))
}

// RestoreDir starts a sandbox named name ("": a new name) from the
// snapshot in dir, its guest taking hostname ("": the snapshot's), with
// the host-facing settings given (nil: none; see sandbox.RestoredSpec)
// and its secrets' values (nil: none); rm removes it when it ends. It
// returns the sandbox's name.
func (m *Manager) RestoreDir(ctx context.Context, dir, name, hostname string, rm bool, settings *sandbox.Spec, secrets map[string]string) (string, error) {
	if name != "" {
		if err := CheckName(name); err != nil {
			return "", err
		}
	}
	rec, err := RestoreRecord(dir, name, hostname, rm, settings)
	if err != nil {
		return "", err
	}
	return m.Launch(ctx, rec, secrets)
}
