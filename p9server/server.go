// Package p9server answers 9P2000.L requests, one message at a time, for
// a p9.Attacher's files (package p9fs's): the protocol as Linux's 9p
// client (net/9p, fs/9p) speaks it, its messages and fields written here
// from include/net/9p/9p.h and the 9P2000.L documentation, with
// github.com/hugelgupf/p9's File interface and types for the file server
// behind it.
//
// It stands in for hugelgupf/p9's server, whose rules suit a file server
// that keeps paths but are wrong for one that keeps descriptors:
//
//   - That server marks a fid "deleted" once its name is renamed over or
//     removed, and then refuses Tlopen, Treadlink, Tsetattr and more on
//     it (EINVAL), where a local disk goes on serving the inode: an open
//     racing a rename over the name fails, and so do ftruncate and fchmod
//     of an open file whose name was removed. p9fs's files are O_PATH
//     descriptors, which a rename cannot redirect, so this server asks
//     the file itself.
//   - It keeps only the permission and sticky bits of modes it decodes, so
//     a directory's set-group-ID bit never reaches the file server.
//   - It answers every failed Txattrwalk with EINVAL and an empty
//     attribute list with one NUL byte, and has no Tgetlock.
//
// A Session is one connection: Serve takes each request in the order the
// client sent them and answers each, from its own goroutine, through the
// reply function, so a slow request does not hold up others. Every field
// is checked against the message's size before use; a malformed request
// gets Rlerror(EINVAL) and never reaches the file server. The session
// bounds its fids, its requests in flight, and the extended attribute
// values it holds.
package p9server

import (
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"syscall"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
)

// Limits.
const (
	// MaxMessage is the largest msize a session agrees to.
	MaxMessage = 4 << 20
	// MinMessage is the smallest msize a Tversion may ask for.
	MinMessage = 4096
	// MaxFids bounds the fids one session holds (ENFILE past it).
	MaxFids = 32768
	// MaxXattrFids bounds the fids holding an extended attribute's value
	// or list (ENFILE past it), each of at most MaxXattrSize bytes (E2BIG
	// past it): Linux's XATTR_SIZE_MAX.
	MaxXattrFids = 64
	MaxXattrSize = 64 << 10
	// MaxInFlight bounds the requests being served at once: Serve waits
	// for one to finish past it.
	MaxInFlight = 256
)

// Version is the protocol this server speaks.
const Version = "9P2000.L"

// Options configure a session.
type Options struct {
	// MaxMessage bounds msize (0: MaxMessage).
	MaxMessage uint32
	// MaxFids bounds the fids held (0: MaxFids).
	MaxFids int
	// Logger receives diagnostics (nil: none).
	Logger *slog.Logger
}

// Session is one 9P2000.L connection over a p9.Attacher's files.
type Session struct {
	attacher p9.Attacher
	maxMsg   uint32
	maxFids  int
	log      *slog.Logger
	slots    chan struct{} // MaxInFlight tokens

	mu     sync.Mutex
	msize  uint32 // 0 until a Tversion
	fids   map[uint32]*fid
	xattrs int                      // fids holding an attribute's value
	calls  map[uint16]chan struct{} // requests in flight, closed when answered
	// replying are requests whose reply is being sent (their tags free).
	replying map[uint16]chan struct{}
	closed   bool
	wg       sync.WaitGroup
}

// fid is what a fid stands for: a file of the file server, or an
// extended attribute being read or written.
type fid struct {
	refs int // the table's, and each request's using it; s.mu guards

	// Set when the fid is made, never changed (a Tlcreate puts a new
	// fid in the table).
	file p9.File
	typ  p9.QIDType // the file's type, from its QID
	uid  p9.UID     // the attach's user, the owner of what it creates

	mu       sync.Mutex
	opened   bool
	readable bool // opened for reading (or a directory)
	writable bool
	xread    []byte      // a Txattrwalk's value, read with Tread
	xwrite   *xattrWrite // a Txattrcreate's, written with Twrite
	isXattr  bool        // xread or xwrite: not a file any more
}

// xattrWrite is an attribute being written: it is set when the fid is
// clunked.
type xattrWrite struct {
	name  string
	size  uint64
	flags p9.XattrFlags
	buf   []byte
}

