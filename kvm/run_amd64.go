package kvm

import (
	"encoding/binary"
	"fmt"
)

// Offsets into struct kvm_run (x86_64), checked in structs_test.go against
// the values the kernel headers give.
const (
	runImmediateExit = 0x01
	runExitReason    = 0x08
	runExit          = 0x20 // the exit union
	runIODataOffset  = 0x28
	runMMIOData      = 0x28
	runMMIOLen       = 0x30
	runMMIOIsWrite   = 0x34
	runMinSize       = 0x930 // sizeof(struct kvm_run)
)

// ExitReason is kvm_run.exit_reason.
type ExitReason uint32

// Exit reasons capsa handles.
const (
	ExitUnknown       ExitReason = 0
	ExitException     ExitReason = 1
	ExitIO            ExitReason = 2
	ExitHypercall     ExitReason = 3
	ExitDebug         ExitReason = 4
	ExitHLT           ExitReason = 5
	ExitMMIO          ExitReason = 6
	ExitShutdown      ExitReason = 8
	ExitFailEntry     ExitReason = 9
	ExitIntr          ExitReason = 10
	ExitInternalError ExitReason = 17
	ExitSystemEvent   ExitReason = 24
)

var exitNames = map[ExitReason]string{
	ExitUnknown: "KVM_EXIT_UNKNOWN", ExitException: "KVM_EXIT_EXCEPTION", ExitIO: "KVM_EXIT_IO",
	ExitHypercall: "KVM_EXIT_HYPERCALL", ExitDebug: "KVM_EXIT_DEBUG", ExitHLT: "KVM_EXIT_HLT",
	ExitMMIO: "KVM_EXIT_MMIO", ExitShutdown: "KVM_EXIT_SHUTDOWN", ExitFailEntry: "KVM_EXIT_FAIL_ENTRY",
	ExitIntr: "KVM_EXIT_INTR", ExitInternalError: "KVM_EXIT_INTERNAL_ERROR", ExitSystemEvent: "KVM_EXIT_SYSTEM_EVENT",
	// Named for diagnostics only: capsa does not enable what causes these.
	7: "KVM_EXIT_IRQ_WINDOW_OPEN", 11: "KVM_EXIT_SET_TPR", 12: "KVM_EXIT_TPR_ACCESS", 16: "KVM_EXIT_NMI",
	26: "KVM_EXIT_IOAPIC_EOI", 27: "KVM_EXIT_HYPERV", 29: "KVM_EXIT_X86_RDMSR", 30: "KVM_EXIT_X86_WRMSR",
	31: "KVM_EXIT_DIRTY_RING_FULL", 33: "KVM_EXIT_X86_BUS_LOCK", 34: "KVM_EXIT_XEN", 37: "KVM_EXIT_NOTIFY",
	39: "KVM_EXIT_MEMORY_FAULT",
}

func (r ExitReason) String() string {
	if n, ok := exitNames[r]; ok {
		return n
	}
	return fmt.Sprintf("KVM exit %d", uint32(r))
}

// System event types (kvm_run.system_event.type).
const (
	SystemEventShutdown = 1
	SystemEventReset    = 2
	SystemEventCrash    = 3
)

// IOExit is a port I/O exit. Data aliases the run area: for an IN, fill it
// before the next Run. It holds Count items of Size bytes.
type IOExit struct {
	Out   bool
	Size  uint8
	Port  uint16
	Count uint32
	Data  []byte
}

// MMIOExit is an MMIO exit. For a read, fill Data before the next Run.
type MMIOExit struct {
	PhysAddr uint64
	IsWrite  bool
	Data     []byte // Len bytes, aliasing the run area
}

// run is the vCPU's mmap'd struct kvm_run. The kernel writes it during
// KVM_RUN; the vCPU's own thread reads it after.
type run []byte

func (r run) u32(off int) uint32 { return binary.LittleEndian.Uint32(r[off:]) }
func (r run) u64(off int) uint64 { return binary.LittleEndian.Uint64(r[off:]) }

// ExitReason returns why KVM_RUN returned.
func (v *VCPU) ExitReason() ExitReason { return ExitReason(v.run.u32(runExitReason)) }

// IO decodes a KVM_EXIT_IO. The data offset comes from the kernel, but it is
// checked against the mapping all the same.
func (v *VCPU) IO() (IOExit, error) {
	r := v.run
	e := IOExit{
		Out:   r[runExit] == 1,
		Size:  r[runExit+1],
		Port:  binary.LittleEndian.Uint16(r[runExit+2:]),
		Count: r.u32(runExit + 4),
	}
	off := r.u64(runIODataOffset)
	n := uint64(e.Size) * uint64(e.Count)
	if e.Size != 1 && e.Size != 2 && e.Size != 4 {
		return e, fmt.Errorf("KVM_EXIT_IO: bad access size %d", e.Size)
	}
	if off > uint64(len(r)) || n > uint64(len(r))-off {
		return e, fmt.Errorf("KVM_EXIT_IO: data at %#x+%d lies outside the %d-byte run area", off, n, len(r))
	}
	e.Data = r[off : off+n]
	return e, nil
}

// MMIO decodes a KVM_EXIT_MMIO.
func (v *VCPU) MMIO() MMIOExit {
	r := v.run
	n := min(r.u32(runMMIOLen), 8)
	return MMIOExit{
		PhysAddr: r.u64(runExit),
		IsWrite:  r[runMMIOIsWrite] != 0,
		Data:     r[runMMIOData : runMMIOData+n],
	}
}

// SystemEventType returns kvm_run.system_event.type.
func (v *VCPU) SystemEventType() uint32 { return v.run.u32(runExit) }

// FailEntryReason returns kvm_run.fail_entry.hardware_entry_failure_reason.
func (v *VCPU) FailEntryReason() uint64 { return v.run.u64(runExit) }

// InternalErrorSuberror returns kvm_run.internal.suberror.
func (v *VCPU) InternalErrorSuberror() uint32 { return v.run.u32(runExit) }

// SetImmediateExit sets kvm_run.immediate_exit: while it is set, KVM_RUN
// returns EINTR at once. Another goroutine may call it to stop the vCPU.
func (v *VCPU) SetImmediateExit(on bool) {
	var b byte
	if on {
		b = 1
	}
	v.run[runImmediateExit] = b
}
