package snapshot

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// CloneFile copies src to dst (made, 0600) as cheaply as the host's file
// system allows: a reflink (FICLONE: the blocks shared copy-on-write, on
// btrfs, XFS and others) where it can, otherwise a copy of src's data
// segments that leaves its holes as holes (SEEK_DATA, SEEK_HOLE), so a
// sparse disk stays sparse.
func CloneFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	return CloneFrom(in, dst)
}

// CloneFrom is CloneFile from a file already open (a Snapshot's File).
func CloneFrom(in *os.File, dst string) (err error) {
	src := in.Name()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(dst)
		}
	}()
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return nil
	}
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	size := fi.Size()
	if err := out.Truncate(size); err != nil {
		return err
	}
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		}
		if err != nil {
			return fmt.Errorf("clone %s: %w", src, err)
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("clone %s: %w", src, err)
		}
		if _, err := io.Copy(io.NewOffsetWriter(out, data), io.NewSectionReader(in, data, hole-data)); err != nil {
			return fmt.Errorf("clone %s: %w", src, err)
		}
		off = hole
	}
	return out.Sync()
}
