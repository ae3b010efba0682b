package ninep

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/p9fs"
	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

// The hostile-guest tests below speak raw 9P2000.L through the device's
// queue, as a guest driver that does not play by Linux's rules would.

func u16b(v uint16) []byte { return binary.LittleEndian.AppendUint16(nil, v) }
func u32b(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }
func u64b(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }
func str9(s string) []byte { return append(u16b(uint16(len(s))), s...) }
func cat(parts ...[]byte) []byte {
	return bytes.Join(parts, nil)
}

// call sends one request and returns the reply.
func (g *guest) call(typ byte, tag uint16, body []byte, room int) []byte {
	g.t.Helper()
	return g.roundTrip(message(typ, tag, body), room)
}

// ok sends one request and fails the test unless it succeeds.
func (g *guest) ok(typ byte, tag uint16, body []byte, room int) []byte {
	g.t.Helper()
	r := g.call(typ, tag, body, room)
	if len(r) < headerLen || r[4] != typ+1 {
		g.t.Fatalf("request type %d tag %d: reply % x (errno %d), want type %d", typ, tag, r[:min(len(r), 16)], errnoOf(r), typ+1)
	}
	return r
}

// errnoOf is an Rlerror's errno, or -1 for any other reply.
func errnoOf(r []byte) int {
	if len(r) != headerLen+4 || r[4] != rlerror {
		return -1
	}
	return int(binary.LittleEndian.Uint32(r[headerLen:]))
}

func (g *guest) version(msize uint32) []byte {
	g.t.Helper()
	return g.call(tversion, 0xffff, cat(u32b(msize), str9("9P2000.L")), 8192)
}

// attach starts a session with msize 8192 and attaches fid 1 to the root.
func (g *guest) attach() {
	g.t.Helper()
	if r := g.version(8192); len(r) < headerLen || r[4] != rversion {
		g.t.Fatalf("Tversion: % x", r)
	}
	g.ok(tattach, 1, cat(u32b(1), u32b(noFid), str9("root"), str9(""), u32b(0)), 64)
}

func TestVersionBelowTheMinimumIsRefused(t *testing.T) {
	g := newGuest(t, t.TempDir(), false)
	if r := g.version(100); errnoOf(r) != errnoEINVAL {
		t.Fatalf("Tversion msize 100: reply % x, want Rlerror EINVAL", r)
	}
	// The session goes on with a sane msize, and the device's limit is
	// exactly the server's: a request one byte over it gets an error,
	// not the end of the connection.
	r := g.version(5000)
	if len(r) < headerLen+4 || r[4] != rversion || binary.LittleEndian.Uint32(r[headerLen:]) != 5000 {
		t.Fatalf("Tversion msize 5000: % x", r)
	}
	big := message(118 /* Twrite */, 2, cat(u32b(1), u64b(0), u32b(5000-23+1), make([]byte, 5000-23+1)))
	if r := g.roundTrip(big, 64); errnoOf(r) != errnoEINVAL {
		t.Fatalf("a %d-byte Twrite with msize 5000: reply % x, want Rlerror EINVAL", len(big), r)
	}
	g.ok(tattach, 3, cat(u32b(1), u32b(noFid), str9("root"), str9(""), u32b(0)), 64)
}

// TestVersionOnlyAlone: the p9 server swaps its buffers on Tversion, so a
// Tversion is refused while requests are in flight, and nothing else is
// admitted while a Tversion is.
func TestVersionOnlyAlone(t *testing.T) {
	drv := virtiotest.NewDriver(1 << 20)
	q := drv.NewQueue(queueSize)
	s := sessionState(&Device{log: slog.New(slog.DiscardHandler)})
	dq := q.Device()
	admit := func(req []byte) (uint16, []byte) {
		t.Helper()
		if _, err := q.Add(req, 64); err != nil {
			t.Fatal(err)
		}
		c, err := dq.Next()
		if err != nil || c == nil {
			t.Fatalf("Next() = %v, %v", c, err)
		}
		_, tag, reply, _ := s.admit(c)
		return tag, reply
	}
	version := message(tversion, 0xffff, cat(u32b(8192), str9("9P2000.L")))
	if _, r := admit(message(tread, 5, cat(u32b(1), u64b(0), u32b(10)))); r != nil {
		t.Fatalf("Tread: device answered % x", r)
	}
	if _, r := admit(version); errnoOf(r) != errnoEBUSY {
		t.Errorf("Tversion with a read in flight: reply % x, want Rlerror EBUSY", r)
	}
	s.reply(message(tread+1, 5, u32b(0)))
	if _, r := admit(version); r != nil {
		t.Fatalf("Tversion alone: device answered % x", r)
	}
	if _, r := admit(message(tclunk, 6, u32b(1))); errnoOf(r) != errnoEBUSY {
		t.Errorf("Tclunk behind a Tversion: reply % x, want Rlerror EBUSY", r)
	}
	s.reply(message(rversion, 0xffff, cat(u32b(8192), str9("9P2000.L"))))
	if s.msize != 8192 {
		t.Errorf("msize after Rversion = %d, want 8192", s.msize)
	}
	if _, r := admit(message(tclunk, 6, u32b(1))); r != nil {
		t.Errorf("Tclunk after the Rversion: device answered % x", r)
	}
}

