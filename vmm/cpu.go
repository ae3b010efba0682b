package vmm

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"

	"github.com/capsa-sandbox/capsa/boot"
	"github.com/capsa-sandbox/capsa/kvm"
)

// MSRs set on every vCPU before it runs (the guest kernel sets its own
// values early; these are the reset state it expects).
const (
	msrIA32TSC         = 0x0000_0010
	msrTSCDeadline     = 0x0000_06e0
	msrSysenterCS      = 0x0000_0174
	msrSysenterESP     = 0x0000_0175
	msrSysenterEIP     = 0x0000_0176
	msrMiscEnable      = 0x0000_01a0
	msrMTRRDefType     = 0x0000_02ff
	msrSTAR            = 0xc000_0081
	msrLSTAR           = 0xc000_0082
	msrCSTAR           = 0xc000_0083
	msrSyscallMask     = 0xc000_0084
	msrKernelGSBase    = 0xc000_0102
	miscEnableFastStr  = 1 << 0
	mtrrEnableWriteBak = 1<<11 | 6 // MTRRs on, default type write-back
)

// LAPIC register offsets in struct kvm_lapic_state and delivery modes.
const (
	apicLVT0       = 0x350
	apicLVT1       = 0x360
	apicModeMask   = 0x700
	apicModeNMI    = 0x400
	apicModeExtINT = 0x700
)

// CPUID bits capsa adjusts per vCPU.
const (
	cpuidHypervisor   = 1 << 31 // leaf 1 ECX
	cpuidTSCDeadline  = 1 << 24 // leaf 1 ECX
	cpuidHyperThreads = 1 << 28 // leaf 1 EDX: EBX[23:16] counts logical CPUs
)

// hostCPUID is the CPUID table the vCPUs are given from: what KVM
// supports, and whether it emulates the TSC-deadline timer.
func (m *Machine) hostCPUID() ([]kvm.CPUIDEntry, bool, error) {
	supported, err := m.sys.GetSupportedCPUID()
	if err != nil {
		return nil, false, err
	}
	// KVM emulates the TSC-deadline timer but leaves its CPUID bit out of
	// KVM_GET_SUPPORTED_CPUID; it says so with a capability instead.
	tscDeadline, err := m.sys.CheckExtension(kvm.CapTSCDeadlineTimer)
	if err != nil {
		return nil, false, err
	}
	return supported, tscDeadline > 0, nil
}

// newVCPUs creates the vCPUs, each with the CPUID table cpuid gives it.
func (m *Machine) newVCPUs(cpuid func(i int) []kvm.CPUIDEntry) error {
	m.tids = make([]atomic.Int32, m.cfg.CPUs)
	m.cpuBase = make([]atomic.Int64, m.cfg.CPUs)
	for range m.cfg.CPUs {
		m.track = append(m.track, newVCPUTrack())
	}
	for i := 0; i < m.cfg.CPUs; i++ {
		v, err := m.vm.CreateVCPU(i)
		if err != nil {
			return err
		}
		m.vcpus = append(m.vcpus, v)
		c := cpuid(i)
		if err := v.SetCPUID2(c); err != nil {
			return fmt.Errorf("vCPU %d: %w", i, err)
		}
		m.cpuid = append(m.cpuid, c)
	}
	return nil
}

// createVCPUs creates the vCPUs in their power-on state, the boot CPU at
// the kernel's entry as state says.
func (m *Machine) createVCPUs(state *boot.CPUState) error {
	supported, tscDeadline, err := m.hostCPUID()
	if err != nil {
		return err
	}
	err = m.newVCPUs(func(i int) []kvm.CPUIDEntry { return vcpuCPUID(supported, i, m.cfg.CPUs, tscDeadline) })
	if err != nil {
		return err
	}
	for i, v := range m.vcpus {
		if err := setupMSRs(v); err != nil {
			return err
		}
		if err := v.SetFPU(&kvm.FPU{FCW: 0x37f, MXCSR: 0x1f80}); err != nil {
			return err
		}
		if err := setupLAPIC(v); err != nil {
			return err
		}
		// Application processors wait for INIT/SIPI from the boot CPU in
		// the in-kernel LAPIC; only the boot CPU starts at the kernel entry.
		if i == 0 {
			if err := setupBootRegisters(v, state); err != nil {
				return err
			}
		}
	}
	return nil
}

