package virtioballoon

import (
	"encoding/binary"
	"sync/atomic"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

// memSize is the test guest's RAM: the rings and buffers the driver
// allocates lie in its first MiB, the pages it gives back above.
const memSize = 16 << 20

// guest is a balloon driver with its three queues in memory that
// guestmem.New mapped, so that a discard really gives pages back.
type guest struct {
	t      testing.TB
	dev    *Device
	mem    *guestmem.Memory
	qs     []*virtiotest.Queue
	irqs   atomic.Int32
	failed atomic.Pointer[error]
}

func newGuest(t testing.TB, features uint64) *guest {
	t.Helper()
	mem, err := guestmem.New(memSize)
	if err != nil {
		t.Fatal(err)
	}
	dev := New(nil)
	t.Cleanup(func() {
		dev.Close()
		mem.Close()
	})
	g := &guest{t: t, dev: dev, mem: mem}
	// Make the rings' pages resident now, so that posting a chain later
	// does not change what the host holds.
	g.fill(0, 2<<20, 0)
	drv := virtiotest.NewDriverOn(mem)
	var qs []*virtio.Queue
	for i := range 3 {
		if i == queueReporting && features&FeatureReporting == 0 {
			qs = append(qs, nil)
			continue
		}
		q := drv.NewQueue(queueSize)
		g.qs = append(g.qs, q)
		qs = append(qs, q.Device())
	}
	err = dev.Activate(virtio.Activation{
		Mem: mem, Queues: qs, Features: features | virtio.FeatureVersion1,
		Interrupt: func() { g.irqs.Add(1) },
		Fail:      func(err error) { g.failed.Store(&err) },
	})
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// post makes a chain available on queue i and waits for the device to
// return it.
func (g *guest) post(i int, bufs []virtiotest.Buffer) virtiotest.Used {
	g.t.Helper()
	if _, err := g.qs[i].AddBuffers(bufs); err != nil {
		g.t.Fatal(err)
	}
	g.dev.Notify(i)
	used := g.qs[i].WaitUsed(1, 5*time.Second)
	if p := g.failed.Load(); p != nil {
		g.t.Fatalf("device failed: %v", *p)
	}
	if len(used) != 1 {
		g.t.Fatalf("device returned %d chains on queue %d, want 1", len(used), i)
	}
	return used[0]
}

// fill writes a byte into every page of [gpa, gpa+n).
func (g *guest) fill(gpa, n uint64, v byte) {
	g.t.Helper()
	for a := gpa; a < gpa+n; a += pageSize {
		if err := g.mem.PutUint8(a+17, v); err != nil {
			g.t.Fatal(err)
		}
	}
}

func (g *guest) resident() uint64 {
	g.t.Helper()
	n, err := g.mem.Resident()
	if err != nil {
		g.t.Fatal(err)
	}
	return n
}

func (g *guest) byteAt(gpa uint64) byte {
	v, err := g.mem.Uint8(gpa)
	if err != nil {
		g.t.Fatal(err)
	}
	return v
}

// TestReportingGivesPagesBack: two 2 MiB blocks reported free leave the
// host's resident memory, read as zero after, and are counted; a page
// next to them keeps its content; the driver gets its chain back with
// nothing written, and an interrupt.
func TestReportingGivesPagesBack(t *testing.T) {
	g := newGuest(t, FeatureReporting)
	g.fill(4<<20, 6<<20, 0xaa)
	before := g.resident()
	u := g.post(queueReporting, []virtiotest.Buffer{
		{Addr: 4 << 20, Len: 2 << 20, Write: true},
		{Addr: 8 << 20, Len: 2 << 20, Write: true},
	})
	if u.Len != 0 {
		t.Errorf("the device wrote %d bytes into reported pages, want 0", u.Len)
	}
	if after := g.resident(); after+4<<20 > before {
		t.Errorf("resident %d bytes before the report, %d after; want 4 MiB less", before, after)
	}
	for _, c := range []struct {
		gpa  uint64
		want byte
	}{{4<<20 + 17, 0}, {6<<20 - pageSize + 17, 0}, {6<<20 + 17, 0xaa}, {8<<20 + 17, 0}, {10<<20 - pageSize + 17, 0}} {
		if v := g.byteAt(c.gpa); v != c.want {
			t.Errorf("byte at %#x = %#x, want %#x", c.gpa, v, c.want)
		}
	}
	if st := g.dev.Stats(); st.Reported != 4<<20 || st.Errors != 0 {
		t.Errorf("Stats() = %+v, want 4 MiB reported and no errors", st)
	}
	if g.irqs.Load() == 0 {
		t.Error("no interrupt for the returned chain")
	}
}

// TestInflateAndDeflate: page frames in the inflate queue are given back
// and counted, one outside the guest's RAM is skipped and counted as an
// error, and deflate only counts.
func TestInflateAndDeflate(t *testing.T) {
	g := newGuest(t, FeatureReporting)
	g.fill(2<<20, 3*pageSize, 0x55)
	pfns := func(frames ...uint32) []byte {
		b := make([]byte, 4*len(frames))
		for i, f := range frames {
			binary.LittleEndian.PutUint32(b[4*i:], f)
		}
		return b
	}
	frames := pfns(2<<20>>pageShift, 2<<20>>pageShift+2, memSize>>pageShift+5)
	addr := uint64(1 << 20)
	if err := g.mem.WriteAt(frames, addr); err != nil {
		t.Fatal(err)
	}
	g.post(queueInflate, []virtiotest.Buffer{{Addr: addr, Len: uint32(len(frames))}})
	if v0, v1, v2 := g.byteAt(2<<20+17), g.byteAt(2<<20+pageSize+17), g.byteAt(2<<20+2*pageSize+17); v0 != 0 || v1 != 0x55 || v2 != 0 {
		t.Errorf("after inflating pages 0 and 2: bytes %#x %#x %#x, want 0 0x55 0", v0, v1, v2)
	}
	if st := g.dev.Stats(); st.Inflated != 2 || st.Errors != 1 {
		t.Errorf("Stats() after inflate = %+v, want 2 inflated, 1 error", st)
	}
	g.post(queueDeflate, []virtiotest.Buffer{{Addr: addr, Len: 8}})
	if st := g.dev.Stats(); st.Deflated != 2 {
		t.Errorf("Stats() after deflate = %+v, want 2 deflated", st)
	}
	g.dev.WriteConfig(cfgActual, []byte{2, 0, 0, 0})
	var cfg [cfgLen]byte
	g.dev.ReadConfig(0, cfg[:])
	if n, actual := binary.LittleEndian.Uint32(cfg[cfgNumPages:]), binary.LittleEndian.Uint32(cfg[cfgActual:]); n != 0 || actual != 2 {
		t.Errorf("config num_pages %d actual %d, want 0 and 2", n, actual)
	}
}

// TestActivateChecksQueues: reporting accepted needs its queue, and a
// third queue needs reporting.
func TestActivateChecksQueues(t *testing.T) {
	drv := virtiotest.NewDriver(1 << 20)
	q := func() *virtio.Queue { return drv.NewQueue(8).Device() }
	for _, c := range []struct {
		name     string
		features uint64
		queues   []*virtio.Queue
	}{
		{"reporting without its queue", FeatureReporting, []*virtio.Queue{q(), q(), nil}},
		{"a third queue without reporting", 0, []*virtio.Queue{q(), q(), q()}},
		{"no deflate queue", 0, []*virtio.Queue{q(), nil, nil}},
		{"two queues", 0, []*virtio.Queue{q(), q()}},
	} {
		d := New(nil)
		if err := d.Activate(virtio.Activation{Mem: drv.Mem, Queues: c.queues, Features: c.features, Interrupt: func() {}, Fail: func(error) {}}); err == nil {
			t.Errorf("%s: Activate() = nil, want an error", c.name)
		}
		d.Close()
	}
}

// TestBrokenChainFailsTheDevice: a reported buffer outside guest memory
// breaks the queue (its check refuses the descriptor): the device marks
// itself broken and gives nothing back.
func TestBrokenChainFailsTheDevice(t *testing.T) {
	g := newGuest(t, FeatureReporting)
	if _, err := g.qs[queueReporting].AddBuffers([]virtiotest.Buffer{{Addr: memSize - pageSize, Len: 2 * pageSize, Write: true}}); err != nil {
		t.Fatal(err)
	}
	g.dev.Notify(queueReporting)
	deadline := time.Now().Add(5 * time.Second)
	for g.failed.Load() == nil && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if g.failed.Load() == nil {
		t.Fatal("a descriptor past guest memory did not fail the device")
	}
	if st := g.dev.Stats(); st.Reported != 0 {
		t.Errorf("Stats() = %+v, want nothing reported", st)
	}
}
