package p9fs

import (
	"encoding/binary"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// fileSeq orders Files for two-File operations (lock ordering).
var fileSeq atomic.Uint64

// file is a p9.File: one inode of the share, pinned by an O_PATH
// descriptor.
type file struct {
	s   *share
	seq uint64
	typ uint32 // S_IFMT bits; an inode's type never changes
	ino uint64 // with a quota: the inode held (share.hold)

	// mu guards the descriptors' lifetime: operations that use them hold
	// it for reading, so Close (and Open) cannot close or replace a
	// descriptor that a concurrent syscall is about to use, which could
	// meanwhile be reused for another file.
	mu      sync.RWMutex
	fd      int  // O_PATH descriptor; -1 once closed
	ofd     int  // descriptor opened for I/O by Open or Create; -1 if none
	owrite  bool // ofd is open for writing
	oappend bool // ofd is open with O_APPEND: writes go to the end

	dirMu sync.Mutex // serializes Readdir's seek and read on ofd
}

var _ p9.File = (*file)(nil)

// newFile makes a File owning fd, inode ino of type typ, charging fd to
// the descriptor budget and, with a quota, holding the inode; over budget,
// fd is closed and the error is ENFILE.
func newFile(s *share, fd int, typ uint32, ino uint64) (*file, error) {
	if err := s.charge(1); err != nil {
		unix.Close(fd)
		return nil, s.deny(linux.ENFILE, "new fid", "held", s.fds.Load())
	}
	if s.quota != nil {
		if err := s.hold(fd, ino); err != nil {
			unix.Close(fd)
			s.release(1)
			return nil, err
		}
	}
	return &file{s: s, seq: fileSeq.Add(1), typ: typ & unix.S_IFMT, ino: ino, fd: fd, ofd: -1}, nil
}

// rlock locks f for using its descriptors and reports EBADF once closed.
func (f *file) rlock() error {
	f.mu.RLock()
	if f.fd < 0 {
		f.mu.RUnlock()
		return linux.EBADF
	}
	return nil
}

// rlock2 read-locks two Files of the same share in a global order.
// other must be a *file of f's share, else EXDEV. It returns the unlock
// function.
func (f *file) rlock2(other p9.File) (*file, func(), error) {
	o, ok := other.(*file)
	if !ok || o == nil || o.s != f.s {
		return nil, nil, linux.EXDEV
	}
	if o == f {
		if err := f.rlock(); err != nil {
			return nil, nil, err
		}
		return o, f.mu.RUnlock, nil
	}
	a, b := f, o
	if b.seq < a.seq {
		a, b = b, a
	}
	if err := a.rlock(); err != nil {
		return nil, nil, err
	}
	if err := b.rlock(); err != nil {
		a.mu.RUnlock()
		return nil, nil, err
	}
	return o, func() { b.mu.RUnlock(); a.mu.RUnlock() }, nil
}

// Walk implements p9.File.Walk. An empty walk clones f (unopened).
func (f *file) Walk(names []string) ([]p9.QID, p9.File, error) {
	qids, nf, _, err := f.walk(names)
	if err != nil {
		return nil, nil, err
	}
	return qids, nf, nil
}

// WalkGetAttr implements p9.File.WalkGetAttr.
func (f *file) WalkGetAttr(names []string) ([]p9.QID, p9.File, p9.AttrMask, p9.Attr, error) {
	qids, nf, st, err := f.walk(names)
	if err != nil {
		return nil, nil, p9.AttrMask{}, p9.Attr{}, err
	}
	return qids, nf, attrValid, f.s.attr(nf.fd, &st), nil
}

// walk looks up names one entry at a time, never following a symlink,
// and returns the QIDs, a File for the last one and its stat.
func (f *file) walk(names []string) ([]p9.QID, *file, unix.Stat_t, error) {
	var st unix.Stat_t
	for _, n := range names {
		if err := checkName(n); err != nil {
			return nil, nil, st, f.s.deny(err.(linux.Errno), "walk", "name", n)
		}
	}
	if err := f.rlock(); err != nil {
		return nil, nil, st, err
	}
	defer f.mu.RUnlock()

	if len(names) == 0 {
		fd, err := dupFD(f.fd)
		if err != nil {
			return nil, nil, st, errno(err)
		}
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return nil, nil, st, errno(err)
		}
		nf, err := newFile(f.s, fd, st.Mode, st.Ino)
		return nil, nf, st, err
	}

	qids := make([]p9.QID, 0, len(names))
	dir, owned := f.fd, -1
	for i, n := range names {
		if i > 0 && st.Mode&unix.S_IFMT != unix.S_IFDIR {
			unix.Close(owned)
			return nil, nil, st, linux.ENOTDIR
		}
		fd, err := f.s.openat(dir, n, unix.O_PATH, 0)
		if owned >= 0 {
			unix.Close(owned)
		}
		if err != nil {
			return nil, nil, st, errno(err)
		}
		owned, dir = fd, fd
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return nil, nil, st, errno(err)
		}
		qids = append(qids, f.s.qid(&st))
	}
	nf, err := newFile(f.s, owned, st.Mode, st.Ino)
	if err != nil {
		return nil, nil, st, err
	}
	return qids, nf, st, nil
}

