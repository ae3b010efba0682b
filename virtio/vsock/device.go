package vsock

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/internal/strictjson"
	"github.com/capsa-sandbox/capsa/virtio"
)

// Limits on what a guest can make the host hold.
const (
	queueSize      = 256
	rxBufSize      = 256 << 10 // per connection: guest data not yet read by the host
	txBufSize      = 256 << 10 // per connection: host data not yet sent to the guest
	maxConns       = 1024
	maxAcceptQueue = 64
	maxCtrlQueue   = 1024
	closeTimeout   = 5 * time.Second
	firstHostPort  = 1 << 30   // local ports for host-initiated connections
	portAny        = 1<<32 - 1 // VMADDR_PORT_ANY: never a connection's port
)

// Errors a connection reports.
var (
	ErrConnRefused = errors.New("vsock: connection refused")
	ErrConnReset   = errors.New("vsock: connection reset by peer")
	ErrDeviceDown  = errors.New("vsock: device not running")
)

type connKey struct{ host, guest uint32 } // host (local) port, guest port

type connState int

const (
	stateConnecting connState = iota
	stateEstablished
	stateClosed
)

// Device is the virtio-vsock device. Its methods are safe for concurrent use.
type Device struct {
	guestCID uint64
	log      *slog.Logger

	mu        sync.Mutex
	act       *virtio.Activation // nil unless the driver has started the device
	conns     map[connKey]*Conn
	listeners map[uint32]*Listener
	ctrl      []header // control packets waiting for rx buffers
	nextPort  uint32
	kick      chan struct{}
	stop      chan struct{}
	// resetUntil, while set, is when the guest is assumed to have handled
	// the transport reset a restore told it of: until it posts its event
	// buffer again (or then), nothing goes to it, since a connection
	// request it took before the reset would be reset with the others.
	resetUntil time.Time
	onReset    func(handled bool) // OnResetHandled's, or nil
	resetAvail uint16             // the event queue's available index after the reset
	// fallback, when set, is offered guest connections to ports nobody
	// listens on (the hybrid-vsock Unix socket uses it). It is called with
	// mu held and must not block; false refuses the connection.
	fallback func(port uint32, c *Conn) bool
}

// New returns a vsock device for a guest with context id cid (3 or more).
func New(cid uint64, log *slog.Logger) (*Device, error) {
	if cid < 3 || cid > 0xffff_ffff {
		return nil, fmt.Errorf("vsock: guest CID %d: must be between 3 and 2^32-1", cid)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Device{
		guestCID: cid, log: log,
		conns: map[connKey]*Conn{}, listeners: map[uint32]*Listener{},
		nextPort: firstHostPort,
	}, nil
}

// GuestCID is the guest's context id.
func (d *Device) GuestCID() uint64 { return d.guestCID }

// Type implements virtio.Device.
func (d *Device) Type() uint32 { return virtio.TypeVsock }

// Features implements virtio.Device: stream sockets only.
func (d *Device) Features() uint64 { return 0 }

// QueueSizes implements virtio.Device: rx, tx and event queues.
func (d *Device) QueueSizes() []uint16 { return []uint16{queueSize, queueSize, queueSize} }

// ReadConfig implements virtio.Device: the config space is the guest CID.
func (d *Device) ReadConfig(off uint64, data []byte) {
	var cfg [8]byte
	binary.LittleEndian.PutUint64(cfg[:], d.guestCID)
	if off < uint64(len(cfg)) {
		copy(data, cfg[off:])
	}
}

// WriteConfig implements virtio.Device: the config space is read-only.
func (d *Device) WriteConfig(uint64, []byte) {}

// Activate implements virtio.Device.
func (d *Device) Activate(a virtio.Activation) error {
	if len(a.Queues) != 3 || a.Queues[0] == nil || a.Queues[1] == nil {
		return errors.New("vsock: the driver did not set up the rx and tx queues")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.act = &a
	d.kick = make(chan struct{}, 1)
	d.stop = make(chan struct{})
	go d.worker(d.kick, d.stop)
	// Buffers the driver made available before DRIVER_OK came with
	// notifications the transport could not pass on: look at once.
	d.wake()
	return nil
}

// Reset implements virtio.Device: every connection is reset.
func (d *Device) Reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.act == nil {
		return
	}
	d.teardown()
}

// Notify implements virtio.Device.
func (d *Device) Notify(int) {
	d.mu.Lock()
	d.wake()
	d.mu.Unlock()
}

// resetDone reports whether the guest has handled a transport reset, if
// one is pending: it posted its event buffer again, or the time allowed
// passed. d.mu is held.
func (d *Device) resetDone() bool {
	if d.resetUntil.IsZero() {
		return true
	}
	idx, err := d.act.Queues[2].WatchAvail()
	if err == nil && idx == d.resetAvail && time.Now().Before(d.resetUntil) {
		return false
	}
	d.resetUntil = time.Time{}
	if f := d.onReset; f != nil {
		f(err == nil && idx != d.resetAvail)
	}
	return true
}

// OnResetHandled has f called once the guest has handled a restore's
// transport reset (handled), or the time allowed for it passed (not),
// for the restore's timeline. Set it before the device runs.
func (d *Device) OnResetHandled(f func(handled bool)) {
	d.mu.Lock()
	d.onReset = f
	d.mu.Unlock()
}

// wake makes the worker run; d.mu is held.
func (d *Device) wake() {
	if d.kick != nil {
		select {
		case d.kick <- struct{}{}:
		default:
		}
	}
}

// worker processes the queues whenever kicked. It calls back into the
// transport (Interrupt, Fail) only after releasing d.mu: the transport holds
// its own lock when it calls Reset.
func (d *Device) worker(kick, stop chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-kick:
		}
		d.mu.Lock()
		act := d.act
		var irq bool
		var err error
		if act != nil {
			if irq, err = d.process(); err != nil {
				d.teardown()
			}
		}
		d.mu.Unlock()
		act.Report(irq, err)
	}
}