// New returns a session serving a's files.
func New(a p9.Attacher, o Options) *Session {
	maxMsg := o.MaxMessage
	if maxMsg == 0 || maxMsg > MaxMessage {
		maxMsg = MaxMessage
	}
	maxFids := o.MaxFids
	if maxFids <= 0 || maxFids > MaxFids {
		maxFids = MaxFids
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Session{attacher: a, maxMsg: maxMsg, maxFids: maxFids, log: log, slots: make(chan struct{}, MaxInFlight),
		fids: map[uint32]*fid{}, calls: map[uint16]chan struct{}{}, replying: map[uint16]chan struct{}{}}
}

// Serve answers the request msg through reply, which is called once,
// from any goroutine (a Tflush's reply after the reply to the request it
// flushes). Call Serve with the requests in the order they came; it
// returns once msg is taken, at once unless MaxInFlight requests are
// being served. A message too short for its header is dropped.
func (s *Session) Serve(msg []byte, reply func([]byte)) {
	typ, tag, body, err := header(msg)
	if err != nil {
		if len(msg) >= headerLen {
			reply(errorReply(tag, uint32(linux.EINVAL)))
		}
		return
	}
	switch typ {
	case msgTversion:
		reply(s.version(tag, body))
		return
	case msgTflush:
		s.flush(tag, body, reply)
		return
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		reply(errorReply(tag, uint32(linux.EBADF)))
		return
	}
	if _, busy := s.calls[tag]; busy || tag == NoTag {
		s.mu.Unlock()
		reply(errorReply(tag, uint32(linux.EBUSY)))
		return
	}
	done := make(chan struct{})
	s.calls[tag] = done
	s.wg.Add(1)
	s.mu.Unlock()
	s.slots <- struct{}{}
	go func() {
		defer s.wg.Done()
		out := s.handle(typ, tag, body)
		<-s.slots
		// The tag is free before the reply goes: the client may use it
		// again as soon as it has the reply. A Tflush of it meanwhile
		// waits for the reply in replying.
		s.mu.Lock()
		delete(s.calls, tag)
		s.replying[tag] = done
		s.mu.Unlock()
		reply(out)
		close(done)
		s.mu.Lock()
		if s.replying[tag] == done {
			delete(s.replying, tag)
		}
		s.mu.Unlock()
	}()
}

// Close waits for the requests in flight and releases every fid.
func (s *Session) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.wg.Wait()
	s.releaseAll()
	return nil
}

// releaseAll clunks every fid, as a Tversion or Close does.
func (s *Session) releaseAll() {
	s.mu.Lock()
	fids := s.fids
	s.fids, s.xattrs = map[uint32]*fid{}, 0
	s.mu.Unlock()
	for _, f := range fids {
		s.put(f)
	}
}

// version answers a Tversion: msize[4] version[s]. Requests in flight are
// waited for and every fid is released, as the protocol says.
func (s *Session) version(tag uint16, body []byte) []byte {
	d := decoder{b: body}
	msize, v := d.u32(), d.str()
	if d.end() != nil {
		return errorReply(tag, uint32(linux.EINVAL))
	}
	s.wg.Wait()
	s.releaseAll()
	e := newReply(msgTversion+1, tag, 4+2+len(Version))
	if !strings.HasPrefix(v, Version) || msize < MinMessage {
		s.mu.Lock()
		s.msize = 0
		s.mu.Unlock()
		e.u32(0)
		e.str("unknown")
		return e.done()
	}
	msize = min(msize, s.maxMsg)
	s.mu.Lock()
	s.msize = msize
	s.mu.Unlock()
	e.u32(msize)
	e.str(Version)
	return e.done()
}

// flush answers a Tflush: oldtag[2]. Requests are not cancelled: the
// Rflush follows the flushed request's reply.
func (s *Session) flush(tag uint16, body []byte, reply func([]byte)) {
	d := decoder{b: body}
	old := d.u16()
	if d.end() != nil {
		reply(errorReply(tag, uint32(linux.EINVAL)))
		return
	}
	s.mu.Lock()
	done, ok := s.calls[old]
	if !ok {
		done, ok = s.replying[old]
	}
	s.mu.Unlock()
	rflush := newReply(msgTflush+1, tag, 0).done()
	if !ok {
		reply(rflush)
		return
	}
	go func() {
		<-done
		reply(rflush)
	}()
}

// get takes a reference to fid n; put gives it back.
func (s *Session) get(n uint32) (*fid, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f, ok := s.fids[n]
	if !ok {
		return nil, linux.EBADF
	}
	f.refs++
	return f, nil
}

// put drops a reference, closing the file with the last.
func (s *Session) put(f *fid) {
	s.mu.Lock()
	f.refs--
	last := f.refs == 0
	s.mu.Unlock()
	if last && f.file != nil {
		if err := f.file.Close(); err != nil {
			s.log.Debug("9P: close", "err", err)
		}
	}
}

