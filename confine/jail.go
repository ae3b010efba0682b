package confine

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// The jail: when capsa runs as root, the VMM process also gets a mount
// namespace of its own whose root is an empty tmpfs holding only bind
// mounts of the paths it still uses, at their own absolute paths (the
// read-only ones mounted read-only), and can drop to another user and
// group. A guest that took over the VMM then sees no other host file at
// all, and as that user holds no capability.
//
// The namespace must be made when the process is spawned
// (SysProcAttr.Cloneflags CLONE_NEWNS): in a Go process, which has many
// threads, unshare(CLONE_NEWNS) would move only the calling thread. (Not
// Unshareflags, after which os/exec makes every mount private: a jail
// that follows the host's mounts needs them as they were.)

// User is the user and group a jailed process drops to.
type User struct {
	UID int `json:"uid"`
	GID int `json:"gid"`
}

func (u User) String() string { return fmt.Sprintf("uid %d gid %d", u.UID, u.GID) }

// ParseUser parses UID[:GID] (GID defaults to UID), numbers only.
func ParseUser(s string) (User, error) {
	us, gs, ok := strings.Cut(s, ":")
	if !ok {
		gs = us
	}
	uid, err1 := strconv.ParseUint(us, 10, 32)
	gid, err2 := strconv.ParseUint(gs, 10, 32)
	if err1 != nil || err2 != nil || uid == 1<<32-1 || gid == 1<<32-1 {
		return User{}, fmt.Errorf("confine: user %q: want UID[:GID], numbers", s)
	}
	return User{int(uid), int(gid)}, nil
}

// JailConfig says what a jailed process still sees.
type JailConfig struct {
	// Read and Write are bound into the jail, read-only and writable.
	// Files and directories; missing ones are skipped.
	Read, Write []string
	// Follow are directories of Write beneath which the host mounts while
	// the process runs (a containerd pod's container roots, in its
	// shared directory): the jail takes those mounts as they come and
	// go. Each is bound with what is mounted beneath it, as a slave of
	// the host's mount: the host's mounts and unmounts there reach the
	// jail, the jail's reach nothing. For them to come, the host's mount
	// of the directory must be shared (mount --make-shared) before the
	// process is spawned. Every other bind takes nothing from the host
	// after it is made. A mount that comes keeps the host's flags, not
	// the jail's nosuid, nodev and noexec (what holds the process there
	// is seccomp, which refuses execve, and its file server, which opens
	// no device). A directory given in Read too is bound once, and not
	// followed.
	Follow []string
	// User, when set, is the user and group the process becomes.
	User *User
	// Own are files and directories capsa made for this sandbox alone
	// and keeps writing (its state directory): they are given to User,
	// with everything beneath.
	Own []string
	// Shared are capsa's files that other sandboxes use too (the
	// store's records, the hub, the snapshots directory): User gets read
	// and write access to them through an ACL entry, their owner stays.
	Shared []string
}

// jailRoot is where the jail's tmpfs is mounted while it is built. Inside
// the private namespace only: the host's directory is not touched (paths
// beneath it are opened before it is covered).
const jailRoot = "/tmp"

// InOwnMountNamespace reports whether the process's mount namespace is not
// its parent's (or, without a parent to compare with, init's): whether it
// was spawned into one of its own.
func InOwnMountNamespace() (bool, error) {
	self, err := nsID("self")
	if err != nil {
		return false, err
	}
	other, err := nsID(strconv.Itoa(os.Getppid()))
	if err != nil {
		if other, err = nsID("1"); err != nil {
			return false, err
		}
	}
	return self != other, nil
}

func nsID(pid string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/"+pid+"/ns/mnt", &st); err != nil {
		return "", fmt.Errorf("confine: jail: the mount namespace of %s: %w", pid, err)
	}
	return fmt.Sprintf("%d:%d", st.Dev, st.Ino), nil
}

// jailFlags are every bind's: nothing in the jail is a device, runs, or
// grants privileges.
const jailFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC

// Jail moves the calling process, which must run as root in a mount
// namespace of its own, into a root holding only c's paths (plus
// /dev/null), and then, with c.User, drops to that user and group for
// good. It returns what it did, for Layers.
func Jail(c JailConfig, log *slog.Logger) (string, error) {
	own, err := InOwnMountNamespace()
	if err != nil {
		return "", err
	}
	if !own {
		return "", fmt.Errorf("%w: not in a mount namespace of its own (spawn it with CLONE_NEWNS)", errUnavailable)
	}
	if c.User != nil {
		for _, p := range c.Own {
			if err := chownTree(p, c.User.UID, c.User.GID); err != nil {
				return "", err
			}
		}
		for _, p := range c.Shared {
			if err := grantACL(p, c.User.UID); err != nil {
				return "", err
			}
		}
	}
	// Nothing made here goes back to the host. Where the jail follows
	// the host's mounts, they still come in: a slave receives its
	// master's, and a bind of a slave is a slave of the same master.
	propagation, kind := uintptr(unix.MS_PRIVATE), "private"
	follow := map[string]bool{}
	for _, p := range c.Follow {
		follow[filepath.Clean(p)] = true
	}
	if len(follow) > 0 {
		propagation, kind = unix.MS_SLAVE, "a slave"
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|propagation, ""); err != nil {
		return "", fmt.Errorf("confine: jail: make / %s: %w", kind, err)
	}
	// Open every path before the tmpfs covers jailRoot: some lie beneath
	// it. Parents first, so a path inside another is mounted on top.
	type bind struct {
		path   string
		f      *os.File
		dir    bool
		rdonly bool
		flags  uintptr
		rec    bool // with what is mounted beneath it, a slave (Follow)
	}
	var binds []bind
	defer func() {
		for _, b := range binds {
			b.f.Close()
		}
	}()
	add := func(paths []string, rdonly bool, flags uintptr) error {
		for _, p := range paths {
			p = filepath.Clean(p)
			if !filepath.IsAbs(p) {
				return fmt.Errorf("confine: jail: %s: not an absolute path", p)
			}
			f, err := os.OpenFile(p, unix.O_PATH|unix.O_CLOEXEC, 0)
			if errors.Is(err, fs.ErrNotExist) {
				continue
			} else if err != nil {
				return fmt.Errorf("confine: jail: %w", err)
			}
			fi, err := f.Stat()
			if err != nil {
				f.Close()
				return fmt.Errorf("confine: jail: %w", err)
			}
			binds = append(binds, bind{p, f, fi.IsDir(), rdonly, flags, follow[p] && !rdonly && fi.IsDir()})
		}
		return nil
	}
	if err := add(c.Read, true, jailFlags); err != nil {
		return "", err
	}
	if err := add(c.Write, false, jailFlags); err != nil {
		return "", err
	}
	if err := add([]string{"/dev/null"}, false, unix.MS_NOSUID|unix.MS_NOEXEC); err != nil {
		return "", err
	}
	// A path given twice is bound once, writable if either says so.
	slices.SortStableFunc(binds, func(a, b bind) int {
		if d := strings.Count(a.path, "/") - strings.Count(b.path, "/"); d != 0 {
			return d
		}
		return strings.Compare(a.path, b.path)
	})
	if err := unix.Mount("tmpfs", jailRoot, "tmpfs", jailFlags, "mode=0755,size=1m,nr_inodes=4096"); err != nil {
		return "", fmt.Errorf("confine: jail: mount its root: %w", err)
	}
	// isolate makes a mount of the jail's take nothing from the host
	// from here on: under Follow, where / became a slave, a bind of a
	// slave is one too.
	isolate := func(target string) error {
		if len(follow) == 0 {
			return nil
		}
		if err := unix.Mount("", target, "", unix.MS_PRIVATE, ""); err != nil {
			return fmt.Errorf("confine: jail: make %s private: %w", target, err)
		}
		return nil
	}
	if err := isolate(jailRoot); err != nil {
		return "", err
	}
	bound := map[string]int{} // path -> its bind's index
	for j, b := range binds {
		if i, ok := bound[b.path]; ok {
			if !b.rdonly && binds[i].rdonly {
				binds[i].rdonly = false
				if err := unix.Mount("", jailRoot+b.path, "", unix.MS_REMOUNT|unix.MS_BIND|binds[i].flags, ""); err != nil {
					return "", fmt.Errorf("confine: jail: remount %s writable: %w", b.path, err)
				}
			}
			continue
		}
		if i, ok := boundAbove(bound, b.path); ok && binds[i].rdonly == b.rdonly && (binds[i].rec || !b.rec) {
			continue // reached through that bind, which it would only pin
		}
		target := jailRoot + b.path
		if err := mountPoint(target, b.dir); err != nil {
			return "", fmt.Errorf("confine: jail: %s: %w", b.path, err)
		}
		src := "/proc/self/fd/" + strconv.Itoa(int(b.f.Fd()))
		bindFlags := uintptr(unix.MS_BIND)
		if b.rec {
			bindFlags |= unix.MS_REC
		}
		if err := unix.Mount(src, target, "", bindFlags, ""); err != nil {
			return "", fmt.Errorf("confine: jail: bind %s: %w", b.path, err)
		}
		if !b.rec {
			if err := isolate(target); err != nil {
				return "", err
			}
		}
		flags := unix.MS_REMOUNT | unix.MS_BIND | b.flags
		if b.rdonly {
			flags |= unix.MS_RDONLY
		}
		if err := unix.Mount("", target, "", flags, ""); err != nil {
			return "", fmt.Errorf("confine: jail: remount %s: %w", b.path, err)
		}
		bound[b.path] = j
	}
	// The tmpfs becomes the root (pivot_root(".", ".") stacks the old
	// root on it, and the detach takes that away), read-only.
	if err := unix.Chdir(jailRoot); err != nil {
		return "", fmt.Errorf("confine: jail: %w", err)
	}
	how := "pivot_root"
	switch err := unix.PivotRoot(".", "."); {
	case errors.Is(err, unix.EINVAL):
		// The root is the initial ramfs, which cannot be pivoted away
		// from: as switch_root does, move the tmpfs over it and chroot
		// there. The old root stays in the namespace, beneath; getting
		// back to it takes chroot or mount, which seccomp refuses, and
		// the capability a dropped user no longer has.
		if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
			return "", fmt.Errorf("confine: jail: move its root over /: %w", err)
		}
		if err := unix.Chroot("."); err != nil {
			return "", fmt.Errorf("confine: jail: chroot: %w", err)
		}
		how = "moved over the initial ramfs"
	case err != nil:
		return "", fmt.Errorf("confine: jail: pivot_root: %w", err)
	default:
		if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
			return "", fmt.Errorf("confine: jail: detach the old root: %w", err)
		}
	}
	if err := unix.Chdir("/"); err != nil {
		return "", fmt.Errorf("confine: jail: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_RDONLY|jailFlags, ""); err != nil {
		return "", fmt.Errorf("confine: jail: remount its root read-only: %w", err)
	}
	what := fmt.Sprintf("mount namespace, %d paths", len(bound))
	if how != "pivot_root" {
		what += ", " + how
	}
	followed := 0
	for _, i := range bound {
		if binds[i].rec {
			followed++
		}
	}
	if followed > 0 {
		what += fmt.Sprintf(", following the host's mounts beneath %d of them", followed)
	}
	if c.User == nil {
		return what + ", uid 0", nil
	}
	// The syscall package's calls change every thread's credentials.
	if err := syscall.Setgroups(nil); err != nil {
		return "", fmt.Errorf("confine: jail: setgroups: %w", err)
	}
	if err := syscall.Setresgid(c.User.GID, c.User.GID, c.User.GID); err != nil {
		return "", fmt.Errorf("confine: jail: setresgid %d: %w", c.User.GID, err)
	}
	if err := syscall.Setresuid(c.User.UID, c.User.UID, c.User.UID); err != nil {
		return "", fmt.Errorf("confine: jail: setresuid %d: %w", c.User.UID, err)
	}
	// A change of credentials makes the process undumpable, which gives
	// its /proc entries to root: p9fs reopens descriptors through
	// /proc/self/fd. (Core dumps stay off: RLIMIT_CORE is 0.)
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 1, 0, 0, 0); err != nil {
		return "", fmt.Errorf("confine: jail: PR_SET_DUMPABLE: %w", err)
	}
	log.Debug("confine: jailed", "paths", len(bound), "user", c.User.String())
	return what + ", " + c.User.String(), nil
}

