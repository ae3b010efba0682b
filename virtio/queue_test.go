package virtio

import (
	"bytes"
	"errors"
	"io"
	"slices"
	"testing"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// driver plays the guest's side of a split queue in test memory.
type driver struct {
	t                 testing.TB
	mem               *guestmem.Memory
	size              uint16
	desc, avail, used uint64
	availIdx          uint16
}

type buf struct {
	addr  uint64
	len   uint32
	write bool
}

const (
	testDesc  = 0x1000
	testAvail = 0x2000
	testUsed  = 0x3000
	testData  = 0x10000
)

func newDriver(t testing.TB, size uint16) (*driver, *Queue) {
	mem, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: make([]byte, 1<<20)})
	if err != nil {
		t.Fatal(err)
	}
	d := &driver{t: t, mem: mem, size: size, desc: testDesc, avail: testAvail, used: testUsed}
	q, err := NewQueue(mem, size, testDesc, testAvail, testUsed)
	if err != nil {
		t.Fatal(err)
	}
	return d, q
}

// setDesc writes descriptor i.
func (d *driver) setDesc(i uint16, addr uint64, length uint32, flags, next uint16) {
	base := d.desc + uint64(i)*16
	d.mem.PutUint64(base, addr)
	d.mem.PutUint32(base+8, length)
	d.mem.PutUint16(base+12, flags)
	d.mem.PutUint16(base+14, next)
}

// publish puts head on the available ring.
func (d *driver) publish(head uint16) {
	d.mem.PutUint16(d.avail+4+2*uint64(d.availIdx%d.size), head)
	d.availIdx++
	d.mem.StoreUint16(d.avail+2, d.availIdx)
}

// add chains bufs from descriptor first on and publishes the chain.
func (d *driver) add(first uint16, bufs ...buf) {
	for i, b := range bufs {
		var flags uint16
		if b.write {
			flags |= descFWrite
		}
		if i < len(bufs)-1 {
			flags |= descFNext
		}
		d.setDesc(first+uint16(i), b.addr, b.len, flags, first+uint16(i)+1)
	}
	d.publish(first)
}

func (d *driver) usedElem(i uint16) (id, length uint32) {
	e := d.used + 4 + 8*uint64(i%d.size)
	id, _ = d.mem.Uint32(e)
	length, _ = d.mem.Uint32(e + 4)
	return
}

func TestChainReadWrite(t *testing.T) {
	d, q := newDriver(t, 8)
	d.mem.WriteAt([]byte("hello, "), testData)
	d.mem.WriteAt([]byte("world"), testData+0x100)
	d.add(2, buf{testData, 7, false}, buf{testData + 0x100, 5, false}, buf{testData + 0x200, 4, true}, buf{testData + 0x300, 4, true})
	c, err := q.Next()
	if err != nil || c == nil {
		t.Fatalf("Next: %v, %v", c, err)
	}
	if c.Head != 2 || c.ReadableLen() != 12 || c.WritableLen() != 8 {
		t.Fatalf("chain head %d readable %d writable %d", c.Head, c.ReadableLen(), c.WritableLen())
	}
	got, _ := io.ReadAll(c)
	if string(got) != "hello, world" {
		t.Errorf("read %q", got)
	}
	if n, err := c.Write([]byte("abcdef")); n != 6 || err != nil {
		t.Errorf("Write = %d, %v", n, err)
	}
	if n, err := c.Write([]byte("ghi")); n != 2 || !errors.Is(err, io.ErrShortWrite) {
		t.Errorf("overflowing Write = %d, %v", n, err)
	}
	a, _ := d.mem.Slice(testData+0x200, 4)
	b, _ := d.mem.Slice(testData+0x300, 4)
	if string(a)+string(b) != "abcdefgh" {
		t.Errorf("written %q %q", a, b)
	}
	irq, err := q.Push(c)
	if err != nil || !irq {
		t.Fatalf("Push = %v, %v", irq, err)
	}
	if idx, _ := d.mem.Uint16(d.used + 2); idx != 1 {
		t.Errorf("used idx %d", idx)
	}
	if id, n := d.usedElem(0); id != 2 || n != 8 {
		t.Errorf("used elem id %d len %d", id, n)
	}
	if c, err := q.Next(); c != nil || err != nil {
		t.Errorf("empty queue: %v, %v", c, err)
	}
	// The driver can suppress interrupts.
	d.mem.PutUint16(d.avail, availFNoInterrupt)
	d.add(0, buf{testData, 1, false})
	c, _ = q.Next()
	if irq, err := q.Push(c); irq || err != nil {
		t.Errorf("Push with NO_INTERRUPT = %v, %v", irq, err)
	}
}

