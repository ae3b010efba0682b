package agent

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// checkXattrs refuses attributes past the bounds, or with names that are
// no names.
func checkXattrs(x map[string]string) error {
	if len(x) > MaxXattrs {
		return fmt.Errorf("%d extended attributes: at most %d", len(x), MaxXattrs)
	}
	for k, v := range x {
		if k == "" || len(k) > MaxXattrName || strings.ContainsRune(k, 0) || len(v) > MaxXattrValue {
			return fmt.Errorf("extended attribute %q: want a name of 1 to %d bytes and a value of at most %d", k, MaxXattrName, MaxXattrValue)
		}
	}
	return nil
}

// setXattrs gives the open file f the user attributes x.
func setXattrs(f *os.File, x map[string]string) error {
	for k, v := range x {
		if err := unix.Fsetxattr(int(f.Fd()), "user."+k, []byte(v), 0); err != nil {
			return fmt.Errorf("set the extended attribute user.%s: %w", k, err)
		}
	}
	return nil
}

// userXattrs returns path's user attributes (not following a final
// symlink), names without "user.": at most MaxXattrs, each value text of
// at most MaxXattrValue bytes (others are left out). A file system
// without them has none.
func userXattrs(path string) map[string]string {
	buf := make([]byte, 16<<10)
	n, err := unix.Llistxattr(path, buf)
	if err != nil || n <= 0 {
		return nil
	}
	var out map[string]string
	val := make([]byte, MaxXattrValue)
	for _, name := range bytes.Split(buf[:n], []byte{0}) {
		k, ok := strings.CutPrefix(string(name), "user.")
		if !ok || k == "" {
			continue
		}
		m, err := unix.Lgetxattr(path, "user."+k, val)
		if err != nil || !utf8.Valid(val[:m]) {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[k] = string(val[:m])
		if len(out) == MaxXattrs {
			break
		}
	}
	return out
}

// networkFS reports whether path is on a network file system (9P, NFS,
// SMB/CIFS, FUSE), whose changes made elsewhere inotify never sees.
func networkFS(path string) bool {
	var st unix.Statfs_t
	if unix.Statfs(path, &st) != nil {
		return false
	}
	switch uint32(st.Type) {
	case unix.V9FS_MAGIC, unix.NFS_SUPER_MAGIC, unix.SMB_SUPER_MAGIC, unix.SMB2_SUPER_MAGIC, unix.CIFS_SUPER_MAGIC, unix.FUSE_SUPER_MAGIC:
		return true
	}
	return false
}
