// Package guestmem is a virtual machine's physical memory as the host sees it:
// anonymous mmap'd regions placed at guest physical addresses, with
// bounds-checked accessors.
//
// It is the one type that the boot code, the devices and the VMM share. Every
// access takes a guest physical address (GPA) and a length and fails with an
// error, never a panic, when any byte of it falls outside guest RAM: the guest
// controls most of the addresses that reach this package.
package guestmem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// The x86 layout: RAM from 0 up to MMIOStart, the rest of RAM from 4 GiB up.
// [MMIOStart, 4 GiB) holds device MMIO, the IOAPIC and the LAPIC.
const (
	MMIOStart uint64 = 0xd000_0000
	HighStart uint64 = 0x1_0000_0000
)

// ErrOutOfRange is wrapped by every error for an access outside guest RAM.
var ErrOutOfRange = errors.New("guest memory access out of range")

// Region is one contiguous block of guest RAM.
type Region struct {
	GPA  uint64 // guest physical address of Host[0]
	Host []byte // the host mapping
}

// End is the first guest physical address after the region.
func (r Region) End() uint64 { return r.GPA + uint64(len(r.Host)) }

// Memory is a guest's RAM. Its methods are safe for concurrent use: the
// mapping never changes after New, and callers coordinate the contents.
type Memory struct {
	regions []Region // sorted by GPA, non-overlapping
	maps    [][]byte // the mappings the regions lie in, for Close
	size    uint64
	mapped  bool // regions were mmap'd by New and are unmapped by Close
	backed  bool // every region is a private mapping of files (Map, MapLayers, Remap): Dirty works
	// discards, while a PreCopy runs, notes the pages Discard gives back:
	// read again, such a page is the kernel's zero page, present and not
	// soft-dirty, which Finish could not tell from an unchanged one.
	discards atomic.Pointer[pageSet]
}

// New maps size bytes of guest RAM laid out for x86: below MMIOStart first,
// the remainder at HighStart. size must be a positive multiple of 4 KiB.
func New(size uint64) (*Memory, error) { return mapLayout(size, nil) }

// Map maps size bytes of guest RAM from f, laid out as New lays it out and
// as WriteFile wrote it (the regions one after another), copy-on-write:
// the guest's writes stay in this process and never reach f, and every
// VM that maps one file shares the pages it has not written. f must hold
// size bytes.
func Map(f *os.File, size uint64) (*Memory, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("guest memory file: %w", err)
	}
	if !fi.Mode().IsRegular() || uint64(fi.Size()) != size {
		return nil, fmt.Errorf("guest memory file %s: %d bytes (%v), want a regular file of %d", f.Name(), fi.Size(), fi.Mode().Type(), size)
	}
	return mapLayout(size, f)
}