func TestRingWraps(t *testing.T) {
	d, q := newDriver(t, 4)
	for i := 0; i < 70000; i++ { // wraps the 16-bit indices
		d.add(uint16(i%4), buf{testData, 1, true})
		c, err := q.Next()
		if err != nil || c == nil || c.Head != uint16(i%4) {
			t.Fatalf("iteration %d: %v, %v", i, c, err)
		}
		c.Write([]byte{1})
		if _, err := q.Push(c); err != nil {
			t.Fatal(err)
		}
	}
}

func TestHostileChains(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(d *driver)
	}{
		{"loop", func(d *driver) {
			d.setDesc(0, testData, 1, descFNext, 1)
			d.setDesc(1, testData, 1, descFNext, 0)
			d.publish(0)
		}},
		{"self loop", func(d *driver) { d.setDesc(3, testData, 1, descFNext, 3); d.publish(3) }},
		{"next out of range", func(d *driver) { d.setDesc(0, testData, 1, descFNext, 200); d.publish(0) }},
		{"head out of range", func(d *driver) { d.publish(9) }},
		{"buffer outside memory", func(d *driver) { d.setDesc(0, 1<<40, 16, 0, 0); d.publish(0) }},
		{"buffer runs off the end", func(d *driver) { d.setDesc(0, 1<<20-8, 16, 0, 0); d.publish(0) }},
		{"address wraps", func(d *driver) { d.setDesc(0, ^uint64(0)-4, 16, 0, 0); d.publish(0) }},
		{"indirect", func(d *driver) { d.setDesc(0, testData, 16, descFIndirect, 0); d.publish(0) }},
		{"readable after writable", func(d *driver) {
			d.setDesc(0, testData, 1, descFWrite|descFNext, 1)
			d.setDesc(1, testData, 1, 0, 0)
			d.publish(0)
		}},
		{"avail index far ahead", func(d *driver) { d.mem.PutUint16(d.avail+2, 100) }},
	} {
		d, q := newDriver(t, 8)
		tc.setup(d)
		c, err := q.Next()
		if err == nil || !errors.Is(err, ErrQueue) {
			t.Errorf("%s: Next = %v, %v; want a queue error", tc.name, c, err)
		}
	}
}

// TestOversizedChain: 512 descriptors of nearly 1 MiB each, all pointing at
// the same guest memory, claim more than MaxChainBytes.
func TestOversizedChain(t *testing.T) {
	d, q := newDriver(t, 512)
	for i := uint16(0); i < 512; i++ {
		d.setDesc(i, 0, 1<<20-1, descFNext, i+1)
	}
	d.setDesc(511, 0, 1<<20-1, 0, 0)
	d.publish(0)
	if c, err := q.Next(); !errors.Is(err, ErrQueue) {
		t.Errorf("Next = %v, %v; want a queue error", c, err)
	}
}

func TestNewQueueValidates(t *testing.T) {
	mem, _ := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: make([]byte, 0x10000)})
	for _, tc := range []struct {
		size              uint16
		desc, avail, used uint64
	}{
		{0, testDesc, testAvail, testUsed},
		{3, testDesc, testAvail, testUsed},
		{8, testDesc + 8, testAvail, testUsed}, // misaligned
		{8, testDesc, testAvail + 1, testUsed}, // misaligned
		{8, testDesc, testAvail, testUsed + 2}, // misaligned
		{8, 0xfff0, testAvail, testUsed},       // table runs off memory
		{256, testDesc, testAvail, 0xfff0},     // used ring runs off memory
		{8, testDesc, 1 << 40, testUsed},       // outside memory
	} {
		if _, err := NewQueue(mem, tc.size, tc.desc, tc.avail, tc.used); err == nil {
			t.Errorf("NewQueue(%d, %#x, %#x, %#x) accepted", tc.size, tc.desc, tc.avail, tc.used)
		}
	}
}

