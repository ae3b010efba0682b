// Package assets finds the guest kernel and initramfs capsa boots when the
// caller names none: a set of them, compressed, with a manifest. The
// starting point is Find, which returns the first usable set of:
//
//  1. the one built into the binary (internal/builtin, `-tags
//     capsa_builtin`, what `make capsa` builds);
//  2. the directory $CAPSA_ASSETS names, when set (then it is the only
//     other place: a set there that fails its checks is an error);
//  3. the build cache, $CAPSA_CACHE/assets (default ~/.cache/capsa/assets),
//     where `make capsa` leaves the set it builds;
//  4. Prefix/share/capsa (default /usr/local/share/capsa), where `make
//     install` puts it.
//
// A set is a directory (or the embedded file system) holding manifest.json
// and the two zstd-compressed files it names. The manifest gives the capsa
// version that built the set, the range of agent protocol versions its
// initramfs speaks (which must meet this package's agent.ProtocolVersion
// range: that is what makes a set usable by this library) and each file's
// SHA-256 and uncompressed size and SHA-256.
//
// Decompressing costs tens of milliseconds, more than reading the files
// uncompressed from the page cache, so a file is decompressed once per
// machine: its content is checked against the manifest and kept in
// $CAPSA_CACHE/unpacked (default ~/.cache/capsa/unpacked) under its
// SHA-256, and later processes map that copy (shared page cache, nothing
// on the heap). Where that directory cannot be written, the file is
// decompressed into memory, once per process.
package assets

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/capsa-sandbox/capsa/internal/strictjson"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/internal/builtin"
)

// Prefix is the installation prefix whose share/capsa Find searches last.
// Set it at link time where the assets were installed elsewhere:
//
//	go build -ldflags "-X github.com/capsa-sandbox/capsa/internal/assets.Prefix=/opt/capsa"
var Prefix = "/usr/local"

// ManifestName is the manifest's file name in a set.
const ManifestName = "manifest.json"

// ManifestFormat is the manifest format this package reads and writes.
const ManifestFormat = 1

// MaxFileSize bounds a file's uncompressed size: a manifest that says
// more is refused, and decompression stops there.
const MaxFileSize = 1 << 30

// Manifest describes a set.
type Manifest struct {
	Format       int    `json:"format"`
	CapsaVersion string `json:"capsa_version"`
	// AgentProtocol is the oldest and newest agent protocol version the
	// initramfs's agent speaks.
	AgentProtocol [2]int `json:"agent_protocol"`
	Kernel        File   `json:"kernel"`    // an uncompressed vmlinux, compressed
	Initramfs     File   `json:"initramfs"` // a cpio archive, compressed
}

// File is one compressed file of a set.
type File struct {
	Name          string `json:"name"`           // beside the manifest
	SHA256        string `json:"sha256"`         // of the compressed file, hex
	Size          int64  `json:"size"`           // uncompressed
	ContentSHA256 string `json:"content_sha256"` // of the uncompressed content, hex
}

// Set is a set of assets found and checked: its manifest is well formed
// and its agent speaks this package's protocol. Its files' hashes are
// checked when they are decompressed.
type Set struct {
	// Where says where the set was found: "built in", or a place and its
	// directory.
	Where    string
	Manifest Manifest

	fsys              fs.FS
	kernel, initramfs func() ([]byte, error)
}

// Kernel returns the set's kernel, uncompressed. It is decompressed (or
// its unpacked copy mapped) once per Set; the bytes must not be modified.
func (s *Set) Kernel() ([]byte, error) { return s.kernel() }

// Initramfs returns the set's initramfs, uncompressed, once per Set like
// Kernel.
func (s *Set) Initramfs() ([]byte, error) { return s.initramfs() }

// Open returns the set in dir, checked.
func Open(dir string) (*Set, error) {
	return open(os.DirFS(dir), dir)
}