// TestRequestsBeyondTheQueueAreRefused: a driver that reuses descriptor
// heads still in flight cannot put more requests in flight than the queue
// holds (the stream to the server holds that many).
func TestRequestsBeyondTheQueueAreRefused(t *testing.T) {
	drv := virtiotest.NewDriver(1 << 20)
	q := drv.NewQueue(queueSize)
	s := sessionState(&Device{log: slog.New(slog.DiscardHandler)})
	for i := range queueSize {
		s.pending[uint16(1000+i)] = &virtio.Chain{}
	}
	q.Add(message(tclunk, 7, u32b(1)), 64)
	c, _ := q.Device().Next()
	if _, _, r, err := s.admit(c); errnoOf(r) != errnoEBUSY || err == nil {
		t.Errorf("admit with %d in flight = reply % x, err %v; want Rlerror EBUSY", queueSize, r, err)
	}
}

// TestXattrCreateIsBoundedUpFront: the p9 server buffers an extended
// attribute's value until the clunk, so its size is checked when it is
// announced, and a read-only share refuses it at once.
func TestXattrCreateIsBoundedUpFront(t *testing.T) {
	for _, ro := range []bool{false, true} {
		t.Run(fmt.Sprintf("ro=%v", ro), func(t *testing.T) {
			g := newGuest(t, t.TempDir(), ro)
			g.attach()
			huge := cat(u32b(1), str9("user.x"), u64b(1<<40), u32b(0))
			want := errnoE2BIG
			if ro {
				want = errnoEROFS
			}
			if r := g.call(txattrcreate, 2, huge, 64); errnoOf(r) != want {
				t.Fatalf("Txattrcreate of 1 TiB: reply % x, want Rlerror %d", r, want)
			}
			small := cat(u32b(1), str9("user.x"), u64b(10), u32b(0))
			if r := g.call(txattrcreate, 3, small, 64); ro && errnoOf(r) != errnoEROFS {
				t.Errorf("Txattrcreate on a read-only share: reply % x, want Rlerror EROFS", r)
			} else if !ro && (len(r) < headerLen || r[4] != txattrcreate+1) {
				t.Errorf("Txattrcreate of 10 bytes: reply % x", r)
			}
		})
	}
}

// TestXattrFidsAreCapped: fids holding extended attribute values are
// limited per session, and a clunk frees one.
func TestXattrFidsAreCapped(t *testing.T) {
	g := newGuest(t, t.TempDir(), false)
	g.attach()
	for i := range MaxXattrFids {
		g.ok(txattrwalk, 2, cat(u32b(1), u32b(uint32(100+i)), str9("")), 4096)
	}
	if r := g.call(txattrwalk, 2, cat(u32b(1), u32b(99), str9("")), 4096); errnoOf(r) != errnoENFILE {
		t.Fatalf("Txattrwalk past %d: reply % x, want Rlerror ENFILE", MaxXattrFids, r)
	}
	g.ok(tclunk, 3, u32b(100), 64)
	g.ok(txattrwalk, 2, cat(u32b(1), u32b(99), str9("")), 4096)
	// Ordinary fids are still allowed.
	g.ok(twalk, 4, cat(u32b(1), u32b(5000), u16b(0)), 4096)
}

