package supervisor

import (
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
