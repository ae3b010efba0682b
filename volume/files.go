package volume

// Files: a volume's files reached from the host, for a host-side API
// (capsa serve's E2B volume file API), the way a sandbox's guest reaches
// them: through the same file server (package p9fs) over the volume's
// data directory, with the volume mounted for the while. So every change
// is charged to the quota by the same rule, from the same lock, as a
// guest's; a file some sandbox still holds stays charged after it is
// removed; and no path leaves the volume: names are walked one at a time,
// a link never followed. Writing a second file server here would mean a
// second copy of those rules, each to be kept right.

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"syscall"
	"time"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/p9fs"
)

// Bounds of the file API: a path's length and depth, what one List
// returns, and how deep a Remove goes.
const (
	MaxPathLen     = 4096
	MaxPathDepth   = 128
	MaxListEntries = 10000
	maxRemoveDepth = MaxPathDepth
)

// Files is a mounted volume's files, for the host.
type Files struct {
	m    *Mount
	a    p9.Attacher
	root p9.File
}

// OpenFiles mounts the volume name for its files (Close lets it go).
// Files the host's user owns there are shown as owned by uid and gid, as
// a sandbox that mounts it with the same ids sees them.
func (r *Root) OpenFiles(name string, uid, gid uint32, log *slog.Logger) (*Files, error) {
	m, err := r.Mount(name, log)
	if err != nil {
		return nil, err
	}
	a, err := p9fs.New(m.DataDir(), p9fs.Options{Quota: m, UID: uid, GID: gid, Logger: log})
	if err != nil {
		m.Close()
		return nil, fmt.Errorf("volume: files of %s: %w", name, err)
	}
	root, err := a.Attach()
	if err != nil {
		a.(io.Closer).Close()
		m.Close()
		return nil, fmt.Errorf("volume: files of %s: %w", name, errno(err))
	}
	return &Files{m: m, a: a, root: root}, nil
}

// Close lets the volume go.
func (f *Files) Close() error {
	return errors.Join(f.root.Close(), f.a.(io.Closer).Close(), f.m.Close())
}

// Entry describes a file of a volume.
type Entry struct {
	Name   string // its last name; "" for the volume's top
	Path   string // from the volume's top, starting with /
	Type   string // file, directory, symlink or unknown
	Size   int64
	Mode   uint32 // the permission bits
	UID    uint32
	GID    uint32
	ATime  time.Time
	MTime  time.Time
	CTime  time.Time
	Target string // a symlink's
}

// errno turns the file server's errors into syscall.Errno, which
// errors.Is matches against fs.ErrNotExist, fs.ErrExist and
// fs.ErrPermission, and callers against syscall.ENOSPC and the like.
func errno(err error) error {
	var e linux.Errno
	if errors.As(err, &e) {
		return syscall.Errno(e)
	}
	return err
}

// ErrBadPath and ErrBadMode are the errors for a path and a mode the
// file API refuses.
var (
	ErrBadPath = errors.New("bad path")
	ErrBadMode = errors.New("bad mode")
	// ErrTooMany is List's error past MaxListEntries.
	ErrTooMany = errors.New("too many entries")
)

// splitPath splits p, taken from the volume's top whether or not it
// starts with /, into names; "" and "/" are the top. A "." or ".." name,
// a NUL, and paths over MaxPathLen or MaxPathDepth are refused.
func splitPath(p string) ([]string, error) {
	if len(p) > MaxPathLen || strings.IndexByte(p, 0) >= 0 {
		return nil, fmt.Errorf("%w: %.64q", ErrBadPath, p)
	}
	var names []string
	for _, n := range strings.Split(p, "/") {
		switch n {
		case "":
			continue
		case ".", "..":
			return nil, fmt.Errorf("%w: %q holds %q", ErrBadPath, p, n)
		}
		names = append(names, n)
	}
	if len(names) > MaxPathDepth {
		return nil, fmt.Errorf("%w: %d names deep, at most %d", ErrBadPath, len(names), MaxPathDepth)
	}
	return names, nil
}

func joinPath(names []string) string { return "/" + strings.Join(names, "/") }

// walk returns a File for names (a copy of the top for none).
func (f *Files) walk(names []string) (p9.File, error) {
	_, file, err := f.root.Walk(names)
	return file, errno(err)
}

