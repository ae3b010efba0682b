package snapshot

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// CloneFile copies src to dst (made, 0600) as cheaply as the host's file
// system allows: a reflink (FICLONE: the blocks shared copy-on-write, on
// btrfs, XFS and others) where it can, otherwise a copy of src's data
// segments that leaves its holes as holes (SEEK_DATA, SEEK_HOLE) and
// makes its zero-filled chunks holes too, so a sparse disk stays sparse
// and one written full of zeros (a new file system's inode tables)
// becomes so: the next copy of it skips them.
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
	buf := make([]byte, cloneChunk)
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
		if err := copySparse(out, in, data, hole, buf); err != nil {
			return fmt.Errorf("clone %s: %w", src, err)
		}
		off = hole
	}
	return out.Sync()
}

// cloneChunk is the unit CloneFrom copies in, and leaves a hole for when
// it holds only zeros.
const cloneChunk = 1 << 20

// copySparse copies in's bytes [from, to) to the same offsets of out
// (already as long as in, all hole), a chunk at a time, skipping the
// chunks that hold only zeros.
func copySparse(out, in *os.File, from, to int64, buf []byte) error {
	for off := from; off < to; {
		n := int(min(int64(len(buf)), to-off))
		if _, err := io.ReadFull(io.NewSectionReader(in, off, int64(n)), buf[:n]); err != nil {
			return err
		}
		if !allZero(buf[:n]) {
			if _, err := out.WriteAt(buf[:n], off); err != nil {
				return err
			}
		}
		off += int64(n)
	}
	return nil
}

// zeros is a chunk of zeros, for copySparse to compare with.
var zeros [cloneChunk]byte

// allZero reports whether b (at most a chunk) holds only zero bytes.
func allZero(b []byte) bool { return bytes.Equal(b, zeros[:len(b)]) }
