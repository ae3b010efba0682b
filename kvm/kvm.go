// Package kvm is a typed interface to the Linux KVM API (/dev/kvm) for
// x86_64, over golang.org/x/sys/unix with no cgo.
//
// It knows nothing about devices or boot protocols: the vmm package builds a
// machine from these handles. Every error names its ioctl; the structs that
// cross into the kernel live in structs_amd64.go with size checks, and the
// unsafe pointer conversions stay in this package.
package kvm

import (
	"errors"
	"fmt"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DevicePath is where KVM lives.
const DevicePath = "/dev/kvm"

// APIVersion is the only KVM API version there is.
const APIVersion = 12

// System is an open /dev/kvm.
type System struct {
	fd       int
	mmapSize int
}

// Open opens /dev/kvm.
func Open() (*System, error) { return OpenPath(DevicePath) }

// OpenPath opens the KVM device at path ("" means /dev/kvm) and checks its
// API version. Each way it can fail has one clear message.
func OpenPath(path string) (*System, error) {
	if path == "" {
		path = DevicePath
	}
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO):
		return nil, fmt.Errorf("open %s: %w: this machine has no KVM (load the kvm module, or enable nested virtualization in the VM you are in)", path, err)
	case errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM):
		return nil, fmt.Errorf("open %s: permission denied: add your user to the group that owns %s (usually kvm)", path, path)
	case err != nil:
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	s := &System{fd: fd}
	v, err := ioctl(fd, kvmGetAPIVersion, 0)
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("%s is not a KVM device: %w", path, err)
	}
	if v != APIVersion {
		s.Close()
		return nil, fmt.Errorf("%s: KVM API version %d, capsa needs %d", path, v, APIVersion)
	}
	n, err := ioctl(fd, kvmGetVCPUMmapSize, 0)
	if err != nil {
		s.Close()
		return nil, err
	}
	if n < runMinSize {
		s.Close()
		return nil, fmt.Errorf("KVM_GET_VCPU_MMAP_SIZE: %d bytes is smaller than struct kvm_run", n)
	}
	s.mmapSize = int(n)
	return s, nil
}

// APIVersion returns KVM_GET_API_VERSION's answer (OpenPath checked it is 12).
func (s *System) APIVersion() (int, error) {
	v, err := ioctl(s.fd, kvmGetAPIVersion, 0)
	return int(v), err
}

// VCPUMmapSize returns the size of a vCPU's run area
// (KVM_GET_VCPU_MMAP_SIZE, read once by OpenPath).
func (s *System) VCPUMmapSize() int { return s.mmapSize }

// Close closes /dev/kvm. VMs created from it stay valid.
func (s *System) Close() error { return closeFD(&s.fd) }

func closeFD(fd *int) error {
	if *fd < 0 {
		return nil
	}
	err := unix.Close(*fd)
	*fd = -1
	return err
}

// Cap is a KVM capability (KVM_CAP_*).
type Cap uintptr

// Capabilities capsa uses.
const (
	CapIRQChip            Cap = 0
	CapHLT                Cap = 1
	CapUserMemory         Cap = 3
	CapSetTSSAddr         Cap = 4
	CapExtCPUID           Cap = 7
	CapNrVCPUs            Cap = 9
	CapMPState            Cap = 14
	CapIRQFD              Cap = 32
	CapPIT2               Cap = 33
	CapIOEventFD          Cap = 36
	CapSetIdentityMapAddr Cap = 37
	CapMaxVCPUs           Cap = 66
	CapTSCDeadlineTimer   Cap = 72
	CapImmediateExit      Cap = 136
)

var capNames = map[Cap]string{
	CapIRQChip: "KVM_CAP_IRQCHIP", CapHLT: "KVM_CAP_HLT", CapUserMemory: "KVM_CAP_USER_MEMORY",
	CapSetTSSAddr: "KVM_CAP_SET_TSS_ADDR", CapExtCPUID: "KVM_CAP_EXT_CPUID", CapNrVCPUs: "KVM_CAP_NR_VCPUS",
	CapMPState: "KVM_CAP_MP_STATE", CapIRQFD: "KVM_CAP_IRQFD", CapPIT2: "KVM_CAP_PIT2",
	CapIOEventFD: "KVM_CAP_IOEVENTFD", CapSetIdentityMapAddr: "KVM_CAP_SET_IDENTITY_MAP_ADDR",
	CapMaxVCPUs: "KVM_CAP_MAX_VCPUS", CapTSCDeadlineTimer: "KVM_CAP_TSC_DEADLINE_TIMER",
	CapImmediateExit: "KVM_CAP_IMMEDIATE_EXIT",
}

func (c Cap) String() string {
	if n, ok := capNames[c]; ok {
		return n
	}
	return fmt.Sprintf("KVM capability %d", uintptr(c))
}