// insert puts f in the table as fid n, replacing one there (clunked).
func (s *Session) insert(n uint32, f *fid) error {
	s.mu.Lock()
	old, had := s.fids[n]
	if !had && len(s.fids) >= s.maxFids {
		s.mu.Unlock()
		return linux.ENFILE
	}
	f.refs = 1
	s.fids[n] = f
	if had && old.isXattr {
		s.xattrs--
	}
	s.mu.Unlock()
	if had {
		s.put(old)
	}
	return nil
}

// replace puts f in the table as fid n in place of old, which must still
// be there (EBADF if it was clunked or replaced meanwhile).
func (s *Session) replace(n uint32, old, f *fid) error {
	s.mu.Lock()
	if s.fids[n] != old {
		s.mu.Unlock()
		return linux.EBADF
	}
	f.refs = 1
	s.fids[n] = f
	s.mu.Unlock()
	s.put(old)
	return nil
}

// remove takes fid n out of the table and returns it, still referenced
// for the caller.
func (s *Session) remove(n uint32) (*fid, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f, ok := s.fids[n]
	if !ok {
		return nil, linux.EBADF
	}
	delete(s.fids, n)
	if f.isXattr {
		s.xattrs--
	}
	return f, nil
}

// errnoOf is the errno a reply gives for err: the file server's own
// (linux.Errno or a syscall.Errno, never rewritten), else EIO.
func errnoOf(err error) uint32 {
	var le linux.Errno
	if errors.As(err, &le) {
		return uint32(le)
	}
	var se syscall.Errno
	if errors.As(err, &se) {
		return uint32(se)
	}
	return uint32(linux.EIO)
}

// handle answers one request other than Tversion and Tflush.
func (s *Session) handle(typ uint8, tag uint16, body []byte) []byte {
	s.mu.Lock()
	msize := s.msize
	s.mu.Unlock()
	if msize == 0 {
		return errorReply(tag, uint32(linux.EINVAL)) // no Tversion yet
	}
	h, ok := handlers[typ]
	if !ok {
		return errorReply(tag, uint32(linux.EOPNOTSUPP))
	}
	out, err := h(s, &request{tag: tag, d: decoder{b: body}, msize: msize})
	if err != nil {
		if errors.Is(err, errShort) {
			s.log.Debug("9P: malformed request", "type", typ, "tag", tag)
			return errorReply(tag, uint32(linux.EINVAL))
		}
		return errorReply(tag, errnoOf(err))
	}
	return out
}

// request is a request being answered.
type request struct {
	tag   uint16
	d     decoder
	msize uint32
}

// reply starts the reply of type typ (the request's plus one).
func (r *request) reply(typ uint8, room int) *encoder { return newReply(typ, r.tag, room) }

type handler func(*Session, *request) ([]byte, error)

var handlers map[uint8]handler

func init() {
	handlers = map[uint8]handler{
		msgTattach: (*Session).attach, msgTauth: (*Session).auth, msgTwalk: (*Session).walk,
		msgTgetattr: (*Session).getattr, msgTsetattr: (*Session).setattr, msgTstatfs: (*Session).statfs,
		msgTlopen: (*Session).lopen, msgTlcreate: (*Session).lcreate, msgTread: (*Session).read,
		msgTwrite: (*Session).write, msgTclunk: (*Session).clunk, msgTremove: (*Session).removeFid,
		msgTreaddir: (*Session).readdir, msgTreadlink: (*Session).readlink, msgTfsync: (*Session).fsync,
		msgTmkdir: (*Session).mkdir, msgTsymlink: (*Session).symlink, msgTmknod: (*Session).mknod,
		msgTlink: (*Session).link, msgTrename: (*Session).rename, msgTrenameat: (*Session).renameat,
		msgTunlinkat: (*Session).unlinkat, msgTxattrwalk: (*Session).xattrwalk,
		msgTxattrcreat: (*Session).xattrcreate, msgTlock: (*Session).lock, msgTgetlock: (*Session).getlock,
	}
}

// fileFid takes a reference to fid n, which must stand for a file (not
// an extended attribute); release with put.
func (s *Session) fileFid(n uint32) (*fid, error) {
	f, err := s.get(n)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	x := f.isXattr
	f.mu.Unlock()
	if x || f.file == nil {
		s.put(f)
		return nil, linux.EINVAL
	}
	return f, nil
}

