package fusefs

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/p9fs"
)

// newFS serves dir over FUSE, as a virtio-fs device does.
func newFS(t *testing.T, dir string, o p9fs.Options) *FS {
	t.Helper()
	a, err := p9fs.New(dir, o)
	if err != nil {
		t.Fatal(err)
	}
	fs, err := New(a, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fs.Close() })
	return fs
}

func hdr(node uint64) fuse.InHeader {
	return fuse.InHeader{NodeId: node, Caller: fuse.Caller{Owner: fuse.Owner{Uid: uint32(os.Getuid()), Gid: uint32(os.Getgid())}}}
}

func lookup(t *testing.T, fs *FS, parent uint64, name string) (fuse.EntryOut, fuse.Status) {
	t.Helper()
	h := hdr(parent)
	var out fuse.EntryOut
	st := fs.Lookup(nil, &h, name, &out)
	return out, st
}

// create makes name in parent with data, as the guest kernel does once
// CREATE and OPEN answer ENOSYS (MKNOD, then WRITE by node), returning its
// node.
func create(t *testing.T, fs *FS, parent uint64, name, data string) uint64 {
	t.Helper()
	in := fuse.MknodIn{InHeader: hdr(parent), Mode: unix.S_IFREG | 0o644}
	var out fuse.EntryOut
	if st := fs.Mknod(nil, &in, name, &out); !st.Ok() {
		t.Fatalf("mknod %s: %v", name, st)
	}
	if data != "" {
		n, st := fs.Write(nil, &fuse.WriteIn{InHeader: hdr(out.NodeId)}, []byte(data))
		if !st.Ok() || int(n) != len(data) {
			t.Fatalf("write %s: %d, %v", name, n, st)
		}
	}
	return out.NodeId
}

func TestFileOperations(t *testing.T) {
	dir := t.TempDir()
	fs := newFS(t, dir, p9fs.Options{})

	// A name that does not exist is a negative entry, kept for the timeout.
	out, st := lookup(t, fs, rootID, "missing")
	if !st.Ok() || out.NodeId != 0 || out.EntryTimeout() == 0 {
		t.Fatalf("lookup of a missing name: node %d, timeout %v, %v; want a negative entry", out.NodeId, out.EntryTimeout(), st)
	}

	// Files are opened by the guest without OPEN: CREATE and OPEN
	// answer ENOSYS.
	var co fuse.CreateOut
	if st := fs.Create(nil, &fuse.CreateIn{InHeader: hdr(rootID), Flags: unix.O_RDWR | unix.O_CREAT}, "x", &co); st != fuse.ENOSYS {
		t.Fatalf("create: %v, want ENOSYS", st)
	}
	var oo fuse.OpenOut
	if st := fs.Open(nil, &fuse.OpenIn{InHeader: hdr(rootID)}, &oo); st != fuse.ENOSYS {
		t.Fatalf("open: %v, want ENOSYS", st)
	}
	a := create(t, fs, rootID, "a", "hello")
	if got, _ := os.ReadFile(filepath.Join(dir, "a")); string(got) != "hello" {
		t.Fatalf("host sees %q, want hello", got)
	}
	buf := make([]byte, 64)
	if r, st := fs.Read(nil, &fuse.ReadIn{InHeader: hdr(a), Size: 64}, buf); !st.Ok() {
		t.Fatalf("read by node: %v", st)
	} else if got, _ := r.Bytes(nil); string(got) != "hello" {
		t.Fatalf("read by node: %q", got)
	}
	// One inode is one node, however it is looked up.
	again, st := lookup(t, fs, rootID, "a")
	if !st.Ok() || again.NodeId != a || again.Size != 5 || again.Mode&unix.S_IFMT != unix.S_IFREG {
		t.Fatalf("lookup a: node %d (created %d), size %d, mode %o, %v", again.NodeId, a, again.Size, again.Mode, st)
	}

	// Truncate by path (no handle).
	var attr fuse.AttrOut
	if st := fs.SetAttr(nil, &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: hdr(a), Valid: fuse.FATTR_SIZE, Size: 2}}, &attr); !st.Ok() || attr.Size != 2 {
		t.Fatalf("truncate: size %d, %v", attr.Size, st)
	}

	// An empty attribute list is empty, not one empty name.
	h := hdr(a)
	if n, st := fs.ListXAttr(nil, &h, nil); !st.Ok() || n != 0 {
		t.Fatalf("listxattr of a new file: %d bytes, %v; want 0", n, st)
	}

	// Renames across directories, and renameat2's flags.
	mk := fuse.MkdirIn{InHeader: hdr(rootID), Mode: 0o755}
	var d fuse.EntryOut
	if st := fs.Mkdir(nil, &mk, "d", &d); !st.Ok() {
		t.Fatalf("mkdir: %v", st)
	}
	if st := fs.Rename(nil, &fuse.RenameIn{InHeader: hdr(rootID), Newdir: d.NodeId}, "a", "b"); !st.Ok() {
		t.Fatalf("rename a to d/b: %v", st)
	}
	cNode := create(t, fs, rootID, "c", "other")
	if st := fs.Rename(nil, &fuse.RenameIn{InHeader: hdr(rootID), Newdir: d.NodeId, Flags: unix.RENAME_NOREPLACE}, "c", "b"); st != fuse.Status(unix.EEXIST) {
		t.Fatalf("rename with RENAME_NOREPLACE over a file: %v, want EEXIST", st)
	}
	if st := fs.Rename(nil, &fuse.RenameIn{InHeader: hdr(rootID), Newdir: d.NodeId, Flags: unix.RENAME_EXCHANGE}, "c", "b"); !st.Ok() {
		t.Fatalf("rename with RENAME_EXCHANGE: %v", st)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "c")); string(got) != "he" {
		t.Fatalf("after the exchange c holds %q, want he", got)
	}

	// A hard link is the same node.
	var l fuse.EntryOut
	if st := fs.Link(nil, &fuse.LinkIn{InHeader: hdr(rootID), Oldnodeid: a}, "hard", &l); !st.Ok() || l.NodeId != a {
		t.Fatalf("link: node %d (target %d), %v", l.NodeId, a, st)
	}

	// The listing has every entry.
	var open fuse.OpenOut
	if st := fs.OpenDir(nil, &fuse.OpenIn{InHeader: hdr(rootID)}, &open); !st.Ok() {
		t.Fatalf("opendir: %v", st)
	}
	list := fuse.NewDirEntryList(make([]byte, 4096), 0)
	if st := fs.ReadDir(nil, &fuse.ReadIn{InHeader: hdr(rootID), Fh: open.Fh, Size: 4096}, list); !st.Ok() {
		t.Fatalf("readdir: %v", st)
	}
	fs.ReleaseDir(&fuse.ReleaseIn{Fh: open.Fh})

	// After the exchange, c is a's inode: the same node.
	c, _ := lookup(t, fs, rootID, "c")
	if c.NodeId != a {
		t.Fatalf("c after the exchange is node %d, want a's %d", c.NodeId, a)
	}

	// Forgetting every lookup releases every node but the root.
	fs.Forget(a, 4) // made, looked up, linked, looked up as c
	fs.Forget(cNode, 1)
	fs.Forget(d.NodeId, 1)
	if n, hs := fs.Nodes(); n != 1 || hs != 0 {
		t.Fatalf("after every forget and release: %d nodes, %d handles; want the root alone", n, hs)
	}
}

