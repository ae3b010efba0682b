package e2e

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/virtio"
	"golang.org/x/sys/unix"
)

// metaScript is the metadata workload, timed inside the guest (so that an
// exec's own cost is not counted): "files" creates, stats, renames and
// removes 1,000 empty files; "tree" makes a tree 100 directories deep
// with a file in each, and a directory of 200 files (untimed setup);
// "walk" walks the tree with os.walk; "list" lists the 200 files and
// stats each as it goes, as ls -l, find -newer or git status do. It
// prints the seconds the timed part took.
const metaScript = `import os, sys, time
op, d = sys.argv[1], sys.argv[2]
os.makedirs(d, exist_ok=True)
os.chdir(d)
t = time.perf_counter()
if op == "files":
    for i in range(1000):
        open("f%d" % i, "wb").close()
    for i in range(1000):
        os.stat("f%d" % i)
    for i in range(1000):
        os.rename("f%d" % i, "g%d" % i)
    for i in range(1000):
        os.unlink("g%d" % i)
elif op == "tree":
    p = "tree"
    for i in range(100):
        p = os.path.join(p, "d")
        os.makedirs(p, exist_ok=True)
        open(os.path.join(p, "f"), "wb").close()
    os.makedirs("flat", exist_ok=True)
    for i in range(200):
        open(os.path.join("flat", "f%d" % i), "wb").close()
elif op == "list":
    n = 0
    with os.scandir("flat") as it:
        for e in it:
            e.stat(follow_symlinks=False)
            n += 1
    assert n == 200, n
elif op == "walk":
    n = sum(len(fs) for _, _, fs in os.walk("tree"))
    assert n == 100, n
print(time.perf_counter() - t)
`

// scriptSandbox starts a python image sandbox (1 GiB) whose read-write
// share at /w, over transport shareFS, holds script as /w/NAME.py, pulled
// from the test registry under tag name; it is closed when the benchmark
// ends.
func scriptSandbox(b *testing.B, ctx context.Context, name, script, shareFS string) *sandbox.Sandbox {
	b.Helper()
	ref := pythonImage(b, name)
	if r := capsaWith(b, 10*time.Minute, nil, "image", "pull", ref); r.code != 0 {
		b.Fatalf("capsa image pull %s: exit %d: %s", ref, r.code, r.stderr)
	}
	share := b.TempDir()
	if err := os.WriteFile(filepath.Join(share, name+".py"), []byte(script), 0o644); err != nil {
		b.Fatal(err)
	}
	sb, err := sandbox.New().Memory(1024).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
		Share(share, "/w", sandbox.ReadWrite).ShareFS(shareFS).Pull(sandbox.PullNever).OCI(ref, "sleep", "100000").User("0").Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { sb.Close() })
	return sb
}

// BenchmarkWorkspaceMeta runs the metadata workload in one image sandbox
// on a read-write 9P share and on the image's own root disk, one after
// the other in the same run, and in a second sandbox on a virtio-fs share
// (--share-fs virtiofs), and reports min, median and max of each, and each
// share's median over its sandbox's disk's; the 9P share also with the
// guest kernel keeping no dentries (9p.dentry_ttl_ms=0, Linux's own
// behaviour), the anchor for what kernel/patches/0002 changed.
//
//	make bench   (runs it in the nested host)
func BenchmarkWorkspaceMeta(b *testing.B) {
	ctx := context.Background()
	sb9p := scriptSandbox(b, ctx, "meta", metaScript, sandbox.ShareFS9P)
	sbFS := scriptSandbox(b, ctx, "meta", metaScript, sandbox.ShareFSVirtioFS)
	run := func(b *testing.B, sb *sandbox.Sandbox, op, dir string) time.Duration {
		b.Helper()
		o := sandbox.Command("python3", "/w/meta.py", op, dir)
		o.User, o.Timeout = "0", 10*time.Minute
		r, err := sb.Exec(ctx, o)
		if err != nil {
			b.Fatalf("meta.py %s %s: %v\nthe sandbox's state:\n%s", op, dir, err, sb.Debug(ctx))
		}
		if r.Code != 0 {
			b.Fatalf("meta.py %s %s: exit %d %s %s", op, dir, r.Code, r.Stdout, r.Stderr)
		}
		s, err := strconv.ParseFloat(strings.TrimSpace(string(r.Stdout)), 64)
		if err != nil {
			b.Fatalf("meta.py %s %s printed %q", op, dir, r.Stdout)
		}
		return time.Duration(s * float64(time.Second))
	}
	// ttl sets how long the guest kernel trusts a directory's or a
	// missing name's dentry on a 9P share (kernel/patches/0002); 0 is
	// the unpatched client's behaviour, every dentry gone with its last
	// use.
	ttl := func(b *testing.B, sb *sandbox.Sandbox, ms string) {
		o := sandbox.Shell("echo " + ms + " > /sys/module/9p/parameters/dentry_ttl_ms")
		o.User = "0"
		if r, err := sb.Exec(ctx, o); err != nil || r.Code != 0 {
			b.Fatalf("set 9p.dentry_ttl_ms to %s: %v %v", ms, r, err)
		}
	}
	places := []struct {
		name, dir, ttl string
		sb             *sandbox.Sandbox
	}{
		{"disk", "/root/meta", "1000", sb9p},
		{"share", "/w/meta", "1000", sb9p},
		{"share-dentries-not-kept", "/w/meta0", "0", sb9p},
		{"disk-virtiofs-sandbox", "/root/meta", "", sbFS},
		{"share-virtiofs", "/w/meta", "", sbFS},
	}
	for _, place := range places {
		if place.ttl != "" {
			ttl(b, place.sb, place.ttl)
		}
		run(b, place.sb, "tree", place.dir)
	}
	for _, op := range []string{"files", "walk", "list"} {
		var diskMedian time.Duration
		for _, place := range places {
			b.Run(place.name+"/"+op, func(b *testing.B) {
				if place.ttl != "" {
					ttl(b, place.sb, place.ttl)
				}
				var samples []time.Duration
				for b.Loop() {
					samples = append(samples, run(b, place.sb, op, place.dir))
				}
				reportOverDisk(b, place.name, samples, &diskMedian)
			})
		}
	}
}