// lookup returns the names of the path p and a File for it (the caller
// closes it).
func (f *Files) lookup(p string) ([]string, p9.File, error) {
	names, err := splitPath(p)
	if err != nil {
		return nil, nil, err
	}
	file, err := f.walk(names)
	return names, file, err
}

// entry describes file, found at names.
func entry(file p9.File, names []string) (Entry, error) {
	_, _, a, err := file.GetAttr(p9.AttrMaskAll)
	if err != nil {
		return Entry{}, errno(err)
	}
	e := Entry{
		Path: joinPath(names), Size: int64(a.Size), Mode: uint32(a.Mode.Permissions()),
		UID: uint32(a.UID), GID: uint32(a.GID), Type: "unknown",
		ATime: time.Unix(int64(a.ATimeSeconds), int64(a.ATimeNanoSeconds)).UTC(),
		MTime: time.Unix(int64(a.MTimeSeconds), int64(a.MTimeNanoSeconds)).UTC(),
		CTime: time.Unix(int64(a.CTimeSeconds), int64(a.CTimeNanoSeconds)).UTC(),
	}
	if len(names) > 0 {
		e.Name = names[len(names)-1]
	}
	switch {
	case a.Mode.IsRegular():
		e.Type = "file"
	case a.Mode.IsDir():
		e.Type = "directory"
	case a.Mode.IsSymlink():
		e.Type = "symlink"
		if t, err := file.Readlink(); err == nil {
			e.Target = t
		}
	}
	return e, nil
}

// Stat describes the file at p.
func (f *Files) Stat(p string) (Entry, error) {
	names, file, err := f.lookup(p)
	if err != nil {
		return Entry{}, err
	}
	defer file.Close()
	return entry(file, names)
}

// List describes what the directory p holds, and with depth over 1 what
// its directories hold, that many levels down; at most MaxListEntries.
func (f *Files) List(p string, depth int) ([]Entry, error) {
	names, err := splitPath(p)
	if err != nil {
		return nil, err
	}
	if depth < 1 {
		depth = 1
	}
	out := []Entry{}
	err = f.list(names, depth, &out)
	return out, err
}

func (f *Files) list(names []string, depth int, out *[]Entry) error {
	dir, err := f.walk(names)
	if err != nil {
		return err
	}
	defer dir.Close()
	kids, err := readDir(dir)
	if err != nil {
		return err
	}
	for _, k := range kids {
		if len(*out) >= MaxListEntries {
			return fmt.Errorf("volume: list %s: %w: more than %d (list less deep)", joinPath(names), ErrTooMany, MaxListEntries)
		}
		kn := append(names[:len(names):len(names)], k)
		file, err := f.walk(kn)
		if err != nil {
			continue // gone since
		}
		e, err := entry(file, kn)
		file.Close()
		if err != nil {
			continue
		}
		*out = append(*out, e)
		if e.Type == "directory" && depth > 1 && len(kn) < MaxPathDepth {
			if err := f.list(kn, depth-1, out); err != nil {
				return err
			}
		}
	}
	return nil
}

// readDir lists the names in the directory dir (a File not yet open),
// without . and ..; ENOTDIR if it is not one.
func readDir(dir p9.File) ([]string, error) {
	if _, _, err := dir.Open(p9.ReadOnly); err != nil {
		return nil, errno(err)
	}
	var names []string
	var off uint64
	for {
		ents, err := dir.Readdir(off, 64<<10)
		if err != nil {
			return nil, errno(err)
		}
		if len(ents) == 0 {
			return names, nil
		}
		for _, e := range ents {
			off = e.Offset
			if e.Name != "." && e.Name != ".." {
				names = append(names, e.Name)
			}
			if len(names) > MaxListEntries {
				return nil, fmt.Errorf("volume: %w: a directory of more than %d", ErrTooMany, MaxListEntries)
			}
		}
	}
}

// Open opens the regular file p for reading and says its size.
func (f *Files) Open(p string) (io.ReadCloser, int64, error) {
	names, file, err := f.lookup(p)
	if err != nil {
		return nil, 0, err
	}
	e, err := entry(file, names)
	if err == nil && e.Type != "file" {
		err = syscall.EISDIR
		if e.Type != "directory" {
			err = syscall.EINVAL
		}
	}
	if err == nil {
		_, _, err = file.Open(p9.ReadOnly)
		err = errno(err)
	}
	if err != nil {
		file.Close()
		return nil, 0, err
	}
	return &reader{f: file}, e.Size, nil
}