// RequiredCaps are the capabilities capsa cannot run without.
var RequiredCaps = []Cap{
	CapIRQChip, CapHLT, CapUserMemory, CapSetTSSAddr, CapExtCPUID, CapMPState,
	CapIRQFD, CapPIT2, CapIOEventFD, CapSetIdentityMapAddr, CapImmediateExit,
}

// CheckExtension returns KVM_CHECK_EXTENSION's answer (0: unsupported).
func (s *System) CheckExtension(c Cap) (int, error) {
	r, err := ioctl(s.fd, kvmCheckExtension, uintptr(c))
	return int(r), err
}

// CheckCapabilities fails, naming every missing one, unless KVM has all caps.
func (s *System) CheckCapabilities(caps ...Cap) error {
	var missing []string
	for _, c := range caps {
		n, err := s.CheckExtension(c)
		if err != nil {
			return err
		}
		if n <= 0 {
			missing = append(missing, c.String())
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("KVM lacks required capabilities: %s", strings.Join(missing, ", "))
	}
	return nil
}

// GetSupportedCPUID returns the CPUID leaves KVM can present to a guest,
// including its paravirt leaves at 0x40000000.
func (s *System) GetSupportedCPUID() ([]CPUIDEntry, error) {
	for n := 64; n <= 4096; n *= 2 {
		buf, hdr := flexArray(make([]CPUIDEntry, n))
		_, err := ioctlPtr(s.fd, kvmGetSupportedCPUID, hdr)
		if errors.Is(err, unix.E2BIG) {
			continue
		}
		if err != nil {
			return nil, err
		}
		got := *(*uint32)(hdr)
		if int(got) > n {
			return nil, fmt.Errorf("KVM_GET_SUPPORTED_CPUID: kernel reported %d entries for a %d-entry buffer", got, n)
		}
		return buf[1 : 1+got], nil
	}
	return nil, errors.New("KVM_GET_SUPPORTED_CPUID: more than 4096 entries")
}

// VM is a virtual machine.
type VM struct {
	fd       int
	mmapSize int
}

// CreateVM creates a VM.
func (s *System) CreateVM() (*VM, error) {
	fd, err := ioctl(s.fd, kvmCreateVM, 0)
	if err != nil {
		return nil, err
	}
	unix.CloseOnExec(int(fd))
	return &VM{fd: int(fd), mmapSize: s.mmapSize}, nil
}

// Close closes the VM. Its vCPUs must be closed too for KVM to free it.
func (vm *VM) Close() error { return closeFD(&vm.fd) }

// SetUserMemoryRegion maps host memory mem at guest physical address gpa in
// memory slot slot. mem must stay mapped while the VM uses it.
func (vm *VM) SetUserMemoryRegion(slot, flags uint32, gpa uint64, mem []byte) error {
	r := userspaceMemoryRegion{Slot: slot, Flags: flags, GuestPhysAddr: gpa, MemorySize: uint64(len(mem))}
	if len(mem) > 0 {
		r.UserspaceAddr = uint64(uintptr(unsafe.Pointer(&mem[0])))
	}
	_, err := ioctlPtr(vm.fd, kvmSetUserMemoryRegion, unsafe.Pointer(&r))
	return err
}

// SetTSSAddr places the 3-page TSS KVM needs on Intel.
func (vm *VM) SetTSSAddr(addr uint64) error {
	_, err := ioctl(vm.fd, kvmSetTSSAddr, uintptr(addr))
	return err
}

// SetIdentityMapAddr places the identity-map page KVM needs on Intel.
func (vm *VM) SetIdentityMapAddr(addr uint64) error {
	_, err := ioctlPtr(vm.fd, kvmSetIdentityMapAddr, unsafe.Pointer(&addr))
	return err
}

// CreateIRQChip creates the in-kernel PIC, IOAPIC and local APICs.
func (vm *VM) CreateIRQChip() error {
	_, err := ioctl(vm.fd, kvmCreateIRQChip, 0)
	return err
}

// CreatePIT2 creates the in-kernel i8254 timer, with a dummy PC speaker port.
func (vm *VM) CreatePIT2() error {
	c := pitConfig{Flags: 1} // KVM_PIT_SPEAKER_DUMMY
	_, err := ioctlPtr(vm.fd, kvmCreatePIT2, unsafe.Pointer(&c))
	return err
}

// SetPITReinject turns the in-kernel PIT's catching up on missed ticks on
// or off (KVM_REINJECT_CONTROL). With it on, a vCPU that ran late gets a
// burst of the ticks it missed.
func (vm *VM) SetPITReinject(on bool) error {
	var c reinjectControl
	if on {
		c.PITReinject = 1
	}
	_, err := ioctlPtr(vm.fd, kvmReinjectControl, unsafe.Pointer(&c))
	return err
}

// Clock reads the VM's kvmclock (KVM_GET_CLOCK).
func (vm *VM) Clock() (ClockData, error) {
	var c ClockData
	_, err := ioctlPtr(vm.fd, kvmGetClock, unsafe.Pointer(&c))
	return c, err
}

// SetClock sets the VM's kvmclock to c.Clock nanoseconds (KVM_SET_CLOCK;
// only the clock value is used: the flags are cleared, so KVM does not
// move it on by the host time elapsed since c was read). Every vCPU must
// be out of KVM_RUN.
func (vm *VM) SetClock(c ClockData) error {
	c = ClockData{Clock: c.Clock}
	_, err := ioctlPtr(vm.fd, kvmSetClock, unsafe.Pointer(&c))
	return err
}

// IRQLine sets the level of an interrupt line of the in-kernel irqchip.
func (vm *VM) IRQLine(irq uint32, high bool) error {
	l := irqLevel{IRQ: irq}
	if high {
		l.Level = 1
	}
	_, err := ioctlPtr(vm.fd, kvmIRQLine, unsafe.Pointer(&l))
	return err
}

// IRQFD makes a write to eventfd efd raise interrupt gsi.
func (vm *VM) IRQFD(efd int, gsi uint32) error { return vm.irqfd(efd, gsi, 0) }

// DeassignIRQFD undoes IRQFD(efd, gsi).
func (vm *VM) DeassignIRQFD(efd int, gsi uint32) error {
	return vm.irqfd(efd, gsi, 1) // KVM_IRQFD_FLAG_DEASSIGN
}

func (vm *VM) irqfd(efd int, gsi, flags uint32) error {
	r := irqfd{FD: uint32(efd), GSI: gsi, Flags: flags}
	_, err := ioctlPtr(vm.fd, kvmIRQFD, unsafe.Pointer(&r))
	return err
}

// IOEventFD makes a guest write of length bytes at addr (a port if pio)
// signal eventfd efd instead of exiting to userspace. With datamatch, only
// writes of that value do.
func (vm *VM) IOEventFD(efd int, addr uint64, length uint32, pio bool, datamatch *uint64) error {
	return vm.ioeventfd(efd, addr, length, pio, datamatch, false)
}

// DeassignIOEventFD undoes IOEventFD called with the same arguments.
func (vm *VM) DeassignIOEventFD(efd int, addr uint64, length uint32, pio bool, datamatch *uint64) error {
	return vm.ioeventfd(efd, addr, length, pio, datamatch, true)
}

func (vm *VM) ioeventfd(efd int, addr uint64, length uint32, pio bool, datamatch *uint64, deassign bool) error {
	r := ioeventfd{Addr: addr, Len: length, FD: int32(efd)}
	if datamatch != nil {
		r.Flags |= 1 << 0 // KVM_IOEVENTFD_FLAG_DATAMATCH
		r.Datamatch = *datamatch
	}
	if pio {
		r.Flags |= 1 << 1 // KVM_IOEVENTFD_FLAG_PIO
	}
	if deassign {
		r.Flags |= 1 << 2 // KVM_IOEVENTFD_FLAG_DEASSIGN
	}
	_, err := ioctlPtr(vm.fd, kvmIOEventFD, unsafe.Pointer(&r))
	return err
}

// VCPU is a virtual CPU with its mmap'd run area.
type VCPU struct {
	fd  int
	ID  int
	run run
}

// CreateVCPU creates vCPU id and maps its run area.
func (vm *VM) CreateVCPU(id int) (*VCPU, error) {
	fd, err := ioctl(vm.fd, kvmCreateVCPU, uintptr(id))
	if err != nil {
		return nil, err
	}
	unix.CloseOnExec(int(fd))
	mem, err := unix.Mmap(int(fd), 0, vm.mmapSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(int(fd))
		return nil, fmt.Errorf("mmap vCPU %d run area: %w", id, err)
	}
	return &VCPU{fd: int(fd), ID: id, run: run(mem)}, nil
}

// Close unmaps the run area and closes the vCPU.
func (v *VCPU) Close() error {
	var err error
	if v.run != nil {
		err = unix.Munmap(v.run)
		v.run = nil
	}
	return errors.Join(err, closeFD(&v.fd))
}

// Run enters the guest until the next exit. An error that IsInterrupted
// means a signal or immediate_exit ended it early.
func (v *VCPU) Run() error {
	_, err := ioctl(v.fd, kvmRun, 0)
	return err
}

// GetRegs reads the general-purpose registers.
func (v *VCPU) GetRegs() (*Regs, error) {
	var r Regs
	_, err := ioctlPtr(v.fd, kvmGetRegs, unsafe.Pointer(&r))
	return &r, err
}

// SetRegs writes the general-purpose registers.
func (v *VCPU) SetRegs(r *Regs) error {
	_, err := ioctlPtr(v.fd, kvmSetRegs, unsafe.Pointer(r))
	return err
}

// GetSregs reads the special registers.
func (v *VCPU) GetSregs() (*Sregs, error) {
	var s Sregs
	_, err := ioctlPtr(v.fd, kvmGetSregs, unsafe.Pointer(&s))
	return &s, err
}

// SetSregs writes the special registers.
func (v *VCPU) SetSregs(s *Sregs) error {
	_, err := ioctlPtr(v.fd, kvmSetSregs, unsafe.Pointer(s))
	return err
}

// GetFPU reads the FPU state.
func (v *VCPU) GetFPU() (*FPU, error) {
	var f FPU
	_, err := ioctlPtr(v.fd, kvmGetFPU, unsafe.Pointer(&f))
	return &f, err
}

// SetFPU writes the FPU state.
func (v *VCPU) SetFPU(f *FPU) error {
	_, err := ioctlPtr(v.fd, kvmSetFPU, unsafe.Pointer(f))
	return err
}

// GetLAPIC reads the local APIC registers.
func (v *VCPU) GetLAPIC() (*LAPICState, error) {
	var l LAPICState
	_, err := ioctlPtr(v.fd, kvmGetLAPIC, unsafe.Pointer(&l))
	return &l, err
}

// SetLAPIC writes the local APIC registers.
func (v *VCPU) SetLAPIC(l *LAPICState) error {
	_, err := ioctlPtr(v.fd, kvmSetLAPIC, unsafe.Pointer(l))
	return err
}

// GetMPState reads the vCPU's multiprocessing state.
func (v *VCPU) GetMPState() (MPState, error) {
	var s MPState
	_, err := ioctlPtr(v.fd, kvmGetMPState, unsafe.Pointer(&s))
	return s, err
}

// SetMPState writes the vCPU's multiprocessing state.
func (v *VCPU) SetMPState(s MPState) error {
	_, err := ioctlPtr(v.fd, kvmSetMPState, unsafe.Pointer(&s))
	return err
}

// GetVCPUEvents reads the exceptions, interrupts and NMIs pending or being
// injected.
func (v *VCPU) GetVCPUEvents() (*VCPUEvents, error) {
	var e VCPUEvents
	_, err := ioctlPtr(v.fd, kvmGetVCPUEvents, unsafe.Pointer(&e))
	return &e, err
}

// SetCPUID2 sets the CPUID leaves the guest sees.
func (v *VCPU) SetCPUID2(entries []CPUIDEntry) error {
	_, hdr := flexArray(entries)
	_, err := ioctlPtr(v.fd, kvmSetCPUID2, hdr)
	return err
}

// SetMSRs writes model-specific registers; it fails unless KVM took all.
func (v *VCPU) SetMSRs(entries []MSREntry) error {
	_, err := v.msrs(kvmSetMSRs, entries)
	return err
}

// GetMSRs reads the MSRs whose indices are in entries.
func (v *VCPU) GetMSRs(entries []MSREntry) error {
	buf, err := v.msrs(kvmGetMSRs, entries)
	if err == nil {
		copy(entries, buf)
	}
	return err
}

// msrs issues KVM_GET_MSRS or KVM_SET_MSRS: struct kvm_msrs followed by
// the entries, all of which KVM must process.
func (v *VCPU) msrs(req uintptr, entries []MSREntry) ([]MSREntry, error) {
	buf, hdr := flexArray(entries)
	n, err := ioctlPtr(v.fd, req, hdr)
	if err != nil {
		return nil, err
	}
	if int(n) != len(entries) {
		if int(n) > len(entries) {
			return nil, fmt.Errorf("%s: KVM reported %d MSRs processed of %d", opName(req), n, len(entries))
		}
		return nil, fmt.Errorf("%s: KVM processed %d of %d MSRs; MSR %#x was refused", opName(req), n, len(entries), entries[n].Index)
	}
	return buf[1:], nil
}

// flexArray lays out a kernel struct ending in a flexible array (struct
// kvm_cpuid2, struct kvm_msrs): an 8-byte header holding the __u32 entry
// count and padding, then the entries. The header fills the last 8 bytes of
// an extra leading element, so the entries keep their alignment and
// buf[1:] are the entries. hdr is what the ioctl takes.
func flexArray[E CPUIDEntry | MSREntry](entries []E) (buf []E, hdr unsafe.Pointer) {
	buf = make([]E, len(entries)+1)
	copy(buf[1:], entries)
	hdr = unsafe.Add(unsafe.Pointer(&buf[0]), unsafe.Sizeof(buf[0])-flexHeaderSize)
	*(*uint32)(hdr) = uint32(len(entries))
	return buf, hdr
}
