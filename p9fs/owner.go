package p9fs

import (
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// ownerXattr is the host attribute that keeps the owner the guest gave a
// file the VMM's user owns, as "uid:gid" in decimal: the VMM, run by an
// ordinary user, cannot chown on the host, and a guest user who made a
// directory must still own it (and write in it) once it is made. QEMU's
// virtfs keeps owners the same way (security_model=mapped-xattr). The
// guest never sees the attribute, nor can set it: it is its owner's
// business only through chown.
const ownerXattr = "user.capsa.owner"

// owner is a pair of guest ids.
type owner struct{ uid, gid uint32 }

// A user attribute is read and written under the file's permission bits,
// which bind its owner too: a VMM run by an ordinary user (no
// CAP_FOWNER) reads the owner of a file whose mode gives it no read
// permission only through ownerCache, and writes it by lending itself the
// permission for that one call (ownerAccess).

// ownerCache remembers, for a file whose owner attribute the VMM may not
// read, the owner and the file's ctime once it lost the right (written
// with the permission lent, or chmod'ed through the share), so the owner
// stays shown. Any other change of the inode (the host's, or the inode
// reused) changes its ctime and the entry no longer counts.
type ownerCache struct {
	mu sync.Mutex
	m  map[qidKey]ownerEntry
}

type ownerEntry struct {
	o     owner
	ctime unix.Timespec
}

// maxOwnerCache bounds the cache; past it, it starts again empty.
const maxOwnerCache = 1 << 16

func (c *ownerCache) put(st *unix.Stat_t, o owner) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= maxOwnerCache {
		c.m = map[qidKey]ownerEntry{}
	}
	c.m[qidKey{dev: st.Dev, hi: st.Ino}] = ownerEntry{o, st.Ctim}
}

func (c *ownerCache) get(st *unix.Stat_t) (owner, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[qidKey{dev: st.Dev, hi: st.Ino}]
	return e.o, ok && e.ctime == st.Ctim
}

// ownerAccess runs fn, which reads or writes the owner attribute of the
// file fd pins (stat st), with the VMM given the read and write
// permission that needs: a mode without them is widened for the call and
// set back after. Root needs none of it.
func (s *share) ownerAccess(fd int, st *unix.Stat_t, fn func() error) error {
	need := uint32(0o600)
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		need = 0o700
	}
	mode := st.Mode & 0o7777
	if s.hostUID == 0 || mode&need == need {
		return fn()
	}
	p := procPath(fd)
	if err := unix.Chmod(p, mode|need); err != nil {
		return err
	}
	err := fn()
	if cerr := unix.Chmod(p, mode); cerr != nil {
		s.log.Warn("p9fs: a file's mode is not set back after its owner was written", "mode", fmt.Sprintf("%o", mode), "err", cerr)
	}
	return err
}

// ownable reports whether a file of type typ can hold ownerXattr: user
// attributes exist only on regular files and directories.
func ownable(typ uint32) bool {
	return typ&unix.S_IFMT == unix.S_IFREG || typ&unix.S_IFMT == unix.S_IFDIR
}

// keeps reports whether a file of host stat st can have an owner of the
// guest's: the VMM's user owns it and it can hold ownerXattr.
func (s *share) keeps(st *unix.Stat_t) bool {
	return st.Uid == s.hostUID && ownable(st.Mode)
}

// unreadable reports whether the VMM may not read the owner attribute of
// a file of mode mode (no read permission, and not root): ownerCache
// holds its owner then.
func (s *share) unreadable(mode uint32) bool {
	return s.hostUID != 0 && mode&0o400 == 0
}

// mapped is the owner the guest sees for a host stat with no ownerXattr.
func (s *share) mapped(st *unix.Stat_t) owner {
	return owner{s.guestUID(st.Uid), s.guestGID(st.Gid)}
}

