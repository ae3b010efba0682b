// Package snapshot is a paused sandbox written to a directory, and read
// back: a versioned manifest (manifest.json), the VM's state (state.json,
// vmm.State: vCPUs, interrupt controllers, timer, clock, every device's
// transport), the guest's memory (memory, sparse: the pages the guest
// never touched are holes) and the files a sandbox adds (its writable
// root disk). Starting points: Write, Open, Verify.
//
// Everything read back is untrusted: the manifest and state are size-
// bounded, checksummed and decoded strictly, and vmm.Restore checks the
// state again as it checks a guest. Open opens every file once, never
// through a symbolic link, checks it with fstat (a regular file of the
// size the manifest says, owned by the user restoring and writable by no
// one else) and hands out that descriptor: a file swapped after Open, or
// a FIFO, is never read. The checksums (manifest.sha256 for the manifest,
// the manifest's for the rest) find damage, not forgery: whoever can
// write a snapshot can write its checksums too, which is why everything
// is checked as untrusted anyway. Firecracker's snapshot files (a
// versioned state beside a memory file mapped on restore) are the model.
//
// A layer (WriteWith, WriteOptions.Parent) is a snapshot written over an earlier one, its
// parent, in the same directory: its memory file holds only the pages
// that differ from the parent's (Manifest.MemoryRuns), and a restore maps
// the parent's memory and the layer's runs over it (MapMemory), down a
// chain of at most MaxChain snapshots. The layer names its parent by
// directory name and by its manifest's SHA-256: a parent changed since,
// replaced, or owned by someone else is refused. Squash writes a layer's
// flattened copy, a snapshot that needs no parent.
package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/internal/strictjson"
	"github.com/capsa-sandbox/capsa/vmm"
)

// Format and Version name the layout this package writes and reads.
const (
	Format  = "capsa-snapshot"
	Version = 2 // 2: manifest.sha256
	// LayerVersion is a layer's: a capsa that reads only version 2
	// refuses it by its version, not by a field it does not know.
	LayerVersion = 3
)

// Bounds on layers: how many snapshots a chain holds, the one without a
// parent included, and how many runs of pages a layer's memory holds
// (each is one mapping of a restored sandbox's process: their product
// stays well under the kernel's 65530 per process).
const (
	MaxChain     = 8
	MaxLayerRuns = 1024
)

// The files of a snapshot directory.
const (
	ManifestFile = "manifest.json"
	// ManifestSumFile holds the manifest's SHA-256, in hex.
	ManifestSumFile = "manifest.sha256"
	StateFile       = "state.json"
	MemoryFile      = "memory"
	// RootDiskFile is an image sandbox's writable root disk.
	RootDiskFile = "rootfs.ext4"
)

// Bounds on what Open reads into memory.
const (
	maxManifest = 1 << 20
	maxState    = 64 << 20
)

// Manifest describes a snapshot.
type Manifest struct {
	Format       string    `json:"format"`
	Version      int       `json:"version"`
	CapsaVersion string    `json:"capsa_version"`
	Created      time.Time `json:"created"`
	// Spec is the sandbox's description (sandbox.Spec), as JSON.
	Spec        json.RawMessage `json:"spec"`
	CPUModel    string          `json:"cpu_model"` // the host CPU it ran on
	CPUs        int             `json:"cpus"`
	MemoryBytes uint64          `json:"memory_bytes"`
	// MainProcess is the agent's ID of the sandbox's main process.
	MainProcess int `json:"main_process,omitempty"`
	// ImageDigest is the image under an image sandbox's root (its
	// writable layer is RootDiskFile).
	ImageDigest string `json:"image_digest,omitempty"`
	// Files are the snapshot's files by name, with their sizes and
	// checksums.
	Files map[string]File `json:"files"`
	// Parent is, for a layer, the snapshot it lies over.
	Parent *Parent `json:"parent,omitempty"`
	// MemoryRuns are, for a layer, the runs of its memory file that hold
	// pages; every other page is the parent's.
	MemoryRuns []guestmem.Run `json:"memory_runs,omitempty"`
	// DiskOnly: the snapshot holds the sandbox's spec and its files (an
	// image sandbox's root disk, its interception's CA) but no VM state
	// and no memory (WriteDisk): it can be booted again from its disk,
	// never restored.
	DiskOnly bool `json:"disk_only,omitempty"`
}