// StatFS implements p9.File.StatFS.
func (f *file) StatFS() (p9.FSStat, error) {
	if err := f.rlock(); err != nil {
		return p9.FSStat{}, err
	}
	defer f.mu.RUnlock()
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(f.fd, &sfs); err != nil {
		return p9.FSStat{}, errno(err)
	}
	f.s.quotaStatFS(&sfs.Blocks, &sfs.Bfree, &sfs.Bavail, &sfs.Ffree, uint64(sfs.Bsize))
	return p9.FSStat{
		Type:            v9fsMagic,
		BlockSize:       uint32(sfs.Bsize),
		Blocks:          sfs.Blocks,
		BlocksFree:      sfs.Bfree,
		BlocksAvailable: sfs.Bavail,
		Files:           sfs.Files,
		FilesFree:       sfs.Ffree,
		FSID:            uint64(uint32(sfs.Fsid.Val[0])) | uint64(uint32(sfs.Fsid.Val[1]))<<32,
		NameLength:      uint32(sfs.Namelen),
	}, nil
}

// stat is fstat of the pinned inode; f must be locked.
func (f *file) stat() (unix.Stat_t, error) {
	var st unix.Stat_t
	err := unix.Fstat(f.fd, &st)
	return st, errno(err)
}

// GetAttr implements p9.File.GetAttr. It always returns the basic
// attributes, whatever req asks.
func (f *file) GetAttr(req p9.AttrMask) (p9.QID, p9.AttrMask, p9.Attr, error) {
	if err := f.rlock(); err != nil {
		return p9.QID{}, p9.AttrMask{}, p9.Attr{}, err
	}
	defer f.mu.RUnlock()
	st, err := f.stat()
	if err != nil {
		return p9.QID{}, p9.AttrMask{}, p9.Attr{}, err
	}
	return f.s.qid(&st), attrValid, f.s.attr(f.fd, &st), nil
}