// reader reads an open File from its start.
type reader struct {
	f   p9.File
	off int64
}

func (r *reader) Read(b []byte) (int, error) {
	n, err := r.f.ReadAt(b, r.off)
	r.off += int64(n)
	if n == 0 && err == nil {
		return 0, io.EOF
	}
	return n, errno(err)
}

func (r *reader) Close() error { return r.f.Close() }

// Attrs are a file's ids and permission bits to set; nil: as made (the
// host user's, shown as the volume's ids; the mode Write or MakeDir
// defaults to).
type Attrs struct {
	UID, GID, Mode *uint32
}

// check refuses a mode beyond the permission bits: no set-id or sticky
// bits from the host side.
func (a Attrs) check() error {
	if a.Mode != nil && *a.Mode&^0o777 != 0 {
		return fmt.Errorf("%w %#o: only the permission bits (0777)", ErrBadMode, *a.Mode)
	}
	return nil
}

// set sets a's attributes on file.
func (a Attrs) set(file p9.File) error {
	var mask p9.SetAttrMask
	var attr p9.SetAttr
	if a.Mode != nil {
		mask.Permissions, attr.Permissions = true, p9.FileMode(*a.Mode)
	}
	if a.UID != nil {
		mask.UID, attr.UID = true, p9.UID(*a.UID)
	}
	if a.GID != nil {
		mask.GID, attr.GID = true, p9.GID(*a.GID)
	}
	if mask.Empty() {
		return nil
	}
	return errno(file.SetAttr(mask, attr))
}

// SetAttrs sets the attributes of the file at p, as a guest's chmod and
// chown may (ids only to the volume's, or as they are).
func (f *Files) SetAttrs(p string, a Attrs) (Entry, error) {
	if err := a.check(); err != nil {
		return Entry{}, err
	}
	names, file, err := f.lookup(p)
	if err != nil {
		return Entry{}, err
	}
	defer file.Close()
	if err := a.set(file); err != nil {
		return Entry{}, err
	}
	return entry(file, names)
}

// MakeDir makes the directory p (mode 0755 unless a says), and with
// parents those above it that are missing; EEXIST if p exists, unless
// parents and it is a directory.
func (f *Files) MakeDir(p string, a Attrs, parents bool) (Entry, error) {
	names, dir, mode, err := f.target(p, a, parents, syscall.EEXIST, 0o755)
	if err != nil {
		return Entry{}, err
	}
	defer dir.Close()
	base := names[len(names)-1]
	if _, err := dir.Mkdir(base, p9.FileMode(mode), p9.NoUID, p9.NoGID); err != nil {
		if err = errno(err); !(parents && errors.Is(err, syscall.EEXIST)) {
			return Entry{}, err
		}
		if e, serr := f.Stat(p); serr != nil || e.Type != "directory" {
			return Entry{}, err
		}
	}
	file, err := f.walk(names)
	if err != nil {
		return Entry{}, err
	}
	defer file.Close()
	if err := (Attrs{UID: a.UID, GID: a.GID}).set(file); err != nil {
		return Entry{}, err
	}
	return entry(file, names)
}

// target checks a and the path p of an entry to make: its names, the
// directory above it (with parents, made where missing; the caller
// closes it) and the mode a gives, else def. top is the error for the
// volume's top itself.
func (f *Files) target(p string, a Attrs, parents bool, top error, def uint32) ([]string, p9.File, uint32, error) {
	if err := a.check(); err != nil {
		return nil, nil, 0, err
	}
	names, err := splitPath(p)
	if err != nil {
		return nil, nil, 0, err
	}
	if len(names) == 0 {
		return nil, nil, 0, top
	}
	dir, err := f.parent(names, parents)
	if err != nil {
		return nil, nil, 0, err
	}
	if a.Mode != nil {
		def = *a.Mode
	}
	return names, dir, def, nil
}

