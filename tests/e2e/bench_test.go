package e2e

import (
	"bufio"
	"context"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
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
			slices.Sort(samples)
			ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
			b.ReportMetric(ms(samples[0]), "ms-min")
			b.ReportMetric(ms(samples[len(samples)/2]), "ms-median")
			b.ReportMetric(ms(samples[len(samples)-1]), "ms-max")
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
