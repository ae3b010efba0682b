package guestmem

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestLayout(t *testing.T) {
	for _, tc := range []struct {
		size    uint64
		regions []Region
	}{
		{size: 64 << 20, regions: []Region{{GPA: 0, Host: make([]byte, 64<<20)}}},
		{size: MMIOStart + 8192, regions: []Region{{GPA: 0, Host: make([]byte, MMIOStart)}, {GPA: HighStart, Host: make([]byte, 8192)}}},
	} {
		m, err := New(tc.size)
		if err != nil {
			t.Fatalf("New(%d): %v", tc.size, err)
		}
		got := m.Regions()
		if len(got) != len(tc.regions) {
			t.Fatalf("New(%d): %d regions, want %d", tc.size, len(got), len(tc.regions))
		}
		for i := range got {
			if got[i].GPA != tc.regions[i].GPA || len(got[i].Host) != len(tc.regions[i].Host) {
				t.Errorf("New(%d) region %d = %#x+%#x, want %#x+%#x", tc.size, i,
					got[i].GPA, len(got[i].Host), tc.regions[i].GPA, len(tc.regions[i].Host))
			}
		}
		if m.Size() != tc.size {
			t.Errorf("Size = %d, want %d", m.Size(), tc.size)
		}
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestNewRejectsBadSizes(t *testing.T) {
	for _, n := range []uint64{0, 100, 4097} {
		if _, err := New(n); err == nil {
			t.Errorf("New(%d) succeeded", n)
		}
	}
}

func TestBoundsChecks(t *testing.T) {
	m, err := FromRegions(Region{GPA: 0x1000, Host: make([]byte, 0x1000)}, Region{GPA: 0x3000, Host: make([]byte, 0x1000)})
	if err != nil {
		t.Fatal(err)
	}
	ok := []struct{ gpa, n uint64 }{{0x1000, 0x1000}, {0x1ff8, 8}, {0x3000, 1}, {0x1000, 0}}
	for _, c := range ok {
		if _, err := m.Slice(c.gpa, c.n); err != nil {
			t.Errorf("Slice(%#x, %d): %v", c.gpa, c.n, err)
		}
	}
	bad := []struct{ gpa, n uint64 }{
		{0, 1},                   // below RAM
		{0x1ff9, 8},              // runs off the end of a region
		{0x1fff, 0x1002},         // spans the gap between regions
		{0x2000, 1},              // in the gap
		{0x4000, 0},              // just past the end
		{0x3000, ^uint64(0)},     // length overflow
		{^uint64(0) - 2, 8},      // address overflow
		{0x1000, 1 << 63},        // huge
		{0x3fff, ^uint64(0) - 1}, // wraps
	}
	for _, c := range bad {
		if _, err := m.Slice(c.gpa, c.n); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("Slice(%#x, %#x) = %v, want ErrOutOfRange", c.gpa, c.n, err)
		}
	}
	if err := m.PutUint64(0x1ffc, 1); !errors.Is(err, ErrOutOfRange) {
		t.Errorf("PutUint64 across the end: %v", err)
	}
}

func TestAccessors(t *testing.T) {
	m, err := FromRegions(Region{GPA: 0x10000, Host: make([]byte, 0x100)})
	if err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(m.PutUint64(0x10000, 0x1122334455667788))
	must(m.PutUint32(0x10008, 0xaabbccdd))
	must(m.PutUint16(0x1000c, 0xeeff))
	must(m.PutUint8(0x1000e, 0x42))
	if v, _ := m.Uint64(0x10000); v != 0x1122334455667788 {
		t.Errorf("Uint64 = %#x", v)
	}
	if v, _ := m.Uint8(0x10000); v != 0x88 {
		t.Errorf("little endian: first byte %#x", v)
	}
	if v, _ := m.Uint32(0x10008); v != 0xaabbccdd {
		t.Errorf("Uint32 = %#x", v)
	}
	if v, _ := m.Uint16(0x1000c); v != 0xeeff {
		t.Errorf("Uint16 = %#x", v)
	}
	p := make([]byte, 4)
	must(m.ReadAt(p, 0x1000c))
	if string(p) != "\xff\xee\x42\x00" {
		t.Errorf("ReadAt = %x", p)
	}
	must(m.Zero(0x10000, 8))
	if v, _ := m.Uint64(0x10000); v != 0 {
		t.Errorf("after Zero: %#x", v)
	}
}

func TestFromRegionsRejectsOverlap(t *testing.T) {
	if _, err := FromRegions(Region{GPA: 0, Host: make([]byte, 0x2000)}, Region{GPA: 0x1000, Host: make([]byte, 0x1000)}); err == nil {
		t.Error("overlapping regions accepted")
	}
}

func TestAtomicUint16(t *testing.T) {
	m, _ := FromRegions(Region{GPA: 0x1000, Host: make([]byte, 0x100)})
	for _, gpa := range []uint64{0x1000, 0x1002, 0x10fe} {
		if err := m.StoreUint16(gpa, 0xbeef); err != nil {
			t.Fatal(err)
		}
		if v, _ := m.Uint16(gpa); v != 0xbeef {
			t.Errorf("%#x: plain read %#x", gpa, v)
		}
		if v, _ := m.LoadUint16(gpa); v != 0xbeef {
			t.Errorf("%#x: atomic read %#x", gpa, v)
		}
	}
	// The neighbouring half-word is untouched.
	m.PutUint16(0x1010, 0x1111)
	m.StoreUint16(0x1012, 0x2222)
	if v, _ := m.Uint16(0x1010); v != 0x1111 {
		t.Errorf("neighbour changed to %#x", v)
	}
	if _, err := m.LoadUint16(0x1001); err == nil {
		t.Error("odd address accepted")
	}
	if err := m.StoreUint16(0x1100, 1); err == nil {
		t.Error("address past the end accepted")
	}
}

// TestResident: a fresh mapping holds nothing; written pages are counted,
// never more than the guest's RAM.
func TestResident(t *testing.T) {
	m, err := New(8 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if n, err := m.Resident(); err != nil || n != 0 {
		t.Errorf("Resident() of untouched memory = %d, %v; want 0", n, err)
	}
	for gpa := uint64(0); gpa < 1<<20; gpa += 4096 {
		if err := m.PutUint8(gpa, 1); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := m.Resident(); err != nil || n < 1<<20 || n > m.Size() {
		t.Errorf("Resident() after writing 1 MiB = %d, %v; want between 1 MiB and %d", n, err, m.Size())
	}
}

// TestWriteFileAndMap: memory written to a file and mapped back holds the
// same bytes; the file is sparse where the guest left zeros, and writes to
// the mapping never reach the file. The write tells how far it has come
// after each stretch of pages written.
func TestWriteFileAndMap(t *testing.T) {
	const size = 16 << 20
	m, err := New(size)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for _, gpa := range []uint64{0, 4096 * 7, size - 4096} {
		if err := m.WriteAt([]byte("page"), gpa+5); err != nil {
			t.Fatal(err)
		}
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "mem"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var upTo []int64
	if err := m.WriteFile(f, nil, func(off int64) { upTo = append(upTo, off) }); err != nil {
		t.Fatalf("WriteFile() = %v", err)
	}
	// Told after each stretch written: the three pages, in order.
	if want := []int64{4096, 4096 * 8, size}; !slices.Equal(upTo, want) {
		t.Errorf("WriteFile's progress = %v; want %v", upTo, want)
	}
	// Memory whose last pages are zero: the end is told too, once.
	tail, err := New(size)
	if err != nil {
		t.Fatal(err)
	}
	defer tail.Close()
	if err := tail.WriteAt([]byte("page"), 4096*3); err != nil {
		t.Fatal(err)
	}
	upTo = nil
	if err := tail.WriteFile(f, nil, func(off int64) { upTo = append(upTo, off) }); err != nil {
		t.Fatalf("WriteFile() = %v", err)
	}
	if want := []int64{4096 * 4, size}; !slices.Equal(upTo, want) {
		t.Errorf("WriteFile's progress, the memory's end zero = %v; want %v", upTo, want)
	}
	// Again as the first: the file holds the first memory below.
	if err := m.WriteFile(f, nil, nil); err != nil {
		t.Fatalf("WriteFile() = %v", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if used := st.Blocks * 512; st.Size != size || used > 1<<20 {
		t.Errorf("file of %d bytes using %d on disk; want %d, sparse", st.Size, used, size)
	}
	r, err := Map(f, size)
	if err != nil {
		t.Fatalf("Map() = %v", err)
	}
	defer r.Close()
	for _, gpa := range []uint64{0, 4096 * 7, size - 4096} {
		if b, _ := r.Slice(gpa, 16); !bytes.Equal(b, append(make([]byte, 5), "page\x00\x00\x00\x00\x00\x00\x00"...)) {
			t.Errorf("mapped page at %#x = % x", gpa, b)
		}
	}
	r.WriteAt([]byte("guest"), 4096)
	if b := make([]byte, 5); func() bool { f.ReadAt(b, 4096); return string(b) == "guest" }() {
		t.Error("a write to the mapping reached the file")
	}
	if _, err := Map(f, size*2); err == nil {
		t.Error("Map() of a file smaller than the memory = nil error")
	}
}

func TestNewAlignsOnHugePages(t *testing.T) {
	for _, size := range []uint64{64 << 20, 64<<20 + 4096} {
		m, err := New(size)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range m.Regions() {
			if a := addrOf(r.Host); a%hugePage != 0 {
				t.Errorf("New(%d): region at GPA %#x is at host address %#x, not on a 2 MiB boundary", size, r.GPA, a)
			}
		}
		if got := uint64(len(m.Regions()[0].Host)); got != size {
			t.Errorf("New(%d): region of %d bytes", size, got)
		}
		if err := m.Close(); err != nil {
			t.Errorf("Close() = %v", err)
		}
	}
}

// TestNewGuardsItsMemory: each region is a VMA of its own, between
// inaccessible guard pages, so that no later mapping can be merged into it
// (which would mark all of it soft-dirty, and make a pre-copy's Finish
// write everything). Memories mapped one after another, each given the
// same advice, stay apart.
func TestNewGuardsItsMemory(t *testing.T) {
	var ms []*Memory
	defer func() {
		for _, m := range ms {
			m.Close()
		}
	}()
	for range 8 {
		m, err := New(4 << 20)
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, m)
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	// vma returns the start, end and permissions of the VMA holding a.
	vma := func(a uint64) (start, end uint64, perms string) {
		for _, line := range strings.Split(string(maps), "\n") {
			var s, e uint64
			var p string
			if _, err := fmt.Sscanf(line, "%x-%x %s", &s, &e, &p); err == nil && s <= a && a < e {
				return s, e, p
			}
		}
		return 0, 0, ""
	}
	for i, m := range ms {
		r := m.Regions()[0]
		lo, hi := addrOf(r.Host), addrOf(r.Host)+uint64(len(r.Host))
		if s, e, p := vma(lo); s != lo || e != hi || !strings.HasPrefix(p, "rw") {
			t.Errorf("memory %d at %#x-%#x lies in the VMA %#x-%#x %s; want one of its own", i, lo, hi, s, e, p)
		}
		for _, a := range []uint64{lo - pageSize, hi} {
			if _, _, p := vma(a); !strings.HasPrefix(p, "---") {
				t.Errorf("memory %d at %#x-%#x: the page at %#x is %q; want a guard (---)", i, lo, hi, a, p)
			}
		}
	}
}

// TestDiscard: the whole pages inside a slice go back to the host (no
// longer resident, zero again); a partial page at either end is kept;
// a mapped snapshot's page reverts to the file's content; a slice that is
// not guest memory is refused.
func TestDiscard(t *testing.T) {
	m, err := New(8 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for gpa := uint64(0); gpa < 4<<20; gpa += 4096 {
		if err := m.PutUint8(gpa+100, 7); err != nil {
			t.Fatal(err)
		}
	}
	before, err := m.Resident()
	if err != nil {
		t.Fatal(err)
	}
	// From the middle of page 1 to the middle of page 1+512+1: 512 whole
	// pages (2 MiB) inside.
	b, err := m.Slice(4096+2048, 2<<20+4096)
	if err != nil {
		t.Fatal(err)
	}
	n, err := m.Discard(b)
	if err != nil || n != 2<<20 {
		t.Fatalf("Discard() = %d, %v; want %d", n, err, 2<<20)
	}
	after, err := m.Resident()
	if err != nil {
		t.Fatal(err)
	}
	if after+2<<20 > before {
		t.Errorf("resident %d before, %d after discarding 2 MiB", before, after)
	}
	for _, c := range []struct {
		gpa  uint64
		want uint8
	}{{4096 + 100, 7}, {2*4096 + 100, 0}, {(1+512)*4096 + 100, 0}, {(2+512)*4096 + 100, 7}} {
		if v, _ := m.Uint8(c.gpa); v != c.want {
			t.Errorf("byte at %#x after the discard = %d, want %d", c.gpa, v, c.want)
		}
	}
	if n, err := m.Discard(b[:100]); err != nil || n != 0 {
		t.Errorf("Discard() of less than a page = %d, %v; want 0, nil", n, err)
	}
	if _, err := m.Discard(make([]byte, 8192)); !errors.Is(err, ErrOutOfRange) {
		t.Errorf("Discard() of a slice outside guest memory = %v, want ErrOutOfRange", err)
	}

	// A snapshot's page discarded reads as the file has it.
	f, err := os.Create(filepath.Join(t.TempDir(), "mem"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := m.WriteFile(f, nil, nil); err != nil {
		t.Fatal(err)
	}
	r, err := Map(f, m.Size())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.PutUint8(3<<20+100, 9); err != nil {
		t.Fatal(err)
	}
	p, _ := r.Slice(3<<20, 4096)
	if n, err := r.Discard(p); err != nil || n != 4096 {
		t.Fatalf("Discard() of a mapped page = %d, %v", n, err)
	}
	if v, _ := r.Uint8(3<<20 + 100); v != 7 {
		t.Errorf("a discarded page of a mapped file reads %d, want the file's 7", v)
	}

	// Memory the package did not map is cleared.
	heap := make([]byte, 3*4096)
	for i := range heap {
		heap[i] = 1
	}
	h, err := FromRegions(Region{GPA: 0, Host: heap})
	if err != nil {
		t.Fatal(err)
	}
	n, err = h.Discard(heap)
	if err != nil || n == 0 || n > uint64(len(heap)) {
		t.Fatalf("Discard() of FromRegions memory = %d, %v", n, err)
	}
	if bytes.Count(heap, []byte{0}) != int(n) {
		t.Errorf("%d bytes cleared, want %d", bytes.Count(heap, []byte{0}), n)
	}
}
