// Package fusefs serves a share's file tree to an untrusted guest over the
// FUSE protocol, for virtio-fs (package virtio/virtiofs): FS is a
// go-fuse fuse.RawFileSystem whose every operation is one of package
// p9fs's, so a share served over FUSE has the confinement, read-only mode,
// quotas and owner mapping a 9P share has (see p9fs's documentation). Its
// starting point is the FUSE protocol as Linux's fs/fuse and
// include/uapi/linux/fuse.h define it; go-fuse's ProtocolServer decodes
// the requests and encodes the replies, and this package answers them.
//
// # Nodes
//
// FUSE names files by node ids that the server hands out in LOOKUP,
// MKDIR, MKNOD, SYMLINK, LINK, TMPFILE and READDIRPLUS replies and that
// the kernel gives back, with the number of lookups it is forgetting, in
// FORGET. Each node
// holds one p9fs File (an O_PATH descriptor pinning one inode); one inode
// is one node, whatever the names it was looked up by, so hard links share
// a node and the guest's node count is bounded by the share's descriptor
// budget (p9fs.Options.MaxFDs: past it the guest gets ENFILE). The root is
// node 1 and is never forgotten.
//
// Files have no handles: OPEN and CREATE answer ENOSYS, on which the
// guest kernel stops sending OPEN and RELEASE for files and makes them with
// MKNOD, and each READ, WRITE, FSYNC or FALLOCATE opens the node's inode
// for itself and closes it after (a few host system calls, where an OPEN
// and a RELEASE would be two round trips through the guest's queue). An
// open directory is a handle: a second File of its inode, opened, whose
// offsets a listing resumes from. Handles are bounded by the same budget.
//
// # What the guest caches
//
// Entries (names, and names that do not exist) and attributes are valid
// for Options.Timeout (default 1 s), as a 9P share's names are. A file's
// pages stay cached across opens (FOPEN_KEEP_CACHE, which a kernel that
// opens without OPEN assumes) until a refresh of its attributes shows its
// size or modification time changed (FUSE_AUTO_INVAL_DATA): a change the
// host makes, to names, attributes or contents, is seen within the
// timeout. Writes go straight to the host (no writeback cache is
// negotiated) and FLUSH answers ENOSYS, which the guest then stops
// sending. POSIX and BSD locks are not negotiated, so the guest kernel
// keeps them itself, which is right for one guest.
//
// # Not served
//
// Device nodes (p9fs refuses them), LSEEK's
// SEEK_DATA/SEEK_HOLE, COPY_FILE_RANGE, IOCTL and POLL answer
// ENOSYS, on which the guest kernel falls back or fails as it documents.
package fusefs

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// rootID is the root's node id (FUSE_ROOT_ID).
const rootID = 1

// keepNodes is how many nodes the guest may keep cached entries for
// (9P's dentry_keep_max): past it, new entries are valid for no time.
var keepNodes = 4096

// Options configures an FS.
type Options struct {
	// Timeout is how long the guest may keep an entry or attributes
	// without asking again (0: one second).
	Timeout time.Duration
	// Logger receives refused requests at debug level.
	Logger *slog.Logger
}

// allocator is p9fs's fallocate(2) on an open file.
type allocator interface {
	Allocate(mode uint32, off, length uint64) error
}

// tmpfiler is p9fs's open(2) with O_TMPFILE.
type tmpfiler interface {
	Tmpfile(flags p9.OpenFlags, perm p9.FileMode, uid p9.UID, gid p9.GID) (p9.File, p9.QID, error)
}

// renamer is p9fs's rename with renameat2(2)'s flags.
type renamer interface {
	RenameAtFlags(oldName string, newDir p9.File, newName string, flags uint32) error
}

// node is one inode the guest has looked up.
type node struct {
	f       p9.File // pinned, never opened
	path    uint64  // its QID path: the inode's identity in the share
	lookups uint64  // lookups the guest has not forgotten
}

// FS answers FUSE requests for one share. It is safe for concurrent use:
// virtio-fs requests are served in parallel.
type FS struct {
	fuse.RawFileSystem // ENOSYS for what is not served

	timeout time.Duration
	log     *slog.Logger

	mu      sync.Mutex
	nodes   map[uint64]*node // by node id
	byPath  map[uint64]uint64
	nextID  uint64
	handles map[uint64]p9.File
	nextFH  uint64
	closed  bool
}

