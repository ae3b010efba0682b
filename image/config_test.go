package image

import (
	"bytes"
	"errors"
	"os"
	"reflect"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"golang.org/x/sys/unix"
)

func TestResolve(t *testing.T) {
	img := &Image{Config: v1.ConfigFile{Config: v1.Config{
		Entrypoint: []string{"/entry"}, Cmd: []string{"default", "args"},
		Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, WorkingDir: "/app", User: "app",
	}}}
	for _, tc := range []struct {
		name string
		o    Overrides
		want Process
	}{
		{"image defaults", Overrides{}, Process{
			Argv: []string{"/entry", "default", "args"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, Dir: "/app", User: "app"}},
		{"args replace CMD", Overrides{Args: []string{"x"}}, Process{
			Argv: []string{"/entry", "x"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, Dir: "/app", User: "app"}},
		{"--entrypoint drops CMD", Overrides{Entrypoint: []string{"/bin/sh"}}, Process{
			Argv: []string{"/bin/sh"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, Dir: "/app", User: "app"}},
		{"empty --entrypoint with args", Overrides{Entrypoint: []string{}, Args: []string{"ls", "-l"}}, Process{
			Argv: []string{"ls", "-l"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, Dir: "/app", User: "app"}},
		{"env, dir and user override", Overrides{Env: []string{"A=2", "B=3"}, Dir: "/tmp", User: "1000:1000"}, Process{
			Argv: []string{"/entry", "default", "args"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=2", "B=3"}, Dir: "/tmp", User: "1000:1000"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := img.Resolve(tc.o)
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Resolve(%+v) = %+v, %v; want %+v", tc.o, got, err, tc.want)
			}
		})
	}
	bare := &Image{}
	if _, err := bare.Resolve(Overrides{}); !errors.Is(err, ErrNoCommand) {
		t.Errorf("Resolve of an image without a command = %v, want ErrNoCommand", err)
	}
	got, err := bare.Resolve(Overrides{Args: []string{"/hello"}})
	if err != nil || got.Dir != "/" || got.User != "" || !reflect.DeepEqual(got.Env, []string{"PATH=" + DefaultPath}) {
		t.Errorf("Resolve of a bare image = %+v, %v; want dir /, root, the default PATH", got, err)
	}
}

// TestUpperLayer: the store's template is an ext4 file of the size asked
// for (what a sandbox's writable layer copies; TestUpperTemplate runs
// e2fsck on it), a size under MinUpperSize is refused, and a 1 GiB layer
// takes the disk of its metadata, not of its inode tables' zeros (32 MiB).
// (A copy never overwrites an existing file: TestCloneFile.)
func TestUpperLayer(t *testing.T) {
	s, err := Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	f, err := s.OpenUpperTemplate(256 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || fi.Size() != 256<<20 {
		t.Fatalf("Stat = %v, %v; want a 256 MiB file", fi, err)
	}
	sb := make([]byte, 2)
	f.ReadAt(sb, 1024+0x38) // s_magic
	if sb[0] != 0x53 || sb[1] != 0xef {
		t.Errorf("superblock magic % x, want 53 ef", sb)
	}
	if f, err := s.OpenUpperTemplate(1 << 20); err == nil {
		f.Close()
		t.Error("a template of 1 MiB was made")
	}
	big, err := s.OpenUpperTemplate(1 << 30)
	if err != nil {
		t.Fatal(err)
	}
	defer big.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(big.Fd()), &st); err != nil || st.Blocks*512 > 4<<20 {
		t.Errorf("a 1 GiB layer takes %d bytes on disk (%v), want at most 4 MiB", st.Blocks*512, err)
	}
}

// TestSparseFile: zeros written to a block never written are skipped (the
// file stays a hole there); zeros over data, whole or partial, are
// written; the file reads as the writes in order would leave it.
func TestSparseFile(t *testing.T) {
	f, err := os.Create(t.TempDir() + "/f")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const size = 64 << 10
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, size)
	s := newSparseFile(f, size)
	write := func(p []byte, off int64) {
		t.Helper()
		if n, err := s.WriteAt(p, off); err != nil || n != len(p) {
			t.Fatalf("WriteAt(%d bytes at %d) = %d, %v", len(p), off, n, err)
		}
		copy(want[off:], p)
	}
	data := bytes.Repeat([]byte{7}, 6000)
	write(make([]byte, size), 0)    // all zeros: nothing written
	write(data, 5000)               // blocks 1 and 2
	write(make([]byte, 100), 5100)  // zeros into data: written
	write(make([]byte, 4096), 8192) // block 2 (data) zeroed: written
	write([]byte{0, 0, 9}, 40000)   // a partial block, data after zeros
	got := make([]byte, size)
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Error("the file differs from the writes in order")
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks*512 > 4*4096 {
		t.Errorf("%d bytes on disk, want at most the 4 blocks written with data", st.Blocks*512)
	}
	if _, err := s.WriteAt([]byte{1}, -1); err == nil {
		t.Error("WriteAt at a negative offset = nil error")
	}
}