// attach: fid[4] afid[4] uname[s] aname[s] n_uname[4] -> qid[13]. There
// is no authentication (afid must be NOFID); the attach's user owns what
// its fids create.
func (s *Session) attach(r *request) ([]byte, error) {
	n, afid := r.d.u32(), r.d.u32()
	r.d.str()
	r.d.str()
	uid := r.d.u32()
	if err := r.d.end(); err != nil {
		return nil, err
	}
	if afid != NoFid {
		return nil, linux.EINVAL
	}
	file, err := s.attacher.Attach()
	if err != nil {
		return nil, err
	}
	qid, _, _, err := file.GetAttr(p9.AttrMask{Mode: true})
	if err != nil {
		file.Close()
		return nil, err
	}
	if err := s.insert(n, &fid{file: file, typ: qid.Type, uid: p9.UID(uid)}); err != nil {
		file.Close()
		return nil, err
	}
	e := r.reply(msgTattach+1, qidLen)
	e.qid(qid)
	return e.done(), nil
}

func (s *Session) auth(r *request) ([]byte, error) { return nil, linux.EOPNOTSUPP }

// walk: fid[4] newfid[4] nwname[2] nwname*(wname[s]) -> nwqid[2]
// nwqid*(qid[13]). No names clones fid. A walk that fails fails whole
// (newfid is not made), as Linux's client expects of 9P2000.L.
func (s *Session) walk(r *request) ([]byte, error) {
	n, newN, count := r.d.u32(), r.d.u32(), r.d.u16()
	if count > maxWalk {
		return nil, linux.EINVAL
	}
	names := make([]string, count)
	for i := range names {
		names[i] = r.d.str()
	}
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	if len(names) > 0 && f.typ&p9.TypeDir == 0 {
		return nil, linux.ENOTDIR
	}
	qids, nf, err := f.file.Walk(names)
	if err != nil {
		return nil, err
	}
	typ := f.typ
	if len(qids) > 0 {
		typ = qids[len(qids)-1].Type
	}
	if err := s.insert(newN, &fid{file: nf, typ: typ, uid: f.uid}); err != nil {
		nf.Close()
		return nil, err
	}
	e := r.reply(msgTwalk+1, 2+qidLen*len(qids))
	e.u16(uint16(len(qids)))
	for _, q := range qids {
		e.qid(q)
	}
	return e.done(), nil
}

// getattr: fid[4] request_mask[8] -> valid[8] qid[13] mode[4] uid[4]
// gid[4] nlink[8] rdev[8] size[8] blksize[8] blocks[8] then atime,
// mtime, ctime and btime (sec[8] nsec[8] each), gen[8] data_version[8].
func (s *Session) getattr(r *request) ([]byte, error) {
	n, mask := r.d.u32(), r.d.u64()
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	qid, valid, a, err := f.file.GetAttr(attrMask(mask))
	if err != nil {
		return nil, err
	}
	e := r.reply(msgTgetattr+1, 153)
	e.u64(attrBits(valid))
	e.qid(qid)
	e.u32(uint32(a.Mode))
	e.u32(uint32(a.UID))
	e.u32(uint32(a.GID))
	for _, v := range []uint64{uint64(a.NLink), uint64(a.RDev), a.Size, a.BlockSize, a.Blocks,
		a.ATimeSeconds, a.ATimeNanoSeconds, a.MTimeSeconds, a.MTimeNanoSeconds,
		a.CTimeSeconds, a.CTimeNanoSeconds, a.BTimeSeconds, a.BTimeNanoSeconds, a.Gen, a.DataVersion} {
		e.u64(v)
	}
	return e.done(), nil
}

// setattr: fid[4] valid[4] mode[4] uid[4] gid[4] size[8] atime_sec[8]
// atime_nsec[8] mtime_sec[8] mtime_nsec[8]. The mode goes to the file
// server whole (it decides which bits a guest may set).
func (s *Session) setattr(r *request) ([]byte, error) {
	n, valid := r.d.u32(), r.d.u32()
	a := p9.SetAttr{Permissions: p9.FileMode(r.d.u32()), UID: p9.UID(r.d.u32()), GID: p9.GID(r.d.u32()), Size: r.d.u64(),
		ATimeSeconds: r.d.u64(), ATimeNanoSeconds: r.d.u64(), MTimeSeconds: r.d.u64(), MTimeNanoSeconds: r.d.u64()}
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	if err := f.file.SetAttr(setAttrMask(valid), a); err != nil {
		return nil, err
	}
	return r.reply(msgTsetattr+1, 0).done(), nil
}

// statfs: fid[4] -> type[4] bsize[4] blocks[8] bfree[8] bavail[8]
// files[8] ffree[8] fsid[8] namelen[4].
func (s *Session) statfs(r *request) ([]byte, error) {
	n := r.d.u32()
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	st, err := f.file.StatFS()
	if err != nil {
		return nil, err
	}
	e := r.reply(msgTstatfs+1, 60)
	e.u32(st.Type)
	e.u32(st.BlockSize)
	for _, v := range []uint64{st.Blocks, st.BlocksFree, st.BlocksAvailable, st.Files, st.FilesFree, st.FSID} {
		e.u64(v)
	}
	e.u32(st.NameLength)
	return e.done(), nil
}