var _ fuse.RawFileSystem = (*FS)(nil)

// New returns an FS serving the tree a attaches to. The FS attaches once,
// now; Close releases every File it holds.
func New(a p9.Attacher, o Options) (*FS, error) {
	root, err := a.Attach()
	if err != nil {
		return nil, fmt.Errorf("fusefs: attach: %w", err)
	}
	qid, _, _, err := root.GetAttr(p9.AttrMask{})
	if err != nil {
		root.Close()
		return nil, fmt.Errorf("fusefs: stat the root: %w", err)
	}
	if o.Timeout <= 0 {
		o.Timeout = time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	fs := &FS{
		RawFileSystem: fuse.NewDefaultRawFileSystem(),
		timeout:       o.Timeout,
		log:           o.Logger,
		nodes:         map[uint64]*node{rootID: {f: root, path: qid.Path, lookups: 1}},
		byPath:        map[uint64]uint64{qid.Path: rootID},
		nextID:        rootID + 1,
		handles:       map[uint64]p9.File{},
		nextFH:        1,
	}
	return fs, nil
}

// MountOptions are the go-fuse options an FS is served with: what the
// INIT reply offers the guest. go-fuse's own messages (a request it could
// not decode, an opcode it lacks) go to log at debug level: the guest
// decides how many there are.
func MountOptions(maxWrite int, log *slog.Logger) *fuse.MountOptions {
	return &fuse.MountOptions{
		Logger:   slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		MaxWrite: maxWrite,
		// READDIRPLUS for a directory's first chunk, and for later ones
		// while the guest looks up what it lists (FS.ReadDirPlus), not
		// for every chunk of a listing nobody stats. Passthrough and
		// idmapped mounts are for a kernel server.
		ExtraCapabilities:    fuse.CAP_READDIRPLUS_AUTO,
		DisabledCapabilities: fuse.CAP_PASSTHROUGH | fuse.CAP_ALLOW_IDMAP | fuse.CAP_NO_OPEN_SUPPORT,
		MaxBackground:        64,
		Name:                 "capsa",
	}
}

// String implements fuse.RawFileSystem.
func (fs *FS) String() string { return "capsa" }

// Close releases every node and handle; later requests get EBADF.
func (fs *FS) Close() error {
	fs.mu.Lock()
	nodes, handles := fs.nodes, fs.handles
	fs.nodes, fs.handles, fs.byPath, fs.closed = map[uint64]*node{}, map[uint64]p9.File{}, map[uint64]uint64{}, true
	fs.mu.Unlock()
	for _, n := range nodes {
		n.f.Close()
	}
	for _, h := range handles {
		h.Close()
	}
	return nil
}

// ForgetAll forgets every node but the root, and every handle: the guest
// unmounted (DESTROY), after which Linux sends no FORGET for what it held.
func (fs *FS) ForgetAll() {
	fs.mu.Lock()
	var files []p9.File
	for id, n := range fs.nodes {
		if id != rootID {
			files = append(files, n.f)
			delete(fs.nodes, id)
			delete(fs.byPath, n.path)
		}
	}
	for fh, h := range fs.handles {
		files = append(files, h)
		delete(fs.handles, fh)
	}
	fs.mu.Unlock()
	for _, f := range files {
		f.Close()
	}
}

// Nodes reports how many nodes and handles the guest holds.
func (fs *FS) Nodes() (nodes, handles int) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return len(fs.nodes), len(fs.handles)
}

// status converts an error of p9fs's to a FUSE status.
func status(err error) fuse.Status {
	if err == nil {
		return fuse.OK
	}
	var le linux.Errno
	if errors.As(err, &le) {
		return fuse.Status(le)
	}
	var se syscall.Errno
	if errors.As(err, &se) {
		return fuse.Status(se)
	}
	return fuse.EIO
}

// file returns node id's File.
func (fs *FS) file(id uint64) (p9.File, fuse.Status) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n := fs.nodes[id]
	if n == nil {
		return nil, fuse.EBADF
	}
	return n.f, fuse.OK
}

