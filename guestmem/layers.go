package guestmem

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"

	"golang.org/x/sys/unix"
)

// Layered memory: a snapshot written over an earlier one holds only the
// pages that differ from it (Delta, WriteRuns), and a restore maps the
// earlier one's file and then each later file's runs over it, each
// copy-on-write (MapLayers), so that the chain is flattened by the page
// tables and no page is read until the guest touches it.

// Run is a run of whole pages of a memory file: Off and Len in bytes,
// multiples of 4 KiB, Len not 0.
type Run struct {
	Off int64 `json:"off"`
	Len int64 `json:"len"`
}

// End is the offset after the run.
func (r Run) End() int64 { return r.Off + r.Len }

// Layer is a memory file whose Runs hold pages that replace those of the
// memory beneath it; what lies outside its runs is not read.
type Layer struct {
	File *os.File
	Runs []Run
}

// CheckRuns says what is wrong with runs of a memory file of size bytes,
// if anything: each of whole pages, inside the file and inside one of
// the layout's regions (a run across MMIOStart cannot be mapped in one
// piece), in increasing order without overlap, and at most limit of them.
// Runs come from a snapshot's manifest: untrusted.
func CheckRuns(runs []Run, size uint64, limit int) error {
	if len(runs) > limit {
		return fmt.Errorf("%d runs of memory: at most %d", len(runs), limit)
	}
	low := int64(min(size, MMIOStart))
	var end int64
	for i, r := range runs {
		switch {
		case r.Off%pageSize != 0 || r.Len%pageSize != 0 || r.Len <= 0:
			return fmt.Errorf("run %d (%d bytes at %d): not whole pages", i, r.Len, r.Off)
		case r.Off < end:
			return fmt.Errorf("run %d (%d bytes at %d): out of order or overlapping the one before", i, r.Len, r.Off)
		case r.End() < r.Off || uint64(r.End()) > size:
			return fmt.Errorf("run %d (%d bytes at %d): past the memory's %d bytes", i, r.Len, r.Off, size)
		case r.Off < low && r.End() > low:
			return fmt.Errorf("run %d (%d bytes at %d): across the end of the low region (%d)", i, r.Len, r.Off, low)
		}
		end = r.End()
	}
	return nil
}

// MapLayers maps size bytes of guest RAM from base as Map does, then the
// runs of each layer over it, first to last, each copy-on-write: the
// result reads as base with every layer's pages put in, in order. Each
// run is one more mapping of the process (the kernel's vm.max_map_count
// bounds them all, 65530 by default), so a caller bounds runs and layers.
func MapLayers(base *os.File, size uint64, layers []Layer) (*Memory, error) {
	m, err := Map(base, size)
	if err != nil {
		return nil, err
	}
	for i, l := range layers {
		if err := m.mapLayer(l); err != nil {
			m.Close()
			return nil, fmt.Errorf("guest memory layer %d: %w", i+1, err)
		}
	}
	return m, nil
}

func (m *Memory) mapLayer(l Layer) error {
	fi, err := l.File.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || uint64(fi.Size()) != m.size {
		return fmt.Errorf("%s: %d bytes (%v), want a regular file of %d", l.File.Name(), fi.Size(), fi.Mode().Type(), m.size)
	}
	if err := CheckRuns(l.Runs, m.size, len(l.Runs)); err != nil {
		return err
	}
	for _, r := range l.Runs {
		b, err := m.fileSlice(r)
		if err != nil {
			return err
		}
		if err := mapFixed(b, int(l.File.Fd()), r.Off); err != nil {
			return fmt.Errorf("mmap %d bytes at %d of %s: %w", r.Len, r.Off, l.File.Name(), err)
		}
	}
	return nil
}

// fileSlice is the guest memory that the run r of a memory file holds
// (WriteFile's layout: the regions one after another).
func (m *Memory) fileSlice(r Run) ([]byte, error) {
	var off int64
	for _, reg := range m.regions {
		n := int64(len(reg.Host))
		if r.Off >= off && r.End() <= off+n && r.Off <= r.End() {
			return reg.Host[r.Off-off : r.End()-off], nil
		}
		off += n
	}
	return nil, fmt.Errorf("%w: %d bytes at %d of the memory file", ErrOutOfRange, r.Len, r.Off)
}

