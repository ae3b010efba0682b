package snapshot

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// layerTest writes, in one directory, a snapshot "base" of a memory with
// a few pages in use and a layer "top" over it after mem changed: a
// page rewritten, one cleared, one written afresh. It returns the
// directory and the memory as the layer holds it (closed at cleanup).
func layerTest(t *testing.T) (string, *guestmem.Memory) {
	t.Helper()
	mem, err := guestmem.New(memBytes)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	for _, gpa := range []uint64{0x1000, 0x200000, memBytes - 4096} {
		mem.WriteAt([]byte("in use"), gpa)
	}
	root := t.TempDir()
	m := Manifest{Spec: json.RawMessage(`{"cpus":1}`), CPUs: 1, MemoryBytes: memBytes, MainProcess: 1}
	if err := Write(filepath.Join(root, "base"), m, testState(), mem, nil); err != nil {
		t.Fatal(err)
	}
	mem.WriteAt([]byte("changed"), 0x200000)
	mem.Zero(0x1000, 4096)
	mem.WriteAt(bytes.Repeat([]byte("new"), 3000), 0x500000)
	base, err := Open(filepath.Join(root, "base"))
	if err != nil {
		t.Fatal(err)
	}
	defer base.Close()
	extra := map[string]Extra{"extra": func(p string) (string, error) { return "", os.WriteFile(p, []byte("x"), 0o600) }}
	if err := WriteWith(filepath.Join(root, "top"), m, testState(), mem, extra, WriteOptions{Parent: base}); err != nil {
		t.Fatalf("WriteWith(a layer) = %v", err)
	}
	return root, mem
}

func sameAs(t *testing.T, s *Snapshot, want *guestmem.Memory) {
	t.Helper()
	got, err := s.MapMemory()
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	g, w := got.Regions(), want.Regions()
	for i := range w {
		if !bytes.Equal(g[i].Host, w[i].Host) {
			t.Fatalf("%s: the memory mapped back differs from the sandbox's", s.Dir)
		}
	}
}

// TestLayer: a layer holds only what changed, opens with its parent,
// maps back to the memory it was written from, verifies, and squashes to
// a snapshot that needs no parent.
func TestLayer(t *testing.T) {
	root, mem := layerTest(t)
	top, err := Open(filepath.Join(root, "top"))
	if err != nil {
		t.Fatalf("Open(top) = %v", err)
	}
	defer top.Close()
	if top.Manifest.Version != LayerVersion || top.Parent == nil || top.Chain() != 2 || top.Manifest.Parent.Name != "base" {
		t.Fatalf("top: version %d, parent %+v, chain %d", top.Manifest.Version, top.Manifest.Parent, top.Chain())
	}
	want := []guestmem.Run{{Off: 0x1000, Len: 4096}, {Off: 0x200000, Len: 4096}, {Off: 0x500000, Len: 3 * 4096}}
	if got := top.Manifest.MemoryRuns; len(got) != len(want) || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
		t.Errorf("runs %v, want %v", got, want)
	}
	sameAs(t, top, mem)
	if err := Verify(top.Dir); err != nil {
		t.Errorf("Verify(top) = %v", err)
	}
	// The layer's memory file takes the pages it holds (less the
	// cleared one), not the memory's.
	if fi, err := os.Stat(filepath.Join(top.Dir, MemoryFile)); err != nil || fi.Sys().(*syscallStat).Blocks*512 > 64<<10 {
		t.Errorf("the layer's memory file: %v, %d bytes on disk", err, fi.Sys().(*syscallStat).Blocks*512)
	}

	// A layer over the layer, then squashed: the same memory, no parent.
	mem.WriteAt([]byte("third"), 0x300000)
	extra := map[string]Extra{"extra": func(p string) (string, error) { return sha256Hex([]byte("x")), os.WriteFile(p, []byte("x"), 0o600) }}
	if err := WriteWith(filepath.Join(root, "third"), top.Manifest, top.State, mem, extra, WriteOptions{Parent: top}); err != nil {
		t.Fatal(err)
	}
	third, err := Open(filepath.Join(root, "third"))
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	if third.Chain() != 3 {
		t.Errorf("chain %d", third.Chain())
	}
	sameAs(t, third, mem)
	if err := Squash(third, filepath.Join(root, "flat")); err != nil {
		t.Fatalf("Squash() = %v", err)
	}
	flat, err := Open(filepath.Join(root, "flat"))
	if err != nil {
		t.Fatal(err)
	}
	defer flat.Close()
	if flat.Parent != nil || flat.Manifest.Version != Version || flat.Manifest.MemoryRuns != nil || !flat.Manifest.Created.Equal(third.Manifest.Created) {
		t.Errorf("squashed: %+v", flat.Manifest)
	}
	if b, err := flat.ReadFile("extra", 10); err != nil || string(b) != "x" {
		t.Errorf("squashed extra file: %q, %v", b, err)
	}
	sameAs(t, flat, mem)
	if err := Verify(flat.Dir); err != nil {
		t.Errorf("Verify(flat) = %v", err)
	}
	// Removing the parent leaves the squashed copy whole.
	os.RemoveAll(filepath.Join(root, "base"))
	if _, err := Open(filepath.Join(root, "top")); err == nil || !strings.Contains(err.Error(), "its parent") {
		t.Errorf("Open(top) without its parent = %v", err)
	}
	if err := Verify(flat.Dir); err != nil {
		t.Errorf("Verify(flat) without the chain = %v", err)
	}
}

