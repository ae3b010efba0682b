// Package volume keeps capsa's named volumes: directories that outlive
// sandboxes, that sandboxes mount by name (several at once, from different
// processes, each seeing the others' writes), each with an optional size
// quota that the host enforces. Its starting point is Open, which returns
// the Root of a volumes directory (by default <state dir>/volumes); Create,
// Get, List and Remove manage volumes, and Mount gives a sandbox what it
// serves one with: the data directory and the p9fs.Quota its file server
// charges.
//
// # On disk
//
//	<root>/NAME/
//	    volume.json   name, creation time, quota (bytes, 0: none)
//	    data/         what the guest sees
//	    usage         the bytes charged: 8 bytes, little-endian, under flock
//	    mounted       flock'ed shared by every Mount, for its life
//	    holds         byte-range (OFD) locks: one per inode a Mount holds
//	    orphans/      removed directories still held: INODE -> charge
//
// # The quota
//
// What counts, and how each operation is charged, is p9fs.Quota's rule:
// 4 KiB per inode plus the apparent size of every regular file and
// directory rounded up to 4 KiB (so sparse files count in full). Every
// operation that changes it runs with the usage file locked (flock
// LOCK_EX) across looking at the sizes, refusing with ENOSPC what would
// pass the quota, the syscall itself and recording the change, so
// sandboxes in different processes writing at once never take the volume
// past it. Writes are refused whole (no short writes).
//
// An inode that loses its last link while some Mount still holds it (the
// guest keeps files it has looked up, and may write to a file it unlinked)
// stays charged until the last Mount lets go of it: each Mount takes a
// read lock on the byte of the holds file at the inode's number for every
// inode it holds, and whoever removes or releases an inode asks the kernel
// whether any other Mount still has that byte locked.
//
// The counter is repaired from the files themselves whenever nobody has
// the volume mounted: a Mount that finds itself alone (flock LOCK_EX|NB
// on mounted) recounts before serving, and so do Get and List. That fixes
// a count a crash left behind and files the host changed; while a volume
// is mounted, host-side changes to data/ are not seen by the count.
//
// A volume's usage does not include the file system's own overhead
// beyond that rule (extent trees of very fragmented files, a directory's
// index): under one percent in the worst case.
package volume

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/internal/statedir"
	"github.com/capsa-sandbox/capsa/p9fs"
	"golang.org/x/sys/unix"
)

// Files of a volume's directory.
const (
	metaFile    = "volume.json"
	dataDir     = "data"
	usageFile   = "usage"
	mountedFile = "mounted"
	holdsFile   = "holds"
	orphansDir  = "orphans"
)

var (
	// ErrNotFound is returned for a name with no volume.
	ErrNotFound = errors.New("no such volume")
	// ErrExists is returned when a name is taken.
	ErrExists = errors.New("a volume with that name exists")
	// ErrInUse is returned by Remove for a volume that is mounted.
	ErrInUse = errors.New("the volume is in use")
)

// Root is a directory of volumes.
type Root struct{ dir string }

// DefaultDir is where the CLI keeps volumes: DirIn of the default state
// directory.
func DefaultDir() (string, error) {
	d, err := statedir.Default()
	if err != nil {
		return "", fmt.Errorf("volume: %w", err)
	}
	return DirIn(d), nil
}

// DirIn is the volumes directory of the state directory stateDir:
// stateDir/volumes.
func DirIn(stateDir string) string { return filepath.Join(stateDir, "volumes") }

