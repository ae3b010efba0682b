package vsock

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

const guestCID = 3

// guest is a scripted guest driver: it keeps rx buffers posted and sends
// packets on tx, as Linux's virtio_transport does.
type guest struct {
	t      *testing.T
	dev    *Device
	drv    *virtiotest.Driver
	rx, tx *virtiotest.Queue
	ev     *virtiotest.Queue
	failed atomic.Value
	irqs   atomic.Int32
	seen   []pkt // packets received, in order
}

type pkt struct {
	h    header
	data []byte
}

func newGuest(t *testing.T) *guest {
	t.Helper()
	dev, err := New(guestCID, nil)
	if err != nil {
		t.Fatal(err)
	}
	g := &guest{t: t, dev: dev, drv: virtiotest.NewDriver(64 << 20)}
	g.rx, g.tx = g.drv.NewQueue(queueSize), g.drv.NewQueue(queueSize)
	g.ev = g.drv.NewQueue(queueSize)
	for range 64 {
		g.rx.Add(nil, hdrSize+4096)
	}
	for range 8 { // as Linux posts its event buffers
		g.ev.Add(nil, 4)
	}
	err = dev.Activate(virtio.Activation{
		Mem: g.drv.Mem, Queues: []*virtio.Queue{g.rx.Device(), g.tx.Device(), g.ev.Device()},
		Interrupt: func() { g.irqs.Add(1) },
		Fail:      func(err error) { g.failed.Store(err) },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dev.Reset)
	return g
}

// send puts a packet on the tx queue and notifies the device.
func (g *guest) send(h header, data []byte) {
	g.t.Helper()
	h.Len = uint32(len(data))
	if h.SrcCID == 0 {
		h.SrcCID, h.DstCID = guestCID, HostCID
	}
	if h.Type == 0 {
		h.Type = typeStream
	}
	b := make([]byte, hdrSize)
	h.marshal(b)
	if _, err := g.tx.Add(append(b, data...), 0); err != nil {
		g.t.Fatal(err)
	}
	g.dev.Notify(1)
	g.tx.WaitUsed(1, time.Second)
}

// expect waits for the next packet from the device and checks its op.
func (g *guest) expect(op uint16) pkt {
	g.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		for _, u := range g.rx.TakeUsed() {
			h, err := parseHeader(u.Written)
			if err != nil {
				g.t.Fatalf("device sent a bad header: %v", err)
			}
			g.seen = append(g.seen, pkt{h, u.Written[hdrSize:]})
			g.rx.Add(nil, hdrSize+4096) // repost
			g.dev.Notify(0)
		}
		if len(g.seen) > 0 {
			p := g.seen[0]
			g.seen = g.seen[1:]
			if p.h.Op != op {
				g.t.Fatalf("device sent %s, want %s", opName(p.h.Op), opName(op))
			}
			if p.h.SrcCID != HostCID || p.h.DstCID != guestCID || p.h.Type != typeStream {
				g.t.Fatalf("device sent a misaddressed packet %+v", p.h)
			}
			return p
		}
		time.Sleep(time.Millisecond)
	}
	g.t.Fatalf("no %s from the device", opName(op))
	return pkt{}
}

func (g *guest) connect(hostPort, guestPort uint32) {
	g.send(header{SrcPort: guestPort, DstPort: hostPort, Op: opRequest, BufAlloc: 64 << 10}, nil)
}

