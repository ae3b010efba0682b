package assets

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/capsa-sandbox/capsa/agent"
)

// goCompress is a Compressor on klauspost/compress (the tool uses the zstd
// command; the format is the same).
func goCompress(src, dst, _ string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest))
	if err != nil {
		return err
	}
	return os.WriteFile(dst, enc.EncodeAll(data, nil), 0o600)
}

var (
	testKernel    = bytes.Repeat([]byte("a kernel, or something like one "), 5000)
	testInitramfs = bytes.Repeat([]byte("070701 an initramfs "), 9000)
)

// makeSet packs testKernel and testInitramfs into dir.
func makeSet(t *testing.T, dir string) *Manifest {
	t.Helper()
	src := t.TempDir()
	k, i := filepath.Join(src, "vmlinux"), filepath.Join(src, "initramfs.cpio")
	if err := os.WriteFile(k, testKernel, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(i, testInitramfs, 0o644); err != nil {
		t.Fatal(err)
	}
	m, err := Pack(dir, "v1.2.3-test", k, i, goCompress)
	if err != nil {
		t.Fatalf("Pack(%s) = %v", dir, err)
	}
	return m
}

// isolate points every place Find searches into a fresh directory and
// forgets the set found before; it returns the build cache and the prefix.
func isolate(t *testing.T) (cache, prefix string) {
	t.Helper()
	root := t.TempDir()
	cache, prefix = filepath.Join(root, "cache"), filepath.Join(root, "prefix")
	t.Setenv("CAPSA_CACHE", cache)
	t.Setenv("CAPSA_ASSETS", "")
	old := Prefix
	Prefix = prefix
	forget := func() { found.mu.Lock(); found.set = nil; found.mu.Unlock() }
	forget()
	t.Cleanup(func() { Prefix = old; forget() })
	return cache, prefix
}

func sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func TestPackManifest(t *testing.T) {
	dir := t.TempDir()
	m := makeSet(t, dir)
	data, err := os.ReadFile(filepath.Join(dir, ManifestName))
	if err != nil {
		t.Fatal(err)
	}
	var got Manifest
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatalf("manifest.json: %v\n%s", err, data)
	}
	if got != *m {
		t.Errorf("manifest.json = %+v, Pack returned %+v", got, *m)
	}
	if got.Format != ManifestFormat || got.CapsaVersion != "v1.2.3-test" || got.AgentProtocol != [2]int{agent.MinProtocolVersion, agent.ProtocolVersion} {
		t.Errorf("manifest = format %d, version %q, protocol %v; want %d, v1.2.3-test, %d..%d",
			got.Format, got.CapsaVersion, got.AgentProtocol, ManifestFormat, agent.MinProtocolVersion, agent.ProtocolVersion)
	}
	for _, c := range []struct {
		f       File
		name    string
		content []byte
	}{{got.Kernel, "vmlinux.zst", testKernel}, {got.Initramfs, "initramfs.cpio.zst", testInitramfs}} {
		z, err := os.ReadFile(filepath.Join(dir, c.name))
		if err != nil {
			t.Fatal(err)
		}
		want := File{Name: c.name, SHA256: sum(z), Size: int64(len(c.content)), ContentSHA256: sum(c.content)}
		if c.f != want {
			t.Errorf("manifest file = %+v, want %+v", c.f, want)
		}
		if len(z) >= len(c.content) {
			t.Errorf("%s: %d bytes for %d: not compressed", c.name, len(z), len(c.content))
		}
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 3 {
		t.Errorf("Pack left %d files in the set, want 3 (no work files)", len(ents))
	}
}

func TestUnpackOnceAndReuse(t *testing.T) {
	cache, _ := isolate(t)
	dir := t.TempDir()
	m := makeSet(t, dir)
	s, err := Open(dir)
	if err != nil {
		t.Fatalf("Open = %v", err)
	}
	k, err := s.Kernel()
	if err != nil || !bytes.Equal(k, testKernel) {
		t.Fatalf("Kernel() = %d bytes, %v; want the %d packed", len(k), err, len(testKernel))
	}
	i, err := s.Initramfs()
	if err != nil || !bytes.Equal(i, testInitramfs) {
		t.Fatalf("Initramfs() = %d bytes, %v; want the %d packed", len(i), err, len(testInitramfs))
	}
	unpacked := filepath.Join(cache, "unpacked", m.Kernel.ContentSHA256)
	if data, err := os.ReadFile(unpacked); err != nil || !bytes.Equal(data, testKernel) {
		t.Fatalf("unpacked copy %s = %d bytes, %v; want the kernel", unpacked, len(data), err)
	}
	if k2, _ := s.Kernel(); &k2[0] != &k[0] {
		t.Errorf("Kernel() a second time returned other bytes: not once per Set")
	}
	// Another process (another Set) maps the unpacked copy and does not
	// decompress: a corrupt compressed file goes unread.
	corrupt(t, filepath.Join(dir, m.Kernel.Name))
	s2, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if k, err := s2.Kernel(); err != nil || !bytes.Equal(k, testKernel) {
		t.Errorf("Kernel() with an unpacked copy = %d bytes, %v; want the kernel from the copy", len(k), err)
	}
	ents, _ := os.ReadDir(filepath.Join(cache, "unpacked"))
	if len(ents) != 2 {
		t.Errorf("unpacked/ holds %d files, want 2 (no work files)", len(ents))
	}
}

func corrupt(t *testing.T, path string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	data[len(data)/2] ^= 0xff
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestUnpackChecks(t *testing.T) {
	for _, c := range []struct {
		name   string
		change func(t *testing.T, dir string, m *Manifest)
		want   string
	}{
		{"corrupt file", func(t *testing.T, dir string, m *Manifest) { corrupt(t, filepath.Join(dir, m.Kernel.Name)) }, "vmlinux.zst"},
		{"other file", func(t *testing.T, dir string, m *Manifest) {
			data, _ := os.ReadFile(filepath.Join(dir, m.Initramfs.Name))
			os.WriteFile(filepath.Join(dir, m.Kernel.Name), data, 0o644)
		}, "the manifest says"},
		{"wrong size", func(t *testing.T, dir string, m *Manifest) { m.Kernel.Size-- }, "bytes uncompressed, the manifest says"},
		{"wrong hash", func(t *testing.T, dir string, m *Manifest) { m.Kernel.SHA256 = sum(nil) }, "SHA-256"},
		{"wrong content hash", func(t *testing.T, dir string, m *Manifest) { m.Kernel.ContentSHA256 = sum(nil) }, "content SHA-256"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cache, _ := isolate(t)
			dir := t.TempDir()
			m := makeSet(t, dir)
			c.change(t, dir, m)
			writeManifest(t, dir, m)
			s, err := Open(dir)
			if err != nil {
				t.Fatalf("Open = %v", err)
			}
			k, err := s.Kernel()
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Kernel() = %d bytes, %v; want an error with %q", len(k), err, c.want)
			}
			ents, _ := os.ReadDir(filepath.Join(cache, "unpacked"))
			if len(ents) != 0 {
				t.Errorf("a failed unpack left %d files in the cache", len(ents))
			}
		})
	}
}

