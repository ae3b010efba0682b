package supervisor

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/kvm"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/vmm"
)

// TestSnapshotLayersInTheCatalog: the catalog lists a layer with its
// parent, will not remove a parent that a layer lies over, and squashes
// a layer into a new snapshot or in its own place, after which the parent
// may go.
func TestSnapshotLayersInTheCatalog(t *testing.T) {
	m := newManager(t)
	const size = 8 << 20
	mem, err := guestmem.New(size)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	st := &vmm.State{Version: vmm.StateVersion, CPUs: 1, MemoryBytes: size, IRQChips: []kvm.IRQChip{{}, {ChipID: 1}, {ChipID: 2}},
		VCPUs: []vmm.VCPUState{{}}}
	mf := snapshot.Manifest{Spec: json.RawMessage(`{"cpus":1}`), CPUs: 1, MemoryBytes: size}
	os.MkdirAll(m.st.SnapshotsDir(), 0o700)
	mem.WriteAt([]byte("base"), 0)
	if err := snapshot.Write(m.st.SnapshotDir("base"), mf, st, mem, nil); err != nil {
		t.Fatal(err)
	}
	mem.WriteAt([]byte("top"), 1<<20)
	base, err := snapshot.Open(m.st.SnapshotDir("base"))
	if err != nil {
		t.Fatal(err)
	}
	err = snapshot.WriteWith(m.st.SnapshotDir("top"), mf, st, mem, nil, snapshot.WriteOptions{Parent: base})
	base.Close()
	if err != nil {
		t.Fatal(err)
	}
	infos, err := m.Snapshots()
	if err != nil || len(infos) != 2 || infos[1].Name != "top" || infos[1].Parent != "base" || infos[1].Chain != 2 || infos[0].Chain != 1 {
		t.Fatalf("Snapshots() = %+v, %v", infos, err)
	}
	if err := m.RemoveSnapshot("base"); err == nil || !strings.Contains(err.Error(), "top lie over it") {
		t.Errorf("RemoveSnapshot(base) = %v", err)
	}
	if _, err := m.SquashSnapshot("base", ""); err == nil || !strings.Contains(err.Error(), "top lie over it") {
		t.Errorf("SquashSnapshot(base) in place = %v", err)
	}
	if got, err := m.SquashSnapshot("top", "flat"); err != nil || got != "flat" {
		t.Fatalf("SquashSnapshot(top, flat) = %q, %v", got, err)
	}
	if got, err := m.SquashSnapshot("top", ""); err != nil || got != "top" {
		t.Fatalf("SquashSnapshot(top) = %q, %v", got, err)
	}
	if left, _ := filepath.Glob(filepath.Join(m.st.SnapshotsDir(), ".*")); len(left) != 0 {
		t.Errorf("left behind: %v", left)
	}
	if err := m.RemoveSnapshot("base"); err != nil {
		t.Fatalf("RemoveSnapshot(base) once no layer lies over it = %v", err)
	}
	for _, name := range []string{"top", "flat"} {
		mf, err := m.InspectSnapshot(m.st.SnapshotDir(name), true)
		if err != nil || mf.Parent != nil {
			t.Fatalf("%s after the squash: %+v, %v", name, mf, err)
		}
		s, _ := snapshot.Open(m.st.SnapshotDir(name))
		got, err := s.MapMemory()
		s.Close()
		if err != nil {
			t.Fatal(err)
		}
		b, _ := got.Slice(0, 4)
		c, _ := got.Slice(1<<20, 3)
		if string(b) != "base" || string(c) != "top" {
			t.Errorf("%s: memory %q %q", name, b, c)
		}
		got.Close()
	}
}

// TestOpenForkChain: the fork chain's directory is one of capsa's own,
// 0700 and its user's: a symbolic link or a directory others may enter
// found under its name is replaced, and a good one kept.
func TestOpenForkChain(t *testing.T) {
	dir := t.TempDir()
	target := t.TempDir()
	p := filepath.Join(dir, ".fork-x")
	os.Symlink(target, p)
	f, err := openForkChain(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if fi, err := os.Lstat(p); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Errorf("after a symbolic link: %v, %v; want a directory of its own", fi, err)
	}
	if _, err := os.Stat(target); err != nil {
		t.Errorf("the link's target: %v; want it untouched", err)
	}
	os.Chmod(p, 0o777)
	os.WriteFile(filepath.Join(p, "planted"), nil, 0o600)
	f, err = openForkChain(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := os.Stat(filepath.Join(p, "planted")); err == nil {
		t.Error("a directory others could enter was kept")
	}
	os.WriteFile(filepath.Join(p, "kept"), nil, 0o600)
	f, err = openForkChain(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := os.Stat(filepath.Join(p, "kept")); err != nil {
		t.Error("its own directory was not kept")
	}
}

// TestLayersOverChecksTheParent: a manifest that names a snapshot as its
// parent without its checksum does not keep it from being removed.
func TestLayersOverChecksTheParent(t *testing.T) {
	m := newManager(t)
	mem, _ := guestmem.New(8 << 20)
	defer mem.Close()
	st := &vmm.State{Version: vmm.StateVersion, CPUs: 1, MemoryBytes: 8 << 20, IRQChips: []kvm.IRQChip{{}, {ChipID: 1}, {ChipID: 2}}, VCPUs: []vmm.VCPUState{{}}}
	mf := snapshot.Manifest{Spec: json.RawMessage(`{}`), CPUs: 1, MemoryBytes: 8 << 20}
	os.MkdirAll(m.st.SnapshotsDir(), 0o700)
	for _, n := range []string{"a", "b"} {
		if err := snapshot.Write(m.st.SnapshotDir(n), mf, st, mem, nil); err != nil {
			t.Fatal(err)
		}
	}
	a, _ := snapshot.Open(m.st.SnapshotDir("a"))
	err := snapshot.WriteWith(m.st.SnapshotDir("c"), mf, st, mem, nil, snapshot.WriteOptions{Parent: a})
	a.Close()
	if err != nil {
		t.Fatal(err)
	}
	if kids := m.layersOver("a"); len(kids) != 1 || kids[0] != "c" {
		t.Errorf("layersOver(a) = %v", kids)
	}
	// c's manifest edited to name b, with a's checksum (and its own
	// checksum to match): it does not pin b.
	mp := filepath.Join(m.st.SnapshotDir("c"), snapshot.ManifestFile)
	raw, _ := os.ReadFile(mp)
	raw = []byte(strings.Replace(string(raw), `"name": "a"`, `"name": "b"`, 1))
	os.WriteFile(mp, raw, 0o600)
	sum := sha256.Sum256(raw)
	os.WriteFile(filepath.Join(m.st.SnapshotDir("c"), snapshot.ManifestSumFile), []byte(hex.EncodeToString(sum[:])+"\n"), 0o600)
	if mf, _, err := snapshot.ReadManifest(m.st.SnapshotDir("c")); err != nil || mf.Parent.Name != "b" {
		t.Fatalf("the edited manifest: %+v, %v", mf, err)
	}
	if kids := m.layersOver("b"); len(kids) != 0 {
		t.Errorf("layersOver(b) = %v; want none: c does not hold b's checksum", kids)
	}
	if err := m.RemoveSnapshot("b"); err != nil {
		t.Errorf("RemoveSnapshot(b) = %v", err)
	}
}