func open(fsys fs.FS, where string) (*Set, error) {
	data, err := readManifest(fsys)
	if err != nil {
		return nil, err
	}
	var m Manifest
	if err := strictjson.Decode(data, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", ManifestName, err)
	}
	if err := m.check(); err != nil {
		return nil, fmt.Errorf("%s (capsa %s): %w", ManifestName, m.CapsaVersion, err)
	}
	for _, f := range []File{m.Kernel, m.Initramfs} {
		if _, err := fs.Stat(fsys, f.Name); err != nil {
			return nil, fmt.Errorf("%s: %w", ManifestName, err)
		}
	}
	s := &Set{Where: where, Manifest: m, fsys: fsys}
	s.kernel = sync.OnceValues(func() ([]byte, error) { return unpack(fsys, m.Kernel) })
	s.initramfs = sync.OnceValues(func() ([]byte, error) { return unpack(fsys, m.Initramfs) })
	return s, nil
}

// maxManifest bounds manifest.json.
const maxManifest = 64 << 10

func readManifest(fsys fs.FS) ([]byte, error) {
	f, err := fsys.Open(ManifestName)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("no %s", ManifestName)
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxManifest+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxManifest {
		return nil, fmt.Errorf("%s: larger than %d bytes", ManifestName, maxManifest)
	}
	return data, nil
}

func (m *Manifest) check() error {
	if m.Format != ManifestFormat {
		return fmt.Errorf("format %d, this capsa reads %d", m.Format, ManifestFormat)
	}
	lo, hi := m.AgentProtocol[0], m.AgentProtocol[1]
	if lo < 1 || hi < lo {
		return fmt.Errorf("agent protocol %d..%d: not a range", lo, hi)
	}
	if hi < agent.MinProtocolVersion || lo > agent.ProtocolVersion {
		return fmt.Errorf("its agent speaks protocol %d..%d, this capsa %d..%d",
			lo, hi, agent.MinProtocolVersion, agent.ProtocolVersion)
	}
	for _, f := range []struct {
		what string
		f    File
	}{{"kernel", m.Kernel}, {"initramfs", m.Initramfs}} {
		if err := f.f.check(); err != nil {
			return fmt.Errorf("%s: %w", f.what, err)
		}
	}
	return nil
}

func (f *File) check() error {
	if f.Name == "" || f.Name == "." || f.Name == ".." || f.Name == ManifestName || strings.ContainsAny(f.Name, "/\\\x00") {
		return fmt.Errorf("name %q: not a file name", f.Name)
	}
	if f.Size <= 0 || f.Size > MaxFileSize {
		return fmt.Errorf("%s: size %d out of range (1..%d)", f.Name, f.Size, MaxFileSize)
	}
	for _, h := range []string{f.SHA256, f.ContentSHA256} {
		if b, err := hex.DecodeString(h); err != nil || len(b) != sha256.Size || strings.ToLower(h) != h {
			return fmt.Errorf("%s: %q is not a SHA-256 in lower-case hex", f.Name, h)
		}
	}
	return nil
}

// Place is a directory Find searches.
type Place struct {
	What string // how the directory is named: "$CAPSA_ASSETS", "the build cache", "PREFIX/share/capsa"
	Dir  string // empty when it cannot be known (no home directory)
	Err  error  // why Dir is empty
}

// Places returns where Find searches after the built-in set, in order.
func Places() []Place {
	if d := os.Getenv("CAPSA_ASSETS"); d != "" {
		return []Place{{What: "$CAPSA_ASSETS", Dir: d}}
	}
	cache := Place{What: "the build cache"}
	if base, err := cacheDir(); err != nil {
		cache.Err = err
	} else {
		cache.Dir = filepath.Join(base, "assets")
	}
	return []Place{cache, {What: "PREFIX/share/capsa", Dir: filepath.Join(Prefix, "share", "capsa")}}
}

