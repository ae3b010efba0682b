package sandbox

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/capsa-sandbox/capsa/agent"
)

// maxCopyDepth bounds how deep CopyOut follows a guest's directories.
const maxCopyDepth = 256

// CopyIn copies the host file or directory src to the guest path dst, as
// `docker cp` does: into dst when dst is a directory that exists, else to
// dst itself. Files stream from disk; modes and symlinks are kept.
func (s *Guest) CopyIn(ctx context.Context, src, dst string) error {
	if !path.IsAbs(dst) {
		return fmt.Errorf("sandbox: copy to the guest: %q is not an absolute path", dst)
	}
	if _, err := os.Lstat(src); err != nil {
		return fmt.Errorf("sandbox: copy to the guest: %w", err)
	}
	target := path.Clean(dst)
	if fi, err := s.client.Stat(ctx, target); err == nil && fi.IsDir {
		target = path.Join(target, filepath.Base(filepath.Clean(src)))
	}
	if err := copyIn(ctx, s.client, src, target, func(string) error { return nil }); err != nil {
		return s.explain(fmt.Errorf("sandbox: copy %s to the guest's %s: %w", src, target, err))
	}
	return nil
}

// CopyOut copies the guest file or directory src to the host path dst, as
// `docker cp` does: into dst when dst is a directory that exists, else to
// dst itself, which must not exist. Files stream to disk; permission bits
// (never setuid, setgid or sticky) and symlinks are kept; everything is
// the caller's.
//
// What the guest reports is not trusted: every name must be one plain path
// element, every file is created anew (never written through a symlink or
// over an existing file), and directories nest at most 256 deep.
func (s *Guest) CopyOut(ctx context.Context, src, dst string) error {
	if !path.IsAbs(src) {
		return fmt.Errorf("sandbox: copy from the guest: %q is not an absolute path", src)
	}
	src = path.Clean(src)
	target := dst
	if fi, err := os.Stat(dst); err == nil && fi.IsDir() {
		base := path.Base(src)
		if base == "/" {
			return fmt.Errorf("sandbox: copy from the guest: cannot copy / into %s (name a directory to copy to)", dst)
		}
		target = filepath.Join(dst, base)
	}
	fi, err := s.client.Stat(ctx, src)
	if err != nil {
		return s.explain(fmt.Errorf("sandbox: copy from the guest: %w", err))
	}
	if err := s.copyOut(ctx, src, target, fi, 0); err != nil {
		return s.explain(fmt.Errorf("sandbox: copy the guest's %s to %s: %w", src, target, err))
	}
	return nil
}

func (s *Guest) copyOut(ctx context.Context, gp, hp string, fi *agent.FileInfo, depth int) error {
	perm := fs.FileMode(fi.Mode).Perm()
	switch {
	case fi.IsSymlink:
		if fi.Target == "" || strings.ContainsRune(fi.Target, 0) {
			return fmt.Errorf("%s: a symlink with no usable target", gp)
		}
		return os.Symlink(fi.Target, hp)
	case fi.IsDir:
		if depth >= maxCopyDepth {
			return fmt.Errorf("%s: more than %d directories deep", gp, maxCopyDepth)
		}
		// Writable by us while it fills; its own mode at the end.
		if err := os.Mkdir(hp, 0o700); err != nil {
			return err
		}
		ents, err := s.client.ListDir(ctx, gp)
		if err != nil {
			return err
		}
		seen := make(map[string]bool, len(ents))
		for i := range ents {
			e := &ents[i]
			if e.Name == "" || e.Name == "." || e.Name == ".." || strings.ContainsAny(e.Name, "/\x00") || seen[e.Name] {
				return fmt.Errorf("%s: the guest listed a bad entry name %q", gp, e.Name)
			}
			seen[e.Name] = true
			if err := s.copyOut(ctx, path.Join(gp, e.Name), filepath.Join(hp, e.Name), e, depth+1); err != nil {
				return err
			}
		}
		return os.Chmod(hp, perm)
	case fs.FileMode(fi.Mode).IsRegular():
		f, err := os.OpenFile(hp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, perm)
		if err != nil {
			return err
		}
		_, err = s.client.ReadFile(ctx, gp, f)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(hp)
		}
		return err
	}
	return fmt.Errorf("%s: cannot copy a %v", gp, fs.FileMode(fi.Mode).Type())
}
