package p9fs

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
)

// lentChildEnv, set, makes TestOpenLent run its part as the file's owner
// in this process, which its parent started as that user.
const lentChildEnv = "P9FS_LENT_DIR"

// TestOpenLent: a VMM run by an ordinary user opens a read-only file it
// owns for writing when the client checked the permission itself (a FUSE
// guest writing through the descriptor it made the file 0444 with), and
// sets the mode back; Open alone is refused. As root, the test runs that
// part as another user in a child process.
func TestOpenLent(t *testing.T) {
	if dir := os.Getenv(lentChildEnv); dir != "" {
		openLent(t, dir)
		return
	}
	if os.Getuid() != 0 {
		openLent(t, t.TempDir())
		return
	}
	dir, err := os.MkdirTemp("", "p9fs-lent-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	const nobody = 65534
	if err := os.Chown(dir, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	// The test binary's own directory is root's alone: the child runs a
	// copy in the directory it owns.
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(dir, "p9fs.test")
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestOpenLent$", "-test.v")
	cmd.Env = append(os.Environ(), lentChildEnv+"="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the test as uid %d: %v\n%s", nobody, err, out)
	}
	t.Logf("as uid %d:\n%s", nobody, out)
}

func openLent(t *testing.T, dir string) {
	path := filepath.Join(dir, "obj")
	if err := os.WriteFile(path, []byte("old"), 0o444); err != nil {
		t.Fatal(err)
	}
	root := mountDirect(t, newShare(t, dir, Options{}))
	walk := func() *file {
		_, f, err := root.Walk([]string{"obj"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f.(*file)
	}
	if _, _, err := walk().Open(p9.WriteOnly); !errors.Is(err, linux.EACCES) {
		t.Fatalf("Open for writing of a 0444 file: %v, want EACCES", err)
	}
	f := walk()
	if _, _, err := f.OpenLent(p9.WriteOnly); err != nil {
		t.Fatalf("OpenLent for writing of a 0444 file the VMM's user owns: %v", err)
	}
	if _, err := f.WriteAt([]byte("new"), 0); err != nil {
		t.Fatalf("write: %v", err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o444 {
		t.Fatalf("after the lent open the mode is %v, %v; want 0444 again", fi.Mode(), err)
	}
	if b, _ := os.ReadFile(path); string(b) != "new" {
		t.Fatalf("the file holds %q", b)
	}
}