// Parent names a layer's parent: a directory beside the layer's own (so
// that a snapshot from elsewhere cannot point a restore at any directory
// of the user's), and its manifest's SHA-256 when the layer was written.
type Parent struct {
	Name           string `json:"name"`
	ManifestSHA256 string `json:"manifest_sha256"`
}

// File is one file of a snapshot: its size and a checksum, SHA-256 or,
// for the memory, CRC-32C (Castagnoli) of its pages that are not all
// zero, each after its 8-byte offset. Checksums find damage, not
// tampering: a snapshot is checked as untrusted input on restore anyway,
// and the memory's CRC costs a tenth of a SHA-256 (a snapshot's time is
// mostly its memory's checksum).
type File struct {
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256,omitempty"`
	CRC32C string `json:"crc32c,omitempty"`
}

// Snapshot is a snapshot read back by Open, holding its files open.
type Snapshot struct {
	Dir      string
	Manifest Manifest
	// ManifestSHA256 is the manifest's checksum: what a layer over this
	// snapshot records of it.
	ManifestSHA256 string
	State          *vmm.State
	// Parent is a layer's parent, opened and checked as this snapshot
	// was (nil for a snapshot that has none): its manifest and memory
	// file only (its State is nil, its other files unopened).
	Parent   *Snapshot
	files    map[string]*os.File // every file the manifest names, opened and checked once
	manifest []byte              // the manifest as read, for Lend
}

// File is the snapshot's file name as Open opened and checked it (nil
// if the manifest names none): read it through this, never by its path.
func (s *Snapshot) File(name string) *os.File { return s.files[name] }

// Close closes the snapshot's files, and its parent's (a memory mapped
// from them stays).
func (s *Snapshot) Close() error {
	var errs []error
	for _, f := range s.files {
		errs = append(errs, f.Close())
	}
	s.files = nil
	if s.Parent != nil {
		errs = append(errs, s.Parent.Close())
	}
	return errors.Join(errs...)
}

// Chain is how many snapshots a restore of this one maps: 1, and one
// more for each parent.
func (s *Snapshot) Chain() int {
	n := 1
	for p := s.Parent; p != nil; p = p.Parent {
		n++
	}
	return n
}

// Extra writes one more file of the snapshot at path (a root disk's
// copy, say) and returns its SHA-256, or "" to leave it unhashed.
type Extra func(path string) (sum string, err error)

// Write writes a snapshot of a paused VM to dir, which must not exist:
// everything goes to a temporary directory beside it, renamed to dir once
// complete, so a failed or interrupted Write leaves no half snapshot. m's
// Format, Version, CapsaVersion, Files, Parent and MemoryRuns are filled
// here, and Created where it is zero.
func Write(dir string, m Manifest, st *vmm.State, mem *guestmem.Memory, extra map[string]Extra) error {
	return WriteWith(dir, m, st, mem, extra, WriteOptions{})
}

// WriteOptions choose how WriteWith writes a snapshot.
type WriteOptions struct {
	// Parent, when not nil, makes the snapshot a layer over it: a
	// snapshot in the same directory as dir, of the same vCPUs and memory
	// size, which must stay, unchanged, for as long as the layer is
	// restored. The memory file holds only the pages of mem that differ
	// from the parent's memory: found by reading the parent's whole
	// memory and comparing it page by page, or given as Runs.
	Parent *Snapshot
	// Runs, when not nil, are the runs of mem that differ from Parent's
	// memory: mem.Dirty's, for memory mapped from the parent's chain
	// since (guestmem.Memory.Remap). Pages outside them must equal the
	// parent's; nothing here can check that.
	Runs []guestmem.Run
	// Transient: the snapshot is for sandboxes restored from it at once
	// and is gone before long (a fork's): its memory gets no checksum
	// (Verify skips it) and is not flushed to the disk, both of which
	// cost time the sandbox spends paused.
	Transient bool
	// PreCopy, when not nil, is the memory file begun while the sandbox
	// still ran (PreCopy's, for this dir): the snapshot's memory is it,
	// finished (guestmem.PreCopy.Finish), instead of the whole memory
	// written now. Only of a transient snapshot without a parent.
	PreCopy *MemoryCopy
	// Written, when not nil, is told how far the memory's write has
	// come (guestmem.Written), for showing progress.
	Written guestmem.Written
}