// reportOverDisk reports the samples' spread and, for a place not named
// disk..., its median over *diskMedian, the last disk place's median,
// which a disk place sets.
func reportOverDisk(b *testing.B, place string, samples []time.Duration, diskMedian *time.Duration) {
	reportSpread(b, samples)
	m := samples[len(samples)/2] // reportSpread sorted them
	if strings.HasPrefix(place, "disk") {
		*diskMedian = m
	} else if *diskMedian > 0 {
		b.ReportMetric(float64(m)/float64(*diskMedian), "x-disk")
	}
}

// tripScript times one system call pattern n times in a directory,
// inside the guest, and prints the seconds: stat of a file, fstat of an
// open one, stat of a missing name, open-read-close of a 100-byte file,
// and create-close then unlink of a new file.
const tripScript = `import os, sys, time
op, d, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(d, exist_ok=True)
os.chdir(d)
with open("exists", "wb") as f: f.write(b"x" * 100)
if op == "fstat": fd = os.open("exists", os.O_RDONLY)
t = time.perf_counter()
if op == "stat":
    for i in range(n): os.stat("exists")
elif op == "fstat":
    for i in range(n): os.fstat(fd)
elif op == "missing":
    for i in range(n):
        try: os.stat("missing")
        except FileNotFoundError: pass
elif op == "read":
    for i in range(n):
        with open("exists", "rb") as f: f.read()
elif op == "create":
    for i in range(n):
        open("c%d" % i, "wb").close()
        os.unlink("c%d" % i)
print(time.perf_counter() - t)
`

