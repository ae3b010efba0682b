package virtio

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// Device types (virtio 1.2 §5).
const (
	TypeNet     = 1
	TypeBlock   = 2
	TypeBalloon = 5
	Type9P      = 9
	TypeFS      = 26
	TypeVsock   = 19
)

// FeatureVersion1 is VIRTIO_F_VERSION_1: the device is a modern one. The
// transport always offers it and requires the driver to accept it.
const FeatureVersion1 = 1 << 32

// Device status bits (§2.1).
const (
	StatusAcknowledge = 1
	StatusDriver      = 2
	StatusDriverOK    = 4
	StatusFeaturesOK  = 8
	StatusNeedsReset  = 0x40
	StatusFailed      = 0x80
)

// Device is a virtio device behind a transport. The transport calls it with
// its own lock held, except Notify, which may come from any goroutine and
// must not block.
type Device interface {
	Type() uint32
	// Features are the device's feature bits; the transport adds VERSION_1.
	Features() uint64
	// QueueSizes gives each queue's maximum size.
	QueueSizes() []uint16
	ReadConfig(offset uint64, data []byte)
	WriteConfig(offset uint64, data []byte)
	// Activate starts the device when the driver sets DRIVER_OK.
	Activate(a Activation) error
	// Notify says the driver made buffers available on queue i.
	Notify(queue int)
	// Reset stops the device and forgets its queues.
	Reset()
}

// Activation is what a device runs with once the driver is ready.
type Activation struct {
	Mem      *guestmem.Memory
	Queues   []*Queue
	Features uint64 // as negotiated
	// Interrupt tells the driver that used buffers are ready.
	Interrupt func()
	// Fail marks the device broken (NEEDS_RESET) after the guest gave it
	// something it cannot process; the error is logged.
	Fail func(error)
}

// Report tells the driver how a round of queue work ended: Fail when err
// is set, else an interrupt when irq says the driver wants one. Devices
// call it after releasing their own lock, since the transport holds its
// lock when it calls into them.
func (a *Activation) Report(irq bool, err error) {
	switch {
	case err != nil:
		a.Fail(err)
	case irq:
		a.Interrupt()
	}
}

// virtio-mmio register offsets (§4.2.2).
const (
	regMagic            = 0x000
	regVersion          = 0x004
	regDeviceID         = 0x008
	regVendorID         = 0x00c
	regDeviceFeatures   = 0x010
	regDeviceFeatSel    = 0x014
	regDriverFeatures   = 0x020
	regDriverFeatSel    = 0x024
	regQueueSel         = 0x030
	regQueueNumMax      = 0x034
	regQueueNum         = 0x038
	regQueueReady       = 0x044
	regQueueNotify      = 0x050
	regInterruptStatus  = 0x060
	regInterruptACK     = 0x064
	regStatus           = 0x070
	regQueueDescLow     = 0x080
	regQueueDescHigh    = 0x084
	regQueueDriverLow   = 0x090
	regQueueDriverHigh  = 0x094
	regQueueDeviceLow   = 0x0a0
	regQueueDeviceHigh  = 0x0a4
	regConfigGeneration = 0x0fc
	regConfig           = 0x100

	mmioMagic   = 0x74726976 // "virt"
	mmioVersion = 2
	vendorID    = 0x41534143 // "CASA"

	// MMIOSize is the address range each device takes.
	MMIOSize = 0x1000

	interruptUsedBuffer   = 1
	interruptConfigChange = 2
)

// QueueNotifyOffset is where the driver writes a queue's index to notify
// it; the VMM can route that write to an ioeventfd instead of exiting.
const QueueNotifyOffset = regQueueNotify

type queueConfig struct {
	num               uint16
	ready             bool
	desc, avail, used uint64
}

// MMIO is the virtio-mmio transport (version 2) for one device: it
// implements the register file the guest driver sees.
type MMIO struct {
	dev Device
	mem *guestmem.Memory
	log *slog.Logger
	irq func() // raises the device's interrupt line

	mu          sync.Mutex
	status      uint32
	devFeatSel  uint32
	drvFeatSel  uint32
	drvFeatures uint64
	queueSel    uint32
	queues      []queueConfig
	interrupt   uint32
	active      bool
	configGen   uint32
	warnings    LogLimit // what the driver makes the transport warn about
	gate        *Gate    // nil: never paused
	live        []*Queue // the queues of the running device
}

