package sandbox

// What changed between two checkpoints: a snapshot taken with an
// inventory (SnapshotOptions.Inventory) records the guest's files and the
// agent's processes as they were just before it, and Diff compares two
// such inventories, or one with the running sandbox (DiffSince): files
// added, removed and changed in the guest's own file systems (its root,
// an image's writable layer over the image, and /tmp), and processes
// started and ended. Shares and volumes are the host's directories and
// are not in a snapshot, so not in its inventory.

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/internal/strictjson"
	"github.com/capsa-sandbox/capsa/snapshot"
)

// InventoryFile is a snapshot's inventory, when it has one.
const InventoryFile = "inventory.json"

// Bounds on an inventory read back: a snapshot is untrusted input.
const (
	maxInventoryFile      = 128 << 20
	maxInventoryProcesses = 4096
)

// inventoryMounts are the mount points below / whose files a snapshot
// holds in the guest's memory: an inventory walks them too.
var inventoryMounts = []string{"/tmp"}

// Inventory is what a checkpoint records of its guest for Diff.
type Inventory struct {
	Taken time.Time `json:"taken"` // the host's clock, just before the snapshot
	// Files are the guest's files below / (paths relative to it), by
	// path.
	Files []agent.TreeEntry `json:"files"`
	// Processes are the agent's table: the running processes and the
	// most recent that exited.
	Processes []agent.ProcessInfo `json:"processes"`
	// Unavailable, when set, says why the snapshot has no inventory (its
	// guest was paused, or could not give one): Files and Processes are
	// empty.
	Unavailable string `json:"unavailable,omitempty"`
}

// Inventory takes the guest's inventory now: its files and the agent's
// processes.
func (s *Guest) Inventory(ctx context.Context) (*Inventory, error) {
	files, err := s.client.Tree(ctx, "/", inventoryMounts)
	if err != nil {
		return nil, s.explain(fmt.Errorf("sandbox: inventory: %w", err))
	}
	procs, err := s.client.Processes(ctx)
	if err != nil {
		return nil, s.explain(fmt.Errorf("sandbox: inventory: %w", err))
	}
	inv := &Inventory{Taken: time.Now().UTC(), Files: files, Processes: procs}
	slices.SortFunc(inv.Files, func(a, b agent.TreeEntry) int { return cmp.Compare(a.Path, b.Path) })
	return inv, inv.check()
}

// snapshotInventory is what a snapshot taken with an inventory records of
// its guest: the inventory, or why there is none. A snapshot never fails
// for want of one, as it did not before inventories.
func (s *Sandbox) snapshotInventory(ctx context.Context) *Inventory {
	why := "the sandbox was paused, and its agent cannot answer"
	if !s.Paused() {
		inv, err := s.Inventory(ctx)
		if err == nil {
			return inv
		}
		why = err.Error()
		s.c.logger().Warn("sandbox: snapshot without an inventory", "err", err)
	}
	return &Inventory{Taken: time.Now().UTC(), Files: []agent.TreeEntry{}, Processes: []agent.ProcessInfo{}, Unavailable: why}
}

// check refuses an inventory no agent makes: a bad or repeated path, a
// repeated process, too many entries or processes.
func (inv *Inventory) check() error {
	if len(inv.Files) > agent.MaxTreeEntries || len(inv.Processes) > maxInventoryProcesses {
		return fmt.Errorf("inventory: %d files and %d processes: at most %d and %d", len(inv.Files), len(inv.Processes), agent.MaxTreeEntries, maxInventoryProcesses)
	}
	ids := map[int]bool{}
	for _, p := range inv.Processes {
		if ids[p.ID] {
			return fmt.Errorf("inventory: process %d is listed twice", p.ID)
		}
		ids[p.ID] = true
	}
	for i := range inv.Files {
		if err := inv.Files[i].Check(); err != nil {
			return fmt.Errorf("inventory: %w", err)
		}
		if i > 0 && inv.Files[i-1].Path >= inv.Files[i].Path {
			return fmt.Errorf("inventory: %.100q is out of order or repeated", inv.Files[i].Path)
		}
	}
	return nil
}

