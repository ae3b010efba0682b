package p9fs

import (
	"math"
	"strings"

	"github.com/hugelgupf/p9/linux"
	"golang.org/x/sys/unix"
)

// Quota is a space budget that a share's files are charged to
// (Options.Quota), possibly shared with other shares of the same tree in
// this process and in others (package volume implements it for named
// volumes). The share calls it around every operation that changes how
// much space the tree takes, so that nothing past the budget reaches the
// host's disk:
//
//   - What counts is Charge of every inode in the tree (the root
//     included): 4 KiB per inode plus, for regular files and directories,
//     the apparent size rounded up to 4 KiB.
//   - A write, a truncation (SetAttr, Open with O_TRUNC), a creation (file,
//     directory, symlink, node, hard link), a rename and an unlink each run
//     in one Update: the share looks at the sizes involved, refuses with
//     ENOSPC what would pass the budget before doing anything, does the
//     operation and charges what really changed (a directory that grew
//     or shrank included). A write or truncation is refused whole when
//     its end would pass the budget (no short writes). A creation needs
//     4 KiB for the inode (8 KiB for a directory) plus two directory
//     blocks of room for its parent to grow, a hard link or a rename to
//     a new name the two blocks; the charge is then what really changed.
//   - An inode is freed when its last link goes, unless some share (here
//     or in another process) still holds a File on it: the guest may go
//     on using a file it has open after unlinking it, and its data stays
//     on the host's disk until then. Each share tells the Quota which
//     inodes it holds (Hold, Release), so the last share to let go of a
//     dead inode frees it. A directory's size drops to zero when it is
//     removed, so a removed directory that is still held has its charge
//     remembered (QuotaTx.Remember) for that last share.
//   - User extended attributes are bounded to 4 KiB per inode on a share
//     with a quota, inside the inode's own 4 KiB.
//
// A read-only share calls Hold and Release only: what it holds is still
// on the disk.
type Quota interface {
	// Update calls fn with the budget locked against every other user
	// of it, in this process and others, and records what fn charged,
	// also when fn fails. It returns fn's error, or its own when it
	// cannot lock or record the budget.
	Update(fn func(tx QuotaTx) error) error
	// Hold records that this share holds a File on inode ino (it had
	// none); Release, called inside an Update, that it no longer does.
	Hold(ino uint64) error
	Release(ino uint64) error
	// Usage reports the bytes charged and the budget (0: none, the
	// charge is only counted).
	Usage() (used, limit int64, err error)
}

// QuotaTx is the budget inside Quota.Update. Its methods do not fail:
// when the Quota cannot tell, they answer on the safe side (no room,
// held elsewhere, nothing remembered) and Update reports the error.
type QuotaTx interface {
	// Free is the budget still free (negative once charges passed it,
	// after a change on the host; math.MaxInt64 without a limit).
	Free() int64
	// Charge adds delta bytes (negative: frees them).
	Charge(delta int64)
	// HeldElsewhere reports whether another share holds a File on ino.
	HeldElsewhere(ino uint64) bool
	// Remember keeps charge for the removed directory ino that some
	// share still holds; Recall returns it, and forgets it.
	Remember(ino uint64, charge int64)
	Recall(ino uint64) (charge int64, ok bool)
}

const (
	// quotaBlock is the unit sizes are rounded up to, and what an inode
	// costs by itself.
	quotaBlock = 4096
	// entryRoom is the room a new directory entry needs: its directory
	// may grow by a block, and by another for an index.
	entryRoom = 2 * quotaBlock
	// xattrQuota bounds the user extended attributes of one inode (names
	// and values) on a share with a quota.
	xattrQuota = quotaBlock
)

// Charge is what an inode costs against a Quota: 4 KiB for the inode
// itself (its metadata, a symlink's text, a small extended attribute
// block) plus, for a regular file or a directory, its apparent size
// rounded up to 4 KiB. Counting the apparent size rather than allocated
// blocks makes a sparse file count in full (safe, whatever the guest
// does with holes) and keeps the charge a function of what the share
// did: the host's file system may allocate later, but sizes change only
// by the share's operations.
func Charge(st *unix.Stat_t) int64 {
	c := int64(quotaBlock)
	if t := st.Mode & unix.S_IFMT; t == unix.S_IFREG || t == unix.S_IFDIR {
		c += roundUp(st.Size)
	}
	return c
}

// roundUp rounds a size up to a whole number of blocks, saturating far
// beyond any budget.
func roundUp(n int64) int64 {
	if n <= 0 {
		return 0
	}
	if n > math.MaxInt64/2 {
		return math.MaxInt64 / 2
	}
	return (n + quotaBlock - 1) &^ (quotaBlock - 1)
}

// charged runs fn in an Update of s's Quota, or with a nil tx when s has
// none. Errors of the Quota itself reach the guest as EIO.
func (s *share) charged(op string, fn func(tx QuotaTx) error) error {
	if s.quota == nil {
		return fn(nil)
	}
	err := s.quota.Update(fn)
	if err == nil {
		return nil
	}
	if e, ok := err.(linux.Errno); ok {
		return e
	}
	s.log.Warn("quota", "op", op, "err", err)
	return linux.EIO
}

// room fails with ENOSPC unless tx has n bytes free; without a quota
// there is always room.
func room(tx QuotaTx, n int64) error {
	if tx != nil && n > 0 && n > tx.Free() {
		return linux.ENOSPC
	}
	return nil
}

// dirMark is a directory's charged size before an operation, to charge
// its growth after it.
type dirMark struct {
	fd   int
	ino  uint64
	size int64
}