// shown is the owner the guest sees for the file fd pins, with stat st:
// its ownerXattr where the VMM's user owns it and the attribute is
// well-formed, else the mapped ids.
func (s *share) shown(fd int, st *unix.Stat_t) owner {
	o := s.mapped(st)
	if !s.keeps(st) {
		return o
	}
	var buf [24]byte
	n, err := unix.Getxattr(procPath(fd), ownerXattr, buf[:])
	if err == unix.EACCES {
		if x, ok := s.owners.get(st); ok {
			return x // kept from before the VMM lost the right to read it
		}
	}
	if err != nil || n > len(buf) {
		return o // none, none possible here, or not one of ours
	}
	if x, ok := parseOwner(string(buf[:n])); ok {
		return x
	}
	return o
}

// keepOwner notes the owner of the file fd pins before a chmod that may
// take the VMM's read permission away (to mode); refresh, called after
// it, records it with the file's new ctime.
func (s *share) keepOwner(fd int, st *unix.Stat_t, mode uint32) (refresh func()) {
	if !s.keeps(st) || !s.unreadable(mode) {
		return func() {}
	}
	o := s.shown(fd, st)
	if o == s.mapped(st) {
		return func() {}
	}
	return func() {
		var now unix.Stat_t
		if unix.Fstat(fd, &now) == nil {
			s.owners.put(&now, o)
		}
	}
}

// parseOwner reads an ownerXattr value: two decimal ids, neither -1.
func parseOwner(v string) (owner, bool) {
	u, g, ok := strings.Cut(v, ":")
	if !ok {
		return owner{}, false
	}
	uid, err1 := strconv.ParseUint(u, 10, 32)
	gid, err2 := strconv.ParseUint(g, 10, 32)
	if err1 != nil || err2 != nil || uid == 1<<32-1 || gid == 1<<32-1 {
		return owner{}, false
	}
	return owner{uint32(uid), uint32(gid)}, true
}

// setOwner makes o the owner the guest sees for the file fd pins (stat
// st, owned by the VMM's user, ownable): the attribute is written, or
// removed where o is what the host's ids show anyway. It fails where the
// host's file system keeps no user attributes.
func (s *share) setOwner(fd int, st *unix.Stat_t, o owner) error {
	p := procPath(fd)
	err := s.ownerAccess(fd, st, func() error {
		if o == s.mapped(st) {
			if err := unix.Removexattr(p, ownerXattr); err != nil && err != unix.ENODATA {
				return err
			}
			return nil
		}
		return unix.Setxattr(p, ownerXattr, []byte(strconv.FormatUint(uint64(o.uid), 10)+":"+strconv.FormatUint(uint64(o.gid), 10)), 0)
	})
	if err == nil && s.unreadable(st.Mode) {
		// Not readable once its mode is set back: kept here, with the
		// ctime the lent permission left.
		var now unix.Stat_t
		if unix.Fstat(fd, &now) == nil {
			s.owners.put(&now, o)
		}
	}
	return err
}

// creator is the owner a create asks for: the ids the guest sent (the
// device passes the creating user's; p9.NoUID and p9.NoGID: the mapped
// ones), for a new file with stat st.
func (s *share) creator(st *unix.Stat_t, uid p9.UID, gid p9.GID) owner {
	o := s.mapped(st)
	if uid.Ok() {
		o.uid = uint32(uid)
	}
	if gid.Ok() {
		o.gid = uint32(gid)
	}
	return o
}

// own gives a file just made (fd, stat st) the owner its creator asked
// for. A host without user attributes keeps the mapped ids: the create
// itself has succeeded and stands.
func (s *share) own(fd int, st *unix.Stat_t, uid p9.UID, gid p9.GID) {
	if !s.keeps(st) {
		return
	}
	o := s.creator(st, uid, gid)
	if o == s.mapped(st) {
		return
	}
	if err := s.setOwner(fd, st, o); err != nil {
		s.log.Debug("the new file's owner is not kept: the host's file system refused it", "uid", o.uid, "gid", o.gid, "err", err)
	}
}
