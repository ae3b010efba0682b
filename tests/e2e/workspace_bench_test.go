package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// metaScript is the metadata workload, timed inside the guest (so that an
// exec's own cost is not counted): "files" creates, stats, renames and
// removes 1,000 empty files; "tree" makes a tree 100 directories deep
// with a file in each (untimed setup); "walk" walks it with os.walk. It
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
elif op == "walk":
    n = sum(len(fs) for _, _, fs in os.walk("tree"))
    assert n == 100, n
print(time.perf_counter() - t)
`

// BenchmarkWorkspaceMeta runs the metadata workload in one image sandbox
// on a read-write share and on the image's own root disk, one after the
// other in the same run, and reports min, median and max of each, and the
// share's median over the disk's; the share also with the guest kernel
// keeping no dentries (9p.dentry_ttl_ms=0, Linux's own behaviour), the
// anchor for what kernel/patches/0002 changed.
//
//	make bench   (runs it in the nested host)
func BenchmarkWorkspaceMeta(b *testing.B) {
	ctx := context.Background()
	ref := pythonImage(b, "meta")
	if r := capsaWith(b, 10*time.Minute, nil, "image", "pull", ref); r.code != 0 {
		b.Fatalf("capsa image pull %s: exit %d: %s", ref, r.code, r.stderr)
	}
	share := b.TempDir()
	if err := os.WriteFile(filepath.Join(share, "meta.py"), []byte(metaScript), 0o644); err != nil {
		b.Fatal(err)
	}
	sb, err := sandbox.New().Memory(1024).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
		Share(share, "/w", sandbox.ReadWrite).Pull(sandbox.PullNever).OCI(ref, "sleep", "100000").User("0").Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	run := func(b *testing.B, op, dir string) time.Duration {
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
	// missing name's dentry on the share (kernel/patches/0002); 0 is the
	// unpatched client's behaviour, every dentry gone with its last use.
	ttl := func(b *testing.B, ms string) {
		o := sandbox.Shell("echo " + ms + " > /sys/module/9p/parameters/dentry_ttl_ms")
		o.User = "0"
		if r, err := sb.Exec(ctx, o); err != nil || r.Code != 0 {
			b.Fatalf("set 9p.dentry_ttl_ms to %s: %v %v", ms, r, err)
		}
	}
	places := []struct{ name, dir, ttl string }{
		{"disk", "/root/meta", "1000"},
		{"share", "/w/meta", "1000"},
		{"share-dentries-not-kept", "/w/meta0", "0"},
	}
	for _, place := range places {
		ttl(b, place.ttl)
		run(b, "tree", place.dir)
	}
	for _, op := range []string{"files", "walk"} {
		var diskMedian time.Duration
		for _, place := range places {
			b.Run(place.name+"/"+op, func(b *testing.B) {
				ttl(b, place.ttl)
				var samples []time.Duration
				for b.Loop() {
					samples = append(samples, run(b, op, place.dir))
				}
				reportSpread(b, samples)
				m := samples[len(samples)/2] // reportSpread sorted them
				if place.name == "disk" {
					diskMedian = m
				} else if diskMedian > 0 {
					b.ReportMetric(float64(m)/float64(diskMedian), "x-disk")
				}
			})
		}
	}
}
