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