// Open returns the volumes in dir ("": DefaultDir), making it (0700) if
// needed.
func Open(dir string) (*Root, error) {
	if dir == "" {
		var err error
		if dir, err = DefaultDir(); err != nil {
			return nil, err
		}
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("volume: open %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("volume: open %s: %w", dir, err)
	}
	return &Root{dir: abs}, nil
}

// Dir is the volumes directory (absolute).
func (r *Root) Dir() string { return r.dir }

// CheckName refuses a name that cannot be a volume's: the same rule as a
// sandbox's name (statedir.ValidName). A name never holds a slash, which
// is how `-v` tells a volume from a host directory.
func CheckName(name string) error {
	if !statedir.ValidName(name) {
		return fmt.Errorf("volume name %q: want %s", name, statedir.NameRule)
	}
	return nil
}

// meta is volume.json.
type meta struct {
	Name    string    `json:"name"`
	Created time.Time `json:"created"`
	Quota   int64     `json:"quota,omitempty"`
}

// Info describes a volume.
type Info struct {
	Name    string    `json:"name"`
	Created time.Time `json:"created"`
	// Quota is the most the volume may take, in bytes; 0: no quota.
	Quota int64 `json:"quota"`
	// Used is what the volume takes by the quota's rule (see the package
	// documentation), in bytes.
	Used int64 `json:"used"`
	// InUse says some sandbox has it mounted.
	InUse bool `json:"in_use"`
	// Path is the data directory on the host: what the guest sees.
	Path string `json:"path"`
}

func (r *Root) path(name string) string { return filepath.Join(r.dir, name) }

// Create makes the volume name with a quota of quota bytes (0: none).
func (r *Root) Create(name string, quota int64) (*Info, error) {
	if err := CheckName(name); err != nil {
		return nil, fmt.Errorf("volume: create: %w", err)
	}
	if quota < 0 {
		return nil, fmt.Errorf("volume: create %s: negative quota %d", name, quota)
	}
	final := r.path(name)
	if _, err := os.Lstat(final); err == nil {
		return nil, fmt.Errorf("volume: create %s: %w", name, ErrExists)
	}
	// Made aside and renamed into place, so that nobody sees half a
	// volume and two creators cannot both win.
	tmp, err := os.MkdirTemp(r.dir, ".new-"+name+"-")
	if err != nil {
		return nil, fmt.Errorf("volume: create %s: %w", name, err)
	}
	m := meta{Name: name, Created: time.Now().UTC(), Quota: quota}
	if err := populate(tmp, m); err != nil {
		os.RemoveAll(tmp)
		return nil, fmt.Errorf("volume: create %s: %w", name, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		os.RemoveAll(tmp)
		if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY) {
			err = ErrExists
		}
		return nil, fmt.Errorf("volume: create %s: %w", name, err)
	}
	return r.Get(name)
}

// populate fills a new volume's directory.
func populate(dir string, m meta) error {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, metaFile), append(b, '\n'), 0o600); err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(dir, dataDir), 0o755); err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(dir, orphansDir), 0o700); err != nil {
		return err
	}
	for _, f := range []string{usageFile, mountedFile, holdsFile} {
		if err := os.WriteFile(filepath.Join(dir, f), nil, 0o600); err != nil {
			return err
		}
	}
	_, err = recount(dir)
	return err
}

// readMeta reads a volume's volume.json; ErrNotFound if there is none.
func readMeta(dir string) (meta, error) {
	var m meta
	b, err := os.ReadFile(filepath.Join(dir, metaFile))
	if errors.Is(err, fs.ErrNotExist) {
		return m, ErrNotFound
	}
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("%s: %w", metaFile, err)
	}
	return m, nil
}

// Check returns nil when the volume name exists, else why not
// (ErrNotFound for no such volume), without counting anything.
func (r *Root) Check(name string) error {
	if err := CheckName(name); err != nil {
		return fmt.Errorf("volume: %w", err)
	}
	if _, err := readMeta(r.path(name)); err != nil {
		return fmt.Errorf("volume: %s: %w", name, err)
	}
	return nil
}

// Get describes the volume name. When nobody has it mounted, its usage
// is recounted from its files first.
func (r *Root) Get(name string) (*Info, error) {
	if err := CheckName(name); err != nil {
		return nil, fmt.Errorf("volume: %w", err)
	}
	dir := r.path(name)
	m, err := readMeta(dir)
	if err != nil {
		return nil, fmt.Errorf("volume: %s: %w", name, err)
	}
	info := &Info{Name: m.Name, Created: m.Created, Quota: m.Quota, Path: filepath.Join(dir, dataDir)}
	if info.Used, info.InUse, err = usage(dir); err != nil {
		return nil, fmt.Errorf("volume: %s: %w", name, err)
	}
	return info, nil
}