func writeManifest(t *testing.T, dir string, m *Manifest) {
	t.Helper()
	data, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ManifestName), data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestOpenChecksManifest(t *testing.T) {
	for _, c := range []struct {
		name   string
		change func(m map[string]any)
		want   string
	}{
		{"format", func(m map[string]any) { m["format"] = 2 }, "format 2, this capsa reads 1"},
		{"newer agent", func(m map[string]any) {
			m["agent_protocol"] = []int{agent.ProtocolVersion + 1, agent.ProtocolVersion + 2}
		}, "its agent speaks protocol"},
		{"older agent", func(m map[string]any) { m["agent_protocol"] = []int{1, agent.MinProtocolVersion - 1} }, "its agent speaks protocol"},
		{"no range", func(m map[string]any) { m["agent_protocol"] = []int{3, 2} }, "not a range"},
		{"unknown field", func(m map[string]any) { m["extra"] = true }, "unknown field"},
		{"path name", func(m map[string]any) { file(m, "kernel")["name"] = "../vmlinux.zst" }, "not a file name"},
		{"manifest name", func(m map[string]any) { file(m, "initramfs")["name"] = ManifestName }, "not a file name"},
		{"no size", func(m map[string]any) { file(m, "kernel")["size"] = 0 }, "out of range"},
		{"too big", func(m map[string]any) { file(m, "kernel")["size"] = MaxFileSize + 1 }, "out of range"},
		{"short hash", func(m map[string]any) { file(m, "kernel")["sha256"] = "abcd" }, "not a SHA-256"},
		{"upper-case hash", func(m map[string]any) {
			f := file(m, "initramfs")
			f["content_sha256"] = strings.ToUpper(f["content_sha256"].(string))
		}, "not a SHA-256"},
		{"missing file", func(m map[string]any) { file(m, "initramfs")["name"] = "gone.zst" }, "gone.zst"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			makeSet(t, dir)
			path := filepath.Join(dir, ManifestName)
			data, _ := os.ReadFile(path)
			var m map[string]any
			if err := json.Unmarshal(data, &m); err != nil {
				t.Fatal(err)
			}
			c.change(m)
			data, _ = json.Marshal(m)
			os.WriteFile(path, data, 0o644)
			if s, err := Open(dir); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Open(%s) = %v, %v; want an error with %q", data, s, err, c.want)
			}
		})
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, ManifestName), bytes.Repeat([]byte(" "), maxManifest+1), 0o644)
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("Open(a huge manifest) = %v; want larger than", err)
	}
}

