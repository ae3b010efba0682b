package volume

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// level is one directory of walk's path: what is left of it to visit.
type level struct {
	names    []string
	dev, ino uint64
	name     string // its name in its parent
	mode     uint32 // its mode before walk changed it
	changed  bool
}

// walk calls visit with the stat of dir and of everything under it,
// never following a symlink. It holds two descriptors at most whatever the
// depth (a guest can nest directories far deeper than PATH_MAX): it goes
// down by name and back up by "..", and a tree changed under it so that
// ".." is not where it came from is an error, not a wrong answer.
//
// A directory whose owner lacks the bits in need (a guest's chmod 000;
// the guest's files are the VMM user's) gets them added so it can be
// walked; with restore its mode is put back when walk leaves it.
func walk(dir string, need uint32, restore bool, visit func(*unix.Stat_t)) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("walk %s: %w", dir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("walk %s: not a directory", dir)
	}
	visit(&st)
	fd, top, err := enter(unix.AT_FDCWD, dir, &st, need)
	if err != nil {
		return fmt.Errorf("walk %s: %w", dir, err)
	}
	stack := []*level{top}
	defer func() {
		unix.Close(fd)
		if top.changed && restore {
			unix.Fchmodat(unix.AT_FDCWD, dir, top.mode, 0)
		}
	}()
	for len(stack) > 0 {
		cur := stack[len(stack)-1]
		if len(cur.names) == 0 {
			stack = stack[:len(stack)-1]
			if len(stack) == 0 {
				break
			}
			up, err := openDir(fd, "..")
			if err != nil {
				return fmt.Errorf("walk %s: back up from %s: %w", dir, cur.name, err)
			}
			unix.Close(fd)
			fd = up
			parent := stack[len(stack)-1]
			if err := unix.Fstat(fd, &st); err != nil || st.Dev != parent.dev || st.Ino != parent.ino {
				return fmt.Errorf("walk %s: the tree changed during the walk", dir)
			}
			if cur.changed && restore {
				unix.Fchmodat(fd, cur.name, cur.mode, 0)
			}
			continue
		}
		name := cur.names[len(cur.names)-1]
		cur.names = cur.names[:len(cur.names)-1]
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if err == unix.ENOENT {
				continue
			}
			return fmt.Errorf("walk %s: %s: %w", dir, name, err)
		}
		visit(&st)
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			continue
		}
		cfd, l, err := enter(fd, name, &st, need)
		if err != nil {
			return fmt.Errorf("walk %s: %s: %w", dir, name, err)
		}
		unix.Close(fd)
		fd = cfd
		stack = append(stack, l)
	}
	return nil
}

// enter opens the directory name of dirfd (stat'ed as st), giving its
// owner the bits in need first if it lacks them, and reads its names.
func enter(dirfd int, name string, st *unix.Stat_t, need uint32) (int, *level, error) {
	l := &level{dev: st.Dev, ino: st.Ino, name: name, mode: st.Mode & 07777}
	if l.mode&need != need {
		if err := unix.Fchmodat(dirfd, name, l.mode|need, 0); err == nil {
			l.changed = true
		}
	}
	fd, err := openDir(dirfd, name)
	if err != nil {
		if l.changed {
			unix.Fchmodat(dirfd, name, l.mode, 0)
		}
		return -1, nil, err
	}
	var got unix.Stat_t
	if err := unix.Fstat(fd, &got); err != nil || got.Dev != st.Dev || got.Ino != st.Ino {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("replaced during the walk")
	}
	if l.names, err = readNames(fd); err != nil {
		unix.Close(fd)
		return -1, nil, err
	}
	return fd, l, nil
}

// openDir opens the directory name of dirfd without following a symlink.
func openDir(dirfd int, name string) (int, error) {
	for {
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != unix.EINTR {
			return fd, err
		}
	}
}

// readNames lists the open directory fd.
func readNames(fd int) ([]string, error) {
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(d), "")
	defer f.Close()
	return f.Readdirnames(-1)
}
