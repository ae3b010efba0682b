package volume

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/capsa-sandbox/capsa/p9fs"
	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// wantErrno checks that err is the errno want (0: success).
func wantErrno(t testing.TB, what string, err error, want linux.Errno) {
	t.Helper()
	if want == 0 {
		if err != nil {
			t.Fatalf("%s = %v, want success", what, err)
		}
		return
	}
	var got linux.Errno
	if !errors.As(err, &got) || got != want {
		t.Fatalf("%s = %v, want %v", what, err, want)
	}
}

func newRoot(t testing.TB) *Root {
	t.Helper()
	r, err := Open(filepath.Join(t.TempDir(), "volumes"))
	must(t, err)
	return r
}

// share is one sandbox's view of a volume: its Mount and the root of a
// p9fs share of it charged to that Mount.
type share struct {
	m    *Mount
	a    p9.Attacher
	root p9.File
}

// mountShare mounts name and serves it as a p9fs share would be in a
// sandbox; Close of the share or the test's end unmounts it.
func mountShare(t testing.TB, r *Root, name string, ro bool) *share {
	t.Helper()
	m, err := r.Mount(name, nil)
	must(t, err)
	a, err := p9fs.New(m.DataDir(), p9fs.Options{Quota: m, ReadOnly: ro})
	if err != nil {
		m.Close()
		t.Fatal(err)
	}
	root, err := a.Attach()
	must(t, err)
	s := &share{m: m, a: a, root: root}
	t.Cleanup(s.close)
	return s
}

func (s *share) close() {
	if s.root != nil {
		s.root.Close()
		s.a.(io.Closer).Close()
		s.m.Close()
		s.root = nil
	}
}

// create makes name in the share's root, open for reading and writing.
func (s *share) create(t testing.TB, name string) p9.File {
	t.Helper()
	_, d, err := s.root.Walk(nil)
	must(t, err)
	defer d.Close()
	f, _, _, err := d.Create(name, p9.ReadWrite, 0o644, p9.NoUID, p9.NoGID)
	if err != nil {
		t.Fatalf("create %s = %v", name, err)
	}
	return f
}

// walk returns a File for name (not opened).
func (s *share) walk(t testing.TB, names ...string) p9.File {
	t.Helper()
	_, f, err := s.root.Walk(names)
	if err != nil {
		t.Fatalf("walk %v = %v", names, err)
	}
	return f
}

// used is the volume's counter.
func (s *share) used(t testing.TB) int64 {
	t.Helper()
	u, _, err := s.m.Usage()
	must(t, err)
	return u
}

// checkCount fails unless the counter equals a fresh count of the files.
func (s *share) checkCount(t testing.TB) {
	t.Helper()
	want, err := Count(s.m.DataDir())
	must(t, err)
	if got := s.used(t); got != want {
		t.Fatalf("counter = %d, want %d (a fresh count)", got, want)
	}
}

// onDisk is what the files under dir take on the host's disk.
func onDisk(t testing.TB, dir string) int64 {
	t.Helper()
	var n int64
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil {
			n += fi.Sys().(*syscall.Stat_t).Blocks * 512
		}
		return nil
	})
	return n
}

// fill writes to f in chunks of size from offset off until ENOSPC and
// returns the offset reached.
func fill(t testing.TB, f p9.File, off int64, size int) int64 {
	t.Helper()
	buf := make([]byte, size)
	for i := 0; ; i++ {
		n, err := f.WriteAt(buf, off)
		if err != nil {
			wantErrno(t, "write past the quota", err, linux.ENOSPC)
			if n != 0 {
				t.Fatalf("a refused write wrote %d bytes, want 0", n)
			}
			return off
		}
		off += int64(n)
		if i > 1<<20 {
			t.Fatal("writes never stop")
		}
	}
}

