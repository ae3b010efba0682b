package vmm

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/internal/assets"
	"github.com/capsa-sandbox/capsa/internal/testkernel"
)

// Hand-assembled 64-bit code, run at the kernel entry in long mode with the
// GDT, page tables and boot_params the boot package set up.
var (
	// Prints "OK", signals the boot marker, resets through the i8042.
	codeReboot = []byte{
		0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
		0xb0, 'O', 0xee, // mov al, 'O'; out dx, al
		0xb0, 'K', 0xee, // mov al, 'K'; out dx, al
		0x66, 0xba, 0xf0, 0x03, // mov dx, 0x3f0
		0xb0, 123, 0xee, // mov al, 123; out dx, al
		0xb0, 0xfe, 0xe6, 0x64, // mov al, 0xfe; out 0x64, al
		0xf4, // hlt
	}
	// ud2 with an empty IDT: #UD, #GP, #DF, then a triple fault.
	codeTripleFault = []byte{0x0f, 0x0b}
	// Spins forever: only the host can stop it.
	codeSpin = []byte{0xeb, 0xfe} // jmp $
	// Checks that RSI points at boot_params by reading its e820 entry count
	// (offset 0x1e8, 3 for this memory size): prints 'Y' or 'N', then resets.
	codeBootParams = []byte{
		0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
		0x80, 0xbe, 0xe8, 0x01, 0x00, 0x00, 0x03, // cmp byte [rsi+0x1e8], 3
		0xb0, 'N', // mov al, 'N'
		0x75, 0x02, // jne +2
		0xb0, 'Y', // mov al, 'Y'
		0xee,                   // out dx, al
		0xb0, 0xfe, 0xe6, 0x64, // reset
		0xf4,
	}
)

func needKVM(t *testing.T) {
	t.Helper()
	if _, err := os.Stat("/dev/kvm"); errors.Is(err, os.ErrNotExist) {
		t.Skip("no /dev/kvm on this machine: run `make test-kvm`")
	}
}

