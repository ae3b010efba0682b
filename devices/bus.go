// Package devices holds the legacy platform devices of a capsa VM: the 8250
// UART console, enough of the i8042 for the guest to reset, the boot-time
// marker port, the ACPI sleep registers a guest powers off through, and
// the bus that routes port I/O to them.
//
// Devices know nothing about KVM: they see port reads and writes as byte
// slices and set interrupt lines through IRQLevel callbacks. The vmm package wires
// them to vCPU exits.
package devices

import (
	"fmt"
	"sort"
	"sync"
)

// Device handles guest accesses to a range of I/O ports or MMIO addresses.
// offset is relative to the base the device was registered at; data is the
// access (1, 2, 4 or 8 bytes). A read fills data.
type Device interface {
	Read(offset uint64, data []byte)
	Write(offset uint64, data []byte)
}

// IRQLevel sets the level of a fixed interrupt line: a device that models
// its interrupt output as a level (high while an interrupt is pending)
// calls it when the level changes.
type IRQLevel func(high bool)

type busRange struct {
	base, size uint64
	dev        Device
}

// Bus routes accesses to the device registered for the address: one bus for
// I/O ports, one for MMIO. It is safe for concurrent use; each device
// serialises its own state.
type Bus struct {
	mu     sync.RWMutex
	limit  uint64     // addresses must be below it; 0 means no limit
	ranges []busRange // sorted by base, non-overlapping
}

// NewPortBus returns a bus for the 64 KiB x86 I/O port space.
func NewPortBus() *Bus { return &Bus{limit: 0x10000} }

// NewMMIOBus returns a bus for memory-mapped I/O.
func NewMMIOBus() *Bus { return &Bus{} }

// Register attaches dev to addresses [base, base+size).
func (b *Bus) Register(base, size uint64, dev Device) error {
	if size == 0 || base+size < base || (b.limit != 0 && base+size > b.limit) {
		return fmt.Errorf("address range %#x+%d is invalid", base, size)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, r := range b.ranges {
		if base < r.base+r.size && r.base < base+size {
			return fmt.Errorf("port range %#x+%d overlaps %#x+%d", base, size, r.base, r.size)
		}
	}
	b.ranges = append(b.ranges, busRange{base, size, dev})
	sort.Slice(b.ranges, func(i, j int) bool { return b.ranges[i].base < b.ranges[j].base })
	return nil
}

func (b *Bus) find(addr uint64) (Device, uint64, bool) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	i := sort.Search(len(b.ranges), func(i int) bool { return b.ranges[i].base+b.ranges[i].size > addr })
	if i < len(b.ranges) && b.ranges[i].base <= addr {
		return b.ranges[i].dev, addr - b.ranges[i].base, true
	}
	return nil, 0, false
}

// Read dispatches a read; an unclaimed address reads as all ones, as on real
// hardware with nothing on the bus. It reports whether a device claimed it.
func (b *Bus) Read(addr uint64, data []byte) bool {
	dev, off, ok := b.find(addr)
	if !ok {
		for i := range data {
			data[i] = 0xff
		}
		return false
	}
	dev.Read(off, data)
	return true
}

// Write dispatches a write; an unclaimed address ignores it. It reports
// whether a device claimed it.
func (b *Bus) Write(addr uint64, data []byte) bool {
	dev, off, ok := b.find(addr)
	if !ok {
		return false
	}
	dev.Write(off, data)
	return true
}
