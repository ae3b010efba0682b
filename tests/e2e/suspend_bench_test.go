package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// BenchmarkSuspendImage measures what a suspension of an image sandbox
// costs with its memory (capsa suspend, the anchor) and with its disk
// alone (capsa suspend --no-memory, E2B's pause without memory), in one
// run, for 256 MiB and 1 GiB guests: each snapshot's time and size on
// disk, taken in turns from one running sandbox; then the way back to a
// first exec: a restore of the first beside a boot from the second.
func BenchmarkSuspendImage(b *testing.B) {
	ctx := context.Background()
	b.Setenv("CAPSA_CACHE", b.TempDir())
	startRegistry(b)
	ref := registryAddr + "/capsa-test/python:3.11"
	pushPythonImage(b, ref)
	execTrue := func(b *testing.B, sb *sandbox.Sandbox) {
		if out, err := sb.Exec(ctx, sandbox.Command("true")); err != nil || out.Code != 0 {
			b.Fatalf("true: %+v, %v", out, err)
		}
	}
	// A reboot boots a kernel: the test's (this binary has none built
	// in), as the restore's host-facing settings name it.
	boot := &sandbox.RestoreOptions{Settings: &sandbox.Spec{Kernel: artifactB(b, "vmlinux"), Initrd: artifactB(b, "initramfs.cpio")}}
	for _, mib := range []int{256, 1024} {
		src, err := sandbox.New().Memory(mib).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
			Entrypoint("sleep").OCI(ref, "100000").Start(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer src.Close()
		execTrue(b, src)
		dir := b.TempDir()
		var memSnap, diskSnap string
		b.Run(fmt.Sprintf("snapshot-memory-vs-disk-%dM", mib), func(b *testing.B) {
			var withMem, diskOnly []time.Duration
			var memDisk, diskDisk int64
			for i := 0; b.Loop(); i++ {
				// The guest's sync first, as the supervisor does
				// before either (untimed).
				b.StopTimer()
				if err := src.Sync(ctx); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				os.RemoveAll(memSnap)
				os.RemoveAll(diskSnap)
				memSnap, diskSnap = filepath.Join(dir, fmt.Sprint("mem-", i)), filepath.Join(dir, fmt.Sprint("disk-", i))
				t := time.Now()
				if err := src.Snapshot(ctx, memSnap); err != nil {
					b.Fatal(err)
				}
				withMem = append(withMem, time.Since(t))
				t = time.Now()
				if err := src.SnapshotWith(ctx, diskSnap, sandbox.SnapshotOptions{DiskOnly: true}); err != nil {
					b.Fatal(err)
				}
				diskOnly = append(diskOnly, time.Since(t))
				memDisk, diskDisk = diskBytes(b, memSnap), diskBytes(b, diskSnap)
			}
			reportSpreadAs(b, withMem, "memory-")
			reportSpreadAs(b, diskOnly, "disk-")
			b.ReportMetric(float64(memDisk)/(1<<20), "memory-MiB-on-disk")
			b.ReportMetric(float64(diskDisk)/(1<<20), "disk-MiB-on-disk")
		})
		b.Run(fmt.Sprintf("restore-vs-reboot-to-exec-%dM", mib), func(b *testing.B) {
			var restore, reboot []time.Duration
			for b.Loop() {
				t := time.Now()
				r, err := sandbox.Restore(ctx, memSnap, *boot)
				if err != nil {
					b.Fatal(err)
				}
				execTrue(b, r)
				restore = append(restore, time.Since(t))
				r.Close()
				t = time.Now()
				r, err = sandbox.Reboot(ctx, diskSnap, *boot)
				if err != nil {
					b.Fatal(err)
				}
				execTrue(b, r)
				reboot = append(reboot, time.Since(t))
				r.Close()
			}
			reportSpreadAs(b, restore, "restore-")
			reportSpreadAs(b, reboot, "reboot-")
		})
	}
}
