// Package virtiotest plays the guest driver's side of virtqueues in test
// memory, so device tests exercise a device through real rings.
package virtiotest

import (
	"encoding/binary"
	"fmt"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/virtio"
)

// Driver owns test guest memory and allocates rings and buffers in it.
type Driver struct {
	Mem  *guestmem.Memory
	mu   sync.Mutex
	next uint64 // bump allocator
}

// NewDriver returns a driver with size bytes of guest memory at 0.
func NewDriver(size int) *Driver {
	mem, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: make([]byte, size)})
	if err != nil {
		panic(err)
	}
	return NewDriverOn(mem)
}

// NewDriverOn returns a driver allocating in mem (from 4 KiB up, mem's
// first region starting at 0), for tests that need memory guestmem.New
// mapped.
func NewDriverOn(mem *guestmem.Memory) *Driver {
	return &Driver{Mem: mem, next: 0x1000}
}

func (d *Driver) alloc(n, align uint64) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	a := (d.next + align - 1) &^ (align - 1)
	d.next = a + n
	if d.next > d.Mem.Size() {
		panic("virtiotest: out of guest memory")
	}
	return a
}

// Queue is the driver's side of one split queue.
type Queue struct {
	d                 *Driver
	Size              uint16
	Desc, Avail, Used uint64
	mu                sync.Mutex
	availIdx          uint16
	usedSeen          uint16
	free              []uint16
	chains            map[uint16]chain // by head
}

type chain struct {
	ids  []uint16
	bufs []buffer
}

type buffer struct {
	addr  uint64
	len   uint32
	write bool
}

// NewQueue allocates a queue's rings.
func (d *Driver) NewQueue(size uint16) *Queue {
	q := &Queue{d: d, Size: size, chains: map[uint16]chain{}}
	q.Desc = d.alloc(16*uint64(size), 16)
	q.Avail = d.alloc(6+2*uint64(size), 2)
	q.Used = d.alloc(6+8*uint64(size), 4)
	for i := range size {
		q.free = append(q.free, i)
	}
	return q
}

// Device returns the device's view of the queue.
func (q *Queue) Device() *virtio.Queue {
	vq, err := virtio.NewQueue(q.d.Mem, q.Size, q.Desc, q.Avail, q.Used)
	if err != nil {
		panic(err)
	}
	return vq
}

// Add makes a chain of one readable buffer holding out (if any) and one
// writable buffer of in bytes (if in > 0) available to the device.
func (q *Queue) Add(out []byte, in int) (uint16, error) {
	var outs [][]byte
	if len(out) > 0 {
		outs = append(outs, out)
	}
	var ins []int
	if in > 0 {
		ins = append(ins, in)
	}
	return q.AddChain(outs, ins)
}

// AddChain makes a chain available to the device: one readable buffer per
// element of outs, holding it, then one writable buffer of each size in
// ins. With neither, the chain is one empty readable descriptor, as a
// (hostile) driver may post.
func (q *Queue) AddChain(outs [][]byte, ins []int) (uint16, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	var bufs []buffer
	for _, out := range outs {
		a := q.d.alloc(uint64(max(len(out), 1)), 8)
		q.d.Mem.WriteAt(out, a)
		bufs = append(bufs, buffer{a, uint32(len(out)), false})
	}
	for _, in := range ins {
		bufs = append(bufs, buffer{q.d.alloc(uint64(max(in, 1)), 8), uint32(in), true})
	}
	if len(bufs) == 0 {
		bufs = append(bufs, buffer{q.d.alloc(8, 8), 0, false})
	}
	return q.postLocked(bufs)
}

// Buffer is one descriptor's buffer at an address the test chose.
type Buffer struct {
	Addr  uint64
	Len   uint32
	Write bool // device-writable
}

// AddBuffers makes a chain of bufs, as they are, available to the device:
// for buffers the test placed itself (pages a balloon driver gives up),
// or that lie outside memory.
func (q *Queue) AddBuffers(bufs []Buffer) (uint16, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	var bs []buffer
	for _, b := range bufs {
		bs = append(bs, buffer{b.Addr, b.Len, b.Write})
	}
	if len(bs) == 0 {
		return 0, fmt.Errorf("virtiotest: a chain of no buffers")
	}
	return q.postLocked(bs)
}

func (q *Queue) postLocked(bufs []buffer) (uint16, error) {
	if len(bufs) > len(q.free) {
		return 0, fmt.Errorf("virtiotest: queue full")
	}
	ids := append([]uint16(nil), q.free[:len(bufs)]...)
	q.free = q.free[len(bufs):]
	le := binary.LittleEndian
	for i, b := range bufs {
		var flags uint16
		if b.write {
			flags |= 2
		}
		var next uint16
		if i < len(bufs)-1 {
			flags |= 1
			next = ids[i+1]
		}
		e := make([]byte, 16)
		le.PutUint64(e, b.addr)
		le.PutUint32(e[8:], b.len)
		le.PutUint16(e[12:], flags)
		le.PutUint16(e[14:], next)
		q.d.Mem.WriteAt(e, q.Desc+16*uint64(ids[i]))
	}
	head := ids[0]
	q.chains[head] = chain{ids, bufs}
	q.d.Mem.PutUint16(q.Avail+4+2*uint64(q.availIdx%q.Size), head)
	q.availIdx++
	q.d.Mem.StoreUint16(q.Avail+2, q.availIdx) // publishes the chain
	return head, nil
}

// Used is a chain the device returned, with what it wrote.
type Used struct {
	Head    uint16
	Len     uint32
	Written []byte // the first Len bytes of the writable buffers
}

// TakeUsed returns the chains the device returned since the last call and
// frees their descriptors.
func (q *Queue) TakeUsed() []Used {
	q.mu.Lock()
	defer q.mu.Unlock()
	idx, _ := q.d.Mem.LoadUint16(q.Used + 2)
	var out []Used
	for ; q.usedSeen != idx; q.usedSeen++ {
		e := q.Used + 4 + 8*uint64(q.usedSeen%q.Size)
		id, _ := q.d.Mem.Uint32(e)
		n, _ := q.d.Mem.Uint32(e + 4)
		u := Used{Head: uint16(id), Len: n}
		ch := q.chains[uint16(id)]
		left := n
		for _, b := range ch.bufs {
			if b.write && left > 0 {
				data := make([]byte, min(left, b.len))
				q.d.Mem.ReadAt(data, b.addr)
				u.Written = append(u.Written, data...)
				left -= uint32(len(data))
			}
		}
		delete(q.chains, uint16(id))
		q.free = append(q.free, ch.ids...)
		out = append(out, u)
	}
	return out
}

// WaitUsed polls until the device has returned at least n chains.
func (q *Queue) WaitUsed(n int, timeout time.Duration) []Used {
	var all []Used
	deadline := time.Now().Add(timeout)
	for len(all) < n && time.Now().Before(deadline) {
		all = append(all, q.TakeUsed()...)
		if len(all) < n {
			time.Sleep(time.Millisecond)
		}
	}
	return all
}
