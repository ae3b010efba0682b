package p9fs

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/p9server"
)

const secretText = "TOPSECRET"

// tree is a share with things outside it to escape to:
//
//	base/secret            "TOPSECRET", outside the share
//	base/outside/          a directory outside the share
//	base/share/            the share root
//	base/share/file        "hello"
//	base/share/dir/inner   "inner"
//	base/share/etc     ->  /etc
//	base/share/up      ->  ../..
//	base/share/out     ->  base/outside (absolute)
//	base/share/sec     ->  base/secret  (absolute, planted by the host)
//	base/share/relsec  ->  ../secret
type tree struct {
	base, root, outside, secret string
}

func newTree(t testing.TB) *tree {
	t.Helper()
	base := t.TempDir()
	tr := &tree{
		base:    base,
		root:    filepath.Join(base, "share"),
		outside: filepath.Join(base, "outside"),
		secret:  filepath.Join(base, "secret"),
	}
	must(t, os.WriteFile(tr.secret, []byte(secretText), 0o600))
	must(t, os.Mkdir(tr.outside, 0o755))
	must(t, os.WriteFile(filepath.Join(tr.outside, "keep"), []byte("keep"), 0o644))
	must(t, os.Mkdir(tr.root, 0o755))
	must(t, os.WriteFile(tr.path("file"), []byte("hello"), 0o644))
	must(t, os.Mkdir(tr.path("dir"), 0o755))
	must(t, os.WriteFile(tr.path("dir/inner"), []byte("inner"), 0o644))
	must(t, os.Symlink("/etc", tr.path("etc")))
	must(t, os.Symlink("../..", tr.path("up")))
	must(t, os.Symlink(tr.outside, tr.path("out")))
	must(t, os.Symlink(tr.secret, tr.path("sec")))
	must(t, os.Symlink("../secret", tr.path("relsec")))
	return tr
}

func (tr *tree) path(rel string) string { return filepath.Join(tr.root, rel) }

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// snapshot describes everything under dir (not atimes): type, mode,
// owner, size, link count, mtime, content hash, symlink text.
func snapshot(t testing.TB, dir string) string {
	t.Helper()
	var lines []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		extra := ""
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			extra = fmt.Sprintf("%x", sha256.Sum256(b))
		case unix.S_IFLNK:
			extra, _ = os.Readlink(p)
		}
		rel, _ := filepath.Rel(dir, p)
		lines = append(lines, fmt.Sprintf("%s mode=%o uid=%d gid=%d size=%d nlink=%d mtime=%d.%d %s",
			rel, st.Mode, st.Uid, st.Gid, st.Size, st.Nlink, st.Mtim.Sec, st.Mtim.Nsec, extra))
		return nil
	})
	must(t, err)
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// outsideSnap is the state of everything outside the share.
func (tr *tree) outsideSnap(t testing.TB) string {
	return snapshot(t, tr.outside) + "\n" + snapshot(t, tr.secret)
}

// newShare makes a share of dir and closes it with the test.
func newShare(t testing.TB, dir string, o Options) p9.Attacher {
	t.Helper()
	a, err := New(dir, o)
	must(t, err)
	t.Cleanup(func() { a.(io.Closer).Close() })
	return a
}

// conn is how a test reaches a share: directly or through capsa's 9P
// server and p9's client.
type conn struct {
	name  string
	wire  bool
	mount func(t testing.TB, a p9.Attacher) p9.File
}

var conns = []conn{
	{name: "direct", mount: mountDirect},
	{name: "direct-openat", mount: mountNoOpenat2},
	{name: "wire", wire: true, mount: mountWire},
}

// mountNoOpenat2 is mountDirect with the openat(2) fallback for hosts
// without openat2.
func mountNoOpenat2(t testing.TB, a p9.Attacher) p9.File {
	a.(*share).useOpenat2 = false
	return mountDirect(t, a)
}

func mountDirect(t testing.TB, a p9.Attacher) p9.File {
	t.Helper()
	f, err := a.Attach()
	must(t, err)
	t.Cleanup(func() { f.Close() })
	return f
}

// mountWire serves a with capsa's 9P server (package p9server, what the
// virtio-9p device runs) over a net.Pipe and attaches p9's client to it.
// The cleanup waits until the server has dropped every fid.
func mountWire(t testing.TB, a p9.Attacher) p9.File {
	t.Helper()
	sc, cc := net.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		p9server.New(a, p9server.Options{}).ServeStream(sc)
	}()
	c, err := p9.NewClient(cc, p9.WithMessageSize(256<<10))
	if err != nil {
		cc.Close()
		<-done
		t.Fatal(err)
	}
	root, err := c.Attach("")
	if err != nil {
		c.Close()
		<-done
		t.Fatal(err)
	}
	t.Cleanup(func() {
		root.Close()
		c.Close()
		<-done
	})
	return root
}

// wantErr checks err is the errno want.
func wantErr(t testing.TB, what string, err error, want linux.Errno) {
	t.Helper()
	if want == 0 {
		if err != nil {
			t.Fatalf("%s: %v, want success", what, err)
		}
		return
	}
	var got linux.Errno
	if !errors.As(err, &got) || got != want {
		t.Fatalf("%s: error %v (%T), want %v (errno %d)", what, err, err, want, int(want))
	}
}

// walk walks from f and fails the test on error.
func walk(t testing.TB, f p9.File, names ...string) p9.File {
	t.Helper()
	_, nf, err := f.Walk(names)
	if err != nil {
		t.Fatalf("walk %q: %v", names, err)
	}
	t.Cleanup(func() { nf.Close() })
	return nf
}

// create creates name in dir; the client converts the fid it creates
// from, so this creates from a clone.
func create(dir p9.File, name string, flags p9.OpenFlags, perm p9.FileMode) (p9.File, error) {
	_, d, err := dir.Walk(nil)
	if err != nil {
		return nil, err
	}
	nf, _, _, err := d.Create(name, flags, perm, p9.NoUID, p9.NoGID)
	if err != nil {
		d.Close()
		return nil, err
	}
	if nf != d {
		d.Close()
	}
	return nf, nil
}

// readAll opens a fresh fid of names read-only and reads it.
func readAll(t testing.TB, root p9.File, names ...string) (string, error) {
	t.Helper()
	_, f, err := root.Walk(names)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if _, _, err := f.Open(p9.ReadOnly); err != nil {
		return "", err
	}
	buf := make([]byte, 4096)
	n, err := f.ReadAt(buf, 0)
	if err != nil && err != io.EOF {
		return "", err
	}
	return string(buf[:n]), nil
}

// readdirAll lists an opened directory in chunks of count bytes.
func readdirAll(t testing.TB, d p9.File, count uint32) p9.Dirents {
	t.Helper()
	var all p9.Dirents
	off := uint64(0)
	for range 10000 {
		ents, err := d.Readdir(off, count)
		if err != nil && err != io.EOF {
			t.Fatalf("readdir at %d: %v", off, err)
		}
		if len(ents) == 0 {
			return all
		}
		all = append(all, ents...)
		off = ents[len(ents)-1].Offset
	}
	t.Fatal("readdir does not end")
	return nil
}

// fdCount is the number of open descriptors of this process.
func fdCount(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	must(t, err)
	return len(ents) - 1 // the directory ReadDir itself opened
}

// lstat stats a host path without following it.
func lstat(t testing.TB, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	must(t, unix.Lstat(p, &st))
	return st
}
