package guestmem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// A pre-copy writes the memory to a file while the VM still runs, and
// then, paused, only the pages written since: the pause of a snapshot
// that writes the whole memory (a fork's first) becomes the time to
// write what the guest, its devices and KVM changed while the copy ran,
// instead of the time to scan and write it all (live migration's
// pre-copy, in one round).
//
// Which pages changed is the kernel's soft-dirty tracking
// (Documentation/admin-guide/mm/soft-dirty.rst): writing 4 to
// /proc/PID/clear_refs clears every page's soft-dirty bit and
// write-protects it, and the first write to it after, from this process
// or from KVM on the guest's behalf (KVM follows the write protection
// through its MMU notifier), sets the bit again, which /proc/PID/pagemap
// tells (bit 55). It covers memory that is not a file's (New's): of a
// mapping of files, a page the kernel drops goes back to the file's
// contents, which the copy may not hold.

// pagemap's bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent   = 1 << 63
	pmSwapped   = 1 << 62
	pmFile      = 1 << 61
	pmSoftDirty = 1 << 55
)

// preCopying is held by the pre-copy under way in this process, from
// PreCopy to Finish or Close. It is the package's one global, because
// what it guards is the process's: clear_refs clears every page's
// soft-dirty bit in the process, so a second pre-copy beginning would
// erase what the first's Finish needs. A second is refused (ErrBusy).
var preCopying sync.Mutex

// ErrBusy is PreCopy's error while another pre-copy in this process is
// under way: the caller writes the memory while paused instead.
var ErrBusy = errors.New("another pre-copy of guest memory is under way in this process")

// ErrNoSoftDirty is PreCopy's error where the kernel does not track
// soft-dirty pages (built without CONFIG_MEM_SOFT_DIRTY, which clears
// nothing and sets no bit, or where clear_refs cannot be opened).
var ErrNoSoftDirty = errors.New("the kernel does not track soft-dirty pages")

// OpenClearRefs opens /proc/self/clear_refs for PreCopy: where the
// process is later confined (Landlock gives /proc/self to read only),
// before that.
func OpenClearRefs() (*os.File, error) {
	f, err := os.OpenFile("/proc/self/clear_refs", os.O_WRONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoSoftDirty, err)
	}
	return f, nil
}

// PreCopy is a copy of the memory in a file, begun while the VM runs.
type PreCopy struct {
	m        *Memory
	f        *os.File
	written  *pageSet // the pages the copy wrote (they were not all zero)
	discards *pageSet // the pages Discard gave back since the copy began
	done     bool     // finished or closed: preCopying released
	// Cleared is how long clearing the soft-dirty bits took: the
	// kernel's walk of every page of the process, through which a VM of
	// the process can map no page it faults on (KVM waits for the walk's
	// invalidation to end), so its guest may stand still meanwhile.
	Cleared time.Duration
}

// pageSet is a bit per page of a memory's file offsets.
type pageSet struct {
	mu   sync.Mutex
	bits []uint64
}

func newPageSet(size uint64) *pageSet {
	return &pageSet{bits: make([]uint64, (size/pageSize+63)/64)}
}

// add adds the pages of [off, off+n).
func (s *pageSet) add(off, n int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for o := off; o < off+n; o += pageSize {
		if i := o / pageSize / 64; i >= 0 && i < int64(len(s.bits)) {
			s.bits[i] |= 1 << (o / pageSize % 64)
		}
	}
}

// has says whether the page at off is in the set.
func (s *pageSet) has(off int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := off / pageSize / 64
	return i >= 0 && i < int64(len(s.bits)) && s.bits[i]&(1<<(off/pageSize%64)) != 0
}

// PreCopy clears the soft-dirty bits through clearRefs (OpenClearRefs's),
// checks that the kernel tracks them, and writes the memory to f as
// WriteFile does, while the VM may still run: Finish, paused, completes
// it, or Close gives it up. Memory mapped from files is refused, as are
// kernels that do not track soft-dirty pages (ErrNoSoftDirty) and a
// second pre-copy in the process while one is under way (ErrBusy): the
// caller writes the memory while paused instead.
//
// Clearing the bits write-protects every page of the process, which the
// kernel does holding its mmap lock for the whole walk, and makes KVM
// drop its mappings of every VM's memory in the process: each VM's next
// touch of a page, and its next write, is a fault. That time is not in
// the pause, but the guests run slower for it. If written is not nil, it
// is told how far the copy has come.
func (m *Memory) PreCopy(f, clearRefs *os.File, written Written) (*PreCopy, error) {
	if !m.mapped || m.backed {
		return nil, errors.New("pre-copy of guest memory: only of memory not mapped from files")
	}
	if !preCopying.TryLock() {
		return nil, fmt.Errorf("pre-copy of guest memory: %w", ErrBusy)
	}
	p := &PreCopy{m: m, f: f, written: newPageSet(m.size), discards: newPageSet(m.size)}
	fail := func(err error) (*PreCopy, error) {
		p.Close()
		return nil, fmt.Errorf("pre-copy of guest memory: %w", err)
	}
	pm, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return fail(err)
	}
	defer pm.Close()
	// Discards are noted from before the clear: one between the two
	// would leave a zero page behind it, not soft-dirty.
	m.discards.Store(p.discards)
	t0 := time.Now()
	if err := clearSoftDirty(clearRefs, pm); err != nil {
		return fail(err)
	}
	p.Cleared = time.Since(t0)
	if err := f.Truncate(0); err != nil {
		return fail(err)
	}
	if err := f.Truncate(int64(m.size)); err != nil {
		return fail(err)
	}
	var last int64
	err = m.dataRuns(func(off int64, run []byte) error {
		if _, err := f.WriteAt(run, off); err != nil {
			return err
		}
		p.written.add(off, int64(len(run)))
		last = off + int64(len(run))
		written.upTo(last)
		return nil
	})
	if err != nil {
		return fail(err)
	}
	written.end(last, m.size)
	return p, nil
}

