// Package virtio implements the device side of virtio 1.x: split
// virtqueues over guest memory, and the virtio-mmio transport (version 2).
//
// The queue knows nothing about the transport, and neither knows about KVM:
// the transport raises interrupts and receives notifications through
// callbacks that the vmm package connects to irqfd and ioeventfd.
//
// The guest is hostile. Every index, address and length read from a queue is
// checked; a malformed chain is an error for that queue, never a panic or an
// access outside guest memory.
package virtio

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// Descriptor flags (virtio 1.2 §2.7.5).
const (
	descFNext     = 1
	descFWrite    = 2
	descFIndirect = 4

	availFNoInterrupt = 1

	descSize = 16
	// MaxQueueSize is the largest split queue the spec allows.
	MaxQueueSize = 32768
	// MaxChainBytes bounds the buffers of one chain, whatever the guest
	// claims; no capsa device needs more.
	MaxChainBytes = 256 << 20
)

// ErrQueue is wrapped by every error caused by what the guest put in a queue.
var ErrQueue = errors.New("virtqueue")

func queueErr(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrQueue, fmt.Sprintf(format, a...))
}

// Queue is the device side of one split virtqueue. It is not safe for
// concurrent use: one goroutine of the device drives it.
type Queue struct {
	mem               *guestmem.Memory
	size              uint16
	desc, avail, used uint64
	nextAvail         uint16 // the next available ring entry to consume
	nextUsed          uint16 // the next used ring entry to fill
	eventIdx          bool   // VIRTIO_F_EVENT_IDX was negotiated

	gate *Gate // nil: never paused
	held int   // chains handed out and not yet pushed, under gate.mu
}

// FeatureEventIdx is VIRTIO_F_EVENT_IDX (virtio 1.2 §2.7.10): the driver
// says after which used entry it wants an interrupt (used_event, at the
// end of the available ring) and the device after which available entry
// it wants a notification (avail_event, at the end of the used ring),
// instead of the all-or-nothing flags. The transport offers it for every
// device; each notification and interrupt saved is a VM exit saved.
const FeatureEventIdx = 1 << 29

// SetEventIdx says whether the driver accepted FeatureEventIdx.
func (q *Queue) SetEventIdx(on bool) { q.eventIdx = on }

// NewQueue checks a queue's layout as the driver configured it: a power of
// two size, each ring aligned and wholly inside guest memory.
func NewQueue(mem *guestmem.Memory, size uint16, desc, avail, used uint64) (*Queue, error) {
	if size == 0 || size&(size-1) != 0 || size > MaxQueueSize {
		return nil, queueErr("size %d is not a power of two up to %d", size, MaxQueueSize)
	}
	n := uint64(size)
	for _, r := range []struct {
		name      string
		addr, len uint64
		align     uint64
	}{
		{"descriptor table", desc, descSize * n, 16},
		{"available ring", avail, 6 + 2*n, 2},
		{"used ring", used, 6 + 8*n, 4},
	} {
		if r.addr%r.align != 0 {
			return nil, queueErr("%s at %#x is not %d-byte aligned", r.name, r.addr, r.align)
		}
		if !mem.Contains(r.addr, r.len) {
			return nil, queueErr("%s at %#x+%d is outside guest memory", r.name, r.addr, r.len)
		}
	}
	return &Queue{mem: mem, size: size, desc: desc, avail: avail, used: used}, nil
}

// Size is the number of descriptors.
func (q *Queue) Size() uint16 { return q.size }

// Chain is one descriptor chain popped from the available ring: the
// driver's readable buffers, then its writable ones, all checked to lie in
// guest memory. Read consumes the readable buffers in order; Write fills
// the writable ones.
type Chain struct {
	Head     uint16
	readable [][]byte
	writable [][]byte
	rIdx     int // position in readable
	rOff     int
	wIdx     int
	wOff     int
	written  uint32
}

// Next pops the next available chain, or returns nil when the ring is
// empty or the queue's gate is closed. An error means the queue is broken
// and must not be used further.
func (q *Queue) Next() (*Chain, error) {
	if q.gate != nil {
		return q.gate.next(q)
	}
	return q.next()
}