// handle returns open file fh.
func (fs *FS) handle(fh uint64) (p9.File, fuse.Status) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	h := fs.handles[fh]
	if h == nil {
		return nil, fuse.EBADF
	}
	return h, fuse.OK
}

// addHandle records an opened File and returns its handle.
func (fs *FS) addHandle(f p9.File) (uint64, fuse.Status) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.closed {
		f.Close()
		return 0, fuse.EBADF
	}
	fh := fs.nextFH
	fs.nextFH++
	fs.handles[fh] = f
	return fh, fuse.OK
}

// remember makes f, just walked to with attributes a, a node the guest
// has looked up once more, filling out; f is the FS's from then on (closed
// here where the inode already has a node).
func (fs *FS) remember(f p9.File, qid p9.QID, a p9.Attr, out *fuse.EntryOut) fuse.Status {
	fs.mu.Lock()
	if fs.closed {
		fs.mu.Unlock()
		f.Close()
		return fuse.EBADF
	}
	crowded := len(fs.nodes) >= keepNodes
	id, ok := fs.byPath[qid.Path]
	if ok {
		fs.nodes[id].lookups++
	} else {
		id = fs.nextID
		fs.nextID++
		fs.nodes[id] = &node{f: f, path: qid.Path, lookups: 1}
		fs.byPath[qid.Path] = id
	}
	fs.mu.Unlock()
	if ok {
		f.Close()
	}
	*out = fuse.EntryOut{NodeId: id}
	fs.fill(&out.Attr, qid, a)
	if !crowded {
		// Past keepNodes nodes the entry is valid for no time, so the
		// guest lets it go once unused (and forgets its node): each node
		// is a descriptor of the share's budget, which I/O needs too.
		out.SetEntryTimeout(fs.timeout)
	}
	out.SetAttrTimeout(fs.timeout)
	return fuse.OK
}

// lookup walks from dir to name and remembers what it finds.
func (fs *FS) lookup(dir p9.File, name string, out *fuse.EntryOut) fuse.Status {
	qids, f, _, a, err := dir.WalkGetAttr([]string{name})
	if err != nil {
		return status(err)
	}
	if len(qids) != 1 {
		f.Close()
		return fuse.EIO
	}
	return fs.remember(f, qids[0], a, out)
}

// fill converts p9 attributes.
func (fs *FS) fill(out *fuse.Attr, qid p9.QID, a p9.Attr) {
	*out = fuse.Attr{
		Ino:       qid.Path,
		Size:      a.Size,
		Blocks:    a.Blocks,
		Atime:     a.ATimeSeconds,
		Atimensec: uint32(a.ATimeNanoSeconds),
		Mtime:     a.MTimeSeconds,
		Mtimensec: uint32(a.MTimeNanoSeconds),
		Ctime:     a.CTimeSeconds,
		Ctimensec: uint32(a.CTimeNanoSeconds),
		Mode:      uint32(a.Mode),
		Nlink:     uint32(a.NLink),
		Owner:     fuse.Owner{Uid: uint32(a.UID), Gid: uint32(a.GID)},
		Rdev:      uint32(a.RDev),
		Blksize:   uint32(a.BlockSize),
	}
}

// Lookup implements fuse.RawFileSystem. A name that does not exist is a
// negative entry the guest keeps for the timeout.
func (fs *FS) Lookup(_ <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	dir, st := fs.file(h.NodeId)
	if !st.Ok() {
		return st
	}
	st = fs.lookup(dir, name, out)
	if st == fuse.ENOENT {
		*out = fuse.EntryOut{}
		out.SetEntryTimeout(fs.timeout)
		return fuse.OK
	}
	return st
}

// Forget implements fuse.RawFileSystem.
func (fs *FS) Forget(id, nlookup uint64) {
	if id == rootID {
		return
	}
	fs.mu.Lock()
	n := fs.nodes[id]
	if n == nil {
		fs.mu.Unlock()
		return
	}
	if nlookup < n.lookups {
		n.lookups -= nlookup
		fs.mu.Unlock()
		return
	}
	delete(fs.nodes, id)
	if fs.byPath[n.path] == id {
		delete(fs.byPath, n.path)
	}
	fs.mu.Unlock()
	n.f.Close()
}

