package vmm

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/capsa-sandbox/capsa/kvm"
)

// pause is what a paused VM keeps: the channel its parked vCPUs wait on,
// and the guest's clock when it stopped.
type pause struct {
	resume chan struct{}
	clock  kvm.ClockData
	since  time.Time
}

// Pause stops the guest where it is, until Resume: every vCPU leaves
// KVM_RUN and waits on its own thread, every device returns the requests
// it holds and takes no new ones (virtio.Gate), and the guest's kvmclock
// is read so that Resume sets it back: the guest sees no time pass while
// paused (no watchdog or timer storm; its wall clock is set right by the
// caller, through the agent). A device that holds a request until ctx ends
// (a 9P read of a FIFO, say) fails the pause, and the VM runs on. Pausing
// a paused VM does nothing.
func (m *Machine) Pause(ctx context.Context) error {
	m.runMu.Lock()
	defer m.runMu.Unlock()
	if !m.running || m.stopping.Load() {
		return errors.New("vmm: pause: the VM is not running")
	}
	if m.paused != nil {
		return nil
	}
	p := &pause{resume: make(chan struct{}), since: time.Now()}
	parked := make(chan int, len(m.vcpus))
	undo := func() { m.unpause(p, "vm pause given up") }
	for i := range m.vcpus {
		park := func() {
			parked <- i
			select {
			case <-p.resume:
			case <-m.stopped:
			}
		}
		if !m.request(i, park) {
			undo()
			return fmt.Errorf("vmm: pause: vCPU %d has too many requests pending", i)
		}
	}
	for range m.vcpus {
		select {
		case <-parked:
		case <-m.stopped:
			undo()
			return errors.New("vmm: pause: the VM stopped")
		case <-ctx.Done():
			undo()
			return fmt.Errorf("vmm: pause: waiting for the vCPUs to leave the guest: %w", context.Cause(ctx))
		}
	}
	if err := m.gate.Close(ctx); err != nil {
		undo()
		return fmt.Errorf("vmm: pause: %w", err)
	}
	c, err := m.vm.Clock()
	if err != nil {
		undo()
		return fmt.Errorf("vmm: pause: %w", err)
	}
	p.clock = c
	m.paused = p
	m.log.Debug("vm paused", "clock", c.Clock)
	return nil
}

// Resume runs a paused VM again from where it stopped, its kvmclock where
// it was. Resuming a VM that is not paused does nothing.
func (m *Machine) Resume() error {
	m.runMu.Lock()
	defer m.runMu.Unlock()
	p := m.paused
	if p == nil {
		return nil
	}
	if err := m.vm.SetClock(p.clock); err != nil {
		return fmt.Errorf("vmm: resume: %w", err)
	}
	m.unpause(p, "vm resumed")
	return nil
}

// unpause lets the vCPUs and devices of the paused VM p go on; m.runMu is
// held.
func (m *Machine) unpause(p *pause, msg string) {
	m.paused = nil
	m.gate.Open()
	close(p.resume)
	// Devices that found their queues closed look again.
	m.kickVirtio()
	m.log.Debug(msg, "paused for", time.Since(p.since))
}

// Continue runs a paused VM again with its kvmclock caught up with the
// host, as if the vCPUs had merely not been scheduled meanwhile: for a
// brief pause (a snapshot's), after which the guest's clocks are right
// without being set. Continuing a VM that is not paused does nothing.
func (m *Machine) Continue() error {
	m.runMu.Lock()
	defer m.runMu.Unlock()
	if p := m.paused; p != nil {
		m.unpause(p, "vm continued")
	}
	return nil
}

// Paused reports whether the VM is paused.
func (m *Machine) Paused() bool {
	m.runMu.Lock()
	defer m.runMu.Unlock()
	return m.paused != nil
}

// kickVirtio notifies every virtio device of each of its queues.
func (m *Machine) kickVirtio() {
	for _, s := range m.virtio {
		s.transport.Kick()
	}
}