// TestNoEscape: a symlink is data; a lookup through one (which only a
// hostile guest kernel sends) never leaves the share.
func TestNoEscape(t *testing.T) {
	dir := t.TempDir()
	outside := t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	fs := newFS(t, dir, p9fs.Options{})
	h := hdr(rootID)
	var l fuse.EntryOut
	if st := fs.Symlink(nil, &h, outside, "l", &l); !st.Ok() {
		t.Fatalf("symlink: %v", st)
	}
	if _, st := lookup(t, fs, l.NodeId, "secret"); st.Ok() {
		t.Fatal("a lookup through a symlink found the file it points to outside the share")
	}
	for _, name := range []string{"..", ".", "a/b", ""} {
		if out, st := lookup(t, fs, rootID, name); st.Ok() && out.NodeId != 0 {
			t.Errorf("lookup of %q answered node %d", name, out.NodeId)
		}
	}
}

// TestReadOnly: a read-only share refuses every change.
func TestReadOnly(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	fs := newFS(t, dir, p9fs.Options{ReadOnly: true})
	var out fuse.EntryOut
	if st := fs.Mknod(nil, &fuse.MknodIn{InHeader: hdr(rootID), Mode: unix.S_IFREG | 0o644}, "new", &out); st != fuse.Status(unix.EROFS) {
		t.Errorf("mknod on a read-only share: %v, want EROFS", st)
	}
	f, _ := lookup(t, fs, rootID, "f")
	if _, st := fs.Write(nil, &fuse.WriteIn{InHeader: hdr(f.NodeId)}, []byte("y")); st != fuse.Status(unix.EROFS) {
		t.Errorf("write on a read-only share: %v, want EROFS", st)
	}
}

// TestFallocate: fallocate(2) by node, as FUSE_FALLOCATE asks.
func TestFallocate(t *testing.T) {
	dir := t.TempDir()
	fs := newFS(t, dir, p9fs.Options{})
	f := create(t, fs, rootID, "f", "")
	if st := fs.Fallocate(nil, &fuse.FallocateIn{InHeader: hdr(f), Length: 8192}); !st.Ok() {
		t.Fatalf("fallocate: %v", st)
	}
	if fi, err := os.Stat(filepath.Join(dir, "f")); err != nil || fi.Size() != 8192 {
		t.Fatalf("after fallocate of 8 KiB: %v, %v", fi.Size(), err)
	}
}

