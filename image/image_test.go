package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/erofs/go-erofs"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// entry is one tar entry of a test layer.
type entry struct {
	name, link string
	typ        byte
	mode       int64
	uid, gid   int
	data       string
	xattrs     map[string]string
	major      int64
	minor      int64
}

func layer(t *testing.T, entries ...entry) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid,
			ModTime: time.Unix(1700000000, 0), Devmajor: e.major, Devminor: e.minor, Format: tar.FormatPAX}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.data))
		}
		if len(e.xattrs) > 0 {
			h.PAXRecords = map[string]string{}
			for k, v := range e.xattrs {
				h.PAXRecords["SCHILY.xattr."+k] = v
			}
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			tw.Write([]byte(e.data))
		}
	}
	tw.Close()
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func testImage(t *testing.T, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config.Cmd = []string{"/bin/tool"}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// startRegistry serves an in-process registry on loopback (plain HTTP,
// as go-containerregistry allows for loopback hosts).
func startRegistry(t *testing.T, wrap func(http.Handler) http.Handler) string {
	t.Helper()
	var h http.Handler = registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	if wrap != nil {
		h = wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

func push(t *testing.T, ref string, img v1.Image) {
	t.Helper()
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
}

// rootfs opens a pulled image's EROFS with go-erofs's reader.
func rootfs(t *testing.T, s *Store, img *Image) fs.FS {
	t.Helper()
	p, err := s.RootfsPath(img)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	fsys, err := erofs.Open(f)
	if err != nil {
		t.Fatalf("erofs.Open(%s): %v", p, err)
	}
	return fsys
}

func stat(t *testing.T, fsys fs.FS, p string) (fs.FileInfo, *erofs.Stat) {
	t.Helper()
	fi, err := fs.Stat(fsys, p)
	if err != nil {
		t.Fatalf("Stat(%s): %v", p, err)
	}
	st, _ := fi.Sys().(*erofs.Stat)
	if st == nil {
		t.Fatalf("Stat(%s).Sys() = %T, want *erofs.Stat", p, fi.Sys())
	}
	return fi, st
}

func TestPullConvertsLayers(t *testing.T) {
	reg := startRegistry(t, nil)
	base := layer(t,
		entry{name: "etc/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "etc/passwd", data: "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"},
		entry{name: "bin/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "bin/tool", mode: 0o4755, data: "#!tool\n"},
		entry{name: "bin/ping", mode: 0o755, data: "ping", xattrs: map[string]string{"security.capability": "\x01\x00\x00\x02\x00\x20\x00\x00"}},
		entry{name: "usr/lib/libx.so", data: "libx"},
		entry{name: "lib", typ: tar.TypeSymlink, link: "usr/lib"},
		entry{name: "data/old.txt", data: "old"},
		entry{name: "data/keep.txt", data: "keep"},
		entry{name: "opq/a", data: "a"},
		entry{name: "opq/b", data: "b"},
		entry{name: "dev/null", typ: tar.TypeChar, mode: 0o666, major: 1, minor: 3},
		entry{name: "run/fifo", typ: tar.TypeFifo, mode: 0o600},
		entry{name: "tmp/", typ: tar.TypeDir, mode: 0o1777},
	)
	topEntries := []entry{
		{name: "data/.wh.old.txt"},
		{name: "opq/.wh..wh..opq"},
		{name: "opq/c", data: "c"},
		{name: "bin/tool-link", typ: tar.TypeLink, link: "bin/tool"},
		{name: "home/user/", typ: tar.TypeDir, mode: 0o700, uid: 1000, gid: 1000},
		{name: "home/user/notes", data: "mine", uid: 1000, gid: 1000, mode: 0o600},
	}
	top := layer(t, append(topEntries, entry{name: "lib/libx.so.1", typ: tar.TypeLink, link: "lib/libx.so"})...)
	push(t, reg+"/test/layers:1", testImage(t, base, top))

	s, err := Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var progress []Progress
	img, err := s.Pull(context.Background(), reg+"/test/layers:1", Options{Progress: func(p Progress) { progress = append(progress, p) }})
	// lib/libx.so.1 is a hard link under a symlinked directory: the
	// converter refuses an entry through a symlink rather than guess.
	if err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Fatalf("Pull with an entry under a symlinked directory = %v, want an error naming the symlink", err)
	}
	// Without that entry the image converts.
	top = layer(t, append(topEntries, entry{name: "usr/lib/libx.so.1", typ: tar.TypeLink, link: "lib/libx.so"})...)
	push(t, reg+"/test/layers:2", testImage(t, base, top))
	img, err = s.Pull(context.Background(), reg+"/test/layers:2", Options{Progress: func(p Progress) { progress = append(progress, p) }})
	if err != nil {
		t.Fatal(err)
	}
	if len(img.Layers) != 2 || img.Config.Config.Cmd[0] != "/bin/tool" {
		t.Errorf("Pull = %d layers, Cmd %q; want 2 and /bin/tool", len(img.Layers), img.Config.Config.Cmd)
	}
	if len(progress) == 0 || !progress[len(progress)-1].Complete || progress[len(progress)-1].Layer != -1 {
		t.Errorf("progress ended with %+v, want the conversion's completion", progress[len(progress)-1])
	}
	fsys := rootfs(t, s, img)
	read := func(p string) string {
		b, err := fs.ReadFile(fsys, p)
		if err != nil {
			t.Errorf("ReadFile(%s): %v", p, err)
		}
		return string(b)
	}
	if _, err := fs.Stat(fsys, "data/old.txt"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("whited-out data/old.txt: Stat = %v, want not exist", err)
	}
	if got := read("data/keep.txt"); got != "keep" {
		t.Errorf("data/keep.txt = %q", got)
	}
	ents, _ := fs.ReadDir(fsys, "opq")
	if len(ents) != 1 || ents[0].Name() != "c" {
		t.Errorf("opaque dir opq holds %v, want only c", ents)
	}
	// Modes come from the Stat: go-erofs's FileInfo.Mode drops the
	// setuid, setgid and sticky bits when it reads an image back.
	if _, st := stat(t, fsys, "bin/tool"); st.Mode&fs.ModeSetuid == 0 || st.Mode.Perm() != 0o755 || st.UID != 0 {
		t.Errorf("bin/tool mode %v uid %d, want setuid 0755 root", st.Mode, st.UID)
	}
	if _, st := stat(t, fsys, "bin/tool-link"); st.Mode&fs.ModeSetuid == 0 || read("bin/tool-link") != "#!tool\n" {
		t.Errorf("hard link to a lower layer's file: mode %v, content %q", st.Mode, read("bin/tool-link"))
	}
	if read("usr/lib/libx.so.1") != "libx" {
		t.Error("hard link to a path through a symlink lost its content")
	}
	if _, st := stat(t, fsys, "bin/ping"); st.Xattrs["security.capability"] != "\x01\x00\x00\x02\x00\x20\x00\x00" {
		t.Errorf("bin/ping xattrs = %q, want the file capability", st.Xattrs)
	}
	if fi, st := stat(t, fsys, "home/user"); !fi.IsDir() || fi.Mode().Perm() != 0o700 || st.UID != 1000 || st.GID != 1000 {
		t.Errorf("home/user: mode %v owner %d:%d, want a 0700 directory of 1000:1000", fi.Mode(), st.UID, st.GID)
	}
	if _, st := stat(t, fsys, "tmp"); st.Mode&fs.ModeSticky == 0 {
		t.Errorf("tmp mode %v, want sticky", st.Mode)
	}
	if fi, st := stat(t, fsys, "dev/null"); fi.Mode()&fs.ModeCharDevice == 0 || st.Rdev != 1<<8|3 {
		t.Errorf("dev/null: mode %v rdev %#x, want a char device 1:3", fi.Mode(), st.Rdev)
	}
	if fi, _ := stat(t, fsys, "run/fifo"); fi.Mode()&fs.ModeNamedPipe == 0 {
		t.Errorf("run/fifo mode %v, want a FIFO", fi.Mode())
	}
	if target, err := fs.ReadLink(fsys, "lib"); err != nil || target != "usr/lib" {
		t.Errorf("ReadLink(lib) = %q, %v; want usr/lib", target, err)
	}
	if fi, _ := stat(t, fsys, "home/user/notes"); fi.ModTime().Unix() != 1700000000 {
		t.Errorf("mtime %v, want the layer's", fi.ModTime())
	}

	// The cache serves the second pull of the same layers.
	progress = nil
	if _, err := s.Pull(context.Background(), reg+"/test/layers:2", Options{Progress: func(p Progress) { progress = append(progress, p) }}); err != nil {
		t.Fatal(err)
	}
	for _, p := range progress {
		if p.Layer >= 0 && !p.Cached {
			t.Errorf("second pull fetched layer %d again", p.Layer)
		}
	}
}

func TestHostileLayersAreRefused(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries []entry
		want    string
	}{
		{"dot-dot", []entry{{name: "../../etc/passwd", data: "pwned"}}, "leaves the image"},
		// An entry under a symlink of a lower layer (within one layer,
		// mutate.Extract drops it).
		{"through a symlink", nil, "symlink"},
		{"hard link loop", []entry{{name: "x", typ: tar.TypeSymlink, link: "y"}, {name: "y", typ: tar.TypeSymlink, link: "x"}, {name: "h", typ: tar.TypeLink, link: "x"}}, "levels of symlinks"},
		{"hard link to nothing", []entry{{name: "h", typ: tar.TypeLink, link: "missing"}}, "not in the image"},
		{"hard link to a directory", []entry{{name: "d/", typ: tar.TypeDir, mode: 0o755}, {name: "h", typ: tar.TypeLink, link: "d"}}, "not a regular file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := startRegistry(t, nil)
			if tc.entries == nil {
				push(t, reg+"/bad:1", testImage(t,
					layer(t, entry{name: "a", typ: tar.TypeSymlink, link: "/etc"}),
					layer(t, entry{name: "a/b", data: "x"})))
			} else {
				push(t, reg+"/bad:1", testImage(t, layer(t, tc.entries...)))
			}
			dir := t.TempDir()
			s, err := Open(dir, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, err = s.Pull(context.Background(), reg+"/bad:1", Options{})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Pull = %v, want an error containing %q", err, tc.want)
			}
			if _, err := s.Get(reg + "/bad:1"); !errors.Is(err, ErrNotFound) {
				t.Errorf("Get after a refused image = %v, want ErrNotFound", err)
			}
			if ents, _ := os.ReadDir(filepath.Join(dir, "rootfs", "sha256")); len(ents) != 0 {
				t.Errorf("a refused image left %d root filesystems", len(ents))
			}
			if ents, _ := os.ReadDir(filepath.Join(dir, "tmp")); len(ents) != 0 {
				t.Errorf("a refused image left %d work files", len(ents))
			}
			if _, err := os.Stat(filepath.Join(dir, "..", "etc")); err == nil {
				t.Error("a file appeared outside the cache")
			}
		})
	}
}

func TestLimitsBoundTheRoot(t *testing.T) {
	reg := startRegistry(t, nil)
	push(t, reg+"/big:1", testImage(t, layer(t, entry{name: "big", data: strings.Repeat("x", 1<<20)})))
	s, _ := Open(t.TempDir(), nil)
	_, err := s.Pull(context.Background(), reg+"/big:1", Options{Limits: ConvertLimits{MaxBytes: 1 << 19}})
	if !errors.Is(err, ErrTooLarge) {
		t.Fatalf("Pull past MaxBytes = %v, want ErrTooLarge", err)
	}
	push(t, reg+"/many:1", testImage(t, layer(t, entry{name: "a"}, entry{name: "b"}, entry{name: "c"})))
	if _, err := s.Pull(context.Background(), reg+"/many:1", Options{Limits: ConvertLimits{MaxEntries: 2}}); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("Pull past MaxEntries = %v, want ErrTooLarge", err)
	}
}

func TestCorruptBlobIsNotCached(t *testing.T) {
	img := testImage(t, layer(t, entry{name: "f", data: strings.Repeat("data", 1000)}))
	ls, _ := img.Layers()
	ld, _ := ls[0].Digest()
	reg := startRegistry(t, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/blobs/"+ld.String()) {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, r)
				b := rec.Body.Bytes()
				if len(b) > 10 {
					b[len(b)/2] ^= 0xff
				}
				for k, v := range rec.Header() {
					w.Header()[k] = v
				}
				w.WriteHeader(rec.Code)
				w.Write(b)
				return
			}
			h.ServeHTTP(w, r)
		})
	})
	push(t, reg+"/corrupt:1", img)
	dir := t.TempDir()
	s, _ := Open(dir, nil)
	if _, err := s.Pull(context.Background(), reg+"/corrupt:1", Options{}); err == nil {
		t.Fatal("Pull of a corrupted layer succeeded")
	}
	p, _ := s.blobPath(ld.String())
	if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the corrupted layer was cached (%v)", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "tmp")); len(ents) != 0 {
		t.Errorf("a failed pull left %d work files", len(ents))
	}
}