// allAttrs is what GETATTR asks p9fs for.
var allAttrs = p9.AttrMask{Mode: true, NLink: true, UID: true, GID: true, RDev: true, ATime: true, MTime: true, CTime: true, INo: true, Size: true, Blocks: true}

// GetAttr implements fuse.RawFileSystem.
func (fs *FS) GetAttr(_ <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	f, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	return fs.attrOut(f, out)
}

func (fs *FS) attrOut(f p9.File, out *fuse.AttrOut) fuse.Status {
	qid, _, a, err := f.GetAttr(allAttrs)
	if err != nil {
		return status(err)
	}
	*out = fuse.AttrOut{}
	fs.fill(&out.Attr, qid, a)
	out.SetTimeout(fs.timeout)
	return fuse.OK
}

// SetAttr implements fuse.RawFileSystem: mode, owner, size and times, as
// p9fs's SetAttr applies them.
func (fs *FS) SetAttr(_ <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	f, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	var m p9.SetAttrMask
	var a p9.SetAttr
	v := in.Valid
	if v&fuse.FATTR_MODE != 0 {
		m.Permissions, a.Permissions = true, p9.FileMode(in.Mode&07777)
	}
	if v&fuse.FATTR_UID != 0 {
		m.UID, a.UID = true, p9.UID(in.Uid)
	}
	if v&fuse.FATTR_GID != 0 {
		m.GID, a.GID = true, p9.GID(in.Gid)
	}
	if v&fuse.FATTR_SIZE != 0 {
		m.Size, a.Size = true, in.Size
	}
	// 9P's convention: ATime alone is now, with ATimeNotSystemTime the
	// time given.
	if v&(fuse.FATTR_ATIME|fuse.FATTR_ATIME_NOW) != 0 {
		m.ATime = true
		if v&fuse.FATTR_ATIME_NOW == 0 {
			m.ATimeNotSystemTime, a.ATimeSeconds, a.ATimeNanoSeconds = true, in.Atime, uint64(in.Atimensec)
		}
	}
	if v&(fuse.FATTR_MTIME|fuse.FATTR_MTIME_NOW) != 0 {
		m.MTime = true
		if v&fuse.FATTR_MTIME_NOW == 0 {
			m.MTimeNotSystemTime, a.MTimeSeconds, a.MTimeNanoSeconds = true, in.Mtime, uint64(in.Mtimensec)
		}
	}
	if v&fuse.FATTR_CTIME != 0 {
		m.CTime = true
	}
	if !m.Empty() {
		if err := f.SetAttr(m, a); err != nil {
			return status(err)
		}
	}
	return fs.attrOut(f, out)
}

// inherit applies a set-group-ID directory's rule to what a caller of
// group gid makes in dir, as a local file system does: the new entry
// takes dir's group, and a new directory the bit too. (A 9P client does
// this in the guest; a FUSE client leaves it to the server, which
// creates with the caller's group.)
func inherit(dir p9.File, gid uint32, mode uint32, isDir bool) (p9.GID, uint32) {
	_, _, a, err := dir.GetAttr(p9.AttrMask{Mode: true, GID: true})
	if err != nil || uint32(a.Mode)&unix.S_ISGID == 0 {
		return p9.GID(gid), mode
	}
	if isDir {
		mode |= unix.S_ISGID
	}
	return a.GID, mode
}

// Mkdir implements fuse.RawFileSystem.
func (fs *FS) Mkdir(_ <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	dir, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	gid, mode := inherit(dir, in.Gid, in.Mode&^in.Umask, true)
	if _, err := dir.Mkdir(name, p9.FileMode(mode), p9.UID(in.Uid), gid); err != nil {
		return status(err)
	}
	return fs.lookup(dir, name, out)
}

// Mknod implements fuse.RawFileSystem (fifos and sockets; p9fs refuses
// devices).
func (fs *FS) Mknod(_ <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	dir, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	gid, mode := inherit(dir, in.Gid, in.Mode&unix.S_IFMT|in.Mode&07777&^in.Umask, false)
	if _, err := dir.Mknod(name, p9.FileMode(mode), unix.Major(uint64(in.Rdev)), unix.Minor(uint64(in.Rdev)), p9.UID(in.Uid), gid); err != nil {
		return status(err)
	}
	return fs.lookup(dir, name, out)
}