// ReadInventory reads the inventory of the snapshot in dir, checked as
// untrusted input: the snapshot's own checks (package snapshot), the
// checksum its manifest gives the inventory, a strict decoding, and each
// entry. A snapshot taken without one is an error wrapping ErrNoInventory.
func ReadInventory(dir string) (*Inventory, error) {
	snap, err := snapshot.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("sandbox: inventory: %w", err)
	}
	defer snap.Close()
	f, ok := snap.Manifest.Files[InventoryFile]
	if !ok {
		return nil, fmt.Errorf("sandbox: snapshot %s: %w: it was taken without one (a suspension's, a fork's, or by an older capsa)", dir, ErrNoInventory)
	}
	b, err := snap.ReadFile(InventoryFile, maxInventoryFile)
	if err != nil {
		return nil, fmt.Errorf("sandbox: snapshot %s: %w", dir, err)
	}
	if sum := sha256.Sum256(b); hex.EncodeToString(sum[:]) != f.SHA256 {
		return nil, fmt.Errorf("sandbox: snapshot %s: %s does not match its checksum: corrupted", dir, InventoryFile)
	}
	var inv Inventory
	if err := strictjson.Decode(b, &inv); err != nil {
		return nil, fmt.Errorf("sandbox: snapshot %s: %s: %w", dir, InventoryFile, err)
	}
	if err := inv.check(); err != nil {
		return nil, fmt.Errorf("sandbox: snapshot %s: %w", dir, err)
	}
	if inv.Unavailable != "" {
		return nil, fmt.Errorf("sandbox: snapshot %s: %w: %.500s", dir, ErrNoInventory, inv.Unavailable)
	}
	return &inv, nil
}

// ErrNoInventory is wrapped when a snapshot has no inventory, so nothing
// can be compared: it was taken without one (a suspension's, a fork's, or
// by an older capsa), or its guest could not give one (the error says
// why).
var ErrNoInventory = errors.New("it has no inventory")

// writeInventory is the snapshot's extra file holding inv.
func writeInventory(inv *Inventory) snapshot.Extra {
	return func(path string) (string, error) {
		b, err := json.Marshal(inv)
		if err != nil {
			return "", err
		}
		if err := os.WriteFile(path, b, 0o600); err != nil {
			return "", err
		}
		sum := sha256.Sum256(b)
		return hex.EncodeToString(sum[:]), nil
	}
}

// Diff is what changed from one inventory to a later one.
type Diff struct {
	From time.Time `json:"from"`
	To   time.Time `json:"to"`
	// Files are the files added, removed and changed, by path.
	Files []FileChange `json:"files"`
	// Processes are those started and ended, by ID.
	Processes []ProcessChange `json:"processes"`
}

// The kinds of change.
const (
	Added   = "added"
	Removed = "removed"
	Changed = "changed"
	Started = "started"
	Ended   = "ended"
)

// FileChange is one file's change.
type FileChange struct {
	Path   string `json:"path"`   // absolute, in the guest
	Change string `json:"change"` // Added, Removed or Changed
	Type   string `json:"type"`   // file, dir, symlink or other (now; removed: then)
	// Size is the file's size now (removed: then); OldSize, of a changed
	// file, before.
	Size    int64 `json:"size"`
	OldSize int64 `json:"old_size,omitempty"`
}

// ProcessChange is a process of the agent's table that started or ended.
type ProcessChange struct {
	Change string            `json:"change"` // Started or Ended
	ID     int               `json:"id"`
	PID    int               `json:"pid"`
	Argv   []string          `json:"argv"`
	Exit   *agent.ExitStatus `json:"exit,omitempty"` // ended: how (started and ended since: both)
}