// Delta compares the memory with base, the memory file of the snapshot
// beneath (LayersReader's, for a chain), page by page, and returns the
// runs of the pages that differ, at most limit of them (at least 2): past
// that, runs closest to each other are joined, the pages between them
// (equal in both) taken along. The memory must not change meanwhile (a
// paused VM).
//
// base is read, not mapped: a read fault on a hole of a file on tmpfs
// puts a page into the file, so comparing through a mapping would fill
// every hole of a snapshot on tmpfs (measured: a 256 MiB snapshot of
// 55 MiB grew to 256 MiB); a read of a hole allocates nothing anywhere.
//
// Why compare, not track writes (KVM's dirty log): the comparison is
// exact whatever wrote the page (the guest, a device emulated here, a
// balloon's discard) and whatever the memory's history (booted, restored
// from base or from elsewhere), costs the guest nothing while it runs,
// and reads no more than the full snapshot it replaces already read.
func (m *Memory) Delta(base io.ReaderAt, limit int) ([]Run, error) {
	if limit < 2 {
		return nil, fmt.Errorf("delta of guest memory: at most %d runs", limit)
	}
	var l runList
	var off int64
	buf := make([]byte, 1<<20)
	var o []byte // base's bytes from obase on
	var obase int64
	for _, r := range m.regions {
		b := r.Host
		l.region()
		for i := 0; i < len(b); i += pageSize {
			at := off + int64(i)
			if at >= obase+int64(len(o)) {
				n := min(len(buf), len(b)-i)
				if _, err := base.ReadAt(buf[:n], at); err != nil {
					return nil, fmt.Errorf("delta of guest memory: read the memory beneath at %d: %w", at, err)
				}
				o, obase = buf[:n], at
			}
			if !bytes.Equal(b[i:i+pageSize], o[at-obase:at-obase+pageSize]) {
				l.add(at)
			}
		}
		off += int64(len(b))
	}
	return joinRuns(l.runs, l.split, limit), nil
}

// runList gathers pages into runs, region by region.
type runList struct {
	runs  []Run
	split []bool // split[i]: runs[i] and runs[i+1] lie in different regions
	first bool   // no page of the current region added yet
}

// region starts the next region: its pages never join the last run.
func (l *runList) region() { l.first = true }

// add adds the page at off, which lies after every page added before.
func (l *runList) add(off int64) {
	if n := len(l.runs); !l.first && l.runs[n-1].End() == off {
		l.runs[n-1].Len += pageSize
		return
	}
	if len(l.runs) > 0 {
		l.split = append(l.split, l.first)
	}
	l.runs = append(l.runs, Run{Off: off, Len: pageSize})
	l.first = false
}

// joinRuns joins the runs separated by the smallest gaps (never two that
// split says lie in different regions) until at most limit are left.
func joinRuns(runs []Run, split []bool, limit int) []Run {
	extra := len(runs) - limit
	if extra <= 0 {
		return runs
	}
	gaps := make([]int, 0, len(runs)-1) // indexes i of the gaps after runs[i]
	for i := range len(runs) - 1 {
		if !split[i] {
			gaps = append(gaps, i)
		}
	}
	gap := func(i int) int64 { return runs[i+1].Off - runs[i].End() }
	slices.SortStableFunc(gaps, func(a, b int) int { return cmp.Compare(gap(a), gap(b)) })
	join := make([]bool, len(runs))
	for _, i := range gaps[:min(extra, len(gaps))] {
		join[i] = true
	}
	out := runs[:0:0]
	for i, r := range runs {
		if i > 0 && join[i-1] {
			out[len(out)-1].Len = r.End() - out[len(out)-1].Off
			continue
		}
		out = append(out, r)
	}
	return out
}

// LayersReader reads the memory file that MapLayers(base, size, layers)
// would map: each byte from the last layer whose runs hold it, else from
// base. The layers' runs must be checked (CheckRuns) and base and every
// layer's file at least as long as what is read.
func LayersReader(base *os.File, layers []Layer) io.ReaderAt {
	return layersReader{base, layers}
}

type layersReader struct {
	base   *os.File
	layers []Layer
}

