package e2e

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// benchCmdline is the same for both VMMs: a quiet console, reset on reboot.
const benchCmdline = "console=ttyS0 quiet reboot=k panic=-1"

// bootOnce starts argv and returns the time until the guest's init prints
// its first line, then waits for the VM to end (the test init reboots).
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
		if at == 0 && strings.Contains(sc.Text(), "capsa-testinit: userspace reached") {
			at = time.Since(start)
		}
	}
	if err := cmd.Wait(); err != nil {
		b.Fatalf("%s: %v", argv[0], err)
	}
	if at == 0 {
		b.Fatalf("%s: the guest never reached userspace", argv[0])
	}
	return at
}

// BenchmarkBootToUserspace boots the same kernel and initramfs with capsa
// and with QEMU's microvm machine, and reports min, median and max of the
// time from starting the VMM to the guest init's first console line.
//
//	make bench   (runs it in the nested host with -test.benchtime 5x)
func BenchmarkBootToUserspace(b *testing.B) {
	kernel := artifactB(b, "vmlinux")
	initrd := artifactB(b, "testinitrd.cpio")
	vmms := []struct {
		name string
		argv []string
	}{
		{"capsa", []string{artifactB(b, "capsa"), "vm", "--kernel", kernel, "--initrd", initrd,
			"--memory", "256M", "--cmdline", benchCmdline}},
		{"qemu-microvm", []string{qemuB(b), "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "256",
			"-smp", "1", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio",
			"-kernel", kernel, "-initrd", initrd, "-append", benchCmdline}},
	}
	for _, v := range vmms {
		b.Run(v.name, func(b *testing.B) {
			var samples []time.Duration
			for b.Loop() {
				samples = append(samples, bootOnce(b, v.argv))
			}
			reportSpread(b, samples)
		})
	}
}

func artifactB(b *testing.B, name string) string { return artifact(b, name) }

// qemuB finds QEMU: the bundle `make bench` brings into the nested host
// (qemu/qemu), else qemu-system-x86_64 on PATH.
func qemuB(b *testing.B) string {
	if p, err := exec.LookPath(artifactDir() + "/qemu/qemu"); err == nil {
		return p
	}
	p, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		b.Skip("QEMU not found: run `make bench`")
	}
	return p
}

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
func BenchmarkExecTrue(b *testing.B) {
	ctx := context.Background()
	sb := newSandbox(b, ctx, 1)
	var samples []time.Duration
	for b.Loop() {
		start := time.Now()
		out, err := sb.Exec(ctx, sandbox.Command("true"))
		if err != nil || out.Code != 0 {
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

func reportSpread(b *testing.B, samples []time.Duration) {
	slices.Sort(samples)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(samples[0]), "ms-min")
	b.ReportMetric(ms(samples[len(samples)/2]), "ms-median")
	b.ReportMetric(ms(samples[len(samples)-1]), "ms-max")
}