// openMode records how a fid was opened.
func (f *fid) openMode(flags p9.OpenFlags) {
	f.opened = true
	mode := flags & p9.OpenFlagsModeMask
	f.readable = mode == p9.ReadOnly || mode == p9.ReadWrite || f.typ&p9.TypeDir != 0
	f.writable = mode == p9.WriteOnly || mode == p9.ReadWrite
}

// lopen: fid[4] flags[4] -> qid[13] iounit[4]. A fid opens once. The file
// is opened whatever became of its name meanwhile, as on a local disk.
func (s *Session) lopen(r *request) ([]byte, error) {
	n, flags := r.d.u32(), p9.OpenFlags(r.d.u32())
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.opened {
		return nil, linux.EINVAL
	}
	if f.typ&p9.TypeDir != 0 && flags&p9.OpenFlagsModeMask != p9.ReadOnly {
		return nil, linux.EISDIR
	}
	qid, iounit, err := f.file.Open(flags)
	if err != nil {
		return nil, err
	}
	f.openMode(flags)
	e := r.reply(msgTlopen+1, qidLen+4)
	e.qid(qid)
	e.u32(iounit)
	return e.done(), nil
}

// lcreate: fid[4] name[s] flags[4] mode[4] gid[4] -> qid[13] iounit[4].
// The fid, a directory, becomes the new file, open.
func (s *Session) lcreate(r *request) ([]byte, error) {
	n, name, flags, mode, gid := r.d.u32(), r.d.str(), p9.OpenFlags(r.d.u32()), p9.FileMode(r.d.u32()), p9.GID(r.d.u32())
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.typ&p9.TypeDir == 0:
		return nil, linux.ENOTDIR
	case f.opened:
		return nil, linux.EINVAL
	}
	nf, qid, iounit, err := f.file.Create(name, flags, mode, f.uid, gid)
	if err != nil {
		return nil, err
	}
	// The fid stands for the new file, open, from now on: a fid of its
	// own in the table, the directory's released with its references.
	created := &fid{file: nf, typ: qid.Type, uid: f.uid}
	created.openMode(flags)
	f.opened = true // a request still holding the old one cannot open it
	if err := s.replace(n, f, created); err != nil {
		nf.Close() // the file is made; the fid went meanwhile
		return nil, err
	}
	e := r.reply(msgTlcreate+1, qidLen+4)
	e.qid(qid)
	e.u32(iounit)
	return e.done(), nil
}

// read: fid[4] offset[8] count[4] -> count[4] data[count], count at most
// msize less the reply's header. An extended attribute's fid reads its
// value.
func (s *Session) read(r *request) ([]byte, error) {
	n, off, count := r.d.u32(), r.d.u64(), r.d.u32()
	if err := r.d.end(); err != nil {
		return nil, err
	}
	f, err := s.get(n)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	count = min(count, r.msize-headerLen-4)
	f.mu.Lock()
	if f.isXattr {
		data, writing := f.xread, f.xwrite != nil
		f.mu.Unlock()
		if writing {
			return nil, linux.EINVAL
		}
		var chunk []byte
		if off < uint64(len(data)) {
			chunk = data[off:min(uint64(len(data)), off+uint64(count))]
		}
		e := r.reply(msgTread+1, 4+len(chunk))
		e.u32(uint32(len(chunk)))
		e.b = append(e.b, chunk...)
		return e.done(), nil
	}
	ok := f.opened && f.readable && f.typ&p9.TypeDir == 0
	f.mu.Unlock()
	if !ok {
		return nil, linux.EBADF
	}
	if off > 1<<63-1 {
		return nil, linux.EINVAL
	}
	e := r.reply(msgTread+1, 4+int(count))
	e.u32(0)
	e.b = e.b[:headerLen+4+int(count)]
	got, err := f.file.ReadAt(e.b[headerLen+4:], int64(off))
	if err != nil && !errors.Is(err, io.EOF) {
		if got == 0 {
			return nil, err
		}
	}
	e.b = e.b[:headerLen+4+got]
	binary.LittleEndian.PutUint32(e.b[headerLen:], uint32(got))
	return e.done(), nil
}

