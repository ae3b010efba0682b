// Package virtionet is the virtio-net device (virtio 1.2 §5.1): one receive
// and one transmit queue connecting the guest's NIC to a Backend, the
// network it is plugged into (netstack.Stack in capsa).
//
// The device offers no offloads: no checksum, no segmentation, no mergeable
// receive buffers, no control queue. Every buffer therefore holds one
// struct virtio_net_hdr (12 bytes: VERSION_1 is always negotiated) followed
// by one plain Ethernet frame, and the backend sees frames without the
// virtio header.
//
// The guest is hostile. A transmitted frame that is too short, too long or
// asks for an offload is dropped and counted, and the next one is served; a
// guest that breaks a queue's rings gets the device marked NEEDS_RESET.
// Neither stops the VMM. Frames for the guest wait in a small bounded
// backlog while it has posted no receive buffers; beyond it they are
// dropped, as a NIC with a full ring would.
package virtionet

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"

	"github.com/capsa-sandbox/capsa/virtio"
)

// Backend is the network the NIC is plugged into (netstack.Stack implements
// it). Both methods may be called concurrently with each other.
type Backend interface {
	// DeliverFrame takes an Ethernet frame the guest sent. The backend
	// copies it; the device reuses the slice afterwards. Errors are
	// counted and logged, never fatal.
	DeliverFrame(frame []byte) error
	// ReadFrame blocks for the next Ethernet frame for the guest. The
	// device owns the returned slice and does not modify it. It returns an
	// error when ctx ends or the backend is closed; the device then stops
	// receiving until its next activation.
	ReadFrame(ctx context.Context) ([]byte, error)
}

// Sizes and limits.
const (
	queueSize = 256
	// hdrLen is struct virtio_net_hdr with num_buffers, the layout under
	// VERSION_1 (§5.1.6).
	hdrLen = 12
	// ethHdrLen is the Ethernet header: destination, source, type.
	ethHdrLen = 14
	// vlanLen is an 802.1Q tag, which a guest may add to an MTU-sized
	// frame.
	vlanLen = 4
	// maxBacklog is how many frames for the guest wait for receive
	// buffers; more are dropped.
	maxBacklog = 256
	// txBatch is how many transmitted frames the device copies out of the
	// guest before handing them to the backend.
	txBatch = 64

	rxQueue = 0
	txQueue = 1
)

// The MTUs New accepts: 68 is the least an IPv4 host must support, and the
// config space's mtu field is 16 bits.
const (
	MinMTU = 68
	MaxMTU = 65535
)

// Feature bits (§5.1.3).
const (
	featureMTU    = 1 << 3  // VIRTIO_NET_F_MTU
	featureMAC    = 1 << 5  // VIRTIO_NET_F_MAC
	featureStatus = 1 << 16 // VIRTIO_NET_F_STATUS

	statusLinkUp = 1 // VIRTIO_NET_S_LINK_UP
)

// Header fields (§5.1.6).
const (
	hdrFlags      = 0 // u8
	hdrGSOType    = 1 // u8
	hdrNumBuffers = 10
)

// Errors for a dropped transmitted frame.
var (
	errShortChain = errors.New("chain shorter than the virtio-net header")
	errOffload    = errors.New("header asks for an offload that was not offered")
	errRunt       = errors.New("frame shorter than an Ethernet header")
	errOversize   = errors.New("frame longer than the MTU allows")
)

// rxHeader is what precedes every frame the guest receives: no flags, no
// GSO, one buffer.
var rxHeader = func() (h [hdrLen]byte) {
	binary.LittleEndian.PutUint16(h[hdrNumBuffers:], 1)
	return h
}()

// Stats counts the frames the device moved or dropped.
type Stats struct {
	RxFrames, RxBytes uint64 // frames (and their bytes) delivered to the guest
	// RxDropped are frames for the guest that were dropped: the backlog
	// was full, the guest's buffer was too small, the frame's size was
	// out of range, or the device was reset before the guest took them.
	RxDropped         uint64
	TxFrames, TxBytes uint64 // frames (and their bytes) the backend accepted
	TxDropped         uint64 // malformed frames from the guest
	TxErrors          uint64 // frames the backend refused
}

// Device is a virtio-net device. Its methods are safe for concurrent use.
type Device struct {
	mac      net.HardwareAddr
	mtu      uint16
	maxFrame int // the longest Ethernet frame either way
	backend  Backend
	log      *slog.Logger

	mu     sync.Mutex
	run    *run // nil unless the driver has started the device
	closed bool
	// lastReader is closed when the previous activation's reader has
	// returned: two readers never call ReadFrame at once.
	lastReader chan struct{}
	workers    sync.WaitGroup

	rxFrames, rxBytes, rxDropped        atomic.Uint64
	txFrames, txBytes, txDropped, txErr atomic.Uint64
}

