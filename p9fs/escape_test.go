package p9fs

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// escapeCase is one attempt to reach outside the share. run returns the
// error of the decisive step; direct is the errno expected, calling the
// File API directly and through capsa's 9P server alike (which passes the
// file server's errnos on). Zero means the step must succeed (harmlessly;
// check says why).
type escapeCase struct {
	name   string
	run    func(t *testing.T, tr *tree, root p9.File) error
	direct linux.Errno
	check  func(t *testing.T, tr *tree, root p9.File)
}

var escapeCases = []escapeCase{
	{
		name:   "walk through symlink to /etc",
		run:    walkErr("etc", "passwd"),
		direct: linux.ENOTDIR,
	},
	{
		name:   "open symlink to /etc",
		run:    openErr("etc"),
		direct: linux.ELOOP,
	},
	{
		name: "readdir symlink to /etc",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, err := walk(t, root, "etc").Readdir(0, 4096)
			return err
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "guest symlink to /etc then walk and open through it",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			if _, err := root.Symlink("/etc", "g", p9.NoUID, p9.NoGID); err != nil {
				t.Fatal(err)
			}
			if _, err := readAll(t, root, "g"); err == nil {
				t.Fatal("opened a symlink")
			}
			return walkErr("g", "passwd")(t, tr, root)
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "create through symlink to outside dir",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, err := create(walk(t, root, "out"), "pwn", p9.ReadWrite, 0o644)
			return err
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "create through guest symlink ../../..",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			if _, err := root.Symlink("../../..", "g", p9.NoUID, p9.NoGID); err != nil {
				t.Fatal(err)
			}
			_, err := create(walk(t, root, "g"), "pwn", p9.ReadWrite, 0o644)
			return err
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "mkdir through symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, err := walk(t, root, "out").Mkdir("pwn", 0o755, p9.NoUID, p9.NoGID)
			return err
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "symlink through symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, err := walk(t, root, "out").Symlink("x", "pwn", p9.NoUID, p9.NoGID)
			return err
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "mknod through symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, err := walk(t, root, "out").Mknod("pwn", p9.ModeRegular|0o644, 0, 0, p9.NoUID, p9.NoGID)
			return err
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "link into symlinked dir",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return walk(t, root, "out").Link(walk(t, root, "file"), "pwn")
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "unlink through symlinked dir",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return walk(t, root, "out").UnlinkAt("keep", 0)
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "rmdir of symlink to dir",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return root.UnlinkAt("out", unix.AT_REMOVEDIR)
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "rename into symlinked dir",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return root.RenameAt("file", walk(t, root, "out"), "file")
		},
		direct: linux.ENOTDIR,
	},
	{
		name: "rename out of symlinked dir",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return walk(t, root, "out").RenameAt("keep", root, "stolen")
		},
		direct: linux.ENOTDIR,
	},
	{
		name:   "walk .. at root",
		run:    walkErr(".."),
		direct: linux.EPERM,
	},
	{
		name:   "walk .. below root",
		run:    walkErr("dir", "..", ".."),
		direct: linux.EPERM,
	},
	{
		name:   "walk .",
		run:    walkErr("."),
		direct: linux.EPERM,
	},
	{
		name:   "walk multi-component name",
		run:    walkErr("../secret"),
		direct: linux.EINVAL,
	},
	{
		name:   "walk name with NUL",
		run:    walkErr("file\x00/../../secret"),
		direct: linux.EINVAL,
	},
	{
		name:   "walk through symlink ../..",
		run:    walkErr("up", "x"),
		direct: linux.ENOTDIR,
	},
	{
		name:   "open symlink ../..",
		run:    openErr("up"),
		direct: linux.ELOOP,
	},
	{
		name:   "read host-planted symlink to secret",
		run:    openErr("sec"),
		direct: linux.ELOOP,
	},
	{
		name:   "read host-planted relative symlink to secret",
		run:    openErr("relsec"),
		direct: linux.ELOOP,
	},
	{
		name: "readlink of planted symlink gives only its text",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			got, err := walk(t, root, "relsec").Readlink()
			if err == nil && got != "../secret" {
				t.Fatalf("readlink = %q", got)
			}
			return err
		},
	},
	{
		name: "getattr of symlink describes the symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			qid, _, attr, err := walk(t, root, "sec").GetAttr(p9.AttrMaskAll)
			if err != nil {
				return err
			}
			if !attr.Mode.IsSymlink() || attr.Size != uint64(len(tr.secret)) || qid.Type != p9.TypeSymlink {
				t.Fatalf("getattr of symlink: qid %v attr %v", qid, attr)
			}
			return nil
		},
	},
	{
		name: "walkgetattr of symlink describes the symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, f, _, attr, err := root.WalkGetAttr([]string{"sec"})
			if err != nil {
				return err
			}
			defer f.Close()
			if !attr.Mode.IsSymlink() {
				t.Fatalf("walkgetattr of symlink: %v", attr)
			}
			return nil
		},
	},
	{
		name: "create over symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, err := create(root, "sec", p9.ReadWrite, 0o644)
			return err
		},
		direct: linux.EEXIST,
	},
	{
		name: "mkdir over symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, err := root.Mkdir("out", 0o755, p9.NoUID, p9.NoGID)
			return err
		},
		direct: linux.EEXIST,
	},
	{
		name: "rename file over symlink then open",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			f, err := create(root, "mine", p9.ReadWrite, 0o644)
			must(t, err)
			_, err = f.WriteAt([]byte("mine"), 0)
			must(t, err)
			f.Close()
			if err := root.RenameAt("mine", root, "sec"); err != nil {
				return err
			}
			got, err := readAll(t, root, "sec")
			if err != nil || got != "mine" {
				t.Fatalf("read after rename over symlink: %q, %v", got, err)
			}
			return nil
		},
		check: func(t *testing.T, tr *tree, root p9.File) {
			if st := lstat(t, tr.path("sec")); st.Mode&unix.S_IFMT != unix.S_IFREG {
				t.Fatalf("share/sec mode %o, want a regular file", st.Mode)
			}
		},
	},
	{
		name: "rename symlink over a file with an fid on it",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			old := walk(t, root, "file")
			if _, _, err := old.Open(p9.ReadOnly); err != nil {
				t.Fatal(err)
			}
			must(t, root.RenameAt("sec", root, "file"))
			buf := make([]byte, 64)
			n, _ := old.ReadAt(buf, 0)
			if string(buf[:n]) != "hello" {
				t.Fatalf("old fid reads %q, want its own inode", buf[:n])
			}
			_, err := readAll(t, root, "file")
			return err
		},
		direct: linux.ELOOP,
	},
	{
		name: "hard link of symlink pointing out",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			if err := root.Link(walk(t, root, "sec"), "hl"); err != nil {
				return err
			}
			_, err := readAll(t, root, "hl")
			return err
		},
		direct: linux.ELOOP,
		check: func(t *testing.T, tr *tree, root p9.File) {
			hl, sec := lstat(t, tr.path("hl")), lstat(t, tr.path("sec"))
			if hl.Mode&unix.S_IFMT != unix.S_IFLNK || hl.Ino != sec.Ino {
				t.Fatalf("share/hl mode %o ino %d, want the symlink inode %d", hl.Mode, hl.Ino, sec.Ino)
			}
			if st := lstat(t, tr.secret); st.Nlink != 1 {
				t.Fatalf("secret has %d links", st.Nlink)
			}
		},
	},
	{
		name: "truncate through symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return walk(t, root, "sec").SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: 0})
		},
		direct: linux.EINVAL,
	},
	{
		name: "chmod through symlink",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return walk(t, root, "sec").SetAttr(p9.SetAttrMask{Permissions: true}, p9.SetAttr{Permissions: 0o777})
		},
		direct: linux.EOPNOTSUPP,
	},
	{
		name: "utimes on symlink changes the symlink only",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return walk(t, root, "sec").SetAttr(
				p9.SetAttrMask{ATime: true, MTime: true, ATimeNotSystemTime: true, MTimeNotSystemTime: true},
				p9.SetAttr{ATimeSeconds: 1, MTimeSeconds: 1})
		},
		check: func(t *testing.T, tr *tree, root p9.File) {
			if st := lstat(t, tr.path("sec")); st.Mtim.Sec != 1 {
				t.Fatalf("symlink mtime %d, want 1", st.Mtim.Sec)
			}
		},
	},
	{
		name: "chown of symlink to a foreign id",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return walk(t, root, "sec").SetAttr(p9.SetAttrMask{UID: true}, p9.SetAttr{UID: 4242})
		},
		direct: linux.EPERM,
	},
	{
		name: "unlink symlink removes only the link",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			return root.UnlinkAt("sec", 0)
		},
		check: func(t *testing.T, tr *tree, root p9.File) {
			if _, err := os.Lstat(tr.path("sec")); !os.IsNotExist(err) {
				t.Fatalf("share/sec still there: %v", err)
			}
		},
	},
	{
		name: "directory swapped for a symlink under an fid",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			d := walk(t, root, "dir")
			must(t, os.Rename(tr.path("dir"), tr.path("dir2")))
			must(t, os.Symlink(tr.outside, tr.path("dir")))
			f, err := create(d, "new", p9.ReadWrite, 0o644)
			if err == nil {
				f.Close()
			}
			return err
		},
		check: func(t *testing.T, tr *tree, root p9.File) {
			if _, err := os.Stat(tr.path("dir2/new")); err != nil {
				t.Fatalf("file did not land in the moved directory: %v", err)
			}
		},
	},
	{
		name: "mknod of a device",
		run: func(t *testing.T, tr *tree, root p9.File) error {
			_, err := root.Mknod("null", p9.ModeCharacterDevice|0o666, 1, 3, p9.NoUID, p9.NoGID)
			return err
		},
		direct: linux.EPERM,
	},
}