// write: fid[4] offset[8] count[4] data[count] -> count[4]. An extended
// attribute's fid (Txattrcreate) takes its value, in order.
func (s *Session) write(r *request) ([]byte, error) {
	n, off, count := r.d.u32(), r.d.u64(), r.d.u32()
	data := r.d.take(int(count))
	if err := r.d.end(); err != nil {
		return nil, err
	}
	f, err := s.get(n)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	f.mu.Lock()
	if w := f.xwrite; w != nil {
		defer f.mu.Unlock()
		if off != uint64(len(w.buf)) || uint64(len(w.buf))+uint64(len(data)) > w.size {
			return nil, linux.EINVAL
		}
		w.buf = append(w.buf, data...)
	} else {
		ok := f.opened && f.writable && !f.isXattr
		f.mu.Unlock()
		if !ok {
			return nil, linux.EBADF
		}
		if off > 1<<63-1 {
			return nil, linux.EINVAL
		}
		got, err := f.file.WriteAt(data, int64(off))
		if err != nil && got == 0 {
			return nil, err
		}
		count = uint32(got)
	}
	e := r.reply(msgTwrite+1, 4)
	e.u32(count)
	return e.done(), nil
}

// clunk: fid[4]. The fid goes whatever the reply; an extended attribute
// written through it is set now, and its failure is the reply's.
func (s *Session) clunk(r *request) ([]byte, error) {
	n := r.d.u32()
	if err := r.d.end(); err != nil {
		return nil, err
	}
	f, err := s.remove(n)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	f.mu.Lock()
	w := f.xwrite
	f.xwrite = nil
	f.mu.Unlock()
	if w != nil {
		if err := commitXattr(f.file, w); err != nil {
			return nil, err
		}
	}
	return r.reply(msgTclunk+1, 0).done(), nil
}

// commitXattr sets w's attribute, or, with no value declared, removes it:
// Linux's client sends removexattr(2) as a Txattrcreate of size 0 (with
// XATTR_REPLACE), and so, indistinguishably, a setxattr of an empty
// value, which QEMU's server also takes for a removal.
func commitXattr(file p9.File, w *xattrWrite) error {
	if uint64(len(w.buf)) != w.size {
		return linux.EINVAL // fewer bytes written than declared
	}
	if w.size == 0 {
		return file.RemoveXattr(w.name)
	}
	return file.SetXattr(w.name, w.buf, w.flags)
}

// removeFid: fid[4]. 9P2000.L's clients remove with Tunlinkat; a fid
// does not know its name here, so Tremove only clunks (EOPNOTSUPP, and
// Linux's client then unlinks by name).
func (s *Session) removeFid(r *request) ([]byte, error) {
	n := r.d.u32()
	if err := r.d.end(); err != nil {
		return nil, err
	}
	f, err := s.remove(n)
	if err != nil {
		return nil, err
	}
	s.put(f)
	return nil, linux.EOPNOTSUPP
}

// readdir: fid[4] offset[8] count[4] -> count[4] data[count], entries of
// qid[13] offset[8] type[1] name[s], as many whole ones as count holds.
func (s *Session) readdir(r *request) ([]byte, error) {
	n, off, count := r.d.u32(), r.d.u64(), r.d.u32()
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	if f.typ&p9.TypeDir == 0 {
		return nil, linux.ENOTDIR
	}
	f.mu.Lock()
	ok := f.opened
	f.mu.Unlock()
	if !ok {
		return nil, linux.EBADF
	}
	count = min(count, r.msize-headerLen-4)
	ents, err := f.file.Readdir(off, count)
	if err != nil {
		return nil, err
	}
	e := r.reply(msgTreaddir+1, 4+int(count))
	e.u32(0)
	used := 0
	for _, d := range ents {
		l := direntLen(d.Name)
		if !fitsString(d.Name) || used+l > int(count) {
			break
		}
		e.qid(d.QID)
		e.u64(d.Offset)
		e.u8(uint8(d.Type))
		e.str(d.Name)
		used += l
	}
	binary.LittleEndian.PutUint32(e.b[headerLen:], uint32(used))
	return e.done(), nil
}

// readlink: fid[4] -> target[s].
func (s *Session) readlink(r *request) ([]byte, error) {
	n := r.d.u32()
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	target, err := f.file.Readlink()
	if err != nil {
		return nil, err
	}
	if !fitsString(target) || len(target)+headerLen+2 > int(r.msize) {
		return nil, linux.ENAMETOOLONG
	}
	e := r.reply(msgTreadlink+1, 2+len(target))
	e.str(target)
	return e.done(), nil
}

// fsync: fid[4] datasync[4] (older clients send the fid alone).
func (s *Session) fsync(r *request) ([]byte, error) {
	n := r.d.u32()
	if len(r.d.b) == 4 {
		r.d.u32()
	}
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	if err := f.file.FSync(); err != nil {
		return nil, err
	}
	return r.reply(msgTfsync+1, 0).done(), nil
}

