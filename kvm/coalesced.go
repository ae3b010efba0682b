package kvm

import (
	"errors"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Coalesced MMIO (KVM_REGISTER_COALESCED_MMIO): a guest's writes to a
// registered zone do not exit to userspace; KVM appends them to a ring in
// a page of each vCPU's mmap (the page KVM_CAP_COALESCED_MMIO names) and
// the vCPU runs on. When the ring is full, a write exits as any MMIO
// write does. capsa coalesces only writes it may drop (a virtio-mmio
// device's InterruptACK, which its status read has done already), so it
// never replays the ring: it discards it.

// ErrNoCoalescedMMIO is CoalesceWrites' error where KVM offers no
// coalesced MMIO ring.
var ErrNoCoalescedMMIO = errors.New("kvm: no coalesced MMIO (KVM_CAP_COALESCED_MMIO)")

// coalescedMMIOZone is struct kvm_coalesced_mmio_zone.
type coalescedMMIOZone struct {
	Addr uint64
	Size uint32
	PIO  uint32
}

var kvmRegisterCoalescedMMIO = iow(0x67, unsafe.Sizeof(coalescedMMIOZone{}))

// The ring: struct kvm_coalesced_mmio_ring, its first and last indexes
// (u32 each), then KVM_COALESCED_MMIO_MAX entries of struct
// kvm_coalesced_mmio (24 bytes) filling the page.
const (
	coalescedRingHeader = 8
	coalescedEntrySize  = 24
)

// coalescedPage is the page of a vCPU's mmap that holds the ring, or 0
// where there is none (KVM_CHECK_EXTENSION's answer, checked to fit in
// a run area of mmapSize bytes).
func (s *System) coalescedPage() int {
	n, err := s.CheckExtension(CapCoalescedMMIO)
	if err != nil || n <= 0 || (n+1)*unix.Getpagesize() > s.mmapSize {
		return 0
	}
	return n
}

// CoalesceWrites makes the guest's writes to [addr, addr+size) go to the
// coalesced MMIO ring instead of exiting (ErrNoCoalescedMMIO where KVM has
// none). Their data is never read: only writes whose effect the VMM may
// drop belong there. Call it while building the VM.
func (vm *VM) CoalesceWrites(addr uint64, size uint32) error {
	if vm.coalescedPage == 0 {
		return ErrNoCoalescedMMIO
	}
	z := coalescedMMIOZone{Addr: addr, Size: size}
	_, err := ioctlPtr(vm.fd, kvmRegisterCoalescedMMIO, unsafe.Pointer(&z))
	return err
}

// coalescedMax is KVM_COALESCED_MMIO_MAX: the ring's entries.
func coalescedMax() uint32 {
	return uint32((unix.Getpagesize() - coalescedRingHeader) / coalescedEntrySize)
}

// ringIndexes returns pointers to the ring's first and last indexes, or
// nils where the vCPU has no ring.
func (v *VCPU) ringIndexes() (first, last *uint32) {
	if v.ringOff == 0 || v.ringOff+coalescedRingHeader > len(v.run) {
		return nil, nil
	}
	return (*uint32)(unsafe.Pointer(&v.run[v.ringOff])), (*uint32)(unsafe.Pointer(&v.run[v.ringOff+4]))
}

// PendingCoalescedWrites is how many writes the ring holds (0 without a
// ring, or with indexes KVM could not have written).
func (v *VCPU) PendingCoalescedWrites() int {
	first, last := v.ringIndexes()
	if first == nil {
		return 0
	}
	f, l, m := atomic.LoadUint32(first), atomic.LoadUint32(last), coalescedMax()
	if f >= m || l >= m {
		return 0
	}
	return int((l + m - f) % m)
}

// DiscardCoalescedWrites empties the ring (the VM's, which every vCPU
// maps), so that later writes to a coalesced zone go on without exiting.
// Any vCPU thread may call it after KVM_RUN returns: the ring has one
// consumer's index, and two threads setting it to what each read of
// KVM's can only leave a few entries counted again, which nobody reads.
func (v *VCPU) DiscardCoalescedWrites() {
	first, last := v.ringIndexes()
	if first == nil {
		return
	}
	if l := atomic.LoadUint32(last); l < coalescedMax() && atomic.LoadUint32(first) != l {
		atomic.StoreUint32(first, l)
	}
}
