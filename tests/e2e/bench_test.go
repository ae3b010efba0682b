package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/ratelimit"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// benchCmdline is the same for both VMMs: a quiet console, reset on reboot.
const benchCmdline = "console=ttyS0 quiet reboot=k panic=-1"

// bootOnce starts argv and returns the time until the guest's init prints
// its first line, then ends the VM.
func bootOnce(b *testing.B, argv []string) time.Duration {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	var at time.Duration
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "capsa-testinit: userspace reached") {
			at = time.Since(start)
			break
		}
	}
	// Measured: the VM is not waited for. (QEMU's microvm has no i8042,
	// and the guest's reboot=k falls back through other ways for tens of
	// seconds before QEMU sees a reset.)
	cmd.Process.Kill()
	err = cmd.Wait()
	if at == 0 {
		b.Fatalf("%s: the guest never reached userspace (%v)", argv[0], err)
	}
	return at
}

// BenchmarkBootToUserspace boots the same kernel and initramfs with capsa
// and with QEMU's microvm machine, taking turns, and reports min, median
// and max of each one's time from starting the VMM to the guest init's
// first console line, and capsa's median over QEMU's.
//
//	make bench   (runs it in the nested host with -test.benchtime 5x)
func BenchmarkBootToUserspace(b *testing.B) {
	benchBoots(b, artifactB(b, "vmlinux"), artifactB(b, "testinitrd.cpio"), benchCmdline, 1)
}

// benchBoots boots kernel and initrd with cmdline and cpus vCPUs under
// capsa and under QEMU's microvm, each started directly (no shell), one
// boot of each per iteration, in turn and the order swapped every
// iteration: the nested host's speed drifts within a run, and each pair
// of boots sees the same host. It reports each VMM's time from its start
// to the guest init's first console line (capsa-ms-*, qemu-microvm-ms-*)
// and capsa's median over QEMU's (capsa-x-qemu).
func benchBoots(b *testing.B, kernel, initrd, cmdline string, cpus int) {
	n := strconv.Itoa(cpus)
	vmms := []struct {
		name string
		argv []string
	}{
		{"capsa", []string{artifactB(b, "capsa"), "vm", "--kernel", kernel, "--initrd", initrd,
			"--cpus", n, "--memory", "256M", "--cmdline", cmdline}},
		{"qemu-microvm", []string{qemuPath(b), "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "256",
			"-smp", n, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio",
			"-kernel", kernel, "-initrd", initrd, "-append", cmdline}},
	}
	samples := make([][]time.Duration, len(vmms))
	turn := 0
	for b.Loop() {
		for k := range vmms {
			i := (k + turn) % len(vmms)
			samples[i] = append(samples[i], bootOnce(b, vmms[i].argv))
		}
		turn++
	}
	for i, v := range vmms {
		reportSpreadAs(b, samples[i], v.name+"-")
	}
	b.ReportMetric(float64(median(samples[0]))/float64(median(samples[1])), "capsa-x-qemu")
}

func artifactB(b *testing.B, name string) string { return artifact(b, name) }