// List describes every volume, by name.
func (r *Root) List() ([]*Info, error) {
	ents, err := os.ReadDir(r.dir)
	if err != nil {
		return nil, fmt.Errorf("volume: list: %w", err)
	}
	var out []*Info
	for _, e := range ents {
		if !e.IsDir() || CheckName(e.Name()) != nil {
			continue // a volume being made or removed
		}
		info, err := r.Get(e.Name())
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, info)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// usage reads a volume's charge, recounting it when nobody has it
// mounted, and says whether somebody has.
func usage(dir string) (used int64, inUse bool, err error) {
	mf, err := os.OpenFile(filepath.Join(dir, mountedFile), os.O_RDWR, 0)
	if err != nil {
		return 0, false, err
	}
	defer mf.Close()
	switch err := flock(mf, unix.LOCK_EX|unix.LOCK_NB); err {
	case nil:
		used, err := recount(dir)
		return used, false, err
	case unix.EWOULDBLOCK:
		uf, err := os.OpenFile(filepath.Join(dir, usageFile), os.O_RDWR, 0)
		if err != nil {
			return 0, true, err
		}
		defer uf.Close()
		if err := flock(uf, unix.LOCK_SH); err != nil {
			return 0, true, err
		}
		used, err := readUsage(uf)
		return used, true, err
	default:
		return 0, false, err
	}
}

// Remove removes the volume name and its files. A volume some sandbox
// has mounted is refused with ErrInUse, unless force: then its sandboxes
// keep what they have open, and find everything else gone.
func (r *Root) Remove(name string, force bool) error {
	if err := CheckName(name); err != nil {
		return fmt.Errorf("volume: rm: %w", err)
	}
	dir := r.path(name)
	if _, err := readMeta(dir); err != nil {
		return fmt.Errorf("volume: rm %s: %w", name, err)
	}
	mf, err := os.OpenFile(filepath.Join(dir, mountedFile), os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("volume: rm %s: %w", name, err)
	}
	defer mf.Close()
	if err := flock(mf, unix.LOCK_EX|unix.LOCK_NB); err == unix.EWOULDBLOCK {
		if !force {
			return fmt.Errorf("volume: rm %s: %w", name, ErrInUse)
		}
	} else if err != nil {
		return fmt.Errorf("volume: rm %s: %w", name, err)
	}
	// Moved aside first: the name is free at once, and a Mount that was
	// waiting for the lock finds no volume.
	gone := filepath.Join(r.dir, ".rm-"+name+"-"+randomHex())
	if err := os.Rename(dir, gone); err != nil {
		return fmt.Errorf("volume: rm %s: %w", name, err)
	}
	if err := removeTree(gone); err != nil {
		return fmt.Errorf("volume: rm %s: %w", name, err)
	}
	return nil
}

// removeTree removes dir and everything in it, also the directories a
// guest made unreadable or unwritable (they are the VMM user's, so their
// modes can be given back).
func removeTree(dir string) error {
	if os.RemoveAll(dir) == nil {
		return nil
	}
	if err := walk(dir, 0o700, false, func(*unix.Stat_t) {}); err != nil {
		return err
	}
	return os.RemoveAll(dir)
}

func randomHex() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// flock is flock(2), again when a signal interrupts it.
func flock(f *os.File, how int) error {
	for {
		err := unix.Flock(int(f.Fd()), how)
		if err != unix.EINTR {
			return err
		}
	}
}

// readUsage reads the usage counter.
func readUsage(uf *os.File) (int64, error) {
	var b [8]byte
	n, err := uf.ReadAt(b[:], 0)
	if n != len(b) {
		return 0, fmt.Errorf("%s: %d bytes, want 8 (%v)", usageFile, n, err)
	}
	return int64(binary.LittleEndian.Uint64(b[:])), nil
}

// writeUsage writes the usage counter.
func writeUsage(uf *os.File, used int64) error {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(max(used, 0)))
	_, err := uf.WriteAt(b[:], 0)
	return err
}

// recount sets a volume's counter from its files and forgets its removed
// directories; nobody may have it mounted. It returns the count.
func recount(dir string) (int64, error) {
	uf, err := os.OpenFile(filepath.Join(dir, usageFile), os.O_RDWR, 0)
	if err != nil {
		return 0, err
	}
	defer uf.Close()
	if err := flock(uf, unix.LOCK_EX); err != nil {
		return 0, err
	}
	used, err := Count(filepath.Join(dir, dataDir))
	if err != nil {
		return 0, err
	}
	if err := writeUsage(uf, used); err != nil {
		return 0, err
	}
	od := filepath.Join(dir, orphansDir)
	ents, _ := os.ReadDir(od)
	for _, e := range ents {
		os.Remove(filepath.Join(od, e.Name()))
	}
	return used, nil
}