func file(m map[string]any, name string) map[string]any { return m[name].(map[string]any) }

func TestFindOrder(t *testing.T) {
	cache, prefix := isolate(t)
	// Nothing anywhere: every place is named with why.
	_, err := Find()
	if err == nil {
		t.Fatal("Find() with no set anywhere succeeded")
	}
	for _, want := range []string{
		"built in: none",
		"the build cache " + filepath.Join(cache, "assets") + ": no manifest.json",
		"PREFIX/share/capsa " + filepath.Join(prefix, "share", "capsa") + ": no manifest.json",
		"make install", "$CAPSA_ASSETS",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Find() = %v; want it to say %q", err, want)
		}
	}
	if _, err := Kernel(); err == nil {
		t.Errorf("Kernel() with no set succeeded")
	}

	// Installed under the prefix.
	makeSet(t, filepath.Join(prefix, "share", "capsa"))
	s, err := Find()
	if err != nil || s.Where != "PREFIX/share/capsa "+filepath.Join(prefix, "share", "capsa") {
		t.Fatalf("Find() = %v, %v; want the prefix's set", s, err)
	}
	if k, err := Kernel(); err != nil || !bytes.Equal(k, testKernel) {
		t.Errorf("Kernel() = %d bytes, %v; want the kernel", len(k), err)
	}
	if s2, _ := Find(); s2 != s {
		t.Errorf("Find() again returned another Set: not kept for the process")
	}

	// The build cache comes before the prefix.
	isolate(t)
	t.Setenv("CAPSA_CACHE", cache)
	Prefix = prefix
	makeSet(t, filepath.Join(cache, "assets"))
	if s, err := Find(); err != nil || !strings.HasPrefix(s.Where, "the build cache ") {
		t.Errorf("Find() = %v, %v; want the build cache's set", s, err)
	}

	// $CAPSA_ASSETS is the only place searched when set, and a bad set
	// there is an error even though others would do.
	forget := func() { found.mu.Lock(); found.set = nil; found.mu.Unlock() }
	forget()
	env := t.TempDir()
	t.Setenv("CAPSA_ASSETS", env)
	if _, err := Find(); err == nil || !strings.Contains(err.Error(), "$CAPSA_ASSETS "+env+": no manifest.json") || strings.Contains(err.Error(), "build cache") {
		t.Errorf("Find() with an empty $CAPSA_ASSETS = %v; want its error alone", err)
	}
	makeSet(t, env)
	if s, err := Find(); err != nil || s.Where != "$CAPSA_ASSETS "+env {
		t.Errorf("Find() = %v, %v; want $CAPSA_ASSETS's set", s, err)
	}
}

