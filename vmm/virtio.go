package vmm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/virtio"
)

// virtio-mmio devices sit at the bottom of the MMIO hole, one 4 KiB window
// each, with interrupts on IOAPIC pins from 5 up (0-4 and 8 are the legacy
// timer, keyboard, cascade, COM ports and RTC).
var virtioGSIs = [...]uint32{5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23}

// maxVirtioDevices is how many virtio devices a VM can have: one
// interrupt line each.
const maxVirtioDevices = len(virtioGSIs)

const virtioMMIOBase = guestmem.MMIOStart

// virtioSlot is one attached virtio-mmio device.
type virtioSlot struct {
	transport *virtio.MMIO
	base      uint64
	gsi       uint32
	irqfd     *os.File
	notify    []*os.File // one ioeventfd per queue
}

func newEventFD() (*os.File, error) {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	return os.NewFile(uintptr(fd), "eventfd"), nil
}

// attachVirtio places each configured device behind a virtio-mmio transport
// and returns the kernel command line arguments that declare them.
func (m *Machine) attachVirtio() (string, error) {
	if len(m.cfg.Devices) > maxVirtioDevices {
		return "", fmt.Errorf("vmm: %d virtio devices, at most %d", len(m.cfg.Devices), maxVirtioDevices)
	}
	var args string
	for i, dev := range m.cfg.Devices {
		s := &virtioSlot{base: virtioMMIOBase + uint64(i)*virtio.MMIOSize, gsi: virtioGSIs[i]}
		m.virtio = append(m.virtio, s)
		var err error
		if s.irqfd, err = newEventFD(); err != nil {
			return "", err
		}
		if err := m.vm.IRQFD(int(s.irqfd.Fd()), s.gsi); err != nil {
			return "", err
		}
		irqfd := s.irqfd
		raise := func() {
			if _, err := irqfd.Write(binary.LittleEndian.AppendUint64(nil, 1)); err != nil && !errors.Is(err, os.ErrClosed) {
				m.log.Warn("virtio interrupt", "gsi", s.gsi, "err", err)
			}
		}
		s.transport = virtio.NewMMIO(dev.Device, m.mem, raise, m.log)
		s.transport.UseGate(m.gate)
		if err := m.mmio.Register(s.base, virtio.MMIOSize, s.transport); err != nil {
			return "", fmt.Errorf("vmm: attach virtio device: %w", err)
		}
		// A queue notification is a 4-byte write of the queue's index to
		// QueueNotify: route each index to its own eventfd so it never
		// exits to userspace on the vCPU thread.
		for q := 0; q < s.transport.NumQueues(); q++ {
			efd, err := newEventFD()
			if err != nil {
				return "", err
			}
			s.notify = append(s.notify, efd)
			match := uint64(q)
			if err := m.vm.IOEventFD(int(efd.Fd()), s.base+virtio.QueueNotifyOffset, 4, false, &match); err != nil {
				return "", err
			}
		}
		args += fmt.Sprintf(" virtio_mmio.device=4K@%#x:%d", s.base, s.gsi)
	}
	return args, nil
}

// startVirtio runs one goroutine per queue that turns its ioeventfd into
// notifications; they end when the eventfds are closed.
func (m *Machine) startVirtio() {
	for _, s := range m.virtio {
		for q, efd := range s.notify {
			go func() {
				buf := make([]byte, 8)
				for {
					if _, err := efd.Read(buf); err != nil {
						return
					}
					s.transport.Notify(q)
				}
			}()
		}
	}
}

func (m *Machine) closeVirtio() error {
	var errs []error
	for _, s := range m.virtio {
		if s.transport != nil {
			s.transport.Close()
		}
		for _, f := range append(s.notify, s.irqfd) {
			if f != nil {
				errs = append(errs, f.Close())
			}
		}
	}
	m.virtio = nil
	return errors.Join(errs...)
}