// TestBadLayers: a parent changed or swapped, a layer's memory damaged, a
// parent named outside the directory, a chain too long: each refused,
// with an error naming it.
func TestBadLayers(t *testing.T) {
	t.Run("parent-rewritten", func(t *testing.T) {
		root, _ := layerTest(t)
		// A snapshot written again under the parent's name.
		os.RemoveAll(filepath.Join(root, "base"))
		mem, _ := guestmem.New(memBytes)
		defer mem.Close()
		Write(filepath.Join(root, "base"), Manifest{Spec: json.RawMessage(`{}`), CPUs: 1, MemoryBytes: memBytes}, testState(), mem, nil)
		if _, err := Open(filepath.Join(root, "top")); err == nil || !strings.Contains(err.Error(), "not the snapshot it was written over") {
			t.Errorf("Open() = %v", err)
		}
	})
	t.Run("parent-memory-damaged", func(t *testing.T) {
		root, _ := layerTest(t)
		f, _ := os.OpenFile(filepath.Join(root, "base", MemoryFile), os.O_WRONLY, 0)
		f.WriteAt([]byte("X"), 0x200001)
		f.Close()
		if _, err := Open(filepath.Join(root, "top")); err != nil {
			t.Fatalf("Open() = %v (the memory is Verify's to check)", err)
		}
		if err := Verify(filepath.Join(root, "top")); err == nil || !strings.Contains(err.Error(), "base: memory does not match") {
			t.Errorf("Verify() = %v", err)
		}
	})
	t.Run("layer-memory-damaged", func(t *testing.T) {
		root, _ := layerTest(t)
		f, _ := os.OpenFile(filepath.Join(root, "top", MemoryFile), os.O_WRONLY, 0)
		f.WriteAt([]byte("X"), 0x500001)
		f.Close()
		if err := Verify(filepath.Join(root, "top")); err == nil || !strings.Contains(err.Error(), "top: memory does not match") {
			t.Errorf("Verify() = %v", err)
		}
	})
	t.Run("parent-elsewhere", func(t *testing.T) {
		root, mem := layerTest(t)
		other := filepath.Join(t.TempDir(), "other")
		base, err := Open(filepath.Join(root, "base"))
		if err != nil {
			t.Fatal(err)
		}
		defer base.Close()
		if err := WriteWith(other, base.Manifest, base.State, mem, nil, WriteOptions{Parent: base}); err == nil || !strings.Contains(err.Error(), "same directory") {
			t.Errorf("a layer elsewhere = %v", err)
		}
		small, _ := guestmem.New(memBytes / 2)
		defer small.Close()
		if err := WriteWith(filepath.Join(root, "small"), base.Manifest, base.State, small, nil, WriteOptions{Parent: base}); err == nil || !strings.Contains(err.Error(), "bytes of memory") {
			t.Errorf("a layer of another size = %v", err)
		}
		// A manifest naming a parent by a path is refused before
		// anything is opened.
		for _, name := range []string{"../base", "/etc", ".hidden", ""} {
			editManifest(t, filepath.Join(root, "top"), func(m map[string]any) { m["parent"].(map[string]any)["name"] = name })
			if _, err := Open(filepath.Join(root, "top")); err == nil || !strings.Contains(err.Error(), "not the name of a directory beside") {
				t.Errorf("parent %q: Open() = %v", name, err)
			}
		}
	})
	t.Run("runs", func(t *testing.T) {
		root, _ := layerTest(t)
		editManifest(t, filepath.Join(root, "top"), func(m map[string]any) {
			m["memory_runs"] = []any{map[string]any{"off": 8192, "len": 4096}, map[string]any{"off": 0, "len": 4096}}
		})
		if _, err := Open(filepath.Join(root, "top")); err == nil || !strings.Contains(err.Error(), "out of order") {
			t.Errorf("Open() = %v", err)
		}
		editManifest(t, filepath.Join(root, "top"), func(m map[string]any) { delete(m, "parent") })
		if _, err := Open(filepath.Join(root, "top")); err == nil || !strings.Contains(err.Error(), "version 3 with a parent false") {
			t.Errorf("Open() = %v", err)
		}
	})
	t.Run("chain-too-long", func(t *testing.T) {
		root, mem := layerTest(t)
		parent := "top"
		for i := 3; ; i++ {
			p, err := Open(filepath.Join(root, parent))
			if err != nil {
				t.Fatal(err)
			}
			mem.PutUint8(0x700000, uint8(i))
			name := fmt.Sprintf("l%d", i)
			err = WriteWith(filepath.Join(root, name), p.Manifest, p.State, mem, nil, WriteOptions{Parent: p})
			chain := p.Chain()
			p.Close()
			if chain >= MaxChain {
				if err == nil || !strings.Contains(err.Error(), "squash it first") {
					t.Errorf("a layer over a chain of %d: %v", chain, err)
				}
				mem.PutUint8(0x700000, uint8(i-1))
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			parent = name
		}
		s, err := Open(filepath.Join(root, parent))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if s.Chain() != MaxChain {
			t.Errorf("chain %d", s.Chain())
		}
		sameAs(t, s, mem)
	})
}

// editManifest rewrites dir's manifest through fn, and its checksum to
// match: damage that only the checks of its contents can find.
func editManifest(t *testing.T, dir string, fn func(map[string]any)) {
	t.Helper()
	p := filepath.Join(dir, ManifestFile)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	fn(m)
	b, _ = json.Marshal(m)
	os.WriteFile(p, b, 0o600)
	sum := sha256Hex(b)
	os.WriteFile(filepath.Join(dir, ManifestSumFile), []byte(sum+"\n"), 0o600)
}

type syscallStat = syscall.Stat_t

func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// TestPruneChain: a fork chain's directory keeps its newest snapshot and
// what that lies over; older layers, a base no longer under it, and
// anything else go.
func TestPruneChain(t *testing.T) {
	root, mem := layerTest(t) // base, and top over it
	base, err := Open(filepath.Join(root, "base"))
	if err != nil {
		t.Fatal(err)
	}
	defer base.Close()
	if base.Parent != nil {
		t.Fatal("base has a parent")
	}
	chain := t.TempDir()
	os.Rename(filepath.Join(root, "base"), filepath.Join(chain, "100"))
	os.Rename(filepath.Join(root, "top"), filepath.Join(chain, "x-old"))
	b100, err := Open(filepath.Join(chain, "100"))
	if err != nil {
		t.Fatal(err)
	}
	defer b100.Close()
	for _, name := range []string{"200", "300"} {
		mem.PutUint8(0x600000, name[0])
		if err := WriteWith(filepath.Join(chain, name), b100.Manifest, testState(), mem, nil, WriteOptions{Parent: b100, Transient: true}); err != nil {
			t.Fatal(err)
		}
	}
	os.Mkdir(filepath.Join(chain, ".300.tmp-1"), 0o700)
	s300, err := Open(filepath.Join(chain, "300"))
	if err != nil {
		t.Fatal(err)
	}
	if s300.Parent == nil || s300.Parent.State != nil || s300.Parent.File(StateFile) != nil || s300.Manifest.Files[MemoryFile].CRC32C != "" {
		t.Errorf("a transient layer's parent: state %v, state file %v; its memory's checksum %q: want only the parent's memory opened, no checksum",
			s300.Parent.State, s300.Parent.File(StateFile), s300.Manifest.Files[MemoryFile].CRC32C)
	}
	s300.Close()
	if err := PruneChain(chain); err != nil {
		t.Fatal(err)
	}
	var left []string
	entries, _ := os.ReadDir(chain)
	for _, e := range entries {
		left = append(left, e.Name())
	}
	if strings.Join(left, " ") != "100 300" {
		t.Errorf("after the prune: %v; want 100 (the base) and 300 (the newest)", left)
	}
	s, err := Open(filepath.Join(chain, "300"))
	if err != nil {
		t.Fatalf("the newest after the prune: %v", err)
	}
	sameAs(t, s, mem)
	s.Close()
}
