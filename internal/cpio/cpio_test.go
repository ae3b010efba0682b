package cpio

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestRoundTripWithGNUCpio checks the archive against an independent reader:
// GNU cpio, when it is installed.
func TestRoundTripWithGNUCpio(t *testing.T) {
	bin, err := exec.LookPath("cpio")
	if err != nil {
		t.Skip("GNU cpio not installed")
	}
	src := filepath.Join(t.TempDir(), "big")
	big := bytes.Repeat([]byte("0123456789abcdef"), 4097)
	if err := os.WriteFile(src, big[:len(big)-3], 0o600); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	w := NewWriter(&buf)
	for _, err := range []error{
		w.Dir("bin", 0o755),
		w.File("bin/hello", 0o755, []byte("#!/bin/sh\necho hi\n")),
		w.Symlink("bin/sh", "busybox"),
		w.Dir("/work/", 0o700),
		w.CopyFile("work/big", src, 0o644),
		w.File("odd", 0o600, []byte("x")),
		w.Close(),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	if buf.Len()%4 != 0 {
		t.Errorf("archive length %d not 4-byte aligned", buf.Len())
	}
	dir := t.TempDir()
	cmd := exec.Command(bin, "-i", "-d", "--quiet", "--no-absolute-filenames")
	cmd.Dir = dir
	cmd.Stdin = &buf
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i: %v\n%s", err, out)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "bin/hello")); string(b) != "#!/bin/sh\necho hi\n" {
		t.Errorf("bin/hello = %q", b)
	}
	if l, _ := os.Readlink(filepath.Join(dir, "bin/sh")); l != "busybox" {
		t.Errorf("bin/sh -> %q", l)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "work/big")); !bytes.Equal(b, big[:len(big)-3]) {
		t.Errorf("work/big: %d bytes, contents differ", len(b))
	}
	if st, err := os.Stat(filepath.Join(dir, "bin/hello")); err != nil || st.Mode().Perm() != 0o755 {
		t.Errorf("bin/hello mode: %v %v", st.Mode(), err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "odd")); string(b) != "x" {
		t.Errorf("odd = %q", b)
	}
}

func TestErrors(t *testing.T) {
	w := NewWriter(&bytes.Buffer{})
	if err := w.File("a", 0o644, nil); err != nil {
		t.Fatal(err)
	}
	if err := w.File("/a", 0o644, nil); err == nil || !strings.Contains(err.Error(), "duplicate") {
		t.Errorf("duplicate entry: %v", err)
	}
	if err := w.CopyFile("b", t.TempDir(), 0o644); err == nil {
		t.Error("CopyFile of a directory succeeded")
	}
	w.Close()
	if err := w.File("c", 0o644, nil); err == nil {
		t.Error("write after Close succeeded")
	}
}