// Count is what the tree at dir takes by the quota's rule (p9fs.Charge of
// every inode, the directory itself included, hard links once).
func Count(dir string) (int64, error) {
	var total int64
	seen := make(map[[2]uint64]bool)
	err := walk(dir, 0o500, true, func(st *unix.Stat_t) {
		if st.Mode&unix.S_IFMT != unix.S_IFDIR && st.Nlink > 1 {
			k := [2]uint64{st.Dev, st.Ino}
			if seen[k] {
				return
			}
			seen[k] = true
		}
		total += p9fs.Charge(st)
	})
	return total, err
}

// Mount is one mount of a volume by one file server (p9fs share): it
// holds the volume in use until Close, and is the share's p9fs.Quota.
type Mount struct {
	name    string
	dir     string
	limit   int64
	log     *slog.Logger
	mounted *os.File // flock'ed LOCK_SH for the Mount's life
	usage   *os.File // the counter, flock'ed LOCK_EX by each Update
	holds   *os.File // one OFD read lock per held inode

	// mu serializes Updates and Usage: flock is per open file, so it
	// does not exclude this Mount's own goroutines from each other.
	mu sync.Mutex
	// fdMu guards the files' lifetime for Hold and Release, which run
	// outside mu (Release inside an Update).
	fdMu   sync.RWMutex
	closed bool
}

var _ p9fs.Quota = (*Mount)(nil)

// Mount mounts the volume name for one file server. When nobody else
// has it mounted, its usage is recounted first. Close releases it.
func (r *Root) Mount(name string, log *slog.Logger) (*Mount, error) {
	if err := CheckName(name); err != nil {
		return nil, fmt.Errorf("volume: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir := r.path(name)
	m, err := mount(dir, log.With("volume", name))
	if err != nil {
		return nil, fmt.Errorf("volume: mount %s: %w", name, err)
	}
	m.name = name
	return m, nil
}

func mount(dir string, log *slog.Logger) (_ *Mount, err error) {
	md, err := readMeta(dir)
	if err != nil {
		return nil, err
	}
	m := &Mount{dir: dir, limit: md.Quota, log: log}
	defer func() {
		if err != nil {
			m.Close()
		}
	}()
	if m.mounted, err = os.OpenFile(filepath.Join(dir, mountedFile), os.O_RDWR, 0); err != nil {
		return nil, err
	}
	switch err := flock(m.mounted, unix.LOCK_EX|unix.LOCK_NB); err {
	case nil:
		// Alone: repair the count before serving. Turning the lock
		// into a shared one is not atomic, but whoever gets in between
		// also finds nobody serving.
		if _, err := recount(dir); err != nil {
			return nil, err
		}
	case unix.EWOULDBLOCK:
	default:
		return nil, err
	}
	if err := flock(m.mounted, unix.LOCK_SH); err != nil {
		return nil, err
	}
	// Removed while this waited for the lock?
	var a, b unix.Stat_t
	if unix.Fstat(int(m.mounted.Fd()), &a) != nil || unix.Stat(filepath.Join(dir, mountedFile), &b) != nil || a.Ino != b.Ino || a.Dev != b.Dev {
		return nil, ErrNotFound
	}
	if m.usage, err = os.OpenFile(filepath.Join(dir, usageFile), os.O_RDWR, 0); err != nil {
		return nil, err
	}
	if m.holds, err = os.OpenFile(filepath.Join(dir, holdsFile), os.O_RDWR, 0); err != nil {
		return nil, err
	}
	return m, nil
}

// Name is the volume's name.
func (m *Mount) Name() string { return m.name }

// DataDir is the directory to serve: what the guest sees.
func (m *Mount) DataDir() string { return filepath.Join(m.dir, dataDir) }

// Close releases the volume (and every inode this Mount still holds).
func (m *Mount) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.fdMu.Lock()
	defer m.fdMu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	var err error
	for _, f := range []*os.File{m.holds, m.usage, m.mounted} {
		if f != nil {
			err = errors.Join(err, f.Close())
		}
	}
	return err
}

var errClosed = errors.New("volume: the mount is closed")

// Update implements p9fs.Quota.
func (m *Mount) Update(fn func(tx p9fs.QuotaTx) error) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errClosed
	}
	if err := flock(m.usage, unix.LOCK_EX); err != nil {
		return fmt.Errorf("volume: lock %s: %w", m.name, err)
	}
	defer flock(m.usage, unix.LOCK_UN)
	t := &tx{m: m}
	ferr := fn(t)
	if t.delta != 0 {
		if t.load(); t.err == nil {
			if err := writeUsage(m.usage, t.used+t.delta); err != nil {
				t.err = err
			}
		}
	}
	if t.err != nil {
		return fmt.Errorf("volume: %s: %w", m.name, t.err)
	}
	return ferr
}