// fidOf finishes decoding r, then takes a reference to fid n: a file's,
// or with dir a directory's. Release it with put.
func (s *Session) fidOf(r *request, n uint32, dir bool) (*fid, error) {
	if err := r.d.end(); err != nil {
		return nil, err
	}
	if dir {
		return s.dirFid(n)
	}
	return s.fileFid(n)
}

// dirFid takes a reference to fid n, a directory's.
func (s *Session) dirFid(n uint32) (*fid, error) {
	f, err := s.fileFid(n)
	if err != nil {
		return nil, err
	}
	if f.typ&p9.TypeDir == 0 {
		s.put(f)
		return nil, linux.ENOTDIR
	}
	return f, nil
}

// qidReply is a reply of one qid[13].
func qidReply(r *request, typ uint8, q p9.QID) []byte {
	e := r.reply(typ, qidLen)
	e.qid(q)
	return e.done()
}

// mkdir: dfid[4] name[s] mode[4] gid[4] -> qid[13].
func (s *Session) mkdir(r *request) ([]byte, error) {
	n, name, mode, gid := r.d.u32(), r.d.str(), p9.FileMode(r.d.u32()), p9.GID(r.d.u32())
	f, err := s.fidOf(r, n, true)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	q, err := f.file.Mkdir(name, mode, f.uid, gid)
	if err != nil {
		return nil, err
	}
	return qidReply(r, msgTmkdir+1, q), nil
}

// symlink: fid[4] name[s] symtgt[s] gid[4] -> qid[13].
func (s *Session) symlink(r *request) ([]byte, error) {
	n, name, target, gid := r.d.u32(), r.d.str(), r.d.str(), p9.GID(r.d.u32())
	f, err := s.fidOf(r, n, true)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	q, err := f.file.Symlink(target, name, f.uid, gid)
	if err != nil {
		return nil, err
	}
	return qidReply(r, msgTsymlink+1, q), nil
}

// mknod: dfid[4] name[s] mode[4] major[4] minor[4] gid[4] -> qid[13].
func (s *Session) mknod(r *request) ([]byte, error) {
	n, name, mode, major, minor, gid := r.d.u32(), r.d.str(), p9.FileMode(r.d.u32()), r.d.u32(), r.d.u32(), p9.GID(r.d.u32())
	f, err := s.fidOf(r, n, true)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	q, err := f.file.Mknod(name, mode, major, minor, f.uid, gid)
	if err != nil {
		return nil, err
	}
	return qidReply(r, msgTmknod+1, q), nil
}

// two takes references to two fids, the second a directory's.
func (s *Session) two(a, dir uint32) (*fid, *fid, error) {
	f, err := s.fileFid(a)
	if err != nil {
		return nil, nil, err
	}
	d, err := s.dirFid(dir)
	if err != nil {
		s.put(f)
		return nil, nil, err
	}
	return f, d, nil
}

// link: dfid[4] fid[4] name[s].
func (s *Session) link(r *request) ([]byte, error) {
	dir, n, name := r.d.u32(), r.d.u32(), r.d.str()
	if err := r.d.end(); err != nil {
		return nil, err
	}
	f, d, err := s.two(n, dir)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	defer s.put(d)
	if err := d.file.Link(f.file, name); err != nil {
		return nil, err
	}
	return r.reply(msgTlink+1, 0).done(), nil
}

// rename: fid[4] dfid[4] name[s].
func (s *Session) rename(r *request) ([]byte, error) {
	n, dir, name := r.d.u32(), r.d.u32(), r.d.str()
	if err := r.d.end(); err != nil {
		return nil, err
	}
	f, d, err := s.two(n, dir)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	defer s.put(d)
	if err := f.file.Rename(d.file, name); err != nil {
		return nil, err
	}
	return r.reply(msgTrename+1, 0).done(), nil
}

// renameat: olddirfid[4] oldname[s] newdirfid[4] newname[s].
func (s *Session) renameat(r *request) ([]byte, error) {
	from, oldName, to, newName := r.d.u32(), r.d.str(), r.d.u32(), r.d.str()
	if err := r.d.end(); err != nil {
		return nil, err
	}
	f, err := s.dirFid(from)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	d, err := s.dirFid(to)
	if err != nil {
		return nil, err
	}
	defer s.put(d)
	if err := f.file.RenameAt(oldName, d.file, newName); err != nil {
		return nil, err
	}
	return r.reply(msgTrenameat+1, 0).done(), nil
}