func TestCreateGetListRemove(t *testing.T) {
	r := newRoot(t)
	info, err := r.Create("data", 1<<20)
	must(t, err)
	empty, err := Count(filepath.Join(r.Dir(), "data", dataDir))
	must(t, err)
	if info.Name != "data" || info.Quota != 1<<20 || info.Used != empty || info.InUse || info.Path != filepath.Join(r.Dir(), "data", "data") {
		t.Errorf("Create(data, 1M) = %+v, want quota 1M, used %d, not in use", info, empty)
	}
	if _, err := r.Create("data", 0); !errors.Is(err, ErrExists) {
		t.Errorf("Create(data) again = %v, want ErrExists", err)
	}
	for _, bad := range []string{"", "a/b", "..", ".hidden", strings.Repeat("x", 64)} {
		if _, err := r.Create(bad, 0); err == nil || !strings.Contains(err.Error(), "want 1 to 63 letters") {
			t.Errorf("Create(%q) = %v, want the name rule", bad, err)
		}
	}
	if _, err := r.Create("neg", -1); err == nil {
		t.Error("Create(neg, -1) succeeded")
	}
	_, err = r.Create("b-other", 0)
	must(t, err)
	list, err := r.List()
	must(t, err)
	if len(list) != 2 || list[0].Name != "b-other" || list[1].Name != "data" || list[0].Quota != 0 {
		t.Errorf("List() = %+v, want b-other (no quota), data", list)
	}
	must(t, r.Remove("data", false))
	if _, err := r.Get("data"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(data) after Remove = %v, want ErrNotFound", err)
	}
	if err := r.Remove("data", false); !errors.Is(err, ErrNotFound) {
		t.Errorf("Remove(data) again = %v, want ErrNotFound", err)
	}
	if _, err := r.Mount("nosuch", nil); !errors.Is(err, ErrNotFound) {
		t.Errorf("Mount(nosuch) = %v, want ErrNotFound", err)
	}
	ents, _ := os.ReadDir(r.Dir())
	if len(ents) != 1 {
		t.Errorf("the volumes directory holds %d entries, want 1 (nothing left of data)", len(ents))
	}
}

// TestWritesStopAtTheQuota: writes succeed up to the quota, the next fails
// whole with ENOSPC, and neither the counter nor the disk passes it.
func TestWritesStopAtTheQuota(t *testing.T) {
	const quota = 1 << 20
	r := newRoot(t)
	_, err := r.Create("v", quota)
	must(t, err)
	s := mountShare(t, r, "v", false)
	f := s.create(t, "big")
	defer f.Close()
	end := fill(t, f, 0, 32<<10)
	if used := s.used(t); used > quota || used < quota-64<<10 {
		t.Errorf("after filling: counter %d, want within 64 KiB below the quota %d", used, quota)
	}
	s.checkCount(t)
	// Smaller writes still fit until the last block; the one past fails.
	end = fill(t, f, end, 1)
	_, _, attr, err := f.GetAttr(p9.AttrMaskAll)
	must(t, err)
	if int64(attr.Size) != end {
		t.Errorf("size after refused writes = %d, want %d (nothing of them written)", attr.Size, end)
	}
	if used := s.used(t); used != quota {
		t.Errorf("counter at the end = %d, want exactly the quota %d", used, quota)
	}
	if d := onDisk(t, s.m.DataDir()); d > quota {
		t.Errorf("on disk %d bytes, past the quota %d", d, quota)
	}
	// A write far out (a sparse file) counts in full.
	_, err = f.WriteAt([]byte{1}, 1<<40)
	wantErrno(t, "write at 1 TiB", err, linux.ENOSPC)
	// So does a new file once full.
	_, d, _ := s.root.Walk(nil)
	defer d.Close()
	_, _, _, err = d.Create("more", p9.ReadWrite, 0o644, p9.NoUID, p9.NoGID)
	wantErrno(t, "create when full", err, linux.ENOSPC)
	_, err = s.root.Mkdir("dir", 0o755, p9.NoUID, p9.NoGID)
	wantErrno(t, "mkdir when full", err, linux.ENOSPC)
	s.checkCount(t)

	// The guest's statfs says the same.
	st, err := s.root.StatFS()
	must(t, err)
	if got := st.Blocks * uint64(st.BlockSize); got != quota {
		t.Errorf("statfs size = %d, want the quota %d", got, quota)
	}
	if st.BlocksAvailable != 0 || st.BlocksFree != 0 {
		t.Errorf("statfs free = %d/%d blocks, want 0 on a full volume", st.BlocksFree, st.BlocksAvailable)
	}
}

