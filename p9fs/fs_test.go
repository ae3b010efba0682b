package p9fs

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// TestOperations exercises normal use, directly and through p9's server
// and client.
func TestOperations(t *testing.T) {
	for _, c := range conns {
		t.Run(c.name, func(t *testing.T) {
			tr := newTree(t)
			root := c.mount(t, newShare(t, tr.root, Options{}))

			// getattr of the root and statfs.
			qid, valid, attr, err := root.GetAttr(p9.AttrMaskAll)
			must(t, err)
			if !valid.Mode || !attr.Mode.IsDir() || qid.Type != p9.TypeDir {
				t.Fatalf("root getattr: %v %v %v", qid, valid, attr)
			}
			fsst, err := root.StatFS()
			must(t, err)
			if fsst.Type != v9fsMagic || fsst.BlockSize == 0 || fsst.NameLength == 0 {
				t.Fatalf("statfs: %+v", fsst)
			}

			// read an existing file.
			got, err := readAll(t, root, "dir", "inner")
			if err != nil || got != "inner" {
				t.Fatalf("read dir/inner: %q %v", got, err)
			}

			// create, write, read back, getattr.
			f, err := create(root, "new", p9.ReadWrite, 0o640)
			must(t, err)
			data := bytes.Repeat([]byte("0123456789"), 50000) // > msize: chunked
			n, err := f.WriteAt(data, 0)
			if err != nil || n != len(data) {
				t.Fatalf("write: %d %v", n, err)
			}
			buf := make([]byte, 10)
			n, err = f.ReadAt(buf, 123455)
			if err != nil || string(buf[:n]) != "5678901234" {
				t.Fatalf("read at offset: %q %v", buf[:n], err)
			}
			must(t, f.FSync())
			_, _, attr, err = f.GetAttr(p9.AttrMaskAll)
			must(t, err)
			if attr.Size != uint64(len(data)) || attr.Mode != p9.ModeRegular|0o640 {
				t.Fatalf("new file attr %v", attr)
			}
			if st, err := os.Lstat(tr.path("new")); err != nil || st.Mode().Perm() != 0o640 {
				t.Fatalf("host sees %v %v", st, err)
			}
			if !c.wire { // p9's client sends Tlock without its fid
				st, err := f.Lock(1, p9.WriteLock, 0, 0, 0, "x")
				if err != nil || st != p9.LockStatusOK {
					t.Fatalf("lock: %v %v", st, err)
				}
			}
			must(t, f.Close())

			// open an existing file for writing with truncation.
			w := walk(t, root, "file")
			_, _, err = w.Open(p9.WriteOnly | dotlTrunc)
			must(t, err)
			_, err = w.WriteAt([]byte("bye"), 0)
			must(t, err)
			if b, _ := os.ReadFile(tr.path("file")); string(b) != "bye" {
				t.Fatalf("after O_TRUNC write: %q", b)
			}

			// setattr: size, mode, times.
			s := walk(t, root, "new")
			must(t, s.SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: 5}))
			must(t, s.SetAttr(p9.SetAttrMask{Permissions: true}, p9.SetAttr{Permissions: 0o600}))
			must(t, s.SetAttr(p9.SetAttrMask{MTime: true, MTimeNotSystemTime: true, ATime: true},
				p9.SetAttr{MTimeSeconds: 1000, MTimeNanoSeconds: 5}))
			_, _, attr, err = s.GetAttr(p9.AttrMaskAll)
			must(t, err)
			if attr.Size != 5 || attr.Mode.Permissions() != 0o600 || attr.MTimeSeconds != 1000 || attr.MTimeNanoSeconds != 5 {
				t.Fatalf("after setattr: %v", attr)
			}
			if attr.ATimeSeconds < 1000000 {
				t.Fatalf("atime not set to now: %v", attr)
			}

			// mkdir, symlink, readlink, link.
			_, err = root.Mkdir("sub", 0o750, p9.NoUID, p9.NoGID)
			must(t, err)
			if st, err := os.Lstat(tr.path("sub")); err != nil || !st.IsDir() || st.Mode().Perm() != 0o750 {
				t.Fatalf("mkdir: %v %v", st, err)
			}
			sub := walk(t, root, "sub")
			sqid, err := sub.Symlink("../new", "ln", p9.NoUID, p9.NoGID)
			must(t, err)
			if sqid.Type != p9.TypeSymlink {
				t.Fatalf("symlink qid %v", sqid)
			}
			target, err := walk(t, root, "sub", "ln").Readlink()
			if err != nil || target != "../new" {
				t.Fatalf("readlink: %q %v", target, err)
			}
			must(t, sub.Link(walk(t, root, "new"), "hard"))
			if got, err := readAll(t, root, "sub", "hard"); err != nil || got != "01234" {
				t.Fatalf("read hard link: %q %v", got, err)
			}
			if st := lstat(t, tr.path("new")); st.Nlink != 2 {
				t.Fatalf("nlink %d after link", st.Nlink)
			}
			_, err = root.Mknod("fifo", p9.ModeNamedPipe|0o600, 0, 0, p9.NoUID, p9.NoGID)
			must(t, err)
			if st := lstat(t, tr.path("fifo")); st.Mode != unix.S_IFIFO|0o600 {
				t.Fatalf("fifo mode %o", st.Mode)
			}

			// readdir.
			d := walk(t, root)
			_, _, err = d.Open(p9.ReadOnly)
			must(t, err)
			ents := readdirAll(t, d, 4096)
			var names []string
			for _, e := range ents {
				names = append(names, e.Name)
				want := lstat(t, filepath.Join(tr.root, e.Name))
				if e.Name != ".." && e.QID.Path != want.Ino {
					t.Errorf("%s: qid path %d, ino %d", e.Name, e.QID.Path, want.Ino)
				}
				if e.Name != ".." && uint8(e.Type) != dtype(want.Mode) {
					t.Errorf("%s: type %d, want d_type %d", e.Name, e.Type, dtype(want.Mode))
				}
			}
			sort.Strings(names)
			want := ". .. dir etc fifo file new out relsec sec sub up"
			if strings.Join(names, " ") != want {
				t.Fatalf("readdir: %q, want %q", names, want)
			}

			// rename and unlink.
			must(t, root.RenameAt("new", sub, "moved"))
			if _, err := os.Lstat(tr.path("sub/moved")); err != nil {
				t.Fatal(err)
			}
			must(t, s.Close()) // an fid of the renamed file
			wantErr(t, "rmdir non-empty", root.UnlinkAt("sub", unix.AT_REMOVEDIR), linux.ENOTEMPTY)
			for _, n := range []string{"moved", "hard", "ln"} {
				must(t, sub.UnlinkAt(n, 0))
			}
			must(t, root.UnlinkAt("sub", unix.AT_REMOVEDIR))
			wantErr(t, "unlink missing", root.UnlinkAt("sub", 0), linux.ENOENT)
			_, _, err = root.Walk([]string{"nope"})
			wantErr(t, "walk missing", err, linux.ENOENT)
		})
	}
}