// Symlink implements fuse.RawFileSystem.
func (fs *FS) Symlink(_ <-chan struct{}, h *fuse.InHeader, target, name string, out *fuse.EntryOut) fuse.Status {
	dir, st := fs.file(h.NodeId)
	if !st.Ok() {
		return st
	}
	gid, _ := inherit(dir, h.Gid, 0, false)
	if _, err := dir.Symlink(target, name, p9.UID(h.Uid), gid); err != nil {
		return status(err)
	}
	return fs.lookup(dir, name, out)
}

// Link implements fuse.RawFileSystem.
func (fs *FS) Link(_ <-chan struct{}, in *fuse.LinkIn, name string, out *fuse.EntryOut) fuse.Status {
	dir, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	target, st := fs.file(in.Oldnodeid)
	if !st.Ok() {
		return st
	}
	if err := dir.Link(target, name); err != nil {
		return status(err)
	}
	return fs.lookup(dir, name, out)
}

// Unlink implements fuse.RawFileSystem.
func (fs *FS) Unlink(_ <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	dir, st := fs.file(h.NodeId)
	if !st.Ok() {
		return st
	}
	return status(dir.UnlinkAt(name, 0))
}

// Rmdir implements fuse.RawFileSystem.
func (fs *FS) Rmdir(_ <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	dir, st := fs.file(h.NodeId)
	if !st.Ok() {
		return st
	}
	return status(dir.UnlinkAt(name, unix.AT_REMOVEDIR))
}

// Rename implements fuse.RawFileSystem, with renameat2(2)'s
// RENAME_NOREPLACE and RENAME_EXCHANGE.
func (fs *FS) Rename(_ <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	from, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	to, st := fs.file(in.Newdir)
	if !st.Ok() {
		return st
	}
	if r, ok := from.(renamer); ok {
		return status(r.RenameAtFlags(oldName, to, newName, in.Flags))
	}
	if in.Flags != 0 {
		return fuse.EINVAL
	}
	return status(from.RenameAt(oldName, to, newName))
}

// Readlink implements fuse.RawFileSystem.
func (fs *FS) Readlink(_ <-chan struct{}, h *fuse.InHeader) ([]byte, fuse.Status) {
	f, st := fs.file(h.NodeId)
	if !st.Ok() {
		return nil, st
	}
	s, err := f.Readlink()
	if err != nil {
		return nil, status(err)
	}
	return []byte(s), fuse.OK
}

// open clones node id's File and opens the clone as flags say; with
// lend, a file through p9fs's OpenLent (see io).
func (fs *FS) open(id uint64, flags uint32, lend bool) (p9.File, fuse.Status) {
	f, st := fs.file(id)
	if !st.Ok() {
		return nil, st
	}
	_, c, err := f.Walk(nil)
	if err != nil {
		return nil, status(err)
	}
	if l, ok := c.(lender); ok && lend {
		_, _, err = l.OpenLent(p9.OpenFlags(flags))
	} else {
		_, _, err = c.Open(p9.OpenFlags(flags))
	}
	if err != nil {
		c.Close()
		return nil, status(err)
	}
	return c, fuse.OK
}

// Open implements fuse.RawFileSystem: ENOSYS, on which the guest kernel
// stops sending OPEN and RELEASE for files (fc->no_open) and does their
// I/O by node (handle 0, see io), keeping a file's cached pages across
// opens until a refresh of its attributes shows it changed
// (FUSE_AUTO_INVAL_DATA). An open and a close are then no round trip.
func (fs *FS) Open(<-chan struct{}, *fuse.OpenIn, *fuse.OpenOut) fuse.Status {
	return fuse.ENOSYS
}

// Create implements fuse.RawFileSystem: ENOSYS, for the reason Open
// gives: the guest kernel then makes files with MKNOD (fc->no_create),
// and a CREATE's handle, which no RELEASE would ever free once the guest
// opens without OPEN, is never made.
func (fs *FS) Create(<-chan struct{}, *fuse.CreateIn, string, *fuse.CreateOut) fuse.Status {
	return fuse.ENOSYS
}