func TestTruncate(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 1<<20)
	must(t, err)
	s := mountShare(t, r, "v", false)
	f := s.create(t, "f")
	defer f.Close()
	base := s.used(t)
	must(t, f.SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: 100 << 10}))
	if got := s.used(t); got != base+100<<10 {
		t.Errorf("after truncate up to 100 KiB: counter %d, want %d", got, base+100<<10)
	}
	wantErrno(t, "truncate up to 2 MiB", f.SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: 2 << 20}), linux.ENOSPC)
	wantErrno(t, "chmod and truncate to 2 MiB", f.SetAttr(p9.SetAttrMask{Size: true, Permissions: true}, p9.SetAttr{Size: 2 << 20, Permissions: 0o600}), linux.ENOSPC)
	if fi, err := os.Stat(filepath.Join(s.m.DataDir(), "f")); err != nil || fi.Size() != 100<<10 || fi.Mode().Perm() != 0o644 {
		t.Errorf("after refused truncations: %v %v, want 100 KiB, 0644 (nothing changed)", fi, err)
	}
	must(t, f.SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: 5000}))
	if got := s.used(t); got != base+8192 {
		t.Errorf("after truncate down to 5000: counter %d, want %d", got, base+8192)
	}
	// Opening with O_TRUNC frees what the file took.
	w := s.walk(t, "f")
	defer w.Close()
	_, _, err = w.Open(p9.WriteOnly | 01000)
	must(t, err)
	if got := s.used(t); got != base {
		t.Errorf("after open with O_TRUNC: counter %d, want %d", got, base)
	}
	s.checkCount(t)
}

// TestUnlinkAndRename: an unlink frees a file once its last link goes
// and nobody holds it; a rename over a file frees the target.
func TestUnlinkAndRename(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 4<<20)
	must(t, err)
	s := mountShare(t, r, "v", false)
	base := s.used(t)
	f := s.create(t, "a")
	_, err = f.WriteAt(make([]byte, 300<<10), 0)
	must(t, err)
	withA := s.used(t)
	if withA != base+4096+300<<10 {
		t.Errorf("after a 300 KiB file: counter %d, want %d", withA, base+4096+300<<10)
	}
	// A hard link costs no inode and frees nothing when one name goes.
	must(t, s.root.Link(f, "b"))
	must(t, s.root.UnlinkAt("a", 0))
	if got := s.used(t); got != withA {
		t.Errorf("after unlinking one of two links: counter %d, want %d", got, withA)
	}
	// The last link goes while this share holds the file: it is still
	// on disk, so still charged, until the File closes.
	must(t, s.root.UnlinkAt("b", 0))
	if got := s.used(t); got != withA {
		t.Errorf("after unlinking a held file: counter %d, want %d (its data is still on disk)", got, withA)
	}
	_, err = f.WriteAt(make([]byte, 100<<10), 300<<10) // writes to it still count
	must(t, err)
	if got := s.used(t); got != withA+100<<10 {
		t.Errorf("after writing to an unlinked file: counter %d, want %d", got, withA+100<<10)
	}
	must(t, f.Close())
	if got := s.used(t); got != base {
		t.Errorf("after the last File on it closed: counter %d, want %d", got, base)
	}
	s.checkCount(t)

	// Rename over a file frees the target.
	for _, n := range []string{"src", "dst"} {
		g := s.create(t, n)
		_, err = g.WriteAt(make([]byte, 200<<10), 0)
		must(t, err)
		must(t, g.Close())
	}
	two := s.used(t)
	must(t, s.root.RenameAt("src", s.root, "dst"))
	if got := s.used(t); got != two-4096-200<<10 {
		t.Errorf("after renaming over a 200 KiB file: counter %d, want %d", got, two-4096-200<<10)
	}
	s.checkCount(t)
	// Renaming onto another link of the same file changes nothing.
	must(t, s.root.Link(s.walk(t, "dst"), "dst2"))
	before := s.used(t)
	must(t, s.root.RenameAt("dst", s.root, "dst2"))
	if got := s.used(t); got != before {
		t.Errorf("after renaming onto its own other link: counter %d, want %d", got, before)
	}
	s.checkCount(t)

	// Directories: made and removed.
	_, err = s.root.Mkdir("d", 0o755, p9.NoUID, p9.NoGID)
	must(t, err)
	d := s.walk(t, "d")
	_, err = d.Symlink("target", "l", p9.NoUID, p9.NoGID)
	must(t, err)
	_, err = d.Mknod("fifo", p9.ModeNamedPipe|0o644, 0, 0, p9.NoUID, p9.NoGID)
	must(t, err)
	s.checkCount(t)
	must(t, d.UnlinkAt("l", 0))
	must(t, d.UnlinkAt("fifo", 0))
	must(t, s.root.UnlinkAt("d", unix.AT_REMOVEDIR))
	must(t, d.Close())
	s.checkCount(t)
}

