package virtioblk

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

// guest is a guest driver with the request queue in test memory.
type guest struct {
	t      *testing.T
	dev    *Device
	path   string
	drv    *virtiotest.Driver
	q      *virtiotest.Queue
	irqs   atomic.Int32
	failed atomic.Pointer[error]
}

// newDisk makes a disk file of size bytes holding a pattern.
func newDisk(t *testing.T, size int) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk.img")
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i / SectorSize)
	}
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func newGuest(t *testing.T, path string, opts Options) *guest {
	t.Helper()
	f, err := Open(path, opts.ReadOnly)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := New(f, opts, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	g := &guest{t: t, dev: dev, path: path}
	g.activate(dev.Features())
	return g
}

func (g *guest) activate(features uint64) {
	g.t.Helper()
	g.drv = virtiotest.NewDriver(4 << 20)
	g.q = g.drv.NewQueue(queueSize)
	err := g.dev.Activate(virtio.Activation{
		Mem: g.drv.Mem, Queues: []*virtio.Queue{g.q.Device()},
		Features:  features | virtio.FeatureVersion1,
		Interrupt: func() { g.irqs.Add(1) },
		Fail:      func(err error) { g.failed.Store(&err) },
	})
	if err != nil {
		g.t.Fatal(err)
	}
}

func header(typ uint32, sector uint64) []byte {
	h := make([]byte, hdrLen)
	binary.LittleEndian.PutUint32(h, typ)
	binary.LittleEndian.PutUint64(h[8:], sector)
	return h
}

// do posts one chain, waits for it and returns what the device wrote.
func (g *guest) do(outs [][]byte, ins []int) virtiotest.Used {
	g.t.Helper()
	if _, err := g.q.AddChain(outs, ins); err != nil {
		g.t.Fatal(err)
	}
	g.dev.Notify(0)
	used := g.q.WaitUsed(1, 5*time.Second)
	if len(used) != 1 {
		g.t.Fatalf("device returned %d chains, want 1", len(used))
	}
	if p := g.failed.Load(); p != nil {
		g.t.Fatalf("device failed: %v", *p)
	}
	return used[0]
}

// status returns a request's status byte, checking it is the last byte
// the device wrote.
func (g *guest) status(u virtiotest.Used, want int) byte {
	g.t.Helper()
	if int(u.Len) != want || len(u.Written) != want {
		g.t.Fatalf("device wrote %d bytes (%d seen), want %d", u.Len, len(u.Written), want)
	}
	return u.Written[want-1]
}

// read reads n sectors at sector, its data split over two buffers.
func (g *guest) read(sector uint64, n int) (byte, []byte) {
	g.t.Helper()
	size := n * SectorSize
	u := g.do([][]byte{header(typeIn, sector)}, []int{size / 2, size - size/2, 1})
	return g.status(u, size+1), u.Written[:size]
}

// write writes data at sector, in buffers of SectorSize bytes after the
// header.
func (g *guest) write(sector uint64, data []byte) byte {
	g.t.Helper()
	outs := [][]byte{header(typeOut, sector)}
	for len(data) > 0 {
		k := min(len(data), SectorSize)
		outs = append(outs, data[:k])
		data = data[k:]
	}
	return g.status(g.do(outs, []int{1}), 1)
}

func TestReadWriteThroughTheRing(t *testing.T) {
	g := newGuest(t, newDisk(t, 64*SectorSize), Options{})
	st, data := g.read(3, 2)
	if st != statusOK || data[0] != 3 || data[SectorSize] != 4 {
		t.Fatalf("read(3, 2) = status %d, sectors starting %d and %d; want OK, 3 and 4", st, data[0], data[SectorSize])
	}
	payload := bytes.Repeat([]byte("capsa-blk"), 3*SectorSize/9+1)[:3*SectorSize]
	if st := g.write(10, payload); st != statusOK {
		t.Fatalf("write(10) = status %d, want OK", st)
	}
	if st, data := g.read(10, 3); st != statusOK || !bytes.Equal(data, payload) {
		t.Fatalf("read(10, 3) after write = status %d, data equal %v", st, bytes.Equal(data, payload))
	}
	file, _ := os.ReadFile(g.path)
	if !bytes.Equal(file[10*SectorSize:13*SectorSize], payload) {
		t.Error("the write did not reach the file")
	}
	if got := g.irqs.Load(); got == 0 {
		t.Error("no interrupt for served requests")
	}
	if s := g.dev.Stats(); s.Reads != 2 || s.Writes != 1 || s.WriteBytes != 3*SectorSize || s.Errors != 0 {
		t.Errorf("Stats() = %+v, want 2 reads, 1 write of %d bytes, no errors", s, 3*SectorSize)
	}
}

func TestHeaderAndDataInOneBuffer(t *testing.T) {
	// Chains may frame the request any way: header and data in one
	// readable buffer, data and status in one writable buffer.
	g := newGuest(t, newDisk(t, 16*SectorSize), Options{})
	data := bytes.Repeat([]byte{0xab}, SectorSize)
	u := g.do([][]byte{append(header(typeOut, 5), data...)}, []int{1})
	if st := g.status(u, 1); st != statusOK {
		t.Fatalf("write = status %d, want OK", st)
	}
	u = g.do([][]byte{header(typeIn, 5)}, []int{SectorSize + 1})
	if st := g.status(u, SectorSize+1); st != statusOK || !bytes.Equal(u.Written[:SectorSize], data) {
		t.Fatalf("read = status %d, data equal %v", st, bytes.Equal(u.Written[:SectorSize], data))
	}
}

func TestConfigSpace(t *testing.T) {
	g := newGuest(t, newDisk(t, 64*SectorSize+100), Options{ReadOnly: true})
	cfg := make([]byte, 16)
	g.dev.ReadConfig(0, cfg)
	if got := binary.LittleEndian.Uint64(cfg); got != 64 {
		t.Errorf("capacity = %d sectors, want 64 (a partial sector is not used)", got)
	}
	if got := binary.LittleEndian.Uint32(cfg[cfgSegMax:]); got != segMax {
		t.Errorf("seg_max = %d, want %d", got, segMax)
	}
	if f := g.dev.Features(); f&featureRO == 0 || f&featureDiscard != 0 {
		t.Errorf("Features() = %#x: want RO and no discard on a read-only disk", f)
	}
	tail := make([]byte, 8)
	g.dev.ReadConfig(cfgLen+100, tail)
	if !bytes.Equal(tail, make([]byte, 8)) {
		t.Errorf("config past its end reads % x, want zeros", tail)
	}
}

func TestReadOnlyRefusesWrites(t *testing.T) {
	path := newDisk(t, 16*SectorSize)
	before, _ := os.ReadFile(path)
	g := newGuest(t, path, Options{ReadOnly: true})
	if st := g.write(0, make([]byte, SectorSize)); st != statusIOErr {
		t.Errorf("write to a read-only disk = status %d, want IOERR", st)
	}
	zero := append(header(typeWriteZeroes, 0), make([]byte, discardSegLen)...)
	binary.LittleEndian.PutUint32(zero[hdrLen+8:], 4)
	if st := g.status(g.do([][]byte{zero}, []int{1}), 1); st != statusUnsupp {
		t.Errorf("write zeroes on a read-only disk = status %d, want UNSUPP", st)
	}
	if st, _ := g.read(0, 1); st != statusOK {
		t.Errorf("read after refused writes = status %d, want OK", st)
	}
	after, _ := os.ReadFile(path)
	if !bytes.Equal(before, after) {
		t.Error("a read-only disk's file changed")
	}
}

func TestBadRequestsFailAlone(t *testing.T) {
	g := newGuest(t, newDisk(t, 16*SectorSize), Options{})
	size := 16 * SectorSize
	for _, tc := range []struct {
		name string
		outs [][]byte
		ins  []int
		want byte
	}{
		{"read past the end", [][]byte{header(typeIn, 15)}, []int{2 * SectorSize, 1}, statusIOErr},
		{"read at a huge sector", [][]byte{header(typeIn, 1<<63)}, []int{SectorSize, 1}, statusIOErr},
		{"sector+count overflows", [][]byte{header(typeIn, ^uint64(0))}, []int{SectorSize, 1}, statusIOErr},
		{"partial sector read", [][]byte{header(typeIn, 0)}, []int{100, 1}, statusIOErr},
		{"partial sector write", [][]byte{header(typeOut, 0), make([]byte, 100)}, []int{1}, statusIOErr},
		{"write past the end", [][]byte{header(typeOut, 16), make([]byte, SectorSize)}, []int{1}, statusIOErr},
		{"short header", [][]byte{make([]byte, 8)}, []int{1}, statusIOErr},
		{"unknown type", [][]byte{header(99, 0)}, []int{1}, statusUnsupp},
		{"GET_ID into 4 bytes", [][]byte{header(typeGetID, 0)}, []int{5}, statusIOErr},
		{"discard of no range", [][]byte{header(typeDiscard, 0)}, []int{1}, statusIOErr},
		{"discard of a ragged payload", [][]byte{header(typeDiscard, 0), make([]byte, 10)}, []int{1}, statusIOErr},
		{"discard of too many ranges", [][]byte{header(typeDiscard, 0), make([]byte, (maxDiscardSegs+1)*discardSegLen)}, []int{1}, statusIOErr},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := g.do(tc.outs, tc.ins)
			want := 0
			for _, n := range tc.ins {
				want += n
			}
			if st := g.status(u, want); st != tc.want {
				t.Errorf("status = %d, want %d", st, tc.want)
			}
			if st, _ := g.read(0, 1); st != statusOK {
				t.Errorf("the next read = status %d, want OK", st)
			}
		})
	}
	if fi, _ := os.Stat(g.path); fi.Size() != int64(size) {
		t.Errorf("disk file is %d bytes after bad requests, want %d", fi.Size(), size)
	}
	if g.dev.Stats().Errors == 0 {
		t.Error("Stats().Errors = 0 after bad requests")
	}
}