// MemoryCopy is a transient snapshot's memory file written while the
// sandbox still runs, for WriteWith to finish while it is paused.
type MemoryCopy struct {
	pc    *guestmem.PreCopy
	f     *os.File
	taken bool
	// Pages is how many pages WriteWith wrote again or cleared to finish
	// it: what changed while it was written.
	Pages int
	// Failed is why WriteWith could not finish it, if it could not: it
	// then wrote the whole memory, as without a copy.
	Failed error
}

// PreCopy begins the memory of a transient snapshot to be written to dir
// (WriteOptions.PreCopy) while the VM may still run: a file beside dir,
// which WriteWith makes the snapshot's memory file. clearRefs is
// guestmem.OpenClearRefs's; written, when not nil, is told how far the
// copy has come. Close removes the file if no snapshot took it. Memory
// mapped from files, and a kernel that does not track soft-dirty pages
// (guestmem.ErrNoSoftDirty), are refused.
func PreCopy(dir string, mem *guestmem.Memory, clearRefs *os.File, written guestmem.Written) (*MemoryCopy, error) {
	f, err := os.CreateTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".memory-")
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	pc, err := mem.PreCopy(f, clearRefs, written)
	if err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	return &MemoryCopy{pc: pc, f: f}, nil
}

// Cleared is how long clearing the soft-dirty bits took, at the copy's
// start (guestmem.PreCopy.Cleared): a time its guest may stand still.
func (c *MemoryCopy) Cleared() time.Duration { return c.pc.Cleared }

// Close closes the copy, removing its file unless a snapshot took it.
func (c *MemoryCopy) Close() error {
	c.pc.Close()
	err := c.f.Close()
	if !c.taken {
		os.Remove(c.f.Name())
	}
	return err
}

// ErrDiskOnly is the error for restoring, or layering over, a snapshot of
// the disk alone (Manifest.DiskOnly): it holds no memory.
var ErrDiskOnly = errors.New("it holds the disk alone, no memory: it can only be booted again")

// WriteWith is Write with options: a layer, or a transient snapshot.
func WriteWith(dir string, m Manifest, st *vmm.State, mem *guestmem.Memory, extra map[string]Extra, o WriteOptions) error {
	if o.Parent != nil && o.Parent.Manifest.DiskOnly {
		return fmt.Errorf("snapshot: the parent %s: %w", o.Parent.Dir, ErrDiskOnly)
	}
	if o.PreCopy != nil && (o.Parent != nil || !o.Transient) {
		return errors.New("snapshot: a memory copy begun while running is for a transient snapshot without a parent")
	}
	if o.PreCopy != nil {
		m.Version, m.Parent, m.MemoryRuns = Version, nil, nil
		c := o.PreCopy
		return write(dir, m, st, mem.Size(), extra, true, func(f *os.File, _ io.Writer) error {
			n, err := c.pc.Finish()
			if err != nil {
				// Still paused: the whole memory, then.
				c.Failed = err
				return mem.WriteFile(f, nil, o.Written)
			}
			// The copy, finished, takes the place of the empty memory
			// file write made (whose descriptor write closes).
			if err := os.Rename(c.f.Name(), f.Name()); err != nil {
				return err
			}
			c.taken, c.Pages = true, n
			if o.Written != nil {
				o.Written(int64(mem.Size())) // the pages changed since, written
			}
			return nil
		})
	}
	if o.Parent == nil {
		m.Version, m.Parent, m.MemoryRuns = Version, nil, nil
		return write(dir, m, st, mem.Size(), extra, o.Transient, func(f *os.File, h io.Writer) error { return mem.WriteFile(f, h, o.Written) })
	}
	parent, runs := o.Parent, o.Runs
	pdir, err := filepath.Abs(parent.Dir)
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	adir, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	switch pm := parent.Manifest; {
	case filepath.Dir(pdir) != filepath.Dir(adir) || pdir == adir:
		return fmt.Errorf("snapshot: a layer's parent must be a snapshot in the same directory: %s is not beside %s", parent.Dir, dir)
	case pm.MemoryBytes != mem.Size() || pm.CPUs != m.CPUs:
		return fmt.Errorf("snapshot: the parent %s is of %d vCPUs and %d bytes of memory, the sandbox of %d and %d", parent.Dir, pm.CPUs, pm.MemoryBytes, m.CPUs, mem.Size())
	case parent.Chain() >= MaxChain:
		return fmt.Errorf("snapshot: the parent %s is a chain of %d snapshots already, the most a layer may lie over is %d: squash it first", parent.Dir, parent.Chain(), MaxChain-1)
	}
	if runs == nil {
		base, layers, err := parent.memoryFiles()
		if err != nil {
			return err
		}
		if runs, err = mem.Delta(guestmem.LayersReader(base, layers), MaxLayerRuns); err != nil {
			return fmt.Errorf("snapshot: %w", err)
		}
	} else if err := guestmem.CheckRuns(runs, mem.Size(), MaxLayerRuns); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	m.Version, m.MemoryRuns = LayerVersion, runs
	m.Parent = &Parent{Name: filepath.Base(pdir), ManifestSHA256: parent.ManifestSHA256}
	return write(dir, m, st, mem.Size(), extra, o.Transient, func(f *os.File, h io.Writer) error { return mem.WriteRuns(f, runs, h, o.Written) })
}

