package virtio

import (
	"context"
	"encoding/json"
	"io"
	"strings"
	"sync/atomic"
	"testing"
)

// TestTransportStateRoundTrip: a transport restored from another's state,
// on the same memory, runs its device on queues that go on where the first
// left them, without the driver setting anything up again.
func TestTransportStateRoundTrip(t *testing.T) {
	dev := &echoDevice{}
	d, _ := newMMIO(t, dev)
	d.m.UseGate(NewGate())
	d.bringUp(FeatureVersion1 | FeatureEventIdx | 1<<3)
	d.drv.mem.WriteAt([]byte("ping"), testData)
	d.drv.add(0, buf{testData, 4, false}, buf{testData + 0x100, 8, true})
	d.w(regQueueNotify, 0)
	st, err := d.m.State()
	if err != nil {
		t.Fatal(err)
	}
	if !st.Active || len(st.Live) != 1 || st.Live[0].NextUsed != 1 || st.Live[0].NextAvail != 1 || !st.Live[0].EventIdx {
		t.Fatalf("State() = %+v; want a running device with one chain used", st)
	}

	dev2 := &echoDevice{}
	d2 := &mmioDriver{t: t, m: NewMMIO(dev2, d.drv.mem, func() {}, nil), drv: d.drv}
	if err := d2.m.Restore(st); err != nil {
		t.Fatalf("Restore() = %v", err)
	}
	if want := st.Interrupt | interruptUsedBuffer; dev2.activated != 1 || d2.r(regStatus) != st.Status || d2.r(regInterruptStatus) != want {
		t.Fatalf("restored: activated %d, status %#x, interrupt %#x; want 1, %#x, %#x", dev2.activated, d2.r(regStatus), d2.r(regInterruptStatus), st.Status, want)
	}
	d.drv.mem.WriteAt([]byte("pong"), testData)
	d.drv.add(2, buf{testData, 4, false}, buf{testData + 0x200, 8, true})
	d2.w(regQueueNotify, 0)
	if got, _ := d.drv.mem.Slice(testData+0x200, 4); string(got) != "pong" {
		t.Errorf("the restored device wrote %q, want pong", got)
	}
	if id, _ := d.drv.usedElem(1); id != 2 {
		t.Errorf("the second used entry is chain %d, want 2", id)
	}
}

// TestTransportRestoreInterrupts: a device's interrupt for the chains it
// pushed last comes after the gate let the pause go on (it reports once it
// has pushed them all), so a state can hold a used entry whose interrupt
// it does not record. The restored transport interrupts the guest anyway,
// or the driver would wait for that completion forever; a device that was
// not running is not interrupted.
func TestTransportRestoreInterrupts(t *testing.T) {
	dev := &echoDevice{}
	d, _ := newMMIO(t, dev)
	g := NewGate()
	d.m.UseGate(g)
	d.bringUp(FeatureVersion1 | 1<<3)
	d.drv.mem.WriteAt([]byte("ping"), testData)
	d.drv.add(0, buf{testData, 4, false}, buf{testData + 0x100, 8, true})
	// The device's worker: takes the chain and pushes it, and is about to
	// report when the pause closes the gate and takes the state.
	q := dev.act.Queues[0]
	c, err := q.Next()
	if err != nil || c == nil {
		t.Fatalf("Next() = %v, %v", c, err)
	}
	io.Copy(c, c)
	if _, err := q.Push(c); err != nil {
		t.Fatal(err)
	}
	if err := g.Close(context.Background()); err != nil {
		t.Fatalf("Close() = %v; want the gate closed, the chain being back", err)
	}
	st, err := d.m.State()
	if err != nil {
		t.Fatal(err)
	}
	if st.Interrupt != 0 || st.Live[0].NextUsed != 1 {
		t.Fatalf("State() = interrupt %#x, next used %d; want the used entry without its interrupt", st.Interrupt, st.Live[0].NextUsed)
	}
	var irqs atomic.Int32
	d2 := &mmioDriver{t: t, m: NewMMIO(&echoDevice{}, d.drv.mem, func() { irqs.Add(1) }, nil), drv: d.drv}
	if err := d2.m.Restore(st); err != nil {
		t.Fatalf("Restore() = %v", err)
	}
	if irqs.Load() != 1 || d2.r(regInterruptStatus) != interruptUsedBuffer {
		t.Errorf("restored: %d interrupts, status %#x; want 1 and the used-buffer bit", irqs.Load(), d2.r(regInterruptStatus))
	}

	idle, _ := newMMIO(t, &echoDevice{})
	st, err = idle.m.State()
	if err != nil {
		t.Fatal(err)
	}
	irqs.Store(0)
	d3 := NewMMIO(&echoDevice{}, d.drv.mem, func() { irqs.Add(1) }, nil)
	if err := d3.Restore(st); err != nil || irqs.Load() != 0 {
		t.Errorf("a device the driver never started: Restore() = %v with %d interrupts; want none", err, irqs.Load())
	}
}