// BenchmarkShareRoundTrips says where a share's system call goes: for
// each pattern of tripScript, on a read-write share and on the image's
// root disk in one image sandbox, the time per call, and for the share the
// 9P requests each call made (the share device's completed requests, read
// from its virtqueue), the VM exits to capsa per request, and capsa's own
// CPU time outside the vCPUs per request (the 9P server's work, with the
// exec's). In the nested host, where the test runs as root with L1's
// debugfs, it also reports the exits L1's KVM took per request, those
// handled in L1's kernel included (notifications, halts, interrupt
// windows), which capsa never sees.
//
//	make bench BENCH=ShareRoundTrips
func BenchmarkShareRoundTrips(b *testing.B) {
	ctx := context.Background()
	sb9p := scriptSandbox(b, ctx, "trips", tripScript, sandbox.ShareFS9P)
	sbFS := scriptSandbox(b, ctx, "trips", tripScript, sandbox.ShareFSVirtioFS)
	// The script runs from the image's disk, so that only the timed calls
	// ask the share anything (its directory made once, untimed).
	for _, sb := range []*sandbox.Sandbox{sb9p, sbFS} {
		cp := sandbox.Shell("cp /w/trips.py /root/trips.py")
		cp.User = "0"
		if r, err := sb.Exec(ctx, cp); err != nil || r.Code != 0 {
			b.Fatalf("copy trips.py to the disk: %v %+v", err, r)
		}
	}
	// L1's KVM counters, where this runs as root in the nested host.
	if _, err := os.Stat("/sys/kernel/debug/kvm"); err != nil && os.Geteuid() == 0 {
		unix.Mount("debugfs", "/sys/kernel/debug", "debugfs", 0, "")
	}
	kvmExits := func() (uint64, bool) {
		s, err := os.ReadFile("/sys/kernel/debug/kvm/exits")
		if err != nil {
			return 0, false
		}
		n, err := strconv.ParseUint(strings.TrimSpace(string(s)), 10, 64)
		return n, err == nil
	}
	// requests is each share device's queues' used indexes: their
	// completed requests, which wrap at 2^16 (a virtio-fs device's
	// high-priority queue's FORGETs among them).
	requests := func(sb *sandbox.Sandbox) []uint16 {
		var idx []uint16
		for _, tr := range sb.Debug(ctx).Virtio {
			if tr.Type == virtio.Type9P || tr.Type == virtio.TypeFS {
				for _, q := range tr.Queues {
					idx = append(idx, q.UsedIdx)
				}
			}
		}
		return idx
	}
	const n = 200
	for _, op := range []string{"stat", "fstat", "missing", "read", "create"} {
		for _, place := range []struct {
			name, dir, metric string
			sb                *sandbox.Sandbox
		}{
			{"disk", "/root/trips", "", sb9p},
			{"share", "/w/trips", "9p-requests/call", sb9p},
			{"share-virtiofs", "/w/trips", "fuse-requests/call", sbFS},
		} {
			sb := place.sb
			b.Run(place.name+"/"+op, func(b *testing.B) {
				var samples []time.Duration
				var reqs, exits, l1Exits uint64
				var vmmCPU time.Duration
				l1 := true
				for b.Loop() {
					st0, err := sb.Stats()
					if err != nil {
						b.Fatal(err)
					}
					q0 := requests(sb)
					k0, ok0 := kvmExits()
					o := sandbox.Command("python3", "/root/trips.py", op, place.dir, strconv.Itoa(n))
					o.User, o.Timeout = "0", 10*time.Minute
					r, err := sb.Exec(ctx, o)
					if err != nil || r.Code != 0 {
						b.Fatalf("trips.py %s %s: %v %+v", op, place.dir, err, r)
					}
					k1, ok1 := kvmExits()
					q1 := requests(sb)
					st1, err := sb.Stats()
					if err != nil {
						b.Fatal(err)
					}
					s, err := strconv.ParseFloat(strings.TrimSpace(string(r.Stdout)), 64)
					if err != nil {
						b.Fatalf("trips.py %s %s printed %q", op, place.dir, r.Stdout)
					}
					samples = append(samples, time.Duration(s*float64(time.Second)/n))
					for i := range min(len(q0), len(q1)) {
						reqs += uint64(q1[i] - q0[i])
					}
					exits += st1.Exits - st0.Exits
					vmmCPU += st1.VMMCPUTime - st0.VMMCPUTime
					l1 = l1 && ok0 && ok1
					l1Exits += k1 - k0
				}
				reportSpreadAs(b, samples, "call-")
				if place.metric == "" || reqs == 0 {
					return
				}
				calls := float64(n) * float64(len(samples))
				b.ReportMetric(float64(reqs)/calls, place.metric)
				b.ReportMetric(float64(exits)/float64(reqs), "exits/request")
				b.ReportMetric(float64(vmmCPU.Microseconds())/float64(reqs), "vmm-cpu-us/request")
				if l1 {
					b.ReportMetric(float64(l1Exits)/float64(reqs), "l1-kvm-exits/request")
				}
			})
		}
	}
}

// gitRepoScript makes, on the sandbox's own disk, a git checkout of 5,000
// files in 50 directories, committed and packed, and a tar of it.
const gitRepoScript = `set -e; mkdir -p /root/repo; cd /root/repo; git init -q; ` +
	`git config user.email bench@capsa.test; git config user.name bench; d=0; ` +
	`while [ $d -lt 50 ]; do mkdir d$d; f=0; while [ $f -lt 100 ]; do echo "$d $f" > d$d/f$f; f=$((f+1)); done; d=$((d+1)); done; ` +
	`git add -A; git commit -qm init; git gc -q; tar cf /root/repo.tar -C /root repo`

// gitStatusScript times git status --porcelain in a checkout, inside the
// guest, and prints the nanoseconds; it fails where the checkout is not
// clean (and the benchmark where git wrote any error).
const gitStatusScript = `cd "$1"; s=$(date +%s%N); out=$(git status --porcelain); e=$(date +%s%N); ` +
	`[ -z "$out" ] || { echo "not clean: $out" >&2; exit 3; }; echo $((e-s))`