// NewMMIO puts dev behind a virtio-mmio register file. irq raises its
// interrupt (edge); log receives errors the guest causes.
func NewMMIO(dev Device, mem *guestmem.Memory, irq func(), log *slog.Logger) *MMIO {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &MMIO{dev: dev, mem: mem, irq: irq, log: log, queues: make([]queueConfig, len(dev.QueueSizes()))}
}

// UseGate puts the device's queues behind g from its next activation on
// (call it before the guest boots).
func (t *MMIO) UseGate(g *Gate) {
	t.mu.Lock()
	t.gate = g
	t.mu.Unlock()
}

// Kick notifies the running device of each of its queues, as the driver
// would: after a Gate opens, a device looks again at the rings it found
// closed.
func (t *MMIO) Kick() {
	t.mu.Lock()
	n := 0
	if t.active && t.status&StatusNeedsReset == 0 {
		n = len(t.live)
	}
	live := t.live
	t.mu.Unlock()
	for i := range n {
		if live[i] != nil {
			t.dev.Notify(i)
		}
	}
}

// releaseQueues tells the gate that the device will return none of the
// chains it holds (it was reset or failed). t.mu is held.
func (t *MMIO) releaseQueues() {
	for _, q := range t.live {
		if q != nil && t.gate != nil {
			t.gate.release(q)
		}
	}
}

func (t *MMIO) features() uint64 { return t.dev.Features() | FeatureVersion1 | FeatureEventIdx }

// Read implements devices.Device for the device's MMIO range.
func (t *MMIO) Read(off uint64, data []byte) {
	clear(data)
	t.mu.Lock()
	defer t.mu.Unlock()
	if off >= regConfig {
		t.dev.ReadConfig(off-regConfig, data)
		return
	}
	if len(data) != 4 || off%4 != 0 {
		return // registers are read as aligned 32-bit words
	}
	var v uint32
	q := t.selected()
	switch off {
	case regMagic:
		v = mmioMagic
	case regVersion:
		v = mmioVersion
	case regDeviceID:
		v = t.dev.Type()
	case regVendorID:
		v = vendorID
	case regDeviceFeatures:
		if t.devFeatSel < 2 {
			v = uint32(t.features() >> (32 * t.devFeatSel))
		}
	case regQueueNumMax:
		if q != nil {
			v = uint32(t.dev.QueueSizes()[t.queueSel])
		}
	case regQueueReady:
		if q != nil && q.ready {
			v = 1
		}
	case regInterruptStatus:
		v = t.interrupt
	case regStatus:
		v = t.status
	case regConfigGeneration:
		v = t.configGen
	}
	binary.LittleEndian.PutUint32(data, v)
}

// selected returns the queue QueueSel names, or nil.
func (t *MMIO) selected() *queueConfig {
	if int(t.queueSel) < len(t.queues) {
		return &t.queues[t.queueSel]
	}
	return nil
}