// TestTransportRestoreRefuses: a state that does not fit the device or its
// memory is refused, naming why.
func TestTransportRestoreRefuses(t *testing.T) {
	dev := &echoDevice{}
	d, _ := newMMIO(t, dev)
	d.bringUp(FeatureVersion1 | 1<<3)
	good, err := d.m.State()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		edit func(*TransportState)
		want string
	}{
		{"type", func(s *TransportState) { s.DeviceType = 7 }, "type 7"},
		{"queues", func(s *TransportState) { s.Queues = nil; s.Live = nil }, "0 queues"},
		{"size", func(s *TransportState) { s.Queues[0].Num = 64; s.Live[0].Size = 64 }, "size 64"},
		{"features", func(s *TransportState) { s.DrvFeatures |= 1 << 20 }, "driver features"},
		{"rings", func(s *TransportState) { s.Live[0].Desc = 0x40000 }, "other rings"},
		{"used index", func(s *TransportState) { s.Live[0].NextUsed = 5 }, "used index in memory is 0"},
		{"outside memory", func(s *TransportState) { s.Queues[0].Used = 1 << 40; s.Live[0].Used = 1 << 40 }, "outside guest memory"},
	} {
		st := good
		st.Queues = append([]QueueRegisters(nil), good.Queues...)
		l := *good.Live[0]
		st.Live = []*QueueState{&l}
		tc.edit(&st)
		m := NewMMIO(&echoDevice{}, d.drv.mem, func() {}, nil)
		if err := m.Restore(st); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Restore() = %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

// FuzzTransportRestore: any transport state, decoded from JSON as a
// snapshot's is, is either refused or gives a device that runs on guest
// memory without a panic.
func FuzzTransportRestore(f *testing.F) {
	drv, _ := newDriver(f, 16)
	d := &mmioDriver{m: NewMMIO(&echoDevice{}, drv.mem, func() {}, nil), drv: drv}
	d.w(regStatus, StatusAcknowledge|StatusDriver)
	d.w(regDriverFeatSel, 1)
	d.w(regDriverFeatures, 1)
	d.w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
	d.w(regQueueNum, 16)
	d.w(regQueueDescLow, testDesc)
	d.w(regQueueDriverLow, testAvail)
	d.w(regQueueDeviceLow, testUsed)
	d.w(regQueueReady, 1)
	d.w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
	st, err := d.m.State()
	if err != nil {
		f.Fatal(err)
	}
	b, _ := json.Marshal(st)
	f.Add(b)
	f.Add([]byte(`{"device_type":66,"status":15,"driver_features":4294967296,"queues":[{"num":16,"ready":true,"used":1048570}],"active":true,"live":[{"size":16,"used":1048570}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var st TransportState
		if json.Unmarshal(b, &st) != nil {
			return
		}
		dev := &echoDevice{}
		m := NewMMIO(dev, drv.mem, func() {}, nil)
		if m.Restore(st) == nil && dev.act.Queues != nil {
			m.Kick()
		}
		m.Close()
	})
}