func TestPlatformFromIndex(t *testing.T) {
	reg := startRegistry(t, nil)
	amd := testImage(t, layer(t, entry{name: "which", data: "amd64"}))
	arm, _ := mutate.ConfigFile(amd, &v1.ConfigFile{OS: "linux", Architecture: "arm64"})
	arm, _ = mutate.AppendLayers(arm, layer(t, entry{name: "which", data: "arm64"}))
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: amd, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	idx = mutate.IndexMediaType(idx, types.OCIImageIndex)
	r, _ := name.ParseReference(reg + "/multi:1")
	if err := remote.WriteIndex(r, idx); err != nil {
		t.Fatal(err)
	}
	s, _ := Open(t.TempDir(), nil)
	img, err := s.Pull(context.Background(), reg+"/multi:1", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := fs.ReadFile(rootfs(t, s, img), "which"); string(b) != "amd64" {
		t.Errorf("the pulled image is %q's, want amd64's", b)
	}
	armOnly := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}})
	r, _ = name.ParseReference(reg + "/armonly:1")
	if err := remote.WriteIndex(r, armOnly); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pull(context.Background(), reg+"/armonly:1", Options{}); err == nil || !strings.Contains(err.Error(), "amd64") {
		t.Errorf("Pull of an arm64-only index = %v, want an error naming amd64", err)
	}
}