// WatchAvail returns the driver's available index without taking any
// entry, and with VIRTIO_F_EVENT_IDX asks the driver to notify the device
// when it adds the next entry.
func (q *Queue) WatchAvail() (uint16, error) {
	idx, err := q.mem.LoadUint16(q.avail + 2)
	if err != nil {
		return 0, queueErr("available index: %v", err)
	}
	if q.eventIdx {
		if err := q.mem.StoreUint16(q.used+4+8*uint64(q.size), idx); err != nil {
			return 0, queueErr("available event: %v", err)
		}
		if idx, err = q.mem.LoadUint16(q.avail + 2); err != nil {
			return 0, queueErr("available index: %v", err)
		}
	}
	return idx, nil
}

func (q *Queue) next() (*Chain, error) {
	// The atomic load orders the reads of the entry it published after it.
	idx, err := q.mem.LoadUint16(q.avail + 2)
	if err != nil {
		return nil, queueErr("available index: %v", err)
	}
	pending := idx - q.nextAvail
	if pending == 0 && q.eventIdx {
		// Ask for a notification when the driver adds the next entry,
		// then look once more: the atomic store orders it before the
		// load, so an entry added meanwhile is either seen here or
		// notified.
		if err := q.mem.StoreUint16(q.used+4+8*uint64(q.size), q.nextAvail); err != nil {
			return nil, queueErr("available event: %v", err)
		}
		if idx, err = q.mem.LoadUint16(q.avail + 2); err != nil {
			return nil, queueErr("available index: %v", err)
		}
		pending = idx - q.nextAvail
	}
	if pending == 0 {
		return nil, nil
	}
	if pending > q.size {
		return nil, queueErr("available index %d is %d ahead of %d, more than the queue size %d", idx, pending, q.nextAvail, q.size)
	}
	head, err := q.mem.Uint16(q.avail + 4 + 2*uint64(q.nextAvail%q.size))
	if err != nil {
		return nil, queueErr("available ring: %v", err)
	}
	q.nextAvail++
	return q.chain(head)
}

// chain walks and checks the descriptors starting at head.
func (q *Queue) chain(head uint16) (*Chain, error) {
	c := &Chain{Head: head}
	var total uint64
	i := head
	for n := 0; ; n++ {
		if i >= q.size {
			return nil, queueErr("descriptor index %d out of range (queue size %d)", i, q.size)
		}
		if n >= int(q.size) {
			return nil, queueErr("descriptor chain from %d is longer than the queue: a loop", head)
		}
		d, err := q.mem.Slice(q.desc+uint64(i)*descSize, descSize)
		if err != nil {
			return nil, queueErr("descriptor %d: %v", i, err)
		}
		le := binary.LittleEndian
		addr, length := le.Uint64(d[0:]), le.Uint32(d[8:])
		flags, next := le.Uint16(d[12:]), le.Uint16(d[14:])
		if flags&descFIndirect != 0 {
			return nil, queueErr("descriptor %d is indirect, a feature not offered", i)
		}
		total += uint64(length)
		if total > MaxChainBytes {
			return nil, queueErr("descriptor chain from %d holds more than %d bytes", head, MaxChainBytes)
		}
		buf, err := q.mem.Slice(addr, uint64(length))
		if err != nil {
			return nil, queueErr("descriptor %d buffer %#x+%d: %v", i, addr, length, err)
		}
		if flags&descFWrite != 0 {
			c.writable = append(c.writable, buf)
		} else {
			if len(c.writable) > 0 {
				return nil, queueErr("descriptor %d is readable after a writable one", i)
			}
			c.readable = append(c.readable, buf)
		}
		if flags&descFNext == 0 {
			return c, nil
		}
		i = next
	}
}