func mapLayout(size uint64, f *os.File) (*Memory, error) {
	if size == 0 || size%4096 != 0 {
		return nil, fmt.Errorf("guest memory size %d: must be a positive multiple of 4096", size)
	}
	low := min(size, MMIOStart)
	layout := []struct{ gpa, n uint64 }{{0, low}}
	if size > low {
		layout = append(layout, struct{ gpa, n uint64 }{HighStart, size - low})
	}
	m := &Memory{size: size, mapped: true, backed: f != nil}
	var off int64
	for _, l := range layout {
		if f != nil {
			b, err := unix.Mmap(int(f.Fd()), off, int(l.n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_NORESERVE)
			if err != nil {
				m.Close()
				return nil, fmt.Errorf("mmap %d bytes of guest memory: %w", l.n, err)
			}
			m.maps = append(m.maps, b)
			m.regions = append(m.regions, Region{GPA: l.gpa, Host: b})
			off += int64(l.n)
			continue
		}
		// The region starts at a 2 MiB boundary of the mapping, so that
		// guest and host huge pages line up.
		b, skip, err := mapHuge(l.n)
		if err != nil {
			m.Close()
			return nil, err
		}
		m.maps = append(m.maps, b)
		m.regions = append(m.regions, Region{GPA: l.gpa, Host: b[skip : skip+l.n : skip+l.n]})
		off += int64(l.n)
	}
	return m, nil
}

// hugePage is x86's 2 MiB page.
const hugePage = 2 << 20

// mapHuge maps n bytes of anonymous memory, with slack at either end so
// that a 2 MiB aligned run of n bytes lies inside, and asks for
// transparent huge pages on that run: KVM then maps the guest's memory
// with 2 MiB pages of the nested page table wherever the host has a huge
// page, and a guest's boot takes a few hundred second-level page faults
// instead of thousands (each an exit, costly when the host is itself a
// guest). Where transparent huge pages are off, the advice fails quietly
// and memory is in 4 KiB pages. It returns the whole mapping and the
// run's offset in it.
//
// The slack, at least a page at either end, is made inaccessible: a guard
// that keeps any later mapping of the process from lying next to the run.
// A mapping with the run's flags placed next to it would be merged into
// its VMA, and the kernel marks a VMA that grows soft-dirty as a whole
// (mm/vma.c, for soft-dirty trackers that must see new memory), so every
// page of the guest would read as written since a pre-copy began.
func mapHuge(n uint64) ([]byte, uint64, error) {
	total := n + hugePage + pageSize
	b, err := unix.Mmap(-1, 0, int(total), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, 0, fmt.Errorf("mmap %d bytes of guest memory: %w", n, err)
	}
	// The first 2 MiB boundary at least a page in: skip is at most
	// hugePage, and the slack after the run at least a page.
	first := addrOf(b) + pageSize
	skip := pageSize + (hugePage-first%hugePage)%hugePage
	for _, guard := range [][]byte{b[:skip], b[skip+n:]} {
		if err := unix.Mprotect(guard, unix.PROT_NONE); err != nil {
			unix.Munmap(b)
			return nil, 0, fmt.Errorf("guard pages of guest memory: %w", err)
		}
	}
	_ = unix.Madvise(b[skip:skip+n], unix.MADV_HUGEPAGE)
	return b, skip, nil
}

// WriteFile writes the memory to f as Map reads it: the regions one after
// another. f is truncated to Size first and all-zero pages are left as
// holes, so the file takes the disk space of the pages the guest used.
// If sum is not nil, Hash's bytes go to it too; if written is not nil,
// it is told how far the write has come.
func (m *Memory) WriteFile(f *os.File, sum io.Writer, written Written) error {
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("write guest memory: %w", err)
	}
	if err := f.Truncate(int64(m.size)); err != nil {
		return fmt.Errorf("write guest memory: %w", err)
	}
	var last int64
	err := m.dataRuns(func(off int64, run []byte) error {
		if _, err := f.WriteAt(run, off); err != nil {
			return fmt.Errorf("write guest memory: %w", err)
		}
		last = off + int64(len(run))
		written.upTo(last)
		if sum != nil {
			return hashRun(sum, off, run)
		}
		return nil
	})
	if err == nil {
		written.end(last, m.size)
	}
	return err
}

// Written, when not nil, is told how far a write of guest memory has
// come, as it goes: the offset of the memory file up to which it has
// written (the all-zero pages it passes over are holes), after each
// stretch written, and the memory's Size once the write is done. It is
// for showing progress.
type Written func(upTo int64)

func (w Written) upTo(off int64) {
	if w != nil {
		w(off)
	}
}

// end tells a write that ended well, whose last stretch written ended at
// last, that it reached size: the zero pages after it are holes.
func (w Written) end(last int64, size uint64) {
	if last != int64(size) {
		w.upTo(int64(size))
	}
}

// Hash writes to w, for each page that is not all zero, its offset in
// the memory file (8 bytes, little-endian) and its bytes: a checksum of
// the contents that costs only the pages in use.
func (m *Memory) Hash(w io.Writer) error {
	return m.dataRuns(func(off int64, run []byte) error { return hashRun(w, off, run) })
}

func hashRun(w io.Writer, off int64, run []byte) error {
	for i := 0; i < len(run); i += pageSize {
		var o [8]byte
		binary.LittleEndian.PutUint64(o[:], uint64(off)+uint64(i))
		if _, err := w.Write(o[:]); err != nil {
			return err
		}
		if _, err := w.Write(run[i : i+pageSize]); err != nil {
			return err
		}
	}
	return nil
}

// pageSize is the x86 page, the guest's and the host's.
const pageSize = 4096