func TestGuestConnectsToHostListener(t *testing.T) {
	g := newGuest(t)
	l, err := g.dev.Listen(1234)
	if err != nil {
		t.Fatal(err)
	}
	g.connect(1234, 5000)
	resp := g.expect(opResponse)
	if resp.h.SrcPort != 1234 || resp.h.DstPort != 5000 || resp.h.BufAlloc != rxBufSize {
		t.Fatalf("response %+v", resp.h)
	}
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	if c.RemoteAddr().String() != "3:5000" || c.LocalAddr().String() != "2:1234" {
		t.Errorf("addresses %v %v", c.RemoteAddr(), c.LocalAddr())
	}
	g.send(header{SrcPort: 5000, DstPort: 1234, Op: opRW, BufAlloc: 64 << 10}, []byte("hello"))
	buf := make([]byte, 10)
	if n, err := c.Read(buf); err != nil || string(buf[:n]) != "hello" {
		t.Fatalf("Read = %q, %v", buf[:n], err)
	}
	if _, err := c.Write([]byte("world")); err != nil {
		t.Fatal(err)
	}
	if p := g.expect(opRW); string(p.data) != "world" || p.h.FwdCnt != 5 {
		t.Errorf("RW %q fwd_cnt %d", p.data, p.h.FwdCnt)
	}
	// Guest half-closes: the host reads EOF but can still write.
	g.send(header{SrcPort: 5000, DstPort: 1234, Op: opShutdown, Flags: shutdownSend, BufAlloc: 64 << 10}, nil)
	if _, err := c.Read(buf); err != io.EOF {
		t.Errorf("Read after guest SHUTDOWN(SEND) = %v, want EOF", err)
	}
	c.Write([]byte("still"))
	if p := g.expect(opRW); string(p.data) != "still" {
		t.Errorf("RW after half-close %q", p.data)
	}
	// Host closes: the guest is told both directions are shut; its RST
	// finishes the connection.
	c.Close()
	if p := g.expect(opShutdown); p.h.Flags != shutdownRcv|shutdownSend {
		t.Errorf("shutdown flags %d", p.h.Flags)
	}
	g.send(header{SrcPort: 5000, DstPort: 1234, Op: opRst}, nil)
	waitFor(t, func() bool { g.dev.mu.Lock(); defer g.dev.mu.Unlock(); return len(g.dev.conns) == 0 })
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatal("condition not reached")
}

func TestNoListenerIsRefused(t *testing.T) {
	g := newGuest(t)
	g.connect(999, 5000)
	if p := g.expect(opRst); p.h.SrcPort != 999 || p.h.DstPort != 5000 {
		t.Errorf("RST %+v", p.h)
	}
}

func TestHostDial(t *testing.T) {
	g := newGuest(t)
	done := make(chan error, 1)
	var conn *Conn
	go func() {
		c, err := g.dev.Dial(context.Background(), 52)
		conn = c
		done <- err
	}()
	req := g.expect(opRequest)
	if req.h.DstPort != 52 || req.h.SrcPort < firstHostPort {
		t.Fatalf("request %+v", req.h)
	}
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opResponse, BufAlloc: 64 << 10}, nil)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	conn.Write([]byte("x"))
	g.expect(opRW)

	// A refused dial.
	go func() {
		_, err := g.dev.Dial(context.Background(), 53)
		done <- err
	}()
	req = g.expect(opRequest)
	g.send(header{SrcPort: 53, DstPort: req.h.SrcPort, Op: opRst}, nil)
	if err := <-done; !errors.Is(err, ErrConnRefused) {
		t.Errorf("refused dial: %v", err)
	}

	// A dial nobody answers ends with the context.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := g.dev.Dial(ctx, 54); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("unanswered dial: %v", err)
	}
}

// TestHostAbort: a connection the host gives up on ends at once with a
// reset, its unsent data dropped, where Close shuts it down and waits for
// the guest's reset: a guest that never answers (its reader stopped) is
// not sent one closeTimeout later.
func TestHostAbort(t *testing.T) {
	g := newGuest(t)
	dial := func(port uint32) *Conn {
		t.Helper()
		done := make(chan *Conn, 1)
		go func() {
			c, err := g.dev.Dial(context.Background(), port)
			if err != nil {
				t.Error(err)
			}
			done <- c
		}()
		req := g.expect(opRequest)
		// The guest gives no credit: what the host writes stays queued.
		g.send(header{SrcPort: port, DstPort: req.h.SrcPort, Op: opResponse}, nil)
		return <-done
	}
	c := dial(60)
	if _, err := c.Write([]byte("never sent")); err != nil {
		t.Fatal(err)
	}
	if err := c.Abort(); err != nil {
		t.Fatal(err)
	}
	if rst := g.expect(opRst); rst.h.DstPort != 60 {
		t.Errorf("reset for guest port %d, want 60", rst.h.DstPort)
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("Read() after Abort succeeded")
	}
	if err := c.Close(); err != nil {
		t.Errorf("Close() after Abort = %v", err)
	}
	g.dev.mu.Lock()
	n := len(g.dev.conns)
	g.dev.mu.Unlock()
	if n != 0 {
		t.Errorf("%d connections after Abort, want none", n)
	}

	// Close, by contrast, shuts down and waits for the guest's reset.
	c = dial(61)
	c.Close()
	if sd := g.expect(opShutdown); sd.h.Flags != shutdownRcv|shutdownSend {
		t.Errorf("Close sent shutdown flags %#x", sd.h.Flags)
	}
}

