package kvm

import "unsafe"

// The structs below mirror <linux/kvm.h> and <asm/kvm.h> for x86_64 field
// for field. Each has a compile-time size check: an array length that is
// negative (a build error) unless the size matches the kernel's. Field
// offsets that matter are checked in structs_test.go.

// Regs is struct kvm_regs.
type Regs struct {
	RAX, RBX, RCX, RDX uint64
	RSI, RDI, RSP, RBP uint64
	R8, R9, R10, R11   uint64
	R12, R13, R14, R15 uint64
	RIP, RFLAGS        uint64
}

// Segment is struct kvm_segment.
type Segment struct {
	Base     uint64
	Limit    uint32
	Selector uint16
	Type     uint8
	Present  uint8
	DPL      uint8
	DB       uint8
	S        uint8
	L        uint8
	G        uint8
	AVL      uint8
	Unusable uint8
	_        uint8
}

// DTable is struct kvm_dtable (a GDT or IDT pointer).
type DTable struct {
	Base  uint64
	Limit uint16
	_     [3]uint16
}

// Sregs is struct kvm_sregs.
type Sregs struct {
	CS, DS, ES, FS, GS, SS Segment
	TR, LDT                Segment
	GDT, IDT               DTable
	CR0, CR2, CR3, CR4     uint64
	CR8                    uint64
	EFER                   uint64
	APICBase               uint64
	InterruptBitmap        [4]uint64
}

// FPU is struct kvm_fpu.
type FPU struct {
	FPR        [8][16]uint8
	FCW        uint16
	FSW        uint16
	FTWX       uint8
	_          uint8
	LastOpcode uint16
	LastIP     uint64
	LastDP     uint64
	XMM        [16][16]uint8
	MXCSR      uint32
	_          uint32
}

// LAPICState is struct kvm_lapic_state: the local APIC's register page.
type LAPICState struct {
	Regs [1024]byte
}

// CPUIDEntry is struct kvm_cpuid_entry2.
type CPUIDEntry struct {
	Function uint32
	Index    uint32
	Flags    uint32
	EAX      uint32
	EBX      uint32
	ECX      uint32
	EDX      uint32
	_        [3]uint32
}

// cpuid2Header is struct kvm_cpuid2 without its flexible entries array.
type cpuid2Header struct {
	Nent uint32
	_    uint32
}

// flexHeaderSize is the size of struct kvm_cpuid2 and of struct kvm_msrs,
// the headers before their flexible entries arrays (checked below).
const flexHeaderSize = 8

// MSREntry is struct kvm_msr_entry.
type MSREntry struct {
	Index uint32
	_     uint32
	Data  uint64
}

// msrsHeader is struct kvm_msrs without its flexible entries array.
type msrsHeader struct {
	NMSRs uint32
	_     uint32
}

// VCPUEvents is struct kvm_vcpu_events: exceptions, interrupts, NMIs and
// SMIs pending or being injected.
type VCPUEvents struct {
	ExceptionInjected     uint8
	ExceptionNr           uint8
	ExceptionHasErrorCode uint8
	ExceptionPending      uint8
	ExceptionErrorCode    uint32
	InterruptInjected     uint8
	InterruptNr           uint8
	InterruptSoft         uint8
	InterruptShadow       uint8
	NMIInjected           uint8
	NMIPending            uint8
	NMIMasked             uint8
	_                     uint8
	SIPIVector            uint32
	Flags                 uint32
	SMM                   uint8
	SMIPending            uint8
	SMMInsideNMI          uint8
	LatchedInit           uint8
	TripleFaultPending    uint8
	_                     [26]uint8
	ExceptionHasPayload   uint8
	ExceptionPayload      uint64
}

// MPState is struct kvm_mp_state.
type MPState uint32

// MP states.
const (
	MPStateRunnable      MPState = 0
	MPStateUninitialized MPState = 1
	MPStateHalted        MPState = 3
)

type userspaceMemoryRegion struct {
	Slot          uint32
	Flags         uint32
	GuestPhysAddr uint64
	MemorySize    uint64
	UserspaceAddr uint64
}

type irqLevel struct {
	IRQ   uint32
	Level uint32
}