func walkErr(names ...string) func(*testing.T, *tree, p9.File) error {
	return func(t *testing.T, tr *tree, root p9.File) error {
		_, f, err := root.Walk(names)
		if err == nil {
			f.Close()
		}
		return err
	}
}

func openErr(names ...string) func(*testing.T, *tree, p9.File) error {
	return func(t *testing.T, tr *tree, root p9.File) error {
		got, err := readAll(t, root, names...)
		if err == nil {
			t.Errorf("read %q through %q", got, names)
		}
		return err
	}
}

// TestEscapes runs every escape attempt on a fresh tree, directly and
// through capsa's 9P server, and checks that nothing outside the share
// changed.
func TestEscapes(t *testing.T) {
	etc := snapshotFile(t, "/etc/passwd")
	for _, c := range conns {
		for _, ec := range escapeCases {
			t.Run(c.name+"/"+ec.name, func(t *testing.T) {
				tr := newTree(t)
				before := tr.outsideSnap(t)
				root := c.mount(t, newShare(t, tr.root, Options{}))
				wantErr(t, "attempt", ec.run(t, tr, root), ec.direct)
				if ec.check != nil {
					ec.check(t, tr, root)
				}
				if after := tr.outsideSnap(t); after != before {
					t.Fatalf("outside the share changed:\nbefore:\n%s\nafter:\n%s", before, after)
				}
				if _, err := os.Lstat(filepath.Join(tr.outside, "pwn")); err == nil {
					t.Fatal("created outside/pwn")
				}
			})
		}
	}
	if snapshotFile(t, "/etc/passwd") != etc {
		t.Fatal("/etc/passwd changed")
	}
}

