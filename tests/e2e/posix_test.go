package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/posixtest"
)

// posixDirEnv, set in a guest, makes TestPosixSuite run go-fuse's POSIX
// file system suite (posixtest.All, third-party: written for FUSE file
// systems, it checks what Linux's local ones do) in fresh directories
// under it, instead of starting sandboxes.
const posixDirEnv = "CAPSA_E2E_POSIX_DIR"

// posixLocal are the suite's cases that do not pass on Linux's own file
// systems either, each with its result there and why: the guest's tmpfs
// must give exactly this, and every other case PASS.
var posixLocal = map[string]struct{ got, why string }{
	"FcntlFlockLocksFile": {"FAIL", "it expects two descriptors of one process to conflict, which POSIX record locks never do on Linux"},
}

// posixShareDifferences are the suite's cases whose result on a share
// differs from the guest's tmpfs, each with the share's result and why.
// The test holds the share to exactly this, as TestWorkspaceFidelity does.
// XAttr and XAttrLarge follow the host directory's file system instead.
var posixShareDifferences = map[string]struct{ got, why string }{
	"Fallocate":         {"FAIL", "9P2000.L has no fallocate: Linux's v9fs answers fallocate(2) EOPNOTSUPP (posix_fallocate(3) then writes zeros, TestWorkspaceFidelity's fallocate probe)"},
	"FallocateKeepSize": {"FAIL", "as Fallocate"},
	"Tmpfile":           {"SKIP", "Linux's v9fs has no tmpfile operation: O_TMPFILE is EOPNOTSUPP, which the suite skips on"},
}

// TestPosixSuite runs go-fuse's posixtest suite in a sandbox, through the
// CLI (so the VMM is confined as users run it), on a read-write share and
// on the guest's tmpfs, and compares: every case must pass on tmpfs, and
// give the same on the share unless posixShareDifferences says otherwise.
func TestPosixSuite(t *testing.T) {
	if dir := os.Getenv(posixDirEnv); dir != "" {
		runPosixSuite(t, dir)
		return
	}
	posixSuite(t, "9p", posixShareDifferences)
}

// posixVirtioFSDifferences are posixShareDifferences for a virtio-fs
// share: none.
var posixVirtioFSDifferences = map[string]struct{ got, why string }{}

// TestPosixSuiteVirtioFS is TestPosixSuite on a virtio-fs share
// (--share-fs virtiofs).
func TestPosixSuiteVirtioFS(t *testing.T) {
	posixSuite(t, "virtiofs", posixVirtioFSDifferences)
}

// posixSuite runs the suite on a share over transport shareFS, whose
// results differ from tmpfs's as differences says.
func posixSuite(t *testing.T, shareFS string, differences map[string]struct{ got, why string }) {
	share := t.TempDir()
	// User attributes on the share are the host directory's: with them
	// the suite's XAttr cases pass; without (the nested host's tmpfs),
	// getxattr answers ENOTSUP, as the host does, and both skip, as they
	// do on a local file system without them; XAttrLarge skips too where
	// the host's attributes cannot hold its 8 KiB value (ext4 without
	// ea_inode).
	xattr, xattrLarge, xattrWhy := "PASS", "PASS", "as tmpfs"
	if err := hostXattr(share, 1); err != nil {
		xattr, xattrLarge, xattrWhy = "SKIP", "SKIP", "the host directory's file system has no user attributes: "+err.Error()
	} else if err := hostXattr(share, 8<<10+123); err != nil {
		xattrLarge, xattrWhy = "SKIP", "the host directory's file system holds no 8 KiB attribute: "+err.Error()
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	suite := func(dir string) string {
		return fmt.Sprintf("mkdir -p %[1]s && %[2]s=%[1]s /tmp/e2e.test -test.run '^TestPosixSuite$' -test.v -test.timeout 10m", dir, posixDirEnv)
	}
	// Two vCPUs, so that the cases' threads run at once, as on a host.
	r := capsa(t, 15*time.Minute, "run", "--cpus", "2", "--memory", "1G", "--share-fs", shareFS, "-v", share+":/mnt/share", "--copy", self+":/tmp/e2e.test", "--",
		"sh", "-c", suite("/mnt/share/posix")+" > /tmp/share.out 2>&1; "+suite("/tmp/posix")+" > /tmp/tmpfs.out 2>&1; "+
			"echo '=== share'; cat /tmp/share.out; echo '=== tmpfs'; cat /tmp/tmpfs.out")
	shareOut, tmpfsOut, ok := strings.Cut(strings.TrimPrefix(r.stdout, "=== share\n"), "=== tmpfs\n")
	if r.code != 0 || !ok {
		t.Fatalf("the suite: exit %d; want 0 and both runs' output", r.code)
	}
	onShare, onTmpfs := posixResults(shareOut), posixResults(tmpfsOut)
	if want := len(posixtest.All) + len(posixCapsa); len(onTmpfs) < want || len(onShare) != len(onTmpfs) {
		t.Fatalf("the suite ran %d cases on tmpfs and %d on the share; want %d each", len(onTmpfs), len(onShare), want)
	}
	names := make([]string, 0, len(onTmpfs))
	for name := range onTmpfs {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		local, localWhy := "PASS", "a local file system"
		if d, ok := posixLocal[name]; ok {
			local, localWhy = d.got, d.why
		}
		if onTmpfs[name] != local {
			t.Errorf("%s on the guest's tmpfs: %s, want %s (%s)", name, onTmpfs[name], local, localWhy)
		}
		want, why := onTmpfs[name], "as tmpfs"
		if d, ok := differences[name]; ok {
			want, why = d.got, d.why
		}
		switch name {
		case "XAttr":
			want, why = xattr, xattrWhy
		case "XAttrLarge":
			want, why = xattrLarge, xattrWhy
		}
		if onShare[name] != want {
			t.Errorf("%s on the share: %s, want %s (%s)", name, onShare[name], want, why)
		}
	}
}

// posixCase is a subtest's verdict line in go test -v output.
var posixCase = regexp.MustCompile(`(?m)^\s+--- (PASS|FAIL|SKIP): TestPosixSuite/(\S+)`)

// posixResults reads each case's verdict from the suite's -v output.
func posixResults(out string) map[string]string {
	got := map[string]string{}
	for _, m := range posixCase.FindAllStringSubmatch(out, -1) {
		got[m[2]] = m[1]
	}
	return got
}

// runPosixSuite is TestPosixSuite inside the guest: every case of the
// suite, each in a fresh directory under dir.
func runPosixSuite(t *testing.T, dir string) {
	cases := map[string]func(*testing.T, string){}
	for name, f := range posixtest.All {
		cases[name] = f
	}
	for name, f := range posixCapsa {
		cases[name] = f
	}
	names := make([]string, 0, len(cases))
	for name := range cases {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			d, err := os.MkdirTemp(dir, name+"-")
			if err != nil {
				t.Fatal(err)
			}
			cases[name](t, d)
		})
	}
}