// boundAbove returns the index of the bind of the nearest directory above
// path in bound.
func boundAbove(bound map[string]int, path string) (int, bool) {
	for p := filepath.Dir(path); ; p = filepath.Dir(p) {
		if i, ok := bound[p]; ok {
			return i, true
		}
		if p == "/" {
			return 0, false
		}
	}
}

// mountPoint makes target, in the jail's tmpfs, a directory or an empty
// file to mount on, with its parents. An existing one (inside a bind
// mounted before: a path beneath another) is used as it is.
func mountPoint(target string, dir bool) error {
	if _, err := os.Lstat(target); err == nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return err
	}
	if dir {
		return os.Mkdir(target, 0o755)
	}
	f, err := os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	return f.Close()
}

// chownTree gives path and everything beneath it to uid and gid, not
// following symbolic links.
func chownTree(path string, uid, gid int) error {
	err := filepath.WalkDir(path, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("confine: jail: give %s to uid %d: %w", path, uid, err)
	}
	return nil
}

// POSIX ACLs as the kernel stores them in system.posix_acl_access: a
// version, then entries of tag, permissions and id, sorted by tag and id.
// No library: the format is these few lines (include/uapi/linux/
// posix_acl_xattr.h), and only one operation is needed.
const (
	aclXattr   = "system.posix_acl_access"
	aclVersion = 2
	aclUserObj = 0x01
	aclUser    = 0x02
	aclGroup   = 0x04 // the owning group
	aclGroups  = 0x08 // a named group
	aclMask    = 0x10
	aclOther   = 0x20
	aclNoID    = 0xffffffff
)