// unlinkat: dirfid[4] name[s] flags[4].
func (s *Session) unlinkat(r *request) ([]byte, error) {
	n, name, flags := r.d.u32(), r.d.str(), r.d.u32()
	f, err := s.fidOf(r, n, true)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	if err := f.file.UnlinkAt(name, flags); err != nil {
		return nil, err
	}
	return r.reply(msgTunlinkat+1, 0).done(), nil
}

// xattrwalk: fid[4] newfid[4] name[s] -> size[8]. newfid holds the
// attribute's value (or, for an empty name, the list of names, each
// ending in NUL), read with Tread.
func (s *Session) xattrwalk(r *request) ([]byte, error) {
	n, newN, name := r.d.u32(), r.d.u32(), r.d.str()
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	var data []byte
	if name == "" {
		names, err := f.file.ListXattrs()
		if err != nil {
			return nil, err
		}
		for _, a := range names {
			data = append(append(data, a...), 0)
		}
	} else if data, err = f.file.GetXattr(name); err != nil {
		return nil, err
	}
	if len(data) > MaxXattrSize {
		return nil, linux.E2BIG
	}
	if data == nil {
		data = []byte{}
	}
	if err := s.insertXattr(newN, &fid{typ: f.typ, uid: f.uid, xread: data, isXattr: true}); err != nil {
		return nil, err
	}
	e := r.reply(msgTxattrwalk+1, 8)
	e.u64(uint64(len(data)))
	return e.done(), nil
}

// insertXattr inserts an extended attribute's fid, within MaxXattrFids.
func (s *Session) insertXattr(n uint32, f *fid) error {
	s.mu.Lock()
	if s.xattrs >= MaxXattrFids {
		s.mu.Unlock()
		return linux.ENFILE
	}
	s.xattrs++
	s.mu.Unlock()
	if err := s.insert(n, f); err != nil {
		s.mu.Lock()
		s.xattrs--
		s.mu.Unlock()
		return err
	}
	return nil
}

// xattrcreate: fid[4] name[s] attr_size[8] flags[4]. The fid becomes the
// attribute's: its value comes with Twrite, and is set at Tclunk.
func (s *Session) xattrcreate(r *request) ([]byte, error) {
	n, name, size, flags := r.d.u32(), r.d.str(), r.d.u64(), p9.XattrFlags(r.d.u32())
	if err := r.d.end(); err != nil {
		return nil, err
	}
	if size > MaxXattrSize {
		return nil, linux.E2BIG
	}
	if name == "" {
		return nil, linux.EINVAL
	}
	f, err := s.fileFid(n)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	// f.mu, then s.mu: the order every handler takes them in.
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.opened || f.isXattr {
		return nil, linux.EINVAL
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.fids[n] != f:
		return nil, linux.EBADF // clunked or replaced meanwhile
	case s.xattrs >= MaxXattrFids:
		return nil, linux.ENFILE
	}
	f.isXattr = true
	f.xwrite = &xattrWrite{name: name, size: size, flags: flags}
	s.xattrs++
	return r.reply(msgTxattrcreat+1, 0).done(), nil
}

// lock: fid[4] type[1] flags[4] start[8] length[8] proc_id[4]
// client_id[s] -> status[1].
func (s *Session) lock(r *request) ([]byte, error) {
	n, typ, flags, start, length, pid, client := r.d.u32(), p9.LockType(r.d.u8()), p9.LockFlags(r.d.u32()), r.d.u64(), r.d.u64(), r.d.u32(), r.d.str()
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	defer s.put(f)
	st, err := f.file.Lock(int(pid), typ, flags, start, length, client)
	if err != nil {
		return nil, err
	}
	e := r.reply(msgTlock+1, 1)
	e.u8(uint8(st))
	return e.done(), nil
}

// getlock: fid[4] type[1] start[8] length[8] proc_id[4] client_id[s] ->
// the same fields. The guest's kernel keeps its locks (it is the share's
// one client): no lock here conflicts, so the answer is "unlocked" for
// the range asked.
func (s *Session) getlock(r *request) ([]byte, error) {
	n := r.d.u32()
	r.d.u8()
	start, length, pid, client := r.d.u64(), r.d.u64(), r.d.u32(), r.d.str()
	f, err := s.fidOf(r, n, false)
	if err != nil {
		return nil, err
	}
	s.put(f)
	e := r.reply(msgTgetlock+1, 1+8+8+4+2+len(client))
	e.u8(uint8(p9.Unlock)) // P9_LOCK_TYPE_UNLCK
	e.u64(start)
	e.u64(length)
	e.u32(pid)
	e.str(client)
	return e.done(), nil
}