// SetAttr implements p9.File.SetAttr: permissions (without setuid and
// setgid), size, and times. Ownership changes are accepted only when they
// change nothing the guest sees. Everything is checked before anything is
// changed.
func (f *file) SetAttr(valid p9.SetAttrMask, a p9.SetAttr) error {
	if valid.Empty() {
		return nil
	}
	if f.s.ro {
		return linux.EROFS
	}
	if err := f.rlock(); err != nil {
		return err
	}
	defer f.mu.RUnlock()

	// A chown of a file the VMM's user owns (a regular file or a
	// directory) keeps the new owner in ownerXattr; the guest kernel
	// has checked that its caller may. Any other is accepted only where
	// it changes nothing the guest sees.
	var chown *owner
	var chownSt unix.Stat_t
	if valid.UID || valid.GID {
		st, err := f.stat()
		if err != nil {
			return err
		}
		cur := f.s.shown(f.fd, &st)
		want := cur
		if valid.UID && a.UID.Ok() {
			want.uid = uint32(a.UID)
		}
		if valid.GID && a.GID.Ok() {
			want.gid = uint32(a.GID)
		}
		switch {
		case want == cur:
		case f.s.keeps(&st):
			chown, chownSt = &want, st
		case want.uid != cur.uid && want.uid != f.s.uid:
			return f.s.deny(linux.EPERM, "chown", "uid", want.uid)
		case want.gid != cur.gid && want.gid != f.s.gid:
			return f.s.deny(linux.EPERM, "chown", "gid", want.gid)
		}
	}
	link := f.typ == unix.S_IFLNK
	if valid.Permissions && link {
		return linux.EOPNOTSUPP // as lchmod(2)
	}
	if valid.Size {
		switch {
		case f.typ == unix.S_IFDIR:
			return linux.EISDIR
		case f.typ != unix.S_IFREG:
			return linux.EINVAL
		case a.Size > math.MaxInt64:
			return linux.EFBIG
		}
	}
	var ts [2]unix.Timespec
	if valid.ATime || valid.MTime {
		var err error
		if ts[0], err = utime(valid.ATime, valid.ATimeNotSystemTime, a.ATimeSeconds, a.ATimeNanoSeconds); err != nil {
			return err
		}
		if ts[1], err = utime(valid.MTime, valid.MTimeNotSystemTime, a.MTimeSeconds, a.MTimeNanoSeconds); err != nil {
			return err
		}
	}

	if valid.Size && (valid.Permissions || chown != nil) && f.s.quota != nil {
		// Refuse a truncation past the budget before the owner or the
		// chmod (the truncation checks again, in its own Update).
		err := f.s.charged("truncate", func(tx QuotaTx) error {
			var st unix.Stat_t
			if err := unix.Fstat(f.fd, &st); err != nil {
				return errno(err)
			}
			return room(tx, roundUp(int64(a.Size))-roundUp(st.Size))
		})
		if err != nil {
			return err
		}
	}
	// The owner first: on a host without user attributes it is what
	// fails, and then nothing has changed.
	if chown != nil {
		if err := f.s.setOwner(f.fd, &chownSt, *chown); err != nil {
			return f.s.deny(linux.EPERM, "chown", "uid", chown.uid, "gid", chown.gid, "host", err.Error())
		}
	}
	if valid.Permissions {
		mode := safeMode(a.Permissions)
		if f.typ == unix.S_IFDIR {
			mode = dirMode(a.Permissions)
		}
		var st unix.Stat_t
		refresh := func() {}
		if unix.Fstat(f.fd, &st) == nil {
			refresh = f.s.keepOwner(f.fd, &st, mode)
		}
		if err := unix.Chmod(procPath(f.fd), mode); err != nil {
			return errno(err)
		}
		refresh()
	}
	if valid.Size {
		if err := f.truncate(int64(a.Size)); err != nil {
			return err
		}
	}
	if valid.ATime || valid.MTime {
		// AT_EMPTY_PATH acts on the descriptor's inode, a symlink
		// included; kernels without it for utimensat get the magic
		// link instead, which is fine for anything but a symlink.
		err := unix.UtimesNanoAt(f.fd, "", ts[:], unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
		if err == unix.EINVAL && !link {
			err = unix.UtimesNanoAt(unix.AT_FDCWD, procPath(f.fd), ts[:], 0)
		}
		if err != nil {
			return errno(err)
		}
	}
	return nil
}

// truncate sets the size of f (a regular file, locked), charging the
// change.
func (f *file) truncate(size int64) error {
	return f.s.charged("truncate", func(tx QuotaTx) error {
		var st unix.Stat_t
		if tx != nil {
			if err := unix.Fstat(f.fd, &st); err != nil {
				return errno(err)
			}
			if err := room(tx, roundUp(size)-roundUp(st.Size)); err != nil {
				return err
			}
		}
		// An fid open for writing may truncate even a file whose mode
		// no longer allows writing, as ftruncate(2) would. Otherwise the
		// inode is opened for writing through its magic link, which
		// checks the same write permission truncate(2) does, and
		// truncated through that descriptor: truncate(2) by path is not
		// in a confined VMM's system call allowlist (a guest's
		// truncate -s got EPERM from seccomp).
		var err error
		if f.ofd >= 0 && f.owrite {
			err = unix.Ftruncate(f.ofd, size)
		} else {
			var wfd int
			if wfd, err = reopen(f.fd, unix.O_WRONLY|unix.O_NONBLOCK); err == nil {
				err = unix.Ftruncate(wfd, size)
				unix.Close(wfd)
			}
		}
		chargeSize(tx, f.fd, st.Size)
		return errno(err)
	})
}

// Allocate is fallocate(2) on f's open descriptor (which must be open
// for writing): mode 0 or FALLOC_FL_KEEP_SIZE reserves blocks,
// FALLOC_FL_PUNCH_HOLE|FALLOC_FL_KEEP_SIZE frees them, FALLOC_FL_ZERO_RANGE
// zeroes a range. A size it grows is charged as a write's would be. 9P has
// no way to ask for it; a FUSE client (package fusefs) does.
func (f *file) Allocate(mode uint32, off, length uint64) error {
	const known = unix.FALLOC_FL_KEEP_SIZE | unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_ZERO_RANGE
	if f.s.ro {
		return linux.EROFS
	}
	if mode&^known != 0 || off > math.MaxInt64 || length == 0 || length > math.MaxInt64-off {
		return linux.EINVAL
	}
	fd, err := f.openFD()
	if err != nil {
		return err
	}
	defer f.mu.RUnlock()
	if !f.owrite {
		return linux.EBADF
	}
	return f.s.charged("fallocate", func(tx QuotaTx) error {
		var st unix.Stat_t
		if tx != nil {
			if err := unix.Fstat(fd, &st); err != nil {
				return errno(err)
			}
			end := int64(off + length)
			if mode&unix.FALLOC_FL_KEEP_SIZE == 0 && end > st.Size {
				if err := room(tx, roundUp(end)-roundUp(st.Size)); err != nil {
					return err
				}
			} else if mode&unix.FALLOC_FL_PUNCH_HOLE == 0 && end > st.Size {
				// Blocks past the size, which the quota (by size)
				// would not count.
				return linux.EOPNOTSUPP
			}
		}
		err := unix.Fallocate(fd, mode, int64(off), int64(length))
		chargeSize(tx, fd, st.Size)
		return errno(err)
	})
}

// chargeSize charges how the size of the regular file fd changed since it
// was old.
func chargeSize(tx QuotaTx, fd int, old int64) {
	if tx == nil {
		return
	}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		return // it did not change, or we cannot tell
	}
	tx.Charge(roundUp(st.Size) - roundUp(old))
}

// utime is one utimensat timestamp for a SetAttr time field.
func utime(set, given bool, sec, nsec uint64) (unix.Timespec, error) {
	switch {
	case !set:
		return unix.Timespec{Nsec: unix.UTIME_OMIT}, nil
	case !given:
		return unix.Timespec{Nsec: unix.UTIME_NOW}, nil
	case nsec >= 1e9 || sec > math.MaxInt64:
		return unix.Timespec{}, linux.EINVAL
	}
	return unix.Timespec{Sec: int64(sec), Nsec: int64(nsec)}, nil
}

// Close implements p9.File.Close, releasing f's descriptors.
func (f *file) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ofd >= 0 {
		unix.Close(f.ofd)
		f.ofd = -1
		f.s.release(1)
	}
	if f.fd >= 0 {
		if f.s.quota != nil {
			f.s.unhold(f.fd, f.ino)
		}
		unix.Close(f.fd)
		f.fd = -1
		f.s.release(1)
	}
	return nil
}

