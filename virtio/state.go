package virtio

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// QueueState is a split virtqueue's state as the guest can observe it:
// where its rings are and how far the device has gone in them. It is
// plain data, checked again by RestoreQueue as the live path checks the
// driver's setup (rust-vmm's QueueState is the model).
type QueueState struct {
	Size      uint16 `json:"size"`
	Desc      uint64 `json:"desc"`
	Avail     uint64 `json:"avail"`
	Used      uint64 `json:"used"`
	NextAvail uint16 `json:"next_avail"`
	NextUsed  uint16 `json:"next_used"`
	EventIdx  bool   `json:"event_idx"`
}

// State returns the queue's state; the queue must be still (its gate
// closed, no chain held).
func (q *Queue) State() QueueState {
	return QueueState{Size: q.size, Desc: q.desc, Avail: q.avail, Used: q.used,
		NextAvail: q.nextAvail, NextUsed: q.nextUsed, EventIdx: q.eventIdx}
}

// RestoreQueue rebuilds a queue on mem from its state, after the checks
// NewQueue makes of a driver's setup. The used index in memory must be
// the one the device had published: a state that does not belong with
// its memory is refused.
func RestoreQueue(mem *guestmem.Memory, st QueueState) (*Queue, error) {
	q, err := NewQueue(mem, st.Size, st.Desc, st.Avail, st.Used)
	if err != nil {
		return nil, err
	}
	used, err := mem.LoadUint16(st.Used + 2)
	if err != nil {
		return nil, queueErr("used index: %v", err)
	}
	if used != st.NextUsed {
		return nil, queueErr("the used index in memory is %d, the saved state says %d", used, st.NextUsed)
	}
	q.nextAvail, q.nextUsed, q.eventIdx = st.NextAvail, st.NextUsed, st.EventIdx
	return q, nil
}

// QueueRegisters are the registers the driver set for one queue.
type QueueRegisters struct {
	Num   uint16 `json:"num"`
	Ready bool   `json:"ready"`
	Desc  uint64 `json:"desc"`
	Avail uint64 `json:"avail"`
	Used  uint64 `json:"used"`
}

// TransportState is a virtio-mmio transport's state: its registers as the
// driver set them and, for a running device, its queues' positions.
type TransportState struct {
	DeviceType  uint32           `json:"device_type"`
	Status      uint32           `json:"status"`
	DevFeatSel  uint32           `json:"device_features_sel"`
	DrvFeatSel  uint32           `json:"driver_features_sel"`
	DrvFeatures uint64           `json:"driver_features"`
	QueueSel    uint32           `json:"queue_sel"`
	Queues      []QueueRegisters `json:"queues"`
	Interrupt   uint32           `json:"interrupt_status"`
	ConfigGen   uint32           `json:"config_generation"`
	Active      bool             `json:"active"`
	// Live holds each queue's position while the device runs (nil for a
	// queue the driver did not set up).
	Live []*QueueState `json:"live,omitempty"`
	// Device is a Stateful device's own state.
	Device json.RawMessage `json:"device,omitempty"`
}

// Stateful is a device with state of its own beyond its queues (the 9P
// device: what the guest's fids stand for; vsock: its next host port).
type Stateful interface {
	// SaveState returns the device's state; its queues are still.
	SaveState() (json.RawMessage, error)
	// RestoreState takes it back, once the device runs on its restored
	// queues and before the guest does. It is untrusted input.
	RestoreState(json.RawMessage) error
}

// NoState reports whether a Stateful device's saved state is absent (a
// snapshot taken before the device kept one, or of a device that was not
// running): RestoreState then leaves the device as a new one.
func NoState(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }

// Restorer is a device that has something to tell the guest when it
// comes back from a snapshot, once running on its restored queues
// (vsock: that its transport was reset).
type Restorer interface {
	Restored()
}

// State returns the transport's state. Its device's queues must be
// still: the gate closed and no chain held.
func (t *MMIO) State() (TransportState, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.gate != nil && t.gate.Held() > 0 {
		return TransportState{}, errors.New("virtio: save state: requests are in the device's hands")
	}
	st := TransportState{
		DeviceType: t.dev.Type(), Status: t.status, DevFeatSel: t.devFeatSel, DrvFeatSel: t.drvFeatSel,
		DrvFeatures: t.drvFeatures, QueueSel: t.queueSel, Interrupt: t.interrupt, ConfigGen: t.configGen, Active: t.active,
	}
	for _, q := range t.queues {
		st.Queues = append(st.Queues, QueueRegisters{Num: q.num, Ready: q.ready, Desc: q.desc, Avail: q.avail, Used: q.used})
	}
	if sd, ok := t.dev.(Stateful); ok && t.active {
		var err error
		if st.Device, err = sd.SaveState(); err != nil {
			return TransportState{}, err
		}
	}
	if t.active {
		for _, q := range t.live {
			if q == nil {
				st.Live = append(st.Live, nil)
				continue
			}
			s := q.State()
			st.Live = append(st.Live, &s)
		}
	}
	return st, nil
}