// TestRestoredTellsTheGuest: a restored device reports a transport reset on
// the event queue and sends the guest nothing (a host connection request
// included) until the guest has posted an event buffer again, its sign
// that it reset its connections: a request taken before would be reset
// with them.
func TestRestoredTellsTheGuest(t *testing.T) {
	g := newGuest(t)
	g.dev.Restored()
	used := g.ev.WaitUsed(1, 5*time.Second)
	if len(used) != 1 || len(used[0].Written) != 4 || binary.LittleEndian.Uint32(used[0].Written) != eventTransportReset {
		t.Fatalf("event queue: %+v; want one TRANSPORT_RESET event", used)
	}
	done := make(chan error, 1)
	go func() {
		_, err := g.dev.Dial(context.Background(), 52)
		done <- err
	}()
	time.Sleep(100 * time.Millisecond)
	if u := g.rx.TakeUsed(); len(u) != 0 {
		t.Fatalf("the device sent %d packets before the guest handled the reset", len(u))
	}
	g.ev.Add(nil, 4) // the guest handled it and posts the buffer again
	g.dev.Notify(2)
	req := g.expect(opRequest)
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opResponse, BufAlloc: 64 << 10}, nil)
	if err := <-done; err != nil {
		t.Fatalf("Dial after the reset = %v", err)
	}
}