// process handles everything the guest sent, then sends what it can. It
// reports whether to interrupt the guest; an error means the guest broke a
// queue.
func (d *Device) process() (bool, error) {
	irq := false
	tx := d.act.Queues[1]
	for {
		c, err := tx.Next()
		if err != nil || c == nil {
			if err != nil {
				return false, err
			}
			break
		}
		d.receive(c)
		more, err := tx.Push(c)
		if err != nil {
			return false, err
		}
		irq = irq || more
	}
	if !d.resetDone() {
		return irq, nil
	}
	more, err := d.transmit()
	return irq || more, err
}

// teardown stops the device after a queue error: every connection resets.
func (d *Device) teardown() {
	close(d.stop)
	d.act = nil
	for _, c := range d.conns {
		c.fail(ErrConnReset)
	}
	clear(d.conns)
	d.ctrl = nil
}

// receive handles one packet the guest sent.
func (d *Device) receive(c *virtio.Chain) {
	var hb [hdrSize]byte
	if _, err := io.ReadFull(c, hb[:]); err != nil {
		d.log.Debug("vsock: dropped a packet", "err", errShortHeader)
		return
	}
	h, err := parseHeader(hb[:])
	if err != nil {
		d.log.Debug("vsock: dropped a packet", "err", err)
		d.rstReply(h)
		return
	}
	if h.SrcCID != d.guestCID || h.DstCID != HostCID {
		d.log.Debug("vsock: dropped a misaddressed packet", "src", h.SrcCID, "dst", h.DstCID)
		return
	}
	var payload []byte
	if h.Op == opRW && h.Len > 0 {
		payload = make([]byte, h.Len)
		if _, err := io.ReadFull(c, payload); err != nil {
			d.log.Debug("vsock: packet data shorter than its header says", "len", h.Len)
			d.rstReply(h)
			return
		}
	}
	if h.Type != typeStream {
		d.rstReply(h)
		return
	}
	key := connKey{host: h.DstPort, guest: h.SrcPort}
	conn := d.conns[key]
	if h.Op == opRequest {
		d.accept(h, key, conn)
		return
	}
	if conn == nil {
		if h.Op != opRst {
			d.rstReply(h)
		}
		return
	}
	conn.peerBufAlloc, conn.peerFwdCnt = h.BufAlloc, h.FwdCnt
	switch h.Op {
	case opResponse:
		if conn.state != stateConnecting {
			d.resetConn(conn, true)
			return
		}
		conn.state = stateEstablished
		conn.cond.Broadcast()
	case opRst:
		d.resetConn(conn, false)
	case opShutdown:
		conn.peerShutdown |= h.Flags & (shutdownRcv | shutdownSend)
		conn.cond.Broadcast()
		if conn.peerShutdown == shutdownRcv|shutdownSend {
			// The guest closed: acknowledge with RST, as Linux does, and
			// keep what it sent readable.
			d.queueCtrl(conn.hdr(opRst, 0))
			d.forget(conn)
		}
	case opRW:
		if conn.state != stateEstablished {
			d.resetConn(conn, true)
			return
		}
		if len(conn.rx)+len(payload) > rxBufSize {
			d.log.Debug("vsock: guest sent more than its credit; resetting", "port", key.host)
			d.resetConn(conn, true)
			return
		}
		if conn.closed || conn.shutRead {
			conn.fwdCnt += uint32(len(payload)) // nobody will read it
		} else {
			conn.rx = append(conn.rx, payload...)
		}
		conn.cond.Broadcast()
	case opCreditUpdate:
		conn.cond.Broadcast()
	case opCreditRequest:
		conn.creditOwed = true
	default:
		d.resetConn(conn, true)
	}
}

