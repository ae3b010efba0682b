package kvm

import (
	"errors"
	"os"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// openKVM skips the test where this machine has no /dev/kvm; `make
// test-kvm` runs these tests where it has one (the nested host otherwise).
func openKVM(t *testing.T) *System {
	t.Helper()
	if _, err := os.Stat(DevicePath); errors.Is(err, os.ErrNotExist) {
		t.Skip("no /dev/kvm on this machine: run `make test-kvm`")
	}
	s, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestCapabilitiesAndCPUID(t *testing.T) {
	s := openKVM(t)
	if err := s.CheckCapabilities(RequiredCaps...); err != nil {
		t.Fatal(err)
	}
	entries, err := s.GetSupportedCPUID()
	if err != nil {
		t.Fatal(err)
	}
	var sawKVM bool
	for _, e := range entries {
		if e.Function == 0x4000_0000 {
			sig := string([]byte{byte(e.EBX), byte(e.EBX >> 8), byte(e.EBX >> 16), byte(e.EBX >> 24),
				byte(e.ECX), byte(e.ECX >> 8), byte(e.ECX >> 16), byte(e.ECX >> 24),
				byte(e.EDX), byte(e.EDX >> 8), byte(e.EDX >> 16), byte(e.EDX >> 24)})
			sawKVM = strings.HasPrefix(sig, "KVMKVMKVM")
		}
	}
	if len(entries) == 0 || !sawKVM {
		t.Errorf("%d CPUID entries, KVM signature leaf present: %v", len(entries), sawKVM)
	}
}

// realModeProgram is hand-assembled 16-bit code, loaded at 0x1000:
//
//	mov dx, 0x3f8      ba f8 03
//	mov al, 'H'        b0 48
//	out dx, al         ee
//	mov al, 'i'        b0 69
//	out dx, al         ee
//	mov ax, 0x1234     b8 34 12
//	add ax, 0x1111     05 11 11     ; ax = 0x2345
//	out dx, ax         ef           ; a 2-byte write
//	mov [0x8000], al   a2 00 80     ; a write outside RAM: an MMIO exit
//	in al, dx          ec           ; a read, filled in by the test
//	out dx, al         ee           ; echoes what was read
//	hlt                f4
var realModeProgram = []byte{
	0xba, 0xf8, 0x03,
	0xb0, 'H',
	0xee,
	0xb0, 'i',
	0xee,
	0xb8, 0x34, 0x12,
	0x05, 0x11, 0x11,
	0xef,
	0xa2, 0x00, 0x80,
	0xec,
	0xee,
	0xf4,
}

func TestRealModeExits(t *testing.T) {
	s := openKVM(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	vm, err := s.CreateVM()
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	// 32 KiB of RAM at 0: the write to 0x8000 falls just outside it.
	mem, err := unix.Mmap(-1, 0, 0x8000, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	copy(mem[0x1000:], realModeProgram)
	if err := vm.SetUserMemoryRegion(0, 0, 0, mem); err != nil {
		t.Fatal(err)
	}
	v, err := vm.CreateVCPU(0)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	sr, err := v.GetSregs()
	if err != nil {
		t.Fatal(err)
	}
	sr.CS.Base, sr.CS.Selector = 0, 0
	if err := v.SetSregs(sr); err != nil {
		t.Fatal(err)
	}
	if err := v.SetRegs(&Regs{RIP: 0x1000, RFLAGS: 2}); err != nil {
		t.Fatal(err)
	}

	next := func() ExitReason {
		t.Helper()
		for {
			err := v.Run()
			if IsInterrupted(err) {
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			return v.ExitReason()
		}
	}
	expectOut := func(size uint8, data ...byte) {
		t.Helper()
		if r := next(); r != ExitIO {
			t.Fatalf("exit %v, want KVM_EXIT_IO", r)
		}
		io, err := v.IO()
		if err != nil {
			t.Fatal(err)
		}
		if !io.Out || io.Port != 0x3f8 || io.Size != size || io.Count != 1 || string(io.Data) != string(data) {
			t.Fatalf("IO exit %+v, want out of %d bytes %q to 0x3f8", io, size, data)
		}
	}
	expectOut(1, 'H')
	expectOut(1, 'i')
	expectOut(2, 0x45, 0x23)

	if r := next(); r != ExitMMIO {
		t.Fatalf("exit %v, want KVM_EXIT_MMIO", r)
	}
	if m := v.MMIO(); !m.IsWrite || m.PhysAddr != 0x8000 || len(m.Data) != 1 || m.Data[0] != 0x45 {
		t.Fatalf("MMIO exit %+v, want a 1-byte write of 0x45 at 0x8000", m)
	}

	if r := next(); r != ExitIO {
		t.Fatalf("exit %v, want KVM_EXIT_IO (in)", r)
	}
	io, err := v.IO()
	if err != nil || io.Out || io.Size != 1 || io.Port != 0x3f8 {
		t.Fatalf("IO exit %+v, %v, want a 1-byte in from 0x3f8", io, err)
	}
	io.Data[0] = 'z'
	expectOut(1, 'z')

	if r := next(); r != ExitHLT {
		t.Fatalf("exit %v, want KVM_EXIT_HLT", r)
	}
	regs, err := v.GetRegs()
	if err != nil {
		t.Fatal(err)
	}
	if regs.RIP != 0x1000+uint64(len(realModeProgram)) || regs.RAX&0xffff != 0x237a {
		t.Errorf("after HLT: RIP=%#x AX=%#x, want RIP=%#x AX=0x237a", regs.RIP, regs.RAX&0xffff, 0x1000+len(realModeProgram))
	}
}

func TestErrorNamesIoctlOnRealKVM(t *testing.T) {
	s := openKVM(t)
	vm, err := s.CreateVM()
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	mem, err := unix.Mmap(-1, 0, 0x2000, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	err = vm.SetUserMemoryRegion(0, 0, 0x123, mem) // not page aligned
	if err == nil || err.Error() != "KVM_SET_USER_MEMORY_REGION: invalid argument" || !errors.Is(err, unix.EINVAL) {
		t.Errorf("misaligned slot: %v", err)
	}
}

// TestVMAndVCPUState exercises the setup and state ioctls the real-mode
// test does not, the way the vmm package uses them.
func TestVMAndVCPUState(t *testing.T) {
	s := openKVM(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if v, err := s.APIVersion(); err != nil || v != APIVersion {
		t.Fatalf("APIVersion() = %d, %v", v, err)
	}
	vm, err := s.CreateVM()
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	// The identity map must be placed before any vCPU exists.
	for _, err := range []error{vm.SetTSSAddr(0xfffb_d000), vm.SetIdentityMapAddr(0xfffb_c000), vm.CreateIRQChip(), vm.CreatePIT2()} {
		if err != nil {
			t.Fatal(err)
		}
	}

	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	if err := vm.IRQFD(efd, 5); err != nil {
		t.Fatal(err)
	}
	if err := vm.DeassignIRQFD(efd, 5); err != nil {
		t.Fatal(err)
	}
	match := uint64(0xbeef)
	if err := vm.IOEventFD(efd, 0x600, 2, true, &match); err != nil {
		t.Fatal(err)
	}
	if err := vm.DeassignIOEventFD(efd, 0x600, 2, true, &match); err != nil {
		t.Fatal(err)
	}
	if err := vm.DeassignIOEventFD(efd, 0x600, 2, true, &match); !errors.Is(err, unix.ENOENT) || !strings.HasPrefix(err.Error(), "KVM_IOEVENTFD: ") {
		t.Errorf("deassigning an ioeventfd twice: %v, want KVM_IOEVENTFD: ENOENT", err)
	}
	if err := vm.IRQLine(4, true); err != nil {
		t.Fatal(err)
	}
	if err := vm.IRQLine(4, false); err != nil {
		t.Fatal(err)
	}

	v, err := vm.CreateVCPU(0)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	cpuid, err := s.GetSupportedCPUID()
	if err != nil {
		t.Fatal(err)
	}
	if err := v.SetCPUID2(cpuid); err != nil {
		t.Fatal(err)
	}

	const sysenterCS = 0x174 // MSR_IA32_SYSENTER_CS
	if err := v.SetMSRs([]MSREntry{{Index: sysenterCS, Data: 0x10}}); err != nil {
		t.Fatal(err)
	}
	msrs := []MSREntry{{Index: sysenterCS}}
	if err := v.GetMSRs(msrs); err != nil || msrs[0].Data != 0x10 {
		t.Errorf("GetMSRs: %+v, %v; want data 0x10", msrs, err)
	}
	// KVM refuses an unknown MSR unless the kvm module ignores them.
	if ignore, _ := os.ReadFile("/sys/module/kvm/parameters/ignore_msrs"); strings.TrimSpace(string(ignore)) != "Y" {
		err := v.SetMSRs([]MSREntry{{Index: 0xdead_beef, Data: 1}})
		if err == nil || !strings.HasPrefix(err.Error(), "KVM_SET_MSRS: KVM processed 0 of 1 MSRs") {
			t.Errorf("setting a nonexistent MSR: %v", err)
		}
	}

	f, err := v.GetFPU()
	if err != nil {
		t.Fatal(err)
	}
	// Hardware KVM resets MXCSR to 0x1f80 and round-trips it; PVM (a
	// software KVM some cloud VMs offer) reports 0 and ignores the field.
	hasMXCSR := f.MXCSR != 0
	f.FCW, f.MXCSR = 0x37e, 0x1f80
	if err := v.SetFPU(f); err != nil {
		t.Fatal(err)
	}
	if f, err = v.GetFPU(); err != nil || f.FCW != 0x37e || (hasMXCSR && f.MXCSR != 0x1f80) {
		t.Errorf("GetFPU after SetFPU: FCW=%#x MXCSR=%#x, %v", f.FCW, f.MXCSR, err)
	}

	l, err := v.GetLAPIC()
	if err != nil {
		t.Fatal(err)
	}
	if version := l.Regs[0x30]; version < 0x10 { // an integrated APIC: 0x1X
		t.Errorf("LAPIC version register %#x", version)
	}
	if err := v.SetLAPIC(l); err != nil {
		t.Fatal(err)
	}

	if st, err := v.GetMPState(); err != nil || st != MPStateRunnable {
		t.Errorf("GetMPState() = %d, %v; want runnable (the BSP)", st, err)
	}
	if err := v.SetMPState(MPStateRunnable); err != nil {
		t.Fatal(err)
	}
}