// TestHeldByAnotherMount: a file or directory removed by one sandbox while
// another (another Mount: another process) holds it stays charged until
// the holder lets go; a read-only mount's holds count too.
func TestHeldByAnotherMount(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 4<<20)
	must(t, err)
	a := mountShare(t, r, "v", false)
	b := mountShare(t, r, "v", true)
	base := a.used(t)
	f := a.create(t, "f")
	_, err = f.WriteAt(make([]byte, 500<<10), 0)
	must(t, err)
	must(t, f.Close())
	_, err = a.root.Mkdir("d", 0o755, p9.NoUID, p9.NoGID)
	must(t, err)
	// A directory that grew, emptied again: its size stays.
	dd := a.walk(t, "d")
	for i := range 300 {
		name := strings.Repeat("n", 200) + string(rune('a'+i%26)) + string(rune('a'+i/26))
		g, _, _, err := dd.Create(name, p9.ReadWrite, 0o644, p9.NoUID, p9.NoGID)
		must(t, err)
		g.Close()
		must(t, dd.UnlinkAt(name, 0))
	}
	must(t, dd.Close())
	full := a.used(t)
	a.checkCount(t)

	bf := b.walk(t, "f")
	bd := b.walk(t, "d")
	must(t, a.root.UnlinkAt("f", 0))
	must(t, a.root.UnlinkAt("d", unix.AT_REMOVEDIR))
	if got := a.used(t); got != full {
		t.Errorf("after removing what the other mount holds: counter %d, want %d", got, full)
	}
	must(t, bf.Close())
	must(t, bd.Close())
	if got := a.used(t); got != base {
		t.Errorf("after the other mount let go: counter %d, want %d", got, base)
	}
	a.checkCount(t)
}

// TestConcurrentWriters: two Mounts of one volume (two processes, as far
// as their locks go) write from several goroutines at once, and unlink and
// truncate as they go; neither the counter nor the disk ever passes the
// quota, and the counter ends equal to a fresh count.
func TestConcurrentWriters(t *testing.T) {
	const quota = 4 << 20
	r := newRoot(t)
	_, err := r.Create("v", quota)
	must(t, err)
	shares := []*share{mountShare(t, r, "v", false), mountShare(t, r, "v", false)}
	var over atomic.Int64
	stop := make(chan struct{})
	var watch sync.WaitGroup
	watch.Add(1)
	go func() {
		defer watch.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if u, _, err := shares[0].m.Usage(); err == nil && u > quota {
				over.Store(u)
			}
			if d := onDisk(t, shares[0].m.DataDir()); d > quota {
				over.Store(d)
			}
		}
	}()
	var wg sync.WaitGroup
	var refused atomic.Int64
	for w := range 6 {
		s := shares[w%2]
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 32<<10)
			for round := range 4 {
				name := string(rune('a'+w)) + string(rune('0'+round))
				_, d, err := s.root.Walk(nil)
				if err != nil {
					t.Error(err)
					return
				}
				f, _, _, err := d.Create(name, p9.ReadWrite, 0o644, p9.NoUID, p9.NoGID)
				d.Close()
				if err != nil {
					refused.Add(1)
					continue // full: ENOSPC
				}
				var off int64
				for off < 2<<20 {
					n, err := f.WriteAt(buf, off)
					if err != nil {
						var e linux.Errno
						if !errors.As(err, &e) || e != linux.ENOSPC {
							t.Errorf("write: %v, want success or ENOSPC", err)
						}
						refused.Add(1)
						break
					}
					off += int64(n)
				}
				switch round % 3 {
				case 0: // free it all
					s.root.UnlinkAt(name, 0)
				case 1: // free half
					f.SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: uint64(off / 2)})
				}
				f.Close()
			}
		}()
	}
	wg.Wait()
	close(stop)
	watch.Wait()
	if v := over.Load(); v != 0 {
		t.Errorf("the volume reached %d bytes, past its quota %d", v, quota)
	}
	if refused.Load() == 0 {
		t.Error("no write was refused: the test did not reach the quota")
	}
	shares[0].checkCount(t)
	if d := onDisk(t, shares[0].m.DataDir()); d > quota {
		t.Errorf("on disk at the end: %d, past the quota %d", d, quota)
	}
}