// posixCapsa are capsa's own cases, for what the suite does not reach,
// run beside its cases and held to the same rule: PASS on tmpfs, and the
// same on the share.
var posixCapsa = map[string]func(*testing.T, string){
	"capsa.MmapGrowWhileStat": mmapGrowWhileStat,
}

// fsType is the type of the file system dir lies on, from the mount
// table: the mount with the longest mount point above it (a 9P share's
// statfs gives the host file system's type, not 9p).
func fsType(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	best, typ := "", ""
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		if mp := f[1]; (dir == mp || strings.HasPrefix(dir, strings.TrimSuffix(mp, "/")+"/")) && len(mp) >= len(best) {
			best, typ = mp, f[2]
		}
	}
	return typ
}

// mmapGrowWhileStat does what SQLite does with its WAL index (the -shm
// file) while another process stats it: truncate the file, extend it by
// writing a byte at the end of each page, map it shared and write to every
// page, again and again, while three threads fstat it. A stat's answer
// that is older than the writes must not shrink the guest's idea of the
// file's size, or the mapped pages past it fault with SIGBUS: on a 9P
// share, before kernel/patches/0003, 32 of 501 rounds did, in 60 s.
func mmapGrowWhileStat(t *testing.T, dir string) {
	const pages, page = 8, 4096
	path := filepath.Join(dir, "shm")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var stop atomic.Bool
	var wg sync.WaitGroup
	defer func() { stop.Store(true); wg.Wait() }()
	for range 3 {
		g, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer g.Close()
			var st syscall.Stat_t
			for !stop.Load() {
				if err := syscall.Fstat(int(g.Fd()), &st); err != nil {
					t.Errorf("fstat: %v", err)
					return
				}
			}
		}()
	}
	// A fault in the mapping becomes a panic this goroutine recovers.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	fd := int(f.Fd())
	// 15 s on a share (9P or virtio-fs), where the race lies (a round
	// there takes tens of milliseconds); elsewhere, the control,
	// thousands of rounds a second, 2 s.
	run := 2 * time.Second
	if typ := fsType(t, dir); typ == "9p" || typ == "virtiofs" {
		run = 15 * time.Second
	}
	rounds, faults := 0, 0
	for deadline := time.Now().Add(run); time.Now().Before(deadline); rounds++ {
		if err := syscall.Ftruncate(fd, 3); err != nil {
			t.Fatalf("ftruncate: %v", err)
		}
		for p := range pages {
			if _, err := syscall.Pwrite(fd, []byte{0}, int64(p*page+page-1)); err != nil {
				t.Fatalf("pwrite: %v", err)
			}
		}
		m, err := syscall.Mmap(fd, 0, pages*page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		if err != nil {
			t.Fatalf("mmap: %v", err)
		}
		func() {
			defer func() {
				if r := recover(); r != nil {
					faults++
				}
			}()
			for p := range pages {
				m[p*page+7]++
			}
		}()
		if err := syscall.Munmap(m); err != nil {
			t.Fatalf("munmap: %v", err)
		}
	}
	if faults > 0 {
		t.Errorf("%d of %d rounds faulted writing to a mapped page of a file %d pages long", faults, rounds, pages)
	}
	t.Logf("%d rounds", rounds)
}