type aclEntry struct {
	tag, perm uint16
	id        uint32
}

// grantACL lets uid read and write path (and search it, a directory)
// through an entry of its access ACL, widening the mask to match; the
// owner and mode bits stay. A missing path is skipped.
func grantACL(path string, uid int) error {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return fmt.Errorf("confine: jail: %w", err)
	}
	perm := uint16(6)
	if fi.IsDir() {
		perm = 7
	}
	fail := func(err error) error {
		return fmt.Errorf("confine: jail: let uid %d use %s (an ACL entry; its file system must support POSIX ACLs): %w", uid, path, err)
	}
	var entries []aclEntry
	buf := make([]byte, 4096)
	n, err := unix.Getxattr(path, aclXattr, buf)
	switch {
	case errors.Is(err, unix.ENODATA):
		m := uint16(fi.Mode().Perm())
		entries = []aclEntry{{aclUserObj, m >> 6 & 7, aclNoID}, {aclGroup, m >> 3 & 7, aclNoID}, {aclOther, m & 7, aclNoID}}
	case err != nil:
		return fail(err)
	case n < 4 || (n-4)%8 != 0 || binary.LittleEndian.Uint32(buf) != aclVersion:
		return fail(fmt.Errorf("unexpected ACL of %d bytes", n))
	default:
		for b := buf[4:n]; len(b) >= 8; b = b[8:] {
			entries = append(entries, aclEntry{binary.LittleEndian.Uint16(b), binary.LittleEndian.Uint16(b[2:]), binary.LittleEndian.Uint32(b[4:])})
		}
	}
	entries = slices.DeleteFunc(entries, func(e aclEntry) bool {
		return e.tag == aclMask || (e.tag == aclUser && e.id == uint32(uid))
	})
	entries = append(entries, aclEntry{aclUser, perm, uint32(uid)})
	var mask uint16
	for _, e := range entries {
		if e.tag == aclUser || e.tag == aclGroup || e.tag == aclGroups {
			mask |= e.perm
		}
	}
	entries = append(entries, aclEntry{aclMask, mask, aclNoID})
	slices.SortFunc(entries, func(a, b aclEntry) int {
		if a.tag != b.tag {
			return int(a.tag) - int(b.tag)
		}
		return int(int64(a.id) - int64(b.id))
	})
	out := binary.LittleEndian.AppendUint32(nil, aclVersion)
	for _, e := range entries {
		out = binary.LittleEndian.AppendUint16(out, e.tag)
		out = binary.LittleEndian.AppendUint16(out, e.perm)
		out = binary.LittleEndian.AppendUint32(out, e.id)
	}
	if err := unix.Setxattr(path, aclXattr, out, 0); err != nil {
		return fail(err)
	}
	return nil
}