func runCode(t *testing.T, ctx context.Context, code []byte, cpus int) (*Exit, string) {
	t.Helper()
	var out bytes.Buffer
	m, err := New(ctx, Config{Kernel: testkernel.Code(code), CPUs: cpus, MemoryBytes: 64 << 20, Console: &out, Cmdline: "x"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	return m.Run(ctx), out.String()
}

func TestLongModeEntryDevicesAndReset(t *testing.T) {
	needKVM(t)
	for _, cpus := range []int{1, 4} {
		exit, out := runCode(t, context.Background(), codeReboot, cpus)
		if exit.Reason != StopReboot || !strings.Contains(exit.Detail, "i8042") {
			t.Errorf("%d vCPUs: exit %v, want a reboot through the i8042", cpus, exit)
		}
		if out != "OK" {
			t.Errorf("%d vCPUs: console %q, want \"OK\"", cpus, out)
		}
		if exit.BootTime <= 0 {
			t.Errorf("%d vCPUs: the boot marker was not recorded", cpus)
		}
	}
}

func TestBootParamsReachTheKernel(t *testing.T) {
	needKVM(t)
	exit, out := runCode(t, context.Background(), codeBootParams, 1)
	if out != "Y" || exit.Reason != StopReboot {
		t.Errorf("console %q, exit %v: RSI did not point at boot_params with 3 e820 entries", out, exit)
	}
}

func TestTripleFault(t *testing.T) {
	needKVM(t)
	exit, _ := runCode(t, context.Background(), codeTripleFault, 1)
	if exit.Reason != StopTripleFault || exit.Reason.Clean() {
		t.Errorf("exit %v, want a triple fault that is not a clean stop", exit)
	}
	if exit.Debug == nil || len(exit.Debug.VCPUs) != 1 || exit.Debug.VCPUs[0].Err != nil {
		t.Errorf("a triple fault came with no vCPU state: %+v", exit.Debug)
	}
}

// TestCancelStopsSpinningVCPUs checks the host can stop vCPUs that never
// exit on their own: the kick (immediate_exit and a signal) must reach each
// vCPU thread.
func TestCancelStopsSpinningVCPUs(t *testing.T) {
	needKVM(t)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	done := make(chan *Exit, 1)
	go func() {
		exit, _ := runCode(t, ctx, codeSpin, 2)
		done <- exit
	}()
	select {
	case exit := <-done:
		if exit.Reason != StopCanceled {
			t.Errorf("exit %v, want stopped by the host", exit)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("spinning vCPUs were not stopped within 60s of the cancel")
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	for _, cfg := range []Config{
		{Kernel: []byte("x"), CPUs: 0, MemoryBytes: 64 << 20},
		{Kernel: []byte("x"), CPUs: MaxCPUs + 1, MemoryBytes: 64 << 20},
		{Kernel: []byte("x"), CPUs: 1, MemoryBytes: 1 << 20},
		{CPUs: 1, MemoryBytes: 64 << 20},
	} {
		if _, err := New(context.Background(), cfg); err == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
}

// TestTruncatedKernelFileIsAnError: a kernel file mapped by
// assets.MapFile and truncated before New copies it makes that copy fault;
// New returns an error instead of the process dying of SIGBUS.
func TestTruncatedKernelFileIsAnError(t *testing.T) {
	needKVM(t)
	code := append(slices.Clone(codeReboot), make([]byte, 64<<10)...)
	path := t.TempDir() + "/vmlinux"
	image := testkernel.ELF(testkernel.LoadAddr, elf.EM_X86_64, elf.ELFCLASS64, testkernel.Segment{
		Type: elf.PT_LOAD, Paddr: testkernel.LoadAddr, Filesz: uint64(len(code)), Memsz: uint64(len(code)), Data: code})
	if err := os.WriteFile(path, image, 0o644); err != nil {
		t.Fatal(err)
	}
	kernel, release, err := assets.MapFile(path)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if err := os.Truncate(path, 4096); err != nil {
		t.Fatal(err)
	}
	m, err := New(context.Background(), Config{Kernel: kernel, CPUs: 1, MemoryBytes: 64 << 20, Cmdline: "x"})
	if err == nil {
		m.Close()
		t.Fatal("New(a kernel file truncated while mapped) = nil error, want the fault as an error")
	}
	if !strings.Contains(err.Error(), "truncated") {
		t.Errorf("New(a kernel file truncated while mapped) = %v, want it to say the file may have been truncated", err)
	}
}

func TestBootTimeline(t *testing.T) {
	needKVM(t)
	ctx := context.Background()
	m, err := New(ctx, Config{Kernel: testkernel.Code(codeReboot), CPUs: 1, MemoryBytes: 64 << 20, Cmdline: "x"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if exit := m.Run(ctx); exit.Reason != StopReboot {
		t.Fatalf("Run() = %v, want a reboot", exit)
	}
	tl, ok := m.BootTimeline()
	if !ok {
		t.Fatal("BootTimeline() = false after the guest wrote its boot marker")
	}
	var names []string
	for i, mk := range tl.Marks {
		names = append(names, mk.What)
		if i > 0 && mk.At < tl.Marks[i-1].At {
			t.Errorf("mark %q at %v comes before its predecessor's %v", mk.What, mk.At, tl.Marks[i-1].At)
		}
	}
	for _, want := range []string{"vmm: guest memory mapped", "vmm: kernel and initramfs loaded (beside KVM's setup)", "vmm: boot tables written", "vmm: vCPUs started",
		"guest: first console output", "guest: userspace (boot marker)"} {
		if !slices.Contains(names, want) {
			t.Errorf("BootTimeline().Marks = %q, want %q among them", names, want)
		}
	}
	// "OK" and the marker: three port writes reached the VMM.
	if got := tl.Exits["KVM_EXIT_IO"]; got < 3 {
		t.Errorf("BootTimeline().Exits[KVM_EXIT_IO] = %d, want at least 3 (%v)", got, tl.Exits)
	}
	if tl.KVM != nil && tl.KVM["exits"] < tl.Exits["KVM_EXIT_IO"] {
		t.Errorf("KVM counters: %d exits, fewer than the %d the VMM handled", tl.KVM["exits"], tl.Exits["KVM_EXIT_IO"])
	}
	t.Logf("%s", tl)
}