// cacheDir is capsa's cache: $CAPSA_CACHE, else the user's cache
// directory's capsa (as package image and the Makefile have it).
func cacheDir() (string, error) {
	if d := os.Getenv("CAPSA_CACHE"); d != "" {
		return d, nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(d, "capsa"), nil
}

var found struct {
	mu  sync.Mutex
	set *Set
}

// Find returns the first usable set (see the package comment). A set
// found is kept for the process, so its files are decompressed once;
// when none is found, the error names every place searched and why each
// failed, and the next call searches again.
func Find() (*Set, error) {
	found.mu.Lock()
	defer found.mu.Unlock()
	if found.set != nil {
		return found.set, nil
	}
	var why []string
	if fsys := builtin.FS(); fsys != nil {
		s, err := open(fsys, "built in")
		if err == nil {
			found.set = s
			return s, nil
		}
		why = append(why, "built in: "+err.Error())
	} else {
		why = append(why, "built in: none (built without -tags capsa_builtin)")
	}
	for _, p := range Places() {
		if p.Dir == "" {
			why = append(why, fmt.Sprintf("%s: %v", p.What, p.Err))
			continue
		}
		s, err := Open(p.Dir)
		if err == nil {
			s.Where = p.What + " " + p.Dir
			found.set = s
			return s, nil
		}
		why = append(why, fmt.Sprintf("%s %s: %v", p.What, p.Dir, err))
	}
	return nil, fmt.Errorf("assets: no guest kernel and initramfs found (%s); "+
		"install them with `make install` in a capsa checkout, set $CAPSA_ASSETS to a directory holding them, "+
		"or name a kernel and initramfs", strings.Join(why, "; "))
}

// Kernel returns the kernel of the set Find finds.
func Kernel() ([]byte, error) {
	s, err := Find()
	if err != nil {
		return nil, err
	}
	return s.Kernel()
}

// Initramfs returns the initramfs of the set Find finds.
func Initramfs() ([]byte, error) {
	s, err := Find()
	if err != nil {
		return nil, err
	}
	return s.Initramfs()
}

// unpack returns f's content: its unpacked copy in the cache, mapped, or
// else f decompressed and checked, stored in the cache when it can be.
func unpack(fsys fs.FS, f File) ([]byte, error) {
	fail := func(err error) ([]byte, error) { return nil, fmt.Errorf("assets: %s: %w", f.Name, err) }
	dir := ""
	if base, err := cacheDir(); err == nil {
		dir = filepath.Join(base, "unpacked")
		if data, err := mapUnpacked(filepath.Join(dir, f.ContentSHA256), f.Size); err == nil {
			return data, nil
		}
	}
	if dir != "" {
		path, err := unpackTo(fsys, f, dir)
		if err == nil {
			data, err := mapUnpacked(path, f.Size)
			if err != nil {
				return fail(err)
			}
			return data, nil
		}
		if !isCacheWriteError(err) {
			return fail(err)
		}
		// The cache cannot be written: decompress into memory.
	}
	var buf memWriter
	buf.b = make([]byte, 0, f.Size)
	if err := decompress(fsys, f, &buf); err != nil {
		return fail(err)
	}
	return buf.b, nil
}

// cacheWriteError marks a failure to write the unpacked cache, as opposed
// to a bad set.
type cacheWriteError struct{ err error }

func (e cacheWriteError) Error() string { return e.err.Error() }
func (e cacheWriteError) Unwrap() error { return e.err }

func isCacheWriteError(err error) bool {
	var c cacheWriteError
	return errors.As(err, &c)
}

type memWriter struct{ b []byte }

func (w *memWriter) Write(p []byte) (int, error) { w.b = append(w.b, p...); return len(p), nil }

// mapUnpacked maps path read-only if it holds size bytes, and marks it
// used (its modification time) so cleanup keeps it.
func mapUnpacked(path string, size int64) ([]byte, error) {
	fd, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fd.Close()
	st, err := fd.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() != size {
		return nil, fmt.Errorf("%s: %d bytes, want %d", path, st.Size(), size)
	}
	if time.Since(st.ModTime()) > touchAfter {
		now := time.Now()
		os.Chtimes(path, now, now) // best effort: at worst cleanup removes it early
	}
	// The cache is only ever replaced by rename, never truncated, so the
	// mapping stays valid for the process's life.
	data, err := unix.Mmap(int(fd.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_PRIVATE)
	if err == nil && size > 0 {
		mapped.Store(&data[0], struct{}{})
	}
	return data, err
}

// MapFile maps the file at path read-only: a kernel or initramfs the
// caller named. Copying it into guest memory then reads the page cache
// once, where os.ReadFile would first copy it into a heap buffer its size
// (in the nested host, each of that buffer's fresh pages a fault: about
// 70 ms for the project's kernel and initramfs). release unmaps it; until
// then Evict gives its pages back. What cannot be mapped (a pipe, an empty
// file) is read instead, and release does nothing.
//
// A mapped file truncated by someone else makes reading past its new end
// fault: vmm's loader turns that fault into an error.
func MapFile(path string) (data []byte, release func(), err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	if st.Mode().IsRegular() && st.Size() > 0 && st.Size() == int64(int(st.Size())) {
		if data, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_PRIVATE); err == nil {
			mapped.Store(&data[0], struct{}{})
			return data, func() {
				mapped.Delete(&data[0])
				unix.Munmap(data)
			}, nil
		}
	}
	data, err = io.ReadAll(f)
	return data, func() {}, err
}

// mapped holds the first byte of every file mapping mapUnpacked and
// MapFile made.
var mapped sync.Map

// Evict gives back the memory b's pages hold if b is one of this package's
// file mappings (Kernel, Initramfs): a VMM that has copied them into guest
// memory needs them no more, and they would otherwise count in its RSS
// for its whole life. The mapping stays valid: a later read brings the
// pages back from the page cache. Anything else (a file read into the
// heap, an in-memory decompression) is left alone.
func Evict(b []byte) {
	if len(b) == 0 {
		return
	}
	if _, ok := mapped.Load(&b[0]); ok {
		unix.Madvise(b, unix.MADV_DONTNEED)
	}
}

// An unpacked copy unused for unusedFor is removed when another is made;
// use refreshes its time at most every touchAfter.
const (
	unusedFor  = 7 * 24 * time.Hour
	touchAfter = time.Hour
)

// unpackTo decompresses f into dir under its content hash, checked, and
// returns the path. Errors writing dir are cacheWriteErrors.
func unpackTo(fsys fs.FS, f File, dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", cacheWriteError{err}
	}
	tmp, err := os.CreateTemp(dir, ".tmp-"+f.ContentSHA256[:16]+"-")
	if err != nil {
		return "", cacheWriteError{err}
	}
	defer os.Remove(tmp.Name()) // after the rename, a no-op
	err = decompress(fsys, f, writerFunc(func(p []byte) (int, error) {
		n, err := tmp.Write(p)
		if err != nil {
			err = cacheWriteError{err}
		}
		return n, err
	}))
	if cerr := tmp.Close(); err == nil && cerr != nil {
		err = cacheWriteError{cerr}
	}
	// The decoder's window (tens of MiB) is garbage now: give it back to
	// the system rather than keep it in the VMM's RSS for its life.
	debug.FreeOSMemory()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, f.ContentSHA256)
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return "", cacheWriteError{err}
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return "", cacheWriteError{err}
	}
	cleanUnpacked(dir, path)
	return path, nil
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// cleanUnpacked removes the unpacked copies (and work files of crashed
// unpacks) unused for unusedFor, but keep. A process that still maps one
// keeps its mapping.
func cleanUnpacked(dir, keep string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		if p == keep {
			continue
		}
		if info, err := e.Info(); err == nil && info.Mode().IsRegular() && time.Since(info.ModTime()) > unusedFor {
			os.Remove(p)
		}
	}
}

