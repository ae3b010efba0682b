package guestmem

import (
	"bytes"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// memFile writes m to a new file in dir and returns it open.
func memFile(t *testing.T, m *Memory, name string) *os.File {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(t.TempDir(), name), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := m.WriteFile(f, nil, nil); err != nil {
		t.Fatal(err)
	}
	return f
}

func fill(t *testing.T, m *Memory, gpa uint64, n int, seed uint64) {
	t.Helper()
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, 1))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	if err := m.WriteAt(b, gpa); err != nil {
		t.Fatal(err)
	}
}

func sameMemory(t *testing.T, got, want *Memory) {
	t.Helper()
	g, w := got.Regions(), want.Regions()
	for i := range w {
		if !bytes.Equal(g[i].Host, w[i].Host) {
			for p := 0; p < len(w[i].Host); p += pageSize {
				if !bytes.Equal(g[i].Host[p:p+pageSize], w[i].Host[p:p+pageSize]) {
					t.Fatalf("region %d differs first at page %#x", i, p)
				}
			}
		}
	}
}

// TestLayersRebuildMemory: a memory written as a delta over the memory
// file beneath it maps back, over that file, to the memory it was, across
// a chain of two layers, with pages changed, zeroed and left alone.
func TestLayersRebuildMemory(t *testing.T) {
	const size = 16 << 20
	cur, err := New(size)
	if err != nil {
		t.Fatal(err)
	}
	defer cur.Close()
	fill(t, cur, 0, 4<<20, 1)
	fill(t, cur, 9<<20, 1<<20, 2)
	baseFile := memFile(t, cur, "base")

	var layers []Layer
	for step, change := range []func(){
		func() {
			fill(t, cur, 8192, 3*pageSize, 3)
			fill(t, cur, 12<<20, 5*pageSize, 4)
			cur.Zero(9<<20, pageSize)
		},
		func() { fill(t, cur, 8192, pageSize, 5); fill(t, cur, 15<<20, pageSize, 6); cur.Zero(0, 2*pageSize) },
	} {
		change()
		// What the chain so far reads as is what it maps as.
		beneath, err := MapLayers(baseFile, size, layers)
		if err != nil {
			t.Fatal(err)
		}
		read := make([]byte, size)
		if _, err := LayersReader(baseFile, layers).ReadAt(read, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(read, beneath.Regions()[0].Host) {
			t.Fatalf("step %d: the layers read differently from how they map", step)
		}
		beneath.Close()
		runs, err := cur.Delta(LayersReader(baseFile, layers), 64)
		if err != nil {
			t.Fatal(err)
		}
		if len(runs) == 0 || len(runs) > 4 {
			t.Fatalf("step %d: runs %v", step, runs)
		}
		f, err := os.OpenFile(filepath.Join(t.TempDir(), "layer"), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		h := crc32.NewIEEE()
		if err := cur.WriteRuns(f, runs, h, nil); err != nil {
			t.Fatal(err)
		}
		layers = append(layers, Layer{File: f, Runs: runs})
		got, err := MapLayers(baseFile, size, layers)
		if err != nil {
			t.Fatal(err)
		}
		sameMemory(t, got, cur)
		// The layer's checksum reads back from its file alone.
		alone, err := Map(f, size)
		if err != nil {
			t.Fatal(err)
		}
		h2 := crc32.NewIEEE()
		if err := alone.HashRuns(h2, runs); err != nil {
			t.Fatal(err)
		}
		alone.Close()
		if h.Sum32() != h2.Sum32() {
			t.Errorf("step %d: the layer's checksum %x, read back %x", step, h.Sum32(), h2.Sum32())
		}
		// A guest's write to restored memory stays in the process.
		got.PutUint64(8192, 0xdeadbeef)
		got.Close()
		again, err := MapLayers(baseFile, size, layers)
		if err != nil {
			t.Fatal(err)
		}
		sameMemory(t, again, cur)
		again.Close()
	}
	// A layer's file takes the space of what it holds, not the memory's.
	lf := layers[1].File
	fi, _ := lf.Stat()
	if used := fileBlocks(t, lf) * 512; used > 64<<10 || fi.Size() != size {
		t.Errorf("the second layer: %d bytes, %d on disk", fi.Size(), used)
	}
}

// TestDeltaJoinsRuns: at most the asked-for number of runs, joined
// across the smallest gaps, still rebuilding the memory exactly.
func TestDeltaJoinsRuns(t *testing.T) {
	const size = 4 << 20
	cur, err := New(size)
	if err != nil {
		t.Fatal(err)
	}
	defer cur.Close()
	baseFile := memFile(t, cur, "base")
	// Pages changed at 0, 2, 4, ... 98 (gaps of one page), and at 500 and 900.
	for p := uint64(0); p < 100; p += 2 {
		cur.PutUint8(p*pageSize, 1)
	}
	cur.PutUint8(500*pageSize, 1)
	cur.PutUint8(900*pageSize, 1)
	all, err := cur.Delta(baseFile, 1000)
	if err != nil || len(all) != 52 {
		t.Fatalf("Delta(1000) = %d runs, %v; want 52", len(all), err)
	}
	runs, err := cur.Delta(baseFile, 3)
	if err != nil {
		t.Fatal(err)
	}
	want := []Run{{0, 99 * pageSize}, {500 * pageSize, pageSize}, {900 * pageSize, pageSize}}
	if len(runs) != 3 || runs[0] != want[0] || runs[1] != want[1] || runs[2] != want[2] {
		t.Errorf("Delta(3) = %v, want %v", runs, want)
	}
	if _, err := cur.Delta(baseFile, 1); err == nil {
		t.Error("Delta(1) did not fail")
	}
	same, err := cur.Delta(memFile(t, cur, "same"), 8)
	if err != nil || len(same) != 0 {
		t.Errorf("a memory's delta over itself = %v, %v", same, err)
	}
	if _, err := cur.Delta(bytes.NewReader(make([]byte, 4096)), 8); err == nil || !strings.Contains(err.Error(), "read the memory beneath") {
		t.Errorf("a delta over a short file = %v", err)
	}
}

// TestDeltaLeavesHoles: comparing with a snapshot's memory file on tmpfs
// puts nothing into its holes (a read fault through a mapping would).
func TestDeltaLeavesHoles(t *testing.T) {
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skip("no /dev/shm")
	}
	const size = 8 << 20
	cur, err := New(size)
	if err != nil {
		t.Fatal(err)
	}
	defer cur.Close()
	cur.PutUint8(4096, 1)
	f, err := os.CreateTemp("/dev/shm", "capsa-delta-")
	if err != nil {
		t.Skip(err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if err := cur.WriteFile(f, nil, nil); err != nil {
		t.Fatal(err)
	}
	before := fileBlocks(t, f)
	cur.PutUint8(8192, 1)
	if runs, err := cur.Delta(f, 8); err != nil || len(runs) != 1 {
		t.Fatalf("Delta = %v, %v", runs, err)
	}
	if after := fileBlocks(t, f); after != before {
		t.Errorf("the memory file beneath took %d blocks before the delta, %d after", before, after)
	}
}

func TestCheckRuns(t *testing.T) {
	low := int64(MMIOStart)
	size := uint64(MMIOStart + 1<<20)
	for _, tc := range []struct {
		runs []Run
		want string
	}{
		{[]Run{{0, 4096}, {8192, 4096}}, ""},
		{[]Run{{low - 4096, 4096}, {low, 4096}}, ""},
		{[]Run{{0, 4096}, {0, 4096}}, "overlapping"},
		{[]Run{{8192, 4096}, {0, 4096}}, "out of order"},
		{[]Run{{1, 4096}}, "whole pages"},
		{[]Run{{0, 0}}, "whole pages"},
		{[]Run{{0, -4096}}, "whole pages"},
		{[]Run{{int64(size), 4096}}, "past"},
		{[]Run{{1<<62 + 1<<61, 1 << 62}}, "past"},
		{[]Run{{low - 4096, 8192}}, "across"},
		{[]Run{{0, 4096}, {8192, 4096}, {16384, 4096}}, "at most 2"},
	} {
		err := CheckRuns(tc.runs, size, 2)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("CheckRuns(%v) = %v, want %q", tc.runs, err, tc.want)
		}
	}
}

// TestMapLayersRefusesBadLayers: a layer file of another size, or runs
// out of bounds, fail the mapping with an error.
func TestMapLayersRefusesBadLayers(t *testing.T) {
	const size = 1 << 20
	m, err := New(size)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	base := memFile(t, m, "base")
	short, err := os.CreateTemp(t.TempDir(), "short")
	if err != nil {
		t.Fatal(err)
	}
	defer short.Close()
	short.Truncate(4096)
	if _, err := MapLayers(base, size, []Layer{{File: short, Runs: []Run{{0, 4096}}}}); err == nil || !strings.Contains(err.Error(), "want a regular file") {
		t.Errorf("a short layer: %v", err)
	}
	if _, err := MapLayers(base, size, []Layer{{File: base, Runs: []Run{{size - 4096, 8192}}}}); err == nil || !strings.Contains(err.Error(), "past") {
		t.Errorf("a run past the end: %v", err)
	}
}

func fileBlocks(t *testing.T, f *os.File) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks
}

// TestRemapAndDirty: memory mapped again from the file it was just
// written to holds the same, and Dirty then names exactly the pages
// written since, read ones not; those written to a layer over the file
// map back to the memory as it is.
func TestRemapAndDirty(t *testing.T) {
	const size = 8 << 20
	cur, err := New(size)
	if err != nil {
		t.Fatal(err)
	}
	defer cur.Close()
	if _, err := cur.Dirty(8); err == nil {
		t.Error("Dirty of anonymous memory did not fail")
	}
	fill(t, cur, 0, 2<<20, 7)
	want := make([]byte, size)
	cur.ReadAt(want, 0)
	base := memFile(t, cur, "base")
	if err := cur.Remap(base); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	cur.ReadAt(got, 0) // reads every page: none becomes dirty
	if !bytes.Equal(got, want) {
		t.Fatal("the memory reads differently after Remap")
	}
	if runs, err := cur.Dirty(8); err != nil || len(runs) != 0 {
		t.Fatalf("Dirty after Remap = %v, %v; want none", runs, err)
	}
	cur.PutUint8(4096, 1)
	cur.PutUint8(5*4096+17, 1)
	cur.PutUint8(6*4096, 1)
	cur.PutUint8(7<<20, 1)
	runs, err := cur.Dirty(8)
	wantRuns := []Run{{4096, 4096}, {5 * 4096, 2 * 4096}, {7 << 20, 4096}}
	if err != nil || len(runs) != 3 || runs[0] != wantRuns[0] || runs[1] != wantRuns[1] || runs[2] != wantRuns[2] {
		t.Fatalf("Dirty = %v, %v; want %v", runs, err, wantRuns)
	}
	cur.ReadAt(want, 0)
	layer, err := os.OpenFile(filepath.Join(t.TempDir(), "layer"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer layer.Close()
	if err := cur.WriteRuns(layer, runs, nil, nil); err != nil {
		t.Fatal(err)
	}
	// The chain maps back to the same memory elsewhere too.
	other, err := MapLayers(base, size, []Layer{{File: layer, Runs: runs}})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	other.ReadAt(got, 0)
	if !bytes.Equal(got, want) {
		t.Error("the chain maps to another memory than the one remapped onto it")
	}
}

// TestReadSparse: reading around a file's holes gives what ReadAt gives,
// for ranges that start, end and lie in holes and data.
func TestReadSparse(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "sparse")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.Truncate(1 << 20)
	for _, at := range []int64{0, 300 << 10, 512<<10 + 17, 1<<20 - 4096} {
		f.WriteAt(bytes.Repeat([]byte{byte(at>>12) | 1}, 5000), min(at, 1<<20-5000))
	}
	for _, r := range [][2]int64{{0, 1 << 20}, {4096, 100 << 10}, {290 << 10, 20 << 10}, {600 << 10, 10}, {1<<20 - 100, 100}, {5000, 1}} {
		want := make([]byte, r[1])
		if _, err := f.ReadAt(want, r[0]); err != nil {
			t.Fatal(err)
		}
		got := bytes.Repeat([]byte{0xee}, int(r[1]))
		if n, err := readSparse(f, got, r[0]); err != nil || n != len(got) || !bytes.Equal(got, want) {
			t.Errorf("readSparse(%d bytes at %d) = %d, %v; same bytes as ReadAt: %v", r[1], r[0], n, err, bytes.Equal(got, want))
		}
	}
}
