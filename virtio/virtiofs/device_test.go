package virtiofs

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/capsa-sandbox/capsa/p9fs"
	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

// guest drives the device through real split queues in test memory.
type guest struct {
	t      *testing.T
	dev    *Device
	drv    *virtiotest.Driver
	qs     []*virtiotest.Queue
	failed atomic.Value
	unique uint64
}

func newGuest(t *testing.T, root string) *guest {
	t.Helper()
	a, err := p9fs.New(root, p9fs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dev, err := New("share0", a, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	g := &guest{t: t, dev: dev, drv: virtiotest.NewDriver(16 << 20)}
	g.qs = []*virtiotest.Queue{g.drv.NewQueue(queueSize), g.drv.NewQueue(queueSize)}
	err = dev.Activate(virtio.Activation{
		Mem: g.drv.Mem, Queues: []*virtio.Queue{g.qs[0].Device(), g.qs[1].Device()},
		Interrupt: func() {},
		Fail:      func(err error) { g.failed.Store(err) },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	return g
}

// request encodes a FUSE request: the header, then body's fields.
func (g *guest) request(op uint32, node uint64, body ...any) []byte {
	var b bytes.Buffer
	for _, v := range body {
		binary.Write(&b, binary.LittleEndian, v)
	}
	g.unique++
	h := fuse.InHeader{Length: uint32(40 + b.Len()), Opcode: op, Unique: g.unique, NodeId: node}
	var out bytes.Buffer
	binary.Write(&out, binary.LittleEndian, h)
	out.Write(b.Bytes())
	return out.Bytes()
}

// roundTrip sends req on the request queue and returns the reply's error
// and body.
func (g *guest) roundTrip(req []byte, room int) (int32, []byte) {
	g.t.Helper()
	if _, err := g.qs[1].Add(req, room); err != nil {
		g.t.Fatal(err)
	}
	g.dev.Notify(1)
	used := g.qs[1].WaitUsed(1, 5*time.Second)
	if len(used) != 1 {
		g.t.Fatalf("device returned %d chains, want 1 (failed: %v)", len(used), g.failed.Load())
	}
	w := used[0].Written
	if len(w) < outHeaderLen {
		g.t.Fatalf("reply of %d bytes, shorter than a header", len(w))
	}
	if got := binary.LittleEndian.Uint32(w); int(got) != len(w) {
		g.t.Fatalf("reply header says %d bytes, %d written", got, len(w))
	}
	if u := binary.LittleEndian.Uint64(w[8:]); u != g.unique {
		g.t.Fatalf("reply for request %d, want %d", u, g.unique)
	}
	return int32(binary.LittleEndian.Uint32(w[4:])), w[outHeaderLen:]
}

const opLookup = 1

func cstring(s string) []byte { return append([]byte(s), 0) }

func TestInitAndLookup(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f"), []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	g := newGuest(t, dir)
	// INIT: major 7, minor 31, as Linux 6.x sends, offering READDIRPLUS
	// and READDIRPLUS_AUTO.
	const plus = uint32(fuse.CAP_READDIRPLUS | fuse.CAP_READDIRPLUS_AUTO)
	errno, body := g.roundTrip(g.request(opInit, 0, uint32(7), uint32(31), uint32(128<<10), plus, uint32(0), [11]uint32{}), 4096)
	if errno != 0 || len(body) < 24 {
		t.Fatalf("INIT: error %d, %d bytes", errno, len(body))
	}
	if major, maxWrite := binary.LittleEndian.Uint32(body), binary.LittleEndian.Uint32(body[20:]); major != 7 || maxWrite != MaxWrite {
		t.Fatalf("INIT reply: major %d, max_write %d; want 7, %d", major, maxWrite, MaxWrite)
	}
	if flags := binary.LittleEndian.Uint32(body[12:]); flags&plus != plus {
		t.Fatalf("INIT reply: flags %#x; want READDIRPLUS and READDIRPLUS_AUTO (%#x)", flags, plus)
	}
	errno, body = g.roundTrip(g.request(opLookup, 1, cstring("f")), 4096)
	var e fuse.EntryOut
	if errno != 0 || binary.Read(bytes.NewReader(body), binary.LittleEndian, &e) != nil || e.NodeId == 0 || e.Size != 5 {
		t.Fatalf("LOOKUP f: error %d, node %d, size %d", errno, e.NodeId, e.Size)
	}
	// OPENDIR of the root, then READDIRPLUS: f, looked up, the node LOOKUP found.
	errno, body = g.roundTrip(g.request(27, 1, uint32(0), uint32(0)), 4096)
	if errno != 0 || len(body) < 8 {
		t.Fatalf("OPENDIR: error %d, %d bytes", errno, len(body))
	}
	fh := binary.LittleEndian.Uint64(body)
	errno, body = g.roundTrip(g.request(44, 1, fh, uint64(0), uint32(4096), uint32(0), uint64(0), uint32(0), uint32(0)), 4096+outHeaderLen)
	if errno != 0 {
		t.Fatalf("READDIRPLUS: error %d", errno)
	}
	// Each entry: fuse_entry_out (the node id first), then fuse_dirent
	// (ino, off, namelen, type) and the name, padded to 8.
	var fNode uint64
	for b := body; len(b) >= 128+24; {
		n := int(binary.LittleEndian.Uint32(b[128+16:]))
		if len(b) < 128+24+n {
			t.Fatalf("READDIRPLUS: an entry's name runs past the reply")
		}
		if string(b[128+24:128+24+n]) == "f" {
			fNode = binary.LittleEndian.Uint64(b)
		}
		b = b[min(len(b), 128+(24+n+7)&^7):]
	}
	if fNode != e.NodeId {
		t.Fatalf("READDIRPLUS: f is node %d; want %d, as LOOKUP found it", fNode, e.NodeId)
	}
	errno, _ = g.roundTrip(g.request(opLookup, 12345, cstring("f")), 4096)
	if errno != -9 { // EBADF
		t.Fatalf("LOOKUP under an unknown node: error %d, want -EBADF", errno)
	}
	// FALLOCATE and RENAME2 reach the server (an unknown handle, an
	// unknown directory), not the device's ENOSYS.
	errno, _ = g.roundTrip(g.request(43, e.NodeId, uint64(99), uint64(0), uint64(1), uint32(0), uint32(0)), 4096)
	if errno != -9 {
		t.Fatalf("FALLOCATE of an unknown handle: error %d, want -EBADF", errno)
	}
	errno, _ = g.roundTrip(g.request(45, 1, uint64(777), uint32(0), uint32(0), cstring("f"), cstring("g")), 4096)
	if errno != -9 {
		t.Fatalf("RENAME2 into an unknown directory: error %d, want -EBADF", errno)
	}
}

// TestHostileRequests: malformed requests get an error reply (or their
// chain back) and never stop the device.
func TestHostileRequests(t *testing.T) {
	g := newGuest(t, t.TempDir())
	g.roundTrip(g.request(opInit, 0, uint32(7), uint32(31), uint32(128<<10), uint32(0), uint32(0), [11]uint32{}), 4096)
	// A header whose length lies.
	req := g.request(opLookup, 1, cstring("f"))
	binary.LittleEndian.PutUint32(req, 1<<30)
	if errno, _ := g.roundTrip(req, 4096); errno == 0 {
		t.Error("a request whose length lies was answered without an error")
	}
	// An opcode the device does not serve, a request too short for its
	// opcode, and an INIT of another protocol.
	if errno, _ := g.roundTrip(g.request(9999, 1), 4096); errno != -errnoENOSYS {
		t.Errorf("an unknown opcode: error %d, want -ENOSYS", errno)
	}
	if errno, _ := g.roundTrip(g.request(16, 1, uint32(1)), 4096); errno != -errnoEINVAL {
		t.Errorf("a WRITE shorter than its arguments: error %d, want -EINVAL", errno)
	}
	if errno, _ := g.roundTrip(g.request(opInit, 0, uint32(8), uint32(31)), 4096); errno != -errnoEPROTO {
		t.Errorf("INIT of protocol 8: error %d, want -EPROTO", errno)
	}
	// Too short for a header: the chain comes back, with nothing written.
	if _, err := g.qs[1].Add([]byte{1, 2, 3}, 64); err != nil {
		t.Fatal(err)
	}
	g.dev.Notify(1)
	if used := g.qs[1].WaitUsed(1, 5*time.Second); len(used) != 1 || len(used[0].Written) != 0 {
		t.Fatalf("a 3-byte request: %d chains back", len(used))
	}
	// Still serving.
	if errno, _ := g.roundTrip(g.request(opLookup, 1, cstring("missing")), 4096); errno != 0 {
		t.Fatalf("LOOKUP after the hostile requests: error %d", errno)
	}
	if err := g.failed.Load(); err != nil {
		t.Fatalf("the device failed: %v", err)
	}
}

// FuzzRequest feeds the device arbitrary requests after a real INIT.
func FuzzRequest(f *testing.F) {
	f.Add(uint32(opLookup), uint64(1), []byte("f\x00"))
	f.Add(uint32(opInit), uint64(0), make([]byte, 64))
	f.Add(uint32(3), uint64(1), make([]byte, 16))      // GETATTR
	f.Add(uint32(12), uint64(1), []byte("x\x00y\x00")) // RENAME
	f.Add(uint32(35), uint64(1), make([]byte, 64))     // CREATE
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, op uint32, node uint64, body []byte) {
		g := newGuest(t, dir)
		g.roundTrip(g.request(opInit, 0, uint32(7), uint32(31), uint32(128<<10), uint32(0), uint32(0), [11]uint32{}), 4096)
		if _, err := g.qs[1].Add(g.request(op, node, body), 8192); err != nil {
			t.Fatal(err)
		}
		g.dev.Notify(1)
		g.dev.Notify(0)
		// Every chain comes back, those of requests with no reply
		// (FORGET, INTERRUPT) with nothing written.
		if used := g.qs[1].WaitUsed(1, 5*time.Second); len(used) != 1 {
			t.Fatalf("op %d: no reply", op)
		}
		if err := g.failed.Load(); err != nil {
			t.Fatalf("op %d: the device failed: %v", op, err)
		}
	})
}

// TestSessionOrder: INIT once per mount; a DESTROY (an unmount) forgets
// every node, after which a new INIT starts again.
func TestSessionOrder(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	g := newGuest(t, dir)
	initReq := func() []byte {
		return g.request(opInit, 0, uint32(7), uint32(31), uint32(128<<10), uint32(0), uint32(0), [11]uint32{})
	}
	if errno, _ := g.roundTrip(initReq(), 4096); errno != 0 {
		t.Fatalf("INIT: %d", errno)
	}
	if errno, _ := g.roundTrip(initReq(), 4096); errno != -errnoEINVAL {
		t.Fatalf("a second INIT: error %d, want -EINVAL", errno)
	}
	if errno, _ := g.roundTrip(g.request(opLookup, 1, cstring("f")), 4096); errno != 0 {
		t.Fatalf("LOOKUP: %d", errno)
	}
	fs := g.dev.sess.fs
	if n, _ := fs.Nodes(); n != 2 {
		t.Fatalf("%d nodes after a lookup, want 2", n)
	}
	if errno, _ := g.roundTrip(g.request(opDestroy, 0), 4096); errno != 0 {
		t.Fatalf("DESTROY: %d", errno)
	}
	if n, _ := fs.Nodes(); n != 1 {
		t.Fatalf("%d nodes after DESTROY, want the root alone", n)
	}
	if errno, _ := g.roundTrip(initReq(), 4096); errno != 0 {
		t.Fatalf("INIT after DESTROY: %d", errno)
	}
}