// TestRecountRepairs: a wrong counter is set right by the first mount
// that finds nobody else, and by Get when nobody has the volume mounted;
// not while it is mounted.
func TestRecountRepairs(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 1<<20)
	must(t, err)
	s := mountShare(t, r, "v", false)
	f := s.create(t, "f")
	_, err = f.WriteAt(make([]byte, 10000), 0)
	must(t, err)
	f.Close()
	want := s.used(t)
	s.close()

	usagePath := filepath.Join(r.Dir(), "v", usageFile)
	setUsage := func(v int64) {
		uf, err := os.OpenFile(usagePath, os.O_RDWR, 0)
		must(t, err)
		must(t, writeUsage(uf, v))
		uf.Close()
	}
	setUsage(12345678)
	info, err := r.Get("v")
	must(t, err)
	if info.Used != want || info.InUse {
		t.Errorf("Get after a wrong count = used %d, in use %v; want %d, false", info.Used, info.InUse, want)
	}
	// Host-side changes are seen at the next lone mount.
	must(t, os.WriteFile(filepath.Join(info.Path, "host"), make([]byte, 5000), 0o644))
	setUsage(0)
	s = mountShare(t, r, "v", false)
	if got := s.used(t); got != want+4096+8192 {
		t.Errorf("lone mount after a host change: counter %d, want %d", got, want+4096+8192)
	}
	// While mounted, Get reports the counter as it is.
	setUsage(777)
	info, err = r.Get("v")
	must(t, err)
	if info.Used != 777 || !info.InUse {
		t.Errorf("Get while mounted = used %d, in use %v; want 777 (not recounted), true", info.Used, info.InUse)
	}
}

func TestRemoveInUse(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 0)
	must(t, err)
	s := mountShare(t, r, "v", false)
	if err := r.Remove("v", false); !errors.Is(err, ErrInUse) {
		t.Errorf("Remove(v) while mounted = %v, want ErrInUse", err)
	}
	if _, err := os.Stat(s.m.DataDir()); err != nil {
		t.Errorf("a refused Remove touched the volume: %v", err)
	}
	s.close()
	must(t, r.Remove("v", false))

	// --force removes a mounted one; its mount goes on, on nothing.
	_, err = r.Create("w", 0)
	must(t, err)
	s = mountShare(t, r, "w", false)
	must(t, r.Remove("w", true))
	if _, err := r.Get("w"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(w) after a forced Remove = %v, want ErrNotFound", err)
	}
	_, d, err := s.root.Walk(nil)
	must(t, err)
	defer d.Close()
	if _, _, _, err := d.Create("x", p9.ReadWrite, 0o644, p9.NoUID, p9.NoGID); err == nil {
		t.Error("creating in a removed volume succeeded")
	}
}