// TestTmpfile: O_TMPFILE makes a file with no name, which LINK names.
func TestTmpfile(t *testing.T) {
	dir := t.TempDir()
	fs := newFS(t, dir, p9fs.Options{})
	in := fuse.CreateIn{InHeader: hdr(rootID), Flags: unix.O_RDWR, Mode: 0o600}
	var out fuse.CreateOut
	if st := fs.Tmpfile(nil, &in, &out); !st.Ok() {
		t.Fatalf("tmpfile: %v", st)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("a tmpfile has a name: %v", ents)
	}
	if out.Fh != 0 {
		t.Fatalf("tmpfile: handle %d, want 0 (I/O by node)", out.Fh)
	}
	if n, st := fs.Write(nil, &fuse.WriteIn{InHeader: hdr(out.NodeId)}, []byte("data")); !st.Ok() || n != 4 {
		t.Fatalf("write: %d, %v", n, st)
	}
	var l fuse.EntryOut
	if st := fs.Link(nil, &fuse.LinkIn{InHeader: hdr(rootID), Oldnodeid: out.NodeId}, "named", &l); !st.Ok() || l.NodeId != out.NodeId {
		t.Fatalf("link of the tmpfile: node %d (tmpfile %d), %v", l.NodeId, out.NodeId, st)
	}
	if got, err := os.ReadFile(filepath.Join(dir, "named")); err != nil || string(got) != "data" {
		t.Fatalf("the linked tmpfile holds %q, %v", got, err)
	}
	// A read-only tmpfile is refused, as open(2) refuses it.
	in.Flags = unix.O_RDONLY
	if st := fs.Tmpfile(nil, &in, &out); st != fuse.EINVAL {
		t.Fatalf("read-only tmpfile: %v, want EINVAL", st)
	}
}

