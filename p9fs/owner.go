package p9fs

import (
	"strconv"
	"strings"

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

// ownable reports whether a file of type typ can hold ownerXattr: user
// attributes exist only on regular files and directories.
func ownable(typ uint32) bool {
	return typ&unix.S_IFMT == unix.S_IFREG || typ&unix.S_IFMT == unix.S_IFDIR
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
	if st.Uid != s.hostUID || !ownable(st.Mode) {
		return o
	}
	var buf [24]byte
	n, err := unix.Getxattr(procPath(fd), ownerXattr, buf[:])
	if err != nil || n > len(buf) {
		return o // none, none possible here, or not one of ours
	}
	if x, ok := parseOwner(string(buf[:n])); ok {
		return x
	}
	return o
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
	if o == s.mapped(st) {
		if err := unix.Removexattr(p, ownerXattr); err != nil && err != unix.ENODATA {
			return err
		}
		return nil
	}
	return unix.Setxattr(p, ownerXattr, []byte(strconv.FormatUint(uint64(o.uid), 10)+":"+strconv.FormatUint(uint64(o.gid), 10)), 0)
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
	if st.Uid != s.hostUID || !ownable(st.Mode) {
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
