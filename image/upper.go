package image

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/diskfs/go-diskfs/backend/file"
	"github.com/diskfs/go-diskfs/filesystem/ext4"
)

// MinUpperSize is the smallest writable layer OpenUpperTemplate makes.
const MinUpperSize = 64 << 20

// makeUpper makes f, a new empty file, a sparse file of size bytes
// holding an empty ext4 filesystem: a sandbox's writable layer, which the
// guest puts over the image with overlayfs. The file never grows past
// size, so the guest gets ENOSPC there. It is written in Go (go-diskfs),
// with no host tool and no root; without a journal, since the layer lives
// as long as its sandbox.
func makeUpper(f *os.File, size int64) error {
	size &^= 4095
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("image: writable layer: %w", err)
	}
	fsys, err := ext4.Create(file.New(newSparseFile(f, size), false), size, 0, 512, &ext4.Params{
		VolumeName: "capsa-upper",
		Features:   []ext4.FeatureOpt{ext4.WithFeatureHasJournal(false)},
	})
	if err != nil {
		return fmt.Errorf("image: make the writable layer's ext4: %w", err)
	}
	if err := fsys.Close(); err != nil {
		return fmt.Errorf("image: make the writable layer's ext4: %w", err)
	}
	return nil
}

// OpenUpperTemplate opens an empty writable layer of size bytes that the
// store keeps, made by makeUpper the first time one of
// that size is asked for. A sandbox's layer is a copy of it (a reflink,
// or a copy of its megabyte of metadata): go-diskfs makes the file system
// in 0.15 s of CPU on the development machine, but in 1.4 s in the nested
// host, which every image sandbox's start paid. The file is opened
// without following a symlink and must be a regular file of the size;
// anything else in its place (a symlink, a short file) is replaced by a
// new template, the rename taking the name without following it.
func (s *Store) OpenUpperTemplate(size int64) (*os.File, error) {
	if size < MinUpperSize {
		return nil, fmt.Errorf("image: writable layer of %d bytes: at least %d", size, MinUpperSize)
	}
	size &^= 4095
	dir := filepath.Join(s.dir, "upper")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("image: writable layer template: %w", err)
	}
	p := filepath.Join(dir, fmt.Sprintf("v%d-%d.ext4", upperTemplateVersion, size))
	f, err := openTemplate(p, size)
	if err != nil {
		if err := s.writeAtomic(p, func(f *os.File) error { return makeUpper(f, size) }, nil); err != nil {
			return nil, fmt.Errorf("image: make the writable layer template %s: %w", p, err)
		}
		f, err = openTemplate(p, size)
	}
	if err != nil {
		return nil, fmt.Errorf("image: writable layer template: %w", err)
	}
	return f, nil
}

// upperTemplateVersion names the templates makeUpper makes: a change to
// the file system it makes (or to go-diskfs's) bumps it, so that an
// older template is not used again.
const upperTemplateVersion = 1

// openTemplate opens the template at p: a regular file of size bytes,
// not through a symlink.
func openTemplate(p string, size int64) (*os.File, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err == nil && (!fi.Mode().IsRegular() || fi.Size() != size) {
		err = fmt.Errorf("%s: %v of %d bytes, want a regular file of %d", p, fi.Mode().Type(), fi.Size(), size)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// sparseFile is a file just truncated to its size, as go-diskfs writes it,
// less the writes of zeros to blocks never written: those read as zero
// already. ext4.Create writes every inode table in full, 128 MiB of zeros
// for the default 4 GiB layer, which took most of an image sandbox's
// extra start time in the nested host (2.6 s of a 4.2 s start against
// 1.6 s for an initramfs sandbox), and made the sparse file 128 MiB on
// disk. A block once written with data is written again whatever comes,
// so the file ends as the writes in order would leave it. It also hides
// the *os.File from go-diskfs, whose backend then cannot fsync it.
type sparseFile struct {
	f       *os.File
	written []uint64 // a bit per block: written with data
}

const sparseBlock = 4096

var zeroBlock [sparseBlock]byte

func newSparseFile(f *os.File, size int64) *sparseFile {
	return &sparseFile{f: f, written: make([]uint64, (size/sparseBlock+64)/64)}
}

func (s *sparseFile) Stat() (fs.FileInfo, error)                { return s.f.Stat() }
func (s *sparseFile) Read(p []byte) (int, error)                { return s.f.Read(p) }
func (s *sparseFile) ReadAt(p []byte, off int64) (int, error)   { return s.f.ReadAt(p, off) }
func (s *sparseFile) Seek(off int64, whence int) (int64, error) { return s.f.Seek(off, whence) }
func (s *sparseFile) Close() error                              { return nil } // makeUpper's caller closes f
func (s *sparseFile) isWritten(b int64) bool {
	return b/64 < int64(len(s.written)) && s.written[b/64]&(1<<(b%64)) != 0
}

// WriteAt writes p block by block, skipping each piece of zeros that
// falls in a block never written with data.
func (s *sparseFile) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("image: write at offset %d", off)
	}
	for done := 0; done < len(p); {
		at := off + int64(done)
		b := at / sparseBlock
		n := min(len(p)-done, int(sparseBlock-at%sparseBlock))
		piece := p[done : done+n]
		if !bytes.Equal(piece, zeroBlock[:n]) || s.isWritten(b) {
			if _, err := s.f.WriteAt(piece, at); err != nil {
				return done, err
			}
			if b/64 < int64(len(s.written)) {
				s.written[b/64] |= 1 << (b % 64)
			}
		}
		done += n
	}
	return len(p), nil
}