// TestReaddirOffsets lists a big directory in small chunks: every entry
// exactly once, offsets usable as resume points, also while entries
// are added and removed.
func TestReaddirOffsets(t *testing.T) {
	for _, c := range conns {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			const n = 300
			for i := range n {
				must(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%03d-%s", i, strings.Repeat("x", i%40))), nil, 0o644))
			}
			root := c.mount(t, newShare(t, dir, Options{}))
			d := walk(t, root)
			_, _, err := d.Open(p9.ReadOnly)
			must(t, err)
			counts := []uint32{1, 100, 512, 64 << 10}
			if c.wire {
				counts = counts[1:] // the server sends only whole entries
			}
			for _, count := range counts {
				ents := readdirAll(t, d, count)
				seen := map[string]bool{}
				for _, e := range ents {
					if seen[e.Name] {
						t.Fatalf("count %d: %s twice", count, e.Name)
					}
					seen[e.Name] = true
				}
				if len(seen) != n+2 {
					t.Fatalf("count %d: %d entries, want %d", count, len(seen), n+2)
				}
			}
			// Offsets are resume points for any fid: list half with
			// one, the rest with another.
			first, err := d.Readdir(0, 2000)
			must(t, err)
			resume := first[len(first)-1].Offset
			d2 := walk(t, root)
			_, _, err = d2.Open(p9.ReadOnly)
			must(t, err)
			seen := map[string]bool{}
			for _, e := range first {
				seen[e.Name] = true
			}
			rest := func(what string, dup func(string) bool) {
				for off := resume; ; {
					ents, err := d2.Readdir(off, 2000)
					if err != nil && err != io.EOF {
						t.Fatal(err)
					}
					if len(ents) == 0 {
						return
					}
					for _, e := range ents {
						if seen[e.Name] && !dup(e.Name) {
							t.Fatalf("%s: %s listed twice", what, e.Name)
						}
						seen[e.Name] = true
					}
					off = ents[len(ents)-1].Offset
				}
			}
			rest("resume", func(string) bool { return false })
			if len(seen) != n+2 {
				t.Fatalf("resume: %d entries, want %d", len(seen), n+2)
			}

			// Resume after the directory changed: no entry listed
			// twice and, on file systems with stable directory
			// cookies, none of the untouched ones missed.
			must(t, root.UnlinkAt(first[len(first)-1].Name, 0))
			f, err := create(root, "added", p9.ReadWrite, 0o644)
			must(t, err)
			f.Close()
			seen = map[string]bool{}
			for _, e := range first {
				seen[e.Name] = true
			}
			rest("resume after change", func(name string) bool { return name == "added" })
			var sfs unix.Statfs_t
			must(t, unix.Statfs(dir, &sfs))
			switch sfs.Type {
			case unix.EXT4_SUPER_MAGIC, unix.XFS_SUPER_MAGIC, unix.BTRFS_SUPER_MAGIC:
				if len(seen) < n+2 {
					t.Fatalf("resume after change: %d entries, want at least %d", len(seen), n+2)
				}
			}
		})
	}
}

