package image

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestUpperTemplate: the store makes a layer's template once per size and
// opens the same file after; the template is a file system e2fsck
// accepts; a symlink or a file of another size in its place is refused.
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
	p := filepath.Join(s.dir, "upper", "134217728.ext4")
	if e2fsck, err := exec.LookPath("e2fsck"); err == nil {
		if out, err := exec.Command(e2fsck, "-fn", p).CombinedOutput(); err != nil {
			t.Errorf("e2fsck -fn of the template: %v\n%s", err, out)
		}
	}
	if _, err := s.OpenUpperTemplate(1 << 20); err == nil {
		t.Error("OpenUpperTemplate(1 MiB) = nil error")
	}
	// Something else in the template's place is refused, not copied.
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(secret, p); err != nil {
		t.Fatal(err)
	}
	if f, err := s.OpenUpperTemplate(size); err == nil {
		f.Close()
		t.Error("OpenUpperTemplate() followed a symlink in the template's place")
	}
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	if f, err := s.OpenUpperTemplate(size); err == nil {
		f.Close()
		t.Error("OpenUpperTemplate() took a template of the wrong size")
	}
}
