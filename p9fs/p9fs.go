// Package p9fs serves one host directory to an untrusted guest as a
// 9P2000.L file tree: New returns a p9.Attacher (github.com/hugelgupf/p9's
// File interface), which package p9server serves, and every fid the guest
// holds is a File of this package.
//
// # Confinement
//
// The guest is hostile, so the server never resolves a path. Every File
// holds an O_PATH descriptor for exactly one inode, obtained from its
// parent directory's descriptor by a single-component lookup that never
// follows a symlink:
//
//   - Names are checked before any syscall: "", "." and "..", and names
//     containing "/" or NUL are refused (see Names below), so a lookup is
//     always one directory entry of one directory.
//   - Lookups and creations use openat2(2) with RESOLVE_BENEATH,
//     RESOLVE_NO_SYMLINKS and RESOLVE_NO_MAGICLINKS plus O_NOFOLLOW (or
//     openat(2) with O_NOFOLLOW where openat2 is unavailable, which for a
//     single component is equivalent). Walking onto a symlink yields a
//     File for the symlink itself; walking through it fails with ENOTDIR
//     because a symlink's descriptor is not a directory.
//   - Every other operation is an *at(2) call on the File's own
//     descriptor with one checked name (mkdirat, symlinkat, mknodat,
//     renameat, unlinkat, fstatat with AT_SYMLINK_NOFOLLOW) or acts on the
//     inode the descriptor pins. Where Linux has no call that takes an
//     O_PATH descriptor (open for I/O, chmod, truncate, xattrs, link) the
//     server goes through /proc/self/fd/N: that magic link resolves to
//     exactly the pinned inode and is never followed further, so it cannot
//     reach any other file. Inode types never change, so the checks that
//     refuse these on symlinks cannot race.
//   - Because a File is a descriptor, not a path, a rename anywhere in the
//     tree (by the guest or the host) cannot redirect it: a File renamed
//     over, or a directory replaced by a symlink, leaves existing Files on
//     the inodes they had and new lookups find the symlink, not its target.
//
// Consequently a symlink (whether the guest made it or it was planted on
// the host) is data: Symlink creates one and Readlink returns its text, but
// no operation of this package follows one. Opening a symlink for I/O
// fails with ELOOP; the guest kernel follows guest symlinks itself, inside
// its own view of the mount.
//
// Hard links and renames stay inside the share because both ends are
// Files of the same share (otherwise EXDEV). Linking a symlink links the
// symlink inode, not its target.
//
// # Why not p9's fsimpl/localfs
//
// localfs keeps a host path per fid and calls os.OpenFile, os.Truncate,
// os.Rename, setxattr(2) and friends on path.Join(parent, name). Those
// follow symlinks in every component, so a guest-made symlink to "/" or
// "../.." takes the guest out of the share, and a rename between a check
// and a use redirects it. It also calls umask(0) for the whole process,
// sets xattrs in any namespace (security.capability included), has no
// read-only mode, and returns unix.Errno values, which p9 rewrites (EPERM
// becomes EACCES, ENOTEMPTY becomes EEXIST). This package shares only
// the p9 protocol types with it.
//
// # Names
//
// Every name the guest sends (walk components, create, mkdir, symlink,
// link, mknod, rename and unlink names) must be one directory entry: an
// empty name or one containing "/" or NUL fails with EINVAL, "." and ".."
// fail with EPERM (the server never resolves "..": the guest kernel
// handles ".." from its own dentry cache, so walking ".." from the root,
// or from anywhere, is refused rather than answered), and names longer
// than 255 bytes fail with ENAMETOOLONG.
//
// # Host safety
//
// Modes the guest creates or sets lose their setuid and setgid bits
// (a directory keeps its setgid bit, which only gives its group to what is
// made in it);
// modes are applied exactly (the VMM's umask is not consulted and not
// changed). Device nodes cannot be made (EPERM); fifos and sockets can,
// but the server never opens anything other than regular files and
// directories. Only the "user." extended attribute namespace is visible
// and writable. With Options.ReadOnly every mutation fails with EROFS
// here, whatever the guest's mount options say.
//
// # Quotas
//
// With Options.Quota every operation that changes how much space the tree
// takes is charged to it and refused with ENOSPC past it, also when other
// shares (in other processes) charge the same budget at once; see Quota
// for the rule. Package volume provides the budget for named volumes. The
// budget never sees a path from the guest: it is told sizes and inode
// numbers that the share got from its descriptors.
//
// # Ownership
//
// Files owned by the VMM's effective uid (gid) are shown to the guest as
// Options.UID (Options.GID); others are shown with their host ids. Files
// the guest creates belong to the VMM's user on the host. A chown that
// would change nothing visible (the requested id is the mapped id or the
// one already shown) succeeds without doing anything; any other fails with
// EPERM.
//
// # Other details
//
// QIDs are built from (st_dev, st_ino): inodes of the share root's device
// with numbers below 2^48 use the inode number as the QID path; others get
// a per-share 16-bit prefix per (device, high inode bits). The QID version
// is always 0. Readdir offsets are the host file system's directory
// cookies (what getdents64 reports in d_off), so they stay valid across
// calls and fids (and, on file systems with stable cookies such as ext4,
// xfs, btrfs and tmpfs, across entries being added or removed);
// Dirent.Type carries the Linux d_type (DT_*), which is what Linux's v9fs
// client passes on, not a QID type. The root's ".." entry describes the
// root itself. Lock always succeeds (the guest kernel keeps its own lock
// state).
//
// Each File holds one host descriptor, two once opened, released by
// Close. The guest decides how many Files exist, so all shares of the
// process together hold at most half of RLIMIT_NOFILE (as it is when the
// first File is made); past that, walks, opens and creates fail with
// ENFILE rather than starve the rest of the VMM of descriptors.
//
// The package needs Linux and a mounted /proc.
package p9fs

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// Options configures a share.
type Options struct {
	// ReadOnly makes every mutation fail with EROFS, enforced on the
	// host whatever the guest mounts.
	ReadOnly bool
	// UID and GID are the ids the guest sees for files owned by the
	// VMM's own effective uid and gid (zero: guest root). Files with
	// other owners are shown with their host ids.
	UID, GID uint32
	// MaxFDs is how many host descriptors this share's Files may hold at
	// once (0: DefaultMaxFDs); past it the guest gets ENFILE. All shares
	// of the process together also hold at most half its RLIMIT_NOFILE.
	MaxFDs int
	// Logger receives debug records of refused guest requests and
	// warnings about the host. Nil discards them.
	Logger *slog.Logger
	// Quota, when not nil, is the space budget the share's files are
	// charged to (see Quota); past it the guest gets ENOSPC.
	Quota Quota
}