// parent returns the directory above names, with mkdirs making what is
// missing of it.
func (f *Files) parent(names []string, mkdirs bool) (p9.File, error) {
	up := names[:len(names)-1]
	if !mkdirs {
		return f.walk(up)
	}
	dir, err := f.walk(nil)
	if err != nil {
		return nil, err
	}
	for _, n := range up {
		_, next, err := dir.Walk([]string{n})
		if errors.Is(errno(err), syscall.ENOENT) {
			if _, err = dir.Mkdir(n, 0o755, p9.NoUID, p9.NoGID); err == nil || errors.Is(errno(err), syscall.EEXIST) {
				_, next, err = dir.Walk([]string{n})
			}
		}
		dir.Close()
		if err != nil {
			return nil, errno(err)
		}
		dir = next
	}
	return dir, nil
}

// Write writes what r gives to the file p (made with mode 0644 unless a
// says), replacing one there only with overwrite (else EEXIST). A write
// the quota has no room for fails with ENOSPC, and a file it made is
// removed again.
func (f *Files) Write(p string, r io.Reader, a Attrs, overwrite bool) (Entry, error) {
	names, dir, mode, err := f.target(p, a, false, syscall.EISDIR, 0o644)
	if err != nil {
		return Entry{}, err
	}
	defer dir.Close()
	base := names[len(names)-1]
	var file p9.File
	made := false
	_, old, err := dir.Walk([]string{base})
	switch err = errno(err); {
	case err == nil:
		if !overwrite {
			old.Close()
			return Entry{}, syscall.EEXIST
		}
		e, err := entry(old, names)
		if err == nil && e.Type != "file" {
			err = syscall.EISDIR
		}
		if err == nil {
			_, _, err = old.Open(p9.WriteOnly | p9.OpenFlags(unix.O_TRUNC))
			err = errno(err)
		}
		if err != nil {
			old.Close()
			return Entry{}, err
		}
		file = old
	case errors.Is(err, syscall.ENOENT):
		if file, _, _, err = dir.Create(base, p9.WriteOnly, p9.FileMode(mode), p9.NoUID, p9.NoGID); err != nil {
			return Entry{}, errno(err)
		}
		made = true
	default:
		return Entry{}, err
	}
	defer file.Close()
	buf := make([]byte, 256<<10)
	var off int64
	for {
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			if _, err := file.WriteAt(buf[:n], off); err != nil {
				if made {
					dir.UnlinkAt(base, 0)
				}
				return Entry{}, errno(err)
			}
			off += int64(n)
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			break
		}
		if rerr != nil {
			if made {
				dir.UnlinkAt(base, 0)
			}
			return Entry{}, rerr
		}
	}
	if err := (Attrs{UID: a.UID, GID: a.GID, Mode: a.Mode}).set(file); err != nil {
		return Entry{}, err
	}
	return entry(file, names)
}

// Remove removes the file at p, a directory with all it holds; not the
// volume's top.
func (f *Files) Remove(p string) error {
	names, err := splitPath(p)
	if err != nil {
		return err
	}
	if len(names) == 0 {
		return fmt.Errorf("%w: the volume's top cannot be removed", ErrBadPath)
	}
	dir, err := f.parent(names, false)
	if err != nil {
		return err
	}
	defer dir.Close()
	return f.remove(dir, names, 0)
}

// remove removes the entry names[last] of dir, what it holds first.
func (f *Files) remove(dir p9.File, names []string, depth int) error {
	base := names[len(names)-1]
	_, file, err := dir.Walk([]string{base})
	if err != nil {
		return errno(err)
	}
	e, err := entry(file, names)
	if err != nil || e.Type != "directory" {
		file.Close()
		if err != nil {
			return err
		}
		return errno(dir.UnlinkAt(base, 0))
	}
	if depth >= maxRemoveDepth {
		file.Close()
		return fmt.Errorf("volume: remove %s: more than %d levels deep", e.Path, maxRemoveDepth)
	}
	_, sub, err := file.Walk(nil)
	if err != nil {
		file.Close()
		return errno(err)
	}
	kids, err := readDir(file)
	file.Close()
	if err != nil {
		sub.Close()
		return err
	}
	for _, k := range kids {
		if err := f.remove(sub, append(names[:len(names):len(names)], k), depth+1); err != nil && !errors.Is(err, syscall.ENOENT) {
			sub.Close()
			return err
		}
	}
	sub.Close()
	return errno(dir.UnlinkAt(base, unix.AT_REMOVEDIR))
}
