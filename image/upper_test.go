package image

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestUpperTemplate: the store makes a layer's template once per size and
// opens the same file after; the template is a file system e2fsck
// accepts; a symlink or a file of another size in its place is replaced
// by a new template, never followed or copied.
func TestUpperTemplate(t *testing.T) {
	s, err := Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	const size = 128 << 20
	ino := func() uint64 {
		t.Helper()
		f, err := s.OpenUpperTemplate(size)
		if err != nil {
			t.Fatalf("OpenUpperTemplate() = %v", err)
		}
		defer f.Close()
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			t.Fatal(err)
		}
		if st.Size != size {
			t.Errorf("template of %d bytes, want %d", st.Size, size)
		}
		return st.Ino
	}
	first := ino()
	if again := ino(); again != first {
		t.Errorf("the second open made the template again (inode %d, then %d)", first, again)
	}
	p := filepath.Join(s.dir, "upper", "v1-134217728.ext4")
	if e2fsck, err := exec.LookPath("e2fsck"); err == nil {
		if out, err := exec.Command(e2fsck, "-fn", p).CombinedOutput(); err != nil {
			t.Errorf("e2fsck -fn of the template: %v\n%s", err, out)
		}
	}
	if _, err := s.OpenUpperTemplate(1 << 20); err == nil {
		t.Error("OpenUpperTemplate(1 MiB) = nil error")
	}
	// Something else in the template's place is replaced, not used.
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, bytes.Repeat([]byte("secret"), size/6+1)[:size], 0o600); err != nil {
		t.Fatal(err)
	}
	for _, plant := range []func() error{
		func() error { return os.Symlink(secret, p) },
		func() error { return os.WriteFile(p, make([]byte, 4096), 0o644) },
	} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
		if err := plant(); err != nil {
			t.Fatal(err)
		}
		ino()
		if fi, err := os.Lstat(p); err != nil || !fi.Mode().IsRegular() || fi.Size() != size {
			t.Errorf("after a planted file, the template is %v, %v; want a regular file of %d bytes", fi, err, size)
		}
		if b, err := os.ReadFile(secret); err != nil || !bytes.HasPrefix(b, []byte("secret")) {
			t.Errorf("the symlink's target changed: %v", err)
		}
	}
	if e2fsck, err := exec.LookPath("e2fsck"); err == nil {
		if out, err := exec.Command(e2fsck, "-fn", p).CombinedOutput(); err != nil {
			t.Errorf("e2fsck -fn of the remade template: %v\n%s", err, out)
		}
	}
}