// share is the Attacher: one pinned root directory and what every File of
// it needs.
type share struct {
	ro               bool
	uid, gid         uint32 // what the guest sees for the VMM's own files
	hostUID, hostGID uint32 // the VMM's effective ids
	log              *slog.Logger
	useOpenat2       bool
	rootDev, rootIno uint64
	maxFDs           int64
	fds              atomic.Int64 // descriptors held by this share's Files

	mu      sync.Mutex
	rootFD  int // O_PATH directory; -1 after Close
	cleanup runtime.Cleanup

	qmu     sync.Mutex
	qidPfx  map[qidKey]uint64 // (dev, ino>>48) -> QID path prefix
	pfxFull bool              // logged once when prefixes run out

	quota Quota           // nil: no accounting
	pinMu sync.Mutex      // guards pins; taken inside an Update, never around one
	pins  map[uint64]*pin // with a quota: the inodes this share's Files hold

	owners ownerCache // the owners of files the VMM may not read (owner.go)
}

// New returns an Attacher serving the directory root, which must exist and
// be a directory (a symlink to one is resolved once, here). The directory
// is pinned by a descriptor: renaming or replacing root on the host later
// does not change what the guest sees.
//
// The returned Attacher also implements io.Closer, which releases that
// descriptor; Files already attached keep working. Without Close it is
// released when the Attacher and all its Files are garbage.
func New(root string, o Options) (p9.Attacher, error) {
	if root == "" {
		return nil, errors.New("p9fs: share root is empty")
	}
	fd, st, err := pinRoot(root)
	if err != nil {
		return nil, err
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs("/proc/self/fd", &sfs); err != nil || sfs.Type != unix.PROC_SUPER_MAGIC {
		unix.Close(fd)
		return nil, fmt.Errorf("p9fs: share root %q: /proc is not mounted (needed to reopen files by descriptor)", root)
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &share{
		ro:      o.ReadOnly,
		uid:     o.UID,
		gid:     o.GID,
		hostUID: uint32(os.Geteuid()),
		hostGID: uint32(os.Getegid()),
		log:     log.With("p9fs", root),
		rootFD:  fd,
		rootDev: st.Dev,
		rootIno: st.Ino,
		qidPfx:  make(map[qidKey]uint64),
		maxFDs:  DefaultMaxFDs,
		quota:   o.Quota,
		pins:    make(map[uint64]*pin),
	}
	if o.MaxFDs > 0 {
		s.maxFDs = int64(o.MaxFDs)
	}
	s.useOpenat2 = probeOpenat2(fd)
	if !s.useOpenat2 {
		s.log.Debug("openat2 unavailable; using openat with O_NOFOLLOW")
	}
	s.cleanup = runtime.AddCleanup(s, func(fd int) { unix.Close(fd) }, fd)
	return s, nil
}

// pinRoot opens the directory root as a share's pinned root (O_PATH) and
// returns it with its attributes (New, Reopen).
func pinRoot(root string) (int, unix.Stat_t, error) {
	var st unix.Stat_t
	fd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		switch err {
		case unix.ENOENT:
			return -1, st, fmt.Errorf("p9fs: share root %q does not exist", root)
		case unix.ENOTDIR:
			return -1, st, fmt.Errorf("p9fs: share root %q is not a directory", root)
		}
		return -1, st, fmt.Errorf("p9fs: share root %q: %w", root, err)
	}
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, st, fmt.Errorf("p9fs: share root %q: %w", root, err)
	}
	return fd, st, nil
}

