package snapshot

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestLend: a chain lent and opened from its files makes the same layer
// over it as the chain Open opened, one that opens with its parent and
// maps back to the memory it was written from; a lent chain whose files
// are not what Lend gave is refused.
func TestLend(t *testing.T) {
	root, mem := layerTest(t)
	top, err := Open(filepath.Join(root, "top"))
	if err != nil {
		t.Fatal(err)
	}
	defer top.Close()
	lend := func() []*os.File {
		t.Helper()
		files, err := top.Lend()
		if err != nil {
			t.Fatalf("Lend() = %v", err)
		}
		// As another process gets them: descriptors of their own.
		var dup []*os.File
		for i, f := range files {
			d, err := dupFile(f)
			if err != nil {
				t.Fatal(err)
			}
			dup = append(dup, d)
			if i%2 == 0 {
				f.Close()
			}
		}
		return dup
	}
	lent, err := OpenLent(top.Dir, lend())
	if err != nil {
		t.Fatalf("OpenLent() = %v", err)
	}
	if lent.Chain() != 2 || lent.ManifestSHA256 != top.ManifestSHA256 || lent.Parent.Dir != filepath.Join(root, "base") || lent.State != nil {
		t.Errorf("lent: chain %d, manifest %s (want %s), parent %s, state %v", lent.Chain(), lent.ManifestSHA256, top.ManifestSHA256, lent.Parent.Dir, lent.State)
	}
	mem.WriteAt([]byte("over the lent"), 0x300000)
	if err := WriteWith(filepath.Join(root, "third"), top.Manifest, top.State, mem, nil, WriteOptions{Parent: lent}); err != nil {
		t.Fatalf("WriteWith(over a lent parent) = %v", err)
	}
	lent.Close()
	third, err := Open(filepath.Join(root, "third"))
	if err != nil {
		t.Fatalf("Open(a layer over a lent parent) = %v", err)
	}
	defer third.Close()
	if third.Chain() != 3 {
		t.Errorf("chain %d, want 3", third.Chain())
	}
	sameAs(t, third, mem)

	for _, c := range []struct {
		name string
		edit func([]*os.File) []*os.File
		want string
	}{
		{"none", func([]*os.File) []*os.File { return nil }, "0 files"},
		{"a manifest without its memory", func(f []*os.File) []*os.File { f[3].Close(); return f[:3] }, "3 files"},
		{"the parent left out", func(f []*os.File) []*os.File { f[2].Close(); f[3].Close(); return f[:2] }, "which was not lent"},
		{"the chain upside down", func(f []*os.File) []*os.File { return []*os.File{f[2], f[3], f[0], f[1]} }, "has no parent"},
		{"a memory file of another size", func(f []*os.File) []*os.File {
			short, err := os.CreateTemp(t.TempDir(), "memory")
			if err != nil {
				t.Fatal(err)
			}
			f[1].Close()
			f[1] = short
			return f
		}, "the manifest says"},
	} {
		_, err := OpenLent(top.Dir, c.edit(lend()))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: OpenLent() = %v; want an error saying %q", c.name, err, c.want)
		}
	}
	if _, err := OpenLent("relative", lend()); err == nil {
		t.Error("OpenLent(a relative directory) succeeded")
	}
}

func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}
