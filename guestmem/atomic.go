package guestmem

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Virtqueue ring indices are 16-bit fields that the guest and the VMM
// update concurrently, ordering their other accesses around them. Go has no
// 16-bit atomics, so these access the aligned 32-bit word that holds the
// field: an atomic load or compare-and-swap of that word is a full barrier
// on x86 and a synchronisation point for Go's memory model.

func (m *Memory) word(gpa uint64) (*uint32, uint, error) {
	if gpa%2 != 0 {
		return nil, 0, fmt.Errorf("%w: atomic 16-bit access at odd address %#x", ErrOutOfRange, gpa)
	}
	b, err := m.Slice(gpa&^3, 4)
	if err != nil {
		return nil, 0, err
	}
	return (*uint32)(unsafe.Pointer(&b[0])), uint(gpa&2) * 8, nil
}

// LoadUint16 atomically reads the little-endian 16-bit value at gpa, which
// must be 2-byte aligned.
func (m *Memory) LoadUint16(gpa uint64) (uint16, error) {
	p, shift, err := m.word(gpa)
	if err != nil {
		return 0, err
	}
	return uint16(littleEndianWord(atomic.LoadUint32(p)) >> shift), nil
}

// StoreUint16 atomically writes v at gpa, leaving the other half of the
// word as it is.
func (m *Memory) StoreUint16(gpa uint64, v uint16) error {
	p, shift, err := m.word(gpa)
	if err != nil {
		return err
	}
	for {
		old := atomic.LoadUint32(p)
		w := littleEndianWord(old)
		w = w&^(0xffff<<shift) | uint32(v)<<shift
		if atomic.CompareAndSwapUint32(p, old, littleEndianWord(w)) {
			return nil
		}
	}
}

// littleEndianWord converts between a word as stored in guest memory and
// its little-endian value (the identity on x86, the only host capsa runs on).
func littleEndianWord(w uint32) uint32 {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], w)
	return binary.LittleEndian.Uint32(b[:])
}

// mincore is mincore(2), which golang.org/x/sys/unix does not wrap on
// Linux: one byte in vec per page of b, bit 0 set when it is resident.
func mincore(b, vec []byte) error {
	if len(b) == 0 {
		return nil
	}
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return errno
	}
	return nil
}

// addrOf is the host address of b's first byte (to align guest memory on
// huge pages).
func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

// mapFixed maps len(b) bytes of fd at off over b (which must be page
// aligned), private and copy-on-write: mmap(2) with MAP_FIXED, which
// golang.org/x/sys/unix's Mmap cannot ask for.
func mapFixed(b []byte, fd int, off int64) error {
	if len(b) == 0 {
		return nil
	}
	addr := uintptr(unsafe.Pointer(&b[0]))
	got, _, errno := unix.Syscall6(unix.SYS_MMAP, addr, uintptr(len(b)), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_FIXED|unix.MAP_NORESERVE, uintptr(fd), uintptr(off))
	if errno != 0 {
		return errno
	}
	if got != addr {
		return fmt.Errorf("mmap placed the mapping at %#x, not %#x", got, addr)
	}
	return nil
}
