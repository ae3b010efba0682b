package p9fs

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// userXattrs skips where the test directory's file system keeps no user
// attributes (tmpfs before Linux 6.6): there a share shows the mapped ids
// only, which TestOwnersWithoutXattrs checks.
func userXattrs(t *testing.T, dir string) {
	t.Helper()
	if err := unix.Setxattr(dir, "user.capsa-test", []byte("1"), 0); err != nil {
		t.Skipf("%s keeps no user attributes (%v)", dir, err)
	}
	unix.Removexattr(dir, "user.capsa-test")
}

func hostOwner(t *testing.T, p string) string {
	t.Helper()
	buf := make([]byte, 64)
	n, err := unix.Getxattr(p, ownerXattr, buf)
	if err == unix.ENODATA {
		return ""
	}
	if err != nil {
		t.Fatalf("getxattr %s: %v", p, err)
	}
	return string(buf[:n])
}

func shownIDs(t *testing.T, f p9.File) (uint32, uint32) {
	t.Helper()
	_, _, a, err := f.GetAttr(p9.AttrMaskAll)
	if err != nil {
		t.Fatal(err)
	}
	return uint32(a.UID), uint32(a.GID)
}

// TestOwners: files a guest user makes are shown as that user's, chown
// changes what is shown, and the host files stay the VMM's, with the
// owner in ownerXattr, which the guest can neither see nor set.
func TestOwners(t *testing.T) {
	for _, c := range conns {
		if c.wire {
			// 9P2000.L's creates carry no uid: the server gives what a
			// fid makes the user of its attach (p9server's
			// TestCreatorIsAttachUser), and p9's client attaches as
			// no one.
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			userXattrs(t, dir)
			root := c.mount(t, newShare(t, dir, Options{}))

			// A regular file and a directory made by uid 1000.
			_, d, err := root.Walk(nil)
			must(t, err)
			nf, _, _, err := d.Create("f", p9.WriteOnly, 0o644, 1000, 1000)
			must(t, err)
			nf.Close()
			if nf != d {
				d.Close()
			}
			_, err = root.Mkdir("d", 0o755, 1000, 100)
			must(t, err)
			// Root's and an unknown creator's: the mapped ids, no attribute.
			_, err = root.Mkdir("r", 0o755, 0, 0)
			must(t, err)
			_, err = root.Mkdir("n", 0o755, p9.NoUID, p9.NoGID)
			must(t, err)
			// A symlink keeps no attribute: the mapped ids.
			_, err = root.Symlink("f", "l", 1000, 1000)
			must(t, err)

			for _, w := range []struct {
				name     string
				uid, gid uint32
				host     string
			}{
				{"f", 1000, 1000, "1000:1000"},
				{"d", 1000, 100, "1000:100"},
				{"r", 0, 0, ""},
				{"n", 0, 0, ""},
				{"l", 0, 0, ""},
			} {
				f := walk(t, root, w.name)
				if uid, gid := shownIDs(t, f); uid != w.uid || gid != w.gid {
					t.Errorf("%s is shown as %d:%d, want %d:%d", w.name, uid, gid, w.uid, w.gid)
				}
				if w.name != "l" {
					if got := hostOwner(t, filepath.Join(dir, w.name)); got != w.host {
						t.Errorf("%s's %s = %q, want %q", w.name, ownerXattr, got, w.host)
					}
				}
				var st unix.Stat_t
				must(t, unix.Lstat(filepath.Join(dir, w.name), &st))
				if st.Uid != uint32(os.Geteuid()) {
					t.Errorf("%s belongs to uid %d on the host, want the VMM's %d", w.name, st.Uid, os.Geteuid())
				}
			}

			// chown: to another owner, then back to the mapped one (the
			// attribute goes), and a gid alone.
			f := walk(t, root, "f")
			chown := func(uid p9.UID, gid p9.GID) error {
				return f.SetAttr(p9.SetAttrMask{UID: uid.Ok(), GID: gid.Ok()}, p9.SetAttr{UID: uid, GID: gid})
			}
			must(t, chown(5, 6))
			if uid, gid := shownIDs(t, f); uid != 5 || gid != 6 {
				t.Errorf("after chown 5:6, shown %d:%d", uid, gid)
			}
			must(t, chown(0, 0))
			if uid, gid := shownIDs(t, f); uid != 0 || gid != 0 || hostOwner(t, filepath.Join(dir, "f")) != "" {
				t.Errorf("after chown 0:0, shown %d:%d, attribute %q; want 0:0 and none", uid, gid, hostOwner(t, filepath.Join(dir, "f")))
			}
			must(t, chown(p9.NoUID, 7))
			if uid, gid := shownIDs(t, f); uid != 0 || gid != 7 {
				t.Errorf("after chgrp 7, shown %d:%d", uid, gid)
			}

			// The guest's attribute calls never reach the owner's (the
			// p9 client has no attribute calls).
			if c.wire {
				return
			}
			must(t, chown(5, 6))
			names, err := f.ListXattrs()
			must(t, err)
			if slices.Contains(names, ownerXattr) {
				t.Errorf("the guest lists %q", ownerXattr)
			}
			if _, err := f.GetXattr(ownerXattr); err == nil {
				t.Errorf("the guest reads %q", ownerXattr)
			}
			wantErr(t, "setxattr of the owner", f.SetXattr(ownerXattr, []byte("0:0"), 0), linux.EPERM)
			wantErr(t, "removexattr of the owner", f.RemoveXattr(ownerXattr), linux.EPERM)

			// A malformed attribute written on the host shows the mapped ids.
			for _, bad := range []string{"x", "1000", "4294967295:0", "-1:0", "1:2:3", "99999999999:1"} {
				must(t, unix.Setxattr(filepath.Join(dir, "d"), ownerXattr, []byte(bad), 0))
				if uid, gid := shownIDs(t, walk(t, root, "d")); uid != 0 || gid != 0 {
					t.Errorf("with %s = %q, d is shown as %d:%d, want the mapped 0:0", ownerXattr, bad, uid, gid)
				}
			}
		})
	}
}

