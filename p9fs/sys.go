package p9fs

import (
	"errors"
	"hash/fnv"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// nameMax is the longest directory entry name (NAME_MAX).
const nameMax = 255

// symlinkMax bounds a symlink target (PATH_MAX without the NUL).
const symlinkMax = 4095

// v9fsMagic is V9FS_MAGIC, the f_type StatFS reports.
const v9fsMagic = 0x01021997

// checkName accepts only a single directory entry name; see the package
// documentation.
func checkName(name string) error {
	switch {
	case name == "", strings.ContainsAny(name, "/\x00"):
		return linux.EINVAL
	case name == ".", name == "..":
		return linux.EPERM
	case len(name) > nameMax:
		return linux.ENAMETOOLONG
	}
	return nil
}

// errno converts an error to the linux.Errno that p9 sends. unix.Errno
// must not reach p9 as is: p9 matches errors against os.ErrExist and
// friends first, which would turn EPERM into EACCES and ENOTEMPTY into
// EEXIST.
func errno(err error) error {
	if err == nil {
		return nil
	}
	var le linux.Errno
	if errors.As(err, &le) {
		return le
	}
	var ue unix.Errno
	if errors.As(err, &ue) {
		return linux.Errno(ue)
	}
	return linux.EIO
}

// The guest decides how many Files exist, and each holds host
// descriptors. Each share may hold at most its own budget (Options.MaxFDs),
// so one sandbox's shares cannot starve another's, and all shares of the
// process together at most half of its descriptor limit, so no guest
// starves the rest of the VMM: past either, the guest gets ENFILE.
var (
	processBudgetOnce sync.Once
	processBudget     int64
	processFDs        atomic.Int64
)

// DefaultMaxFDs is a share's descriptor budget when Options.MaxFDs is 0.
const DefaultMaxFDs = 16384

// charge reserves n descriptors from s's budget and the process's, or
// fails with ENFILE.
func (s *share) charge(n int64) error {
	processBudgetOnce.Do(func() {
		var r unix.Rlimit
		processBudget = 512
		if unix.Getrlimit(unix.RLIMIT_NOFILE, &r) == nil && r.Cur/2 > uint64(processBudget) {
			processBudget = int64(min(r.Cur/2, math.MaxInt32))
		}
	})
	if s.fds.Add(n) > s.maxFDs {
		s.fds.Add(-n)
		return linux.ENFILE
	}
	if processFDs.Add(n) > processBudget {
		processFDs.Add(-n)
		s.fds.Add(-n)
		return linux.ENFILE
	}
	return nil
}

// release returns n descriptors to s's budget and the process's.
func (s *share) release(n int64) {
	s.fds.Add(-n)
	processFDs.Add(-n)
}

// procPath names fd's magic link, which resolves to exactly the inode fd
// refers to and is never followed further.
func procPath(fd int) string {
	return "/proc/self/fd/" + strconv.Itoa(fd)
}

// dupFD duplicates fd with close-on-exec.
func dupFD(fd int) (int, error) {
	return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
}

// resolveFlags are the openat2 restrictions for every lookup. Names are
// single components already; these make the kernel enforce it too.
const resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// probeOpenat2 reports whether openat2 works here (it can be missing or
// filtered by seccomp).
func probeOpenat2(dirfd int) bool {
	fd, err := unix.Openat2(dirfd, ".", &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_CLOEXEC | unix.O_DIRECTORY,
		Resolve: resolveFlags,
	})
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

// openat opens the single entry name of directory dirfd without following
// a symlink. name must have passed checkName.
func (s *share) openat(dirfd int, name string, flags int, mode uint32) (int, error) {
	flags |= unix.O_NOFOLLOW | unix.O_CLOEXEC
	for {
		var fd int
		var err error
		if s.useOpenat2 {
			how := unix.OpenHow{Flags: uint64(flags), Resolve: resolveFlags}
			if flags&unix.O_CREAT != 0 {
				how.Mode = uint64(mode)
			}
			fd, err = unix.Openat2(dirfd, name, &how)
		} else {
			fd, err = unix.Openat(dirfd, name, flags, mode)
		}
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		return fd, err
	}
}

// reopen opens the inode pinned by the O_PATH descriptor fd for I/O.
func reopen(fd int, flags int) (int, error) {
	for {
		nfd, err := unix.Open(procPath(fd), flags|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
		if err == unix.EINTR {
			continue
		}
		return nfd, err
	}
}

// 9P2000.L open flags (P9_DOTL_*) that the server honours. They equal the
// Linux x86 O_* values except for the two sync flags.
const (
	dotlAccMode = 0x3
	dotlTrunc   = 01000
	dotlAppend  = 02000
	dotlDsync   = 010000
	dotlSync    = 04000000
)

// hostOpenFlags maps the honoured 9P2000.L open flags to host flags; the
// rest (O_CREAT, O_EXCL, O_NOFOLLOW, O_DIRECT, O_NOATIME, O_NONBLOCK, ...)
// are dropped. Access mode 3 is invalid.
func hostOpenFlags(f p9.OpenFlags) (int, error) {
	var fl int
	switch f & dotlAccMode {
	case p9.ReadOnly:
		fl = unix.O_RDONLY
	case p9.WriteOnly:
		fl = unix.O_WRONLY
	case p9.ReadWrite:
		fl = unix.O_RDWR
	default:
		return 0, linux.EINVAL
	}
	if f&dotlTrunc != 0 {
		fl |= unix.O_TRUNC
	}
	if f&dotlAppend != 0 {
		fl |= unix.O_APPEND
	}
	if f&dotlDsync != 0 {
		fl |= unix.O_DSYNC
	}
	if f&dotlSync != 0 {
		fl |= unix.O_SYNC
	}
	return fl, nil
}

// safeMode keeps permission bits and the sticky bit, dropping setuid,
// setgid and the file type.
func safeMode(m p9.FileMode) uint32 {
	return uint32(m) & (0777 | unix.S_ISVTX)
}

// dirMode is safeMode for a directory, which keeps its set-group-ID bit:
// its new entries take its group (and new subdirectories the bit), which
// makes nothing run as anyone.
func dirMode(m p9.FileMode) uint32 {
	return uint32(m) & (0777 | unix.S_ISVTX | unix.S_ISGID)
}

// qidKey groups inodes that share a QID path prefix.
type qidKey struct{ dev, hi uint64 }

const (
	qidInoBits = 48
	qidInoMask = 1<<qidInoBits - 1
	qidMaxPfx  = 1<<(64-qidInoBits) - 1
)

// qidPath makes a QID path unique within the share from (dev, ino).
func (s *share) qidPath(dev, ino uint64) uint64 {
	if dev == s.rootDev && ino <= qidInoMask {
		return ino
	}
	k := qidKey{dev, ino >> qidInoBits}
	s.qmu.Lock()
	defer s.qmu.Unlock()
	p, ok := s.qidPfx[k]
	if !ok {
		if len(s.qidPfx) >= qidMaxPfx {
			// 65535 devices in one share: give up on uniqueness
			// rather than fail; a collision only confuses the guest's
			// inode cache.
			if !s.pfxFull {
				s.pfxFull = true
				s.log.Warn("QID prefixes exhausted; inode numbers may collide")
			}
			h := fnv.New64a()
			var b [16]byte
			for i := range 8 {
				b[i] = byte(dev >> (8 * i))
				b[8+i] = byte(ino >> (8 * i))
			}
			h.Write(b[:])
			return h.Sum64()
		}
		p = uint64(len(s.qidPfx) + 1)
		s.qidPfx[k] = p
	}
	return p<<qidInoBits | ino&qidInoMask
}

// qid is the QID of a stat result.
func (s *share) qid(st *unix.Stat_t) p9.QID {
	q := p9.QID{
		Type: p9.FileMode(st.Mode).QIDType(),
		Path: s.qidPath(st.Dev, st.Ino),
	}
	if st.Mode&unix.S_IFMT == unix.S_IFREG {
		q.Version = contentVersion(st)
	}
	return q
}

// contentVersion is a regular file's QID version: it changes when the
// file's modification time or size does. Linux's 9P client reads through
// its page cache (the shares mount with cache=readahead) only for files
// whose version is not 0, and keeps an inode, and so its cached pages,
// only while a lookup returns the same version: a file the host changes
// gets a new inode, and the guest reads the new data, at the next open.
// A file changed twice within the host filesystem's timestamp granularity
// without a size change keeps its version; QEMU's virtfs has the same
// limit (its version is mtime ^ size << 8).
func contentVersion(st *unix.Stat_t) uint32 {
	h := fnv.New32a()
	var b [24]byte
	for i := range 8 {
		b[i] = byte(st.Mtim.Sec >> (8 * i))
		b[8+i] = byte(st.Mtim.Nsec >> (8 * i))
		b[16+i] = byte(st.Size >> (8 * i))
	}
	h.Write(b[:])
	if v := h.Sum32(); v != 0 {
		return v
	}
	return 1 // 0 means "no version": the guest would read uncached
}

// attrValid is what attr fills in, whatever was asked.
var attrValid = p9.AttrMask{
	Mode: true, NLink: true, UID: true, GID: true, RDev: true,
	ATime: true, MTime: true, CTime: true, INo: true,
	Size: true, Blocks: true,
}

// attr converts the stat result st of the file fd pins, with the owner
// the guest sees (share.shown).
func (s *share) attr(fd int, st *unix.Stat_t) p9.Attr {
	o := s.shown(fd, st)
	return p9.Attr{
		Mode:             p9.FileMode(st.Mode),
		UID:              p9.UID(o.uid),
		GID:              p9.GID(o.gid),
		NLink:            p9.NLink(st.Nlink),
		RDev:             p9.Dev(st.Rdev),
		Size:             uint64(st.Size),
		BlockSize:        uint64(st.Blksize),
		Blocks:           uint64(st.Blocks),
		ATimeSeconds:     uint64(st.Atim.Sec),
		ATimeNanoSeconds: uint64(st.Atim.Nsec),
		MTimeSeconds:     uint64(st.Mtim.Sec),
		MTimeNanoSeconds: uint64(st.Mtim.Nsec),
		CTimeSeconds:     uint64(st.Ctim.Sec),
		CTimeNanoSeconds: uint64(st.Ctim.Nsec),
	}
}

// dtype is the Linux d_type of a mode.
func dtype(mode uint32) uint8 {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return unix.DT_REG
	case unix.S_IFDIR:
		return unix.DT_DIR
	case unix.S_IFLNK:
		return unix.DT_LNK
	case unix.S_IFIFO:
		return unix.DT_FIFO
	case unix.S_IFSOCK:
		return unix.DT_SOCK
	case unix.S_IFCHR:
		return unix.DT_CHR
	case unix.S_IFBLK:
		return unix.DT_BLK
	}
	return unix.DT_UNKNOWN
}

// qidTypeOfDT is the QID type for a d_type, for entries that vanished
// before they could be stat'ed.
func qidTypeOfDT(t uint8) p9.QIDType {
	switch t {
	case unix.DT_DIR:
		return p9.TypeDir
	case unix.DT_LNK:
		return p9.TypeSymlink
	}
	return p9.TypeRegular
}
