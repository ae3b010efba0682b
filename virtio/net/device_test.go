package virtionet

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

var testMAC = net.HardwareAddr{0x52, 0x54, 0x00, 0x12, 0x34, 0x56}

const testMTU = 1500

// chanBackend is a network made of channels: the test sends frames for the
// guest on toGuest and receives the guest's frames on fromGuest.
type chanBackend struct {
	toGuest   chan []byte
	fromGuest chan []byte
	refuse    atomic.Bool // DeliverFrame fails
	readers   atomic.Int32
	overlap   atomic.Bool // two ReadFrame calls ran at once
}

func newBackend() *chanBackend {
	return &chanBackend{toGuest: make(chan []byte), fromGuest: make(chan []byte, 4096)}
}

func (b *chanBackend) DeliverFrame(f []byte) error {
	if b.refuse.Load() {
		return errors.New("refused")
	}
	select {
	case b.fromGuest <- bytes.Clone(f):
		return nil
	default:
		return errors.New("test backend full")
	}
}

func (b *chanBackend) ReadFrame(ctx context.Context) ([]byte, error) {
	if b.readers.Add(1) > 1 {
		b.overlap.Store(true)
	}
	defer b.readers.Add(-1)
	select {
	case f := <-b.toGuest:
		return f, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// send gives the device a frame for the guest, failing after a while.
func (b *chanBackend) send(t *testing.T, f []byte) {
	t.Helper()
	select {
	case b.toGuest <- f:
	case <-time.After(5 * time.Second):
		t.Fatal("the device does not read frames from the backend")
	}
}

// recv returns the next frame the guest sent.
func (b *chanBackend) recv(t *testing.T) []byte {
	t.Helper()
	select {
	case f := <-b.fromGuest:
		return f
	case <-time.After(5 * time.Second):
		t.Fatal("no frame reached the backend")
		return nil
	}
}

// guest is a guest driver with an rx and a tx queue in test memory.
type guest struct {
	t      *testing.T
	dev    *Device
	be     *chanBackend
	drv    *virtiotest.Driver
	rx, tx *virtiotest.Queue
	irqs   atomic.Int32
	failed atomic.Pointer[error]
}

func newGuest(t *testing.T) *guest {
	t.Helper()
	be := newBackend()
	dev, err := New(testMAC, testMTU, be, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	g := &guest{t: t, dev: dev, be: be}
	g.activate()
	return g
}

// activate sets up fresh queues, as a driver does after a reset.
func (g *guest) activate() {
	g.t.Helper()
	g.drv = virtiotest.NewDriver(32 << 20)
	g.rx, g.tx = g.drv.NewQueue(queueSize), g.drv.NewQueue(queueSize)
	err := g.dev.Activate(virtio.Activation{
		Mem: g.drv.Mem, Queues: []*virtio.Queue{g.rx.Device(), g.tx.Device()},
		Features:  featureMAC | featureMTU | featureStatus | virtio.FeatureVersion1,
		Interrupt: func() { g.irqs.Add(1) },
		Fail:      func(err error) { g.failed.Store(&err) },
	})
	if err != nil {
		g.t.Fatal(err)
	}
}

func (g *guest) checkNotFailed() {
	g.t.Helper()
	if p := g.failed.Load(); p != nil {
		g.t.Fatalf("device failed: %v", *p)
	}
}

// transmit puts one chain with the given readable bytes on the tx queue.
func (g *guest) transmit(b []byte) {
	g.t.Helper()
	if _, err := g.tx.Add(b, 0); err != nil {
		g.t.Fatal(err)
	}
	g.dev.Notify(txQueue)
}

// waitTxUsed waits for n tx chains to come back, each with nothing
// written.
func (g *guest) waitTxUsed(n int) {
	g.t.Helper()
	used := g.tx.WaitUsed(n, 5*time.Second)
	if len(used) != n {
		g.t.Fatalf("device returned %d tx chains, want %d", len(used), n)
	}
	for _, u := range used {
		if u.Len != 0 {
			g.t.Errorf("tx chain %d returned with %d bytes written", u.Head, u.Len)
		}
	}
}

// postRx adds n receive buffers of size bytes and notifies the device.
func (g *guest) postRx(n, size int) {
	g.t.Helper()
	for range n {
		if _, err := g.rx.Add(nil, size); err != nil {
			g.t.Fatal(err)
		}
	}
	g.dev.Notify(rxQueue)
}

// received waits for n frames in the rx queue and checks their headers.
func (g *guest) received(n int) [][]byte {
	g.t.Helper()
	used := g.rx.WaitUsed(n, 5*time.Second)
	if len(used) != n {
		g.t.Fatalf("device filled %d rx buffers, want %d", len(used), n)
	}
	var frames [][]byte
	for _, u := range used {
		if u.Len < hdrLen || int(u.Len) != len(u.Written) {
			g.t.Fatalf("rx buffer with %d bytes", u.Len)
		}
		if h := u.Written[:hdrLen]; !bytes.Equal(h, rxHeader[:]) {
			g.t.Fatalf("rx header % x, want % x", h, rxHeader)
		}
		frames = append(frames, u.Written[hdrLen:])
	}
	return frames
}

// frame returns an Ethernet frame of n bytes (at least 14) tagged with i.
func frame(i, n int) []byte {
	f := make([]byte, n)
	copy(f, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x52, 0x54, 0, 1, 2, 3, 0x08, 0x00})
	for j := ethHdrLen; j < n; j++ {
		f[j] = byte(i + j)
	}
	if n >= ethHdrLen+4 {
		binary.BigEndian.PutUint32(f[ethHdrLen:], uint32(i))
	}
	return f
}

// txHdr returns a zero virtio-net header with the given flags and GSO type.
func txHdr(flags, gso byte) []byte {
	h := make([]byte, hdrLen)
	h[hdrFlags], h[hdrGSOType] = flags, gso
	return h
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func TestNewValidates(t *testing.T) {
	be := newBackend()
	for _, tc := range []struct {
		name string
		mac  net.HardwareAddr
		mtu  uint16
		b    Backend
	}{
		{"short MAC", testMAC[:5], testMTU, be},
		{"long MAC", append(bytes.Clone(testMAC), 0), testMTU, be},
		{"no MAC", nil, testMTU, be},
		{"multicast MAC", net.HardwareAddr{0x01, 0, 0x5e, 0, 0, 1}, testMTU, be},
		{"broadcast MAC", net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, testMTU, be},
		{"MTU 0", testMAC, 0, be},
		{"MTU 67", testMAC, 67, be},
		{"no backend", testMAC, testMTU, nil},
	} {
		if _, err := New(tc.mac, tc.mtu, tc.b, nil); err == nil {
			t.Errorf("%s: New succeeded", tc.name)
		}
	}
	for _, mtu := range []uint16{MinMTU, testMTU, 9000, MaxMTU} {
		d, err := New(testMAC, mtu, be, nil)
		if err != nil {
			t.Errorf("MTU %d: %v", mtu, err)
			continue
		}
		if d.MTU() != mtu || !bytes.Equal(d.MAC(), testMAC) {
			t.Errorf("MTU %d: device has MAC %v MTU %d", mtu, d.MAC(), d.MTU())
		}
	}
}

func TestConfigSpace(t *testing.T) {
	d, err := New(testMAC, 9000, newBackend(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if d.Type() != virtio.TypeNet {
		t.Errorf("type %d", d.Type())
	}
	if f := d.Features(); f != 1<<5|1<<3|1<<16 {
		t.Errorf("features %#x", f)
	}
	if s := d.QueueSizes(); len(s) != 2 {
		t.Errorf("queue sizes %v", s)
	}
	want := []byte{0x52, 0x54, 0x00, 0x12, 0x34, 0x56, 1, 0, 1, 0, 0x28, 0x23, 0, 0, 0, 0}
	for off := range len(want) + 4 {
		for n := 1; n <= 8; n++ {
			got := bytes.Repeat([]byte{0xaa}, n)
			d.ReadConfig(uint64(off), got)
			exp := make([]byte, n)
			if off < len(want) {
				copy(exp, want[off:])
			}
			if !bytes.Equal(got, exp) {
				t.Errorf("config at %d, %d bytes: % x, want % x", off, n, got, exp)
			}
		}
	}
	big := bytes.Repeat([]byte{0xaa}, 4)
	d.ReadConfig(1<<40, big)
	if !bytes.Equal(big, make([]byte, 4)) {
		t.Errorf("config far beyond: % x", big)
	}
	d.WriteConfig(0, []byte{1, 2, 3, 4, 5, 6}) // ignored
	mac := make([]byte, 6)
	d.ReadConfig(0, mac)
	if !bytes.Equal(mac, testMAC) {
		t.Errorf("MAC after a config write: % x", mac)
	}
}

// TestThroughTransport reads the device through the virtio-mmio registers a
// guest driver sees.
func TestThroughTransport(t *testing.T) {
	d, err := New(testMAC, testMTU, newBackend(), nil)
	if err != nil {
		t.Fatal(err)
	}
	drv := virtiotest.NewDriver(1 << 20)
	m := virtio.NewMMIO(d, drv.Mem, func() {}, nil)
	reg := func(off uint64, n int) []byte {
		b := make([]byte, n)
		m.Read(off, b)
		return b
	}
	if id := binary.LittleEndian.Uint32(reg(0x008, 4)); id != virtio.TypeNet {
		t.Errorf("device id %d", id)
	}
	m.Write(0x014, []byte{0, 0, 0, 0})
	if f := binary.LittleEndian.Uint32(reg(0x010, 4)); f != featureMAC|featureMTU|featureStatus|virtio.FeatureEventIdx {
		t.Errorf("features[0] %#x", f)
	}
	if mac := reg(0x100, 6); !bytes.Equal(mac, testMAC) {
		t.Errorf("config mac % x", mac)
	}
	if mtu := binary.LittleEndian.Uint16(reg(0x10a, 2)); mtu != testMTU {
		t.Errorf("config mtu %d", mtu)
	}
}

func TestTransmit(t *testing.T) {
	g := newGuest(t)
	maxFrame := ethHdrLen + vlanLen + testMTU
	sizes := []int{ethHdrLen, 60, 1514, maxFrame, 100}
	for i, n := range sizes {
		g.transmit(append(txHdr(0, 0), frame(i, n)...))
	}
	g.waitTxUsed(len(sizes))
	var total uint64
	for i, n := range sizes {
		if got, want := g.be.recv(t), frame(i, n); !bytes.Equal(got, want) {
			t.Fatalf("frame %d: backend got %d bytes % x..., want %d bytes", i, len(got), got[:min(len(got), 20)], n)
		}
		total += uint64(n)
	}
	waitFor(t, "tx stats", func() bool { return g.dev.Stats().TxFrames == uint64(len(sizes)) })
	if s := g.dev.Stats(); s.TxBytes != total || s.TxDropped != 0 || s.TxErrors != 0 {
		t.Errorf("stats %+v", s)
	}
	if g.irqs.Load() == 0 {
		t.Error("no interrupt for the used tx chains")
	}
	g.checkNotFailed()
}

func TestTransmitBeforeDriverOK(t *testing.T) {
	be := newBackend()
	dev, err := New(testMAC, testMTU, be, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	drv := virtiotest.NewDriver(1 << 20)
	rx, tx := drv.NewQueue(16), drv.NewQueue(16)
	tx.Add(append(txHdr(0, 0), frame(7, 64)...), 0)
	err = dev.Activate(virtio.Activation{
		Mem: drv.Mem, Queues: []*virtio.Queue{rx.Device(), tx.Device()},
		Interrupt: func() {}, Fail: func(error) {},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := be.recv(t); !bytes.Equal(got, frame(7, 64)) {
		t.Errorf("frame % x", got)
	}
}

func TestTransmitHostile(t *testing.T) {
	g := newGuest(t)
	maxFrame := ethHdrLen + vlanLen + testMTU
	hostile := [][]byte{
		txHdr(0, 0),                             // header only
		{0, 0, 0, 0, 0},                         // shorter than the header
		append(txHdr(0, 1), frame(0, 60)...),    // GSO TCPv4
		append(txHdr(0, 0x80), frame(0, 60)...), // ECN
		append(txHdr(1, 0), frame(0, 60)...),    // NEEDS_CSUM
		append(txHdr(2, 0), frame(0, 60)...),    // DATA_VALID
		append(txHdr(0, 0), frame(0, maxFrame+1)...),
		append(txHdr(0, 0), frame(0, 64<<10)...),
		append(txHdr(0, 0), make([]byte, ethHdrLen-1)...),
	}
	for i, b := range hostile {
		g.transmit(b)
		g.transmit(append(txHdr(0, 0), frame(i, 60)...))
	}
	// A chain with no readable buffer at all.
	if _, err := g.tx.Add(nil, 64); err != nil {
		t.Fatal(err)
	}
	g.dev.Notify(txQueue)
	g.transmit(append(txHdr(0, 0), frame(100, 60)...))
	g.waitTxUsed(2*len(hostile) + 2)
	for i := range hostile {
		if got := g.be.recv(t); !bytes.Equal(got, frame(i, 60)) {
			t.Fatalf("after hostile chain %d the backend got % x", i, got)
		}
	}
	if got := g.be.recv(t); !bytes.Equal(got, frame(100, 60)) {
		t.Fatalf("last frame % x", got)
	}
	waitFor(t, "tx stats", func() bool { return g.dev.Stats().TxFrames == uint64(len(hostile)+1) })
	if s := g.dev.Stats(); s.TxDropped != uint64(len(hostile)+1) {
		t.Errorf("stats %+v, want %d dropped", s, len(hostile)+1)
	}
	g.checkNotFailed()
}

func TestTransmitBackendErrorsAreCounted(t *testing.T) {
	g := newGuest(t)
	g.be.refuse.Store(true)
	g.transmit(append(txHdr(0, 0), frame(1, 60)...))
	g.waitTxUsed(1)
	waitFor(t, "tx error", func() bool { return g.dev.Stats().TxErrors == 1 })
	g.be.refuse.Store(false)
	g.transmit(append(txHdr(0, 0), frame(2, 60)...))
	if got := g.be.recv(t); !bytes.Equal(got, frame(2, 60)) {
		t.Errorf("frame % x", got)
	}
	g.checkNotFailed()
}

func TestTransmitManyInBatches(t *testing.T) {
	g := newGuest(t)
	const n = 3*txBatch + 5 // more than a batch, less than the queue
	for i := range n {
		if _, err := g.tx.Add(append(txHdr(0, 0), frame(i, 80)...), 0); err != nil {
			t.Fatal(err)
		}
	}
	g.dev.Notify(txQueue) // one notification for all of them
	g.waitTxUsed(n)
	for i := range n {
		if got := g.be.recv(t); !bytes.Equal(got, frame(i, 80)) {
			t.Fatalf("frame %d out of order: % x", i, got[:20])
		}
	}
}

func TestBrokenTransmitRingFails(t *testing.T) {
	g := newGuest(t)
	// The available index runs further ahead than the ring holds.
	g.drv.Mem.StoreUint16(g.tx.Avail+2, 1000)
	g.dev.Notify(txQueue)
	waitFor(t, "Fail", func() bool { return g.failed.Load() != nil })
	if err := *g.failed.Load(); !errors.Is(err, virtio.ErrQueue) {
		t.Errorf("Fail(%v), want a queue error", err)
	}
	g.dev.mu.Lock()
	running := g.dev.run != nil
	g.dev.mu.Unlock()
	if running {
		t.Error("device still running after a queue error")
	}
	g.dev.Notify(txQueue) // harmless
	g.dev.Notify(rxQueue)
}

func TestBrokenReceiveRingFails(t *testing.T) {
	g := newGuest(t)
	g.drv.Mem.StoreUint16(g.rx.Avail+2, 1000)
	g.be.send(t, frame(0, 60))
	waitFor(t, "Fail", func() bool { return g.failed.Load() != nil })
}

func TestReceive(t *testing.T) {
	g := newGuest(t)
	g.postRx(8, hdrLen+1518)
	sizes := []int{ethHdrLen, 60, 1514, ethHdrLen + vlanLen + testMTU}
	for i, n := range sizes {
		g.be.send(t, frame(i, n))
	}
	frames := g.received(len(sizes))
	var total uint64
	for i, n := range sizes {
		if !bytes.Equal(frames[i], frame(i, n)) {
			t.Errorf("frame %d: % x...", i, frames[i][:min(20, len(frames[i]))])
		}
		total += uint64(n)
	}
	if s := g.dev.Stats(); s.RxFrames != uint64(len(sizes)) || s.RxBytes != total || s.RxDropped != 0 {
		t.Errorf("stats %+v", s)
	}
	if g.irqs.Load() == 0 {
		t.Error("no interrupt")
	}
	g.checkNotFailed()
}

func TestReceiveRespectsNoInterrupt(t *testing.T) {
	g := newGuest(t)
	g.drv.Mem.StoreUint16(g.rx.Avail, 1) // VIRTQ_AVAIL_F_NO_INTERRUPT
	g.postRx(2, 2048)
	g.be.send(t, frame(0, 60))
	g.received(1)
	time.Sleep(10 * time.Millisecond)
	if n := g.irqs.Load(); n != 0 {
		t.Errorf("%d interrupts, the driver asked for none", n)
	}
}

func TestReceiveDropsBadSizes(t *testing.T) {
	g := newGuest(t)
	g.postRx(4, 70000)
	g.be.send(t, nil)
	g.be.send(t, frame(0, ethHdrLen)[:ethHdrLen-1])
	g.be.send(t, frame(0, ethHdrLen+vlanLen+testMTU+1))
	g.be.send(t, frame(1, 60))
	if f := g.received(1); !bytes.Equal(f[0], frame(1, 60)) {
		t.Errorf("frame % x", f[0])
	}
	if s := g.dev.Stats(); s.RxDropped != 3 {
		t.Errorf("stats %+v, want 3 dropped", s)
	}
}

func TestReceiveBacklog(t *testing.T) {
	g := newGuest(t)
	// No buffers: frames wait, up to the limit; the rest are dropped.
	const extra = 10
	for i := range maxBacklog + extra {
		g.be.send(t, frame(i, 60))
	}
	waitFor(t, "drops", func() bool { return g.dev.Stats().RxDropped == extra })
	g.dev.mu.Lock()
	waiting := g.dev.run.backlog.n
	g.dev.mu.Unlock()
	if waiting != maxBacklog {
		t.Errorf("%d frames waiting, want %d", waiting, maxBacklog)
	}
	if n := len(g.rx.TakeUsed()); n != 0 {
		t.Fatalf("%d rx buffers used before any were posted", n)
	}
	// A few buffers first, then the rest.
	g.postRx(5, 2048)
	got := g.received(5)
	g.postRx(queueSize-5, 2048)
	got = append(got, g.received(queueSize-5)...)
	for i, f := range got {
		if !bytes.Equal(f, frame(i, 60)) {
			t.Fatalf("frame %d out of order: % x", i, f[:20])
		}
	}
	if s := g.dev.Stats(); s.RxFrames != maxBacklog || s.RxDropped != extra {
		t.Errorf("stats %+v", s)
	}
	g.checkNotFailed()
}

func TestReceiveFrameLargerThanBuffer(t *testing.T) {
	g := newGuest(t)
	g.postRx(2, hdrLen+100)
	g.be.send(t, frame(0, 101)) // does not fit: dropped, its buffer back empty
	g.be.send(t, frame(1, 100)) // fits exactly, in the next buffer
	if used := g.rx.WaitUsed(2, 5*time.Second); len(used) != 2 || used[0].Len != 0 || !bytes.Equal(used[1].Written, append(rxHeader[:], frame(1, 100)...)) {
		t.Fatalf("used %+v; want the first buffer empty, the second holding frame 1", used)
	}
	if s := g.dev.Stats(); s.RxFrames != 1 || s.RxDropped != 1 {
		t.Errorf("stats %+v", s)
	}
	// A buffer too small for any frame comes back empty rather than hold
	// up the ones behind it.
	g.postRx(1, hdrLen+ethHdrLen-1)
	g.postRx(1, 2048)
	g.be.send(t, frame(2, 60))
	used := g.rx.WaitUsed(2, 5*time.Second)
	if len(used) != 2 || used[0].Len != 0 || !bytes.Equal(used[1].Written, append(rxHeader[:], frame(2, 60)...)) {
		t.Fatalf("used %+v", used)
	}
	if s := g.dev.Stats(); s.RxFrames != 2 || s.RxDropped != 1 {
		t.Errorf("stats %+v", s)
	}
	g.checkNotFailed()
}

func TestResetThenActivateAgain(t *testing.T) {
	g := newGuest(t)
	for round := range 3 {
		g.postRx(4, 2048)
		g.be.send(t, frame(round, 60))
		if f := g.received(1); !bytes.Equal(f[0], frame(round, 60)) {
			t.Fatalf("round %d: rx % x", round, f[0])
		}
		g.transmit(append(txHdr(0, 0), frame(round, 70)...))
		if f := g.be.recv(t); !bytes.Equal(f, frame(round, 70)) {
			t.Fatalf("round %d: tx % x", round, f)
		}
		// Reset with rx buffers still posted: the device forgets them.
		g.dev.Reset()
		g.dev.Reset() // idempotent
		g.dev.Notify(rxQueue)
		g.dev.Notify(txQueue)
		g.activate()
	}
	g.checkNotFailed()
	if g.be.overlap.Load() {
		t.Error("two ReadFrame calls at once")
	}
}

func TestResetDropsBacklog(t *testing.T) {
	g := newGuest(t)
	for i := range 3 {
		g.be.send(t, frame(i, 60))
	}
	waitFor(t, "backlog", func() bool {
		g.dev.mu.Lock()
		defer g.dev.mu.Unlock()
		return g.dev.run.backlog.n == 3
	})
	g.dev.Reset()
	if s := g.dev.Stats(); s.RxDropped != 3 {
		t.Errorf("stats %+v", s)
	}
	g.activate()
	g.postRx(4, 2048)
	g.be.send(t, frame(9, 60))
	if f := g.received(1); !bytes.Equal(f[0], frame(9, 60)) {
		t.Errorf("frame % x", f[0])
	}
}

func TestActivateNeedsBothQueues(t *testing.T) {
	d, err := New(testMAC, testMTU, newBackend(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	drv := virtiotest.NewDriver(1 << 20)
	q := drv.NewQueue(16).Device()
	for _, qs := range [][]*virtio.Queue{nil, {q}, {q, nil}, {nil, q}, {q, q, q}} {
		if err := d.Activate(virtio.Activation{Mem: drv.Mem, Queues: qs}); err == nil {
			t.Errorf("Activate with %d queues succeeded", len(qs))
		}
	}
}

func TestCloseLeaksNoGoroutines(t *testing.T) {
	before := runtime.NumGoroutine()
	g := newGuest(t)
	for round := range 5 {
		g.postRx(2, 2048)
		g.be.send(t, frame(round, 60))
		g.received(1)
		g.transmit(append(txHdr(0, 0), frame(round, 60)...))
		g.be.recv(t)
		g.dev.Reset()
		g.activate()
	}
	// The reader is blocked in ReadFrame; Close must end it.
	if err := g.dev.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.dev.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "goroutines to end", func() bool { return runtime.NumGoroutine() <= before })
	err := g.dev.Activate(virtio.Activation{
		Mem: g.drv.Mem, Queues: []*virtio.Queue{g.rx.Device(), g.tx.Device()},
	})
	if err == nil {
		t.Error("Activate after Close succeeded")
	}
	g.dev.Reset()
	g.dev.Notify(txQueue)
}

// TestConcurrentTraffic moves frames both ways at once, with the guest
// reposting buffers as it goes; run it with -race.
func TestConcurrentTraffic(t *testing.T) {
	g := newGuest(t)
	const n = 2000
	g.postRx(64, 2048)
	var wg sync.WaitGroup
	wg.Add(3)
	go func() { // the host sends
		defer wg.Done()
		for i := range n {
			g.be.toGuest <- frame(i, 60+i%1000)
		}
	}()
	go func() { // the guest sends
		defer wg.Done()
		for i := 0; i < n; {
			if _, err := g.tx.Add(append(txHdr(0, 0), frame(i, 60+i%1400)...), 0); err != nil {
				g.tx.TakeUsed()
				runtime.Gosched()
				continue
			}
			g.dev.Notify(txQueue)
			i++
		}
	}()
	var got []int
	go func() { // the guest receives
		defer wg.Done()
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); {
			used := g.rx.TakeUsed()
			for _, u := range used {
				got = append(got, int(binary.BigEndian.Uint32(u.Written[hdrLen+ethHdrLen:])))
				g.rx.Add(nil, 2048)
			}
			if len(used) > 0 {
				g.dev.Notify(rxQueue)
			}
			s := g.dev.Stats()
			if s.RxFrames+s.RxDropped == n && len(got) == int(s.RxFrames) {
				return
			}
			time.Sleep(100 * time.Microsecond)
		}
	}()
	for i := range n {
		if f := g.be.recv(t); !bytes.Equal(f, frame(i, 60+i%1400)) {
			t.Fatalf("tx frame %d out of order", i)
		}
	}
	wg.Wait()
	s := g.dev.Stats()
	if s.RxFrames+s.RxDropped != n || len(got) != int(s.RxFrames) {
		t.Fatalf("stats %+v, guest got %d frames", s, len(got))
	}
	for i := 1; i < len(got); i++ {
		if got[i] <= got[i-1] {
			t.Fatalf("rx frames out of order: %d after %d", got[i], got[i-1])
		}
	}
	if s.TxFrames != n {
		t.Errorf("stats %+v", s)
	}
	g.checkNotFailed()
}

// TestResetDuringTraffic resets the device while frames flow, to shake out
// races between the workers and Reset.
func TestResetDuringTraffic(t *testing.T) {
	g := newGuest(t)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case g.be.toGuest <- frame(i, 60):
			case <-stop:
				return
			}
		}
	}()
	for range 20 {
		g.postRx(32, 2048)
		for i := range 32 {
			g.transmit(append(txHdr(0, 0), frame(i, 60)...))
		}
		time.Sleep(time.Millisecond)
		g.dev.Reset()
		g.activate()
	}
	close(stop)
	wg.Wait()
	g.checkNotFailed()
	if g.be.overlap.Load() {
		t.Error("two ReadFrame calls at once")
	}
}