// Write implements devices.Device for the device's MMIO range.
func (t *MMIO) Write(off uint64, data []byte) {
	if off == regQueueNotify && len(data) == 4 {
		// Not under the lock: the device takes the queue's requests
		// (virtio-9p on this goroutine, others on their own).
		t.Notify(int(binary.LittleEndian.Uint32(data)))
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if off >= regConfig {
		t.dev.WriteConfig(off-regConfig, data)
		return
	}
	if len(data) != 4 || off%4 != 0 {
		return
	}
	v := binary.LittleEndian.Uint32(data)
	q := t.selected()
	// Queue registers may change only while the queue is not ready and the
	// device not running (§4.2.3.2).
	queueWritable := q != nil && !q.ready && !t.active
	setLow := func(p *uint64) { *p = *p&^0xffff_ffff | uint64(v) }
	setHigh := func(p *uint64) { *p = *p&0xffff_ffff | uint64(v)<<32 }
	switch off {
	case regDeviceFeatSel:
		t.devFeatSel = v
	case regDriverFeatures:
		if t.drvFeatSel < 2 && t.status&StatusFeaturesOK == 0 {
			shift := 32 * t.drvFeatSel
			t.drvFeatures = t.drvFeatures&^(0xffff_ffff<<shift) | uint64(v)<<shift
		}
	case regDriverFeatSel:
		t.drvFeatSel = v
	case regQueueSel:
		t.queueSel = v
	case regQueueNum:
		if queueWritable {
			q.num = uint16(min(v, 0xffff))
		}
	case regQueueReady:
		if q != nil && !t.active {
			q.ready = v == 1
		}
	case regInterruptACK:
		t.interrupt &^= v
	case regStatus:
		t.setStatus(v)
	case regQueueDescLow:
		if queueWritable {
			setLow(&q.desc)
		}
	case regQueueDescHigh:
		if queueWritable {
			setHigh(&q.desc)
		}
	case regQueueDriverLow:
		if queueWritable {
			setLow(&q.avail)
		}
	case regQueueDriverHigh:
		if queueWritable {
			setHigh(&q.avail)
		}
	case regQueueDeviceLow:
		if queueWritable {
			setLow(&q.used)
		}
	case regQueueDeviceHigh:
		if queueWritable {
			setHigh(&q.used)
		}
	}
}

// setStatus applies a driver status write (§3.1.1).
func (t *MMIO) setStatus(v uint32) {
	if v == 0 {
		t.reset()
		return
	}
	if v&^t.status&StatusFeaturesOK != 0 {
		// The driver may accept only what was offered, and must accept
		// VERSION_1; otherwise FEATURES_OK does not stick.
		if t.drvFeatures&^t.features() != 0 || t.drvFeatures&FeatureVersion1 == 0 {
			t.warnings.Warn(t.log, "virtio: driver accepted features the device did not offer", "device", t.dev.Type(),
				"offered", fmt.Sprintf("%#x", t.features()), "accepted", fmt.Sprintf("%#x", t.drvFeatures))
			v &^= StatusFeaturesOK
		}
	}
	t.status = v | t.status&StatusNeedsReset
	if v&StatusDriverOK != 0 && !t.active && v&StatusFeaturesOK != 0 {
		t.activate()
	}
}

func (t *MMIO) reset() {
	if t.active {
		t.dev.Reset()
	}
	t.releaseQueues()
	t.live = nil
	t.status, t.devFeatSel, t.drvFeatSel, t.drvFeatures, t.queueSel, t.interrupt = 0, 0, 0, 0, 0, 0
	t.active = false
	clear(t.queues)
}

// activate builds the queues the driver configured and starts the device.
func (t *MMIO) activate() {
	sizes := t.dev.QueueSizes()
	qs := make([]*Queue, len(t.queues))
	for i, c := range t.queues {
		if !c.ready {
			continue
		}
		if c.num > sizes[i] {
			t.failLocked(fmt.Errorf("queue %d: size %d exceeds the maximum %d", i, c.num, sizes[i]))
			return
		}
		q, err := NewQueue(t.mem, c.num, c.desc, c.avail, c.used)
		if err != nil {
			t.failLocked(fmt.Errorf("queue %d: %w", i, err))
			return
		}
		q.SetEventIdx(t.drvFeatures&FeatureEventIdx != 0)
		qs[i] = q
	}
	if err := t.start(qs); err != nil {
		t.failLocked(err)
	}
}

// start runs the device on qs, behind the transport's gate; t.mu is held.
func (t *MMIO) start(qs []*Queue) error {
	for _, q := range qs {
		if q != nil {
			q.gate = t.gate
		}
	}
	err := t.dev.Activate(Activation{
		Mem: t.mem, Queues: qs, Features: t.drvFeatures,
		Interrupt: t.usedBuffer, Fail: t.fail,
	})
	if err != nil {
		return err
	}
	t.active, t.live = true, qs
	return nil
}

// usedBuffer raises the used-buffer interrupt.
func (t *MMIO) usedBuffer() {
	t.mu.Lock()
	t.interrupt |= interruptUsedBuffer
	t.mu.Unlock()
	t.irq()
}

func (t *MMIO) fail(err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.failLocked(err)
}

// failLocked sets NEEDS_RESET and tells the driver through a configuration
// change interrupt (§2.1.2).
func (t *MMIO) failLocked(err error) {
	t.warnings.Warn(t.log, "virtio: device needs reset", "device", t.dev.Type(), "err", err)
	t.status |= StatusNeedsReset
	t.releaseQueues()
	t.interrupt |= interruptConfigChange
	t.configGen++
	t.irq()
}

// Notify passes a queue notification to the running device. The VMM calls
// it from an ioeventfd; MMIO writes to QueueNotify come here too.
func (t *MMIO) Notify(queue int) {
	t.mu.Lock()
	ok := t.active && t.status&StatusNeedsReset == 0 && queue >= 0 && queue < len(t.queues)
	t.mu.Unlock()
	if ok {
		t.dev.Notify(queue)
	}
}

// NumQueues is the number of queues the device has.
func (t *MMIO) NumQueues() int { return len(t.queues) }

// Status returns the device status register.
func (t *MMIO) Status() uint32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.status
}

