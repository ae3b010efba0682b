package virtio

import (
	"encoding/binary"
	"errors"
	"io"
	"sync/atomic"
	"testing"
)

// echoDevice copies each chain's readable bytes into its writable buffers:
// a test device for the transport.
type echoDevice struct {
	act       Activation
	resets    int
	activated int
	fail      bool
}

func (e *echoDevice) Type() uint32                    { return 0x42 }
func (e *echoDevice) Features() uint64                { return 1 << 3 }
func (e *echoDevice) QueueSizes() []uint16            { return []uint16{16} }
func (e *echoDevice) ReadConfig(off uint64, d []byte) { copy(d, []byte("cfg!")[min(off, 4):]) }
func (e *echoDevice) WriteConfig(uint64, []byte)      {}
func (e *echoDevice) Reset()                          { e.resets++ }
func (e *echoDevice) Activate(a Activation) error {
	if e.fail {
		return errors.New("cannot start")
	}
	e.act = a
	e.activated++
	return nil
}
func (e *echoDevice) Notify(i int) {
	q := e.act.Queues[i]
	for {
		c, err := q.Next()
		if err != nil {
			e.act.Fail(err)
			return
		}
		if c == nil {
			return
		}
		io.Copy(c, c)
		if irq, _ := q.Push(c); irq {
			e.act.Interrupt()
		}
	}
}

type mmioDriver struct {
	t   *testing.T
	m   *MMIO
	drv *driver
}

func (d *mmioDriver) r(off uint64) uint32 {
	b := make([]byte, 4)
	d.m.Read(off, b)
	return binary.LittleEndian.Uint32(b)
}

func (d *mmioDriver) w(off uint64, v uint32) {
	d.m.Write(off, binary.LittleEndian.AppendUint32(nil, v))
}

func newMMIO(t *testing.T, dev Device) (*mmioDriver, *atomic.Int32) {
	drv, _ := newDriver(t, 16)
	var irqs atomic.Int32
	return &mmioDriver{t: t, m: NewMMIO(dev, drv.mem, func() { irqs.Add(1) }, nil), drv: drv}, &irqs
}

// bringUp negotiates features and sets up queue 0 as Linux's driver does.
func (d *mmioDriver) bringUp(features uint64) uint32 {
	d.w(regStatus, 0)
	d.w(regStatus, StatusAcknowledge)
	d.w(regStatus, StatusAcknowledge|StatusDriver)
	d.w(regDriverFeatSel, 0)
	d.w(regDriverFeatures, uint32(features))
	d.w(regDriverFeatSel, 1)
	d.w(regDriverFeatures, uint32(features>>32))
	d.w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
	if d.r(regStatus)&StatusFeaturesOK == 0 {
		return d.r(regStatus)
	}
	d.w(regQueueSel, 0)
	if d.r(regQueueNumMax) != 16 || d.r(regQueueReady) != 0 {
		d.t.Fatalf("queue 0: max %d ready %d", d.r(regQueueNumMax), d.r(regQueueReady))
	}
	d.w(regQueueNum, 16)
	d.w(regQueueDescLow, testDesc)
	d.w(regQueueDescHigh, 0)
	d.w(regQueueDriverLow, testAvail)
	d.w(regQueueDeviceLow, testUsed)
	d.w(regQueueReady, 1)
	d.w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
	return d.r(regStatus)
}

func TestMMIOIdentity(t *testing.T) {
	d, _ := newMMIO(t, &echoDevice{})
	if d.r(regMagic) != 0x74726976 || d.r(regVersion) != 2 || d.r(regDeviceID) != 0x42 {
		t.Fatalf("magic %#x version %d id %#x", d.r(regMagic), d.r(regVersion), d.r(regDeviceID))
	}
	d.w(regDeviceFeatSel, 0)
	lo := d.r(regDeviceFeatures)
	d.w(regDeviceFeatSel, 1)
	hi := d.r(regDeviceFeatures)
	if lo != 1<<3|FeatureEventIdx || hi != 1 {
		t.Errorf("features %#x:%#x, want VERSION_1, EVENT_IDX and bit 3", hi, lo)
	}
	b := make([]byte, 4)
	d.m.Read(regConfig, b)
	if string(b) != "cfg!" {
		t.Errorf("config %q", b)
	}
}