// vcpuCPUID derives vCPU id's CPUID table from what KVM supports: each vCPU
// reports its own APIC id, and the guest learns it runs on a hypervisor
// (KVM's paravirt leaves 0x40000000.. come from KVM_GET_SUPPORTED_CPUID).
//
// The TSC-deadline timer is offered when KVM has it, as QEMU and
// Firecracker do: without it Linux programs its local APIC timer through
// the APIC's memory-mapped registers, each write an exit that KVM decodes
// and emulates, where with it a timer is one MSR write.
func vcpuCPUID(supported []kvm.CPUIDEntry, id, ncpus int, tscDeadline bool) []kvm.CPUIDEntry {
	out := make([]kvm.CPUIDEntry, len(supported))
	copy(out, supported)
	for i := range out {
		e := &out[i]
		switch e.Function {
		case 1:
			e.EBX = e.EBX&0x0000_ffff | uint32(ncpus)<<16 | uint32(id)<<24
			e.ECX |= cpuidHypervisor
			if tscDeadline {
				e.ECX |= cpuidTSCDeadline
			}
			if ncpus > 1 {
				e.EDX |= cpuidHyperThreads
			}
		case 0xb, 0x1f:
			e.EDX = uint32(id) // x2APIC id
		case 0x8000_001e:
			e.EAX = uint32(id) // extended APIC id (AMD)
		}
	}
	return out
}

func setupMSRs(v *kvm.VCPU) error {
	return v.SetMSRs([]kvm.MSREntry{
		{Index: msrIA32TSC},
		{Index: msrSysenterCS},
		{Index: msrSysenterESP},
		{Index: msrSysenterEIP},
		{Index: msrSTAR},
		{Index: msrLSTAR},
		{Index: msrCSTAR},
		{Index: msrSyscallMask},
		{Index: msrKernelGSBase},
		{Index: msrMiscEnable, Data: miscEnableFastStr},
		{Index: msrMTRRDefType, Data: mtrrEnableWriteBak},
	})
}

// setupLAPIC wires LINT0 to the PIC (ExtINT) and LINT1 to NMI, as firmware
// does on a PC.
func setupLAPIC(v *kvm.VCPU) error {
	st, err := v.GetLAPIC()
	if err != nil {
		return err
	}
	set := func(off int, mode uint32) {
		r := binary.LittleEndian.Uint32(st.Regs[off:])
		binary.LittleEndian.PutUint32(st.Regs[off:], r&^apicModeMask|mode)
	}
	set(apicLVT0, apicModeExtINT)
	set(apicLVT1, apicModeNMI)
	return v.SetLAPIC(st)
}

func segment(s boot.Segment) kvm.Segment {
	return kvm.Segment{
		Base: s.Base, Limit: s.Limit, Selector: s.Selector, Type: s.Type,
		Present: s.Present, DPL: s.DPL, DB: s.DB, S: s.S, L: s.L, G: s.G, AVL: s.AVL,
	}
}

// setupBootRegisters enters the kernel in 64-bit mode as the boot package
// laid it out.
func setupBootRegisters(v *kvm.VCPU, st *boot.CPUState) error {
	sr, err := v.GetSregs()
	if err != nil {
		return err
	}
	sr.CS = segment(st.CS)
	sr.DS, sr.ES, sr.FS, sr.GS, sr.SS = segment(st.DS), segment(st.ES), segment(st.FS), segment(st.GS), segment(st.SS)
	sr.TR = segment(st.TR)
	sr.GDT = kvm.DTable{Base: st.GDTBase, Limit: st.GDTLimit}
	sr.IDT = kvm.DTable{Base: st.IDTBase, Limit: st.IDTLimit}
	sr.CR0, sr.CR3, sr.CR4, sr.EFER = st.CR0, st.CR3, st.CR4, st.EFER
	if err := v.SetSregs(sr); err != nil {
		return err
	}
	regs := &kvm.Regs{RIP: st.RIP, RSP: st.RSP, RBP: st.RBP, RSI: st.RSI, RFLAGS: st.RFLAGS}
	if err := v.SetRegs(regs); err != nil {
		return fmt.Errorf("boot CPU registers: %w", err)
	}
	return nil
}