// WriteDisk writes to dir (which must not exist) a snapshot without VM
// state or memory (Manifest.DiskOnly): m, whose CPUs and MemoryBytes say
// the sandbox's shape, and the files of extra, which must hold an image
// sandbox's root disk. It is for booting the sandbox again from what it
// wrote (E2B's pause without memory); nothing of the VM is kept.
func WriteDisk(dir string, m Manifest, extra map[string]Extra) error {
	if _, ok := extra[RootDiskFile]; !ok || m.ImageDigest == "" {
		return errors.New("snapshot: a snapshot of the disk alone is of an image sandbox's root disk")
	}
	m.Version, m.Parent, m.MemoryRuns, m.DiskOnly = Version, nil, nil, true
	return write(dir, m, nil, 0, extra, false, nil)
}

// write is WriteWith, with writeMem writing the memory file and, to its
// second argument when that is not nil, its checksum's bytes. A disk-only
// snapshot (m.DiskOnly) has neither state nor memory.
func write(dir string, m Manifest, st *vmm.State, memSize uint64, extra map[string]Extra, transient bool, writeMem func(f *os.File, h io.Writer) error) error {
	if _, err := os.Lstat(dir); err == nil {
		return fmt.Errorf("snapshot: %s already exists", dir)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".tmp-")
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	defer os.RemoveAll(tmp)
	m.Format, m.CapsaVersion = Format, capsaVersion()
	if m.Created.IsZero() {
		m.Created = time.Now().UTC()
	}
	m.Files = map[string]File{}
	if m.DiskOnly {
		return writeRest(dir, tmp, m, extra)
	}
	b, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("snapshot: state: %w", err)
	}
	if err := os.WriteFile(filepath.Join(tmp, StateFile), b, 0o600); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	sum := sha256.Sum256(b)
	m.Files[StateFile] = File{Size: int64(len(b)), SHA256: hex.EncodeToString(sum[:])}

	f, err := os.OpenFile(filepath.Join(tmp, MemoryFile), os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	// A transient snapshot's memory is not hashed at all: the hash is
	// most of a snapshot's time.
	h := crc32.New(crc32.MakeTable(crc32.Castagnoli))
	var memSum io.Writer
	if !transient {
		memSum = h
	}
	err = writeMem(f, memSum)
	if err == nil && !transient {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	mf := File{Size: int64(memSize)}
	if !transient {
		mf.CRC32C = hex.EncodeToString(h.Sum(nil))
	}
	m.Files[MemoryFile] = mf
	return writeRest(dir, tmp, m, extra)
}

// writeRest writes the extra files and the manifest into tmp, and renames
// it dir: the end of write.
func writeRest(dir, tmp string, m Manifest, extra map[string]Extra) error {
	for name, write := range extra {
		if !validName(name) {
			return fmt.Errorf("snapshot: file name %q", name)
		}
		p := filepath.Join(tmp, name)
		s, err := write(p)
		if err != nil {
			return fmt.Errorf("snapshot: %s: %w", name, err)
		}
		fi, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("snapshot: %s: %w", name, err)
		}
		m.Files[name] = File{Size: fi.Size(), SHA256: s}
	}
	mb, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("snapshot: manifest: %w", err)
	}
	mb = append(mb, '\n')
	if err := os.WriteFile(filepath.Join(tmp, ManifestFile), mb, 0o600); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	msum := sha256.Sum256(mb)
	if err := os.WriteFile(filepath.Join(tmp, ManifestSumFile), []byte(hex.EncodeToString(msum[:])+"\n"), 0o600); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	return nil
}