// Usage implements p9fs.Quota.
func (m *Mount) Usage() (used, limit int64, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return 0, 0, errClosed
	}
	if err := flock(m.usage, unix.LOCK_SH); err != nil {
		return 0, 0, err
	}
	defer flock(m.usage, unix.LOCK_UN)
	used, err = readUsage(m.usage)
	return used, m.limit, err
}

// holdRange is the byte of the holds file standing for inode ino.
func holdRange(ino uint64, typ int16) unix.Flock_t {
	return unix.Flock_t{Type: typ, Whence: io.SeekStart, Start: int64(ino & (1<<62 - 1)), Len: 1}
}

// lockHold applies an OFD lock of type typ to ino's byte.
func (m *Mount) lockHold(ino uint64, typ int16) error {
	m.fdMu.RLock()
	defer m.fdMu.RUnlock()
	if m.closed {
		return errClosed
	}
	lk := holdRange(ino, typ)
	for {
		err := unix.FcntlFlock(m.holds.Fd(), unix.F_OFD_SETLK, &lk)
		if err != unix.EINTR {
			return err
		}
	}
}

// Hold implements p9fs.Quota.
func (m *Mount) Hold(ino uint64) error { return m.lockHold(ino, unix.F_RDLCK) }

// Release implements p9fs.Quota.
func (m *Mount) Release(ino uint64) error { return m.lockHold(ino, unix.F_UNLCK) }

// tx is the p9fs.QuotaTx of one Update.
type tx struct {
	m           *Mount
	loaded      bool
	used, delta int64
	err         error
}

func (t *tx) load() {
	if t.loaded || t.err != nil {
		return
	}
	t.used, t.err = readUsage(t.m.usage)
	t.loaded = t.err == nil
}

func (t *tx) Free() int64 {
	if t.m.limit == 0 {
		return math.MaxInt64
	}
	if t.load(); t.err != nil {
		return 0
	}
	return t.m.limit - t.used - t.delta
}

func (t *tx) Charge(delta int64) { t.delta += delta }

func (t *tx) HeldElsewhere(ino uint64) bool {
	lk := holdRange(ino, unix.F_WRLCK)
	if err := unix.FcntlFlock(t.m.holds.Fd(), unix.F_OFD_GETLK, &lk); err != nil {
		t.m.log.Warn("volume: asking who holds an inode", "ino", ino, "err", err)
		return true
	}
	return lk.Type != unix.F_UNLCK
}

func (t *tx) orphan(ino uint64) string {
	return filepath.Join(t.m.dir, orphansDir, strconv.FormatUint(ino, 10))
}

func (t *tx) Remember(ino uint64, charge int64) {
	if err := os.WriteFile(t.orphan(ino), []byte(strconv.FormatInt(charge, 10)), 0o600); err != nil {
		// It stays charged until the next recount: the safe side.
		t.m.log.Warn("volume: remembering a removed directory", "ino", ino, "err", err)
	}
}

func (t *tx) Recall(ino uint64) (int64, bool) {
	p := t.orphan(ino)
	b, err := os.ReadFile(p)
	if err != nil {
		return 0, false
	}
	os.Remove(p)
	c, err := strconv.ParseInt(string(b), 10, 64)
	return c, err == nil && c >= 0
}
