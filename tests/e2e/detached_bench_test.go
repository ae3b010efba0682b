package e2e

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/store"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// BenchmarkDetachedExec measures `true` run in a detached sandbox, beside
// the same in a sandbox of this process (the anchor): through a library
// handle to the supervisor (Manager.Open), and as a whole `capsa exec`
// command. It also reports the supervisor's RSS beside the guest memory
// the host holds for it.
func BenchmarkDetachedExec(b *testing.B) {
	ctx := context.Background()
	b.Run("in-process", func(b *testing.B) { benchTrue(b, ctx, &newSandbox(b, ctx, 1).Guest) })

	dir := b.TempDir()
	b.Cleanup(func() { stopAll(b, dir) })
	// The first start on a machine unpacks the built-in kernel and
	// initramfs into the cache, reading their compressed copies in the
	// binary, whose pages then stay resident: measure what every later
	// sandbox holds.
	if out, err := exec.Command(artifact(b, "capsa"), "run", "--", "true").CombinedOutput(); err != nil {
		b.Fatalf("capsa run -- true: %v\n%s", err, out)
	}
	run := exec.Command(artifact(b, "capsa"), "run", "-d", "--name", "bench", "--memory", "256M", "--", "sleep", "100000")
	run.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	if out, err := run.CombinedOutput(); err != nil {
		b.Fatalf("capsa run -d: %v\n%s", err, out)
	}
	st, err := store.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	m, err := supervisor.OpenManager(dir)
	if err != nil {
		b.Fatal(err)
	}
	h, err := m.Open(ctx, "bench")
	if err != nil {
		b.Fatal(err)
	}
	b.Run("supervisor-handle", func(b *testing.B) { benchTrue(b, ctx, h.Guest) })
	b.Run("capsa-exec-cli", func(b *testing.B) {
		var samples []time.Duration
		for b.Loop() {
			start := time.Now()
			c := exec.Command(artifact(b, "capsa"), "exec", "bench", "--", "true")
			c.Env = append(os.Environ(), "CAPSA_STATE="+dir)
			if out, err := c.CombinedOutput(); err != nil {
				b.Fatalf("capsa exec bench -- true: %v\n%s", err, out)
			}
			samples = append(samples, time.Since(start))
		}
		reportSpread(b, samples)
	})
	b.Run("memory", func(b *testing.B) { benchVMMOwn(b, ctx, st, "bench", h) })

	// The same with a NIC and the NAT behind it (--net=public-only), after
	// the same kind of use: execs through a handle.
	runNet := exec.Command(artifact(b, "capsa"), "run", "-d", "--name", "bench-net", "--net=public-only", "--memory", "256M", "--", "sleep", "100000")
	runNet.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	if out, err := runNet.CombinedOutput(); err != nil {
		b.Fatalf("capsa run -d --net=public-only: %v\n%s", err, out)
	}
	hn, err := m.Open(ctx, "bench-net")
	if err != nil {
		b.Fatal(err)
	}
	for range 20 {
		if out, err := hn.Guest.Exec(ctx, sandbox.Command("true")); err != nil || out.Code != 0 {
			b.Fatalf("Exec(true) in bench-net = %+v, %v", out, err)
		}
	}
	b.Run("memory-net", func(b *testing.B) { benchVMMOwn(b, ctx, st, "bench-net", hn) })
}

// benchVMMOwn reports a detached sandbox's supervisor RSS, the guest memory
// the host holds for it, and the difference: the VMM's own memory.
func benchVMMOwn(b *testing.B, ctx context.Context, st *store.Store, name string, h *supervisor.Handle) {
	rec, err := st.Get(name)
	if err != nil {
		b.Fatal(err)
	}
	var rss, guest float64
	for b.Loop() {
		if rss, err = vmRSS(rec.PID); err != nil {
			b.Fatal(err)
		}
		s, err := h.Stats(ctx)
		if err != nil {
			b.Fatal(err)
		}
		guest = float64(s.MemoryResident)
	}
	// The supervisor's RSS counts the guest memory it touched: the VMM's
	// own is the difference.
	b.ReportMetric(rss/(1<<20), "supervisor-RSS-MiB")
	b.ReportMetric(guest/(1<<20), "guest-resident-MiB")
	b.ReportMetric((rss-guest)/(1<<20), "VMM-own-MiB")
}

// vmRSS reads a process's resident set size, in bytes.
func vmRSS(pid int) (float64, error) {
	kb, err := procField("/proc/"+strconv.Itoa(pid)+"/status", "VmRSS")
	return float64(kb) * 1024, err
}