func snapshotFile(t *testing.T, p string) string {
	st, err := os.Lstat(p)
	if err != nil {
		return err.Error()
	}
	return st.Mode().String() + st.ModTime().String()
}

// TestXattrThroughSymlink: xattrs are direct-only (p9's client has none).
func TestXattrThroughSymlink(t *testing.T) {
	tr := newTree(t)
	root := mountDirect(t, newShare(t, tr.root, Options{}))
	sec := walk(t, root, "sec")
	wantErr(t, "setxattr on symlink", sec.SetXattr("user.x", []byte("y"), 0), linux.EPERM)
	wantErr(t, "removexattr on symlink", sec.RemoveXattr("user.x"), linux.EPERM)
	_, err := sec.GetXattr("user.x")
	wantErr(t, "getxattr on symlink", err, linux.ENODATA)
	if names, err := sec.ListXattrs(); err != nil || len(names) != 0 {
		t.Fatalf("listxattr on symlink: %q, %v", names, err)
	}
	if n, _ := unix.Getxattr(tr.secret, "user.x", nil); n > 0 {
		t.Fatal("secret got an xattr")
	}
}

// TestCrossShare: links and renames between shares fail with EXDEV.
func TestCrossShare(t *testing.T) {
	tr := newTree(t)
	root := mountDirect(t, newShare(t, tr.root, Options{}))
	other := mountDirect(t, newShare(t, tr.outside, Options{}))
	keep := walk(t, other, "keep")
	wantErr(t, "link across shares", root.Link(keep, "stolen"), linux.EXDEV)
	wantErr(t, "rename across shares", root.RenameAt("file", other, "file"), linux.EXDEV)
	wantErr(t, "rename to a foreign File", root.RenameAt("file", fakeFile{}, "file"), linux.EXDEV)
	if _, err := os.Lstat(tr.path("stolen")); err == nil {
		t.Fatal("linked across shares")
	}
}

// fakeFile is a p9.File of some other implementation.
type fakeFile struct{ p9.File }
