package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// BenchmarkSnapshot measures, in one run: a cold boot (the anchor) beside
// a restore, each until the sandbox is ready (its agent answers, its main
// process runs) and until its first exec has run, and a snapshot's time
// and size on disk, full and as a layer over an earlier one after 10 MiB
// written, and a restore of that layer, for 256 MiB and 1 GiB guests; a fork of 8; a pool's
// hand-out; and the host memory 8 sandboxes restored from one snapshot
// take against 8 guests' memory.
func BenchmarkSnapshot(b *testing.B) {
	ctx := context.Background()
	start := func(b *testing.B, mib int) *sandbox.Sandbox {
		sb, err := sandbox.New().Memory(mib).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
			Run("sleep", "100000").Start(ctx)
		if err != nil {
			b.Fatal(err)
		}
		return sb
	}
	execTrue := func(b *testing.B, sb *sandbox.Sandbox) {
		if out, err := sb.Exec(ctx, sandbox.Command("true")); err != nil || out.Code != 0 {
			b.Fatalf("true: %+v, %v", out, err)
		}
	}
	timed := func(b *testing.B, fn func()) {
		var samples []time.Duration
		for b.Loop() {
			t := time.Now()
			fn()
			samples = append(samples, time.Since(t))
		}
		reportSpread(b, samples)
	}
	snaps := map[int]string{}
	for _, mib := range []int{256, 1024} {
		b.Run(fmt.Sprintf("boot-%dM", mib), func(b *testing.B) {
			timed(b, func() { start(b, mib).Close() })
		})
		b.Run(fmt.Sprintf("boot-to-exec-%dM", mib), func(b *testing.B) {
			timed(b, func() { sb := start(b, mib); execTrue(b, sb); sb.Close() })
		})
		src := start(b, mib)
		defer src.Close()
		b.Run(fmt.Sprintf("snapshot-%dM", mib), func(b *testing.B) {
			var disk int64
			i := 0
			timed(b, func() {
				dir := filepath.Join(b.TempDir(), fmt.Sprint(i))
				i++
				if err := src.Snapshot(ctx, dir); err != nil {
					b.Fatal(err)
				}
				disk = diskBytes(b, dir)
			})
			b.ReportMetric(float64(disk)/(1<<20), "MiB-on-disk")
		})
		dir := filepath.Join(b.TempDir(), "snap")
		if err := src.Snapshot(ctx, dir); err != nil {
			b.Fatal(err)
		}
		snaps[mib] = dir
		// A full snapshot and a layer over the one just taken, each
		// after the guest wrote 10 MiB afresh (untimed), side by side.
		var layer string
		b.Run(fmt.Sprintf("snapshot-after-10M-full-vs-layer-%dM", mib), func(b *testing.B) {
			var full, over []time.Duration
			var fullDisk, layerDisk int64
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				if out, err := src.Exec(ctx, sandbox.Shell("head -c 10485760 /dev/urandom > /tmp/churn")); err != nil || out.Code != 0 {
					b.Fatalf("churn: %+v, %v", out, err)
				}
				b.StartTimer()
				f := filepath.Join(filepath.Dir(dir), fmt.Sprintf("full-%d", i))
				t := time.Now()
				if err := src.Snapshot(ctx, f); err != nil {
					b.Fatal(err)
				}
				full = append(full, time.Since(t))
				layer = filepath.Join(filepath.Dir(dir), fmt.Sprintf("layer-%d", i))
				t = time.Now()
				if err := src.SnapshotWith(ctx, layer, sandbox.SnapshotOptions{Parent: dir}); err != nil {
					b.Fatal(err)
				}
				over = append(over, time.Since(t))
				fullDisk, layerDisk = diskBytes(b, f), diskBytes(b, layer)
				os.RemoveAll(f)
			}
			reportSpreadAs(b, full, "full-")
			reportSpreadAs(b, over, "layer-")
			b.ReportMetric(float64(fullDisk)/(1<<20), "full-MiB-on-disk")
			b.ReportMetric(float64(layerDisk)/(1<<20), "layer-MiB-on-disk")
		})
		b.Run(fmt.Sprintf("restore-layer-%dM", mib), func(b *testing.B) {
			timed(b, func() {
				r, err := sandbox.Restore(ctx, layer, sandbox.RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				r.Close()
			})
		})
		b.Run(fmt.Sprintf("restore-%dM", mib), func(b *testing.B) {
			var last string
			timed(b, func() {
				r, err := sandbox.Restore(ctx, dir, sandbox.RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				last = r.Timeline().String()
				r.Close()
			})
			// Where a restore goes (docs/performance.md), whole: the
			// testing package cuts a benchmark's log to ten lines.
			fmt.Printf("%s: the last restore's %s", b.Name(), last)
		})
		b.Run(fmt.Sprintf("restore-to-exec-%dM", mib), func(b *testing.B) {
			timed(b, func() {
				r, err := sandbox.Restore(ctx, dir, sandbox.RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				execTrue(b, r)
				r.Close()
			})
		})
	}
	b.Run("fork-8-256M", func(b *testing.B) {
		// The fork until the copies run, the source's pause (its first
		// fork writes its whole memory, a later one what it wrote
		// since), and the fork until each copy has run a first exec.
		src := start(b, 256)
		defer src.Close()
		var forks, stalls, execs []time.Duration
		var first time.Duration
		for i := 0; b.Loop(); i++ {
			t := time.Now()
			copies, err := src.Fork(ctx, 8, sandbox.RestoreOptions{})
			if err != nil {
				b.Fatal(err)
			}
			forks = append(forks, time.Since(t))
			if i == 0 {
				first = src.LastPause()
			} else {
				stalls = append(stalls, src.LastPause())
			}
			var wg sync.WaitGroup
			for _, c := range copies {
				wg.Go(func() { execTrue(b, c) })
			}
			wg.Wait()
			execs = append(execs, time.Since(t))
			for _, c := range copies {
				c.Close()
			}
			b.StopTimer()
			// Something for the next fork to write: 4 MiB afresh.
			if out, err := src.Exec(ctx, sandbox.Shell("head -c 4194304 /dev/urandom > /tmp/churn")); err != nil || out.Code != 0 {
				b.Fatalf("churn: %+v, %v", out, err)
			}
			b.StartTimer()
		}
		reportSpread(b, forks)
		reportSpreadAs(b, execs, "to-exec-")
		b.ReportMetric(float64(first.Microseconds())/1000, "first-stall-ms")
		if len(stalls) > 0 {
			reportSpreadAs(b, stalls, "later-stall-")
		}
	})
	b.Run("pool-get-256M", func(b *testing.B) {
		pool, err := sandbox.NewPool(snaps[256], 2, sandbox.RestoreOptions{})
		if err != nil {
			b.Fatal(err)
		}
		defer pool.Close()
		var samples []time.Duration
		for b.Loop() {
			// The hand-out of a ready sandbox, to its first exec: wait
			// (untimed) for the pool to refill.
			b.StopTimer()
			for pool.Ready() == 0 {
				time.Sleep(10 * time.Millisecond)
			}
			b.StartTimer()
			t := time.Now()
			sb, err := pool.Get(ctx)
			if err != nil {
				b.Fatal(err)
			}
			execTrue(b, sb)
			samples = append(samples, time.Since(t))
			sb.Close()
		}
		reportSpread(b, samples)
	})
	b.Run("idle-restores-16-256M", func(b *testing.B) {
		// What an idle sandbox restored from a template costs the host:
		// 16 restored, each runs an exec, then all idle for 10 s; the
		// host's MemAvailable before against after (KVM's and the
		// kernel's share included, not only this process's), and how
		// many such sandboxes the memory available before would hold.
		const n = 16
		for b.Loop() {
			before := memAvailableMiB(b)
			var rs []*sandbox.Sandbox
			for range n {
				r, err := sandbox.Restore(ctx, snaps[256], sandbox.RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				execTrue(b, r)
				rs = append(rs, r)
			}
			time.Sleep(10 * time.Second)
			each := float64(before-memAvailableMiB(b)) / n
			b.ReportMetric(each, "MiB-host-each")
			b.ReportMetric(float64(before), "MiB-available-before")
			if each > 0 {
				b.ReportMetric(float64(before)/each, "sandboxes-fit")
			}
			for _, r := range rs {
				r.Close()
			}
		}
	})
	b.Run("memory-8-restores-256M", func(b *testing.B) {
		for b.Loop() {
			before := pssMiB(b)
			var rs []*sandbox.Sandbox
			for range 8 {
				r, err := sandbox.Restore(ctx, snaps[256], sandbox.RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				execTrue(b, r)
				rs = append(rs, r)
			}
			b.ReportMetric(float64(pssMiB(b)-before), "MiB-host")
			b.ReportMetric(8*256, "MiB-guests")
			for _, r := range rs {
				r.Close()
			}
		}
	})
}

// memAvailableMiB is the host's MemAvailable (/proc/meminfo): what it
// could still give, page cache it would drop included.
func memAvailableMiB(b *testing.B) int {
	kb, err := procField("/proc/meminfo", "MemAvailable")
	if err != nil {
		b.Fatal(err)
	}
	return int(kb / 1024)
}

// diskBytes is what the files in dir take on disk.
func diskBytes(b *testing.B, dir string) int64 {
	var n int64
	entries, err := os.ReadDir(dir)
	if err != nil {
		b.Fatal(err)
	}
	for _, e := range entries {
		fi, err := e.Info()
		if err != nil {
			b.Fatal(err)
		}
		n += fi.Sys().(*syscall.Stat_t).Blocks * 512
	}
	return n
}

// BenchmarkForkPause measures a first fork's pause of its source (256 MiB,
// 32 MiB of it written by the guest first, a process writing on through
// the fork): with the memory written while the sandbox is paused, the
// anchor (Builder.PausedForkCopy), then copied while it runs and only
// what changed meanwhile written while paused (guestmem.PreCopy), with
// the ratio of the medians. Each round boots a fresh source and forks it
// into one copy.
func BenchmarkForkPause(b *testing.B) {
	ctx := context.Background()
	var anchor time.Duration
	for _, paused := range []bool{true, false} {
		name := "precopy-256M"
		if paused {
			name = "paused-copy-256M"
		}
		b.Run(name, func(b *testing.B) {
			var pauses, forks []time.Duration
			for b.Loop() {
				b.StopTimer()
				bl := sandbox.New().Memory(256).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio"))
				if paused {
					bl.PausedForkCopy()
				}
				src, err := bl.Run("sleep", "100000").Start(ctx)
				if err != nil {
					b.Fatal(err)
				}
				if out, err := src.Exec(ctx, sandbox.Shell("head -c 33554432 /dev/urandom > /tmp/fill")); err != nil || out.Code != 0 {
					b.Fatalf("fill: %+v, %v", out, err)
				}
				writer, err := src.Stream(ctx, sandbox.ExecOptions{Shell: "while :; do head -c 65536 /dev/urandom > /tmp/w; done"})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				t := time.Now()
				copies, err := src.Fork(ctx, 1, sandbox.RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				forks = append(forks, time.Since(t))
				b.StopTimer()
				pauses = append(pauses, src.LastPause())
				writer.Signal(ctx, "KILL")
				copies[0].Close()
				src.Close()
				b.StartTimer()
			}
			reportSpreadAs(b, pauses, "pause-")
			reportSpreadAs(b, forks, "fork-")
			slices.Sort(pauses)
			median := pauses[len(pauses)/2]
			if paused {
				anchor = median
			} else if anchor > 0 {
				b.ReportMetric(float64(median)/float64(anchor), "pause-x-anchor")
			}
		})
	}
}