type pitConfig struct {
	Flags uint32
	_     [15]uint32
}

// reinjectControl is struct kvm_reinject_control.
type reinjectControl struct {
	PITReinject uint8
	_           [31]uint8
}

type irqfd struct {
	FD         uint32
	GSI        uint32
	Flags      uint32
	ResampleFD uint32
	_          [16]uint8
}

type ioeventfd struct {
	Datamatch uint64
	Addr      uint64
	Len       uint32
	FD        int32
	Flags     uint32
	_         [36]uint8
}

// ClockData is struct kvm_clock_data: the VM's kvmclock, in nanoseconds,
// as the guest reads it (KVM_GET_CLOCK, KVM_SET_CLOCK). Flags, Realtime
// and HostTSC say which extra fields KVM filled (KVM_CLOCK_REALTIME,
// KVM_CLOCK_HOST_TSC) or is asked to use.
type ClockData struct {
	Clock    uint64
	Flags    uint32
	_        uint32
	Realtime uint64
	HostTSC  uint64
	_        [4]uint32
}

// Compile-time size checks against the kernel's layouts (x86_64). Each line
// fails to build if the size differs in either direction.
var (
	_ [unsafe.Sizeof(Regs{}) - 144]struct{}
	_ [144 - unsafe.Sizeof(Regs{})]struct{}
	_ [unsafe.Sizeof(Segment{}) - 24]struct{}
	_ [24 - unsafe.Sizeof(Segment{})]struct{}
	_ [unsafe.Sizeof(DTable{}) - 16]struct{}
	_ [16 - unsafe.Sizeof(DTable{})]struct{}
	_ [unsafe.Sizeof(Sregs{}) - 312]struct{}
	_ [312 - unsafe.Sizeof(Sregs{})]struct{}
	_ [unsafe.Sizeof(FPU{}) - 416]struct{}
	_ [416 - unsafe.Sizeof(FPU{})]struct{}
	_ [unsafe.Sizeof(LAPICState{}) - 1024]struct{}
	_ [1024 - unsafe.Sizeof(LAPICState{})]struct{}
	_ [unsafe.Sizeof(VCPUEvents{}) - 64]struct{}
	_ [64 - unsafe.Sizeof(VCPUEvents{})]struct{}
	_ [unsafe.Sizeof(CPUIDEntry{}) - 40]struct{}
	_ [40 - unsafe.Sizeof(CPUIDEntry{})]struct{}
	_ [unsafe.Sizeof(cpuid2Header{}) - flexHeaderSize]struct{}
	_ [flexHeaderSize - unsafe.Sizeof(cpuid2Header{})]struct{}
	_ [unsafe.Sizeof(MSREntry{}) - 16]struct{}
	_ [16 - unsafe.Sizeof(MSREntry{})]struct{}
	_ [unsafe.Sizeof(msrsHeader{}) - flexHeaderSize]struct{}
	_ [flexHeaderSize - unsafe.Sizeof(msrsHeader{})]struct{}
	_ [unsafe.Sizeof(userspaceMemoryRegion{}) - 32]struct{}
	_ [32 - unsafe.Sizeof(userspaceMemoryRegion{})]struct{}
	_ [unsafe.Sizeof(irqLevel{}) - 8]struct{}
	_ [8 - unsafe.Sizeof(irqLevel{})]struct{}
	_ [unsafe.Sizeof(pitConfig{}) - 64]struct{}
	_ [64 - unsafe.Sizeof(pitConfig{})]struct{}
	_ [unsafe.Sizeof(reinjectControl{}) - 32]struct{}
	_ [32 - unsafe.Sizeof(reinjectControl{})]struct{}
	_ [unsafe.Sizeof(irqfd{}) - 32]struct{}
	_ [32 - unsafe.Sizeof(irqfd{})]struct{}
	_ [unsafe.Sizeof(ClockData{}) - 48]struct{}
	_ [48 - unsafe.Sizeof(ClockData{})]struct{}
	_ [unsafe.Sizeof(ioeventfd{}) - 64]struct{}
	_ [64 - unsafe.Sizeof(ioeventfd{})]struct{}
)
