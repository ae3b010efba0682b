package virtionet

import (
	"bytes"
	"encoding/binary"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

// rawRing is a split queue laid out by hand at a fixed place in guest
// memory, so a test can build chains of any shape (virtiotest makes one
// readable and one writable buffer per chain).
type rawRing struct {
	mem               *guestmem.Memory
	size              uint16
	desc, avail, used uint64
	data              uint64 // where the next buffer goes
	nextDesc          uint16
	availIdx          uint16
}

const rawRingBase = 0x80000

func newRawRing(mem *guestmem.Memory, size uint16) *rawRing {
	r := &rawRing{mem: mem, size: size, desc: rawRingBase}
	r.avail = r.desc + 16*uint64(size)
	r.used = (r.avail + 6 + 2*uint64(size) + 3) &^ 3
	r.data = (r.used + 6 + 8*uint64(size) + 15) &^ 15
	return r
}

func (r *rawRing) device() *virtio.Queue {
	q, err := virtio.NewQueue(r.mem, r.size, r.desc, r.avail, r.used)
	if err != nil {
		panic(err)
	}
	return q
}

// seg is one buffer of a chain: readable with data, or writable of n bytes.
type seg struct {
	data     []byte
	writable bool
	n        int
}

// add makes a chain of segs available.
func (r *rawRing) add(segs []seg) {
	le := binary.LittleEndian
	head := r.nextDesc
	for i, s := range segs {
		id := r.nextDesc % r.size
		r.nextDesc++
		n := len(s.data)
		var flags uint16
		if s.writable {
			n, flags = s.n, 2
		}
		addr := r.data
		r.data += uint64(n+15) &^ 15
		r.mem.WriteAt(s.data, addr)
		if i < len(segs)-1 {
			flags |= 1
		}
		e := make([]byte, 16)
		le.PutUint64(e, addr)
		le.PutUint32(e[8:], uint32(n))
		le.PutUint16(e[12:], flags)
		le.PutUint16(e[14:], r.nextDesc%r.size)
		r.mem.WriteAt(e, r.desc+16*uint64(id))
	}
	r.mem.PutUint16(r.avail+4+2*uint64(r.availIdx%r.size), head%r.size)
	r.availIdx++
	r.mem.StoreUint16(r.avail+2, r.availIdx)
}

// usedLens returns the lengths the device recorded in the used ring.
func (r *rawRing) usedLens() []uint32 {
	idx, _ := r.mem.LoadUint16(r.used + 2)
	var lens []uint32
	for i := range idx {
		n, _ := r.mem.Uint32(r.used + 4 + 8*uint64(i%r.size) + 4)
		lens = append(lens, n)
	}
	return lens
}

// txDevice is a running device whose transmit queue is a rawRing.
type txDevice struct {
	dev    *Device
	be     *chanBackend
	ring   *rawRing
	irq    chan struct{}
	failed chan error
}

func newTxDevice(t testing.TB, chains ...[]seg) *txDevice {
	be := newBackend()
	dev, err := New(testMAC, testMTU, be, nil)
	if err != nil {
		t.Fatal(err)
	}
	drv := virtiotest.NewDriver(1 << 20)
	rx := drv.NewQueue(16)
	ring := newRawRing(drv.Mem, 16)
	for _, c := range chains {
		ring.add(c) // before DRIVER_OK: the device looks at once
	}
	td := &txDevice{dev: dev, be: be, ring: ring, irq: make(chan struct{}, 1), failed: make(chan error, 1)}
	err = dev.Activate(virtio.Activation{
		Mem: drv.Mem, Queues: []*virtio.Queue{rx.Device(), ring.device()},
		Interrupt: func() {
			select {
			case td.irq <- struct{}{}:
			default:
			}
		},
		Fail: func(err error) { td.failed <- err },
	})
	if err != nil {
		t.Fatal(err)
	}
	return td
}

// waitIRQ waits for the device to return the tx chains.
func (td *txDevice) waitIRQ(t testing.TB) {
	t.Helper()
	select {
	case <-td.irq:
	case err := <-td.failed:
		t.Fatalf("device failed: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("no interrupt")
	}
}

func TestTransmitScatteredChain(t *testing.T) {
	hdr, f := txHdr(0, 0), frame(3, 200)
	pkt := append(bytes.Clone(hdr), f...)
	td := newTxDevice(t,
		// The header split over three buffers, the frame over several,
		// with empty buffers between and a writable one after.
		[]seg{{data: pkt[:5]}, {data: nil}, {data: pkt[5:11]}, {data: pkt[11:13]}, {data: pkt[13:100]}, {data: pkt[100:]}, {writable: true, n: 64}},
		// A chain of only empty buffers.
		[]seg{{data: nil}, {data: nil}},
		// A header alone in a buffer, the frame in the next.
		[]seg{{data: hdr}, {data: frame(4, 60)}},
	)
	defer td.dev.Close()
	td.waitIRQ(t)
	if got := td.be.recv(t); !bytes.Equal(got, f) {
		t.Errorf("scattered frame: % x", got)
	}
	if got := td.be.recv(t); !bytes.Equal(got, frame(4, 60)) {
		t.Errorf("second frame: % x", got)
	}
	if lens := td.ring.usedLens(); len(lens) != 3 || lens[0] != 0 || lens[1] != 0 || lens[2] != 0 {
		t.Errorf("used lengths %v", lens)
	}
	td.dev.Close()
	if s := td.dev.Stats(); s.TxFrames != 2 || s.TxDropped != 1 {
		t.Errorf("stats %+v", s)
	}
}

// FuzzTX sends one chain of arbitrary bytes, cut into buffers as layout
// says, and checks the device either passes the frame unchanged or drops
// and counts it, never failing.
func FuzzTX(f *testing.F) {
	good := append(txHdr(0, 0), frame(1, 60)...)
	f.Add([]byte{}, good)
	f.Add([]byte{1, 1, 1, 1}, good)
	f.Add([]byte{0x80, 3}, good)
	f.Add([]byte{}, txHdr(0, 0))
	f.Add([]byte{2}, []byte{0, 0, 0})
	f.Add([]byte{}, append(txHdr(0, 4), frame(1, 60)...))
	f.Add([]byte{}, append(txHdr(1, 0), frame(1, 60)...))
	f.Add([]byte{200, 7}, append(txHdr(0, 0), frame(1, ethHdrLen+vlanLen+testMTU)...))
	f.Add([]byte{}, append(txHdr(0, 0), frame(1, ethHdrLen+vlanLen+testMTU+1)...))
	f.Fuzz(func(t *testing.T, layout, data []byte) {
		if len(data) > 8<<10 || len(layout) > 8 {
			return
		}
		var segs []seg
		rest := data
		for _, b := range layout[:min(len(layout), 6)] {
			cut := int(b&0x7f) * 7 % (len(rest) + 1)
			segs = append(segs, seg{data: rest[:cut]})
			rest = rest[cut:]
		}
		segs = append(segs, seg{data: rest})
		if len(layout) > 0 && layout[0]&0x80 != 0 {
			segs = append(segs, seg{writable: true, n: int(layout[0] & 0x7f)})
		}
		td := newTxDevice(t, segs)
		defer td.dev.Close()
		td.waitIRQ(t)
		n := len(data) - hdrLen
		valid := n >= ethHdrLen && n <= ethHdrLen+vlanLen+testMTU && data[hdrFlags] == 0 && data[hdrGSOType] == 0
		if valid {
			if got := td.be.recv(t); !bytes.Equal(got, data[hdrLen:]) {
				t.Fatalf("backend got % x, want % x", got, data[hdrLen:])
			}
		}
		td.dev.Close()
		s := td.dev.Stats()
		if valid && (s.TxFrames != 1 || s.TxDropped != 0) || !valid && (s.TxFrames != 0 || s.TxDropped != 1) {
			t.Fatalf("valid %v, stats %+v", valid, s)
		}
		if lens := td.ring.usedLens(); len(lens) != 1 || lens[0] != 0 {
			t.Fatalf("used lengths %v", lens)
		}
		select {
		case err := <-td.failed:
			t.Fatalf("device failed: %v", err)
		default:
		}
	})
}
