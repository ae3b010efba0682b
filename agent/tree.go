package agent

// OpTree: a file tree's inventory, every entry's path and metadata, which
// a snapshot keeps so that two checkpoints can be compared (sandbox.Diff).
// The walk stays on the file system of the directory it starts from, as
// `find -xdev` does, entering only the mount points the request names:
// shares and volumes are the host's, and /proc, /sys and /dev the kernel's.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// FeatureTree: a file tree's inventory (OpTree).
const FeatureTree = "tree"

// OpTree is the operation's name.
const OpTree = "tree"

// TreeEntry is one file of a tree's inventory: what tells a change.
type TreeEntry struct {
	Path    string `json:"p"` // relative to the tree's root, "/"-separated
	Mode    uint32 `json:"m"` // as os.FileMode
	Size    int64  `json:"s"`
	MtimeNs int64  `json:"t"`
	CtimeNs int64  `json:"c"`
	Ino     uint64 `json:"i"`
	UID     int    `json:"u"`
	GID     int    `json:"g"`
	Target  string `json:"l,omitempty"` // a symlink's
}

// treeChunk is one data frame of a tree's inventory.
type treeChunk struct {
	Entries []TreeEntry `json:"entries"`
}

// Bounds on an inventory, on both sides: a tree larger than this is an
// error, not a partial inventory.
const (
	MaxTreeEntries   = 1 << 18
	MaxTreeBytes     = 64 << 20 // of paths and link targets, together
	maxTreePath      = 4096
	treeChunkEntries = 1024
)

// ErrTreeTooLarge is wrapped when a tree is beyond MaxTreeEntries or
// MaxTreeBytes.
var ErrTreeTooLarge = errors.New("the tree is too large for an inventory")

// serveTree walks req.Path, entering the mount points in req.Mounts, and
// streams its entries as treeChunk data frames, then End.
func serveTree(ctx context.Context, c *Conn, req *Request) error {
	root := filepath.Clean(req.Path)
	st, err := os.Lstat(root)
	if err != nil {
		return opError("tree", root, err)
	}
	if !st.IsDir() {
		return opError("tree", root, syscall.ENOTDIR)
	}
	if err := reply(c, Empty{}); err != nil {
		return nil
	}
	dev := st.Sys().(*syscall.Stat_t).Dev
	var chunk []TreeEntry
	n, bytes := 0, 0
	flush := func() error {
		if len(chunk) == 0 {
			return nil
		}
		err := c.WriteJSON(FrameData, treeChunk{Entries: chunk})
		chunk = chunk[:0]
		return err
	}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if path == root {
			return err
		}
		if err != nil {
			// Gone meanwhile, or unreadable: what it was is not known.
			if d != nil && d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil
		}
		sys := info.Sys().(*syscall.Stat_t)
		if d.IsDir() && sys.Dev != dev && !slices.Contains(req.Mounts, path) {
			return fs.SkipDir // another file system
		}
		rel, _ := filepath.Rel(root, path)
		e := TreeEntry{Path: filepath.ToSlash(rel), Mode: uint32(info.Mode()), Size: info.Size(),
			MtimeNs: sys.Mtim.Nano(), CtimeNs: sys.Ctim.Nano(), Ino: sys.Ino, UID: int(sys.Uid), GID: int(sys.Gid)}
		if d.IsDir() {
			e.Size = 0 // a directory's size says nothing of its entries
		}
		if info.Mode()&fs.ModeSymlink != 0 {
			e.Target, _ = os.Readlink(path)
		}
		n++
		bytes += len(e.Path) + len(e.Target)
		if n > MaxTreeEntries || bytes > MaxTreeBytes {
			return fmt.Errorf("tree %s: %w (at most %d entries and %d bytes of paths)", root, ErrTreeTooLarge, MaxTreeEntries, MaxTreeBytes)
		}
		if chunk = append(chunk, e); len(chunk) == treeChunkEntries {
			return flush()
		}
		return nil
	})
	if err == nil {
		err = flush()
	}
	if err != nil {
		c.WriteError(err)
		return nil
	}
	c.WriteFrame(FrameEnd, nil)
	return nil
}

// Tree returns the inventory of the guest's directory root: every entry
// below it on its file system, and below the mount points in mounts
// (absolute paths), by path. A tree beyond MaxTreeEntries or MaxTreeBytes
// is an error wrapping ErrTreeTooLarge.
func (cl *Client) Tree(ctx context.Context, root string, mounts []string) ([]TreeEntry, error) {
	c, _, done, err := cl.openStream(ctx, Request{Op: OpTree, Path: root, Mounts: mounts})
	if err != nil {
		return nil, err
	}
	defer done()
	var out []TreeEntry
	bytes := 0
	for {
		t, b, err := c.ReadFrame()
		if err != nil {
			return nil, ctxErr(ctx, fmt.Errorf("agent: tree %s: %w", root, err))
		}
		if t == FrameEnd {
			return out, nil
		}
		var ch treeChunk
		if err := expectJSON(t, b, FrameData, &ch); err != nil {
			return nil, fmt.Errorf("agent: tree %s: %w", root, err)
		}
		for _, e := range ch.Entries {
			if err := e.Check(); err != nil {
				return nil, fmt.Errorf("agent: tree %s: %w", root, err)
			}
			bytes += len(e.Path) + len(e.Target)
		}
		if out = append(out, ch.Entries...); len(out) > MaxTreeEntries || bytes > MaxTreeBytes {
			return nil, fmt.Errorf("agent: tree %s: %w (at most %d entries and %d bytes of paths)", root, ErrTreeTooLarge, MaxTreeEntries, MaxTreeBytes)
		}
	}
}

// Check refuses an entry no walk makes: an empty, absolute, unclean or
// overlong path, or an overlong link target.
func (e *TreeEntry) Check() error {
	if e.Path == "" || len(e.Path) > maxTreePath || len(e.Target) > maxTreePath || strings.HasPrefix(e.Path, "/") ||
		e.Path != filepath.ToSlash(filepath.Clean(e.Path)) || e.Path == ".." || strings.HasPrefix(e.Path, "../") || strings.ContainsRune(e.Path, 0) {
		return fmt.Errorf("bad entry %.100q", e.Path)
	}
	return nil
}