// TestFidsAreCapped: the fids one session holds are limited.
func TestFidsAreCapped(t *testing.T) {
	old := maxFids
	maxFids = 40
	defer func() { maxFids = old }()
	g := newGuest(t, t.TempDir(), false)
	g.attach() // fid 1
	for i := range maxFids - 1 {
		g.ok(twalk, 2, cat(u32b(1), u32b(uint32(10+i)), u16b(0)), 4096)
	}
	if r := g.call(twalk, 2, cat(u32b(1), u32b(9), u16b(0)), 4096); errnoOf(r) != errnoENFILE {
		t.Fatalf("Twalk past %d fids: reply % x, want Rlerror ENFILE", maxFids, r)
	}
	// A failed walk makes no fid; a removed one is released.
	g.ok(tclunk, 3, u32b(10), 64)
	if r := g.call(twalk, 2, cat(u32b(1), u32b(9), u16b(1), str9("missing")), 4096); errnoOf(r) < 0 {
		t.Fatalf("Twalk to a missing name: reply % x", r)
	}
	g.ok(twalk, 2, cat(u32b(1), u32b(9), u16b(0)), 4096)
}

// TestReadsAreCappedAtMsize: a Tread or Treaddir asking for more than fits
// msize gets what fits (the server caps reads at 4 MiB only and directory
// reads not at all, so the reply would not fit the driver's buffers).
func TestReadsAreCappedAtMsize(t *testing.T) {
	root := t.TempDir()
	data := bytes.Repeat([]byte("x"), 100<<10)
	os.WriteFile(filepath.Join(root, "f"), data, 0o644)
	os.Mkdir(filepath.Join(root, "d"), 0o755)
	for i := range 500 {
		os.WriteFile(filepath.Join(root, "d", fmt.Sprintf("entry-with-a-long-name-%04d", i)), nil, 0o644)
	}
	g := newGuest(t, root, true)
	g.attach()
	g.ok(twalk, 2, cat(u32b(1), u32b(2), u16b(1), str9("f")), 4096)
	g.ok(12 /* Tlopen */, 2, cat(u32b(2), u32b(0)), 4096)
	r := g.ok(tread, 3, cat(u32b(2), u64b(0), u32b(1<<20)), 8192)
	if n := binary.LittleEndian.Uint32(r[headerLen:]); n != 8192-rreadHdrLen || len(r) != 8192 {
		t.Errorf("Tread of 1 MiB with msize 8192: %d bytes in a %d-byte reply", n, len(r))
	}
	g.ok(twalk, 4, cat(u32b(1), u32b(3), u16b(1), str9("d")), 4096)
	g.ok(12, 4, cat(u32b(3), u32b(0)), 4096)
	r = g.ok(treaddir, 5, cat(u32b(3), u64b(0), u32b(1<<20)), 8192)
	if len(r) > 8192 || len(r) < 4096 {
		t.Errorf("Treaddir of 1 MiB with msize 8192: a %d-byte reply", len(r))
	}
}

// gate is an Attacher whose Attach waits until the gate opens: a file
// server call that does not return.
type gate struct {
	p9.Attacher
	open chan struct{}
}

func (a gate) Attach() (p9.File, error) {
	<-a.open
	return a.Attacher.Attach()
}

