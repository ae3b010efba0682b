package kvm

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The structs below carry the state a snapshot saves and a restore sets,
// laid out as <asm/kvm.h> lays them out on x86_64 (sizes checked at the
// end of the file, offsets in structs_test.go).

// XSAVE is struct kvm_xsave: the vCPU's XSAVE area (x87, SSE, AVX and the
// other components the guest enabled), as the XSAVE instruction lays it
// out.
type XSAVE struct {
	Region [1024]uint32
}

// XCR is one extended control register (struct kvm_xcr).
type XCR struct {
	XCR   uint32
	_     uint32
	Value uint64
}

// XCRs is struct kvm_xcrs: XCR0 and its kin.
type XCRs struct {
	NrXCRs uint32
	Flags  uint32
	XCRs   [16]XCR
	_      [16]uint64
}

// DebugRegs is struct kvm_debugregs.
type DebugRegs struct {
	DB    [4]uint64
	DR6   uint64
	DR7   uint64
	Flags uint64
	_     [9]uint64
}

// IRQChip is struct kvm_irqchip: one of the in-kernel interrupt
// controllers (IRQChipPICMaster, IRQChipPICSlave, IRQChipIOAPIC) and its
// state, kept as the kernel's bytes.
type IRQChip struct {
	ChipID uint32
	_      uint32
	Chip   [512]byte
}

// The in-kernel interrupt controllers, by KVM's chip ids.
const (
	IRQChipPICMaster = 0
	IRQChipPICSlave  = 1
	IRQChipIOAPIC    = 2
)

// PITChannel is struct kvm_pit_channel_state.
type PITChannel struct {
	Count         uint32
	LatchedCount  uint16
	CountLatched  uint8
	StatusLatched uint8
	Status        uint8
	ReadState     uint8
	WriteState    uint8
	WriteLatch    uint8
	RWMode        uint8
	Mode          uint8
	BCD           uint8
	Gate          uint8
	CountLoadTime int64
}

// PITState is struct kvm_pit_state2: the in-kernel i8254's channels.
type PITState struct {
	Channels [3]PITChannel
	Flags    uint32
	_        [9]uint32
}

// GetXSAVE reads the vCPU's XSAVE area.
func (v *VCPU) GetXSAVE() (*XSAVE, error) {
	var x XSAVE
	_, err := ioctlPtr(v.fd, kvmGetXSAVE, unsafe.Pointer(&x))
	return &x, err
}

// SetXSAVE writes the vCPU's XSAVE area.
func (v *VCPU) SetXSAVE(x *XSAVE) error {
	_, err := ioctlPtr(v.fd, kvmSetXSAVE, unsafe.Pointer(x))
	return err
}

// GetXCRs reads the extended control registers.
func (v *VCPU) GetXCRs() (*XCRs, error) {
	var x XCRs
	_, err := ioctlPtr(v.fd, kvmGetXCRs, unsafe.Pointer(&x))
	return &x, err
}

// SetXCRs writes the extended control registers.
func (v *VCPU) SetXCRs(x *XCRs) error {
	if x.NrXCRs > uint32(len(x.XCRs)) {
		return fmt.Errorf("KVM_SET_XCRS: %d XCRs, at most %d", x.NrXCRs, len(x.XCRs))
	}
	_, err := ioctlPtr(v.fd, kvmSetXCRs, unsafe.Pointer(x))
	return err
}

// GetDebugRegs reads the debug registers.
func (v *VCPU) GetDebugRegs() (*DebugRegs, error) {
	var d DebugRegs
	_, err := ioctlPtr(v.fd, kvmGetDebugRegs, unsafe.Pointer(&d))
	return &d, err
}

// SetDebugRegs writes the debug registers.
func (v *VCPU) SetDebugRegs(d *DebugRegs) error {
	_, err := ioctlPtr(v.fd, kvmSetDebugRegs, unsafe.Pointer(d))
	return err
}

// SetVCPUEvents writes the exceptions, interrupts and NMIs pending or
// being injected.
func (v *VCPU) SetVCPUEvents(e *VCPUEvents) error {
	_, err := ioctlPtr(v.fd, kvmSetVCPUEvents, unsafe.Pointer(e))
	return err
}

// TSCKHz is the vCPU's TSC frequency in kHz (KVM_GET_TSC_KHZ).
func (v *VCPU) TSCKHz() (uint32, error) {
	n, err := ioctl(v.fd, kvmGetTSCKHz, 0)
	return uint32(n), err
}

// ReadMSRs reads the MSRs in indices that KVM can read, and returns them;
// an MSR KVM refuses to read is left out (KVM stops a batch at the first
// one it refuses).
func (v *VCPU) ReadMSRs(indices []uint32) ([]MSREntry, error) {
	var out []MSREntry
	for len(indices) > 0 {
		entries := make([]MSREntry, len(indices))
		for i, idx := range indices {
			entries[i].Index = idx
		}
		buf, hdr := flexArray(entries)
		n, err := ioctlPtr(v.fd, kvmGetMSRs, hdr)
		if err != nil {
			return nil, err
		}
		if int(n) > len(entries) {
			return nil, fmt.Errorf("KVM_GET_MSRS: KVM reported %d MSRs read of %d", n, len(entries))
		}
		out = append(out, buf[1:1+n]...)
		// Skip the refused one, if any, and go on after it.
		indices = indices[min(int(n)+1, len(indices)):]
	}
	return out, nil
}