// TestKeepNodes: past keepNodes nodes, entries are valid for no time, so
// the guest lets them go once unused.
func TestKeepNodes(t *testing.T) {
	defer func(n int) { keepNodes = n }(keepNodes)
	keepNodes = 2
	dir := t.TempDir()
	for _, name := range []string{"a", "b"} {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	fs := newFS(t, dir, p9fs.Options{})
	if a, _ := lookup(t, fs, rootID, "a"); a.EntryTimeout() == 0 {
		t.Fatal("the first node's entry is valid for no time")
	}
	if b, _ := lookup(t, fs, rootID, "b"); b.NodeId == 0 || b.EntryTimeout() != 0 || b.AttrTimeout() == 0 {
		t.Fatalf("past keepNodes: node %d, entry valid %v, attributes %v; want no entry time", b.NodeId, b.EntryTimeout(), b.AttrTimeout())
	}
}

// plusEntry is one entry of a READDIRPLUS reply, as Linux parses it.
type plusEntry struct {
	name string
	out  fuse.EntryOut
	typ  uint32
	off  uint64
}

// parsePlus reads a READDIRPLUS reply: each entry is a fuse_entry_out,
// then a fuse_dirent (ino, off, namelen, type) and the name, padded to 8.
func parsePlus(t *testing.T, b []byte) []plusEntry {
	t.Helper()
	const entrySize, direntSize = 128, 24
	var out []plusEntry
	for len(b) > 0 {
		if len(b) < entrySize+direntSize {
			t.Fatalf("a READDIRPLUS reply ends in %d bytes, less than an entry", len(b))
		}
		var e plusEntry
		e.out.NodeId = le64(b[0:])
		e.out.EntryValid = le64(b[16:])
		e.out.Attr.Ino = le64(b[40:])
		e.out.Attr.Size = le64(b[48:])
		e.out.Attr.Mode = uint32(le64(b[40+60:]))
		d := b[entrySize:]
		e.off = le64(d[8:])
		n := int(uint32(le64(d[16:])))
		e.typ = uint32(le64(d[20:]))
		e.name = string(d[direntSize : direntSize+n])
		out = append(out, e)
		b = b[entrySize+(direntSize+n+7)&^7:]
	}
	return out
}

func le64(b []byte) uint64 {
	var v uint64
	for i := 7; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

// TestReadDirPlus: each entry of a READDIRPLUS reply but "." and ".." is
// looked up, with its attributes, as LOOKUP would; the lookups counted are
// those of the entries the reply holds, whatever did not fit; past
// keepNodes nodes the entries are plain; and forgetting what was listed
// leaves the root alone.
func TestReadDirPlus(t *testing.T) {
	dir := t.TempDir()
	for i, name := range []string{"a", "bb", "ccc", "dddd"} {
		if err := os.WriteFile(filepath.Join(dir, name), make([]byte, i), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	fs := newFS(t, dir, p9fs.Options{})
	read := func(size int, off uint64) []plusEntry {
		t.Helper()
		var open fuse.OpenOut
		if st := fs.OpenDir(nil, &fuse.OpenIn{InHeader: hdr(rootID)}, &open); !st.Ok() {
			t.Fatalf("opendir: %v", st)
		}
		defer fs.ReleaseDir(&fuse.ReleaseIn{Fh: open.Fh})
		list := fuse.NewDirEntryList(make([]byte, size), off)
		if st := fs.ReadDirPlus(nil, &fuse.ReadIn{InHeader: hdr(rootID), Fh: open.Fh, Offset: off, Size: uint32(size)}, list); !st.Ok() {
			t.Fatalf("readdirplus: %v", st)
		}
		return parsePlus(t, list.Bytes())
	}
	forget := func(ents []plusEntry) {
		for _, e := range ents {
			if e.out.NodeId != 0 {
				fs.Forget(e.out.NodeId, 1)
			}
		}
	}

	all := read(4096, 0)
	seen := map[string]bool{}
	for _, e := range all {
		seen[e.name] = true
		switch {
		case e.name == "." || e.name == "..":
			if e.out.NodeId != 0 {
				t.Errorf("%s: node %d; want 0 (Linux counts no lookup for it)", e.name, e.out.NodeId)
			}
		case e.out.NodeId == 0:
			t.Errorf("%s: no node", e.name)
		default:
			fi, err := os.Lstat(filepath.Join(dir, e.name))
			if err != nil {
				t.Fatal(err)
			}
			if e.out.Attr.Size != uint64(fi.Size()) {
				t.Errorf("%s: size %d; want %d", e.name, e.out.Attr.Size, fi.Size())
			}
			if fi.IsDir() != (e.out.Attr.Mode&unix.S_IFMT == unix.S_IFDIR) || e.typ != e.out.Attr.Mode>>12&0xf {
				t.Errorf("%s: mode %o, entry type %d; want a directory: %v", e.name, e.out.Attr.Mode, e.typ, fi.IsDir())
			}
			if l, st := lookup(t, fs, rootID, e.name); !st.Ok() || l.NodeId != e.out.NodeId {
				t.Errorf("%s: listed as node %d, looked up as %d (%v)", e.name, e.out.NodeId, l.NodeId, st)
			} else {
				fs.Forget(l.NodeId, 1)
			}
		}
	}
	if len(seen) != 7 {
		t.Fatalf("listed %v; want ., .., a, bb, ccc, dddd and sub", seen)
	}
	if n, _ := fs.Nodes(); n != 6 {
		t.Fatalf("after a listing of five entries: %d nodes; want the root and five", n)
	}
	forget(all)
	if n, _ := fs.Nodes(); n != 1 {
		t.Fatalf("after forgetting the listing: %d nodes; want the root alone", n)
	}

	// A reply with room for two entries counts the lookups of those it
	// holds, and the next resumes after them: "." and ".." first (on
	// the file systems a test runs on), then two entries looked up.
	two := 2 * (plusEntrySize + 8)
	first := read(two, 0)
	second := read(two, first[1].off)
	if len(first) != 2 || len(second) != 2 {
		t.Fatalf("replies with room for two entries hold %d and %d", len(first), len(second))
	}
	held := 0
	for _, e := range append(first, second...) {
		if e.out.NodeId != 0 {
			held++
			if e.out.EntryValid == 0 {
				t.Errorf("%s: an entry valid for no time, with the node table nowhere near full", e.name)
			}
		}
	}
	if n, _ := fs.Nodes(); n != 1+held || held < 1 {
		t.Fatalf("after replies of %d looked-up entries: %d nodes; want one more than the entries", held, n)
	}
	rest := read(4096, second[1].off)
	if len(first)+len(second)+len(rest) != len(all) {
		t.Fatalf("three replies hold %d, %d and %d entries; one held %d", len(first), len(second), len(rest), len(all))
	}
	forget(first)
	forget(second)
	forget(rest)
	if n, _ := fs.Nodes(); n != 1 {
		t.Fatalf("after forgetting the listings: %d nodes; want the root alone", n)
	}

	// Crowded: entries are plain.
	defer func(k int) { keepNodes = k }(keepNodes)
	keepNodes = 1
	for _, e := range read(4096, 0) {
		if e.out.NodeId != 0 {
			t.Errorf("with the node table full, %s was looked up as node %d", e.name, e.out.NodeId)
		}
	}
	if n, _ := fs.Nodes(); n != 1 {
		t.Fatalf("with the node table full, a listing left %d nodes; want the root alone", n)
	}
}