// Tmpfile implements fuse.RawFileSystem: open(2) with O_TMPFILE, a file
// with no name until a LINK gives it one. Its node pins it; the reply's
// handle is 0, as for every file (Open).
func (fs *FS) Tmpfile(_ <-chan struct{}, in *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	dir, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	t, ok := dir.(tmpfiler)
	if !ok {
		return fuse.ENOSYS
	}
	gid, mode := inherit(dir, in.Gid, in.Mode&07777&^in.Umask, false)
	nf, _, err := t.Tmpfile(p9.OpenFlags(in.Flags), p9.FileMode(mode), p9.UID(in.Uid), gid)
	if err != nil {
		return status(err)
	}
	defer nf.Close()
	_, pinned, err := nf.Walk(nil)
	if err != nil {
		return status(err)
	}
	qid, _, a, err := pinned.GetAttr(allAttrs)
	if err != nil {
		pinned.Close()
		return status(err)
	}
	if st := fs.remember(pinned, qid, a, &out.EntryOut); !st.Ok() {
		return st
	}
	out.OpenOut = fuse.OpenOut{}
	return fuse.OK
}

// lender is p9fs's open for a client that checked the permission itself.
type lender interface {
	OpenLent(mode p9.OpenFlags) (p9.QID, uint32, error)
}

// io returns the file a READ, WRITE, FSYNC or FALLOCATE acts on: its
// handle where it has one (never, since OPEN answers ENOSYS), else node
// id's file opened for this request alone, as flags say (the guest's
// open flags: for writing when write, appending and synchronous as the
// guest opened it), and what to call when done. The guest kernel has
// checked the guest's permission (virtio-fs mounts check it in the
// guest), so a file the VMM's user owns whose mode withholds the access
// from that user is opened with the permission lent (p9fs OpenLent), as
// the open the guest made before writing to a new read-only file (git's
// objects) would have been on a local disk.
func (fs *FS) io(id, fh uint64, write bool, flags uint32) (p9.File, func(), fuse.Status) {
	if fh != 0 {
		h, st := fs.handle(fh)
		return h, func() {}, st
	}
	mode := uint32(unix.O_RDONLY)
	if write {
		mode = unix.O_WRONLY | flags&(unix.O_APPEND|unix.O_DSYNC|unix.O_SYNC)
	}
	c, st := fs.open(id, mode, true)
	if !st.Ok() {
		return nil, nil, st
	}
	return c, func() { c.Close() }, fuse.OK
}

// Read implements fuse.RawFileSystem.
func (fs *FS) Read(_ <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	h, done, st := fs.io(in.NodeId, in.Fh, false, 0)
	if !st.Ok() {
		return nil, st
	}
	defer done()
	if int(in.Size) < len(buf) {
		buf = buf[:in.Size]
	}
	n, err := h.ReadAt(buf, int64(in.Offset))
	if err != nil && n == 0 && !errors.Is(err, io.EOF) {
		return nil, status(err)
	}
	return fuse.ReadResultData(buf[:n]), fuse.OK
}

// Write implements fuse.RawFileSystem.
func (fs *FS) Write(_ <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	h, done, st := fs.io(in.NodeId, in.Fh, true, in.Flags)
	if !st.Ok() {
		return 0, st
	}
	defer done()
	n, err := h.WriteAt(data, int64(in.Offset))
	if err != nil && n == 0 {
		return 0, status(err)
	}
	return uint32(n), fuse.OK
}

// Writev implements fuse.RawFileSystem: the pieces of one write, which
// lie in separate stretches of guest memory, written in order.
func (fs *FS) Writev(_ <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	h, done, st := fs.io(in.NodeId, in.Fh, true, in.Flags)
	if !st.Ok() {
		return 0, st
	}
	defer done()
	var total uint32
	off := int64(in.Offset)
	for _, d := range data {
		n, err := h.WriteAt(d, off)
		total += uint32(n)
		off += int64(n)
		if err != nil || n < len(d) {
			if total == 0 {
				return 0, status(err)
			}
			break
		}
	}
	return total, fuse.OK
}

