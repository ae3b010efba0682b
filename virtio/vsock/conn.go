package vsock

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"
)

// Addr is a vsock address.
type Addr struct {
	CID  uint64
	Port uint32
}

// Network implements net.Addr.
func (a Addr) Network() string { return "vsock" }
func (a Addr) String() string  { return fmt.Sprintf("%d:%d", a.CID, a.Port) }

// Conn is the host end of one stream connection. It implements net.Conn;
// its state lives under the device's lock.
type Conn struct {
	dev   *Device
	key   connKey
	state connState
	cond  *sync.Cond
	err   error // why the connection ended abnormally

	rx          []byte // from the guest, not yet read
	fwdCnt      uint32 // bytes of rx the host has consumed
	lastFwdSent uint32 // fwdCnt the guest last heard about
	creditOwed  bool

	tx           []byte // to the guest, not yet sent
	txCnt        uint32 // bytes sent to the guest
	peerBufAlloc uint32
	peerFwdCnt   uint32

	peerShutdown uint32 // SHUTDOWN flags the guest sent
	wantShutdown uint32 // SHUTDOWN flags to send once tx is drained
	shutdownSent bool
	shutRead     bool
	closed       bool
	closeTimer   *time.Timer

	readDeadline, writeDeadline time.Time
	deadlineTimers              [2]*time.Timer
}

// credit is how much more the guest has room for.
func (c *Conn) credit() uint32 {
	inflight := c.txCnt - c.peerFwdCnt
	if inflight > c.peerBufAlloc {
		return 0
	}
	return c.peerBufAlloc - inflight
}

func (c *Conn) hdr(op uint16, flags uint32) header {
	return header{
		SrcCID: HostCID, DstCID: c.dev.guestCID, SrcPort: c.key.host, DstPort: c.key.guest,
		Type: typeStream, Op: op, Flags: flags, BufAlloc: rxBufSize, FwdCnt: c.fwdCnt,
	}
}

// fail ends the connection with err; the device lock is held.
func (c *Conn) fail(err error) {
	if c.err == nil {
		c.err = err
	}
	c.state = stateClosed
	c.cond.Broadcast()
}

func expired(t time.Time) bool { return !t.IsZero() && !time.Now().Before(t) }

// Read reads data the guest sent. It returns io.EOF once the guest has shut
// down its sending side and everything it sent has been read.
func (c *Conn) Read(p []byte) (int, error) {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	for {
		switch {
		case c.closed:
			return 0, net.ErrClosed
		case len(c.rx) > 0:
			n := copy(p, c.rx)
			c.rx = c.rx[n:]
			if len(c.rx) == 0 {
				c.rx = nil
			}
			c.fwdCnt += uint32(n)
			if c.fwdCnt-c.lastFwdSent >= rxBufSize/2 {
				d.wake() // tell the guest it has room again
			}
			return n, nil
		case len(p) == 0:
			return 0, nil
		case c.peerShutdown&shutdownSend != 0 || c.shutRead:
			return 0, io.EOF
		case c.err != nil:
			return 0, c.err
		case expired(c.readDeadline):
			return 0, os.ErrDeadlineExceeded
		}
		c.cond.Wait()
	}
}

// Write queues p for the guest, waiting while the connection's send buffer
// is full (the guest has not granted credit for it).
func (c *Conn) Write(p []byte) (int, error) {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for n < len(p) {
		switch {
		case c.closed:
			return n, net.ErrClosed
		case c.err != nil:
			return n, c.err
		case c.wantShutdown&shutdownSend != 0:
			return n, errors.New("vsock: write after CloseWrite")
		case c.peerShutdown&shutdownRcv != 0:
			return n, fmt.Errorf("vsock: write: %w", ErrConnReset)
		case expired(c.writeDeadline):
			return n, os.ErrDeadlineExceeded
		}
		room := txBufSize - len(c.tx)
		if room == 0 {
			c.cond.Wait()
			continue
		}
		k := min(room, len(p)-n)
		c.tx = append(c.tx, p[n:n+k]...)
		n += k
		d.wake()
	}
	return n, nil
}