// DiffInventories says what changed from a to b. A file changed when its
// type, permissions, owner, size, times, inode or link target did (a
// directory: its type, permissions or owner; what it holds shows as its
// entries' changes). A process started when it is in b's table and not
// a's; it ended when it ran in a and has exited in b (or left b's table).
func DiffInventories(a, b *Inventory) *Diff {
	d := &Diff{From: a.Taken, To: b.Taken, Files: []FileChange{}, Processes: []ProcessChange{}}
	i, j := 0, 0
	for i < len(a.Files) || j < len(b.Files) {
		switch {
		case j == len(b.Files) || i < len(a.Files) && a.Files[i].Path < b.Files[j].Path:
			d.Files = append(d.Files, fileChange(Removed, a.Files[i], nil))
			i++
		case i == len(a.Files) || b.Files[j].Path < a.Files[i].Path:
			d.Files = append(d.Files, fileChange(Added, b.Files[j], nil))
			j++
		default:
			if changed(a.Files[i], b.Files[j]) {
				d.Files = append(d.Files, fileChange(Changed, b.Files[j], &a.Files[i]))
			}
			i, j = i+1, j+1
		}
	}
	before := map[int]agent.ProcessInfo{}
	for _, p := range a.Processes {
		before[p.ID] = p
	}
	after := map[int]bool{}
	for _, p := range b.Processes {
		after[p.ID] = true
		old, ok := before[p.ID]
		switch {
		case !ok:
			d.Processes = append(d.Processes, ProcessChange{Change: Started, ID: p.ID, PID: p.PID, Argv: p.Argv, Exit: p.Exit})
		case old.Exit == nil && p.Exit != nil:
			d.Processes = append(d.Processes, ProcessChange{Change: Ended, ID: p.ID, PID: p.PID, Argv: p.Argv, Exit: p.Exit})
		}
	}
	for _, p := range a.Processes {
		if !after[p.ID] && p.Exit == nil {
			d.Processes = append(d.Processes, ProcessChange{Change: Ended, ID: p.ID, PID: p.PID, Argv: p.Argv})
		}
	}
	slices.SortFunc(d.Processes, func(x, y ProcessChange) int { return cmp.Compare(x.ID, y.ID) })
	return d
}

func changed(a, b agent.TreeEntry) bool {
	ta, tb := fs.FileMode(a.Mode), fs.FileMode(b.Mode)
	if ta != tb || a.UID != b.UID || a.GID != b.GID {
		return true
	}
	if ta.IsDir() {
		return false
	}
	return a.Size != b.Size || a.MtimeNs != b.MtimeNs || a.CtimeNs != b.CtimeNs || a.Ino != b.Ino || a.Target != b.Target
}

func fileChange(change string, e agent.TreeEntry, old *agent.TreeEntry) FileChange {
	c := FileChange{Path: "/" + e.Path, Change: change, Type: fileType(fs.FileMode(e.Mode)), Size: e.Size}
	if old != nil {
		c.OldSize = old.Size
	}
	return c
}

func fileType(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "file"
	case m.IsDir():
		return "dir"
	case m&fs.ModeSymlink != 0:
		return "symlink"
	}
	return "other"
}

// DiffSnapshots says what changed from the snapshot in dir a to the one
// in dir b, each taken with an inventory.
func DiffSnapshots(a, b string) (*Diff, error) {
	ia, err := ReadInventory(a)
	if err != nil {
		return nil, err
	}
	ib, err := ReadInventory(b)
	if err != nil {
		return nil, err
	}
	return DiffInventories(ia, ib), nil
}

// DiffSince says what changed in the running guest since the snapshot in
// dir (taken with an inventory).
func (s *Guest) DiffSince(ctx context.Context, dir string) (*Diff, error) {
	ia, err := ReadInventory(dir)
	if err != nil {
		return nil, err
	}
	now, err := s.Inventory(ctx)
	if err != nil {
		return nil, err
	}
	return DiffInventories(ia, now), nil
}