// Open implements p9.File.Open. Only regular files and directories can
// be opened; a symlink fails with ELOOP, anything else with EPERM.
func (f *file) Open(mode p9.OpenFlags) (p9.QID, uint32, error) {
	fl, err := hostOpenFlags(mode)
	if err != nil {
		return p9.QID{}, 0, err
	}
	switch f.typ {
	case unix.S_IFREG:
		if f.s.ro && (fl&unix.O_ACCMODE != unix.O_RDONLY || fl&unix.O_TRUNC != 0) {
			return p9.QID{}, 0, linux.EROFS
		}
	case unix.S_IFDIR:
		if fl&unix.O_ACCMODE != unix.O_RDONLY {
			return p9.QID{}, 0, linux.EISDIR
		}
		fl = unix.O_RDONLY | unix.O_DIRECTORY
	case unix.S_IFLNK:
		return p9.QID{}, 0, linux.ELOOP
	default:
		return p9.QID{}, 0, f.s.deny(linux.EPERM, "open", "type", f.typ)
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fd < 0 {
		return p9.QID{}, 0, linux.EBADF
	}
	if f.ofd >= 0 {
		return p9.QID{}, 0, linux.EINVAL
	}
	if err := f.s.charge(1); err != nil {
		return p9.QID{}, 0, f.s.deny(linux.ENFILE, "open", "held", f.s.fds.Load())
	}
	var ofd int
	if fl&unix.O_TRUNC != 0 {
		// The truncation frees what the file took.
		err = f.s.charged("open", func(tx QuotaTx) error {
			var st unix.Stat_t
			if tx != nil {
				if err := unix.Fstat(f.fd, &st); err != nil {
					return errno(err)
				}
			}
			var err error
			ofd, err = reopen(f.fd, fl)
			chargeSize(tx, f.fd, st.Size)
			return errno(err)
		})
	} else {
		ofd, err = reopen(f.fd, fl)
		err = errno(err)
	}
	if err != nil {
		f.s.release(1)
		return p9.QID{}, 0, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(ofd, &st); err != nil {
		unix.Close(ofd)
		f.s.release(1)
		return p9.QID{}, 0, errno(err)
	}
	f.ofd = ofd
	f.owrite = fl&unix.O_ACCMODE != unix.O_RDONLY
	f.oappend = fl&unix.O_APPEND != 0
	return f.s.qid(&st), 0, nil
}

// OpenLent is Open for a client that checked the permission itself and
// opens files without telling the server (a FUSE guest kernel, whose
// virtio-fs mounts check permissions in the guest, package fusefs): where
// a regular file the VMM's user owns has a mode that withholds from that
// user what the open asks (a file the guest made read-only, 0444, and
// writes to through the descriptor it made it with, as git does), the
// mode is widened for the open and set back after, as ownerAccess does
// for the owner attribute. It lends nothing the guest could not take:
// it may chmod a file the VMM's user owns. Root needs none of it.
func (f *file) OpenLent(mode p9.OpenFlags) (p9.QID, uint32, error) {
	qid, n, err := f.Open(mode)
	if err != linux.EACCES || f.typ != unix.S_IFREG || f.s.hostUID == 0 {
		return qid, n, err
	}
	fl, ferr := hostOpenFlags(mode)
	if ferr != nil {
		return qid, n, err
	}
	need := uint32(0o400)
	switch fl & unix.O_ACCMODE {
	case unix.O_WRONLY:
		need = 0o200
	case unix.O_RDWR:
		need = 0o600
	}
	if rerr := f.rlock(); rerr != nil {
		return qid, n, rerr
	}
	var st unix.Stat_t
	serr := unix.Fstat(f.fd, &st)
	p := procPath(f.fd)
	f.mu.RUnlock()
	if serr != nil || st.Uid != f.s.hostUID || st.Mode&need == need {
		return qid, n, err
	}
	old := st.Mode & 0o7777
	if cerr := unix.Chmod(p, old|need); cerr != nil {
		return qid, n, err
	}
	qid, n, err = f.Open(mode)
	if cerr := unix.Chmod(p, old); cerr != nil {
		f.s.log.Warn("p9fs: a file's mode is not set back after an open lent it permission", "mode", fmt.Sprintf("%o", old), "err", cerr)
	}
	return qid, n, err
}

// openFD returns the I/O descriptor with f read-locked; the caller must
// RUnlock.
func (f *file) openFD() (int, error) {
	if err := f.rlock(); err != nil {
		return -1, err
	}
	if f.ofd < 0 {
		f.mu.RUnlock()
		return -1, linux.EBADF
	}
	return f.ofd, nil
}

// ReadAt implements p9.File.ReadAt with pread(2).
func (f *file) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, linux.EINVAL
	}
	return f.io(unix.Pread, p, off)
}