// run is one activation: from DRIVER_OK to reset.
type run struct {
	act    virtio.Activation
	ctx    context.Context // ends at reset; ReadFrame watches it
	cancel context.CancelFunc
	stop   chan struct{} // closed at reset; the workers watch it
	rxKick chan struct{}
	txKick chan struct{}
	reader chan struct{} // closed when this run's reader returns

	// Under Device.mu:
	backlog backlog
}

// New returns a virtio-net device with the given MAC address and MTU,
// plugged into b. log receives the errors the guest causes.
func New(mac net.HardwareAddr, mtu uint16, b Backend, log *slog.Logger) (*Device, error) {
	if len(mac) != 6 {
		return nil, fmt.Errorf("virtio-net: MAC address %q: must be 6 bytes, not %d", mac, len(mac))
	}
	if mac[0]&1 != 0 {
		return nil, fmt.Errorf("virtio-net: MAC address %s: must be unicast, not multicast", mac)
	}
	if mtu < MinMTU {
		return nil, fmt.Errorf("virtio-net: MTU %d: must be between %d and %d", mtu, MinMTU, MaxMTU)
	}
	if b == nil {
		return nil, errors.New("virtio-net: no backend")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Device{
		mac: append(net.HardwareAddr(nil), mac...), mtu: mtu,
		maxFrame: ethHdrLen + vlanLen + int(mtu),
		backend:  b,
		log:      log.With("dev", "net", "mac", mac.String()),
	}, nil
}

// MAC is the device's MAC address.
func (d *Device) MAC() net.HardwareAddr { return append(net.HardwareAddr(nil), d.mac...) }

// MTU is the device's MTU.
func (d *Device) MTU() uint16 { return d.mtu }

// Stats returns the device's counters.
func (d *Device) Stats() Stats {
	return Stats{
		RxFrames: d.rxFrames.Load(), RxBytes: d.rxBytes.Load(), RxDropped: d.rxDropped.Load(),
		TxFrames: d.txFrames.Load(), TxBytes: d.txBytes.Load(),
		TxDropped: d.txDropped.Load(), TxErrors: d.txErr.Load(),
	}
}

// Type implements virtio.Device.
func (d *Device) Type() uint32 { return virtio.TypeNet }

// Features implements virtio.Device: a MAC address, an MTU and a link
// status; no offloads.
func (d *Device) Features() uint64 { return featureMAC | featureMTU | featureStatus }

// QueueSizes implements virtio.Device: receiveq and transmitq.
func (d *Device) QueueSizes() []uint16 { return []uint16{queueSize, queueSize} }

// ReadConfig implements virtio.Device: mac[6], le16 status (link up), le16
// max_virtqueue_pairs (1), le16 mtu; zero beyond.
func (d *Device) ReadConfig(off uint64, data []byte) {
	var cfg [12]byte
	copy(cfg[0:6], d.mac)
	binary.LittleEndian.PutUint16(cfg[6:], statusLinkUp)
	binary.LittleEndian.PutUint16(cfg[8:], 1)
	binary.LittleEndian.PutUint16(cfg[10:], d.mtu)
	clear(data)
	if off < uint64(len(cfg)) {
		copy(data, cfg[off:])
	}
}

// WriteConfig implements virtio.Device: the config space is read-only
// (the MAC is writable only with VIRTIO_NET_F_CTRL_MAC_ADDR, not offered).
func (d *Device) WriteConfig(uint64, []byte) {}

// Activate implements virtio.Device: the device starts moving frames.
func (d *Device) Activate(a virtio.Activation) error {
	if len(a.Queues) != 2 || a.Queues[rxQueue] == nil || a.Queues[txQueue] == nil {
		return errors.New("virtio-net: the driver did not set up the receive and transmit queues")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errors.New("virtio-net: device closed")
	}
	d.stopLocked() // the transport resets before activating again; be sure
	ctx, cancel := context.WithCancel(context.Background())
	r := &run{
		act: a, ctx: ctx, cancel: cancel,
		stop:   make(chan struct{}),
		rxKick: make(chan struct{}, 1),
		txKick: make(chan struct{}, 1),
		reader: make(chan struct{}),
	}
	d.run = r
	prev := d.lastReader
	d.lastReader = r.reader
	d.workers.Add(3)
	go d.reader(r, prev)
	go d.rxWorker(r)
	go d.txWorker(r)
	// Frames and receive buffers the guest queued before DRIVER_OK came
	// with notifications the transport could not pass on.
	kick(r.txKick)
	kick(r.rxKick)
	return nil
}

// Reset implements virtio.Device: the device stops and forgets its queues
// and the frames waiting for the guest. It does not wait for its
// goroutines, which may be inside the backend; they touch the queues no
// more.
func (d *Device) Reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stopLocked()
}