// Squash writes to out (which must not exist) the snapshot s flattened:
// the same state, files and manifest, its memory whole, no parent. A
// snapshot without a parent is copied.
func Squash(s *Snapshot, out string) error {
	mem, err := s.MapMemory()
	if err != nil {
		return err
	}
	defer mem.Close()
	extra := map[string]Extra{}
	for name, f := range s.Manifest.Files {
		if name == StateFile || name == MemoryFile {
			continue
		}
		in := s.files[name]
		if in == nil {
			return fmt.Errorf("snapshot %s: closed", s.Dir)
		}
		extra[name] = func(path string) (string, error) { return f.SHA256, CloneFrom(in, path) }
	}
	return Write(out, s.Manifest, s.State, mem, extra)
}

// validName is a plain file name: no directories, nothing hidden.
func validName(name string) bool {
	return name != "" && !strings.ContainsAny(name, "/\\\x00") && !strings.HasPrefix(name, ".") && len(name) <= 64
}

func capsaVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "unknown"
}

// Open reads the snapshot in dir: its manifest and state, checked against
// their sizes and checksums and decoded strictly, and every file the
// manifest names, each opened once (never through a symbolic link) and
// checked (see the package doc), and a layer's parents likewise. The
// memory's own checksum is left to Verify (it reads every page). Close
// the snapshot when done.
func Open(dir string) (*Snapshot, error) { return open(dir, 1) }

// open is Open of the depth'th snapshot of a chain.
func open(dir string, depth int) (_ *Snapshot, err error) {
	s := &Snapshot{Dir: dir, files: map[string]*os.File{}}
	defer func() {
		if err != nil {
			s.Close()
			err = fmt.Errorf("snapshot %s: %w", dir, err)
		}
	}()
	d, err := openChecked(unix.AT_FDCWD, dir, true)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	dfd := int(d.Fd())
	if s.ManifestSHA256, s.manifest, err = readManifest(dfd, &s.Manifest); err != nil {
		return nil, err
	}
	if p := s.Manifest.Parent; p != nil {
		if depth >= MaxChain {
			return nil, fmt.Errorf("a chain of more than %d snapshots: refused", MaxChain)
		}
		// Beside this one, by name (ParseManifest checked it is one).
		if s.Parent, err = open(filepath.Join(filepath.Dir(filepath.Clean(dir)), p.Name), depth+1); err != nil {
			return nil, fmt.Errorf("its parent: %w", err)
		}
		if err := checkLink(s, s.Parent); err != nil {
			return nil, err
		}
	}
	for name, want := range s.Manifest.Files {
		if depth > 1 && name != MemoryFile {
			continue // of a parent, only the memory is used
		}
		f, err := openChecked(dfd, name, false)
		if err != nil {
			return nil, err
		}
		s.files[name] = f
		fi, err := f.Stat()
		if err != nil {
			return nil, err
		}
		if fi.Size() != want.Size {
			return nil, fmt.Errorf("%s is %d bytes, the manifest says %d: truncated or replaced", name, fi.Size(), want.Size)
		}
	}
	if depth > 1 || s.Manifest.DiskOnly {
		return s, nil
	}
	sb, err := s.ReadFile(StateFile, maxState)
	if err != nil {
		return nil, err
	}
	if sum := sha256.Sum256(sb); hex.EncodeToString(sum[:]) != s.Manifest.Files[StateFile].SHA256 {
		return nil, fmt.Errorf("%s does not match its checksum: corrupted", StateFile)
	}
	if s.State, err = ParseState(sb); err != nil {
		return nil, err
	}
	if s.State.CPUs != s.Manifest.CPUs || s.State.MemoryBytes != s.Manifest.MemoryBytes {
		return nil, fmt.Errorf("the state is of %d vCPUs and %d bytes, the manifest says %d and %d", s.State.CPUs, s.State.MemoryBytes, s.Manifest.CPUs, s.Manifest.MemoryBytes)
	}
	return s, nil
}