// BenchmarkBootToAgentReady measures sandbox.Start: from starting the VMM to
// the guest agent announcing itself (the main process started). Compare with
// BenchmarkBootToUserspace/qemu-microvm, QEMU's boot to init on the same
// kernel.
func BenchmarkBootToAgentReady(b *testing.B) {
	kernel, initrd := artifactB(b, "vmlinux"), artifactB(b, "initramfs.cpio")
	var samples []time.Duration
	for b.Loop() {
		start := time.Now()
		sb, err := sandbox.New().Memory(256).Kernel(kernel).Initrd(initrd).Run("true").Start(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		samples = append(samples, time.Since(start))
		sb.Close()
	}
	reportSpread(b, samples)
}

// BenchmarkExecTrue measures the round trip of running `true` in a running
// sandbox: connect, handshake, fork and exec in the guest, exit status.
//
// It reports the VM exits an exec costs: each one milliseconds in the
// nested host. BenchmarkAgentStat is the same round trip without a process.
func BenchmarkExecTrue(b *testing.B) {
	ctx := context.Background()
	sb := newSandbox(b, ctx, 1)
	before := benchExits(b, sb)
	benchTrue(b, ctx, &sb.Guest)
	b.ReportMetric(float64(benchExits(b, sb)-before)/float64(b.N), "exits/op")
}

// BenchmarkAgentStat measures an agent operation that starts no process (a
// stat of /): the protocol's and the vsock's share of BenchmarkExecTrue.
func BenchmarkAgentStat(b *testing.B) {
	ctx := context.Background()
	sb := newSandbox(b, ctx, 1)
	before := benchExits(b, sb)
	var samples []time.Duration
	for b.Loop() {
		start := time.Now()
		if _, err := sb.Stat(ctx, "/"); err != nil {
			b.Fatalf("Stat(/) = %v", err)
		}
		samples = append(samples, time.Since(start))
	}
	reportSpread(b, samples)
	b.ReportMetric(float64(benchExits(b, sb)-before)/float64(b.N), "exits/op")
}

// benchExits is the VM exits sb has taken so far.
func benchExits(b *testing.B, sb *sandbox.Sandbox) uint64 {
	s, err := sb.Stats()
	if err != nil {
		b.Fatal(err)
	}
	return s.Exits
}

// benchTrue times `true` run to the end through g, b.N times.
func benchTrue(b *testing.B, ctx context.Context, g *sandbox.Guest) {
	var samples []time.Duration
	for b.Loop() {
		start := time.Now()
		if out, err := g.Exec(ctx, sandbox.Command("true")); err != nil || out.Code != 0 {
			b.Fatalf("true: %+v, %v", out, err)
		}
		samples = append(samples, time.Since(start))
	}
	reportSpread(b, samples)
}

// BenchmarkFileThroughput writes and reads a 64 MiB file through the agent.
func BenchmarkFileThroughput(b *testing.B) {
	ctx := context.Background()
	// 1 GiB: /tmp (half of RAM) holds the file and the copy that replaces it.
	sb, err := sandbox.New().Memory(1024).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
		Run("sleep", "100000").Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	data := make([]byte, 64<<20)
	b.Run("write", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			if err := sb.WriteFileFrom(ctx, "/tmp/bench", bytes.NewReader(data), 0o644); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("read", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			if err := sb.ReadFileTo(ctx, "/tmp/bench", io.Discard); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// copySelf copies the test binary to path in sb, to run there as one of
// its guest-side roles (probe, netBenchClient, the HTTP server).
func copySelf(tb testing.TB, ctx context.Context, sb *sandbox.Sandbox, path string) {
	tb.Helper()
	self, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	f, err := os.Open(self)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	if err := sb.WriteFileFrom(ctx, path, f, 0o755); err != nil {
		tb.Fatalf("copy the test binary to %s: %v", path, err)
	}
}

// dropCaches empties the guest's page cache, so the read after it is cold.
const dropCaches = "echo 3 > /proc/sys/vm/drop_caches"

// guestShell runs script in sb with a 5-minute deadline and fails b, with
// the sandbox's state, unless it exits 0.
func guestShell(b *testing.B, ctx context.Context, sb *sandbox.Sandbox, script string) {
	b.Helper()
	o := sandbox.Shell(script)
	o.Timeout = 5 * time.Minute
	if r, err := sb.Exec(ctx, o); err != nil {
		b.Fatalf("%s: %v\nthe sandbox's state:\n%s", script, err, sb.Debug(ctx))
	} else if r.Code != 0 {
		b.Fatalf("%s: exit %d %s %s", script, r.Code, r.Stdout, r.Stderr)
	}
}

func reportSpread(b *testing.B, samples []time.Duration) { reportSpreadAs(b, samples, "") }

// reportSpreadAs reports samples' min, median and max in milliseconds,
// their units prefixed with prefix.
func reportSpreadAs(b *testing.B, samples []time.Duration, prefix string) {
	slices.Sort(samples)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(samples[0]), prefix+"ms-min")
	b.ReportMetric(ms(samples[len(samples)/2]), prefix+"ms-median")
	b.ReportMetric(ms(samples[len(samples)-1]), prefix+"ms-max")
}

// BenchmarkShareThroughput copies a 16 MiB file between the host and the
// guest's /tmp both ways, over a virtio-9p share and through the agent's
// file API. The 9p rows copy with 1 MiB read and write calls (the test
// binary's "copy" probe, as GNU dd bs=1M would): the share mounts with
// writes going straight to the host, so each write call is one Twrite at
// most msize long. The dd rows are the initramfs's u-root dd, which
// copies in 32 KiB pieces whatever bs says (io.CopyN), so they measure
// 32 KiB writes.
func BenchmarkShareThroughput(b *testing.B) {
	ctx := context.Background()
	dir := b.TempDir()
	data := make([]byte, 16<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := os.WriteFile(filepath.Join(dir, "in.bin"), data, 0o644); err != nil {
		b.Fatal(err)
	}
	sb, err := sandbox.New().Memory(1024).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
		Share(dir, "/mnt/share", sandbox.ReadWrite).Run("sleep", "100000").Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	copySelf(b, ctx, sb, "/tmp/probe")
	sh := func(b *testing.B, script string) { guestShell(b, ctx, sb, script) }
	probeCopy := "; " + probeEnv + "=1 /tmp/probe copy "
	// One untimed copy first, so that no timed row pays for the guest
	// touching the probe's pages and /tmp's memory for the first time
	// (each first touch is a nested page fault; the agent rows run later
	// and would be spared it).
	sh(b, "true"+probeCopy+"/mnt/share/in.bin /tmp/copy")
	b.Run("9p-host-to-guest", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			sh(b, dropCaches+probeCopy+"/mnt/share/in.bin /tmp/copy")
		}
	})
	b.Run("9p-guest-to-host", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			sh(b, "true"+probeCopy+"/tmp/copy /mnt/share/out.bin")
		}
	})
	b.Run("dd-9p-host-to-guest", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			sh(b, dropCaches+"; dd if=/mnt/share/in.bin of=/tmp/copy bs=1048576")
		}
	})
	b.Run("dd-9p-guest-to-host", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			sh(b, "dd if=/tmp/copy of=/mnt/share/out.bin bs=1048576")
		}
	})
	b.Run("agent-host-to-guest", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			if err := sb.WriteFileFrom(ctx, "/tmp/copy", bytes.NewReader(data), 0o644); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("agent-guest-to-host", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			f, err := os.Create(filepath.Join(dir, "out2.bin"))
			if err != nil {
				b.Fatal(err)
			}
			err = sb.ReadFileTo(ctx, "/tmp/copy", f)
			f.Close()
			if err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkNAT measures TCP through the user-mode NAT between a guest
// program and a host listener on loopback (the guest dials the gateway,
// 10.0.2.2): 64 MiB each way, and sequential connection setup.
func BenchmarkNAT(b *testing.B) {
	ctx := context.Background()
	sb, err := sandbox.New().Memory(512).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
		Network(netstack.AllowAll()).Run("sleep", "100000").Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	copySelf(b, ctx, sb, "/tmp/netbench")
	const size = 64 << 20
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	port := l.Addr().(*net.TCPAddr).Port
	// The host end: serve(c) runs for each accepted connection.
	var serve atomic.Pointer[func(net.Conn)]
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { (*serve.Load())(c); c.Close() }()
		}
	}()
	guest := func(b *testing.B, job string) {
		// A deadline, so a stalled guest fails the benchmark with its
		// state instead of hanging it.
		r, err := sb.Exec(ctx, sandbox.ExecOptions{Argv: []string{"/tmp/netbench"}, Env: []string{netBenchEnv + "=" + job}, Timeout: 5 * time.Minute})
		if err != nil {
			b.Fatalf("guest %s: %v\nthe sandbox's state:\n%s", job, err, sb.Debug(ctx))
		} else if r.Code != 0 {
			b.Fatalf("guest %s: exit %d %s", job, r.Code, r.Stderr)
		}
	}
	b.Run("guest-to-host", func(b *testing.B) {
		sink := func(c net.Conn) { io.Copy(io.Discard, c) }
		serve.Store(&sink)
		b.SetBytes(size)
		for b.Loop() {
			guest(b, fmt.Sprintf("send 10.0.2.2:%d %d", port, size))
		}
	})
	hostToGuest := func(b *testing.B) {
		buf := make([]byte, 256<<10)
		source := func(c net.Conn) {
			for n := 0; n < size; n += len(buf) {
				if _, err := c.Write(buf); err != nil {
					return
				}
			}
		}
		serve.Store(&source)
		b.SetBytes(size)
		for b.Loop() {
			guest(b, fmt.Sprintf("recv 10.0.2.2:%d", port))
		}
	}
	b.Run("host-to-guest", hostToGuest)
	// The limiter's own cost: limits far above what the NAT reaches here,
	// against none (the run above), in the same sandbox.
	b.Run("host-to-guest-limited", func(b *testing.B) {
		far := ratelimit.Rate{Per: 10e9}
		if err := sb.SetLimits(ratelimit.Limits{NetRx: ratelimit.Limit{Bytes: far, Ops: far}}); err != nil {
			b.Fatal(err)
		}
		defer sb.SetLimits(ratelimit.Limits{})
		hostToGuest(b)
	})
	b.Run("connect", func(b *testing.B) {
		nothing := func(net.Conn) {}
		serve.Store(&nothing)
		const conns = 200
		var elapsed time.Duration
		for b.Loop() {
			start := time.Now()
			guest(b, fmt.Sprintf("connect 10.0.2.2:%d %d", port, conns))
			elapsed += time.Since(start)
		}
		b.ReportMetric(float64(conns*b.N)/elapsed.Seconds(), "conns/s")
	})
}