// Close stops the device for good and waits for its goroutines. It is
// idempotent.
func (d *Device) Close() error {
	d.mu.Lock()
	d.closed = true
	d.stopLocked()
	d.mu.Unlock()
	d.workers.Wait()
	return nil
}

// Notify implements virtio.Device: receive buffers or transmitted frames
// are available.
func (d *Device) Notify(queue int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.run == nil {
		return
	}
	switch queue {
	case rxQueue:
		kick(d.run.rxKick)
	case txQueue:
		kick(d.run.txKick)
	}
}

func kick(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// stopLocked ends the current run; d.mu is held.
func (d *Device) stopLocked() {
	r := d.run
	if r == nil {
		return
	}
	r.cancel()
	close(r.stop)
	d.rxDropped.Add(uint64(r.backlog.n))
	r.backlog = backlog{}
	d.run = nil
}

// finish calls back into the transport after a run's queues were used:
// Fail after a queue error (which also stops the run), else Interrupt if
// the driver wants one. d.mu is held on entry and released: the transport
// holds its own lock when it calls Reset, so the device must not hold d.mu
// while calling it.
func (d *Device) finish(r *run, irq bool, err error) {
	if err != nil {
		d.stopLocked()
	}
	d.mu.Unlock()
	r.act.Report(irq, err)
}

// reader takes frames for the guest from the backend, queues them and
// passes what it can to the guest at once.
func (d *Device) reader(r *run, prev chan struct{}) {
	defer d.workers.Done()
	defer close(r.reader)
	if prev != nil {
		select {
		case <-prev:
		case <-r.ctx.Done():
			return
		}
	}
	for {
		frame, err := d.backend.ReadFrame(r.ctx)
		if err != nil {
			if r.ctx.Err() == nil {
				d.log.Warn("virtio-net: backend stopped; receiving stops", "err", err)
			}
			return
		}
		d.mu.Lock()
		if d.run != r {
			d.mu.Unlock()
			d.rxDropped.Add(1)
			return
		}
		switch {
		case len(frame) < ethHdrLen || len(frame) > d.maxFrame:
			d.log.Debug("virtio-net: dropped a frame for the guest of bad size", "len", len(frame))
			d.rxDropped.Add(1)
		case !r.backlog.push(frame):
			d.rxDropped.Add(1) // tail drop
		}
		irq, err := d.fillRx(r)
		d.finish(r, irq, err)
	}
}

// rxWorker passes waiting frames to the guest when it adds receive
// buffers.
func (d *Device) rxWorker(r *run) {
	defer d.workers.Done()
	for {
		select {
		case <-r.stop:
			return
		case <-r.rxKick:
		}
		d.mu.Lock()
		if d.run != r {
			d.mu.Unlock()
			return
		}
		irq, err := d.fillRx(r)
		d.finish(r, irq, err)
	}
}

// fillRx writes waiting frames into the guest's receive buffers while it
// has some. It reports whether to interrupt the guest; an error means the
// guest broke the queue. d.mu is held and r is the current run.
func (d *Device) fillRx(r *run) (bool, error) {
	q := r.act.Queues[rxQueue]
	irq := false
	for r.backlog.n > 0 {
		c, err := q.Next()
		if err != nil {
			return irq, fmt.Errorf("virtio-net: receive queue: %w", err)
		}
		if c == nil {
			return irq, nil // the guest notifies when it adds buffers
		}
		room := c.WritableLen()
		var frame []byte
		empty := true // the buffer goes back without a frame
		switch {
		case room < hdrLen+ethHdrLen:
			// No frame fits: give the buffer back empty rather than
			// let it wedge receiving.
			d.log.Debug("virtio-net: receive buffer too small for any frame", "room", room)
		case room < hdrLen+r.backlog.peekLen():
			// Never truncated: the frame goes, and the buffer goes back
			// empty (the driver counts a length error and posts it
			// again). Not kept for the next frame: a device holds no
			// chain it is not working on, so a pause's drain of the
			// queues (virtio.Gate) never waits on one.
			frame = r.backlog.pop()
			d.log.Debug("virtio-net: dropped a frame larger than the guest's buffer", "len", len(frame), "room", room)
			d.rxDropped.Add(1)
		default:
			frame, empty = r.backlog.pop(), false
		}
		if empty {
			more, err := q.Push(c)
			if err != nil {
				return irq, fmt.Errorf("virtio-net: receive queue: %w", err)
			}
			irq = irq || more
			continue
		}
		c.Write(rxHeader[:]) // cannot be short: the room was checked
		c.Write(frame)
		more, err := q.Push(c)
		if err != nil {
			return irq, fmt.Errorf("virtio-net: receive queue: %w", err)
		}
		irq = irq || more
		d.rxFrames.Add(1)
		d.rxBytes.Add(uint64(len(frame)))
	}
	return irq, nil
}

// txWorker takes the frames the guest sends and gives them to the backend,
// outside d.mu: the backend may take its time.
func (d *Device) txWorker(r *run) {
	defer d.workers.Done()
	bufs := make([][]byte, txBatch)
	for {
		select {
		case <-r.stop:
			return
		case <-r.txKick:
		}
		for more := true; more; {
			var frames [][]byte
			frames, more = d.takeTx(r, bufs)
			for _, f := range frames {
				if err := d.backend.DeliverFrame(f); err != nil {
					d.log.Debug("virtio-net: backend refused a frame", "len", len(f), "err", err)
					d.txErr.Add(1)
					continue
				}
				d.txFrames.Add(1)
				d.txBytes.Add(uint64(len(f)))
			}
		}
	}
}

// takeTx copies up to txBatch frames out of the transmit queue into bufs
// and returns the chains to the guest. more says the batch was full, so
// more may be waiting.
func (d *Device) takeTx(r *run, bufs [][]byte) (frames [][]byte, more bool) {
	d.mu.Lock()
	if d.run != r {
		d.mu.Unlock()
		return nil, false
	}
	q := r.act.Queues[txQueue]
	irq := false
	var err error
	for len(frames) < txBatch {
		var c *virtio.Chain
		if c, err = q.Next(); err != nil || c == nil {
			break
		}
		i := len(frames)
		f, ferr := d.readFrame(c, &bufs[i])
		var want bool
		if want, err = q.Push(c); err != nil {
			break
		}
		irq = irq || want
		if ferr != nil {
			d.log.Debug("virtio-net: dropped a frame from the guest", "err", ferr)
			d.txDropped.Add(1)
			continue
		}
		frames = append(frames, f)
	}
	if err != nil {
		err = fmt.Errorf("virtio-net: transmit queue: %w", err)
	}
	more = err == nil && len(frames) == txBatch
	d.finish(r, irq, err)
	return frames, more
}

// readFrame checks a transmitted chain's header and copies its frame into
// *buf, which it grows as needed.
func (d *Device) readFrame(c *virtio.Chain, buf *[]byte) ([]byte, error) {
	n := c.ReadableLen()
	if n < hdrLen {
		return nil, fmt.Errorf("%w: %d bytes", errShortChain, n)
	}
	n -= hdrLen
	if n < ethHdrLen {
		return nil, fmt.Errorf("%w: %d bytes", errRunt, n)
	}
	if n > d.maxFrame {
		return nil, fmt.Errorf("%w: %d bytes, at most %d for MTU %d", errOversize, n, d.maxFrame, d.mtu)
	}
	var h [hdrLen]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return nil, fmt.Errorf("%w: %v", errShortChain, err)
	}
	// Without VIRTIO_NET_F_CSUM and the GSO features the driver can ask
	// for nothing; the other fields are meaningless and ignored.
	if h[hdrFlags] != 0 || h[hdrGSOType] != 0 {
		return nil, fmt.Errorf("%w: flags %#x, gso_type %#x", errOffload, h[hdrFlags], h[hdrGSOType])
	}
	if cap(*buf) < n {
		*buf = make([]byte, n, max(n, 2048))
	}
	f := (*buf)[:n]
	if _, err := io.ReadFull(c, f); err != nil {
		return nil, fmt.Errorf("%w: %v", errShortChain, err) // cannot happen: the length was checked
	}
	return f, nil
}

// backlog is a bounded FIFO of frames for the guest.
type backlog struct {
	frames [][]byte // a ring of maxBacklog, allocated on first use
	head   int
	n      int
}

// push appends f, or reports false when the backlog is full.
func (b *backlog) push(f []byte) bool {
	if b.n == maxBacklog {
		return false
	}
	if b.frames == nil {
		b.frames = make([][]byte, maxBacklog)
	}
	b.frames[(b.head+b.n)%maxBacklog] = f
	b.n++
	return true
}

// peekLen is the oldest frame's length; the backlog is not empty.
func (b *backlog) peekLen() int { return len(b.frames[b.head]) }

// pop removes the oldest frame; the backlog is not empty.
func (b *backlog) pop() []byte {
	f := b.frames[b.head]
	b.frames[b.head] = nil
	b.head = (b.head + 1) % maxBacklog
	b.n--
	return f
}