func TestChainWithoutStatusByte(t *testing.T) {
	g := newGuest(t, newDisk(t, 16*SectorSize), Options{})
	u := g.do([][]byte{header(typeIn, 0)}, nil)
	if u.Len != 0 {
		t.Errorf("chain without a writable byte came back with %d bytes written", u.Len)
	}
	if st, _ := g.read(1, 1); st != statusOK {
		t.Errorf("the next read = status %d, want OK", st)
	}
}

func TestFlushAndID(t *testing.T) {
	g := newGuest(t, newDisk(t, 16*SectorSize), Options{ID: "capsa-root"})
	if st := g.status(g.do([][]byte{header(typeFlush, 0)}, []int{1}), 1); st != statusOK {
		t.Errorf("flush = status %d, want OK", st)
	}
	u := g.do([][]byte{header(typeGetID, 0)}, []int{idLen, 1})
	if st := g.status(u, idLen+1); st != statusOK {
		t.Fatalf("GET_ID = status %d, want OK", st)
	}
	if got := strings.TrimRight(string(u.Written[:idLen]), "\x00"); got != "capsa-root" {
		t.Errorf("GET_ID = %q, want capsa-root", got)
	}
	if _, err := New(nil, Options{}, nil); err == nil {
		t.Error("New(nil file) succeeded")
	}
	f, _ := os.Open(g.path)
	defer f.Close()
	if _, err := New(f, Options{ID: strings.Repeat("x", 21)}, nil); err == nil {
		t.Error("New with a 21-byte ID succeeded")
	}
}