// decompress writes f's content to w, checking the compressed file's hash,
// the content's size and its hash.
func decompress(fsys fs.FS, f File, w io.Writer) error {
	src, err := fsys.Open(f.Name)
	if err != nil {
		return err
	}
	defer src.Close()
	zsum := sha256.New()
	dec, err := zstd.NewReader(io.TeeReader(src, zsum), zstd.WithDecoderMaxMemory(MaxFileSize), zstd.WithDecoderMaxWindow(1<<27))
	if err != nil {
		return err
	}
	defer dec.Close()
	sum := sha256.New()
	n, err := io.CopyN(io.MultiWriter(w, sum), dec, f.Size+1)
	if err != nil && err != io.EOF {
		if isCacheWriteError(err) {
			return err
		}
		return fmt.Errorf("decompress: %w", err)
	}
	if n != f.Size {
		return fmt.Errorf("%d bytes uncompressed, the manifest says %d", n, f.Size)
	}
	// The rest of the compressed file counts toward its hash too.
	if _, err := io.Copy(zsum, src); err != nil {
		return err
	}
	if got := hex.EncodeToString(zsum.Sum(nil)); got != f.SHA256 {
		return fmt.Errorf("SHA-256 %s, the manifest says %s", got, f.SHA256)
	}
	if got := hex.EncodeToString(sum.Sum(nil)); got != f.ContentSHA256 {
		return fmt.Errorf("content SHA-256 %s, the manifest says %s", got, f.ContentSHA256)
	}
	return nil
}
