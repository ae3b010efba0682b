package agent

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestTree: a tree's inventory lists every entry below its root with what
// tells a change (size, times, inode, owner, a link's target), a
// directory's size left out; a change shows in the next inventory.
func TestTree(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "a", "b"), 0o755)
	os.WriteFile(filepath.Join(root, "a", "b", "f"), []byte("hello"), 0o640)
	os.Symlink("a/b/f", filepath.Join(root, "l"))
	got, err := cl.Tree(ctx, root, nil)
	if err != nil {
		t.Fatal(err)
	}
	byPath := map[string]TreeEntry{}
	for _, e := range got {
		byPath[e.Path] = e
	}
	if len(got) != 4 || len(byPath) != 4 {
		t.Fatalf("Tree = %+v; want a, a/b, a/b/f and l", got)
	}
	f := byPath["a/b/f"]
	var st unix.Stat_t
	unix.Lstat(filepath.Join(root, "a", "b", "f"), &st)
	if f.Size != 5 || fs.FileMode(f.Mode).Perm() != 0o640 || f.Ino != st.Ino || f.MtimeNs != st.Mtim.Nano() || f.CtimeNs != st.Ctim.Nano() || f.UID != os.Getuid() {
		t.Errorf("a/b/f = %+v; want its size, mode, inode, times and owner (%+v)", f, st)
	}
	if l := byPath["l"]; l.Target != "a/b/f" || fs.FileMode(l.Mode)&fs.ModeSymlink == 0 {
		t.Errorf("l = %+v; want a symlink to a/b/f", l)
	}
	if d := byPath["a/b"]; !fs.FileMode(d.Mode).IsDir() || d.Size != 0 {
		t.Errorf("a/b = %+v; want a directory of size 0", d)
	}
	os.WriteFile(filepath.Join(root, "a", "b", "f"), []byte("hello, again"), 0o640)
	again, err := cl.Tree(ctx, root, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range again {
		if e.Path == "a/b/f" && (e.Size != 12 || e.CtimeNs == f.CtimeNs && e.MtimeNs == f.MtimeNs) {
			t.Errorf("a/b/f after a write = %+v; want its new size and times", e)
		}
	}
	if _, err := cl.Tree(ctx, filepath.Join(root, "l"), nil); err == nil {
		t.Error("Tree of a symlink: no error; want not a directory")
	}
}

// TestTreeBounds: the client refuses an entry no walk makes and a tree
// beyond the bounds, whatever the guest sends.
func TestTreeBounds(t *testing.T) {
	for _, p := range []string{"", "/etc/passwd", "../x", "a/../../x", "a//b", strings.Repeat("x", maxTreePath+1), "a\x00b"} {
		e := TreeEntry{Path: p}
		if e.Check() == nil {
			t.Errorf("entry %.40q taken", p)
		}
	}
	for _, p := range []string{"a", "a/b", ".x"} {
		e := TreeEntry{Path: p}
		if err := e.Check(); err != nil {
			t.Errorf("entry %q refused: %v", p, err)
		}
	}
}