func TestDiscardPunchesHoles(t *testing.T) {
	const sectors = 4096 // 2 MiB
	g := newGuest(t, newDisk(t, sectors*SectorSize), Options{})
	var st unix.Stat_t
	unix.Stat(g.path, &st)
	before := st.Blocks
	req := header(typeDiscard, 0)
	seg := make([]byte, discardSegLen)
	binary.LittleEndian.PutUint64(seg, 0)
	binary.LittleEndian.PutUint32(seg[8:], sectors)
	if s := g.status(g.do([][]byte{req, seg}, []int{1}), 1); s != statusOK {
		t.Fatalf("discard = status %d, want OK", s)
	}
	unix.Stat(g.path, &st)
	if st.Blocks >= before {
		t.Skipf("the file system here does not punch holes (%d blocks before, %d after)", before, st.Blocks)
	}
	if s, data := g.read(100, 1); s != statusOK || !bytes.Equal(data, make([]byte, SectorSize)) {
		t.Errorf("read after discard = status %d, zeros %v", s, bytes.Equal(data, make([]byte, SectorSize)))
	}
	if fi, _ := os.Stat(g.path); fi.Size() != sectors*SectorSize {
		t.Errorf("discard changed the file size to %d", fi.Size())
	}
}

func TestBrokenRingFailsDevice(t *testing.T) {
	g := newGuest(t, newDisk(t, 16*SectorSize), Options{})
	// Publish an available index far ahead of what the driver added.
	g.drv.Mem.StoreUint16(g.q.Avail+2, 1000)
	g.dev.Notify(0)
	deadline := time.Now().Add(5 * time.Second)
	for g.failed.Load() == nil && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if g.failed.Load() == nil {
		t.Fatal("a broken ring did not fail the device")
	}
	// A reset and a new activation serve again.
	g.dev.Reset()
	g.failed.Store(nil)
	g.activate(g.dev.Features())
	if st, _ := g.read(0, 1); st != statusOK {
		t.Errorf("read after reset = status %d, want OK", st)
	}
}

func TestOpenLocksTheDisk(t *testing.T) {
	path := newDisk(t, 16*SectorSize)
	rw, err := Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	if f, err := Open(path, false); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("second writable Open = %v, want an in-use error", err)
		if f != nil {
			f.Close()
		}
	}
	if f, err := Open(path, true); err == nil {
		t.Error("read-only Open of a disk open for writing succeeded")
		f.Close()
	}
	rw.Close()
	a, err := Open(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Open(path, true)
	if err != nil {
		t.Errorf("two read-only opens: %v", err)
	} else {
		b.Close()
	}
	if _, err := Open(t.TempDir(), true); err == nil {
		t.Error("Open of a directory succeeded")
	}
	if _, err := Open(filepath.Join(t.TempDir(), "none"), true); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Open of a missing file = %v, want ErrNotExist", err)
	}
}

func TestCloseIsBoundedAndIdempotent(t *testing.T) {
	g := newGuest(t, newDisk(t, 16*SectorSize), Options{})
	done := make(chan error)
	go func() { done <- g.dev.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
	if err := g.dev.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
	if err := g.dev.Activate(virtio.Activation{Queues: []*virtio.Queue{g.q.Device()}}); err == nil {
		t.Error("Activate after Close succeeded")
	}
}
