package p9server

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/p9fs"
)

// share is a p9fs share of a new directory.
func share(t testing.TB) (string, p9.Attacher) {
	t.Helper()
	dir := t.TempDir()
	a, err := p9fs.New(dir, p9fs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if c, ok := a.(io.Closer); ok {
			c.Close()
		}
	})
	return dir, a
}

// client attaches github.com/hugelgupf/p9's client (a 9P2000.L client
// written elsewhere) to a session over a's files.
func client(t *testing.T, a p9.Attacher) p9.File {
	t.Helper()
	srv, cli := net.Pipe()
	go New(a, Options{}).ServeStream(srv)
	c, err := p9.NewClient(cli, p9.WithMessageSize(256<<10))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	root, err := c.Attach("")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func walk(t *testing.T, f p9.File, names ...string) p9.File {
	t.Helper()
	_, nf, err := f.Walk(names)
	if err != nil {
		t.Fatalf("walk %v: %v", names, err)
	}
	return nf
}

func create(t *testing.T, dir p9.File, name, content string) {
	t.Helper()
	d := walk(t, dir)
	f, _, _, err := d.Create(name, p9.ReadWrite, 0o644, p9.NoUID, p9.NoGID)
	if err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	if _, err := f.WriteAt([]byte(content), 0); err != nil {
		t.Fatalf("write %s: %v", name, err)
	}
	f.Close()
}

func readAll(t *testing.T, f p9.File) string {
	t.Helper()
	b := make([]byte, 4096)
	n, err := f.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		t.Fatalf("read: %v", err)
	}
	return string(b[:n])
}

// TestClientOperations: the everyday operations, through another
// project's client, reach the host directory.
func TestClientOperations(t *testing.T) {
	dir, a := share(t)
	root := client(t, a)
	create(t, root, "a", "hello")
	if b, err := os.ReadFile(filepath.Join(dir, "a")); err != nil || string(b) != "hello" {
		t.Fatalf("the host's a: %q, %v", b, err)
	}
	f := walk(t, root, "a")
	if _, _, err := f.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, f); got != "hello" {
		t.Errorf("read a: %q", got)
	}
	f.Close()

	if _, err := root.Mkdir("d", 0o755, p9.NoUID, p9.NoGID); err != nil {
		t.Fatal(err)
	}
	if _, err := root.Mkdir("d", 0o755, p9.NoUID, p9.NoGID); !errors.Is(err, linux.EEXIST) {
		t.Errorf("mkdir d again: %v; want EEXIST", err)
	}
	if err := root.RenameAt("a", walk(t, root, "d"), "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "d", "b")); err != nil {
		t.Errorf("after renameat: %v", err)
	}
	if _, err := root.Symlink("d/b", "l", p9.NoUID, p9.NoGID); err != nil {
		t.Fatal(err)
	}
	if target, err := walk(t, root, "l").Readlink(); err != nil || target != "d/b" {
		t.Errorf("readlink l: %q, %v", target, err)
	}
	if err := root.Link(walk(t, root, "d", "b"), "hard"); err != nil {
		t.Fatal(err)
	}
	if _, err := root.Mknod("fifo", p9.ModeNamedPipe|0o600, 0, 0, p9.NoUID, p9.NoGID); err != nil {
		t.Fatal(err)
	}
	_, _, attr, err := walk(t, root, "hard").GetAttr(p9.AttrMask{NLink: true, Size: true, Mode: true})
	if err != nil || attr.NLink != 2 || attr.Size != 5 || !attr.Mode.IsRegular() {
		t.Errorf("getattr hard: %+v, %v; want 2 links, 5 bytes, regular", attr, err)
	}
	if err := walk(t, root, "hard").SetAttr(p9.SetAttrMask{Size: true, Permissions: true}, p9.SetAttr{Size: 2, Permissions: 0o600}); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(filepath.Join(dir, "d", "b")); err != nil || st.Size() != 2 || st.Mode().Perm() != 0o600 {
		t.Errorf("after setattr: %v, %v", st, err)
	}
	if _, err := root.StatFS(); err != nil {
		t.Errorf("statfs: %v", err)
	}
	d := walk(t, root)
	if _, _, err := d.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	ents, err := d.Readdir(0, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name)
	}
	slices.Sort(names)
	if want := []string{".", "..", "d", "fifo", "hard", "l"}; !slices.Equal(names, want) {
		t.Errorf("readdir: %v; want %v", names, want)
	}
	if err := root.UnlinkAt("d", unix.AT_REMOVEDIR); !errors.Is(err, linux.ENOTEMPTY) {
		t.Errorf("rmdir d: %v; want ENOTEMPTY (the host's own errno)", err)
	}
	if _, _, err := root.Walk([]string{"nosuch"}); !errors.Is(err, linux.ENOENT) {
		t.Errorf("walk nosuch: %v; want ENOENT", err)
	}
	if _, _, err := root.Walk([]string{".."}); err == nil {
		t.Error("walk ..: succeeded")
	}
}