// CloseWrite shuts down the sending side: the guest reads EOF after the
// data already written.
func (c *Conn) CloseWrite() error {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if c.closed || c.err != nil {
		return net.ErrClosed
	}
	c.wantShutdown |= shutdownSend
	d.wake()
	return nil
}

// CloseRead stops reading: data the guest sends is discarded.
func (c *Conn) CloseRead() error {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	c.shutRead = true
	c.fwdCnt += uint32(len(c.rx))
	c.rx = nil
	c.cond.Broadcast()
	d.wake()
	return nil
}

// Close closes the connection. Data already written is still delivered,
// then the guest is told both directions are shut; it answers with RST.
func (c *Conn) Close() error {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if c.closed {
		return nil
	}
	c.markClosed()
	switch {
	case d.conns[c.key] != c:
		// Already reset or closed by the guest.
	case c.state == stateConnecting:
		d.resetConn(c, true)
	default:
		c.wantShutdown = shutdownRcv | shutdownSend
	}
	c.cond.Broadcast()
	d.wake()
	return nil
}

// Abort closes the connection at once and tells the guest with RST: what
// was written and not yet sent is dropped, and no close handshake follows.
// It is for a caller that gave up on the guest (its deadline passed): a
// Close would leave the guest a shutdown to answer and, if the guest does
// not (a stopped reader), a reset closeTimeout later, work the guest is
// made to do long after the caller left (the watchdog saw it as the guest
// moving).
func (c *Conn) Abort() error {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if !c.closed {
		c.markClosed()
	}
	if d.conns[c.key] == c {
		d.resetConn(c, true)
		d.wake()
	}
	c.cond.Broadcast()
	return nil
}

// markClosed records that the host closed the connection: what the guest
// sent is dropped and the deadlines stop. The device lock is held.
func (c *Conn) markClosed() {
	c.closed = true
	c.fwdCnt += uint32(len(c.rx))
	c.rx = nil
	for _, t := range c.deadlineTimers {
		if t != nil {
			t.Stop()
		}
	}
}

// LocalAddr implements net.Conn.
func (c *Conn) LocalAddr() net.Addr { return Addr{CID: HostCID, Port: c.key.host} }

// RemoteAddr implements net.Conn.
func (c *Conn) RemoteAddr() net.Addr { return Addr{CID: c.dev.guestCID, Port: c.key.guest} }

// SetDeadline implements net.Conn.
func (c *Conn) SetDeadline(t time.Time) error {
	c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}

// SetReadDeadline implements net.Conn.
func (c *Conn) SetReadDeadline(t time.Time) error { return c.setDeadline(0, t) }

// SetWriteDeadline implements net.Conn.
func (c *Conn) SetWriteDeadline(t time.Time) error { return c.setDeadline(1, t) }

func (c *Conn) setDeadline(which int, t time.Time) error {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if which == 0 {
		c.readDeadline = t
	} else {
		c.writeDeadline = t
	}
	if old := c.deadlineTimers[which]; old != nil {
		old.Stop()
	}
	c.deadlineTimers[which] = nil
	if !t.IsZero() {
		c.deadlineTimers[which] = time.AfterFunc(time.Until(t), func() {
			d.mu.Lock()
			c.cond.Broadcast()
			d.mu.Unlock()
		})
	}
	c.cond.Broadcast()
	return nil
}

// Listener accepts guest connections to one host port.
type Listener struct {
	dev     *Device
	port    uint32
	cond    *sync.Cond
	pending []*Conn
	closed  bool
}

// Accept waits for the next guest connection.
func (l *Listener) Accept() (net.Conn, error) {
	d := l.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	for len(l.pending) == 0 && !l.closed {
		l.cond.Wait()
	}
	if l.closed {
		return nil, net.ErrClosed
	}
	c := l.pending[0]
	l.pending = l.pending[1:]
	return c, nil
}

// Close stops listening; connections not yet accepted are reset.
func (l *Listener) Close() error {
	d := l.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	if d.listeners[l.port] == l {
		delete(d.listeners, l.port)
	}
	for _, c := range l.pending {
		d.resetConn(c, true)
	}
	l.pending = nil
	l.cond.Broadcast()
	d.wake()
	return nil
}

// Addr implements net.Listener.
func (l *Listener) Addr() net.Addr { return Addr{CID: HostCID, Port: l.port} }