// Fallocate implements fuse.RawFileSystem.
func (fs *FS) Fallocate(_ <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	h, done, st := fs.io(in.NodeId, in.Fh, true, 0)
	if !st.Ok() {
		return st
	}
	defer done()
	a, ok := h.(allocator)
	if !ok {
		return fuse.ENOSYS
	}
	return status(a.Allocate(in.Mode, in.Offset, in.Length))
}

// Flush implements fuse.RawFileSystem: writes went to the host already,
// and the guest keeps locks itself, so a close has nothing to tell the
// server. ENOSYS makes the guest kernel stop sending FLUSH at every close
// (fc->no_flush): one round trip a close fewer.
func (fs *FS) Flush(<-chan struct{}, *fuse.FlushIn) fuse.Status { return fuse.ENOSYS }

// Fsync implements fuse.RawFileSystem.
func (fs *FS) Fsync(_ <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	h, done, st := fs.io(in.NodeId, in.Fh, false, 0)
	if !st.Ok() {
		return st
	}
	defer done()
	return status(h.FSync())
}

// Release implements fuse.RawFileSystem.
func (fs *FS) Release(_ <-chan struct{}, in *fuse.ReleaseIn) {
	fs.release(in.Fh)
}

func (fs *FS) release(fh uint64) {
	fs.mu.Lock()
	h := fs.handles[fh]
	delete(fs.handles, fh)
	fs.mu.Unlock()
	if h != nil {
		h.Close()
	}
}

// OpenDir implements fuse.RawFileSystem.
func (fs *FS) OpenDir(_ <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	d, st := fs.open(in.NodeId, unix.O_RDONLY, false)
	if !st.Ok() {
		return st
	}
	fh, st := fs.addHandle(d)
	if st.Ok() {
		*out = fuse.OpenOut{Fh: fh}
	}
	return st
}

// ReadDir implements fuse.RawFileSystem. Offsets are the host
// directory's own cookies, so a listing resumes where it stopped.
func (fs *FS) ReadDir(_ <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	h, st := fs.handle(in.Fh)
	if !st.Ok() {
		return st
	}
	ents, err := h.Readdir(in.Offset, in.Size)
	if err != nil {
		return status(err)
	}
	for _, e := range ents {
		if !out.AddDirEntry(fuse.DirEntry{Name: e.Name, Ino: e.QID.Path, Mode: dtMode(uint8(e.Type)), Off: e.Offset}) {
			break
		}
	}
	return fuse.OK
}

// ReadDirPlus implements fuse.RawFileSystem: READDIR with each entry
// looked up, so that a listing followed by a stat of each entry (ls -l,
// find, git, cp -a) or a descent into each directory costs no LOOKUP per
// entry. The guest kernel asks for it (READDIRPLUS_AUTO) for a directory's
// first chunk and again while it looks up the entries it lists.
//
// Linux counts one lookup for each entry with a node id that it parses,
// whether or not its caller's buffer held the entry, and sends FORGET for
// one it could not link; so an entry is looked up only once the reply is
// known to have room for it, and then added as the lookup found it (its
// inode and type, should the name have been replaced since the listing).
// "." and "..", the root (Linux takes node 1 in a listing as invalid),
// and an entry gone by the time it is looked up have node id 0: a plain
// entry. Past keepNodes nodes entries are plain too, so a listing grows
// the node table, and the share's descriptors, no further than LOOKUP
// would.
func (fs *FS) ReadDirPlus(_ <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	h, st := fs.handle(in.Fh)
	if !st.Ok() {
		return st
	}
	dir, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	// p9fs's budget counts 24 bytes and the name for an entry, a reply
	// 152 and the name, padded: a quarter of the reply's size reads
	// about what fits, not four times as many entries to read again.
	ents, err := h.Readdir(in.Offset, max(in.Size/4, 512))
	if err != nil {
		return status(err)
	}
	for _, e := range ents {
		if int(in.Size)-len(out.Bytes()) < plusEntrySize+(len(e.Name)+7)&^7 {
			break
		}
		de := fuse.DirEntry{Name: e.Name, Ino: e.QID.Path, Mode: dtMode(uint8(e.Type)), Off: e.Offset}
		var eo fuse.EntryOut
		if e.Name != "." && e.Name != ".." && !fs.crowded() {
			if st := fs.lookup(dir, e.Name, &eo); !st.Ok() || eo.NodeId == rootID {
				eo = fuse.EntryOut{}
			}
		}
		if eo.NodeId != 0 {
			de.Ino, de.Mode = eo.Attr.Ino, eo.Attr.Mode
		}
		entry := out.AddDirLookupEntry(de)
		if entry == nil { // not so: the room was checked
			if eo.NodeId != 0 {
				fs.Forget(eo.NodeId, 1)
			}
			break
		}
		*entry = eo
	}
	return fuse.OK
}