// TestRenamedOver: a fid whose name was renamed over opens, reads and is
// truncated as a local disk's open file would be: it is the old inode.
// (github.com/hugelgupf/p9's server refuses these with EINVAL.)
func TestRenamedOver(t *testing.T) {
	_, a := share(t)
	root := client(t, a)
	create(t, root, "a", "old")
	old := walk(t, root, "a")
	create(t, root, "tmp", "new")
	if err := root.RenameAt("tmp", root, "a"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := old.Open(p9.ReadWrite); err != nil {
		t.Fatalf("open a fid renamed over: %v", err)
	}
	if got := readAll(t, old); got != "old" {
		t.Errorf("it reads %q; want the old inode's", got)
	}
	if err := old.SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: 1}); err != nil {
		t.Errorf("truncate it: %v", err)
	}
	cur := walk(t, root, "a")
	if _, _, err := cur.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, cur); got != "new" {
		t.Errorf("the name reads %q; want the new file", got)
	}

	// An open file whose name was removed: its size and mode change.
	create(t, root, "x", "12345")
	x := walk(t, root, "x")
	if _, _, err := x.Open(p9.ReadWrite); err != nil {
		t.Fatal(err)
	}
	if err := root.UnlinkAt("x", 0); err != nil {
		t.Fatal(err)
	}
	if err := x.SetAttr(p9.SetAttrMask{Size: true, Permissions: true}, p9.SetAttr{Size: 2, Permissions: 0o600}); err != nil {
		t.Errorf("ftruncate and fchmod an unlinked open file: %v", err)
	}
	if _, _, attr, err := x.GetAttr(p9.AttrMask{Size: true, Mode: true}); err != nil || attr.Size != 2 || attr.Mode.Permissions() != 0o600 {
		t.Errorf("after: %+v, %v", attr, err)
	}

	// A symlink renamed over still reads its target.
	if _, err := root.Symlink("first", "s", p9.NoUID, p9.NoGID); err != nil {
		t.Fatal(err)
	}
	s := walk(t, root, "s")
	if _, err := root.Symlink("second", "s2", p9.NoUID, p9.NoGID); err != nil {
		t.Fatal(err)
	}
	if err := root.RenameAt("s2", root, "s"); err != nil {
		t.Fatal(err)
	}
	if target, err := s.Readlink(); err != nil || target != "first" {
		t.Errorf("readlink of a symlink renamed over: %q, %v; want first", target, err)
	}
}

// raw sends messages straight to a session and returns each reply.
type raw struct {
	t *testing.T
	s *Session
}

func newRaw(t *testing.T, a p9.Attacher) *raw {
	r := &raw{t: t, s: New(a, Options{})}
	t.Cleanup(func() { r.s.Close() })
	return r
}

// msg builds a request of typ and tag with body.
func msg(typ uint8, tag uint16, body func(e *encoder)) []byte {
	e := newReply(typ, tag, 64)
	if body != nil {
		body(e)
	}
	return e.done()
}

func (r *raw) call(m []byte) []byte {
	r.t.Helper()
	c := make(chan []byte, 1)
	r.s.Serve(m, func(b []byte) { c <- b })
	select {
	case b := <-c:
		return b
	case <-time.After(10 * time.Second):
		r.t.Fatal("no reply in 10 s")
		return nil
	}
}

// errno is a reply's Rlerror code, or 0.
func errno(b []byte) uint32 {
	if len(b) == headerLen+4 && b[4] == msgRlerror {
		return binary.LittleEndian.Uint32(b[headerLen:])
	}
	return 0
}