// Close gives up a copy Finish did not finish (the file is the caller's),
// so that another may begin.
func (p *PreCopy) Close() {
	if p.done {
		return
	}
	p.done = true
	p.m.discards.CompareAndSwap(p.discards, nil)
	preCopying.Unlock()
}

// clearSoftDirty clears every page's soft-dirty bit, and checks on a page
// of its own that the kernel tracks them: clear, the bit is off; written,
// on. A kernel without soft-dirty tracking takes the clear and sets no bit.
func clearSoftDirty(clearRefs, pm *os.File) error {
	probe, err := unix.Mmap(-1, 0, pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return err
	}
	defer unix.Munmap(probe)
	probe[0] = 1
	if _, err := clearRefs.WriteAt([]byte("4"), 0); err != nil {
		return fmt.Errorf("%w: clear_refs: %w", ErrNoSoftDirty, err)
	}
	before, err := pagemapEntry(pm, probe)
	if err != nil {
		return err
	}
	probe[0] = 2
	after, err := pagemapEntry(pm, probe)
	if err != nil {
		return err
	}
	if before&pmSoftDirty != 0 || after&pmSoftDirty == 0 {
		return ErrNoSoftDirty
	}
	return nil
}

func pagemapEntry(pm *os.File, page []byte) (uint64, error) {
	var b [8]byte
	if _, err := pm.ReadAt(b[:], int64(addrOf(page)/pageSize)*8); err != nil {
		return 0, fmt.Errorf("read pagemap: %w", err)
	}
	return binary.LittleEndian.Uint64(b[:]), nil
}

// Finish completes the copy with the memory no longer changing (a paused
// VM, its devices quiet): every page written since PreCopy began, or
// given back to the host (Discard), is written again, and every page the
// copy wrote that is now gone from the process (given back: it reads as
// zeros) is cleared, so that the file then holds exactly what WriteFile
// would write. It returns how many pages it wrote or cleared. Finished or
// not, the copy is over (Close).
func (p *PreCopy) Finish() (int, error) {
	if p.done {
		return 0, errors.New("pre-copy of guest memory: finished or closed already")
	}
	defer p.Close()
	var dirty, gone runList
	err := p.m.scanPagemap(func() { dirty.region(); gone.region() }, func(o int64, e uint64) {
		switch {
		case e&pmSoftDirty != 0 || p.discards.has(o):
			dirty.add(o)
		case e&(pmPresent|pmSwapped) == 0 && p.written.has(o):
			gone.add(o)
		}
	})
	if err != nil {
		return 0, fmt.Errorf("pre-copy of guest memory: %w", err)
	}
	count := 0
	for _, run := range dirty.runs {
		if err := p.writeRun(run); err != nil {
			return 0, err
		}
		count += int(run.Len / pageSize)
	}
	for _, run := range gone.runs {
		if err := p.clearRun(run); err != nil {
			return 0, err
		}
		count += int(run.Len / pageSize)
	}
	return count, nil
}

// writeRun writes the run's pages as they are now: zeros over those the
// copy wrote that are all zero now, and the others' bytes.
func (p *PreCopy) writeRun(run Run) error {
	b, err := p.m.fileSlice(run)
	if err != nil {
		return err
	}
	for i := 0; i < len(b); i += pageSize {
		o := run.Off + int64(i)
		if p.written.has(o) && isZero(b[i:i+pageSize]) {
			if err := p.clearRun(Run{Off: o, Len: pageSize}); err != nil {
				return err
			}
		}
	}
	return nonZero(b, run.Off, func(off int64, data []byte) error {
		if _, err := p.f.WriteAt(data, off); err != nil {
			return fmt.Errorf("pre-copy of guest memory: %w", err)
		}
		return nil
	})
}

// clearRun makes the run read as zeros in the file: a hole where the file
// system punches one, zeros written otherwise.
func (p *PreCopy) clearRun(run Run) error {
	err := unix.Fallocate(int(p.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, run.Off, run.Len)
	if err == nil {
		return nil
	}
	if _, err := p.f.WriteAt(make([]byte, run.Len), run.Off); err != nil {
		return fmt.Errorf("pre-copy of guest memory: %w", err)
	}
	return nil
}

// scanPagemap calls page with the memory file offset and /proc/self/pagemap
// entry of every page of the memory, in order, and region before each
// region's first: the entries are read from the kernel a few thousand
// at a time, no page is touched.
func (m *Memory) scanPagemap(region func(), page func(off int64, e uint64)) error {
	pm, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return err
	}
	defer pm.Close()
	buf := make([]byte, 8*4096)
	var off int64
	for _, r := range m.regions {
		pages := len(r.Host) / pageSize
		region()
		for i := 0; i < pages; {
			n := min(pages-i, len(buf)/8)
			if _, err := pm.ReadAt(buf[:8*n], int64(addrOf(r.Host)/pageSize+uint64(i))*8); err != nil {
				return fmt.Errorf("read pagemap: %w", err)
			}
			for k := range n {
				page(off+int64(i+k)*pageSize, binary.LittleEndian.Uint64(buf[8*k:]))
			}
			i += n
		}
		off += int64(len(r.Host))
	}
	return nil
}

// fileOffset is the offset of region r's first byte in the memory file.
func (m *Memory) fileOffset(r Region) int64 {
	var off int64
	for _, x := range m.regions {
		if x.GPA == r.GPA {
			return off
		}
		off += int64(len(x.Host))
	}
	return off
}