// plusEntrySize is a READDIRPLUS entry's size before its name: a
// fuse_entry_out and a fuse_dirent.
const plusEntrySize = 128 + 24

// crowded says whether the guest holds keepNodes nodes or more.
func (fs *FS) crowded() bool {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return len(fs.nodes) >= keepNodes
}

// dtMode is a directory entry type's S_IFMT bits.
func dtMode(t uint8) uint32 {
	return uint32(t) << 12
}

// ReleaseDir implements fuse.RawFileSystem.
func (fs *FS) ReleaseDir(in *fuse.ReleaseIn) { fs.release(in.Fh) }

// FsyncDir implements fuse.RawFileSystem.
func (fs *FS) FsyncDir(_ <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	h, st := fs.handle(in.Fh)
	if !st.Ok() {
		return st
	}
	return status(h.FSync())
}

// StatFs implements fuse.RawFileSystem.
func (fs *FS) StatFs(_ <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	f, st := fs.file(h.NodeId)
	if !st.Ok() {
		return st
	}
	s, err := f.StatFS()
	if err != nil {
		return status(err)
	}
	*out = fuse.StatfsOut{
		Blocks: s.Blocks, Bfree: s.BlocksFree, Bavail: s.BlocksAvailable,
		Files: s.Files, Ffree: s.FilesFree,
		Bsize: s.BlockSize, NameLen: s.NameLength, Frsize: s.BlockSize,
	}
	return fuse.OK
}

// GetXAttr implements fuse.RawFileSystem: with dest empty, the value's
// size; with dest too small, ERANGE.
func (fs *FS) GetXAttr(_ <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	f, st := fs.file(h.NodeId)
	if !st.Ok() {
		return 0, st
	}
	v, err := f.GetXattr(attr)
	if err != nil {
		return 0, status(err)
	}
	return sized(v, dest)
}

// sized answers an extended attribute request of dest's size for v.
func sized(v, dest []byte) (uint32, fuse.Status) {
	if len(dest) == 0 {
		return uint32(len(v)), fuse.OK
	}
	if len(dest) < len(v) {
		return 0, fuse.ERANGE
	}
	return uint32(copy(dest, v)), fuse.OK
}

// ListXAttr implements fuse.RawFileSystem: names, each ended by NUL.
func (fs *FS) ListXAttr(_ <-chan struct{}, h *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	f, st := fs.file(h.NodeId)
	if !st.Ok() {
		return 0, st
	}
	names, err := f.ListXattrs()
	if err != nil {
		return 0, status(err)
	}
	var v []byte
	for _, n := range names {
		if n != "" {
			v = append(append(v, n...), 0)
		}
	}
	return sized(v, dest)
}

// SetXAttr implements fuse.RawFileSystem.
func (fs *FS) SetXAttr(_ <-chan struct{}, in *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	f, st := fs.file(in.NodeId)
	if !st.Ok() {
		return st
	}
	return status(f.SetXattr(attr, data, p9.XattrFlags(in.Flags)))
}

// RemoveXAttr implements fuse.RawFileSystem.
func (fs *FS) RemoveXAttr(_ <-chan struct{}, h *fuse.InHeader, attr string) fuse.Status {
	f, st := fs.file(h.NodeId)
	if !st.Ok() {
		return st
	}
	return status(f.RemoveXattr(attr))
}

// Access implements fuse.RawFileSystem: virtio-fs mounts check
// permissions in the guest (default_permissions), so nothing is asked.
func (fs *FS) Access(<-chan struct{}, *fuse.AccessIn) fuse.Status { return fuse.ENOSYS }