// WriteAt implements p9.File.WriteAt with pwrite(2). With a quota, a
// write whose end would pass it fails whole with ENOSPC.
func (f *file) WriteAt(p []byte, off int64) (int, error) {
	if f.s.ro {
		return 0, linux.EROFS
	}
	if off < 0 {
		return 0, linux.EINVAL
	}
	if f.s.quota == nil {
		return f.io(unix.Pwrite, p, off)
	}
	fd, err := f.openFD()
	if err != nil {
		return 0, err
	}
	defer f.mu.RUnlock()
	var n int
	// Held across the look at the size and the write: a truncation
	// elsewhere in between could otherwise make this write extend the
	// file unaccounted.
	err = f.s.charged("write", func(tx QuotaTx) error {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return errno(err)
		}
		end := off
		if f.oappend {
			end = st.Size
		}
		if end > math.MaxInt64-int64(len(p)) {
			return linux.EFBIG
		}
		end += int64(len(p))
		if err := room(tx, roundUp(end)-roundUp(st.Size)); err != nil {
			return err
		}
		var err error
		for {
			n, err = unix.Pwrite(fd, p, off)
			if err != unix.EINTR {
				break
			}
		}
		chargeSize(tx, fd, st.Size)
		if err != nil {
			n = 0
		}
		return errno(err)
	})
	return n, err
}

// io runs pread or pwrite on the open file, retrying on EINTR.
func (f *file) io(op func(fd int, p []byte, off int64) (int, error), p []byte, off int64) (int, error) {
	fd, err := f.openFD()
	if err != nil {
		return 0, err
	}
	defer f.mu.RUnlock()
	for {
		n, err := op(fd, p, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return 0, errno(err)
		}
		return n, nil
	}
}

// FSync implements p9.File.FSync.
func (f *file) FSync() error {
	fd, err := f.openFD()
	if err != nil {
		return err
	}
	defer f.mu.RUnlock()
	return errno(unix.Fsync(fd))
}

// Lock implements p9.File.Lock. It always grants the lock: the guest
// kernel tracks its own locks, and one guest is the only client.
func (f *file) Lock(pid int, locktype p9.LockType, flags p9.LockFlags, start, length uint64, client string) (p9.LockStatus, error) {
	return p9.LockStatusOK, nil
}

// dirLocked checks that f is a directory and read-locks it for a
// creation in it. The caller must RUnlock.
func (f *file) dirLocked(name string, op string) error {
	if f.s.ro {
		return linux.EROFS
	}
	if err := checkName(name); err != nil {
		return f.s.deny(err.(linux.Errno), op, "name", name)
	}
	if f.typ != unix.S_IFDIR {
		return linux.ENOTDIR
	}
	return f.rlock()
}

// Create implements p9.File.Create: a new regular file (never an existing
// one, never through a symlink), opened as flags say.
func (f *file) Create(name string, flags p9.OpenFlags, perm p9.FileMode, uid p9.UID, gid p9.GID) (p9.File, p9.QID, uint32, error) {
	fl, err := hostOpenFlags(flags)
	if err != nil {
		return nil, p9.QID{}, 0, err
	}
	if err := f.dirLocked(name, "create"); err != nil {
		return nil, p9.QID{}, 0, err
	}
	defer f.mu.RUnlock()

	mode := safeMode(perm)
	fl = fl&^unix.O_TRUNC | unix.O_CREAT | unix.O_EXCL
	if err := f.s.charge(1); err != nil {
		return nil, p9.QID{}, 0, f.s.deny(linux.ENFILE, "create", "held", f.s.fds.Load())
	}
	var ofd int
	err = f.s.charged("create", func(tx QuotaTx) error {
		if err := room(tx, quotaBlock+entryRoom); err != nil {
			return err
		}
		m := markDir(tx, f.fd)
		var err error
		if ofd, err = f.s.openat(f.fd, name, fl, mode); err != nil {
			return errno(err)
		}
		m.charge(tx)
		if tx != nil {
			tx.Charge(quotaBlock) // an empty file: the inode
		}
		return nil
	})
	if err != nil {
		f.s.release(1)
		return nil, p9.QID{}, 0, err
	}
	// Apply the mode exactly, whatever the VMM's umask.
	if err := unix.Fchmod(ofd, mode); err != nil {
		f.s.log.Debug("chmod of new file failed", "name", name, "err", err)
	}
	nf, qid, err := f.s.adopt(ofd, fl, uid, gid)
	if err != nil {
		return nil, p9.QID{}, 0, err
	}
	return nf, qid, 0, nil
}

