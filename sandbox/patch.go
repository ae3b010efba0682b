package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"

	"github.com/capsa-sandbox/capsa/agent"
)

// PatchOp is what a Patch does.
type PatchOp int

const (
	// PatchWrite writes Data to Path (replacing a file there).
	PatchWrite PatchOp = iota + 1
	// PatchMkdir makes the directory Path and its parents.
	PatchMkdir
	// PatchSymlink makes Path a symlink to Target.
	PatchSymlink
	// PatchRemove removes Path and everything under it; a missing Path
	// is fine.
	PatchRemove
	// PatchCopy copies the host file or directory Source to Path: the
	// tree, regular files (streamed), symlinks as they are, and modes.
	PatchCopy
)

func (o PatchOp) String() string {
	switch o {
	case PatchWrite:
		return "write"
	case PatchMkdir:
		return "mkdir"
	case PatchSymlink:
		return "symlink"
	case PatchRemove:
		return "remove"
	case PatchCopy:
		return "copy"
	}
	return fmt.Sprintf("PatchOp(%d)", int(o))
}

// Patch is one change to the sandbox's root filesystem, made before its
// main process starts (microsandbox's rootfs patches). In an image
// sandbox it lands in the sandbox's own writable layer: the image is never
// changed. Parents of Path are made as needed.
type Patch struct {
	Op     PatchOp
	Path   string      // the absolute guest path it changes
	Data   []byte      // PatchWrite: the content
	Target string      // PatchSymlink: where the link points
	Source string      // PatchCopy: the host file or directory
	Mode   fs.FileMode // PatchWrite, PatchMkdir: permissions; 0 means 0644 or 0755
	// Owner owns what a PatchWrite, PatchMkdir, PatchSymlink or PatchCopy
	// makes (every entry of a copy); nil leaves it root's.
	Owner *agent.Owner
}

// MaxPatchData bounds the data a PatchWrite holds in memory; copy bigger
// files with PatchCopy, which streams them.
const MaxPatchData = 16 << 20

// Patch adds changes to make to the root filesystem before the main
// process starts, in order.
func (b *Builder) Patch(patches ...Patch) *Builder {
	for _, p := range patches {
		if err := checkPatch(p); err != nil {
			b.c.errs = append(b.c.errs, err)
			continue
		}
		if p.Op == PatchCopy {
			// Read once the guest runs, by a VMM that may by then be
			// jailed at / (package confine): a relative path would
			// name another file there.
			abs, err := filepath.Abs(p.Source)
			if err != nil {
				b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: copy patch to %s: %w", p.Path, err))
				continue
			}
			p.Source = abs
		}
		b.c.Patches = append(b.c.Patches, p)
	}
	return b
}

// CopyIn copies the host file or directory hostPath to guestPath before
// the main process starts (a PatchCopy).
func (b *Builder) CopyIn(hostPath, guestPath string) *Builder {
	return b.Patch(Patch{Op: PatchCopy, Source: hostPath, Path: guestPath})
}

// checkPatch refuses a patch that cannot work, before anything boots.
func checkPatch(p Patch) error {
	if !path.IsAbs(p.Path) {
		return fmt.Errorf("sandbox: %v patch: guest path %q must be absolute", p.Op, p.Path)
	}
	if path.Clean(p.Path) == "/" && p.Op != PatchCopy {
		return fmt.Errorf("sandbox: %v patch: cannot change / itself", p.Op)
	}
	if p.Owner != nil && (p.Owner.UID < 0 || p.Owner.GID < 0) {
		return fmt.Errorf("sandbox: %v patch of %s: owner %d:%d must not be negative", p.Op, p.Path, p.Owner.UID, p.Owner.GID)
	}
	switch p.Op {
	case PatchWrite:
		if len(p.Data) > MaxPatchData {
			return fmt.Errorf("sandbox: write patch of %s: %d bytes is more than %d (use a copy patch)", p.Path, len(p.Data), MaxPatchData)
		}
	case PatchMkdir, PatchRemove:
	case PatchSymlink:
		if p.Target == "" {
			return fmt.Errorf("sandbox: symlink patch of %s: no target", p.Path)
		}
	case PatchCopy:
		if _, err := os.Lstat(p.Source); err != nil {
			return fmt.Errorf("sandbox: copy patch to %s: %w", p.Path, err)
		}
	default:
		return fmt.Errorf("sandbox: patch of %s: unknown operation %v", p.Path, p.Op)
	}
	return nil
}

// applyPatches makes the patches through the agent, in order.
func applyPatches(ctx context.Context, cl *agent.Client, patches []Patch) error {
	for _, p := range patches {
		if err := applyPatch(ctx, cl, p); err != nil {
			return fmt.Errorf("sandbox: %v patch of %s: %w", p.Op, p.Path, err)
		}
	}
	return nil
}

func applyPatch(ctx context.Context, cl *agent.Client, p Patch) error {
	dst := path.Clean(p.Path)
	// Mkdir makes its own parents; Remove needs none.
	if p.Op != PatchRemove && p.Op != PatchMkdir && dst != "/" {
		if err := cl.Mkdir(ctx, path.Dir(dst), 0o755, true); err != nil {
			return err
		}
	}
	owner := func(q string) error {
		if p.Owner == nil {
			return nil
		}
		return cl.Chown(ctx, q, p.Owner.UID, p.Owner.GID)
	}
	switch p.Op {
	case PatchWrite:
		if err := cl.WriteFile(ctx, dst, orMode(p.Mode, 0o644), bytes.NewReader(p.Data)); err != nil {
			return err
		}
		return owner(dst)
	case PatchMkdir:
		if err := cl.Mkdir(ctx, dst, orMode(p.Mode, 0o755), true); err != nil {
			return err
		}
		return owner(dst)
	case PatchSymlink:
		if err := cl.Symlink(ctx, p.Target, dst); err != nil {
			return err
		}
		return owner(dst)
	case PatchRemove:
		return cl.Remove(ctx, dst, true)
	case PatchCopy:
		return copyIn(ctx, cl, p.Source, dst, owner)
	}
	return fmt.Errorf("unknown operation %v", p.Op)
}

// copyIn copies the host tree src to dst in the guest. Files are streamed
// from disk; other kinds (devices, sockets) are refused by name.
func copyIn(ctx context.Context, cl *agent.Client, src, dst string, owner func(string) error) error {
	return filepath.WalkDir(src, func(hp string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, hp)
		if err != nil {
			return err
		}
		gp := path.Join(dst, filepath.ToSlash(rel))
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			if err := cl.Mkdir(ctx, gp, info.Mode().Perm(), true); err != nil {
				return err
			}
			// Mkdir leaves an existing directory's mode as it is.
		case d.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(hp)
			if err != nil {
				return err
			}
			if err := cl.Symlink(ctx, target, gp); err != nil {
				return err
			}
		case d.Type().IsRegular():
			f, err := os.Open(hp)
			if err != nil {
				return err
			}
			err = cl.WriteFile(ctx, gp, info.Mode().Perm(), f)
			f.Close()
			if err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s: cannot copy a %v", hp, d.Type())
		}
		return owner(gp)
	})
}

func orMode(m, def fs.FileMode) fs.FileMode {
	if m.Perm() == 0 {
		return def
	}
	return m.Perm()
}
