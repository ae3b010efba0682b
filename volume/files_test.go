package volume

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestFiles: the host-side file API over a volume makes, writes, lists,
// reads, changes and removes files as a guest would, charged to the
// quota, and reaches nothing outside the volume.
func TestFiles(t *testing.T) {
	r, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Create("v", 256<<10); err != nil {
		t.Fatal(err)
	}
	f, err := r.OpenFiles("v", 1000, 1000, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if e, err := f.MakeDir("/a/b", Attrs{}, true); err != nil || e.Type != "directory" || e.Path != "/a/b" || e.UID != 1000 {
		t.Fatalf("MakeDir(/a/b, parents) = %+v, %v; want a directory shown as uid 1000's", e, err)
	}
	if _, err := f.MakeDir("/a/b", Attrs{}, false); !errors.Is(err, fs.ErrExist) {
		t.Errorf("MakeDir of an existing directory = %v; want EEXIST", err)
	}
	if _, err := f.MakeDir("/x/y", Attrs{}, false); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("MakeDir without its parent = %v; want ENOENT", err)
	}
	mode := uint32(0o600)
	e, err := f.Write("a/b/f.txt", strings.NewReader("hello"), Attrs{Mode: &mode}, false)
	if err != nil || e.Size != 5 || e.Type != "file" || e.Mode != 0o600 || e.Name != "f.txt" {
		t.Fatalf("Write = %+v, %v; want a 5-byte file of mode 0600", e, err)
	}
	if _, err := f.Write("/a/b/f.txt", strings.NewReader("again"), Attrs{}, false); !errors.Is(err, fs.ErrExist) {
		t.Errorf("Write over a file without overwrite = %v; want EEXIST", err)
	}
	if e, err := f.Write("/a/b/f.txt", strings.NewReader("hi"), Attrs{}, true); err != nil || e.Size != 2 {
		t.Errorf("Write with overwrite = %+v, %v; want 2 bytes", e, err)
	}
	rc, size, err := f.Open("/a/b/f.txt")
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || string(b) != "hi" || size != 2 {
		t.Errorf("Open and read = %q (size %d), %v; want hi", b, size, err)
	}
	if _, _, err := f.Open("/a"); !errors.Is(err, syscall.EISDIR) {
		t.Errorf("Open of a directory = %v; want EISDIR", err)
	}
	list, err := f.List("/", 3)
	if err != nil || len(list) != 3 || list[0].Path != "/a" || list[1].Path != "/a/b" || list[2].Path != "/a/b/f.txt" {
		t.Errorf("List(/, 3) = %+v, %v; want /a, /a/b, /a/b/f.txt", list, err)
	}
	if list, err := f.List("/", 1); err != nil || len(list) != 1 {
		t.Errorf("List(/, 1) = %+v, %v; want /a alone", list, err)
	}
	setuid := uint32(0o4755)
	if _, err := f.SetAttrs("/a/b/f.txt", Attrs{Mode: &setuid}); !errors.Is(err, ErrBadMode) {
		t.Errorf("a set-uid mode: %v; want ErrBadMode", err)
	}
	// A chown is kept as the file's owner (p9fs's owner attribute, on
	// a host file system with user attributes, as this test's).
	other := uint32(4242)
	if e, err := f.SetAttrs("/a/b/f.txt", Attrs{UID: &other}); err != nil || e.UID != 4242 || e.GID != 1000 {
		t.Errorf("a chown to uid 4242 = %+v, %v; want the file shown as 4242:1000", e, err)
	}
	rw := uint32(0o664)
	if e, err := f.SetAttrs("/a/b/f.txt", Attrs{Mode: &rw}); err != nil || e.Mode != 0o664 {
		t.Errorf("SetAttrs(mode 0664) = %+v, %v", e, err)
	}

	// The quota: a write past it fails whole, and the file it made goes.
	used0, _, _ := f.m.Usage()
	if _, err := f.Write("/big", bytes.NewReader(make([]byte, 512<<10)), Attrs{}, false); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("a write past the quota = %v; want ENOSPC", err)
	}
	if _, err := f.Stat("/big"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the file of the failed write: %v; want it gone", err)
	}
	if used, _, _ := f.m.Usage(); used != used0 {
		t.Errorf("usage after the failed write = %d; want %d as before", used, used0)
	}

	// Nothing outside: bad paths, and a link the guest planted.
	for _, p := range []string{"../v", "/a/../../x", "/a/./b", "a\x00b", strings.Repeat("/d", MaxPathDepth+1)} {
		if _, err := f.Stat(p); !errors.Is(err, ErrBadPath) {
			t.Errorf("Stat(%.40q) = %v; want ErrBadPath", p, err)
		}
	}
	info, err := r.Get("v")
	if err != nil {
		t.Fatal(err)
	}
	outside := t.TempDir()
	os.WriteFile(filepath.Join(outside, "secret"), []byte("host"), 0o600)
	if err := os.Symlink(outside, filepath.Join(info.Path, "link")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Stat("/link/secret"); err == nil {
		t.Error("Stat through a symlink reached the host")
	}
	if _, err := f.Write("/link/planted", strings.NewReader("x"), Attrs{}, false); err == nil {
		t.Error("Write through a symlink reached the host")
	}
	if _, err := os.Stat(filepath.Join(outside, "planted")); err == nil {
		t.Error("a file was planted outside the volume")
	}
	if e, err := f.Stat("/link"); err != nil || e.Type != "symlink" || e.Target != outside {
		t.Errorf("Stat(/link) = %+v, %v; want the symlink itself", e, err)
	}

	// Remove: a tree, with its charge; not the top.
	if err := f.Remove("/a"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Stat("/a"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("/a after Remove: %v; want it gone", err)
	}
	if err := f.Remove("/"); !errors.Is(err, ErrBadPath) {
		t.Errorf("Remove(/) = %v; want ErrBadPath", err)
	}
	if err := f.Remove("/link"); err != nil {
		t.Errorf("Remove(/link) = %v", err)
	}
	if _, err := os.Stat(filepath.Join(outside, "secret")); err != nil {
		t.Errorf("removing the link touched its target: %v", err)
	}
	// The charge is what the files take, less the link the host made
	// behind the file server's back (a host-side change is not counted
	// while the volume is mounted) and the API then removed.
	count, err := Count(info.Path)
	if used, _, _ := f.m.Usage(); err != nil || used != count-4096 {
		t.Errorf("usage with the volume empty again = %d; want %d, what it takes (%v) less the uncounted link's 4096", used, count-4096, err)
	}

}

// FuzzSplitPath: whatever path the file API is given, the names it walks
// are single, real names (no slash, NUL, "." or ".."), at most
// MaxPathDepth of them, and a path it accepts rejoins to itself cleaned.
func FuzzSplitPath(f *testing.F) {
	for _, s := range []string{"", "/", "/a/b", "a//b/", "../x", "/a/./b", "a\x00b", strings.Repeat("/d", MaxPathDepth+1)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		names, err := splitPath(p)
		if err != nil {
			if !errors.Is(err, ErrBadPath) {
				t.Fatalf("splitPath(%q) = %v; want ErrBadPath", p, err)
			}
			return
		}
		if len(names) > MaxPathDepth {
			t.Fatalf("splitPath(%q): %d names", p, len(names))
		}
		for _, n := range names {
			if n == "" || n == "." || n == ".." || strings.ContainsAny(n, "/\x00") {
				t.Fatalf("splitPath(%q) gave the name %q", p, n)
			}
		}
		if j := joinPath(names); j != filepath.Clean("/"+p) {
			t.Fatalf("splitPath(%q) rejoins to %q; want %q", p, j, filepath.Clean("/"+p))
		}
	})
}