// Tmpfile makes an unnamed regular file in directory f (open(2)'s
// O_TMPFILE), opened as flags say (read and write, or write only); Link
// gives it a name later. 9P has no way to ask for it; a FUSE client
// (package fusefs) does. A share with a quota refuses it (EOPNOTSUPP): an
// inode with no name would be charged to no entry.
func (f *file) Tmpfile(flags p9.OpenFlags, perm p9.FileMode, uid p9.UID, gid p9.GID) (p9.File, p9.QID, error) {
	fl, err := hostOpenFlags(flags)
	switch {
	case err != nil:
		return nil, p9.QID{}, err
	case f.s.quota != nil:
		return nil, p9.QID{}, linux.EOPNOTSUPP
	case fl&unix.O_ACCMODE == unix.O_RDONLY:
		return nil, p9.QID{}, linux.EINVAL
	}
	switch {
	case f.s.ro:
		return nil, p9.QID{}, linux.EROFS
	case f.typ != unix.S_IFDIR:
		return nil, p9.QID{}, linux.ENOTDIR
	}
	if err := f.rlock(); err != nil {
		return nil, p9.QID{}, err
	}
	defer f.mu.RUnlock()
	mode := safeMode(perm)
	if err := f.s.charge(1); err != nil {
		return nil, p9.QID{}, f.s.deny(linux.ENFILE, "tmpfile", "held", f.s.fds.Load())
	}
	// "." of the pinned directory: the directory itself, no name
	// resolved.
	ofd, err := unix.Openat(f.fd, ".", fl&^(unix.O_TRUNC|unix.O_CREAT|unix.O_EXCL)|unix.O_TMPFILE|unix.O_CLOEXEC, mode)
	if err != nil {
		f.s.release(1)
		return nil, p9.QID{}, errno(err)
	}
	if err := unix.Fchmod(ofd, mode); err != nil {
		f.s.log.Debug("chmod of new tmpfile failed", "err", err)
	}
	nf, qid, err := f.s.adopt(ofd, fl, uid, gid)
	if err != nil {
		return nil, p9.QID{}, err
	}
	return nf, qid, nil
}

// adopt makes the new file ofd, just created open with flags fl, a File
// owned as uid and gid asked, pinned by its own O_PATH descriptor. ofd
// counts against the budget already; on error it is closed and released.
func (s *share) adopt(ofd, fl int, uid p9.UID, gid p9.GID) (*file, p9.QID, error) {
	fail := func(err error) (*file, p9.QID, error) {
		unix.Close(ofd)
		s.release(1)
		return nil, p9.QID{}, err
	}
	pfd, err := reopen(ofd, unix.O_PATH)
	if err != nil {
		return fail(errno(err))
	}
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		unix.Close(pfd)
		return fail(errno(err))
	}
	nf, err := newFile(s, pfd, st.Mode, st.Ino)
	if err != nil {
		return fail(err)
	}
	s.own(pfd, &st, uid, gid)
	nf.ofd = ofd
	nf.owrite = fl&unix.O_ACCMODE != unix.O_RDONLY
	nf.oappend = fl&unix.O_APPEND != 0
	return nf, s.qid(&st), nil
}