// markDir notes the size of directory fd (nothing without a quota).
func markDir(tx QuotaTx, fd int) dirMark {
	if tx == nil {
		return dirMark{fd: -1}
	}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		return dirMark{fd: -1}
	}
	return dirMark{fd: fd, ino: st.Ino, size: roundUp(st.Size)}
}

// charge charges what the directory grew (or shrank) since the mark. A
// directory that cannot be stat'ed is charged an entry's room: it may
// have grown, and charging too much is the safe side.
func (m dirMark) charge(tx QuotaTx) {
	if tx == nil {
		return
	}
	var st unix.Stat_t
	if m.fd < 0 || unix.Fstat(m.fd, &st) != nil {
		tx.Charge(entryRoom)
		return
	}
	tx.Charge(roundUp(st.Size) - m.size)
}

// chargeNew charges the inode just made as name in directory dirfd (an
// entry's room for the parent when it is already gone).
func chargeNew(tx QuotaTx, dirfd int, name string) {
	if tx == nil {
		return
	}
	var st unix.Stat_t
	if unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
		tx.Charge(quotaBlock)
		return
	}
	tx.Charge(Charge(&st))
}

// pin is what a share holds of one inode: how many of its Files, and
// whether the inode had already lost its last link when the first was
// made (then whoever removed it freed it, and this share must not).
type pin struct {
	n    int
	dead bool
}

// hold records a new File on inode ino (descriptor fd) with the Quota.
func (s *share) hold(fd int, ino uint64) error {
	s.pinMu.Lock()
	defer s.pinMu.Unlock()
	if p := s.pins[ino]; p != nil {
		p.n++
		return nil
	}
	if err := s.quota.Hold(ino); err != nil {
		s.log.Warn("quota: hold", "ino", ino, "err", err)
		return linux.EIO
	}
	// Held first, looked at second: if the inode still had a link now,
	// whoever removes it later sees the hold.
	var st unix.Stat_t
	dead := unix.Fstat(fd, &st) != nil || st.Nlink == 0
	s.pins[ino] = &pin{n: 1, dead: dead}
	return nil
}

// unhold drops a File on inode ino (descriptor fd, still open). The share's
// last File on a dead inode frees it when no other share holds it either.
func (s *share) unhold(fd int, ino uint64) {
	s.pinMu.Lock()
	if p := s.pins[ino]; p != nil && p.n > 1 {
		p.n--
		s.pinMu.Unlock()
		return
	}
	s.pinMu.Unlock()
	// The last one: under the budget's lock, so that an unlink elsewhere
	// either sees this share's hold or happened before this looks.
	err := s.quota.Update(func(tx QuotaTx) error {
		s.pinMu.Lock()
		p := s.pins[ino]
		if p == nil {
			s.pinMu.Unlock()
			return nil
		}
		if p.n--; p.n > 0 {
			s.pinMu.Unlock()
			return nil
		}
		delete(s.pins, ino)
		var st unix.Stat_t
		serr := unix.Fstat(fd, &st)
		err := s.quota.Release(ino)
		s.pinMu.Unlock()
		if serr != nil || st.Nlink > 0 || p.dead || tx.HeldElsewhere(ino) {
			return err
		}
		c := Charge(&st)
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			if rc, ok := tx.Recall(ino); ok {
				c = rc
			}
		}
		tx.Charge(-c)
		return err
	})
	if err != nil {
		s.log.Warn("quota: release", "ino", ino, "err", err)
	}
}

// heldHere reports whether a File of this share holds inode ino, counting
// only holds made while the inode still had a link.
func (s *share) heldHere(ino uint64) bool {
	s.pinMu.Lock()
	defer s.pinMu.Unlock()
	p := s.pins[ino]
	return p != nil && !p.dead
}

// dropLink charges the removal of a directory entry whose inode was st
// (stat'ed before the removal): when that was its last link, the inode
// is freed, or left for the last share holding it.
func (s *share) dropLink(tx QuotaTx, st *unix.Stat_t) {
	if tx == nil {
		return
	}
	dir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	if !dir && st.Nlink > 1 {
		return
	}
	if s.heldHere(st.Ino) || tx.HeldElsewhere(st.Ino) {
		if dir {
			tx.Remember(st.Ino, Charge(st))
		}
		return
	}
	tx.Charge(-Charge(st))
}

// xattrRoom fails with ENOSPC when setting name to size bytes would take
// the user extended attributes of the inode at path (a magic link) past
// xattrQuota.
func xattrRoom(path, name string, size int) error {
	total := len(name) + size
	buf := make([]byte, xattrMax) // XATTR_LIST_MAX
	n, err := unix.Listxattr(path, buf)
	if err != nil {
		return errno(err)
	}
	for _, a := range strings.Split(string(buf[:n]), "\x00") {
		if a == name || a == ownerXattr || !strings.HasPrefix(a, xattrPrefix) {
			continue // the owner's is the share's, not the guest's
		}
		if vn, err := unix.Getxattr(path, a, nil); err == nil {
			total += len(a) + vn
		}
	}
	if total > xattrQuota {
		return linux.ENOSPC
	}
	return nil
}

// quotaStatFS makes a statfs answer describe the budget: its size, what
// is left of it (no more than the host has) and as many free inodes as
// fit in what is left.
func (s *share) quotaStatFS(blocks, bfree, bavail, ffree *uint64, bsize uint64) {
	if s.quota == nil || bsize == 0 {
		return
	}
	used, limit, err := s.quota.Usage()
	if err != nil || limit <= 0 {
		return
	}
	free := uint64(max(limit-used, 0))
	*blocks = uint64(limit) / bsize
	*bfree = min(*bfree, free/bsize)
	*bavail = min(*bavail, free/bsize)
	*ffree = min(*ffree, free/quotaBlock)
}