func TestMMIORoundTrip(t *testing.T) {
	dev := &echoDevice{}
	d, irqs := newMMIO(t, dev)
	if st := d.bringUp(FeatureVersion1 | 1<<3); st&StatusDriverOK == 0 || dev.activated != 1 {
		t.Fatalf("status %#x, activated %d", st, dev.activated)
	}
	d.drv.mem.WriteAt([]byte("ping"), testData)
	d.drv.add(0, buf{testData, 4, false}, buf{testData + 0x100, 8, true})
	d.w(regQueueNotify, 0)
	if got, _ := d.drv.mem.Slice(testData+0x100, 4); string(got) != "ping" {
		t.Errorf("echo wrote %q", got)
	}
	if irqs.Load() != 1 || d.r(regInterruptStatus) != interruptUsedBuffer {
		t.Fatalf("irqs %d status %#x", irqs.Load(), d.r(regInterruptStatus))
	}
	d.w(regInterruptACK, interruptUsedBuffer)
	if d.r(regInterruptStatus) != 0 {
		t.Error("interrupt not acknowledged")
	}
	// Queue registers are frozen while the device runs.
	d.w(regQueueDescLow, 0x5000)
	if dev.act.Queues[0].desc != testDesc {
		t.Error("a running queue was moved")
	}
	d.w(regStatus, 0)
	if dev.resets != 1 || d.r(regStatus) != 0 {
		t.Errorf("reset: %d resets, status %#x", dev.resets, d.r(regStatus))
	}
	d.w(regQueueNotify, 0) // after reset: ignored, not a crash
}

func TestMMIOFeatureNegotiation(t *testing.T) {
	for name, feats := range map[string]uint64{
		"no VERSION_1":       1 << 3,
		"unoffered features": FeatureVersion1 | 1<<5,
	} {
		dev := &echoDevice{}
		d, _ := newMMIO(t, dev)
		if st := d.bringUp(feats); st&StatusFeaturesOK != 0 || dev.activated != 0 {
			t.Errorf("%s: status %#x, activated %d", name, st, dev.activated)
		}
	}
}

func TestMMIOHostileQueueSetup(t *testing.T) {
	for name, setup := range map[string]func(d *mmioDriver){
		"size above max":      func(d *mmioDriver) { d.w(regQueueNum, 32) },
		"size not power of 2": func(d *mmioDriver) { d.w(regQueueNum, 12) },
		"ring outside memory": func(d *mmioDriver) { d.w(regQueueDeviceHigh, 0x10) },
	} {
		dev := &echoDevice{}
		d, irqs := newMMIO(t, dev)
		d.w(regStatus, StatusAcknowledge|StatusDriver)
		d.w(regDriverFeatSel, 1)
		d.w(regDriverFeatures, 1)
		d.w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
		d.w(regQueueNum, 16)
		d.w(regQueueDescLow, testDesc)
		d.w(regQueueDriverLow, testAvail)
		d.w(regQueueDeviceLow, testUsed)
		setup(d)
		d.w(regQueueReady, 1)
		d.w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
		if d.r(regStatus)&StatusNeedsReset == 0 || dev.activated != 0 || irqs.Load() == 0 {
			t.Errorf("%s: status %#x activated %d irqs %d", name, d.r(regStatus), dev.activated, irqs.Load())
		}
	}
	// A bad chain at run time: the device fails, the transport stops
	// passing notifications.
	dev := &echoDevice{}
	d, _ := newMMIO(t, dev)
	d.bringUp(FeatureVersion1)
	d.drv.setDesc(0, testData, 1, descFNext, 0)
	d.drv.publish(0)
	d.w(regQueueNotify, 0)
	if d.r(regStatus)&StatusNeedsReset == 0 {
		t.Error("a looping chain did not mark the device NEEDS_RESET")
	}
	d.w(regQueueNotify, 7)              // no such queue
	d.m.Read(regMagic, make([]byte, 2)) // odd-sized register read
}