// TestNoQuota: a volume without a quota still counts, never refuses, and
// statfs shows the host's file system.
func TestNoQuota(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 0)
	must(t, err)
	s := mountShare(t, r, "v", false)
	f := s.create(t, "f")
	defer f.Close()
	_, err = f.WriteAt(make([]byte, 3<<20), 0)
	must(t, err)
	s.checkCount(t)
	st, err := s.root.StatFS()
	must(t, err)
	var host unix.Statfs_t
	must(t, unix.Statfs(s.m.DataDir(), &host))
	if st.Blocks != host.Blocks {
		t.Errorf("statfs blocks = %d, want the host's %d", st.Blocks, host.Blocks)
	}
}

// TestXattrBound: user extended attributes fit in the inode's 4 KiB.
func TestXattrBound(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 1<<20)
	must(t, err)
	s := mountShare(t, r, "v", false)
	f := s.create(t, "f")
	defer f.Close()
	if err := f.SetXattr("user.a", make([]byte, 3000), 0); errors.Is(err, linux.EOPNOTSUPP) {
		t.Skip("no user xattrs on this file system")
	} else {
		must(t, err)
	}
	wantErrno(t, "a second 2000-byte attribute", f.SetXattr("user.b", make([]byte, 2000), 0), linux.ENOSPC)
	must(t, f.SetXattr("user.a", make([]byte, 3500), 0)) // replacing counts the new value only
}

// TestWalkDeepAndLocked: counting and removing reach directories deeper
// than PATH_MAX and ones the guest made unreadable, and a count leaves
// their modes as they were.
func TestWalkDeepAndLocked(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 0)
	must(t, err)
	data := filepath.Join(r.Dir(), "v", dataDir)
	fd, err := unix.Open(data, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	must(t, err)
	name := strings.Repeat("d", 250)
	for range 30 { // 30 * 251 bytes: past PATH_MAX
		must(t, unix.Mkdirat(fd, name, 0o755))
		nfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		must(t, err)
		unix.Close(fd)
		fd = nfd
	}
	ffd, err := unix.Openat(fd, "file", unix.O_CREAT|unix.O_WRONLY, 0o644)
	must(t, err)
	unix.Write(ffd, make([]byte, 5000))
	unix.Close(ffd)
	unix.Close(fd)
	locked := filepath.Join(data, "locked")
	must(t, os.Mkdir(locked, 0o755))
	must(t, os.WriteFile(filepath.Join(locked, "in"), make([]byte, 100), 0o644))
	must(t, os.Chmod(locked, 0))

	got, err := Count(data)
	must(t, err)
	// data and 30 directories of one block each, the deep file (4096 +
	// 8192), locked (4096 + 4096) and in (4096 + 4096).
	want := int64(31*8192 + 12288 + 8192 + 8192)
	if got != want {
		t.Errorf("Count = %d, want %d", got, want)
	}
	if fi, err := os.Stat(locked); err != nil || fi.Mode().Perm() != 0 {
		t.Errorf("after the count, locked is %v (%v), want mode 0 again", fi.Mode(), err)
	}
	must(t, r.Remove("v", false))
	if ents, _ := os.ReadDir(r.Dir()); len(ents) != 0 {
		t.Errorf("after Remove the volumes directory holds %v", ents)
	}
}

// TestENOSPCOverTheWire: the guest gets the errno itself through p9's
// server (which rewrites some errors).
func TestENOSPCOverTheWire(t *testing.T) {
	r := newRoot(t)
	_, err := r.Create("v", 64<<10)
	must(t, err)
	s := mountShare(t, r, "v", false)
	sc, cc := net.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		p9.NewServer(s.a).Handle(sc, sc)
	}()
	c, err := p9.NewClient(cc, p9.WithMessageSize(256<<10))
	must(t, err)
	defer func() { c.Close(); <-done }()
	root, err := c.Attach("")
	must(t, err)
	defer root.Close()
	_, d, err := root.Walk(nil)
	must(t, err)
	f, _, _, err := d.Create("f", p9.ReadWrite, 0o644, p9.NoUID, p9.NoGID)
	must(t, err)
	defer f.Close()
	_, err = f.WriteAt(make([]byte, 128<<10), 0)
	wantErrno(t, "a 128 KiB write into 64 KiB over the wire", err, linux.ENOSPC)
}
