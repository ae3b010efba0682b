package e2e

import (
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"
)

// distroCmdline boots a distribution's kernel quietly: every console byte
// is a VM exit.
const distroCmdline = "console=ttyS0 quiet reboot=k panic=-1"

// TestDistroKernel boots Debian's cloud kernel (the nested host's own,
// unmodified: built without CONFIG_X86_MPPARSE, it finds CPUs only in
// ACPI's MADT) with the test initramfs under `capsa vm`, and checks that it
// sees every vCPU asked for, that it powers off through ACPI, and that its
// log has no ACPI or APIC complaints.
func TestDistroKernel(t *testing.T) {
	kernel := artifact(t, "vmlinuz-debian")
	initrd := artifact(t, "testinitrd.cpio")
	for _, cpus := range []int{2, 4} {
		t.Run(fmt.Sprintf("%d CPUs", cpus), func(t *testing.T) {
			start := time.Now()
			r := capsa(t, 5*time.Minute, "vm", "--kernel", kernel, "--initrd", initrd, "--cpus", fmt.Sprint(cpus),
				"--memory", "256M", "--boot-time", "--cmdline", distroCmdline+" capsa.test=poweroff")
			took := time.Since(start)
			want := fmt.Sprintf("cpus=%d online=0-%d", cpus, cpus-1)
			if r.code != 0 || !strings.Contains(r.stdout, want) {
				t.Fatalf("capsa vm --cpus %d with Debian's kernel = exit %d; want 0 and %q\nstdout:\n%s\nstderr:\n%s", cpus, r.code, want, r.stdout, r.stderr)
			}
			if !strings.Contains(r.stderr, "guest powered off: ACPI soft off (S5)") {
				t.Errorf("capsa vm --cpus %d: the guest did not power off through ACPI:\n%s", cpus, r.stderr)
			}
			t.Logf("%d CPUs: %s in %v", cpus, strings.TrimSpace(boottimeLine(r.stderr)), took.Round(time.Millisecond))
		})
	}
	t.Run("kernel log", func(t *testing.T) {
		r := capsa(t, 5*time.Minute, "vm", "--kernel", kernel, "--initrd", initrd, "--cpus", "2",
			"--memory", "256M", "--cmdline", distroCmdline+" capsa.test=info")
		if r.code != 0 || !strings.Contains(r.stdout, "capsa-testinit: kernel log:") {
			t.Fatalf("capsa vm with capsa.test=info = exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
		log := r.stdout[strings.Index(r.stdout, "capsa-testinit: kernel log:"):]
		for _, want := range []string{"ACPI: RSDP 0x00000000000E0000", "ACPI: APIC", "ACPI: FACP", "ACPI: DSDT",
			"smp: Brought up 1 node, 2 CPUs", "ACPI: PM: (supports S0 S5)",
			"00:00: ttyS0 at I/O 0x3f8", // the DSDT's COM1, PnP device 00:00
			"i8042: PNP: No PS/2 controller found"} {
			if !strings.Contains(log, want) {
				t.Errorf("the kernel log lacks %q", want)
			}
		}
		bad := regexp.MustCompile(`(?i)ACPI (BIOS )?(Error|Warning)|MADT or MP tables are not detected|not listed by BIOS|rtc_cmos.*(error|fail)|8042.*(timeout|fail)`)
		for _, l := range strings.Split(log, "\n") {
			if bad.MatchString(l) {
				t.Errorf("the kernel log says: %s", l)
			}
		}
		if t.Failed() {
			t.Logf("kernel log:\n%s", log)
		}
	})
}

func boottimeLine(stderr string) string {
	for _, l := range strings.Split(stderr, "\n") {
		if strings.Contains(l, "boot time:") {
			return l
		}
	}
	return "no boot time"
}

// BenchmarkBootDistroKernel boots Debian's cloud kernel with the test
// initramfs and two vCPUs under capsa and under QEMU's microvm (ACPI on,
// its default), and reports the time from starting the VMM to the guest
// init's first console line. The guest powers off through ACPI, which
// both VMMs offer (microvm has no i8042 for reboot=k, and this kernel,
// failing it, falls through reset methods for minutes).
func BenchmarkBootDistroKernel(b *testing.B) {
	benchBoots(b, artifactB(b, "vmlinuz-debian"), artifactB(b, "testinitrd.cpio"), distroCmdline+" capsa.test=poweroff", 2)
}
