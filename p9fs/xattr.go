package p9fs

import (
	"strings"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// Only the "user." namespace is served. The others are the host's
// business: "security." holds file capabilities and LSM labels,
// "trusted." needs CAP_SYS_ADMIN, "system." holds ACLs.
const xattrPrefix = "user."

// xattrMax is XATTR_SIZE_MAX.
const xattrMax = 64 << 10

// xattrName checks an attribute name the guest sent.
func xattrName(name string) error {
	switch {
	case name == "", len(name) > 255, strings.IndexByte(name, 0) >= 0:
		return linux.EINVAL
	case !strings.HasPrefix(name, xattrPrefix) || len(name) == len(xattrPrefix):
		return linux.EOPNOTSUPP
	case name == ownerXattr:
		return linux.EPERM // the share's own (chown changes it)
	}
	return nil
}

// xattrPath is the path that reaches f's inode for the xattr calls (which
// take no O_PATH descriptor). User xattrs exist only on regular files and
// directories, so symlinks and special files are refused rather than
// reached through the magic link.
func (f *file) xattrPath() (string, error) {
	if f.typ != unix.S_IFREG && f.typ != unix.S_IFDIR {
		return "", linux.EPERM
	}
	return procPath(f.fd), nil
}

// SetXattr implements p9.File.SetXattr for "user." attributes.
func (f *file) SetXattr(name string, data []byte, flags p9.XattrFlags) error {
	if f.s.ro {
		return linux.EROFS
	}
	if err := xattrName(name); err != nil {
		return f.s.deny(err.(linux.Errno), "setxattr", "name", name)
	}
	if len(data) > xattrMax {
		return linux.E2BIG
	}
	if err := f.rlock(); err != nil {
		return err
	}
	defer f.mu.RUnlock()
	p, err := f.xattrPath()
	if err != nil {
		return err
	}
	// With a quota, the inode's user attributes must fit in what its
	// inode is charged; the check and the change are one step for every
	// share of the budget.
	return f.s.charged("setxattr", func(tx QuotaTx) error {
		if tx != nil {
			if err := xattrRoom(p, name, len(data)); err != nil {
				return err
			}
		}
		return errno(unix.Setxattr(p, name, data, int(flags)&(unix.XATTR_CREATE|unix.XATTR_REPLACE)))
	})
}

// GetXattr implements p9.File.GetXattr. Attributes outside "user." do not
// exist as far as the guest can tell.
func (f *file) GetXattr(name string) ([]byte, error) {
	switch err := xattrName(name); err {
	case nil:
	case linux.EOPNOTSUPP, linux.EPERM:
		return nil, linux.ENODATA
	default:
		return nil, err
	}
	if err := f.rlock(); err != nil {
		return nil, err
	}
	defer f.mu.RUnlock()
	if f.typ != unix.S_IFREG && f.typ != unix.S_IFDIR {
		return nil, linux.ENODATA
	}
	p := procPath(f.fd)
	for range 8 {
		n, err := unix.Getxattr(p, name, nil)
		if err != nil {
			return nil, errno(err)
		}
		if n == 0 {
			return []byte{}, nil
		}
		buf := make([]byte, n)
		n, err = unix.Getxattr(p, name, buf)
		if err == unix.ERANGE || n > len(buf) {
			continue // grew in between
		}
		if err != nil {
			return nil, errno(err)
		}
		return buf[:n], nil
	}
	return nil, linux.EAGAIN
}

// ListXattrs implements p9.File.ListXattrs: the "user." names.
func (f *file) ListXattrs() ([]string, error) {
	if err := f.rlock(); err != nil {
		return nil, err
	}
	defer f.mu.RUnlock()
	if f.typ != unix.S_IFREG && f.typ != unix.S_IFDIR {
		return nil, nil
	}
	p := procPath(f.fd)
	var buf []byte
	for i := 0; ; i++ {
		n, err := unix.Listxattr(p, nil)
		if err != nil {
			return nil, errno(err)
		}
		if n == 0 {
			return nil, nil
		}
		buf = make([]byte, n)
		n, err = unix.Listxattr(p, buf)
		if (err == unix.ERANGE || n > len(buf)) && i < 8 {
			continue // grew in between
		}
		if err != nil {
			return nil, errno(err)
		}
		if n > len(buf) {
			return nil, linux.EAGAIN
		}
		buf = buf[:n]
		break
	}
	var names []string
	for _, n := range strings.Split(string(buf), "\x00") {
		if strings.HasPrefix(n, xattrPrefix) && n != ownerXattr {
			names = append(names, n)
		}
	}
	return names, nil
}

// RemoveXattr implements p9.File.RemoveXattr for "user." attributes.
func (f *file) RemoveXattr(name string) error {
	if f.s.ro {
		return linux.EROFS
	}
	if err := xattrName(name); err != nil {
		return f.s.deny(err.(linux.Errno), "removexattr", "name", name)
	}
	if err := f.rlock(); err != nil {
		return err
	}
	defer f.mu.RUnlock()
	p, err := f.xattrPath()
	if err != nil {
		return err
	}
	return errno(unix.Removexattr(p, name))
}
