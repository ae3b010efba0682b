package ninep

import (
	"bytes"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/p9fs"
	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

// guest drives the device through a real split queue in test memory.
type guest struct {
	t      *testing.T
	dev    *Device
	drv    *virtiotest.Driver
	q      *virtiotest.Queue
	failed atomic.Value
}

func newGuest(t *testing.T, root string, ro bool) *guest {
	return newGuestMem(t, root, ro, 64<<20)
}

func newGuestMem(t *testing.T, root string, ro bool, mem int) *guest {
	t.Helper()
	a, err := p9fs.New(root, p9fs.Options{ReadOnly: ro})
	if err != nil {
		t.Fatal(err)
	}
	dev, err := New("share0", a, Options{ReadOnly: ro}, nil)
	if err != nil {
		t.Fatal(err)
	}
	g := &guest{t: t, dev: dev, drv: virtiotest.NewDriver(mem)}
	g.q = g.drv.NewQueue(queueSize)
	err = dev.Activate(virtio.Activation{
		Mem: g.drv.Mem, Queues: []*virtio.Queue{g.q.Device()},
		Interrupt: func() {},
		Fail:      func(err error) { g.failed.Store(err) },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	return g
}

// roundTrip sends one raw request and returns the device's reply.
func (g *guest) roundTrip(req []byte, room int) []byte {
	g.t.Helper()
	if _, err := g.q.Add(req, room); err != nil {
		g.t.Fatal(err)
	}
	g.dev.Notify(0)
	used := g.q.WaitUsed(1, 5*time.Second)
	if len(used) != 1 {
		g.t.Fatalf("device returned %d chains, want 1 (failed: %v)", len(used), g.failed.Load())
	}
	return used[0].Written
}

// bridge connects a real p9 client to the device: each message the client
// sends becomes one descriptor chain, each reply goes back on the pipe.
func (g *guest) bridge(msize uint32) *p9.Client {
	g.t.Helper()
	clientEnd, devEnd := net.Pipe()
	var wmu sync.Mutex
	go func() { // client → queue
		for {
			var hdr [4]byte
			if _, err := io.ReadFull(devEnd, hdr[:]); err != nil {
				return
			}
			msg := make([]byte, binary.LittleEndian.Uint32(hdr[:]))
			copy(msg, hdr[:])
			if _, err := io.ReadFull(devEnd, msg[4:]); err != nil {
				return
			}
			if _, err := g.q.Add(msg, int(msize)); err != nil {
				g.t.Error(err)
				return
			}
			g.dev.Notify(0)
		}
	}()
	done := make(chan struct{})
	go func() { // queue → client
		for {
			select {
			case <-done:
				return
			case <-time.After(200 * time.Microsecond):
			}
			for _, u := range g.q.TakeUsed() {
				wmu.Lock()
				devEnd.Write(u.Written)
				wmu.Unlock()
			}
		}
	}()
	c, err := p9.NewClient(clientEnd, p9.WithMessageSize(msize))
	if err != nil {
		g.t.Fatal(err)
	}
	g.t.Cleanup(func() { c.Close(); close(done); devEnd.Close() })
	return c
}

func TestConfigSpaceHoldsTheTag(t *testing.T) {
	g := newGuest(t, t.TempDir(), false)
	buf := make([]byte, 10)
	g.dev.ReadConfig(0, buf)
	if want := append([]byte{6, 0}, "share0"...); !bytes.Equal(buf[:8], want) || buf[8] != 0 {
		t.Errorf("config space % x, want % x", buf, want)
	}
	g.dev.ReadConfig(2, buf[:3])
	if string(buf[:3]) != "sha" {
		t.Errorf("config at offset 2: %q", buf[:3])
	}
	if g.dev.Features()&featureMountTag == 0 || g.dev.Type() != virtio.Type9P {
		t.Error("the device must offer VIRTIO_9P_MOUNT_TAG and be type 9")
	}
}

func TestNewRejectsBadTags(t *testing.T) {
	a, err := p9fs.New(t.TempDir(), p9fs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tag := range []string{"", "has space", "tab\t", string(make([]byte, MaxTagLen+1)), "é"} {
		if _, err := New(tag, a, Options{}, nil); err == nil {
			t.Errorf("New(%q) succeeded", tag)
		}
	}
	if _, err := New("ok", nil, Options{}, nil); err == nil {
		t.Error("New without a filesystem succeeded")
	}
}

// TestCloseReleasesTheShare: Close closes the file server's root
// descriptor at once, not when the garbage collector finds the device (a
// closed sandbox may be kept for its exit status).
func TestCloseReleasesTheShare(t *testing.T) {
	before := openFDs()
	a, err := p9fs.New(t.TempDir(), p9fs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	d, err := New("share0", a, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if openFDs() <= before {
		t.Fatal("p9fs.New opened no descriptor: the test cannot see a leak")
	}
	if err := d.Close(); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if got := openFDs(); got != before {
		t.Errorf("descriptors after Close = %d, want %d (the share's root still open)", got, before)
	}
	runtime.KeepAlive(d)
}

// TestRealClientThroughTheQueue runs the p9 package's client against the
// device, request by request through descriptor chains.
func TestRealClientThroughTheQueue(t *testing.T) {
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "hello.txt"), []byte("hello from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	g := newGuest(t, root, false)
	c := g.bridge(256 << 10)
	rootf, err := c.Attach("")
	if err != nil {
		t.Fatal(err)
	}
	_, f, err := rootf.Walk([]string{"hello.txt"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 100)
	n, err := f.ReadAt(buf, 0)
	if err != nil && err != io.EOF {
		t.Fatal(err)
	}
	if string(buf[:n]) != "hello from the host\n" {
		t.Errorf("read %q", buf[:n])
	}
	f.Close()

	// A write larger than one page crosses several buffers.
	_, dir, err := rootf.Walk(nil)
	if err != nil {
		t.Fatal(err)
	}
	nf, _, _, err := dir.Create("new.bin", p9.WriteOnly, 0o644, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("0123456789abcdef"), 10000)
	if n, err := nf.WriteAt(data, 0); err != nil || n != len(data) {
		t.Fatalf("WriteAt: %d, %v", n, err)
	}
	nf.Close()
	got, err := os.ReadFile(filepath.Join(root, "new.bin"))
	if err != nil || !bytes.Equal(got, data) {
		t.Errorf("host sees %d bytes, %v; want %d", len(got), err, len(data))
	}
	if err := g.failed.Load(); err != nil {
		t.Errorf("device failed: %v", err)
	}
}

func isError(reply []byte, tag uint16) bool {
	return len(reply) == headerLen+4 && reply[4] == rlerror && binary.LittleEndian.Uint16(reply[5:]) == tag &&
		binary.LittleEndian.Uint32(reply) == headerLen+4
}

func TestHostileRequestsGetErrors(t *testing.T) {
	g := newGuest(t, t.TempDir(), false)
	version := func(tag uint16, msize uint32) []byte {
		body := binary.LittleEndian.AppendUint32(nil, msize)
		body = binary.LittleEndian.AppendUint16(body, 8)
		return message(tversion, tag, append(body, "9P2000.L"...))
	}
	if r := g.roundTrip(version(0xffff, 8192), 8192); len(r) < headerLen || r[4] != tversion+1 {
		t.Fatalf("Tversion reply % x", r)
	}

	lying := message(120, 1, []byte{1, 2, 3})
	binary.LittleEndian.PutUint32(lying, 1000) // more than the buffers hold
	tooBig := message(120, 2, make([]byte, 9000))
	tiny := message(120, 3, nil)
	binary.LittleEndian.PutUint32(tiny, 3)
	for name, tc := range map[string]struct {
		req []byte
		tag uint16
	}{
		"size beyond buffers": {lying, 1},
		"beyond msize":        {tooBig, 2},
		"size below header":   {tiny, 3},
		"unknown type":        {message(250, 4, nil), 4},
		"truncated body":      {message(110 /* Twalk */, 5, []byte{1}), 5},
	} {
		if r := g.roundTrip(tc.req, 64); !isError(r, tc.tag) {
			t.Errorf("%s: reply % x, want Rlerror for tag %d", name, r, tc.tag)
		}
	}
	if r := g.roundTrip([]byte{1, 2, 3}, 64); !isError(r, 0xffff) {
		t.Errorf("a 3-byte request: reply % x", r)
	}
	if r := g.roundTrip(version(7, 8192), 4); len(r) != 0 {
		t.Errorf("no room for a reply: the device wrote % x", r)
	}
	if err := g.failed.Load(); err != nil {
		t.Errorf("malformed messages broke the device: %v", err)
	}
	// The session still works.
	if r := g.roundTrip(version(0xffff, 8192), 8192); len(r) < headerLen || r[4] != tversion+1 {
		t.Fatalf("Tversion after the bad requests: % x", r)
	}
}

func FuzzRequests(f *testing.F) {
	f.Add(message(tversion, 0xffff, []byte{0, 32, 0, 0, 8, 0, '9', 'P', '2', '0', '0', '0', '.', 'L'}))
	f.Add(message(104 /* Tattach */, 1, make([]byte, 20)))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 1, 2})
	root := f.TempDir()
	os.WriteFile(filepath.Join(root, "f"), []byte("x"), 0o644)
	f.Fuzz(func(t *testing.T, req []byte) {
		if len(req) == 0 {
			return
		}
		g := newGuestMem(t, root, true, 1<<20)
		if _, err := g.q.Add(req, 1024); err != nil {
			t.Fatal(err)
		}
		g.dev.Notify(0)
		used := g.q.WaitUsed(1, 5*time.Second)
		if len(used) != 1 {
			t.Fatalf("request % x never came back", req)
		}
	})
}

func TestCheckBody(t *testing.T) {
	str := func(s string) []byte { return append(binary.LittleEndian.AppendUint16(nil, uint16(len(s))), s...) }
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	u32 := func(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }
	u64 := func(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }
	for _, tc := range []struct {
		name  string
		typ   byte
		body  []byte
		errno uint32
	}{
		{"version", tversion, cat(u32(8192), str("9P2000.L")), 0},
		{"version short string", tversion, cat(u32(8192), []byte{8, 0, '9'}), errnoEINVAL},
		{"walk two names", 110, cat(u32(1), u32(2), []byte{2, 0}, str("a"), str("b")), 0},
		{"walk missing name", 110, cat(u32(1), u32(2), []byte{2, 0}, str("a")), errnoEINVAL},
		{"write exact", 118, cat(u32(1), u64(0), u32(3), []byte("abc")), 0},
		{"write count lies", 118, cat(u32(1), u64(0), u32(4), []byte("abc")), errnoEINVAL},
		{"setattr", 26, make([]byte, 4+4+12+40), 0},
		{"setattr short", 26, make([]byte, 59), errnoEINVAL},
		{"a reply type", rlerror, u32(5), errnoENOSYS},
		{"getlock short (the device answers it)", 54, u32(1), errnoEINVAL},
		{"an unassigned type", 56, nil, errnoENOSYS},
		{"extra bytes are ignored, as the server does", 120, cat(u32(1), u32(9)), 0},
	} {
		errno, err := checkBody(tc.typ, tc.body)
		if errno != tc.errno || (err == nil) != (tc.errno == 0) {
			t.Errorf("%s: errno %d, %v; want %d", tc.name, errno, err, tc.errno)
		}
	}
}

// TestRequestsQueuedBeforeActivation: a request the driver made available
// before DRIVER_OK (its notification went nowhere) is served once the
// device starts, not left until the next notification.
func TestRequestsQueuedBeforeActivation(t *testing.T) {
	a, err := p9fs.New(t.TempDir(), p9fs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dev, err := New("share0", a, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	drv := virtiotest.NewDriver(16 << 20)
	q := drv.NewQueue(queueSize)
	body := binary.LittleEndian.AppendUint32(nil, 8192)
	body = binary.LittleEndian.AppendUint16(body, 8)
	if _, err := q.Add(message(tversion, 0xffff, append(body, "9P2000.L"...)), 8192); err != nil {
		t.Fatal(err)
	}
	err = dev.Activate(virtio.Activation{Mem: drv.Mem, Queues: []*virtio.Queue{q.Device()}, Interrupt: func() {}, Fail: func(error) {}})
	if err != nil {
		t.Fatal(err)
	}
	if u := q.WaitUsed(1, 5*time.Second); len(u) != 1 {
		t.Fatalf("WaitUsed after activation = %d chains, want the Tversion queued before it", len(u))
	}
}

// TestFlushesTheServerCannotWaitFor: a Tflush of its own tag, of a tag not
// in flight, or of another flush gets its Rflush from the device at once
// (the p9 server would wait forever for the first and last), and Close
// still returns promptly.
func TestFlushesTheServerCannotWaitFor(t *testing.T) {
	g := newGuest(t, t.TempDir(), false)
	body := binary.LittleEndian.AppendUint32(nil, 8192)
	body = binary.LittleEndian.AppendUint16(body, 8)
	if r := g.roundTrip(message(tversion, 0xffff, append(body, "9P2000.L"...)), 8192); len(r) < headerLen || r[4] != tversion+1 {
		t.Fatalf("Tversion: % x", r)
	}
	for name, req := range map[string][]byte{
		"its own tag":    message(tflush, 3, []byte{3, 0}),
		"an idle tag":    message(tflush, 4, []byte{9, 0}),
		"a NOTAG flush":  message(tflush, 0xffff, []byte{0xff, 0xff}),
		"a high old tag": message(tflush, 5, []byte{0x34, 0x12}),
	} {
		r := g.roundTrip(req, 64)
		want := flushReply(binary.LittleEndian.Uint16(req[5:]))
		if !bytes.Equal(r, want) {
			t.Errorf("Tflush of %s: reply % x, want % x", name, r, want)
		}
	}
	done := make(chan struct{})
	go func() { g.dev.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after the flushes")
	}
}

// TestRflushFollowsTheFlushedReply: the driver gets the flushed request's
// chain back before the Rflush, whatever order the server answers in:
// Linux frees the flushed request on Rflush, so a reply after it would be
// written into freed memory.
func TestRflushFollowsTheFlushedReply(t *testing.T) {
	drv := virtiotest.NewDriver(16 << 20)
	q := drv.NewQueue(queueSize)
	d := &Device{log: slog.New(slog.DiscardHandler)}
	act := &virtio.Activation{Mem: drv.Mem, Queues: []*virtio.Queue{q.Device()}, Interrupt: func() {}, Fail: func(error) {}}
	s := sessionState(d)
	d.act, d.sess = act, s
	read := message(116, 5, make([]byte, 16)) // Tread fid offset count
	flush := message(tflush, 6, []byte{5, 0}) // Tflush oldtag 5
	hRead, _ := q.Add(read, 4096)
	hFlush, _ := q.Add(flush, 64)
	for _, want := range []uint16{5, 6} {
		c, err := act.Queues[0].Next()
		if err != nil || c == nil {
			t.Fatalf("Next() = %v, %v", c, err)
		}
		if _, tag, reply, err := s.admit(c); err != nil || reply != nil || tag != want {
			t.Fatalf("admit(tag %d) = tag %d, reply % x, err %v", want, tag, reply, err)
		}
	}
	s.reply(flushReply(6)) // the server's Rflush comes first
	if u := q.TakeUsed(); len(u) != 0 {
		t.Fatalf("Rflush returned before the flushed request: %+v", u)
	}
	rread := message(117, 5, []byte{0, 0, 0, 0}) // Rread count 0
	s.reply(rread)
	u := q.TakeUsed()
	if len(u) != 2 || u[0].Head != hRead || u[1].Head != hFlush {
		t.Fatalf("used chains %+v, want the read (head %d) then the flush (head %d)", u, hRead, hFlush)
	}
	if !bytes.Equal(u[0].Written, rread) || !bytes.Equal(u[1].Written, flushReply(6)) {
		t.Errorf("replies % x and % x", u[0].Written, u[1].Written)
	}
	// Tags are free again: both can be reused.
	if len(s.pending) != 0 || len(s.flushes) != 0 || len(s.held) != 0 {
		t.Errorf("session still holds pending %v flushes %v held %v", s.pending, s.flushes, s.held)
	}
}

// TestCreatesCarryTheirCreator: a file, directory, node or symlink made
// through an attach of uid 1000 (as Linux attaches once per user) reaches
// the file server with that uid, which keeps it as the owner (p9fs's
// ownerXattr); the guest gets the reply type it asked for. Root's attach
// makes files with no owner kept.
func TestCreatesCarryTheirCreator(t *testing.T) {
	root := t.TempDir()
	if err := unix.Setxattr(root, "user.capsa-test", []byte("1"), 0); err != nil {
		t.Skipf("%s keeps no user attributes (%v)", root, err)
	}
	g := newGuest(t, root, false)
	le := binary.LittleEndian
	str := func(b []byte, s string) []byte { return append(le.AppendUint16(b, uint16(len(s))), s...) }
	u32s := func(b []byte, v ...uint32) []byte {
		for _, x := range v {
			b = le.AppendUint32(b, x)
		}
		return b
	}
	send := func(typ byte, tag uint16, body []byte) {
		t.Helper()
		if r := g.roundTrip(message(typ, tag, body), 8192); len(r) < headerLen || r[4] != typ+1 {
			t.Fatalf("request type %d: reply % x, want type %d", typ, r, typ+1)
		}
	}
	send(tversion, 0xffff, str(u32s(nil, 8192), "9P2000.L"))
	attach := func(fid, uid uint32) {
		send(tattach, 1, u32s(str(str(u32s(nil, fid, ^uint32(0)), ""), ""), uid))
	}
	attach(1, 1000)
	attach(2, 0)
	send(72, 2, u32s(str(u32s(nil, 1), "d"), 0o755, 1000))                   // Tmkdir
	send(18, 3, u32s(str(u32s(nil, 1), "n"), unix.S_IFREG|0o644, 0, 0, 100)) // Tmknod
	send(16, 4, u32s(str(str(u32s(nil, 1), "l"), "d"), 1000))                // Tsymlink
	send(twalk, 5, append(u32s(nil, 1, 3), 0, 0))                            // a clone to create from
	send(14, 6, u32s(str(u32s(nil, 3), "f"), unix.O_WRONLY, 0o644, 1000))    // Tlcreate
	send(72, 7, u32s(str(u32s(nil, 2), "r"), 0o755, 0))                      // root's Tmkdir

	owner := func(name string) string {
		buf := make([]byte, 64)
		n, err := unix.Getxattr(filepath.Join(root, name), "user.capsa.owner", buf)
		if err != nil {
			return err.Error()
		}
		return string(buf[:n])
	}
	for name, want := range map[string]string{
		"d": "1000:1000", "n": "1000:100", "f": "1000:1000", "r": unix.ENODATA.Error(),
	} {
		if got := owner(name); got != want {
			t.Errorf("%s: the owner kept is %q, want %q", name, got, want)
		}
	}
	if err := g.failed.Load(); err != nil {
		t.Errorf("device failed: %v", err)
	}
}