// finishNode applies mode exactly to the entry name just made in f, gives
// it the owner its creator asked for (share.own), and returns its QID.
// The entry is looked up without following symlinks and must have type
// typ, so a racing replacement is never changed.
func (f *file) finishNode(name string, typ, mode uint32, uid p9.UID, gid p9.GID) (p9.QID, error) {
	fd, err := f.s.openat(f.fd, name, unix.O_PATH, 0)
	if err != nil {
		return p9.QID{}, errno(err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return p9.QID{}, errno(err)
	}
	if st.Mode&unix.S_IFMT != typ {
		return p9.QID{}, linux.EEXIST
	}
	if st.Mode&07777 != mode {
		if err := unix.Chmod(procPath(fd), mode); err != nil {
			f.s.log.Debug("chmod of new node failed", "name", name, "err", err)
		} else if err := unix.Fstat(fd, &st); err != nil {
			return p9.QID{}, errno(err)
		}
	}
	f.s.own(fd, &st, uid, gid)
	return f.s.qid(&st), nil
}

// Mkdir implements p9.File.Mkdir.
func (f *file) Mkdir(name string, perm p9.FileMode, uid p9.UID, gid p9.GID) (p9.QID, error) {
	if err := f.dirLocked(name, "mkdir"); err != nil {
		return p9.QID{}, err
	}
	defer f.mu.RUnlock()
	mode := dirMode(perm)
	if err := f.makeNode("mkdir", name, 2*quotaBlock, func() error { return unix.Mkdirat(f.fd, name, mode) }); err != nil {
		return p9.QID{}, err
	}
	return f.finishNode(name, unix.S_IFDIR, mode, uid, gid)
}

// Symlink implements p9.File.Symlink: newName becomes a symlink whose text
// is target. The text is stored as is and never followed by the server.
func (f *file) Symlink(target, newName string, _ p9.UID, _ p9.GID) (p9.QID, error) {
	if err := f.dirLocked(newName, "symlink"); err != nil {
		return p9.QID{}, err
	}
	defer f.mu.RUnlock()
	switch {
	case target == "", strings.IndexByte(target, 0) >= 0:
		return p9.QID{}, linux.EINVAL
	case len(target) > symlinkMax:
		return p9.QID{}, linux.ENAMETOOLONG
	}
	if err := f.makeNode("symlink", newName, quotaBlock, func() error { return unix.Symlinkat(target, f.fd, newName) }); err != nil {
		return p9.QID{}, err
	}
	var st unix.Stat_t
	if err := unix.Fstatat(f.fd, newName, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return p9.QID{}, errno(err)
	}
	return f.s.qid(&st), nil
}

// Link implements p9.File.Link: newName in f becomes a hard link to the
// inode target pins (a symlink links the symlink, not its target). target
// must belong to the same share.
func (f *file) Link(target p9.File, newName string) error {
	if err := f.dirLocked(newName, "link"); err != nil {
		return err
	}
	f.mu.RUnlock() // rlock2 takes both in order
	t, unlock, err := f.rlock2(target)
	if err != nil {
		return err
	}
	defer unlock()
	if t.typ == unix.S_IFDIR {
		return linux.EPERM
	}
	// linkat with AT_SYMLINK_FOLLOW on the magic link links the inode
	// itself and, unlike AT_EMPTY_PATH, needs no CAP_DAC_READ_SEARCH.
	// With a quota it runs under its lock even though the inode costs
	// nothing more: an unlink elsewhere must see the link count it leaves.
	return f.s.charged("link", func(tx QuotaTx) error {
		if err := room(tx, entryRoom); err != nil {
			return err
		}
		m := markDir(tx, f.fd)
		if err := unix.Linkat(unix.AT_FDCWD, procPath(t.fd), f.fd, newName, unix.AT_SYMLINK_FOLLOW); err != nil {
			return errno(err)
		}
		m.charge(tx)
		return nil
	})
}

// makeNode runs mk, which makes the entry name in directory f, charging
// the new inode (size bytes of room needed for it) and the directory's
// growth. f must be read-locked.
func (f *file) makeNode(op, name string, size int64, mk func() error) error {
	return f.s.charged(op, func(tx QuotaTx) error {
		if err := room(tx, size+entryRoom); err != nil {
			return err
		}
		m := markDir(tx, f.fd)
		if err := mk(); err != nil {
			return errno(err)
		}
		m.charge(tx)
		chargeNew(tx, f.fd, name)
		return nil
	})
}

// Mknod implements p9.File.Mknod for regular files, fifos and sockets;
// device nodes fail with EPERM.
func (f *file) Mknod(name string, mode p9.FileMode, _, _ uint32, uid p9.UID, gid p9.GID) (p9.QID, error) {
	var typ uint32
	switch mode.FileType() {
	case 0, p9.ModeRegular:
		typ = unix.S_IFREG
	case p9.ModeNamedPipe:
		typ = unix.S_IFIFO
	case p9.ModeSocket:
		typ = unix.S_IFSOCK
	case p9.ModeCharacterDevice, p9.ModeBlockDevice:
		if f.s.ro {
			return p9.QID{}, linux.EROFS
		}
		return p9.QID{}, f.s.deny(linux.EPERM, "mknod", "name", name, "mode", uint32(mode))
	default:
		return p9.QID{}, linux.EINVAL
	}
	if err := f.dirLocked(name, "mknod"); err != nil {
		return p9.QID{}, err
	}
	defer f.mu.RUnlock()
	perm := safeMode(mode)
	if err := f.makeNode("mknod", name, quotaBlock, func() error { return unix.Mknodat(f.fd, name, typ|perm, 0) }); err != nil {
		return p9.QID{}, err
	}
	return f.finishNode(name, typ, perm, uid, gid)
}

// Rename implements p9.File.Rename (Trename). Linux's client renames with
// Trenameat, and a File does not know its own name, so this is ENOSYS.
func (f *file) Rename(p9.File, string) error {
	return linux.ENOSYS
}

// RenameAt implements p9.File.RenameAt. Both directories must be Files of
// this share; renameat(2) never follows a symlink in the final component,
// so renaming over a symlink replaces the symlink.
func (f *file) RenameAt(oldName string, newDir p9.File, newName string) error {
	return f.RenameAtFlags(oldName, newDir, newName, 0)
}

// RenameAtFlags is RenameAt with renameat2(2)'s flags: RENAME_NOREPLACE
// (fail with EEXIST where newName exists) and RENAME_EXCHANGE (swap the
// two entries, which must both exist). 9P has no way to send them; a
// FUSE client (package fusefs) does. Other flags fail with EINVAL.
func (f *file) RenameAtFlags(oldName string, newDir p9.File, newName string, flags uint32) error {
	const known = unix.RENAME_NOREPLACE | unix.RENAME_EXCHANGE
	if flags&^known != 0 || flags == known {
		return linux.EINVAL
	}
	exchange := flags&unix.RENAME_EXCHANGE != 0
	if err := f.dirLocked(oldName, "rename"); err != nil {
		return err
	}
	f.mu.RUnlock()
	if err := checkName(newName); err != nil {
		return f.s.deny(err.(linux.Errno), "rename", "name", newName)
	}
	nd, unlock, err := f.rlock2(newDir)
	if err != nil {
		return err
	}
	defer unlock()
	if nd.typ != unix.S_IFDIR {
		return linux.ENOTDIR
	}
	return f.s.charged("rename", func(tx QuotaTx) error {
		var src, dst unix.Stat_t
		replaces := false
		if tx != nil {
			if err := unix.Fstatat(f.fd, oldName, &src, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return errno(err)
			}
			// Replacing an entry reuses it; a new name may need room.
			// An exchange adds and drops no entry.
			replaces = unix.Fstatat(nd.fd, newName, &dst, unix.AT_SYMLINK_NOFOLLOW) == nil
			if !replaces && !exchange {
				if err := room(tx, entryRoom); err != nil {
					return err
				}
			}
		}
		from, to := markDir(tx, f.fd), markDir(tx, nd.fd)
		if err := unix.Renameat2(f.fd, oldName, nd.fd, newName, uint(flags)); err != nil {
			return errno(err)
		}
		from.charge(tx)
		if to.ino != from.ino {
			to.charge(tx)
		}
		// Renaming onto another link of the same inode changes nothing.
		if replaces && !exchange && (dst.Ino != src.Ino || dst.Dev != src.Dev) {
			f.s.dropLink(tx, &dst)
		}
		return nil
	})
}

// UnlinkAt implements p9.File.UnlinkAt; flags may hold AT_REMOVEDIR.
func (f *file) UnlinkAt(name string, flags uint32) error {
	if err := f.dirLocked(name, "unlink"); err != nil {
		return err
	}
	defer f.mu.RUnlock()
	return f.s.charged("unlink", func(tx QuotaTx) error {
		var st unix.Stat_t
		if tx != nil {
			if err := unix.Fstatat(f.fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return errno(err)
			}
		}
		m := markDir(tx, f.fd)
		if err := unix.Unlinkat(f.fd, name, int(flags&unix.AT_REMOVEDIR)); err != nil {
			return errno(err)
		}
		m.charge(tx)
		f.s.dropLink(tx, &st)
		return nil
	})
}

// Readdir implements p9.File.Readdir. offset is a cookie from a previous
// entry's Offset (0 for the start); count is the reply's byte budget.
func (f *file) Readdir(offset uint64, count uint32) (p9.Dirents, error) {
	if f.typ != unix.S_IFDIR {
		return nil, linux.ENOTDIR
	}
	if offset > math.MaxInt64 {
		return nil, linux.EINVAL
	}
	fd, err := f.openFD()
	if err != nil {
		return nil, err
	}
	defer f.mu.RUnlock()
	f.dirMu.Lock()
	defer f.dirMu.Unlock()

	var self unix.Stat_t
	if err := unix.Fstat(fd, &self); err != nil {
		return nil, errno(err)
	}
	isRoot := self.Dev == f.s.rootDev && self.Ino == f.s.rootIno
	if _, err := unix.Seek(fd, int64(offset), unix.SEEK_SET); err != nil {
		return nil, errno(err)
	}

	ents := p9.Dirents{}
	size := 0
	buf := make([]byte, 32<<10)
	for size < int(count) {
		n, err := unix.Getdents(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, errno(err)
		}
		if n <= 0 {
			break
		}
		for b := buf[:n]; len(b) >= 19 && size < int(count); {
			// struct linux_dirent64: ino u64, off s64, reclen u16,
			// type u8, name NUL-terminated.
			ino := binary.NativeEndian.Uint64(b[0:])
			off := binary.NativeEndian.Uint64(b[8:])
			reclen := int(binary.NativeEndian.Uint16(b[16:]))
			typ := b[18]
			if reclen < 19 || reclen > len(b) {
				return nil, linux.EIO
			}
			name := b[19:reclen]
			if i := indexNUL(name); i >= 0 {
				name = name[:i]
			}
			b = b[reclen:]
			d := f.dirent(fd, &self, isRoot, string(name), ino, typ)
			d.Offset = off
			ents = append(ents, d)
			size += 24 + len(d.Name) // qid[13] offset[8] type[1] name[s]
		}
	}
	return ents, nil
}

func indexNUL(b []byte) int {
	for i, c := range b {
		if c == 0 {
			return i
		}
	}
	return -1
}

// dirent builds the entry for name in directory fd (stat'ed as self).
// "." and ".." are not looked up; at the share root ".." is the root
// itself, so the host's parent is not described.
func (f *file) dirent(fd int, self *unix.Stat_t, isRoot bool, name string, ino uint64, typ uint8) p9.Dirent {
	switch name {
	case ".":
		return p9.Dirent{Name: name, QID: f.s.qid(self), Type: unix.DT_DIR}
	case "..":
		if isRoot {
			return p9.Dirent{Name: name, QID: f.s.qid(self), Type: unix.DT_DIR}
		}
		return p9.Dirent{Name: name, QID: p9.QID{Type: p9.TypeDir, Path: f.s.qidPath(self.Dev, ino)}, Type: unix.DT_DIR}
	}
	var st unix.Stat_t
	if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		return p9.Dirent{Name: name, QID: f.s.qid(&st), Type: p9.QIDType(dtype(st.Mode))}
	}
	// Gone since getdents: describe it from the entry itself.
	return p9.Dirent{Name: name, QID: p9.QID{Type: qidTypeOfDT(typ), Path: f.s.qidPath(self.Dev, ino)}, Type: p9.QIDType(typ)}
}

// Readlink implements p9.File.Readlink.
func (f *file) Readlink() (string, error) {
	if f.typ != unix.S_IFLNK {
		return "", linux.EINVAL
	}
	if err := f.rlock(); err != nil {
		return "", err
	}
	defer f.mu.RUnlock()
	buf := make([]byte, symlinkMax+1)
	n, err := unix.Readlinkat(f.fd, "", buf)
	if err != nil {
		return "", errno(err)
	}
	if n > symlinkMax {
		return "", linux.ENAMETOOLONG
	}
	return string(buf[:n]), nil
}

// Renamed implements p9.File.Renamed. A File is a descriptor, not a
// path, so there is nothing to update.
func (f *file) Renamed(p9.File, string) {}
