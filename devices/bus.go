// Package devices holds the legacy platform devices of a capsa VM: the 8250
// UART console, enough of the i8042 for the guest to reset, the boot-time
// marker port, and the bus that routes port I/O to them.
//
// Devices know nothing about KVM: they see port reads and writes as byte
// slices and raise interrupts through an IRQ callback. The vmm package wires
// them to vCPU exits.
package devices

import (
	"fmt"
	"sort"
	"sync"
)

// PortDevice handles guest port I/O. offset is relative to the base the
// device was registered at; data is 1, 2 or 4 bytes. A read fills data.
type PortDevice interface {
	ReadPort(offset uint16, data []byte)
	WritePort(offset uint16, data []byte)
}

// IRQ raises an edge-triggered interrupt on a fixed line.
type IRQ func()

type portRange struct {
	base, size uint16
	dev        PortDevice
}

// PortBus routes port I/O to the device registered for the port. It is safe
// for concurrent use once registration is done; each device serialises its
// own state.
type PortBus struct {
	mu     sync.RWMutex
	ranges []portRange // sorted by base, non-overlapping
}

// Register attaches dev to ports [base, base+size).
func (b *PortBus) Register(base, size uint16, dev PortDevice) error {
	if size == 0 || uint32(base)+uint32(size) > 0x10000 {
		return fmt.Errorf("port range %#x+%d is invalid", base, size)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, r := range b.ranges {
		if base < r.base+r.size && r.base < base+size {
			return fmt.Errorf("port range %#x+%d overlaps %#x+%d", base, size, r.base, r.size)
		}
	}
	b.ranges = append(b.ranges, portRange{base, size, dev})
	sort.Slice(b.ranges, func(i, j int) bool { return b.ranges[i].base < b.ranges[j].base })
	return nil
}

func (b *PortBus) find(port uint16) (PortDevice, uint16, bool) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	i := sort.Search(len(b.ranges), func(i int) bool { return b.ranges[i].base+b.ranges[i].size > port })
	if i < len(b.ranges) && b.ranges[i].base <= port {
		return b.ranges[i].dev, port - b.ranges[i].base, true
	}
	return nil, 0, false
}

// Read dispatches a read; an unclaimed port reads as all ones, as on real
// hardware with nothing on the bus. It reports whether a device claimed it.
func (b *PortBus) Read(port uint16, data []byte) bool {
	dev, off, ok := b.find(port)
	if !ok {
		for i := range data {
			data[i] = 0xff
		}
		return false
	}
	dev.ReadPort(off, data)
	return true
}

// Write dispatches a write; an unclaimed port ignores it. It reports whether
// a device claimed it.
func (b *PortBus) Write(port uint16, data []byte) bool {
	dev, off, ok := b.find(port)
	if !ok {
		return false
	}
	dev.WritePort(off, data)
	return true
}