// checkLink says what is wrong with parent, opened, as the parent of the
// layer s, if anything: it holds memory, its manifest is the one s was
// written over, and it is of s's vCPUs and memory size (Open, OpenLent).
func checkLink(s, parent *Snapshot) error {
	p, pm := s.Manifest.Parent, parent.Manifest
	switch {
	case pm.DiskOnly:
		return fmt.Errorf("its parent %s holds no memory (a snapshot of the disk alone): refused", p.Name)
	case parent.ManifestSHA256 != p.ManifestSHA256:
		return fmt.Errorf("its parent %s is not the snapshot it was written over (its manifest's checksum differs): refused", p.Name)
	case pm.CPUs != s.Manifest.CPUs || pm.MemoryBytes != s.Manifest.MemoryBytes:
		return fmt.Errorf("its parent %s is of %d vCPUs and %d bytes, it of %d and %d: refused", p.Name, pm.CPUs, pm.MemoryBytes, s.Manifest.CPUs, s.Manifest.MemoryBytes)
	}
	return nil
}

// readManifest reads, checks and decodes the manifest of the snapshot
// directory dirfd into m and returns its SHA-256.
func readManifest(dirfd int, m *Manifest) (string, []byte, error) {
	mb, err := readChecked(dirfd, ManifestFile, maxManifest)
	if err != nil {
		return "", nil, err
	}
	sum, err := readChecked(dirfd, ManifestSumFile, 128)
	if err != nil {
		return "", nil, err
	}
	ms := sha256.Sum256(mb)
	hexSum := hex.EncodeToString(ms[:])
	if strings.TrimSpace(string(sum)) != hexSum {
		return "", nil, fmt.Errorf("%s does not match %s: corrupted", ManifestFile, ManifestSumFile)
	}
	return hexSum, mb, ParseManifest(mb, m)
}

// ReadManifest reads and checks the manifest of the snapshot in dir alone,
// as Open does (no symbolic link, a bounded size, its checksum, strict
// decoding), opening nothing else, and returns it with its SHA-256.
func ReadManifest(dir string) (*Manifest, string, error) {
	d, err := openChecked(unix.AT_FDCWD, dir, true)
	if err != nil {
		return nil, "", fmt.Errorf("snapshot %s: %w", dir, err)
	}
	defer d.Close()
	var m Manifest
	sum, _, err := readManifest(int(d.Fd()), &m)
	if err != nil {
		return nil, "", fmt.Errorf("snapshot %s: %w", dir, err)
	}
	return &m, sum, nil
}

// PruneChain removes from dir, a fork chain's directory
// (sandbox.SnapshotOptions.Fork), every entry but its newest snapshot
// (the greatest number among the names: a fork's is the time it was
// taken, in nanoseconds) and the snapshots that one lies over. Call it
// only while no fork of the chain is under way: one being written or
// restored from would go too.
func PruneChain(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("snapshot: prune %s: %w", dir, err)
	}
	newest, at := "", int64(-1)
	for _, e := range entries {
		n, err := strconv.ParseInt(e.Name(), 10, 64)
		if err != nil || n <= at {
			continue
		}
		if _, err := os.Lstat(filepath.Join(dir, e.Name(), ManifestFile)); err == nil {
			newest, at = e.Name(), n
		}
	}
	if newest == "" {
		return nil
	}
	// The newest's chain, by the parents its manifests name: nothing
	// else of them is read.
	keep := map[string]bool{}
	for name, n := newest, 0; name != "" && n < MaxChain; n++ {
		keep[name] = true
		m, _, err := ReadManifest(filepath.Join(dir, name))
		if err != nil {
			return fmt.Errorf("snapshot: prune %s: %w", dir, err)
		}
		name = ""
		if m.Parent != nil {
			name = m.Parent.Name
		}
	}
	var errs []error
	for _, e := range entries {
		if !keep[e.Name()] {
			errs = append(errs, os.RemoveAll(filepath.Join(dir, e.Name())))
		}
	}
	return errors.Join(errs...)
}

// readChecked reads the file name beneath dirfd, opened by openChecked,
// refusing more than limit bytes.
func readChecked(dirfd int, name string, limit int64) ([]byte, error) {
	f, err := openChecked(dirfd, name, false)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return readBounded(f, limit)
}

// ReadFile reads the snapshot's file name, through the descriptor Open
// checked, refusing more than limit bytes.
func (s *Snapshot) ReadFile(name string, limit int64) ([]byte, error) {
	f := s.files[name]
	if f == nil {
		return nil, fmt.Errorf("%s: not in the snapshot: %w", name, fs.ErrNotExist)
	}
	return readBounded(f, limit)
}