// BenchmarkDiskLimiter measures synchronous 256 KiB writes to a virtio-blk
// disk from the guest, without limits and with limits far above what the
// disk reaches here: the limiter's own cost, side by side in one sandbox.
func BenchmarkDiskLimiter(b *testing.B) {
	ctx := context.Background()
	disk := filepath.Join(b.TempDir(), "disk.img")
	if err := os.WriteFile(disk, nil, 0o600); err != nil {
		b.Fatal(err)
	}
	const size = 32 << 20
	if err := os.Truncate(disk, size); err != nil {
		b.Fatal(err)
	}
	sb, err := sandbox.New().Memory(512).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
		Disk(disk, sandbox.ReadWrite).Run("sleep", "100000").Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	copySelf(b, ctx, sb, "/tmp/netbench")
	write := func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			job := fmt.Sprintf("diskwrite /dev/vda %d", size)
			r, err := sb.Exec(ctx, sandbox.ExecOptions{Argv: []string{"/tmp/netbench"}, Env: []string{netBenchEnv + "=" + job}, Timeout: 5 * time.Minute})
			if err != nil || r.Code != 0 {
				b.Fatalf("guest %s: %+v, %v", job, r, err)
			}
		}
	}
	b.Run("none", write)
	b.Run("limited", func(b *testing.B) {
		if err := sb.SetLimits(ratelimit.Limits{Disk: ratelimit.Limit{Bytes: ratelimit.Rate{Per: 10e9}, Ops: ratelimit.Rate{Per: 1e6}}}); err != nil {
			b.Fatal(err)
		}
		defer sb.SetLimits(ratelimit.Limits{})
		write(b)
	})
}