// accept handles a guest's connection request.
func (d *Device) accept(h header, key connKey, existing *Conn) {
	if existing != nil {
		d.resetConn(existing, true)
		return
	}
	l := d.listeners[h.DstPort]
	full := len(d.conns) >= maxConns
	if l == nil && d.fallback != nil && !full {
		c := d.newConn(key, stateEstablished)
		c.peerBufAlloc, c.peerFwdCnt = h.BufAlloc, h.FwdCnt
		if d.fallback(h.DstPort, c) {
			d.queueCtrl(c.hdr(opResponse, 0))
		} else {
			d.forget(c)
			d.rstReply(h)
		}
		return
	}
	if l == nil || l.closed || len(l.pending) >= maxAcceptQueue || full {
		d.rstReply(h)
		return
	}
	c := d.newConn(key, stateEstablished)
	c.peerBufAlloc, c.peerFwdCnt = h.BufAlloc, h.FwdCnt
	d.queueCtrl(c.hdr(opResponse, 0))
	l.pending = append(l.pending, c)
	l.cond.Broadcast()
}

func (d *Device) newConn(key connKey, st connState) *Conn {
	c := &Conn{dev: d, key: key, state: st}
	c.cond = sync.NewCond(&d.mu)
	d.conns[key] = c
	return c
}

// rstReply answers a packet with RST, swapping its addresses.
func (d *Device) rstReply(h header) {
	if h.Op == opRst {
		return
	}
	d.queueCtrl(header{SrcCID: HostCID, DstCID: d.guestCID, SrcPort: h.DstPort, DstPort: h.SrcPort, Type: typeStream, Op: opRst})
}

func (d *Device) queueCtrl(h header) {
	if len(d.ctrl) >= maxCtrlQueue {
		d.log.Debug("vsock: control queue full; dropping", "op", opName(h.Op))
		return
	}
	d.ctrl = append(d.ctrl, h)
}

// resetConn ends a connection; sendRst says whether to tell the guest.
func (d *Device) resetConn(c *Conn, sendRst bool) {
	if sendRst {
		d.queueCtrl(c.hdr(opRst, 0))
	}
	c.fail(ErrConnReset)
	d.forget(c)
}

func (d *Device) forget(c *Conn) {
	if d.conns[c.key] == c {
		delete(d.conns, c.key)
	}
	if c.closeTimer != nil {
		c.closeTimer.Stop()
	}
}

// outgoing is the next packet to send.
type outgoing struct {
	h    header
	conn *Conn // nil for a control packet about no live connection
	data int   // payload bytes available from conn.tx (RW)
	ctrl bool  // taken from the control queue
}