// Type is the device's type (DeviceID).
func (t *MMIO) Type() uint32 { return t.dev.Type() }

// Close stops the device if it is running (the VM is going away).
func (t *MMIO) Close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.active {
		t.dev.Reset()
		t.active = false
	}
	t.releaseQueues()
	t.live = nil
}

// TransportDebug is a transport's state for diagnostics: the registers the
// driver set and, for each ready queue, the ring indices as they are in
// guest memory now.
type TransportDebug struct {
	Name      string
	Type      uint32
	Status    uint32
	Interrupt uint32 // InterruptStatus: bits raised and not yet acknowledged
	Active    bool
	Queues    []QueueDebug
}

// QueueDebug is one queue's indices. A driver waiting on a device shows
// AvailIdx ahead of UsedIdx; NoInterrupt is the driver's
// VIRTQ_AVAIL_F_NO_INTERRUPT.
type QueueDebug struct {
	Index             int
	Size              uint16
	Ready             bool
	AvailIdx, UsedIdx uint16
	NoInterrupt       bool
	Desc, Avail, Used uint64
	Err               error
}

func (d TransportDebug) String() string {
	s := fmt.Sprintf("%s: type %d status %#x interrupt %#x active %v", d.Name, d.Type, d.Status, d.Interrupt, d.Active)
	for _, q := range d.Queues {
		if !q.Ready {
			continue
		}
		s += fmt.Sprintf("\n  queue %d: size %d avail.idx %d used.idx %d no_interrupt %v (desc %#x avail %#x used %#x)",
			q.Index, q.Size, q.AvailIdx, q.UsedIdx, q.NoInterrupt, q.Desc, q.Avail, q.Used)
		if q.Err != nil {
			s += fmt.Sprintf(" (%v)", q.Err)
		}
	}
	return s
}

// Debug reports the transport's registers and its queues' indices.
func (t *MMIO) Debug(name string) TransportDebug {
	t.mu.Lock()
	defer t.mu.Unlock()
	d := TransportDebug{Name: name, Type: t.dev.Type(), Status: t.status, Interrupt: t.interrupt, Active: t.active}
	for i, c := range t.queues {
		q := QueueDebug{Index: i, Size: c.num, Ready: c.ready, Desc: c.desc, Avail: c.avail, Used: c.used}
		if c.ready {
			var err1, err2, err3 error
			var flags uint16
			flags, err1 = t.mem.LoadUint16(c.avail)
			q.AvailIdx, err2 = t.mem.LoadUint16(c.avail + 2)
			q.UsedIdx, err3 = t.mem.LoadUint16(c.used + 2)
			q.NoInterrupt = flags&availFNoInterrupt != 0
			q.Err = errors.Join(err1, err2, err3)
		}
		d.Queues = append(d.Queues, q)
	}
	return d
}

// CheckTag checks the mount tag of a file-sharing device (dev names it in
// errors): 1 to max bytes of printable ASCII without spaces, which the
// guest's init passes on its kernel command line.
func CheckTag(dev, tag string, max int) error {
	if tag == "" || len(tag) > max {
		return fmt.Errorf("%s: mount tag %q: must be 1 to %d bytes", dev, tag, max)
	}
	for _, r := range tag {
		if r <= ' ' || r > '~' {
			return fmt.Errorf("%s: mount tag %q: only printable ASCII without spaces", dev, tag)
		}
	}
	return nil
}