func TestGetListRemovePrune(t *testing.T) {
	reg := startRegistry(t, nil)
	push(t, reg+"/a:1", testImage(t, layer(t, entry{name: "a", data: "a"})))
	push(t, reg+"/b:1", testImage(t, layer(t, entry{name: "b", data: "b"})))
	s, _ := Open(t.TempDir(), nil)
	a, err := s.Pull(context.Background(), reg+"/a:1", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pull(context.Background(), reg+"/b:1", Options{}); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Get(strings.TrimPrefix(a.Digest, "sha256:")[:12]); err != nil || got.Digest != a.Digest {
		t.Errorf("Get(digest prefix) = %v, %v", got, err)
	}
	if _, err := s.Get(reg + "/nope:1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(unknown) = %v, want ErrNotFound", err)
	}
	list, _ := s.List()
	if len(list) != 2 {
		t.Fatalf("List() = %d images, want 2", len(list))
	}
	if err := s.Remove(reg + "/a:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(reg + "/a:1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get after Remove = %v, want ErrNotFound", err)
	}
	p, _ := s.RootfsPath(a)
	if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
		t.Error("Remove left the image's root filesystem")
	}
	freed, err := s.Prune()
	if err != nil || freed == 0 {
		t.Errorf("Prune() = %d, %v; want the removed image's blobs freed", freed, err)
	}
	b, err := s.Get(reg + "/b:1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fs.ReadFile(rootfs(t, s, b), "b"); err != nil {
		t.Errorf("Prune broke the remaining image: %v", err)
	}
}

