// Package cpio writes "newc" cpio archives, the format the Linux kernel
// unpacks as an initramfs.
//
// u-root has a full cpio package, but u-root cannot share a Go module with
// hugelgupf/p9 (their dependency sets do not tidy together), and the main
// module needs p9. Writing an archive for the kernel is a narrow job: newc
// headers, names, data, padding and the trailer, nothing more.
package cpio

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
)

// Writer writes entries in newc format. Directories named as parents of a
// later entry are not created implicitly: add them first with Dir.
type Writer struct {
	w      io.Writer
	off    int64
	ino    uint32
	closed bool
	seen   map[string]bool
}

// NewWriter returns a Writer that writes to w.
func NewWriter(w io.Writer) *Writer {
	return &Writer{w: w, ino: 1, seen: map[string]bool{}}
}

// Mode bits for entries, as in <sys/stat.h>.
const (
	modeDir     = 0o040000
	modeRegular = 0o100000
	modeSymlink = 0o120000
	modeCharDev = 0o020000
)

func (w *Writer) header(name string, mode uint32, size int64, rdevMajor, rdevMinor uint32) error {
	name = strings.TrimPrefix(path.Clean("/"+name), "/")
	if name == "" {
		name = "."
	}
	if w.closed {
		return fmt.Errorf("cpio: write %q after Close", name)
	}
	if size > 0xffffffff {
		return fmt.Errorf("cpio: %q is %d bytes; newc holds at most 4 GiB per file", name, size)
	}
	if w.seen[name] {
		return fmt.Errorf("cpio: duplicate entry %q", name)
	}
	w.seen[name] = true
	nlink := uint32(1)
	if mode&0o170000 == modeDir {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		w.ino, mode, 0, 0, nlink, 0, uint32(size), 0, 0, rdevMajor, rdevMinor, len(name)+1, 0)
	w.ino++
	if err := w.write([]byte(hdr + name + "\x00")); err != nil {
		return err
	}
	return w.pad()
}

func (w *Writer) write(p []byte) error {
	n, err := w.w.Write(p)
	w.off += int64(n)
	if err != nil {
		return fmt.Errorf("cpio: %w", err)
	}
	return nil
}

func (w *Writer) pad() error {
	if r := w.off % 4; r != 0 {
		return w.write(make([]byte, 4-r))
	}
	return nil
}

// Dir adds a directory.
func (w *Writer) Dir(name string, perm fs.FileMode) error {
	return w.header(name, modeDir|uint32(perm.Perm()), 0, 0, 0)
}

// File adds a regular file with the given contents.
func (w *Writer) File(name string, perm fs.FileMode, data []byte) error {
	if err := w.header(name, modeRegular|uint32(perm.Perm()), int64(len(data)), 0, 0); err != nil {
		return err
	}
	if err := w.write(data); err != nil {
		return err
	}
	return w.pad()
}

// CopyFile adds the host file src as name, streaming its contents.
func (w *Writer) CopyFile(name, src string, perm fs.FileMode) error {
	f, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("cpio: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("cpio: %w", err)
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("cpio: %s is not a regular file", src)
	}
	if err := w.header(name, modeRegular|uint32(perm.Perm()), st.Size(), 0, 0); err != nil {
		return err
	}
	n, err := io.Copy(w.w, io.LimitReader(f, st.Size()))
	w.off += n
	if err != nil {
		return fmt.Errorf("cpio: copy %s: %w", src, err)
	}
	if n != st.Size() {
		return fmt.Errorf("cpio: %s shrank while being archived", src)
	}
	return w.pad()
}

// Symlink adds a symbolic link name pointing at target.
func (w *Writer) Symlink(name, target string) error {
	if err := w.header(name, modeSymlink|0o777, int64(len(target)), 0, 0); err != nil {
		return err
	}
	if err := w.write([]byte(target)); err != nil {
		return err
	}
	return w.pad()
}

// CharDev adds a character device node.
func (w *Writer) CharDev(name string, perm fs.FileMode, major, minor uint32) error {
	return w.header(name, modeCharDev|uint32(perm.Perm()), 0, major, minor)
}

// Close writes the trailer. It does not close the underlying writer.
func (w *Writer) Close() error {
	if w.closed {
		return nil
	}
	if err := w.header("TRAILER!!!", 0, 0, 0, 0); err != nil {
		return err
	}
	w.closed = true
	return nil
}