// With no cache to write, a file is decompressed into memory.
func TestUnpackWithoutCache(t *testing.T) {
	isolate(t)
	notDir := filepath.Join(t.TempDir(), "file")
	os.WriteFile(notDir, nil, 0o644)
	t.Setenv("CAPSA_CACHE", notDir)
	dir := t.TempDir()
	makeSet(t, dir)
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if i, err := s.Initramfs(); err != nil || !bytes.Equal(i, testInitramfs) {
		t.Errorf("Initramfs() with no cache = %d bytes, %v; want it decompressed", len(i), err)
	}
}

func TestCleanUnpacked(t *testing.T) {
	dir := t.TempDir()
	old, recent, keep := filepath.Join(dir, "old"), filepath.Join(dir, "recent"), filepath.Join(dir, "keep")
	for _, p := range []string{old, recent, keep} {
		os.WriteFile(p, []byte("x"), 0o644)
	}
	long := time.Now().Add(-unusedFor - time.Hour)
	os.Chtimes(old, long, long)
	os.Chtimes(keep, long, long)
	cleanUnpacked(dir, keep)
	for p, want := range map[string]bool{old: false, recent: true, keep: true} {
		if _, err := os.Stat(p); (err == nil) != want {
			t.Errorf("after cleanUnpacked, %s exists = %v, want %v", filepath.Base(p), err == nil, want)
		}
	}
}

// TestEvict: evicting a mapping keeps its content readable; anything else
// is left untouched.
func TestEvict(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	want := bytes.Repeat([]byte("capsa"), 4096)
	if err := os.WriteFile(path, want, 0o644); err != nil {
		t.Fatal(err)
	}
	m, err := mapUnpacked(path, int64(len(want)))
	if err != nil {
		t.Fatal(err)
	}
	Evict(m)
	if !bytes.Equal(m, want) {
		t.Errorf("a mapping after Evict reads differently")
	}
	heap := bytes.Clone(want)
	Evict(heap)
	if !bytes.Equal(heap, want) {
		t.Errorf("Evict changed a heap slice")
	}
}

// TestMapFile: a regular file is mapped with its content, and Evict and
// release work on it; a pipe is read instead; a missing file is an error.
func TestMapFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kernel")
	want := bytes.Repeat([]byte("capsa"), 10000)
	if err := os.WriteFile(path, want, 0o644); err != nil {
		t.Fatal(err)
	}
	data, release, err := MapFile(path)
	if err != nil {
		t.Fatalf("MapFile(%s) = %v", path, err)
	}
	if !bytes.Equal(data, want) {
		t.Fatalf("MapFile(%s) = %d bytes, want the file's %d", path, len(data), len(want))
	}
	if _, ok := mapped.Load(&data[0]); !ok {
		t.Error("MapFile's mapping is not one Evict gives back")
	}
	Evict(data)
	if !bytes.Equal(data, want) {
		t.Error("after Evict, the mapping no longer reads as the file")
	}
	release()
	if _, ok := mapped.Load(&data[0]); ok {
		t.Error("release left the mapping registered")
	}

	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	go func() { w.Write([]byte("piped")); w.Close() }()
	defer r.Close()
	data, release, err = MapFile(fmt.Sprintf("/proc/self/fd/%d", r.Fd()))
	if err != nil || string(data) != "piped" {
		t.Errorf("MapFile(a pipe) = %q, %v, want its content read", data, err)
	}
	release()

	if _, _, err := MapFile(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("MapFile(a missing file) = %v, want ErrNotExist", err)
	}
}