// Push returns a chain to the driver through the used ring, recording how
// many bytes the device wrote, and reports whether the driver wants an
// interrupt for it.
func (q *Queue) Push(c *Chain) (bool, error) {
	elem := q.used + 4 + 8*uint64(q.nextUsed%q.size)
	if err := q.mem.PutUint32(elem, uint32(c.Head)); err != nil {
		return false, queueErr("used ring: %v", err)
	}
	if err := q.mem.PutUint32(elem+4, c.written); err != nil {
		return false, queueErr("used ring: %v", err)
	}
	q.nextUsed++
	// The atomic store publishes the element written before it, and is a
	// full barrier before the read of the driver's flags or event.
	if err := q.mem.StoreUint16(q.used+2, q.nextUsed); err != nil {
		return false, queueErr("used index: %v", err)
	}
	if q.gate != nil {
		q.gate.returned(q)
	}
	if q.eventIdx {
		// The driver wants an interrupt once the entry at used_event
		// is used: this one (vring_need_event for a single entry).
		event, err := q.mem.LoadUint16(q.avail + 4 + 2*uint64(q.size))
		if err != nil {
			return false, queueErr("used event: %v", err)
		}
		return event == q.nextUsed-1, nil
	}
	flags, err := q.mem.LoadUint16(q.avail)
	if err != nil {
		return false, queueErr("available flags: %v", err)
	}
	return flags&availFNoInterrupt == 0, nil
}

// ReadableLen is the total size of the chain's driver-readable buffers.
func (c *Chain) ReadableLen() int {
	n := 0
	for _, b := range c.readable {
		n += len(b)
	}
	return n
}

// WritableLen is the total size of the chain's device-writable buffers.
func (c *Chain) WritableLen() int {
	n := 0
	for _, b := range c.writable {
		n += len(b)
	}
	return n
}

// Written is how many bytes Write has put in the chain.
func (c *Chain) Written() uint32 { return c.written }

// Read copies from the readable buffers, in order. It returns io.EOF when
// they are exhausted.
func (c *Chain) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) && c.rIdx < len(c.readable) {
		b := c.readable[c.rIdx][c.rOff:]
		k := copy(p[n:], b)
		n += k
		c.rOff += k
		if c.rOff == len(c.readable[c.rIdx]) {
			c.rIdx, c.rOff = c.rIdx+1, 0
		}
	}
	if n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	return n, nil
}

// Write copies into the writable buffers, in order. It returns
// io.ErrShortWrite when they are full.
func (c *Chain) Write(p []byte) (int, error) {
	n := 0
	for n < len(p) && c.wIdx < len(c.writable) {
		b := c.writable[c.wIdx][c.wOff:]
		k := copy(b, p[n:])
		n += k
		c.wOff += k
		if c.wOff == len(c.writable[c.wIdx]) {
			c.wIdx, c.wOff = c.wIdx+1, 0
		}
	}
	c.written += uint32(n)
	if n < len(p) {
		return n, io.ErrShortWrite
	}
	return n, nil
}

// TakeReadable consumes up to n bytes of the readable buffers and returns
// them as slices of guest memory, for a device that hands them to a system
// call (pwritev) instead of copying them. It returns fewer bytes only when
// the chain has fewer left.
func (c *Chain) TakeReadable(n int) [][]byte {
	out, _ := take(c.readable, &c.rIdx, &c.rOff, n)
	return out
}

// TakeWritable consumes up to n bytes of the writable buffers, counts them
// as written, and returns them as slices of guest memory for the device
// to fill (preadv). It returns fewer bytes only when the chain has fewer
// left.
func (c *Chain) TakeWritable(n int) [][]byte {
	out, k := take(c.writable, &c.wIdx, &c.wOff, n)
	c.written += uint32(k)
	return out
}

// Writable returns the writable buffers as slices of guest memory without
// consuming them or counting them as written, for a device that writes
// nothing into them but acts on the memory they name (the balloon's
// reported free pages).
func (c *Chain) Writable() [][]byte { return c.writable }

// take consumes up to n bytes of bufs from position (*idx, *off) and
// returns them as slices, and how many bytes they hold.
func take(bufs [][]byte, idx, off *int, n int) ([][]byte, int) {
	var out [][]byte
	total := 0
	for n > 0 && *idx < len(bufs) {
		b := bufs[*idx][*off:]
		k := min(n, len(b))
		if k > 0 {
			out = append(out, b[:k])
		}
		n -= k
		total += k
		*off += k
		if *off == len(bufs[*idx]) {
			*idx, *off = *idx+1, 0
		}
	}
	return out, total
}