// Attach implements p9.Attacher: a new File for the share root.
func (s *share) Attach() (p9.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rootFD < 0 {
		return nil, linux.EBADF
	}
	fd, err := dupFD(s.rootFD)
	if err != nil {
		return nil, errno(err)
	}
	return newFile(s, fd, unix.S_IFDIR, s.rootIno)
}

// Reopen pins the share's root again by its path as the process now
// resolves it, which must still be the same directory (device and inode):
// for a process that moved into a jail whose bind of the directory takes
// the mounts the host makes beneath it later, where the descriptor pinned
// before lies in the mount tree it left, which takes none. Files already
// attached keep the old root; call it before the guest attaches.
func (s *share) Reopen(root string) error {
	fd, st, err := pinRoot(root)
	if err != nil {
		return fmt.Errorf("p9fs: reopen: %w", err)
	}
	if st.Dev != s.rootDev || st.Ino != s.rootIno {
		unix.Close(fd)
		return fmt.Errorf("p9fs: reopen share root %q: it is another directory now (device %d inode %d, not %d %d)", root, st.Dev, st.Ino, s.rootDev, s.rootIno)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rootFD < 0 {
		unix.Close(fd)
		return linux.EBADF
	}
	s.cleanup.Stop()
	unix.Close(s.rootFD)
	s.rootFD = fd
	s.cleanup = runtime.AddCleanup(s, func(fd int) { unix.Close(fd) }, fd)
	return nil
}

// Close releases the root descriptor; later Attach calls fail with EBADF.
func (s *share) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rootFD < 0 {
		return nil
	}
	s.cleanup.Stop()
	err := unix.Close(s.rootFD)
	s.rootFD = -1
	return err
}

// guestUID is the uid the guest sees for a host uid.
func (s *share) guestUID(host uint32) uint32 {
	if host == s.hostUID {
		return s.uid
	}
	return host
}

// guestGID is the gid the guest sees for a host gid.
func (s *share) guestGID(host uint32) uint32 {
	if host == s.hostGID {
		return s.gid
	}
	return host
}

// deny logs a refused guest request at debug level and returns e.
func (s *share) deny(e linux.Errno, op string, args ...any) error {
	s.log.Debug("refused", append([]any{"op", op, "err", e.Error()}, args...)...)
	return e
}