// MSRIndexList is every MSR KVM can save and restore for a guest
// (KVM_GET_MSR_INDEX_LIST).
func (s *System) MSRIndexList() ([]uint32, error) {
	// struct kvm_msr_list: nmsrs, then the indices. A first call with
	// room for none says how many there are (E2BIG).
	buf := make([]uint32, 1+1024)
	for {
		buf[0] = uint32(len(buf) - 1)
		_, err := ioctlPtr(s.fd, kvmGetMSRIndexList, unsafe.Pointer(&buf[0]))
		if err == nil {
			return append([]uint32(nil), buf[1:1+buf[0]]...), nil
		}
		if e, ok := err.(*IoctlError); !ok || e.Err != unix.E2BIG || int(buf[0]) < len(buf)-1 {
			return nil, err
		}
		buf = make([]uint32, 1+buf[0])
	}
}

// GetIRQChip reads in-kernel interrupt controller id's state.
func (vm *VM) GetIRQChip(id uint32) (*IRQChip, error) {
	c := IRQChip{ChipID: id}
	_, err := ioctlPtr(vm.fd, kvmGetIRQChip, unsafe.Pointer(&c))
	return &c, err
}

// SetIRQChip writes an in-kernel interrupt controller's state.
func (vm *VM) SetIRQChip(c *IRQChip) error {
	if c.ChipID > IRQChipIOAPIC {
		return fmt.Errorf("KVM_SET_IRQCHIP: no interrupt controller %d", c.ChipID)
	}
	_, err := ioctlPtr(vm.fd, kvmSetIRQChip, unsafe.Pointer(c))
	return err
}

// GetPIT reads the in-kernel i8254's state.
func (vm *VM) GetPIT() (*PITState, error) {
	var p PITState
	_, err := ioctlPtr(vm.fd, kvmGetPIT2, unsafe.Pointer(&p))
	return &p, err
}

// SetPIT writes the in-kernel i8254's state.
func (vm *VM) SetPIT(p *PITState) error {
	_, err := ioctlPtr(vm.fd, kvmSetPIT2, unsafe.Pointer(p))
	return err
}

var (
	kvmGetMSRIndexList = iowr(0x02, 4)
	kvmGetIRQChip      = iowr(0x62, unsafe.Sizeof(IRQChip{}))
	kvmSetIRQChip      = ior(0x63, unsafe.Sizeof(IRQChip{})) // _IOR, as <linux/kvm.h> has it
	kvmGetPIT2         = ior(0x9f, unsafe.Sizeof(PITState{}))
	kvmSetPIT2         = iow(0xa0, unsafe.Sizeof(PITState{}))
	kvmSetVCPUEvents   = iow(0xa0, unsafe.Sizeof(VCPUEvents{}))
	kvmGetDebugRegs    = ior(0xa1, unsafe.Sizeof(DebugRegs{}))
	kvmSetDebugRegs    = iow(0xa2, unsafe.Sizeof(DebugRegs{}))
	kvmGetTSCKHz       = io_(0xa3)
	kvmGetXSAVE        = ior(0xa4, unsafe.Sizeof(XSAVE{}))
	kvmSetXSAVE        = iow(0xa5, unsafe.Sizeof(XSAVE{}))
	kvmGetXCRs         = ior(0xa6, unsafe.Sizeof(XCRs{}))
	kvmSetXCRs         = iow(0xa7, unsafe.Sizeof(XCRs{}))
)

func init() {
	for req, name := range map[uintptr]string{
		kvmGetMSRIndexList: "KVM_GET_MSR_INDEX_LIST", kvmGetIRQChip: "KVM_GET_IRQCHIP", kvmSetIRQChip: "KVM_SET_IRQCHIP",
		kvmGetPIT2: "KVM_GET_PIT2", kvmSetPIT2: "KVM_SET_PIT2", kvmSetVCPUEvents: "KVM_SET_VCPU_EVENTS",
		kvmGetDebugRegs: "KVM_GET_DEBUGREGS", kvmSetDebugRegs: "KVM_SET_DEBUGREGS", kvmGetTSCKHz: "KVM_GET_TSC_KHZ",
		kvmGetXSAVE: "KVM_GET_XSAVE", kvmSetXSAVE: "KVM_SET_XSAVE", kvmGetXCRs: "KVM_GET_XCRS", kvmSetXCRs: "KVM_SET_XCRS",
	} {
		ioctlNames[req] = name
	}
}

// Compile-time size checks against the kernel's layouts (x86_64).
var (
	_ [unsafe.Sizeof(XSAVE{}) - 4096]struct{}
	_ [4096 - unsafe.Sizeof(XSAVE{})]struct{}
	_ [unsafe.Sizeof(XCRs{}) - 392]struct{}
	_ [392 - unsafe.Sizeof(XCRs{})]struct{}
	_ [unsafe.Sizeof(DebugRegs{}) - 128]struct{}
	_ [128 - unsafe.Sizeof(DebugRegs{})]struct{}
	_ [unsafe.Sizeof(IRQChip{}) - 520]struct{}
	_ [520 - unsafe.Sizeof(IRQChip{})]struct{}
	_ [unsafe.Sizeof(PITChannel{}) - 24]struct{}
	_ [24 - unsafe.Sizeof(PITChannel{})]struct{}
	_ [unsafe.Sizeof(PITState{}) - 112]struct{}
	_ [112 - unsafe.Sizeof(PITState{})]struct{}
)