// TestRestoredPortsGoOn: a restored device's host connections take ports
// after every one the snapshotted device used (the guest may still hold a
// socket of one, and would refuse the same pair again); a state with a
// port outside the host's range is refused.
func TestRestoredPortsGoOn(t *testing.T) {
	g := newGuest(t)
	var last uint32
	for port := uint32(70); port < 73; port++ {
		done := make(chan error, 1)
		go func() {
			_, err := g.dev.Dial(context.Background(), port)
			done <- err
		}()
		req := g.expect(opRequest)
		last = req.h.SrcPort
		g.send(header{SrcPort: port, DstPort: req.h.SrcPort, Op: opResponse, BufAlloc: 64 << 10}, nil)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	st, err := g.dev.SaveState()
	if err != nil {
		t.Fatal(err)
	}

	r := newGuest(t)
	if err := r.dev.RestoreState(st); err != nil {
		t.Fatalf("RestoreState(%s) = %v", st, err)
	}
	go r.dev.Dial(context.Background(), 70)
	if req := r.expect(opRequest); req.h.SrcPort <= last {
		t.Errorf("the restored device's first connection is from port %d; want one after %d, the last the snapshot's used", req.h.SrcPort, last)
	}
	for _, bad := range []string{`{"next_port":5}`, `{"next_port":4294967295}`, `{"next_port":"x"}`, `{"next_port":1073741824,"extra":1}`, `[]`} {
		if err := newGuest(t).dev.RestoreState([]byte(bad)); err == nil {
			t.Errorf("RestoreState(%s) = nil, want an error", bad)
		}
	}
	if err := newGuest(t).dev.RestoreState(nil); err != nil {
		t.Errorf("RestoreState of a snapshot without device state = %v, want nil", err)
	}
}

// TestCreditFlowControl: the host never sends more than the guest granted.
func TestCreditFlowControl(t *testing.T) {
	g := newGuest(t)
	l, _ := g.dev.Listen(7)
	g.send(header{SrcPort: 9, DstPort: 7, Op: opRequest, BufAlloc: 6000}, nil)
	g.expect(opResponse)
	c, _ := l.Accept()
	data := bytes.Repeat([]byte("0123456789"), 2000) // 20000 bytes
	go c.Write(data)
	var got []byte
	for len(got) < 6000 {
		got = append(got, g.expect(opRW).data...)
	}
	time.Sleep(50 * time.Millisecond)
	for _, u := range g.rx.TakeUsed() {
		t.Fatalf("device sent %d bytes beyond the guest's credit", len(u.Written))
	}
	// The guest consumed everything: grant more.
	g.send(header{SrcPort: 9, DstPort: 7, Op: opCreditUpdate, BufAlloc: 64 << 10, FwdCnt: 6000}, nil)
	for len(got) < len(data) {
		got = append(got, g.expect(opRW).data...)
	}
	if !bytes.Equal(got, data) {
		t.Error("data corrupted")
	}
	// A credit request is answered.
	g.send(header{SrcPort: 9, DstPort: 7, Op: opCreditRequest, BufAlloc: 64 << 10, FwdCnt: 20000}, nil)
	if p := g.expect(opCreditUpdate); p.h.BufAlloc != rxBufSize {
		t.Errorf("credit update %+v", p.h)
	}
}

func TestGuestOverrunResets(t *testing.T) {
	g := newGuest(t)
	l, _ := g.dev.Listen(7)
	g.connect(7, 9)
	g.expect(opResponse)
	c, _ := l.Accept()
	chunk := make([]byte, maxPayload)
	for range rxBufSize / maxPayload {
		g.send(header{SrcPort: 9, DstPort: 7, Op: opRW, BufAlloc: 64 << 10}, chunk)
	}
	g.send(header{SrcPort: 9, DstPort: 7, Op: opRW, BufAlloc: 64 << 10}, []byte("one too many"))
	g.expect(opRst)
	buf := make([]byte, rxBufSize)
	if _, err := io.ReadFull(c, buf); !errors.Is(err, ErrConnReset) && err != nil {
		t.Logf("read after reset: %v", err)
	}
}

func TestGuestClosesConnection(t *testing.T) {
	g := newGuest(t)
	l, _ := g.dev.Listen(7)
	g.connect(7, 9)
	g.expect(opResponse)
	c, _ := l.Accept()
	g.send(header{SrcPort: 9, DstPort: 7, Op: opRW, BufAlloc: 64 << 10}, []byte("bye"))
	g.send(header{SrcPort: 9, DstPort: 7, Op: opShutdown, Flags: shutdownRcv | shutdownSend}, nil)
	g.expect(opRst) // the device acknowledges the close
	b, err := io.ReadAll(c)
	if err != nil || string(b) != "bye" {
		t.Errorf("ReadAll = %q, %v", b, err)
	}
	if _, err := c.Write([]byte("x")); err == nil {
		t.Error("write to a closed peer succeeded")
	}
}

func TestHostileInput(t *testing.T) {
	g := newGuest(t)
	l, _ := g.dev.Listen(7)
	// Packets from another CID, to another CID, of another type, with an
	// unknown op, claiming too much data, or too short: dropped or reset.
	g.send(header{SrcCID: 77, DstCID: HostCID, SrcPort: 9, DstPort: 7, Op: opRequest}, nil)
	g.send(header{SrcCID: guestCID, DstCID: 99, SrcPort: 9, DstPort: 7, Op: opRequest}, nil)
	g.send(header{SrcPort: 9, DstPort: 7, Type: 2, Op: opRequest}, nil)
	g.expect(opRst) // SEQPACKET is not offered
	g.send(header{SrcPort: 9, DstPort: 8, Op: 99}, nil)
	g.expect(opRst)
	g.tx.Add([]byte("short"), 0)
	bad := make([]byte, hdrSize)
	header{SrcCID: guestCID, DstCID: HostCID, SrcPort: 9, DstPort: 7, Type: typeStream, Op: opRW, Len: 1 << 20}.marshal(bad)
	g.tx.Add(bad, 0)
	g.dev.Notify(1)
	g.tx.WaitUsed(2, time.Second)
	g.expect(opRst) // the oversized packet is answered with RST
	// The device still works.
	g.connect(7, 10)
	g.expect(opResponse)
	if _, err := l.Accept(); err != nil {
		t.Fatal(err)
	}
	if err := g.failed.Load(); err != nil {
		t.Errorf("device failed: %v", err)
	}
	// A duplicate REQUEST on a live connection resets it.
	g.connect(7, 10)
	g.expect(opRst)
}

func TestDeadlinesAndListenerClose(t *testing.T) {
	g := newGuest(t)
	l, _ := g.dev.Listen(7)
	if _, err := g.dev.Listen(7); err == nil {
		t.Error("a second listener on the same port")
	}
	g.connect(7, 9)
	g.expect(opResponse)
	c, _ := l.Accept()
	c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("read past deadline: %v", err)
	}
	go func() { time.Sleep(20 * time.Millisecond); l.Close() }()
	if _, err := l.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after Close: %v", err)
	}
}

// FuzzTxPacket: arbitrary bytes on the tx queue never crash the device.
func FuzzTxPacket(f *testing.F) {
	seed := make([]byte, hdrSize+5)
	header{SrcCID: guestCID, DstCID: HostCID, SrcPort: 9, DstPort: 7, Type: typeStream, Op: opRequest}.marshal(seed)
	f.Add(seed)
	f.Fuzz(func(t *testing.T, b []byte) {
		g := newGuest(t)
		l, _ := g.dev.Listen(7)
		defer l.Close()
		g.tx.Add(b, 0)
		g.dev.Notify(1)
		g.tx.WaitUsed(1, time.Second)
	})
}