// TestLinksKeepTheirLayersData: a hard link and its target are one inode
// of their layer, so a layer above deleting or replacing the target's name
// leaves the link with the old data (Debian's perl is such a pair); a
// symlink above hides what the layers below have under that path
// (usrmerge turning /lib into a symlink).
func TestLinksKeepTheirLayersData(t *testing.T) {
	reg := startRegistry(t, nil)
	base := layer(t,
		entry{name: "usr/bin/perl", mode: 0o755, data: "perl"},
		entry{name: "usr/bin/perl5.36", typ: tar.TypeLink, link: "./usr/bin/perl"},
		entry{name: "usr/bin/perl5", typ: tar.TypeLink, link: "usr/bin/perl"},
		entry{name: "etc/conf", mode: 0o600, uid: 7, data: "old"},
		entry{name: "etc/conf.link", typ: tar.TypeLink, link: "etc/conf"},
		entry{name: "lib/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "lib/old.so", data: "old lib"},
		entry{name: "usr/lib/new.so", data: "new lib"},
	)
	top := layer(t,
		entry{name: "usr/bin/.wh.perl"},
		entry{name: "etc/conf", data: "new"},
		entry{name: "lib", typ: tar.TypeSymlink, link: "usr/lib"},
	)
	push(t, reg+"/test/links:1", testImage(t, base, top))
	s, err := Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	img, err := s.Pull(context.Background(), reg+"/test/links:1", Options{})
	if err != nil {
		t.Fatalf("Pull = %v", err)
	}
	fsys := rootfs(t, s, img)
	for p, want := range map[string]string{"usr/bin/perl5.36": "perl", "usr/bin/perl5": "perl", "etc/conf": "new", "etc/conf.link": "old"} {
		if b, err := fs.ReadFile(fsys, p); err != nil || string(b) != want {
			t.Errorf("ReadFile(%s) = %q, %v; want %q", p, b, err, want)
		}
	}
	if _, st := stat(t, fsys, "usr/bin/perl5.36"); st.Mode.Perm() != 0o755 {
		t.Errorf("usr/bin/perl5.36 mode %v, want its target's 0755", st.Mode)
	}
	if _, st := stat(t, fsys, "etc/conf.link"); st.Mode.Perm() != 0o600 || st.UID != 7 {
		t.Errorf("etc/conf.link mode %v uid %d, want the old target's 0600 and uid 7", st.Mode, st.UID)
	}
	if _, err := fs.Stat(fsys, "usr/bin/perl"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("whited-out usr/bin/perl: Stat = %v, want not exist", err)
	}
	if fi, err := fs.Lstat(fsys, "lib"); err != nil || fi.Mode()&fs.ModeSymlink == 0 {
		t.Errorf("lib: Lstat = %v, %v; want the upper layer's symlink", fi, err)
	}
	// The lower layer's lib/old.so is hidden by the symlink, not made
	// through it.
	if ents, err := fs.ReadDir(fsys, "usr/lib"); err != nil || len(ents) != 1 || ents[0].Name() != "new.so" {
		t.Errorf("ReadDir(usr/lib) = %v, %v; want only new.so", ents, err)
	}
}