// dataRuns calls fn with each run of pages that are not all zero (at
// most 8 MiB each), with its offset in the memory file.
func (m *Memory) dataRuns(fn func(off int64, run []byte) error) error {
	var off int64
	for _, r := range m.regions {
		if err := nonZero(r.Host, off, fn); err != nil {
			return err
		}
		off += int64(len(r.Host))
	}
	return nil
}

// nonZero calls fn with each run of b's pages that are not all zero (at
// most 8 MiB each), with its offset in the memory file, b's being off.
func nonZero(b []byte, off int64, fn func(off int64, run []byte) error) error {
	for i := 0; i < len(b); {
		if isZero(b[i : i+pageSize]) {
			i += pageSize
			continue
		}
		j := i + pageSize
		for j < len(b) && j-i < 8<<20 && !isZero(b[j:j+pageSize]) {
			j += pageSize
		}
		if err := fn(off+int64(i), b[i:j]); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// isZero reports whether b holds only zero bytes.
func isZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// FromRegions builds a Memory over caller-owned buffers (tests, fuzzers).
// Close does not unmap them.
func FromRegions(regions ...Region) (*Memory, error) {
	rs := append([]Region(nil), regions...)
	sort.Slice(rs, func(i, j int) bool { return rs[i].GPA < rs[j].GPA })
	m := &Memory{}
	for i, r := range rs {
		if len(r.Host) == 0 {
			return nil, fmt.Errorf("region at %#x is empty", r.GPA)
		}
		if r.End() < r.GPA {
			return nil, fmt.Errorf("region at %#x wraps the address space", r.GPA)
		}
		if i > 0 && rs[i-1].End() > r.GPA {
			return nil, fmt.Errorf("regions at %#x and %#x overlap", rs[i-1].GPA, r.GPA)
		}
		m.size += uint64(len(r.Host))
	}
	m.regions = rs
	return m, nil
}

// Close unmaps memory that New mapped. The Memory must not be used after.
func (m *Memory) Close() error {
	var errs []error
	if m.mapped {
		for _, b := range m.maps {
			if err := unix.Munmap(b); err != nil {
				errs = append(errs, fmt.Errorf("munmap guest memory: %w", err))
			}
		}
	}
	m.regions, m.maps, m.mapped = nil, nil, false
	return errors.Join(errs...)
}

// Size is the total RAM in bytes.
func (m *Memory) Size() uint64 { return m.size }

// Regions returns the RAM regions, sorted by guest address. The slices alias
// guest memory; the VMM hands them to KVM.
func (m *Memory) Regions() []Region { return append([]Region(nil), m.regions...) }

// LowEnd is the end of the RAM region that starts at 0.
func (m *Memory) LowEnd() uint64 {
	if len(m.regions) == 0 || m.regions[0].GPA != 0 {
		return 0
	}
	return m.regions[0].End()
}

// Slice returns the n bytes at gpa as a slice aliasing guest memory. The range
// must lie inside one region. The guest may change the bytes at any time.
func (m *Memory) Slice(gpa, n uint64) ([]byte, error) {
	for _, r := range m.regions {
		if gpa >= r.GPA && gpa < r.End() {
			off := gpa - r.GPA
			if n > uint64(len(r.Host))-off {
				break
			}
			return r.Host[off : off+n : off+n], nil
		}
	}
	return nil, fmt.Errorf("%w: %d bytes at %#x", ErrOutOfRange, n, gpa)
}

// Contains reports whether all n bytes at gpa are guest RAM in one region.
func (m *Memory) Contains(gpa, n uint64) bool {
	_, err := m.Slice(gpa, n)
	return err == nil
}

// ReadAt copies len(p) bytes from gpa into p.
func (m *Memory) ReadAt(p []byte, gpa uint64) error {
	b, err := m.Slice(gpa, uint64(len(p)))
	if err != nil {
		return err
	}
	copy(p, b)
	return nil
}

// WriteAt copies p into guest memory at gpa.
func (m *Memory) WriteAt(p []byte, gpa uint64) error {
	b, err := m.Slice(gpa, uint64(len(p)))
	if err != nil {
		return err
	}
	copy(b, p)
	return nil
}

// Zero clears n bytes at gpa.
func (m *Memory) Zero(gpa, n uint64) error {
	b, err := m.Slice(gpa, n)
	if err != nil {
		return err
	}
	clear(b)
	return nil
}

// Uint8 .. PutUint64 read and write little-endian integers.

func (m *Memory) Uint8(gpa uint64) (uint8, error) {
	b, err := m.Slice(gpa, 1)
	if err != nil {
		return 0, err
	}
	return b[0], nil
}

func (m *Memory) Uint16(gpa uint64) (uint16, error) {
	b, err := m.Slice(gpa, 2)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint16(b), nil
}

func (m *Memory) Uint32(gpa uint64) (uint32, error) {
	b, err := m.Slice(gpa, 4)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint32(b), nil
}

func (m *Memory) Uint64(gpa uint64) (uint64, error) {
	b, err := m.Slice(gpa, 8)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(b), nil
}

func (m *Memory) PutUint8(gpa uint64, v uint8) error {
	b, err := m.Slice(gpa, 1)
	if err != nil {
		return err
	}
	b[0] = v
	return nil
}

func (m *Memory) PutUint16(gpa uint64, v uint16) error {
	b, err := m.Slice(gpa, 2)
	if err != nil {
		return err
	}
	binary.LittleEndian.PutUint16(b, v)
	return nil
}

func (m *Memory) PutUint32(gpa uint64, v uint32) error {
	b, err := m.Slice(gpa, 4)
	if err != nil {
		return err
	}
	binary.LittleEndian.PutUint32(b, v)
	return nil
}

func (m *Memory) PutUint64(gpa uint64, v uint64) error {
	b, err := m.Slice(gpa, 8)
	if err != nil {
		return err
	}
	binary.LittleEndian.PutUint64(b, v)
	return nil
}

// Discard gives the host back the whole 4 KiB pages inside b, which must
// alias this memory as Slice's results do: the host frees them at once,
// and the guest's next access finds them zero (memory New mapped) or as
// the snapshot file holds them (memory Map mapped). It is for pages the
// guest said it no longer uses (the balloon's), so either is as good. It
// returns how many bytes it gave back. Memory this package did not map
// (FromRegions) is cleared instead, its pages left to the Go heap.
func (m *Memory) Discard(b []byte) (uint64, error) {
	if len(b) == 0 {
		return 0, nil
	}
	start := addrOf(b)
	end := start + uint64(len(b))
	for _, r := range m.regions {
		if len(r.Host) == 0 {
			continue
		}
		rs := addrOf(r.Host)
		if start < rs || end > rs+uint64(len(r.Host)) {
			continue
		}
		lo, hi := (start+pageSize-1)&^(pageSize-1), end&^(pageSize-1)
		if lo >= hi {
			return 0, nil
		}
		p := r.Host[lo-rs : hi-rs]
		if !m.mapped {
			clear(p)
			return uint64(len(p)), nil
		}
		if err := unix.Madvise(p, unix.MADV_DONTNEED); err != nil {
			return 0, fmt.Errorf("discard %d bytes of guest memory at %#x: %w", len(p), r.GPA+(lo-rs), err)
		}
		if d := m.discards.Load(); d != nil {
			d.add(m.fileOffset(r)+int64(lo-rs), int64(len(p)))
		}
		return uint64(len(p)), nil
	}
	return 0, fmt.Errorf("%w: discard of %d bytes that do not lie in one region of guest memory", ErrOutOfRange, len(b))
}

// Resident is how many bytes of guest RAM the host holds in memory now
// (mincore over every region): the pages the guest has touched and the
// host has not reclaimed, what a sandbox really costs the host.
func (m *Memory) Resident() (uint64, error) {
	page := uint64(unix.Getpagesize())
	var vec []byte
	var n uint64
	for _, r := range m.regions {
		pages := (uint64(len(r.Host)) + page - 1) / page
		if uint64(cap(vec)) < pages {
			vec = make([]byte, pages)
		}
		vec = vec[:pages]
		if err := mincore(r.Host, vec); err != nil {
			return 0, fmt.Errorf("mincore guest memory at %#x: %w", r.GPA, err)
		}
		for _, v := range vec {
			n += uint64(v & 1)
		}
	}
	return n * page, nil
}