// Restore sets a new transport's registers from st and, if its device was
// running, starts the device on queues restored where they were (then
// tells it, if it is a Restorer). st is untrusted: it is checked as the
// driver's writes are.
func (t *MMIO) Restore(st TransportState) error {
	if err := t.restore(st); err != nil {
		return err
	}
	// Outside t.mu: the device may interrupt the guest, which takes it.
	if sd, ok := t.dev.(Stateful); ok && st.Active {
		if err := sd.RestoreState(st.Device); err != nil {
			return err
		}
	}
	if r, ok := t.dev.(Restorer); ok && st.Active {
		r.Restored()
	}
	// A running device always gets one used-buffer interrupt (vsock gets
	// its reset event's too): the state may have been taken between the
	// device's last Push, which let the gate close and the snapshot go
	// on, and its Report, so that the used ring in memory holds an entry
	// whose interrupt neither this state nor the vCPU's LAPIC recorded,
	// and the guest would wait for that completion forever (the likeliest
	// cause of a restored image sandbox, every request queue drained,
	// that never answered in CI). A spurious interrupt costs the driver a
	// look at its rings.
	switch {
	case st.Active && st.Status&StatusNeedsReset == 0:
		t.usedBuffer()
	case st.Interrupt != 0:
		t.irq()
	}
	return nil
}

func (t *MMIO) restore(st TransportState) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.active {
		return errors.New("virtio: restore: the device is running")
	}
	sizes := t.dev.QueueSizes()
	switch {
	case st.DeviceType != t.dev.Type():
		return fmt.Errorf("virtio: restore: the state is of a device of type %d, this one is of type %d", st.DeviceType, t.dev.Type())
	case len(st.Queues) != len(sizes):
		return fmt.Errorf("virtio: restore: the state has %d queues, the device %d", len(st.Queues), len(sizes))
	case st.Status&StatusFeaturesOK != 0 && (st.DrvFeatures&^t.features() != 0 || st.DrvFeatures&FeatureVersion1 == 0):
		return fmt.Errorf("virtio: restore: driver features %#x are not among the device's %#x", st.DrvFeatures, t.features())
	case st.Active && (st.Status&StatusDriverOK == 0 || st.Status&StatusFeaturesOK == 0 || len(st.Live) != len(sizes)):
		return fmt.Errorf("virtio: restore: a running device with status %#x and %d live queues", st.Status, len(st.Live))
	}
	for i, q := range st.Queues {
		if q.Ready && (q.Num == 0 || q.Num > sizes[i]) {
			return fmt.Errorf("virtio: restore: queue %d: size %d, the maximum is %d", i, q.Num, sizes[i])
		}
		if st.Active && (st.Live[i] != nil) != q.Ready {
			return fmt.Errorf("virtio: restore: queue %d: ready %v but its position is %v", i, q.Ready, st.Live[i] != nil)
		}
		if l := st.Live; st.Active && l[i] != nil && (l[i].Size != q.Num || l[i].Desc != q.Desc || l[i].Avail != q.Avail || l[i].Used != q.Used) {
			return fmt.Errorf("virtio: restore: queue %d: its position is for other rings than its registers", i)
		}
	}
	t.status, t.devFeatSel, t.drvFeatSel, t.drvFeatures, t.queueSel = st.Status, st.DevFeatSel, st.DrvFeatSel, st.DrvFeatures, st.QueueSel
	t.interrupt, t.configGen = st.Interrupt, st.ConfigGen
	for i, q := range st.Queues {
		t.queues[i] = queueConfig{num: q.Num, ready: q.Ready, desc: q.Desc, avail: q.Avail, used: q.Used}
	}
	if !st.Active {
		return nil
	}
	qs := make([]*Queue, len(st.Live))
	for i, l := range st.Live {
		if l == nil {
			continue
		}
		q, err := RestoreQueue(t.mem, *l)
		if err != nil {
			return fmt.Errorf("virtio: restore: queue %d: %w", i, err)
		}
		qs[i] = q
	}
	if err := t.start(qs); err != nil {
		return fmt.Errorf("virtio: restore: start the device: %w", err)
	}
	return nil
}
