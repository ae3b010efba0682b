package kvm

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ioctl request numbers, built as <asm-generic/ioctl.h> builds them.
const (
	iocNone  = 0
	iocWrite = 1
	iocRead  = 2
	kvmIO    = 0xAE
)

func ioc(dir, nr, size uintptr) uintptr { return dir<<30 | size<<16 | kvmIO<<8 | nr }
func io_(nr uintptr) uintptr            { return ioc(iocNone, nr, 0) }
func iow(nr, size uintptr) uintptr      { return ioc(iocWrite, nr, size) }
func ior(nr, size uintptr) uintptr      { return ioc(iocRead, nr, size) }
func iowr(nr, size uintptr) uintptr     { return ioc(iocRead|iocWrite, nr, size) }

// The ioctls capsa uses. Sizes come from the struct definitions whose
// layouts structs_amd64.go checks against the kernel's.
var (
	kvmGetAPIVersion       = io_(0x00)
	kvmCreateVM            = io_(0x01)
	kvmCheckExtension      = io_(0x03)
	kvmGetVCPUMmapSize     = io_(0x04)
	kvmGetSupportedCPUID   = iowr(0x05, unsafe.Sizeof(cpuid2Header{}))
	kvmCreateVCPU          = io_(0x41)
	kvmSetUserMemoryRegion = iow(0x46, unsafe.Sizeof(userspaceMemoryRegion{}))
	kvmSetTSSAddr          = io_(0x47)
	kvmSetIdentityMapAddr  = iow(0x48, 8)
	kvmCreateIRQChip       = io_(0x60)
	kvmIRQLine             = iow(0x61, unsafe.Sizeof(irqLevel{}))
	kvmReinjectControl     = io_(0x71) // takes a struct kvm_reinject_control pointer
	kvmIRQFD               = iow(0x76, unsafe.Sizeof(irqfd{}))
	kvmCreatePIT2          = iow(0x77, unsafe.Sizeof(pitConfig{}))
	kvmIOEventFD           = iow(0x79, unsafe.Sizeof(ioeventfd{}))
	kvmSetClock            = iow(0x7b, unsafe.Sizeof(ClockData{}))
	kvmGetClock            = ior(0x7c, unsafe.Sizeof(ClockData{}))
	kvmRun                 = io_(0x80)
	kvmGetRegs             = ior(0x81, unsafe.Sizeof(Regs{}))
	kvmSetRegs             = iow(0x82, unsafe.Sizeof(Regs{}))
	kvmGetSregs            = ior(0x83, unsafe.Sizeof(Sregs{}))
	kvmSetSregs            = iow(0x84, unsafe.Sizeof(Sregs{}))
	kvmGetMSRs             = iowr(0x88, unsafe.Sizeof(msrsHeader{}))
	kvmSetMSRs             = iow(0x89, unsafe.Sizeof(msrsHeader{}))
	kvmGetFPU              = ior(0x8c, unsafe.Sizeof(FPU{}))
	kvmSetFPU              = iow(0x8d, unsafe.Sizeof(FPU{}))
	kvmGetLAPIC            = ior(0x8e, unsafe.Sizeof(LAPICState{}))
	kvmSetLAPIC            = iow(0x8f, unsafe.Sizeof(LAPICState{}))
	kvmSetCPUID2           = iow(0x90, unsafe.Sizeof(cpuid2Header{}))
	kvmGetMPState          = ior(0x98, unsafe.Sizeof(MPState(0)))
	kvmSetMPState          = iow(0x99, unsafe.Sizeof(MPState(0)))
	kvmGetVCPUEvents       = ior(0x9f, unsafe.Sizeof(VCPUEvents{}))
)

// RunningIoctls are the ioctl requests a VM needs once it is built and
// booted or restored: running its vCPUs, its devices' interrupts and
// doorbells (a guest may activate or reset a device at any time), the
// clock, pausing and snapshots. Making VMs or vCPUs, mapping memory and
// the other setup calls are not among them: package confine lets no other
// KVM request through once a sandbox's VM is built.
func RunningIoctls() []uint64 {
	reqs := []uintptr{
		kvmCheckExtension, kvmGetSupportedCPUID, kvmGetMSRIndexList, kvmGetTSCKHz,
		kvmRun, kvmIRQLine, kvmIRQFD, kvmIOEventFD, kvmGetClock, kvmSetClock,
		kvmGetRegs, kvmSetRegs, kvmGetSregs, kvmSetSregs, kvmGetMSRs, kvmSetMSRs,
		kvmGetFPU, kvmSetFPU, kvmGetLAPIC, kvmSetLAPIC, kvmGetMPState, kvmSetMPState,
		kvmGetVCPUEvents, kvmSetVCPUEvents, kvmGetDebugRegs, kvmSetDebugRegs,
		kvmGetXSAVE, kvmSetXSAVE, kvmGetXCRs, kvmSetXCRs,
		kvmGetIRQChip, kvmSetIRQChip, kvmGetPIT2, kvmSetPIT2,
	}
	out := make([]uint64, len(reqs))
	for i, r := range reqs {
		out[i] = uint64(r)
	}
	return out
}