// TestOwnersOfOthersFiles: a file the VMM's user does not own keeps its
// host ids, and a chown that would change them fails.
func TestOwnersOfOthersFiles(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a file of another user")
	}
	dir := t.TempDir()
	must(t, os.WriteFile(filepath.Join(dir, "theirs"), nil, 0o666))
	must(t, os.Chown(filepath.Join(dir, "theirs"), 4321, 4321))
	root := mountDirect(t, newShare(t, dir, Options{}))
	f := walk(t, root, "theirs")
	if uid, gid := shownIDs(t, f); uid != 4321 || gid != 4321 {
		t.Errorf("shown %d:%d, want the host's 4321:4321", uid, gid)
	}
	wantErr(t, "chown of another user's file", f.SetAttr(p9.SetAttrMask{UID: true}, p9.SetAttr{UID: 5}), linux.EPERM)
	must(t, f.SetAttr(p9.SetAttrMask{UID: true}, p9.SetAttr{UID: 4321})) // nothing changes
}

// BenchmarkGetAttrOwner: what reading the owner attribute adds to a
// Tgetattr's work on the host, side by side with the anchor, a file the
// VMM's user does not own (no attribute read): the VMM's own file with no
// owner kept (the read finds none) and with one (uid 1000's).
//
//	go test -run '^$' -bench GetAttrOwner ./p9fs   (as root, on a file system with user attributes)
func BenchmarkGetAttrOwner(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root to make a file of another user")
	}
	dir := b.TempDir()
	if err := unix.Setxattr(dir, "user.capsa-test", []byte("1"), 0); err != nil {
		b.Skipf("%s keeps no user attributes (%v)", dir, err)
	}
	must(b, os.WriteFile(filepath.Join(dir, "theirs"), nil, 0o644))
	must(b, os.Chown(filepath.Join(dir, "theirs"), 4321, 4321))
	root := mountDirect(b, newShare(b, dir, Options{}))
	_, err := root.Mkdir("plain", 0o755, p9.NoUID, p9.NoGID)
	must(b, err)
	_, err = root.Mkdir("owned", 0o755, 1000, 1000)
	must(b, err)
	for _, name := range []string{"theirs", "plain", "owned"} {
		b.Run(name, func(b *testing.B) {
			f := walk(b, root, name)
			for b.Loop() {
				if _, _, _, err := f.GetAttr(p9.AttrMaskAll); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestOwnersNotRoot: a VMM run by an ordinary user keeps and shows the
// owners of files whose modes give it no permission to their attributes:
// made read-only (as git's objects are), chowned while read-only, and
// chmod'ed to 0 through the share. Run as root, it runs itself again as
// another user.
func TestOwnersNotRoot(t *testing.T) {
	if dir := os.Getenv("P9FS_NOT_ROOT_DIR"); dir != "" {
		ownersNotRoot(t, dir)
		return
	}
	if os.Geteuid() != 0 {
		ownersNotRoot(t, t.TempDir())
		return
	}
	d, err := os.MkdirTemp("", "p9fs-not-root-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(d) })
	must(t, os.Chmod(d, 0o755))
	exe, err := os.Executable()
	must(t, err)
	b, err := os.ReadFile(exe)
	must(t, err)
	bin := filepath.Join(d, "p9fs.test")
	must(t, os.WriteFile(bin, b, 0o755))
	work := filepath.Join(d, "work")
	must(t, os.Mkdir(work, 0o700))
	must(t, os.Chown(work, 4321, 4321))
	cmd := exec.Command(bin, "-test.run", "^TestOwnersNotRoot$", "-test.v")
	cmd.Env = append(os.Environ(), "P9FS_NOT_ROOT_DIR="+work, "TMPDIR="+work)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 4321, Gid: 4321}}
	out, err := cmd.CombinedOutput()
	switch {
	case bytes.Contains(out, []byte("--- SKIP: TestOwnersNotRoot")):
		t.Skipf("as uid 4321: %s", out)
	case err != nil || !bytes.Contains(out, []byte("--- PASS: TestOwnersNotRoot")):
		t.Fatalf("as uid 4321: %v\n%s", err, out)
	}
}

func ownersNotRoot(t *testing.T, dir string) {
	userXattrs(t, dir)
	root := mountDirect(t, newShare(t, dir, Options{}))
	nf, _, _, err := walk(t, root).Create("ro", p9.WriteOnly, 0o444, 1000, 1000)
	must(t, err)
	nf.Close()
	_, err = root.Mkdir("rx", 0o555, 1000, 1000)
	must(t, err)
	_, err = root.Mkdir("none", 0, 1000, 1000)
	must(t, err)
	for name, mode := range map[string]uint32{"ro": 0o444, "rx": 0o555, "none": 0} {
		if uid, gid := shownIDs(t, walk(t, root, name)); uid != 1000 || gid != 1000 {
			t.Errorf("%s (mode %o), made by uid 1000, is shown as %d:%d", name, mode, uid, gid)
		}
		if st := lstat(t, filepath.Join(dir, name)); st.Mode&0o7777 != mode {
			t.Errorf("%s's mode on the host is %o, want %o", name, st.Mode&0o7777, mode)
		}
	}
	f := walk(t, root, "ro")
	must(t, f.SetAttr(p9.SetAttrMask{UID: true, GID: true}, p9.SetAttr{UID: 5, GID: 6}))
	if uid, gid := shownIDs(t, f); uid != 5 || gid != 6 {
		t.Errorf("after chown 5:6 of a read-only file, shown %d:%d", uid, gid)
	}
	must(t, f.SetAttr(p9.SetAttrMask{Permissions: true}, p9.SetAttr{Permissions: 0}))
	if uid, gid := shownIDs(t, f); uid != 5 || gid != 6 {
		t.Errorf("after chmod 0, shown %d:%d; want 5:6 still", uid, gid)
	}
	must(t, f.SetAttr(p9.SetAttrMask{Permissions: true}, p9.SetAttr{Permissions: 0o640}))
	if uid, gid := shownIDs(t, f); uid != 5 || gid != 6 || hostOwner(t, filepath.Join(dir, "ro")) != "5:6" {
		t.Errorf("after chmod 640, shown %d:%d, attribute %q; want 5:6", uid, gid, hostOwner(t, filepath.Join(dir, "ro")))
	}
}