// BenchmarkWorkspaceGit times git status in a 5,000-file checkout on the
// image's disk and on a read-write share, over 9P and over virtio-fs, each
// share in its own sandbox beside that sandbox's disk, and reports min,
// median and max of each and each share's median over its disk's. The
// checkout is made on one sandbox's disk and copied into both shares
// from the host (so that making it is not what is measured); the first
// git status in each place, which finds every file's host inode new and
// reads it again, is not timed.
//
//	make bench BENCH=WorkspaceGit
func BenchmarkWorkspaceGit(b *testing.B) {
	ctx := context.Background()
	ref := toolsImage(b, "bench")
	if r := capsaWith(b, 10*time.Minute, nil, "image", "pull", ref); r.code != 0 {
		b.Fatalf("capsa image pull %s: exit %d: %s", ref, r.code, r.stderr)
	}
	start := func(shareFS string) (*sandbox.Sandbox, string) {
		share := b.TempDir()
		sb, err := sandbox.New().Memory(1024).CPUs(2).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
			Share(share, "/w", sandbox.ReadWrite).ShareFS(shareFS).Pull(sandbox.PullNever).OCI(ref, "sleep", "100000").User("0").Start(ctx)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { sb.Close() })
		o := sandbox.Shell(gitRepoScript)
		o.User, o.Timeout = "0", 10*time.Minute
		if r, err := sb.Exec(ctx, o); err != nil || r.Code != 0 {
			b.Fatalf("make the checkout: %+v, %v", r, err)
		}
		return sb, share
	}
	sb9p, share9p := start(sandbox.ShareFS9P)
	sbFS, shareFS := start(sandbox.ShareFSVirtioFS)
	tarFile := filepath.Join(b.TempDir(), "repo.tar")
	f, err := os.Create(tarFile)
	if err != nil {
		b.Fatal(err)
	}
	if err := sb9p.ReadFileTo(ctx, "/root/repo.tar", f); err != nil {
		b.Fatal(err)
	}
	f.Close()
	for _, dir := range []string{share9p, shareFS} {
		if err := untar(tarFile, dir); err != nil {
			b.Fatal(err)
		}
	}
	status := func(b *testing.B, sb *sandbox.Sandbox, dir string) time.Duration {
		b.Helper()
		o := sandbox.Command("sh", "-c", gitStatusScript, "sh", dir)
		o.User, o.Timeout = "0", 10*time.Minute
		r, err := sb.Exec(ctx, o)
		if err != nil || r.Code != 0 || len(r.Stderr) > 0 {
			// git status exits 0 after failing to read files (a
			// virtio-fs share at ba5cc8c answered ENFILE here).
			b.Fatalf("git status in %s: exit %d, %v; stderr %.2000s", dir, r.Code, err, r.Stderr)
		}
		ns, err := strconv.ParseInt(strings.TrimSpace(string(r.Stdout)), 10, 64)
		if err != nil {
			b.Fatalf("git status in %s printed %q", dir, r.Stdout)
		}
		return time.Duration(ns)
	}
	places := []struct {
		name, dir string
		sb        *sandbox.Sandbox
	}{
		{"disk", "/root/repo", sb9p},
		{"share", "/w/repo", sb9p},
		{"disk-virtiofs-sandbox", "/root/repo", sbFS},
		{"share-virtiofs", "/w/repo", sbFS},
	}
	for _, p := range places {
		status(b, p.sb, p.dir)
	}
	var diskMedian time.Duration
	for _, p := range places {
		b.Run(p.name, func(b *testing.B) {
			var samples []time.Duration
			for b.Loop() {
				samples = append(samples, status(b, p.sb, p.dir))
			}
			reportOverDisk(b, p.name, samples, &diskMedian)
		})
	}
}

// untar extracts the directories and regular files of the tar file into
// dir (the benchmark's own tar: no links, no names leaving dir).
func untar(file, dir string) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("untar %s: %w", file, err)
		}
		name := filepath.Join(dir, filepath.Clean("/"+h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(name, os.FileMode(h.Mode)&os.ModePerm|0o700); err != nil {
				return err
			}
		case tar.TypeReg:
			w, err := os.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, os.FileMode(h.Mode)&os.ModePerm)
			if err != nil {
				return err
			}
			_, err = io.Copy(w, tr)
			if cerr := w.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		default:
			return fmt.Errorf("untar %s: %s: type %c not expected", file, h.Name, h.Typeflag)
		}
	}
}