// RunIoctl is KVM_RUN's request number: the call a running VM makes most.
func RunIoctl() uint64 { return uint64(kvmRun) }

// ioctlNames names each request in errors.
var ioctlNames = map[uintptr]string{
	kvmGetAPIVersion: "KVM_GET_API_VERSION", kvmCreateVM: "KVM_CREATE_VM",
	kvmCheckExtension: "KVM_CHECK_EXTENSION", kvmGetVCPUMmapSize: "KVM_GET_VCPU_MMAP_SIZE",
	kvmGetSupportedCPUID: "KVM_GET_SUPPORTED_CPUID", kvmCreateVCPU: "KVM_CREATE_VCPU",
	kvmSetUserMemoryRegion: "KVM_SET_USER_MEMORY_REGION", kvmSetTSSAddr: "KVM_SET_TSS_ADDR",
	kvmSetIdentityMapAddr: "KVM_SET_IDENTITY_MAP_ADDR", kvmCreateIRQChip: "KVM_CREATE_IRQCHIP",
	kvmIRQLine: "KVM_IRQ_LINE", kvmReinjectControl: "KVM_REINJECT_CONTROL", kvmIRQFD: "KVM_IRQFD", kvmCreatePIT2: "KVM_CREATE_PIT2",
	kvmIOEventFD: "KVM_IOEVENTFD", kvmRun: "KVM_RUN", kvmGetRegs: "KVM_GET_REGS",
	kvmSetRegs: "KVM_SET_REGS", kvmGetSregs: "KVM_GET_SREGS", kvmSetSregs: "KVM_SET_SREGS",
	kvmGetMSRs: "KVM_GET_MSRS", kvmSetMSRs: "KVM_SET_MSRS", kvmGetFPU: "KVM_GET_FPU",
	kvmSetFPU: "KVM_SET_FPU", kvmGetLAPIC: "KVM_GET_LAPIC", kvmSetLAPIC: "KVM_SET_LAPIC",
	kvmSetCPUID2: "KVM_SET_CPUID2", kvmGetMPState: "KVM_GET_MP_STATE", kvmSetMPState: "KVM_SET_MP_STATE",
	kvmGetVCPUEvents: "KVM_GET_VCPU_EVENTS", kvmGetStatsFD: "KVM_GET_STATS_FD", kvmGetClock: "KVM_GET_CLOCK", kvmSetClock: "KVM_SET_CLOCK",
}

// IoctlError is a failed KVM ioctl. Its message names the ioctl, as in
// "KVM_SET_USER_MEMORY_REGION: invalid argument", and errors.Is matches the
// errno.
type IoctlError struct {
	Op  string
	Err unix.Errno
}

func (e *IoctlError) Error() string { return e.Op + ": " + e.Err.Error() }
func (e *IoctlError) Unwrap() error { return e.Err }

// ioctl issues a request whose argument is a plain integer.
//
// A request other than KVM_RUN that a signal interrupted is issued again:
// KVM_CREATE_VM, for one, returns EINTR when a signal is pending (the Go
// runtime's preemption signal, SIGURG, arrives at any time), and ioctls
// are not restarted by SA_RESTART. KVM_RUN's EINTR is its caller's to see.
func ioctl(fd int, req, arg uintptr) (uintptr, error) {
	for {
		r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, arg)
		if errno == unix.EINTR && req != kvmRun {
			continue
		}
		if errno != 0 {
			return r, &IoctlError{Op: opName(req), Err: errno}
		}
		return r, nil
	}
}

// ioctlPtr issues a request whose argument points at p, again if a signal
// interrupted it (as ioctl). The pointer is converted in the call
// expression, so the garbage collector keeps p alive and in place for the
// call.
func ioctlPtr(fd int, req uintptr, p unsafe.Pointer) (uintptr, error) {
	for {
		r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(p))
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return r, &IoctlError{Op: opName(req), Err: errno}
		}
		return r, nil
	}
}

func opName(req uintptr) string {
	if n, ok := ioctlNames[req]; ok {
		return n
	}
	return fmt.Sprintf("KVM ioctl %#x", req)
}

// IsInterrupted reports whether err is KVM_RUN returning early for a signal
// or immediate_exit.
func IsInterrupted(err error) bool {
	return errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN)
}