// TestReadOnly: every mutation fails with EROFS and the host tree is
// unchanged.
func TestReadOnly(t *testing.T) {
	for _, c := range conns {
		t.Run(c.name, func(t *testing.T) {
			tr := newTree(t)
			must(t, os.WriteFile(tr.path("dir/gone"), nil, 0o644))
			before := snapshot(t, tr.base)
			root := c.mount(t, newShare(t, tr.root, Options{ReadOnly: true}))

			for _, fl := range []p9.OpenFlags{p9.WriteOnly, p9.ReadWrite, p9.ReadOnly | dotlTrunc, p9.WriteOnly | dotlAppend} {
				_, _, err := walk(t, root, "file").Open(fl)
				wantErr(t, fmt.Sprintf("open %#x", uint32(fl)), err, linux.EROFS)
			}
			_, err := create(root, "x", p9.ReadWrite, 0o644)
			wantErr(t, "create", err, linux.EROFS)
			_, err = create(root, "x", p9.ReadOnly, 0o644)
			wantErr(t, "create read-only", err, linux.EROFS)
			_, err = root.Mkdir("x", 0o755, p9.NoUID, p9.NoGID)
			wantErr(t, "mkdir", err, linux.EROFS)
			_, err = root.Symlink("file", "x", p9.NoUID, p9.NoGID)
			wantErr(t, "symlink", err, linux.EROFS)
			wantErr(t, "link", root.Link(walk(t, root, "file"), "x"), linux.EROFS)
			_, err = root.Mknod("x", p9.ModeNamedPipe|0o644, 0, 0, p9.NoUID, p9.NoGID)
			wantErr(t, "mknod fifo", err, linux.EROFS)
			_, err = root.Mknod("x", p9.ModeRegular|0o644, 0, 0, p9.NoUID, p9.NoGID)
			wantErr(t, "mknod regular", err, linux.EROFS)
			_, err = root.Mknod("x", p9.ModeBlockDevice|0o644, 8, 0, p9.NoUID, p9.NoGID)
			wantErr(t, "mknod device", err, linux.EROFS)
			wantErr(t, "rename", root.RenameAt("file", root, "x"), linux.EROFS)
			wantErr(t, "rename into dir", root.RenameAt("file", walk(t, root, "dir"), "x"), linux.EROFS)
			wantErr(t, "unlink", root.UnlinkAt("file", 0), linux.EROFS)
			wantErr(t, "unlink symlink", root.UnlinkAt("sec", 0), linux.EROFS)
			wantErr(t, "unlink in dir", walk(t, root, "dir").UnlinkAt("gone", 0), linux.EROFS)
			wantErr(t, "rmdir", root.UnlinkAt("dir", unix.AT_REMOVEDIR), linux.EROFS)
			for _, m := range []p9.SetAttrMask{
				{Size: true}, {Permissions: true}, {ATime: true}, {MTime: true, MTimeNotSystemTime: true},
				{UID: true}, {GID: true}, {CTime: true},
			} {
				wantErr(t, "setattr "+m.String(), walk(t, root, "file").SetAttr(m, p9.SetAttr{Permissions: 0o777, MTimeSeconds: 1}), linux.EROFS)
				wantErr(t, "setattr on dir "+m.String(), walk(t, root, "dir").SetAttr(m, p9.SetAttr{}), linux.EROFS)
			}
			if !c.wire { // p9's client has no xattrs
				wantErr(t, "setxattr", walk(t, root, "file").SetXattr("user.x", []byte("y"), 0), linux.EROFS)
				wantErr(t, "removexattr", walk(t, root, "file").RemoveXattr("user.x"), linux.EROFS)
			}

			// Reading still works.
			if got, err := readAll(t, root, "dir", "inner"); err != nil || got != "inner" {
				t.Fatalf("read on read-only share: %q %v", got, err)
			}
			d := walk(t, root, "dir")
			_, _, err = d.Open(p9.ReadOnly)
			must(t, err)
			if ents := readdirAll(t, d, 4096); len(ents) != 4 {
				t.Fatalf("readdir on read-only share: %v", ents)
			}
			if !c.wire {
				// A read-only fid refuses writes here too.
				r := walk(t, root, "file")
				_, _, err = r.Open(p9.ReadOnly)
				must(t, err)
				_, err = r.WriteAt([]byte("x"), 0)
				wantErr(t, "write", err, linux.EROFS)
			}

			if after := snapshot(t, tr.base); after != before {
				t.Fatalf("read-only share changed the host:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

// TestModes: setuid never reaches the host, nor setgid but a directory's;
// modes are exact whatever the umask.
func TestModes(t *testing.T) {
	old := unix.Umask(0o077)
	defer unix.Umask(old)
	for _, c := range conns {
		t.Run(c.name, func(t *testing.T) {
			tr := newTree(t)
			must(t, os.Chmod(tr.path("dir"), 0o2775)) // setgid dir: children inherit
			root := c.mount(t, newShare(t, tr.root, Options{}))
			dir := walk(t, root, "dir")

			f, err := create(dir, "suid", p9.ReadWrite, 0o6755)
			must(t, err)
			f.Close()
			_, err = dir.Mkdir("sgid", 0o2777|p9.Sticky, p9.NoUID, p9.NoGID)
			must(t, err)
			_, err = dir.Mkdir("plain", 0o777, p9.NoUID, p9.NoGID)
			must(t, err)
			_, err = dir.Mknod("fifo", p9.ModeNamedPipe|0o4666, 0, 0, p9.NoUID, p9.NoGID)
			must(t, err)
			must(t, walk(t, root, "file").SetAttr(p9.SetAttrMask{Permissions: true}, p9.SetAttr{Permissions: 0o4755}))
			must(t, walk(t, root, "dir").SetAttr(p9.SetAttrMask{Permissions: true}, p9.SetAttr{Permissions: 0o2755}))

			// p9's client sends permissions and sticky alone (01777):
			// through it no setgid reaches the server (p9server's
			// TestSetgidDirectory sends it).
			sgid := uint32(0o2000)
			if c.wire {
				sgid = 0
			}
			for p, want := range map[string]uint32{
				"dir/suid":  unix.S_IFREG | 0o755,
				"dir/sgid":  unix.S_IFDIR | 0o1777 | sgid,
				"dir/plain": unix.S_IFDIR | 0o777,
				"dir/fifo":  unix.S_IFIFO | 0o666,
				"file":      unix.S_IFREG | 0o755,
				"dir":       unix.S_IFDIR | 0o755 | sgid,
			} {
				if st := lstat(t, tr.path(p)); st.Mode != want {
					t.Errorf("%s: mode %o, want %o", p, st.Mode, want)
				}
			}
		})
	}
}

// TestOwnership: id mapping and the chown rules.
func TestOwnership(t *testing.T) {
	for _, c := range conns {
		t.Run(c.name, func(t *testing.T) {
			if os.Geteuid() != 0 {
				t.Skip("needs root to give a file a foreign owner")
			}
			tr := newTree(t)
			other := tr.path("dir/inner")
			must(t, os.Lchown(other, 4321, 4322))
			root := c.mount(t, newShare(t, tr.root, Options{UID: 1000, GID: 1001}))
			mine := walk(t, root, "file")
			_, _, attr, err := mine.GetAttr(p9.AttrMaskAll)
			must(t, err)
			if attr.UID != 1000 || attr.GID != 1001 {
				t.Fatalf("own file shown as %d:%d, want 1000:1001", attr.UID, attr.GID)
			}
			theirs := walk(t, root, "dir", "inner")
			_, _, attr, err = theirs.GetAttr(p9.AttrMaskAll)
			must(t, err)
			if attr.UID != 4321 || attr.GID != 4322 {
				t.Fatalf("foreign file shown as %d:%d", attr.UID, attr.GID)
			}

			ids := p9.SetAttrMask{UID: true, GID: true}
			must(t, mine.SetAttr(ids, p9.SetAttr{UID: 1000, GID: 1001}))
			must(t, mine.SetAttr(ids, p9.SetAttr{UID: p9.NoUID, GID: p9.NoGID}))
			must(t, theirs.SetAttr(ids, p9.SetAttr{UID: 4321, GID: 4322})) // unchanged
			// Another user's file keeps its owner (ownerXattr is for the
			// VMM's own files: TestOwners).
			wantErr(t, "chown of a foreign file", theirs.SetAttr(ids, p9.SetAttr{UID: 0, GID: 4322}), linux.EPERM)
			wantErr(t, "chgrp of a foreign file", theirs.SetAttr(p9.SetAttrMask{GID: true}, p9.SetAttr{GID: 5}), linux.EPERM)
			// A refused chown changes nothing else either.
			wantErr(t, "chown with chmod", theirs.SetAttr(p9.SetAttrMask{UID: true, Permissions: true}, p9.SetAttr{UID: 7, Permissions: 0o777}), linux.EPERM)
			if st := lstat(t, tr.path("file")); st.Mode&0o777 != 0o644 || int(st.Uid) != os.Geteuid() {
				t.Fatalf("file after refused chown: mode %o uid %d", st.Mode, st.Uid)
			}
			if st := lstat(t, other); st.Uid != 4321 || st.Gid != 4322 || st.Mode&0o777 == 0o777 {
				t.Fatalf("foreign file now %d:%d, mode %o", st.Uid, st.Gid, st.Mode&0o777)
			}
		})
	}
}

// TestNames: the name rules, on every operation that takes a name.
func TestNames(t *testing.T) {
	tr := newTree(t)
	root := mountDirect(t, newShare(t, tr.root, Options{}))
	file := walk(t, root, "file")
	long := strings.Repeat("a", 256)
	for _, tc := range []struct {
		name string
		want linux.Errno
	}{
		{"", linux.EINVAL},
		{".", linux.EPERM},
		{"..", linux.EPERM},
		{"/", linux.EINVAL},
		{"/etc", linux.EINVAL},
		{"a/b", linux.EINVAL},
		{"../x", linux.EINVAL},
		{"dir/", linux.EINVAL},
		{"x\x00", linux.EINVAL},
		{"\x00", linux.EINVAL},
		{long, linux.ENAMETOOLONG},
	} {
		t.Run(fmt.Sprintf("%q", tc.name), func(t *testing.T) {
			_, _, err := root.Walk([]string{tc.name})
			wantErr(t, "walk", err, tc.want)
			_, _, err = root.Walk([]string{"dir", tc.name})
			wantErr(t, "walk second", err, tc.want)
			_, _, _, _, err = root.WalkGetAttr([]string{tc.name})
			wantErr(t, "walkgetattr", err, tc.want)
			_, err = create(root, tc.name, p9.ReadWrite, 0o644)
			wantErr(t, "create", err, tc.want)
			_, err = root.Mkdir(tc.name, 0o755, p9.NoUID, p9.NoGID)
			wantErr(t, "mkdir", err, tc.want)
			_, err = root.Symlink("x", tc.name, p9.NoUID, p9.NoGID)
			wantErr(t, "symlink", err, tc.want)
			_, err = root.Mknod(tc.name, p9.ModeNamedPipe|0o644, 0, 0, p9.NoUID, p9.NoGID)
			wantErr(t, "mknod", err, tc.want)
			wantErr(t, "link", root.Link(file, tc.name), tc.want)
			wantErr(t, "rename from", root.RenameAt(tc.name, root, "y"), tc.want)
			wantErr(t, "rename to", root.RenameAt("file", root, tc.name), tc.want)
			wantErr(t, "unlink", root.UnlinkAt(tc.name, 0), tc.want)
			wantErr(t, "rmdir", root.UnlinkAt(tc.name, unix.AT_REMOVEDIR), tc.want)
		})
	}
	// A 255-byte name is fine.
	ok := strings.Repeat("b", 255)
	f, err := create(root, ok, p9.ReadWrite, 0o644)
	must(t, err)
	f.Close()
	walk(t, root, ok)
	// Bad symlink targets.
	_, err = root.Symlink("", "s", p9.NoUID, p9.NoGID)
	wantErr(t, "empty target", err, linux.EINVAL)
	_, err = root.Symlink("a\x00b", "s", p9.NoUID, p9.NoGID)
	wantErr(t, "NUL in target", err, linux.EINVAL)
	_, err = root.Symlink(strings.Repeat("a", 5000), "s", p9.NoUID, p9.NoGID)
	wantErr(t, "long target", err, linux.ENAMETOOLONG)
	if entries, _ := os.ReadDir(tr.root); len(entries) != 8 {
		t.Fatalf("share has %d entries, want the 7 of newTree and one 255-byte name", len(entries))
	}
}

// TestNew: bad roots give errors naming the path.
func TestNew(t *testing.T) {
	tr := newTree(t)
	for _, tc := range []struct{ root, want string }{
		{filepath.Join(tr.base, "missing"), "does not exist"},
		{tr.secret, "is not a directory"},
		{tr.path("sec"), "is not a directory"},
		{"", "empty"},
	} {
		_, err := New(tc.root, Options{})
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.root) {
			t.Errorf("New(%q) = %v, want an error naming it and %q", tc.root, err, tc.want)
		}
	}
	// A symlink to a directory is resolved once, at New.
	a := newShare(t, tr.path("out"), Options{})
	if got, err := readAll(t, mountDirect(t, a), "keep"); err != nil || got != "keep" {
		t.Fatalf("share through a symlinked root: %q %v", got, err)
	}
	// After Close, Attach fails.
	must(t, a.(io.Closer).Close())
	if _, err := a.Attach(); err == nil {
		t.Fatal("Attach after Close succeeded")
	}
}

// TestUnitMisc covers File API corners that p9's server screens out.
func TestUnitMisc(t *testing.T) {
	tr := newTree(t)
	root := mountDirect(t, newShare(t, tr.root, Options{}))

	// Walk of several names at once, and its QIDs.
	qids, f, err := root.Walk([]string{"dir", "inner"})
	must(t, err)
	f.Close()
	if len(qids) != 2 || qids[0].Type != p9.TypeDir || qids[1].Type != p9.TypeRegular ||
		qids[1].Path != lstat(t, tr.path("dir/inner")).Ino {
		t.Fatalf("walk qids %v", qids)
	}
	_, _, err = root.Walk([]string{"file", "x"})
	wantErr(t, "walk through a file", err, linux.ENOTDIR)

	// Unopened and doubly opened Files.
	g := walk(t, root, "file")
	_, err = g.ReadAt(make([]byte, 1), 0)
	wantErr(t, "read unopened", err, linux.EBADF)
	wantErr(t, "fsync unopened", g.FSync(), linux.EBADF)
	_, _, err = g.Open(p9.ReadOnly)
	must(t, err)
	_, _, err = g.Open(p9.ReadOnly)
	wantErr(t, "second open", err, linux.EINVAL)
	_, err = g.ReadAt(make([]byte, 1), -1)
	wantErr(t, "negative offset", err, linux.EINVAL)
	_, _, err = walk(t, root, "file").Open(p9.OpenFlagsModeMask)
	wantErr(t, "access mode 3", err, linux.EINVAL)
	_, _, err = walk(t, root, "dir").Open(p9.ReadWrite)
	wantErr(t, "open dir for writing", err, linux.EISDIR)
	_, err = walk(t, root, "dir").Readdir(0, 100)
	wantErr(t, "readdir unopened", err, linux.EBADF)
	_, err = walk(t, root, "file").Readlink()
	wantErr(t, "readlink of a file", err, linux.EINVAL)
	wantErr(t, "rename", g.Rename(root, "x"), linux.ENOSYS)
	g.Renamed(root, "x") // no-op

	// A fifo is never opened (it would block the server).
	_, err = root.Mknod("fifo", p9.ModeNamedPipe|0o644, 0, 0, p9.NoUID, p9.NoGID)
	must(t, err)
	_, _, err = walk(t, root, "fifo").Open(p9.ReadOnly)
	wantErr(t, "open fifo", err, linux.EPERM)

	// Creating in a non-directory.
	_, err = create(walk(t, root, "file"), "x", p9.ReadWrite, 0o644)
	wantErr(t, "create in a file", err, linux.ENOTDIR)

	// Use after Close.
	h := walk(t, root, "file")
	must(t, h.Close())
	_, _, _, err = h.GetAttr(p9.AttrMaskAll)
	wantErr(t, "getattr after close", err, linux.EBADF)
	_, _, err = h.Walk(nil)
	wantErr(t, "walk after close", err, linux.EBADF)
	must(t, h.Close())

	// Xattrs: only user.*.
	x := walk(t, root, "file")
	if err := x.SetXattr("user.k", []byte("v"), 0); err == linux.EOPNOTSUPP {
		t.Log("no user xattrs on this file system")
	} else {
		must(t, err)
		v, err := x.GetXattr("user.k")
		if err != nil || string(v) != "v" {
			t.Fatalf("getxattr: %q %v", v, err)
		}
		names, err := x.ListXattrs()
		if err != nil || len(names) != 1 || names[0] != "user.k" {
			t.Fatalf("listxattr: %q %v", names, err)
		}
		wantErr(t, "create existing", x.SetXattr("user.k", []byte("w"), p9.XattrCreate), linux.EEXIST)
		must(t, x.RemoveXattr("user.k"))
		_, err = x.GetXattr("user.k")
		wantErr(t, "getxattr removed", err, linux.ENODATA)
	}
	wantErr(t, "security xattr", x.SetXattr("security.capability", []byte{1}, 0), linux.EOPNOTSUPP)
	wantErr(t, "trusted xattr", x.SetXattr("trusted.x", []byte{1}, 0), linux.EOPNOTSUPP)
	_, err = x.GetXattr("security.selinux")
	wantErr(t, "get security xattr", err, linux.ENODATA)
	wantErr(t, "user. alone", x.SetXattr("user.", nil, 0), linux.EOPNOTSUPP)
}

// TestErrnoMapping: errors reach p9 as linux.Errno, so its os.Err*
// matching does not rewrite them (EPERM to EACCES, ENOTEMPTY to EEXIST).
func TestErrnoMapping(t *testing.T) {
	for _, e := range []unix.Errno{unix.EPERM, unix.ENOTEMPTY, unix.ENOENT, unix.EEXIST, unix.ENOSYS} {
		if got := linux.ExtractErrno(errno(e)); got != linux.Errno(e) {
			t.Errorf("%v: p9 sends %v", e, got)
		}
	}
	if got := linux.ExtractErrno(errno(fmt.Errorf("wrapped: %w", unix.EXDEV))); got != linux.EXDEV {
		t.Errorf("wrapped EXDEV: p9 sends %v", got)
	}
	if errno(nil) != nil {
		t.Error("errno(nil) != nil")
	}
}

// TestQIDPrefixes: inodes on other devices or with high bits get unique
// prefixed paths.
func TestQIDPrefixes(t *testing.T) {
	a := newShare(t, t.TempDir(), Options{}).(*share)
	seen := map[uint64]bool{}
	for _, k := range [][2]uint64{
		{a.rootDev, 5}, {a.rootDev, 1 << 50}, {a.rootDev, 1<<50 | 5}, {a.rootDev + 1, 5}, {a.rootDev + 1, 6}, {a.rootDev + 2, 5},
	} {
		p := a.qidPath(k[0], k[1])
		if seen[p] {
			t.Fatalf("qid path %#x for %v collides", p, k)
		}
		seen[p] = true
		if p != a.qidPath(k[0], k[1]) {
			t.Fatal("qid path not stable")
		}
	}
}

// TestQIDVersions: a regular file's QID version is never 0 (0 makes
// Linux's client bypass its page cache) and changes when the host changes
// the file's contents, so the guest reads the new data at its next open;
// directories and symlinks carry no version.
func TestQIDVersions(t *testing.T) {
	for _, c := range conns {
		t.Run(c.name, func(t *testing.T) {
			tr := newTree(t)
			root := c.mount(t, newShare(t, tr.root, Options{}))
			version := func(names ...string) uint32 {
				t.Helper()
				f := walk(t, root, names...)
				defer f.Close()
				q, _, _, err := f.GetAttr(p9.AttrMaskAll)
				must(t, err)
				return q.Version
			}
			v1 := version("file")
			if v1 == 0 {
				t.Fatal("GetAttr(file).Version = 0, want a version")
			}
			if v := version("file"); v != v1 {
				t.Fatalf("GetAttr(file).Version = %#x then %#x with no change, want it stable", v1, v)
			}
			// Same size, new contents, a later mtime.
			must(t, os.WriteFile(tr.path("file"), []byte("HELLO"), 0o644))
			later := time.Now().Add(time.Second)
			must(t, os.Chtimes(tr.path("file"), later, later))
			v2 := version("file")
			if v2 == v1 || v2 == 0 {
				t.Fatalf("GetAttr(file).Version = %#x after the host rewrote it, was %#x: want a new non-zero version", v2, v1)
			}
			// A new size, even with the old mtime.
			st := lstat(t, tr.path("file"))
			must(t, os.WriteFile(tr.path("file"), []byte("hello, longer"), 0o644))
			must(t, unix.UtimesNano(tr.path("file"), []unix.Timespec{st.Atim, st.Mtim}))
			if v3 := version("file"); v3 == v2 || v3 == 0 {
				t.Fatalf("GetAttr(file).Version = %#x after a size change, was %#x", v3, v2)
			}
			if v := version("dir"); v != 0 {
				t.Errorf("GetAttr(dir).Version = %#x, want 0", v)
			}
			if v := version("etc"); v != 0 {
				t.Errorf("GetAttr(etc symlink).Version = %#x, want 0", v)
			}
		})
	}
}

// TestNoFDLeak runs a mixed session, directly and over the wire, and
// checks every descriptor is closed afterwards.
func TestNoFDLeak(t *testing.T) {
	tr := newTree(t)
	before := fdCount(t)
	t.Run("session", func(t *testing.T) {
		for _, c := range conns {
			a := newShare(t, tr.root, Options{})
			root := c.mount(t, a)
			for i := range 20 {
				name := fmt.Sprintf("f%d", i)
				f, err := create(root, name, p9.ReadWrite, 0o644)
				must(t, err)
				f.WriteAt([]byte("x"), 0)
				f.Close()
				readAll(t, root, name)
				readAll(t, root, "sec") // fails
				root.Walk([]string{"etc", "passwd"})
				root.Walk([]string{".."})
				_, d, _ := root.Walk(nil)
				d.Open(p9.ReadOnly)
				d.Readdir(0, 1<<20)
				d.Close()
				_, x, _, _, _ := root.WalkGetAttr([]string{name})
				x.SetAttr(p9.SetAttrMask{Size: true, Permissions: true}, p9.SetAttr{Permissions: 0o600})
				x.Close()
				root.Mkdir("d"+name, 0o755, p9.NoUID, p9.NoGID)
				root.Symlink("/etc", "s"+name, p9.NoUID, p9.NoGID)
				root.Mknod("p"+name, p9.ModeNamedPipe|0o600, 0, 0, p9.NoUID, p9.NoGID)
				root.RenameAt(name, root, "r"+name)
				root.UnlinkAt("r"+name, 0)
				root.UnlinkAt("d"+name, unix.AT_REMOVEDIR)
			}
		}
	})
	if after := fdCount(t); after != before {
		t.Fatalf("%d descriptors before, %d after", before, after)
	}
}

// TestConcurrent hammers one share from many goroutines (run with -race),
// including Close racing other calls on the same File.
func TestConcurrent(t *testing.T) {
	tr := newTree(t)
	for _, c := range conns {
		t.Run(c.name, func(t *testing.T) {
			root := c.mount(t, newShare(t, tr.root, Options{}))
			var wg sync.WaitGroup
			for g := range 8 {
				wg.Go(func() {
					for i := range 30 {
						name := fmt.Sprintf("%s-g%d-%d", c.name, g, i)
						f, err := create(root, name, p9.ReadWrite, 0o644)
						if err != nil {
							t.Error(err)
							return
						}
						f.WriteAt([]byte(name), 0)
						f.Close()
						if got, err := readAll(t, root, name); err != nil || got != name {
							t.Errorf("read %s: %q %v", name, got, err)
						}
						_, d, _ := root.Walk(nil)
						d.Open(p9.ReadOnly)
						d.Readdir(0, 4096)
						d.Close()
						root.UnlinkAt(name, 0)
					}
				})
			}
			wg.Wait()
		})
	}
	// Close racing use on the direct API.
	root := mountDirect(t, newShare(t, tr.root, Options{}))
	for range 50 {
		f := walk(t, root, "file")
		f.Open(p9.ReadOnly)
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				f.ReadAt(make([]byte, 8), 0)
				f.GetAttr(p9.AttrMaskAll)
				if _, c, err := f.Walk(nil); err == nil {
					c.Close()
				}
			})
		}
		wg.Go(func() { f.Close() })
		wg.Wait()
	}
}

// TestFDBudget: past its share's descriptor budget, new Files fail with
// ENFILE until some are closed, and another share (another sandbox's)
// is not affected.
func TestFDBudget(t *testing.T) {
	tr := newTree(t)
	root := mountDirect(t, newShare(t, tr.root, Options{MaxFDs: 4})) // the root, then 3
	other := mountDirect(t, newShare(t, tr.root, Options{MaxFDs: 4}))

	var held []p9.File
	for range 3 {
		held = append(held, walk(t, root, "file"))
	}
	_, _, err := root.Walk([]string{"file"})
	wantErr(t, "walk over budget", err, linux.ENFILE)
	_, _, err = held[0].Open(p9.ReadOnly)
	wantErr(t, "open over budget", err, linux.ENFILE)
	_, err = create(root, "x", p9.ReadWrite, 0o644)
	wantErr(t, "create over budget", err, linux.ENFILE)
	for range 3 {
		walk(t, other, "file") // held to the end
	}
	must(t, held[0].Close())
	must(t, held[1].Close())
	must(t, held[2].Close())
	f, err := create(root, "x", p9.ReadWrite, 0o644) // a clone, then two descriptors
	must(t, err)
	// An fid open for writing truncates with ftruncate(2).
	must(t, f.SetAttr(p9.SetAttrMask{Permissions: true}, p9.SetAttr{Permissions: 0o444}))
	must(t, f.SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: 7}))
	if st := lstat(t, tr.path("x")); st.Size != 7 {
		t.Fatalf("size %d after truncate", st.Size)
	}
	must(t, f.Close())
}

// TestReopen: a share pins its root again by its path only while the path
// names the same directory; the share serves it after, and a closed share
// refuses.
func TestReopen(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "d")
	must(t, os.Mkdir(dir, 0o755))
	must(t, os.WriteFile(filepath.Join(dir, "f"), []byte("same"), 0o644))
	a := newShare(t, dir, Options{})
	r := a.(interface{ Reopen(string) error })
	if err := r.Reopen(dir); err != nil {
		t.Fatalf("Reopen of the same directory: %v", err)
	}
	root := mountDirect(t, a)
	_, f, err := root.Walk([]string{"f"})
	must(t, err)
	defer f.Close()
	must(t, os.Rename(dir, dir+".old"))
	must(t, os.Mkdir(dir, 0o755))
	if err := r.Reopen(dir); err == nil || !strings.Contains(err.Error(), "another directory") {
		t.Errorf("Reopen of another directory at the path = %v; want it refused", err)
	}
	if err := r.Reopen(filepath.Join(base, "missing")); err == nil {
		t.Error("Reopen of a missing path succeeded")
	}
	a.(io.Closer).Close()
	if err := r.Reopen(dir + ".old"); err == nil {
		t.Error("Reopen of a closed share succeeded")
	}
}