// transmit fills rx buffers with control packets, then data and credit
// updates, while the guest provides buffers. It reports whether the guest
// should be interrupted.
func (d *Device) transmit() (bool, error) {
	rx := d.act.Queues[0]
	irq := false
	for {
		o, ok := d.nextOutgoing()
		if !ok {
			return irq, nil
		}
		c, err := rx.Next()
		if err != nil {
			return irq, err
		}
		if c == nil {
			return irq, nil // no buffers: the guest notifies when it adds some
		}
		if c.WritableLen() < hdrSize {
			return irq, fmt.Errorf("vsock: rx buffer of %d bytes cannot hold a header", c.WritableLen())
		}
		n := min(o.data, c.WritableLen()-hdrSize)
		o.h.Len = uint32(n)
		if o.conn != nil {
			o.h.BufAlloc, o.h.FwdCnt = rxBufSize, o.conn.fwdCnt
		}
		var hb [hdrSize]byte
		o.h.marshal(hb[:])
		c.Write(hb[:])
		if n > 0 {
			c.Write(o.conn.tx[:n])
			o.conn.tx = o.conn.tx[n:]
			if len(o.conn.tx) == 0 {
				o.conn.tx = nil
			}
			o.conn.txCnt += uint32(n)
			o.conn.cond.Broadcast()
		}
		d.sent(o)
		more, err := rx.Push(c)
		if err != nil {
			return irq, err
		}
		irq = irq || more
	}
}

// nextOutgoing picks the next packet: a control packet, else data the guest
// has credit for, else a pending shutdown or credit update.
func (d *Device) nextOutgoing() (outgoing, bool) {
	if len(d.ctrl) > 0 {
		h := d.ctrl[0]
		return outgoing{h: h, conn: d.conns[connKey{host: h.SrcPort, guest: h.DstPort}], ctrl: true}, true
	}
	for _, c := range d.conns {
		if c.state != stateEstablished {
			continue
		}
		if n := min(len(c.tx), int(c.credit()), maxPayload); n > 0 && c.peerShutdown&shutdownRcv == 0 {
			return outgoing{h: c.hdr(opRW, 0), conn: c, data: n}, true
		}
		if len(c.tx) == 0 && c.wantShutdown != 0 && !c.shutdownSent {
			return outgoing{h: c.hdr(opShutdown, c.wantShutdown), conn: c}, true
		}
		if c.creditOwed || c.fwdCnt-c.lastFwdSent >= rxBufSize/2 {
			return outgoing{h: c.hdr(opCreditUpdate, 0), conn: c}, true
		}
	}
	return outgoing{}, false
}

// sent records that o went to the guest.
func (d *Device) sent(o outgoing) {
	if o.ctrl {
		d.ctrl = d.ctrl[1:]
	}
	c := o.conn
	if c == nil {
		return
	}
	c.lastFwdSent = c.fwdCnt // every packet carries the credit
	c.creditOwed = false
	if o.h.Op == opShutdown && !o.ctrl {
		c.shutdownSent = true
		if c.wantShutdown == shutdownRcv|shutdownSend {
			// Wait for the guest's RST, but not forever.
			c.closeTimer = time.AfterFunc(closeTimeout, func() {
				d.mu.Lock()
				defer d.mu.Unlock()
				if d.conns[c.key] == c {
					d.resetConn(c, true)
					d.wake()
				}
			})
		}
	}
}

// Dial connects to a guest listening on port.
func (d *Device) Dial(ctx context.Context, port uint32) (*Conn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.act == nil {
		return nil, ErrDeviceDown
	}
	if len(d.conns) >= maxConns {
		return nil, fmt.Errorf("vsock: dial port %d: too many connections", port)
	}
	var key connKey
	for {
		key = connKey{host: d.nextPort, guest: port}
		d.nextPort++
		if d.nextPort == portAny {
			d.nextPort = firstHostPort
		}
		if d.conns[key] == nil {
			break
		}
	}
	c := d.newConn(key, stateConnecting)
	d.queueCtrl(c.hdr(opRequest, 0))
	d.wake()
	stop := context.AfterFunc(ctx, func() {
		d.mu.Lock()
		c.cond.Broadcast()
		d.mu.Unlock()
	})
	defer stop()
	for c.state == stateConnecting && c.err == nil && ctx.Err() == nil {
		c.cond.Wait()
	}
	switch {
	case c.err == ErrConnReset:
		return nil, fmt.Errorf("vsock: dial guest port %d: %w", port, ErrConnRefused)
	case c.err != nil:
		return nil, fmt.Errorf("vsock: dial guest port %d: %w", port, c.err)
	case ctx.Err() != nil:
		if d.conns[key] == c {
			d.resetConn(c, true)
			d.wake()
		}
		return nil, fmt.Errorf("vsock: dial guest port %d: %w", port, ctx.Err())
	}
	return c, nil
}