func (r *raw) start() {
	r.t.Helper()
	b := r.call(msg(msgTversion, NoTag, func(e *encoder) { e.u32(64 << 10); e.str("9P2000.L") }))
	if b[4] != msgTversion+1 {
		r.t.Fatalf("Tversion: %v", b)
	}
	b = r.call(msg(msgTattach, 1, func(e *encoder) { e.u32(0); e.u32(NoFid); e.str(""); e.str(""); e.u32(0) }))
	if b[4] != msgTattach+1 {
		r.t.Fatalf("Tattach: errno %d", errno(b))
	}
}

// TestXattrs: an attribute is written through a fid (Txattrcreate,
// Twrite, set at Tclunk), read back and listed through another
// (Txattrwalk, Tread), and a missing one is ENODATA, the host's answer.
func TestXattrs(t *testing.T) {
	dir, a := share(t)
	if err := os.WriteFile(filepath.Join(dir, "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(filepath.Join(dir, "f"), "user.probe", []byte("x"), 0); err != nil {
		t.Skipf("the host directory holds no user attributes: %v", err)
	}
	r := newRaw(t, a)
	r.start()
	walkTo := func(tag uint16, newfid uint32) {
		if b := r.call(msg(msgTwalk, tag, func(e *encoder) { e.u32(0); e.u32(newfid); e.u16(1); e.str("f") })); b[4] != msgTwalk+1 {
			t.Fatalf("walk: errno %d", errno(b))
		}
	}
	walkTo(2, 1)
	if b := r.call(msg(msgTxattrcreat, 3, func(e *encoder) { e.u32(1); e.str("user.k"); e.u64(3); e.u32(0) })); b[4] != msgTxattrcreat+1 {
		t.Fatalf("Txattrcreate: errno %d", errno(b))
	}
	if b := r.call(msg(msgTwrite, 4, func(e *encoder) { e.u32(1); e.u64(0); e.u32(3); e.b = append(e.b, "abc"...) })); b[4] != msgTwrite+1 {
		t.Fatalf("Twrite: errno %d", errno(b))
	}
	if b := r.call(msg(msgTclunk, 5, func(e *encoder) { e.u32(1) })); b[4] != msgTclunk+1 {
		t.Fatalf("Tclunk: errno %d", errno(b))
	}
	if v := make([]byte, 8); true {
		n, err := unix.Getxattr(filepath.Join(dir, "f"), "user.k", v)
		if err != nil || string(v[:n]) != "abc" {
			t.Errorf("the host's user.k: %q, %v", v[:n], err)
		}
	}
	read := func(name string) (uint64, string, uint32) {
		walkTo(7, 3)
		defer r.call(msg(msgTclunk, 11, func(e *encoder) { e.u32(3) }))
		b := r.call(msg(msgTxattrwalk, 8, func(e *encoder) { e.u32(3); e.u32(4); e.str(name) }))
		if b[4] != msgTxattrwalk+1 {
			return 0, "", errno(b)
		}
		size := binary.LittleEndian.Uint64(b[headerLen:])
		b = r.call(msg(msgTread, 9, func(e *encoder) { e.u32(4); e.u64(0); e.u32(4096) }))
		r.call(msg(msgTclunk, 10, func(e *encoder) { e.u32(4) }))
		return size, string(b[headerLen+4:]), 0
	}
	if size, v, e := read("user.k"); e != 0 || size != 3 || v != "abc" {
		t.Errorf("read user.k: %d %q errno %d", size, v, e)
	}
	if _, v, e := read(""); e != 0 || !slices.Contains(splitNUL(v), "user.k") {
		t.Errorf("the list: %q errno %d", v, e)
	}
	if _, _, e := read("user.nosuch"); e != uint32(linux.ENODATA) {
		t.Errorf("a missing attribute: errno %d; want ENODATA", e)
	}
	// removexattr(2), as Linux sends it: a value of no bytes, replacing.
	walkTo(16, 6)
	r.call(msg(msgTxattrcreat, 17, func(e *encoder) { e.u32(6); e.str("user.k"); e.u64(0); e.u32(unix.XATTR_REPLACE) }))
	if b := r.call(msg(msgTclunk, 18, func(e *encoder) { e.u32(6) })); b[4] != msgTclunk+1 {
		t.Errorf("removing user.k: errno %d", errno(b))
	}
	if _, v, e := read(""); e != 0 || slices.Contains(splitNUL(v), "user.k") {
		t.Errorf("the list after the removal: %q errno %d", v, e)
	}
	// More declared than given: the clunk fails, nothing is set.
	walkTo(12, 5)
	r.call(msg(msgTxattrcreat, 13, func(e *encoder) { e.u32(5); e.str("user.short"); e.u64(10); e.u32(0) }))
	if b := r.call(msg(msgTclunk, 14, func(e *encoder) { e.u32(5) })); errno(b) != uint32(linux.EINVAL) {
		t.Errorf("a clunk before the declared size was written: errno %d; want EINVAL", errno(b))
	}
	if b := r.call(msg(msgTxattrcreat, 15, func(e *encoder) { e.u32(0); e.str("user.big"); e.u64(MaxXattrSize + 1); e.u32(0) })); errno(b) != uint32(linux.E2BIG) {
		t.Errorf("an attribute over %d bytes: errno %d; want E2BIG", MaxXattrSize, errno(b))
	}
}

func splitNUL(s string) []string {
	var out []string
	for len(s) > 0 {
		i := 0
		for i < len(s) && s[i] != 0 {
			i++
		}
		out = append(out, s[:i])
		if i == len(s) {
			break
		}
		s = s[i+1:]
	}
	return out
}

// TestBadRequests: malformed and out-of-order requests get an error
// reply naming nothing the server did, and the session goes on.
func TestBadRequests(t *testing.T) {
	_, a := share(t)
	r := newRaw(t, a)
	if e := errno(r.call(msg(msgTgetattr, 1, func(e *encoder) { e.u32(0); e.u64(0) }))); e != uint32(linux.EINVAL) {
		t.Errorf("a request before Tversion: errno %d; want EINVAL", e)
	}
	if b := r.call(msg(msgTversion, NoTag, func(e *encoder) { e.u32(100); e.str("9P2000.L") })); string(b[headerLen+6:]) != "unknown" {
		t.Errorf("Tversion with msize 100: %q; want unknown", b[headerLen+6:])
	}
	if b := r.call(msg(msgTversion, NoTag, func(e *encoder) { e.u32(1 << 30); e.str("9P2000.L") })); binary.LittleEndian.Uint32(b[headerLen:]) != MaxMessage {
		t.Errorf("Tversion with msize 1 GiB: msize %d; want %d", binary.LittleEndian.Uint32(b[headerLen:]), MaxMessage)
	}
	r.start()
	for what, m := range map[string][]byte{
		"a short Tgetattr":           msg(msgTgetattr, 2, func(e *encoder) { e.u32(0) }),
		"a Tgetattr with extra":      msg(msgTgetattr, 2, func(e *encoder) { e.u32(0); e.u64(0); e.u8(1) }),
		"a Twalk of 17 names":        msg(msgTwalk, 2, func(e *encoder) { e.u32(0); e.u32(1); e.u16(17) }),
		"a string past the end":      msg(msgTwalk, 2, func(e *encoder) { e.u32(0); e.u32(1); e.u16(1); e.u16(100) }),
		"a Twrite shorter than said": msg(msgTwrite, 2, func(e *encoder) { e.u32(0); e.u64(0); e.u32(10) }),
		"a size that lies":           {0xff, 0, 0, 0, msgTclunk, 2, 0, 0, 0, 0, 0},
	} {
		if e := errno(r.call(m)); e != uint32(linux.EINVAL) {
			t.Errorf("%s: errno %d; want EINVAL", what, e)
		}
	}
	if e := errno(r.call(msg(200, 3, nil))); e != uint32(linux.EOPNOTSUPP) {
		t.Errorf("an unknown type: errno %d; want EOPNOTSUPP", e)
	}
	if e := errno(r.call(msg(msgTclunk, 4, func(e *encoder) { e.u32(99) }))); e != uint32(linux.EBADF) {
		t.Errorf("an unknown fid: errno %d; want EBADF", e)
	}
	if e := errno(r.call(msg(msgTread, 5, func(e *encoder) { e.u32(0); e.u64(0); e.u32(10) }))); e != uint32(linux.EBADF) {
		t.Errorf("a read of an unopened fid: errno %d; want EBADF", e)
	}
	if b := r.call(msg(msgTgetattr, 6, func(e *encoder) { e.u32(0); e.u64(getMode) })); b[4] != msgTgetattr+1 || len(b) != headerLen+153 {
		t.Errorf("the session after them: %v", b)
	}
}

// TestFlush: a Tflush's reply follows the reply of the request it
// flushes; one for a tag not in flight is answered at once.
func TestFlush(t *testing.T) {
	_, a := share(t)
	r := newRaw(t, a)
	r.start()
	var mu sync.Mutex
	var order []uint16
	done := make(chan struct{}, 2)
	got := func(b []byte) {
		mu.Lock()
		order = append(order, binary.LittleEndian.Uint16(b[5:]))
		mu.Unlock()
		done <- struct{}{}
	}
	r.s.Serve(msg(msgTgetattr, 7, func(e *encoder) { e.u32(0); e.u64(getMode) }), got)
	r.s.Serve(msg(msgTflush, 8, func(e *encoder) { e.u16(7) }), got)
	<-done
	<-done
	if !slices.Equal(order, []uint16{7, 8}) {
		t.Errorf("replies in order %v; want the flushed request's first", order)
	}
	if b := r.call(msg(msgTflush, 9, func(e *encoder) { e.u16(1234) })); b[4] != msgTflush+1 {
		t.Errorf("a flush of nothing: %v", b)
	}
}

// TestFidBound: past Options.MaxFids a walk gets ENFILE.
func TestFidBound(t *testing.T) {
	_, a := share(t)
	r := &raw{t: t, s: New(a, Options{MaxFids: 100})}
	t.Cleanup(func() { r.s.Close() })
	r.start()
	for i := uint32(1); i < 100; i++ {
		b := r.call(msg(msgTwalk, 2, func(e *encoder) { e.u32(0); e.u32(i); e.u16(0) }))
		if b[4] != msgTwalk+1 {
			t.Fatalf("walk to fid %d: errno %d", i, errno(b))
		}
	}
	if e := errno(r.call(msg(msgTwalk, 2, func(e *encoder) { e.u32(0); e.u32(100); e.u16(0) }))); e != uint32(linux.ENFILE) {
		t.Errorf("fid 101: errno %d; want ENFILE", e)
	}
	// Replacing a fid in use is not one more.
	if b := r.call(msg(msgTwalk, 2, func(e *encoder) { e.u32(0); e.u32(5); e.u16(0) })); b[4] != msgTwalk+1 {
		t.Errorf("a walk to fid 5, in use: errno %d", errno(b))
	}
}

// getattrIDs reads fid's mode, uid and gid with a raw Tgetattr.
func (r *raw) getattrIDs(fid uint32) (mode, uid, gid uint32) {
	r.t.Helper()
	b := r.call(msg(msgTgetattr, 20, func(e *encoder) { e.u32(fid); e.u64(getMode | getUID | getGID) }))
	if b[4] != msgTgetattr+1 {
		r.t.Fatalf("Tgetattr: errno %d", errno(b))
	}
	body := b[headerLen+8+qidLen:]
	return binary.LittleEndian.Uint32(body), binary.LittleEndian.Uint32(body[4:]), binary.LittleEndian.Uint32(body[8:])
}

// TestCreatorIsAttachUser: what a fid makes belongs to the user its
// attach named (9P2000.L's creates carry a gid alone; Linux attaches
// once per user).
func TestCreatorIsAttachUser(t *testing.T) {
	dir, a := share(t)
	if err := unix.Setxattr(dir, "user.probe", []byte("x"), 0); err != nil {
		t.Skipf("the host directory holds no user attributes, where owners are kept: %v", err)
	}
	r := newRaw(t, a)
	if b := r.call(msg(msgTversion, NoTag, func(e *encoder) { e.u32(64 << 10); e.str(Version) })); b[4] != msgTversion+1 {
		t.Fatal("Tversion")
	}
	if b := r.call(msg(msgTattach, 1, func(e *encoder) { e.u32(0); e.u32(NoFid); e.str(""); e.str(""); e.u32(1000) })); b[4] != msgTattach+1 {
		t.Fatalf("Tattach: errno %d", errno(b))
	}
	if b := r.call(msg(msgTmkdir, 2, func(e *encoder) { e.u32(0); e.str("d"); e.u32(0o755); e.u32(100) })); b[4] != msgTmkdir+1 {
		t.Fatalf("Tmkdir: errno %d", errno(b))
	}
	r.call(msg(msgTwalk, 3, func(e *encoder) { e.u32(0); e.u32(1); e.u16(1); e.str("d") }))
	if _, uid, gid := r.getattrIDs(1); uid != 1000 || gid != 100 {
		t.Errorf("d is shown as %d:%d; want 1000:100, the attach's user and the Tmkdir's group", uid, gid)
	}
	// Tlcreate: the fid becomes the new file, owned the same way.
	r.call(msg(msgTwalk, 4, func(e *encoder) { e.u32(0); e.u32(2); e.u16(0) }))
	if b := r.call(msg(msgTlcreate, 5, func(e *encoder) { e.u32(2); e.str("f"); e.u32(2); e.u32(0o644); e.u32(1000) })); b[4] != msgTlcreate+1 {
		t.Fatalf("Tlcreate: errno %d", errno(b))
	}
	if mode, uid, gid := r.getattrIDs(2); uid != 1000 || gid != 1000 || mode&unix.S_IFMT != unix.S_IFREG {
		t.Errorf("f: mode %o, %d:%d; want a regular file of 1000:1000", mode, uid, gid)
	}
}

// TestSetgidDirectory: a directory's set-group-ID bit reaches the host,
// made or set; a file's set-id bits never do.
func TestSetgidDirectory(t *testing.T) {
	dir, a := share(t)
	r := newRaw(t, a)
	r.start()
	if b := r.call(msg(msgTmkdir, 2, func(e *encoder) { e.u32(0); e.str("d"); e.u32(0o2775); e.u32(NoFid) })); b[4] != msgTmkdir+1 {
		t.Fatalf("Tmkdir: errno %d", errno(b))
	}
	if st, err := os.Stat(filepath.Join(dir, "d")); err != nil || st.Mode()&os.ModeSetgid == 0 || st.Mode().Perm() != 0o775 {
		t.Errorf("the host's d: %v, %v; want setgid and 0775", st.Mode(), err)
	}
	if err := os.WriteFile(filepath.Join(dir, "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	setMode := func(name string, mode uint32) {
		r.call(msg(msgTwalk, 3, func(e *encoder) { e.u32(0); e.u32(1); e.u16(1); e.str(name) }))
		b := r.call(msg(msgTsetattr, 4, func(e *encoder) {
			e.u32(1)
			e.u32(setMode)
			e.u32(mode)
			e.u32(0)
			e.u32(0)
			for range 5 {
				e.u64(0)
			}
		}))
		if b[4] != msgTsetattr+1 {
			t.Fatalf("Tsetattr %s: errno %d", name, errno(b))
		}
		r.call(msg(msgTclunk, 5, func(e *encoder) { e.u32(1) }))
	}
	setMode("d", 0o2750)
	setMode("f", 0o6755)
	if st, _ := os.Stat(filepath.Join(dir, "d")); st.Mode()&os.ModeSetgid == 0 || st.Mode().Perm() != 0o750 {
		t.Errorf("d after chmod 2750: %v", st.Mode())
	}
	if st, _ := os.Stat(filepath.Join(dir, "f")); st.Mode()&(os.ModeSetgid|os.ModeSetuid) != 0 || st.Mode().Perm() != 0o755 {
		t.Errorf("f after chmod 6755: %v; want 0755, no set-id bit", st.Mode())
	}
}

// TestCreateAndXattrOnOneFid: a hostile client's Tlcreate and
// Txattrcreate on one fid at once are both answered (the handlers take
// their locks in one order), and Tclunks racing them leave the session
// serving.
func TestCreateAndXattrOnOneFid(t *testing.T) {
	_, a := share(t)
	r := newRaw(t, a)
	r.start()
	for i := range 50 {
		fid := uint32(10 + i)
		r.call(msg(msgTwalk, 1, func(e *encoder) { e.u32(0); e.u32(fid); e.u16(0) }))
		done := make(chan []byte, 3)
		reply := func(b []byte) { done <- b }
		name := fmt.Sprintf("f%d", i)
		r.s.Serve(msg(msgTlcreate, 2, func(e *encoder) { e.u32(fid); e.str(name); e.u32(2); e.u32(0o644); e.u32(0) }), reply)
		r.s.Serve(msg(msgTxattrcreat, 3, func(e *encoder) { e.u32(fid); e.str("user.k"); e.u64(1); e.u32(0) }), reply)
		r.s.Serve(msg(msgTclunk, 4, func(e *encoder) { e.u32(fid) }), reply)
		for range 3 {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatalf("round %d: a request went unanswered (deadlock)", i)
			}
		}
	}
	if b := r.call(msg(msgTgetattr, 5, func(e *encoder) { e.u32(0); e.u64(getMode) })); b[4] != msgTgetattr+1 {
		t.Errorf("the session after: errno %d", errno(b))
	}
}