func (l layersReader) ReadAt(p []byte, off int64) (int, error) {
	done := 0
	for done < len(p) {
		at := off + int64(done)
		src, n := l.base, int64(len(p)-done)
		// The last layer holding at gives it; the next start of a run of
		// any layer above the one found ends the stretch read from it.
		for i := len(l.layers) - 1; i >= 0; i-- {
			runs := l.layers[i].Runs
			j, _ := slices.BinarySearchFunc(runs, at, func(r Run, at int64) int { return cmp.Compare(r.End(), at+1) })
			if j < len(runs) && runs[j].Off <= at {
				src, n = l.layers[i].File, min(n, runs[j].End()-at)
				break
			}
			if j < len(runs) {
				n = min(n, runs[j].Off-at)
			}
		}
		k, err := readSparse(src, p[done:done+int(n)], at)
		done += k
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// readSparse is f.ReadAt(q, off), but the holes of f (SEEK_DATA,
// SEEK_HOLE) are zeroed here, not read: most of a snapshot's memory file
// is holes, and reading one costs the kernel a lookup per page. Where
// the file system cannot say, everything is read.
func readSparse(f *os.File, q []byte, off int64) (int, error) {
	fd, done := int(f.Fd()), 0
	for done < len(q) {
		at := off + int64(done)
		data, err := unix.Seek(fd, at, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) { // nothing but a hole up to the end
			clear(q[done:])
			return len(q), nil
		}
		if err != nil {
			k, err := f.ReadAt(q[done:], at)
			return done + k, err
		}
		if data > at {
			z := int(min(data-at, int64(len(q)-done)))
			clear(q[done : done+z])
			done += z
			continue
		}
		end := int64(len(q) - done)
		if hole, err := unix.Seek(fd, at, unix.SEEK_HOLE); err == nil && hole > at {
			end = min(end, hole-at)
		}
		k, err := f.ReadAt(q[done:done+int(end)], at)
		done += k
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// WriteRuns writes the pages of runs to f, at their offsets, as a layer
// for MapLayers: f is truncated to Size first, and all-zero pages are
// left as holes (which read as zero too). If sum is not nil, HashRuns's
// bytes go to it; if written is not nil, it is told how far the write
// has come.
func (m *Memory) WriteRuns(f *os.File, runs []Run, sum io.Writer, written Written) error {
	if err := CheckRuns(runs, m.size, len(runs)); err != nil {
		return fmt.Errorf("write guest memory: %w", err)
	}
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("write guest memory: %w", err)
	}
	if err := f.Truncate(int64(m.size)); err != nil {
		return fmt.Errorf("write guest memory: %w", err)
	}
	var last int64
	err := m.runData(runs, func(off int64, run []byte) error {
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

// HashRuns is Hash restricted to the pages inside runs: of a memory
// mapped from a layer's file alone, the layer's checksum.
func (m *Memory) HashRuns(w io.Writer, runs []Run) error {
	if err := CheckRuns(runs, m.size, len(runs)); err != nil {
		return fmt.Errorf("hash guest memory: %w", err)
	}
	return m.runData(runs, func(off int64, run []byte) error { return hashRun(w, off, run) })
}

// runData calls fn with each stretch of pages inside runs that are not
// all zero, with its offset in the memory file.
func (m *Memory) runData(runs []Run, fn func(off int64, run []byte) error) error {
	for _, r := range runs {
		b, err := m.fileSlice(r)
		if err != nil {
			return err
		}
		if err := nonZero(b, r.Off, fn); err != nil {
			return err
		}
	}
	return nil
}

// Remap maps the memory again from base, a memory file holding exactly
// what it holds now (WriteFile's, just written), private and
// copy-on-write, as Map would have: the pages it held go back to the
// host, and from here on Dirty tells the pages written since. The memory
// must not change meanwhile (a paused VM; KVM follows the new mapping
// through its MMU notifier, as it follows any change of the host's page
// tables). On an error, a region may be left unmapped: the memory is
// then lost, and the caller must stop using it.
func (m *Memory) Remap(base *os.File) error {
	fi, err := base.Stat()
	if err != nil {
		return fmt.Errorf("remap guest memory: %w", err)
	}
	if !m.mapped || !fi.Mode().IsRegular() || uint64(fi.Size()) != m.size {
		return fmt.Errorf("remap guest memory from %s: %d bytes (%v), want a regular file of %d, over memory this package mapped", base.Name(), fi.Size(), fi.Mode().Type(), m.size)
	}
	var off int64
	for _, r := range m.regions {
		if err := mapFixed(r.Host, int(base.Fd()), off); err != nil {
			return fmt.Errorf("remap guest memory at %#x from %s: %w", r.GPA, base.Name(), err)
		}
		off += int64(len(r.Host))
	}
	m.backed = true
	return nil
}

// Dirty returns the runs of the pages written since the memory was last
// mapped from its files (Map, MapLayers, Remap), at most
// limit of them (at least 2; joined across the smallest gaps as Delta
// joins them): the pages that a private file mapping holds as its own
// copies, present or swapped out, which /proc/self/pagemap tells without
// reading a page (none: an empty slice, never nil). Memory mapped any
// other way fails: it has no files to differ from.
func (m *Memory) Dirty(limit int) ([]Run, error) {
	if !m.backed {
		return nil, errors.New("dirty pages of guest memory: the memory is not mapped from files")
	}
	if limit < 2 {
		return nil, fmt.Errorf("dirty pages of guest memory: at most %d runs", limit)
	}
	var l runList
	err := m.scanPagemap(l.region, func(off int64, e uint64) {
		// pmFile: a page of the file (or shared), not a copy of this
		// process's own.
		if e&pmPresent != 0 && e&pmFile == 0 || e&pmSwapped != 0 {
			l.add(off)
		}
	})
	if err != nil {
		return nil, fmt.Errorf("dirty pages of guest memory: %w", err)
	}
	if l.runs == nil {
		return []Run{}, nil // none written: known, unlike a nil
	}
	return joinRuns(l.runs, l.split, limit), nil
}