func newGated(t *testing.T) (*Device, *virtiotest.Queue, chan struct{}) {
	t.Helper()
	a, err := p9fs.New(t.TempDir(), p9fs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	open := make(chan struct{})
	dev, err := New("share0", gate{a, open}, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	drv := virtiotest.NewDriver(16 << 20)
	q := drv.NewQueue(queueSize)
	if err := dev.Activate(virtio.Activation{Mem: drv.Mem, Queues: []*virtio.Queue{q.Device()}, Interrupt: func() {}, Fail: func(error) {}}); err != nil {
		t.Fatal(err)
	}
	q.Add(message(tversion, 0xffff, cat(u32b(8192), str9("9P2000.L"))), 8192)
	dev.Notify(0)
	if u := q.WaitUsed(1, 5*time.Second); len(u) != 1 {
		t.Fatal("no Rversion")
	}
	return dev, q, open
}

// TestCloseIsBounded: Close returns, with an error, when the file server
// is stuck in a call that never returns.
func TestCloseIsBounded(t *testing.T) {
	old := closeTimeout
	closeTimeout = 300 * time.Millisecond
	defer func() { closeTimeout = old }()
	dev, q, open := newGated(t)
	defer close(open)
	q.Add(message(tattach, 1, cat(u32b(1), u32b(noFid), str9("root"), str9(""), u32b(0))), 64)
	dev.Notify(0)
	time.Sleep(50 * time.Millisecond)
	done := make(chan error, 1)
	go func() { done <- dev.Close() }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "did not stop") {
			t.Errorf("Close with a stuck server = %v, want an error saying so", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return with the file server stuck")
	}
}

// TestBackpressure: past the in-flight byte budget the device leaves
// requests in the queue, and takes them once replies free room.
func TestBackpressure(t *testing.T) {
	old := inflightBudget
	inflightBudget = 200
	defer func() { inflightBudget = old }()
	dev, q, open := newGated(t)
	defer dev.Close()
	const n = 20
	for i := range n {
		q.Add(message(tattach, uint16(i), cat(u32b(uint32(i+1)), u32b(noFid), str9("root"), str9(""), u32b(0))), 64)
	}
	dev.Notify(0)
	time.Sleep(100 * time.Millisecond)
	dev.mu.Lock()
	taken := len(dev.sess.pending)
	dev.mu.Unlock()
	if taken == 0 || taken >= n {
		t.Fatalf("%d of %d requests taken past a 200-byte budget, want some but not all", taken, n)
	}
	close(open)
	if u := q.WaitUsed(n, 5*time.Second); len(u) != n {
		t.Fatalf("%d of %d requests answered after the server went on", len(u), n)
	}
}

// TestResetReleasesEveryFid: open files and stuck flushes do not survive a
// device reset: the host descriptors come back to where they were.
func TestResetReleasesEveryFid(t *testing.T) {
	root := t.TempDir()
	for i := range 50 {
		os.WriteFile(filepath.Join(root, fmt.Sprint(i)), []byte("x"), 0o644)
	}
	a, err := p9fs.New(root, p9fs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dev, err := New("share0", a, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	base := openFDs()
	for round := range 3 {
		drv := virtiotest.NewDriver(16 << 20)
		g := &guest{t: t, dev: dev, drv: drv, q: drv.NewQueue(queueSize)}
		if err := dev.Activate(virtio.Activation{Mem: drv.Mem, Queues: []*virtio.Queue{g.q.Device()}, Interrupt: func() {}, Fail: func(error) {}}); err != nil {
			t.Fatal(err)
		}
		g.attach()
		for i := range 50 {
			fid := uint32(10 + i)
			g.ok(twalk, 2, cat(u32b(1), u32b(fid), u16b(1), str9(fmt.Sprint(i))), 4096)
			g.ok(12, 2, cat(u32b(fid), u32b(0)), 4096)
		}
		if got := openFDs(); got < base+90 {
			t.Fatalf("round %d: %d descriptors with 50 files open, want at least %d", round, got, base+90)
		}
		if r := g.call(tflush, 9, u16b(9), 64); !bytes.Equal(r, flushReply(9)) {
			t.Fatalf("round %d: self-flush reply % x", round, r)
		}
		dev.Reset()
	}
	deadline := time.Now().Add(5 * time.Second)
	for openFDs() > base+2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if got := openFDs(); got > base+2 {
		t.Errorf("%d descriptors after 3 resets, want %d (+2)", got, base)
	}
}

// FuzzRequestSequences feeds the device a session: a Tversion and a
// Tattach, then arbitrary messages (the input is cut into them, each
// prefixed by a u16 length), several in flight at once. Every request
// must come back, the device must not fail, and Close must return.
func FuzzRequestSequences(f *testing.F) {
	seq := func(msgs ...[]byte) []byte {
		var b []byte
		for _, m := range msgs {
			b = append(b, u16b(uint16(len(m)))...)
			b = append(b, m...)
		}
		return b
	}
	f.Add(seq(message(twalk, 2, cat(u32b(1), u32b(2), u16b(1), str9("f"))), message(12, 3, cat(u32b(2), u32b(0))),
		message(tread, 4, cat(u32b(2), u64b(0), u32b(100))), message(tflush, 5, u16b(4)), message(tclunk, 6, u32b(2))))
	f.Add(seq(message(txattrwalk, 2, cat(u32b(1), u32b(7), str9(""))), message(tversion, 3, cat(u32b(4096), str9("9P2000.L")))))
	f.Add(seq(message(tflush, 2, u16b(3)), message(tflush, 3, u16b(2)), message(treaddir, 4, cat(u32b(1), u64b(0), u32b(1<<30)))))
	root := f.TempDir()
	os.WriteFile(filepath.Join(root, "f"), []byte("hello"), 0o644)
	os.Mkdir(filepath.Join(root, "d"), 0o755)
	f.Fuzz(func(t *testing.T, in []byte) {
		g := newGuestMem(t, root, false, 4<<20)
		g.attach()
		n := 0
		for len(in) >= 2 && n < 32 {
			l := int(binary.LittleEndian.Uint16(in))
			in = in[2:]
			l = min(l, len(in))
			if l == 0 {
				continue
			}
			if _, err := g.q.Add(in[:l], 8192); err != nil {
				break
			}
			in = in[l:]
			n++
		}
		g.dev.Notify(0)
		if used := g.q.WaitUsed(n, 10*time.Second); len(used) != n {
			t.Fatalf("%d of %d requests came back", len(used), n)
		}
		if err := g.failed.Load(); err != nil {
			t.Fatalf("the device failed: %v", err)
		}
		done := make(chan error, 1)
		go func() { done <- g.dev.Close() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("Close did not return")
		}
	})
}

// guestAtFile is a guest attached (fid 1) to a share holding one file, f
// ("data"), with fid 2 walked to it.
func guestAtFile(t *testing.T) *guest {
	root := t.TempDir()
	os.WriteFile(filepath.Join(root, "f"), []byte("data"), 0o644)
	g := newGuest(t, root, false)
	g.attach()
	g.ok(twalk, 2, cat(u32b(1), u32b(2), u16b(1), str9("f")), 4096)
	return g
}

// TestXattrWalkKeepsTheFidUsable: the p9 server gives a Txattrwalk's new
// fid the original fid's File and closes it when the new fid is clunked;
// the original fid must still work afterwards (Linux walks from it, as
// after every getxattr on a share).
func TestXattrWalkKeepsTheFidUsable(t *testing.T) {
	g := guestAtFile(t)
	for _, name := range []string{"", "user.missing"} {
		g.call(txattrwalk, 3, cat(u32b(2), u32b(3), str9(name)), 4096)
		g.call(tclunk, 4, u32b(3), 64)
	}
	g.ok(txattrwalk, 3, cat(u32b(1), u32b(3), str9("")), 4096) // the root's too
	g.ok(tclunk, 4, u32b(3), 64)
	g.ok(24 /* Tgetattr */, 5, cat(u32b(2), u64b(0x7ff)), 4096)
	g.ok(12 /* Tlopen */, 6, cat(u32b(2), u32b(0)), 4096)
	r := g.ok(tread, 7, cat(u32b(2), u64b(0), u32b(100)), 4096)
	if got := string(r[rreadHdrLen:]); got != "data" {
		t.Errorf("read after the xattr walks = %q, want \"data\"", got)
	}
	g.ok(twalk, 8, cat(u32b(1), u32b(9), u16b(1), str9("f")), 4096)
}

// TestLaterVersionsAreAnsweredByTheDevice: only a session's first Tversion
// reaches the server (it swaps its buffers on every one, racing replies
// still being cleaned up); later ones are answered with at most the
// server's msize, and the device's limit follows.
func TestLaterVersionsAreAnsweredByTheDevice(t *testing.T) {
	g := newGuest(t, t.TempDir(), false)
	g.attach() // msize 8192
	msizeOf := func(r []byte) (uint32, string) {
		if len(r) < headerLen+6 || r[4] != rversion {
			t.Fatalf("Tversion reply % x", r)
		}
		n := int(binary.LittleEndian.Uint16(r[headerLen+4:]))
		return binary.LittleEndian.Uint32(r[headerLen:]), string(r[headerLen+6 : headerLen+6+n])
	}
	if m, v := msizeOf(g.version(1 << 20)); m != 8192 || v != "9P2000.L" {
		t.Errorf("Tversion 1 MiB after 8192 = %d %q, want 8192 \"9P2000.L\"", m, v)
	}
	if m, _ := msizeOf(g.version(4096)); m != 4096 {
		t.Errorf("Tversion 4096 = %d", m)
	}
	big := message(118 /* Twrite */, 2, cat(u32b(1), u64b(0), u32b(5000), make([]byte, 5000)))
	if r := g.roundTrip(big, 64); errnoOf(r) != errnoEINVAL {
		t.Errorf("a 5023-byte request after msize 4096: reply % x, want Rlerror EINVAL", r)
	}
	if m, v := msizeOf(g.call(tversion, 0xffff, cat(u32b(8192), str9("9P2000")), 64)); m != 0 || v != "unknown" {
		t.Errorf("Tversion 9P2000 = %d %q, want 0 \"unknown\"", m, v)
	}
	g.ok(twalk, 3, cat(u32b(1), u32b(2), u16b(0)), 4096)
}

// openFDs is how many descriptors this process holds.
func openFDs() int {
	e, _ := os.ReadDir("/proc/self/fd")
	return len(e)
}

// TestEmptyXattrListIsEmpty: a file without attributes lists none (size
// 0), where the p9 server alone answers one NUL byte, which the guest
// read as one empty name; a file with one lists exactly it.
func TestEmptyXattrListIsEmpty(t *testing.T) {
	root := t.TempDir()
	os.WriteFile(filepath.Join(root, "f"), []byte("data"), 0o644)
	os.WriteFile(filepath.Join(root, "g"), []byte("data"), 0o644)
	withAttr := unix.Setxattr(filepath.Join(root, "g"), "user.k", []byte("v"), 0) == nil
	g := newGuest(t, root, false)
	g.attach()
	size := func(name string, fid uint32) uint64 {
		g.ok(twalk, 2, cat(u32b(1), u32b(fid), u16b(1), str9(name)), 4096)
		r := g.ok(txattrwalk, 3, cat(u32b(fid), u32b(fid+1), str9("")), 4096)
		g.ok(tclunk, 4, u32b(fid+1), 64)
		return binary.LittleEndian.Uint64(r[headerLen:])
	}
	if n := size("f", 10); n != 0 {
		t.Errorf("attribute list of a file without attributes: %d bytes, want 0", n)
	}
	if !withAttr {
		t.Skip("the test directory's file system has no user attributes")
	}
	if n := size("g", 20); n != uint64(len("user.k\x00")) {
		t.Errorf("attribute list of a file with user.k: %d bytes, want %d", n, len("user.k\x00"))
	}
}

// The server's errnos these tests expect (the device gives neither).
const (
	errnoEBADF   = 9
	errnoENODATA = 61
)

// TestGetlock: fcntl(F_GETLK) reaches the device as Tgetlock only when
// the guest found no conflicting lock of its own; the server answers that
// there is none, with the range and owner asked, and refuses a fid the
// guest does not hold.
func TestGetlock(t *testing.T) {
	g := guestAtFile(t)
	req := cat(u32b(2), []byte{1}, u64b(100), u64b(50), u32b(77), str9("guest"))
	r := g.ok(tgetlock, 3, req, 4096)
	if want := cat([]byte{2}, u64b(100), u64b(50), u32b(77), str9("guest")); !bytes.Equal(r[headerLen:], want) {
		t.Errorf("Rgetlock body = % x, want % x (unlocked, the range and owner asked)", r[headerLen:], want)
	}
	if e := errnoOf(g.call(tgetlock, 4, cat(u32b(99), []byte{1}, u64b(0), u64b(0), u32b(1), str9("")), 4096)); e != errnoEBADF {
		t.Errorf("Tgetlock on a fid not held: errno %d, want EBADF", e)
	}
	if e := errnoOf(g.call(tgetlock, 5, u32b(2), 4096)); e != errnoEINVAL {
		t.Errorf("a truncated Tgetlock: errno %d, want EINVAL", e)
	}
}

// TestMissingAttrIsENODATA: a Txattrwalk of a missing attribute gets
// ENODATA, as getxattr(2) gives on a local disk (hugelgupf/p9's server,
// before capsa's own, answered EINVAL); a malformed name gets EINVAL.
func TestMissingAttrIsENODATA(t *testing.T) {
	g := guestAtFile(t)
	if e := errnoOf(g.call(txattrwalk, 3, cat(u32b(2), u32b(3), str9("user.missing")), 4096)); e != errnoENODATA {
		t.Errorf("Txattrwalk of a missing attribute: errno %d, want ENODATA (%d)", e, errnoENODATA)
	}
	if e := errnoOf(g.call(txattrwalk, 4, cat(u32b(2), u32b(4), str9("user.a\x00b")), 4096)); e != errnoEINVAL {
		t.Errorf("Txattrwalk of a name holding NUL: errno %d, want EINVAL", e)
	}
}