// openChecked opens name beneath the directory dirfd (AT_FDCWD: from the
// working directory), never following a symbolic link in its last
// component and never blocking (a FIFO), and checks what it got: a
// directory (dir) or a regular file, owned by the user opening it (root
// may open anyone's: a fork's snapshot is its jailed supervisor's) and
// writable by no other.
func openChecked(dirfd int, name string, dir bool) (*os.File, error) {
	flags := unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_CLOEXEC
	if dir {
		flags |= unix.O_DIRECTORY
	}
	fd, err := unix.Openat(dirfd, name, flags, 0)
	if err != nil {
		switch {
		case errors.Is(err, unix.ELOOP):
			return nil, fmt.Errorf("%s is a symbolic link: refused", name)
		case dir && errors.Is(err, unix.ENOTDIR):
			return nil, fmt.Errorf("%s is a symbolic link, or not a directory: refused", name)
		}
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("stat %s: %w", name, err)
	}
	typ := uint32(unix.S_IFREG)
	if dir {
		typ = unix.S_IFDIR
	}
	euid := os.Geteuid()
	switch {
	case st.Mode&unix.S_IFMT != typ:
		err = fmt.Errorf("%s is not a regular %s: refused", name, map[bool]string{true: "directory", false: "file"}[dir])
	case euid != 0 && int(st.Uid) != euid:
		err = fmt.Errorf("%s belongs to user %d, not to the user restoring it (%d): refused", name, st.Uid, euid)
	case st.Mode&0o022 != 0:
		err = fmt.Errorf("%s is writable by others (mode %04o): refused", name, st.Mode&0o7777)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// ParseManifest decodes and checks a manifest.
func ParseManifest(b []byte, m *Manifest) error {
	if err := strictjson.Decode(b, m); err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	switch {
	case m.Format != Format:
		return fmt.Errorf("manifest: format %q, not a capsa snapshot", m.Format)
	case m.Version != Version && m.Version != LayerVersion:
		return fmt.Errorf("manifest: snapshot version %d (written by capsa %s); this capsa reads versions %d and %d", m.Version, m.CapsaVersion, Version, LayerVersion)
	case (m.Version == LayerVersion) != (m.Parent != nil) || m.Parent == nil && m.MemoryRuns != nil:
		return fmt.Errorf("manifest: version %d with a parent %v and %d runs of memory", m.Version, m.Parent != nil, len(m.MemoryRuns))
	case m.CPUs < 1 || m.CPUs > vmm.MaxCPUs:
		return fmt.Errorf("manifest: %d vCPUs", m.CPUs)
	case m.MemoryBytes == 0 || m.MemoryBytes%4096 != 0:
		return fmt.Errorf("manifest: %d bytes of memory", m.MemoryBytes)
	case len(m.Spec) == 0:
		return errors.New("manifest: no sandbox spec")
	}
	for _, name := range []string{StateFile, MemoryFile} {
		if _, ok := m.Files[name]; ok == m.DiskOnly {
			if m.DiskOnly {
				return fmt.Errorf("manifest: a snapshot of the disk alone with a %s", name)
			}
			return fmt.Errorf("manifest: no %s", name)
		}
	}
	if m.DiskOnly && (m.Parent != nil || m.MainProcess != 0 || m.ImageDigest == "") {
		return errors.New("manifest: a snapshot of the disk alone is of an image sandbox, with no parent and no process")
	}
	for name, f := range m.Files {
		if !validName(name) || name == ManifestFile || name == ManifestSumFile || f.Size < 0 {
			return fmt.Errorf("manifest: file %q of %d bytes", name, f.Size)
		}
	}
	if _, ok := m.Files[RootDiskFile]; ok != (m.ImageDigest != "") {
		return fmt.Errorf("manifest: image %q with a root disk %v", m.ImageDigest, ok)
	}
	if !m.DiskOnly && m.Files[MemoryFile].Size != int64(m.MemoryBytes) {
		return fmt.Errorf("manifest: a memory file of %d bytes for %d bytes of memory", m.Files[MemoryFile].Size, m.MemoryBytes)
	}
	if p := m.Parent; p != nil {
		if !validName(p.Name) {
			return fmt.Errorf("manifest: parent %q: not the name of a directory beside this one", p.Name)
		}
		if b, err := hex.DecodeString(p.ManifestSHA256); err != nil || len(b) != sha256.Size {
			return fmt.Errorf("manifest: parent %s: checksum %q", p.Name, p.ManifestSHA256)
		}
		if err := guestmem.CheckRuns(m.MemoryRuns, m.MemoryBytes, MaxLayerRuns); err != nil {
			return fmt.Errorf("manifest: %w", err)
		}
	}
	return nil
}

// ParseState decodes a VM state; vmm.Restore checks it against the VM.
func ParseState(b []byte) (*vmm.State, error) {
	var st vmm.State
	if err := strictjson.Decode(b, &st); err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	if st.Version != vmm.StateVersion {
		return nil, fmt.Errorf("state: version %d; this capsa reads version %d", st.Version, vmm.StateVersion)
	}
	return &st, nil
}

// readBounded reads f from its start, refusing more than limit bytes.
func readBounded(f *os.File, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.NewSectionReader(f, 0, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s is larger than %d bytes", filepath.Base(f.Name()), limit)
	}
	return b, nil
}

// MapMemory maps the snapshot's memory copy-on-write (guestmem.Map): every
// sandbox restored from it shares the pages it has not written. A layer's
// is its chain's, each layer's runs mapped over its parent's memory
// (guestmem.MapLayers).
func (s *Snapshot) MapMemory() (*guestmem.Memory, error) {
	if s.Manifest.DiskOnly {
		return nil, fmt.Errorf("snapshot %s: %w", s.Dir, ErrDiskOnly)
	}
	base, layers, err := s.memoryFiles()
	if err != nil {
		return nil, err
	}
	m, err := guestmem.MapLayers(base, s.Manifest.MemoryBytes, layers)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", s.Dir, err)
	}
	return m, nil
}

// memoryFiles are the memory files of the chain: the first snapshot's,
// and the layers over it in order.
func (s *Snapshot) memoryFiles() (*os.File, []guestmem.Layer, error) {
	var layers []guestmem.Layer
	base := s
	for ; base.Parent != nil; base = base.Parent {
		f := base.files[MemoryFile]
		if f == nil {
			return nil, nil, fmt.Errorf("snapshot %s: closed", base.Dir)
		}
		layers = append(layers, guestmem.Layer{File: f, Runs: base.Manifest.MemoryRuns})
	}
	slices.Reverse(layers)
	f := base.files[MemoryFile]
	if f == nil {
		return nil, nil, fmt.Errorf("snapshot %s: closed", base.Dir)
	}
	return f, layers, nil
}

// Verify reads every file the manifest hashes and checks it, and a
// layer's parents' likewise: a corrupted memory file is found here, not
// by Open.
func Verify(dir string) error {
	s, err := Open(dir)
	if err != nil {
		return err
	}
	defer s.Close()
	for ; s != nil; s = s.Parent {
		if err := s.verify(); err != nil {
			return err
		}
	}
	return nil
}

// verify checks the files of s itself; a layer's memory file holds the
// pages of its runs.
func (s *Snapshot) verify() error {
	dir := s.Dir
	for name, f := range s.Manifest.Files {
		if name == StateFile || s.files[name] == nil { // checked by Open; a parent's unused files
			continue
		}
		var h hash.Hash
		want := f.CRC32C
		switch {
		case f.CRC32C != "":
			h = crc32.New(crc32.MakeTable(crc32.Castagnoli))
		case f.SHA256 != "":
			h, want = sha256.New(), f.SHA256
		default:
			continue
		}
		if name == MemoryFile {
			mem, err := guestmem.Map(s.files[name], s.Manifest.MemoryBytes)
			if err != nil {
				return fmt.Errorf("snapshot %s: %w", dir, err)
			}
			if s.Parent != nil {
				err = mem.HashRuns(h, s.Manifest.MemoryRuns)
			} else {
				err = mem.Hash(h)
			}
			mem.Close()
			if err != nil {
				return fmt.Errorf("snapshot %s: %w", dir, err)
			}
		} else {
			fh := s.files[name]
			if _, err := io.Copy(h, io.NewSectionReader(fh, 0, f.Size)); err != nil {
				return fmt.Errorf("snapshot %s: %w", dir, err)
			}
		}
		got := hex.EncodeToString(h.Sum(nil))
		if got != want {
			return fmt.Errorf("snapshot %s: %s does not match its checksum: corrupted", dir, name)
		}
	}
	return nil
}