// FuzzChain feeds arbitrary descriptor tables and rings to the queue: it
// must return chains whose buffers lie in guest memory, or errors, and
// never panic or loop.
func FuzzChain(f *testing.F) {
	f.Add(bytes.Repeat([]byte{0}, 16*8), []byte{0, 0, 1, 0, 0, 0}, uint16(8))
	f.Add([]byte{0, 0, 1, 0, 0, 0, 0, 0, 16, 0, 0, 0, 1, 0, 0, 0}, []byte{0, 0, 3, 0, 0, 0, 0, 0, 0, 0}, uint16(4))
	f.Fuzz(func(t *testing.T, table, avail []byte, size uint16) {
		size = 1 << (size % 9) // 1..256
		d, q := newDriver(t, size)
		d.mem.WriteAt(table[:min(len(table), 16*int(size))], testDesc)
		d.mem.WriteAt(avail[:min(len(avail), 6+2*int(size))], testAvail)
		for i := 0; i < 2*int(size)+2; i++ {
			c, err := q.Next()
			if err != nil || c == nil {
				return
			}
			if c.ReadableLen()+c.WritableLen() > MaxChainBytes {
				t.Fatalf("chain of %d bytes", c.ReadableLen()+c.WritableLen())
			}
			io.Copy(io.Discard, c)
			c.Write(make([]byte, 64))
			if _, err := q.Push(c); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// TestEventIdx: with VIRTIO_F_EVENT_IDX the device interrupts only when it
// uses the entry the driver named in used_event, and when it finds the ring
// empty it names in avail_event the entry it wants a notification for.
func TestEventIdx(t *testing.T) {
	d, q := newDriver(t, 8)
	q.SetEventIdx(true)
	usedEvent := func(v uint16) { d.mem.PutUint16(d.avail+4+2*uint64(d.size), v) }
	availEvent := func() uint16 { v, _ := d.mem.Uint16(d.used + 4 + 8*uint64(d.size)); return v }
	var irqs []bool
	usedEvent(2) // interrupt me once entry 2 is used
	for i := range uint16(4) {
		d.add(i, buf{testData + 0x100*uint64(i), 16, true})
		c, err := q.Next()
		if err != nil || c == nil {
			t.Fatalf("Next() = %v, %v", c, err)
		}
		irq, err := q.Push(c)
		if err != nil {
			t.Fatal(err)
		}
		irqs = append(irqs, irq)
	}
	if want := []bool{false, false, true, false}; !slices.Equal(irqs, want) {
		t.Errorf("Push interrupts %v, want %v (used_event 2)", irqs, want)
	}
	if c, err := q.Next(); c != nil || err != nil {
		t.Fatalf("Next() on an empty ring = %v, %v", c, err)
	}
	if got := availEvent(); got != 4 {
		t.Errorf("avail_event = %d after consuming 4 entries, want 4", got)
	}
	// Without the feature, the flags decide, and avail_event is left alone.
	d2, q2 := newDriver(t, 8)
	d2.mem.PutUint16(d2.used+4+8*uint64(d2.size), 77)
	d2.add(0, buf{testData, 16, true})
	c, _ := q2.Next()
	if irq, _ := q2.Push(c); !irq {
		t.Error("no interrupt without EVENT_IDX and without NO_INTERRUPT")
	}
	q2.Next()
	if v, _ := d2.mem.Uint16(d2.used + 4 + 8*uint64(d2.size)); v != 77 {
		t.Errorf("avail_event written without EVENT_IDX: %d", v)
	}
}