// Listen accepts guest connections to host port.
func (d *Device) Listen(port uint32) (*Listener, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.listeners[port] != nil {
		return nil, fmt.Errorf("vsock: listen on port %d: already in use", port)
	}
	l := &Listener{dev: d, port: port}
	l.cond = sync.NewCond(&d.mu)
	d.listeners[port] = l
	return l, nil
}

var _ virtio.Stateful = (*Device)(nil)

// deviceState is what a snapshot keeps of the device beyond its queues:
// the next local port for a host connection. Connections themselves are
// not kept (a restore resets them), but the guest may still hold a socket
// of one when the host connects again (the reset closes them; the
// guest's programs release them later), and a connection request to the
// same pair of ports would be refused (the restore's first two questions
// to the agent were, on the main process's and the spare connection's
// ports). Ports go on from where the snapshot left them instead.
type deviceState struct {
	NextPort uint32 `json:"next_port"`
}

// SaveState implements virtio.Stateful.
func (d *Device) SaveState() (json.RawMessage, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return json.Marshal(deviceState{NextPort: d.nextPort})
}

// RestoreState implements virtio.Stateful. The state is untrusted: a port
// below the host's range is refused. A snapshot that has none (taken
// before the device kept one) leaves the ports where a new device starts.
func (d *Device) RestoreState(raw json.RawMessage) error {
	if virtio.NoState(raw) {
		return nil
	}
	var st deviceState
	if err := strictjson.Decode(raw, &st); err != nil {
		return fmt.Errorf("vsock: restore: %w", err)
	}
	if st.NextPort < firstHostPort || st.NextPort == portAny {
		return fmt.Errorf("vsock: restore: next host port %d is outside the host's range (%d to %d)", st.NextPort, uint32(firstHostPort), uint32(portAny-1))
	}
	d.mu.Lock()
	d.nextPort = st.NextPort
	d.mu.Unlock()
	return nil
}

// eventTransportReset is VIRTIO_VSOCK_EVENT_TRANSPORT_RESET (virtio 1.2
// §5.10.6.7): the driver resets every connection, its listeners stay.
const eventTransportReset = 0

var _ virtio.Restorer = (*Device)(nil)

// Restored implements virtio.Restorer: a device restored from a snapshot
// knows none of the connections the guest had, so it tells the guest its
// transport was reset, through the event queue, as Firecracker does. The
// guest's sockets close (their readers see ECONNRESET), its listeners
// stay, and the host connects afresh.
func (d *Device) Restored() {
	d.mu.Lock()
	act := d.act
	d.mu.Unlock()
	if act == nil || len(act.Queues) < 3 || act.Queues[2] == nil {
		return
	}
	q := act.Queues[2]
	c, err := q.Next()
	if err != nil || c == nil {
		// No event buffer posted: the guest will not learn of the reset,
		// and its stale connections end when it next uses them.
		d.log.Warn("vsock: no event buffer to report the transport reset", "err", err)
		act.Report(false, err)
		return
	}
	var ev [4]byte
	binary.LittleEndian.PutUint32(ev[:], eventTransportReset)
	c.Write(ev[:])
	// Told when the guest posts an event buffer again, which it does once
	// it has handled this one.
	idx, err := q.WatchAvail()
	d.mu.Lock()
	d.resetUntil, d.resetAvail = time.Now().Add(resetWait), idx
	d.mu.Unlock()
	irq := false
	if err == nil {
		irq, err = q.Push(c)
	}
	act.Report(irq, err)
	// Look again once the allowed time has passed, whatever the guest did.
	time.AfterFunc(resetWait, func() { d.Notify(2) })
}

// resetWait bounds how long a restored device holds back what it sends
// for the guest to handle the transport reset.
const resetWait = time.Second
