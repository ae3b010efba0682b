package vmm

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/capsa-sandbox/capsa/devices"
	"github.com/capsa-sandbox/capsa/kvm"
	"github.com/capsa-sandbox/capsa/virtio"
)

// StateVersion numbers State's layout; a restore refuses any other.
// Version 2 keys each virtio device's state by its id; version 1 held
// them by position, and a state of version 1 is refused (its devices
// cannot be matched to a VM's safely: take the snapshot again).
const StateVersion = 2

// State is a paused VM's state without its memory and devices: what the
// guest can observe of its vCPUs, interrupt controllers, timer and clock,
// as plain data (no file descriptors, locks or channels), so that it can
// be written to a file and a VM restored from it (Restore). Like every
// byte the guest or a file gives, it is checked again on restore.
type State struct {
	Version     int                 `json:"version"`
	CPUs        int                 `json:"cpus"`
	MemoryBytes uint64              `json:"memory_bytes"`
	Clock       uint64              `json:"clock_ns"` // kvmclock when paused
	PIT         kvm.PITState        `json:"pit"`
	IRQChips    []kvm.IRQChip       `json:"irqchips"` // PIC master, PIC slave, IOAPIC
	VCPUs       []VCPUState         `json:"vcpus"`
	Serial      devices.SerialState `json:"serial"`
	// Virtio holds each virtio device's transport under its id, in the
	// order of the guest's memory map.
	Virtio []DeviceState `json:"virtio"`
}

// HasDevice reports whether the state holds a virtio device with this id
// (a device capsa added later than the state was saved is left out of a
// restore of it).
func (st *State) HasDevice(id string) bool {
	for _, d := range st.Virtio {
		if d.ID == id {
			return true
		}
	}
	return false
}

// DeviceState is one virtio device's transport state under its id.
type DeviceState struct {
	ID string `json:"id"`
	virtio.TransportState
}

// VCPUState is one vCPU's state.
type VCPUState struct {
	CPUID   []kvm.CPUIDEntry `json:"cpuid"`
	Regs    kvm.Regs         `json:"regs"`
	Sregs   kvm.Sregs        `json:"sregs"`
	XSAVE   kvm.XSAVE        `json:"xsave"`
	XCRs    kvm.XCRs         `json:"xcrs"`
	Debug   kvm.DebugRegs    `json:"debug_regs"`
	LAPIC   kvm.LAPICState   `json:"lapic"`
	MPState kvm.MPState      `json:"mp_state"`
	Events  kvm.VCPUEvents   `json:"events"`
	MSRs    []kvm.MSREntry   `json:"msrs"`
	TSCKHz  uint32           `json:"tsc_khz"`
}

// maxMSRs and maxCPUIDEntries bound what a state may ask to set (KVM's
// own limit on CPUID entries is 256).
const (
	maxMSRs         = 4096
	maxCPUIDEntries = 256
)

// State returns the paused VM's state. The VM stays paused.
func (m *Machine) State() (*State, error) {
	m.runMu.Lock()
	defer m.runMu.Unlock()
	if m.paused == nil {
		return nil, errors.New("vmm: save state: the VM is not paused")
	}
	st := &State{Version: StateVersion, CPUs: m.cfg.CPUs, MemoryBytes: m.cfg.MemoryBytes, Clock: m.paused.clock.Clock}
	pit, err := m.vm.GetPIT()
	if err != nil {
		return nil, fmt.Errorf("vmm: save state: %w", err)
	}
	st.PIT = *pit
	for id := uint32(kvm.IRQChipPICMaster); id <= kvm.IRQChipIOAPIC; id++ {
		c, err := m.vm.GetIRQChip(id)
		if err != nil {
			return nil, fmt.Errorf("vmm: save state: interrupt controller %d: %w", id, err)
		}
		st.IRQChips = append(st.IRQChips, *c)
	}
	msrs, err := m.msrIndices()
	if err != nil {
		return nil, fmt.Errorf("vmm: save state: %w", err)
	}
	st.Serial = m.serial.State()
	for i, s := range m.virtio {
		id := m.cfg.Devices[i].ID
		ts, err := s.transport.State()
		if err != nil {
			return nil, fmt.Errorf("vmm: save state: virtio device %s: %w", id, err)
		}
		st.Virtio = append(st.Virtio, DeviceState{ID: id, TransportState: ts})
	}
	for i, v := range m.vcpus {
		vs, err := saveVCPU(v, msrs)
		if err != nil {
			return nil, fmt.Errorf("vmm: save state: vCPU %d: %w", i, err)
		}
		vs.CPUID = slices.Clone(m.cpuid[i])
		st.VCPUs = append(st.VCPUs, *vs)
	}
	return st, nil
}

// msrIndices is the MSRs a vCPU's state holds: every one KVM can save,
// the TSC first and the TSC deadline last (a restore sets them in this
// order, and the deadline is read against the TSC and the LAPIC timer's
// mode, both set before it).
func (m *Machine) msrIndices() ([]uint32, error) {
	list, err := m.sys.MSRIndexList()
	if err != nil {
		return nil, err
	}
	out := []uint32{msrIA32TSC}
	for _, idx := range list {
		if idx != msrIA32TSC && idx != msrTSCDeadline {
			out = append(out, idx)
		}
	}
	if slices.Contains(list, msrTSCDeadline) {
		out = append(out, msrTSCDeadline)
	}
	return out, nil
}

// saveVCPU reads a vCPU's state; the vCPU is out of KVM_RUN. The MP state
// is read first: reading it makes KVM settle pending INIT/SIPI events.
func saveVCPU(v *kvm.VCPU, msrs []uint32) (*VCPUState, error) {
	var s VCPUState
	var err error
	if s.MPState, err = v.GetMPState(); err != nil {
		return nil, err
	}
	regs, err := v.GetRegs()
	if err != nil {
		return nil, err
	}
	sregs, err := v.GetSregs()
	if err != nil {
		return nil, err
	}
	xsave, err := v.GetXSAVE()
	if err != nil {
		return nil, err
	}
	xcrs, err := v.GetXCRs()
	if err != nil {
		return nil, err
	}
	dbg, err := v.GetDebugRegs()
	if err != nil {
		return nil, err
	}
	lapic, err := v.GetLAPIC()
	if err != nil {
		return nil, err
	}
	if s.MSRs, err = v.ReadMSRs(msrs); err != nil {
		return nil, err
	}
	ev, err := v.GetVCPUEvents()
	if err != nil {
		return nil, err
	}
	if s.TSCKHz, err = v.TSCKHz(); err != nil {
		return nil, err
	}
	s.Regs, s.Sregs, s.XSAVE, s.XCRs, s.Debug, s.LAPIC, s.Events = *regs, *sregs, *xsave, *xcrs, *dbg, *lapic, *ev
	return &s, nil
}

// Check refuses a state this configuration cannot take, before anything
// is created: a state file is untrusted input.
func (st *State) Check(cfg Config) error {
	switch {
	case st == nil:
		return errors.New("no state")
	case st.Version != StateVersion:
		return fmt.Errorf("state version %d; this capsa reads version %d", st.Version, StateVersion)
	case st.CPUs != cfg.CPUs || len(st.VCPUs) != st.CPUs:
		return fmt.Errorf("state of %d vCPUs (%d saved); the VM has %d: the vCPU count cannot change on restore", st.CPUs, len(st.VCPUs), cfg.CPUs)
	case st.MemoryBytes != cfg.MemoryBytes:
		return fmt.Errorf("state of %d bytes of memory; the VM has %d: the memory size cannot change on restore", st.MemoryBytes, cfg.MemoryBytes)
	case len(st.IRQChips) != 3:
		return fmt.Errorf("state holds %d interrupt controllers, want 3", len(st.IRQChips))
	}
	if err := st.checkDevices(cfg.Devices); err != nil {
		return err
	}
	for i, c := range st.IRQChips {
		if c.ChipID != uint32(i) {
			return fmt.Errorf("interrupt controller %d has id %d", i, c.ChipID)
		}
	}
	for i, v := range st.VCPUs {
		switch {
		case len(v.CPUID) == 0 || len(v.CPUID) > maxCPUIDEntries:
			return fmt.Errorf("vCPU %d: %d CPUID entries, want 1 to %d", i, len(v.CPUID), maxCPUIDEntries)
		case len(v.MSRs) > maxMSRs:
			return fmt.Errorf("vCPU %d: %d MSRs, at most %d", i, len(v.MSRs), maxMSRs)
		case v.XCRs.NrXCRs > uint32(len(v.XCRs.XCRs)):
			return fmt.Errorf("vCPU %d: %d XCRs, at most %d", i, v.XCRs.NrXCRs, len(v.XCRs.XCRs))
		}
	}
	return nil
}

// checkDevices refuses a state whose devices are not the VM's, by id: one
// the state lacks, one the VM lacks, or one saved as another kind, each
// named; and a state whose ids are themselves bad.
func (st *State) checkDevices(devs []Device) error {
	if err := checkDeviceIDs(devs); err != nil {
		return err
	}
	saved := make(map[string]uint32, len(st.Virtio))
	for i, d := range st.Virtio {
		if err := checkDeviceID(d.ID); err != nil {
			return fmt.Errorf("saved virtio device %d: %w", i, err)
		}
		if _, dup := saved[d.ID]; dup {
			return fmt.Errorf("the state holds two virtio devices with the id %q", d.ID)
		}
		saved[d.ID] = d.DeviceType
	}
	have := make(map[string]bool, len(devs))
	for _, d := range devs {
		have[d.ID] = true
		typ, ok := saved[d.ID]
		switch {
		case !ok:
			return fmt.Errorf("the state has no virtio device %q, which this VM has", d.ID)
		case typ != d.Type():
			return fmt.Errorf("virtio device %q: saved as device type %d, this VM's is type %d", d.ID, typ, d.Type())
		}
	}
	for _, d := range st.Virtio {
		if !have[d.ID] {
			return fmt.Errorf("the state holds virtio device %q, which this VM lacks", d.ID)
		}
	}
	return nil
}

// deviceOrder gives devs, checked by checkDevices, in the order of the
// state's devices: each where it was in the guest's memory map.
func (st *State) deviceOrder(devs []Device) []Device {
	byID := make(map[string]Device, len(devs))
	for _, d := range devs {
		byID[d.ID] = d
	}
	out := make([]Device, 0, len(st.Virtio))
	for _, d := range st.Virtio {
		out = append(out, byID[d.ID])
	}
	return out
}

// checkCPUID refuses a state whose vCPUs used CPU features this host's
// KVM does not offer: the guest would find them gone under its feet. The
// bits capsa sets itself (hypervisor, TSC deadline, HTT, the APIC ids)
// are not features of the host.
func checkCPUID(saved, host []kvm.CPUIDEntry, tscDeadline bool) error {
	type key struct{ fn, idx uint32 }
	have := map[key]kvm.CPUIDEntry{}
	for _, e := range host {
		have[key{e.Function, e.Index}] = e
	}
	for _, e := range saved {
		var mask [4]uint32 // the feature registers of the leaves that carry flags
		switch e.Function {
		case 1:
			mask = [4]uint32{0, 0, ^uint32(cpuidHypervisor | cpuidTSCDeadline), ^uint32(cpuidHyperThreads)}
		case 7, 0x8000_0001:
			mask = [4]uint32{0, ^uint32(0), ^uint32(0), ^uint32(0)}
		case 0xd:
			if e.Index == 0 || e.Index == 1 {
				mask = [4]uint32{^uint32(0), 0, 0, 0} // XSAVE components and XSAVE features
			}
		default:
			continue
		}
		if e.Function == 1 && e.ECX&cpuidTSCDeadline != 0 && !tscDeadline {
			return errors.New("the snapshot's vCPUs used the TSC-deadline timer, which this host's KVM lacks")
		}
		h := have[key{e.Function, e.Index}]
		got := [4]uint32{e.EAX, e.EBX, e.ECX, e.EDX}
		hostRegs := [4]uint32{h.EAX, h.EBX, h.ECX, h.EDX}
		for r, name := range []string{"EAX", "EBX", "ECX", "EDX"} {
			if missing := got[r] & mask[r] &^ hostRegs[r]; missing != 0 {
				return fmt.Errorf("the snapshot's vCPUs used CPU features this host lacks: CPUID leaf %#x.%d %s bits %#x", e.Function, e.Index, name, missing)
			}
		}
	}
	return nil
}

// restoreState sets the VM's and every vCPU's state from st, checked by
// st.Check, in the order KVM needs: the clock, the timer and the
// interrupt controllers, then each vCPU (its CPUID when created).
func (m *Machine) restoreState(st *State) error {
	supported, tscDeadline, err := m.hostCPUID()
	if err != nil {
		return err
	}
	for i, v := range st.VCPUs {
		if err := checkCPUID(v.CPUID, supported, tscDeadline); err != nil {
			return fmt.Errorf("vCPU %d: %w", i, err)
		}
	}
	if err := m.vm.SetClock(kvm.ClockData{Clock: st.Clock}); err != nil {
		return err
	}
	if err := m.vm.SetPIT(&st.PIT); err != nil {
		return err
	}
	for i := range st.IRQChips {
		if err := m.vm.SetIRQChip(&st.IRQChips[i]); err != nil {
			return err
		}
	}
	if err := m.newVCPUs(func(i int) []kvm.CPUIDEntry { return st.VCPUs[i].CPUID }); err != nil {
		return err
	}
	for i, v := range m.vcpus {
		if err := restoreVCPU(v, &st.VCPUs[i]); err != nil {
			return fmt.Errorf("vCPU %d: %w", i, err)
		}
	}
	m.serial.Restore(st.Serial)
	for i, s := range m.virtio {
		if err := s.transport.Restore(st.Virtio[i].TransportState); err != nil {
			return fmt.Errorf("virtio device %s: %w", st.Virtio[i].ID, err)
		}
	}
	return nil
}

// restoreVCPU sets a new vCPU's state, in Firecracker's order.
func restoreVCPU(v *kvm.VCPU, s *VCPUState) error {
	if err := v.SetMPState(s.MPState); err != nil {
		return err
	}
	if err := v.SetRegs(&s.Regs); err != nil {
		return err
	}
	if err := v.SetSregs(&s.Sregs); err != nil {
		return err
	}
	if err := v.SetXSAVE(&s.XSAVE); err != nil {
		return err
	}
	if err := v.SetXCRs(&s.XCRs); err != nil {
		return err
	}
	if err := v.SetDebugRegs(&s.Debug); err != nil {
		return err
	}
	if err := v.SetLAPIC(&s.LAPIC); err != nil {
		return err
	}
	if err := v.SetMSRs(s.MSRs); err != nil {
		return err
	}
	return v.SetVCPUEvents(&s.Events)
}

// CPUModel is the processor brand string the vCPUs report (CPUID leaves
// 0x80000002 to 0x80000004), as a snapshot's manifest records it.
func (st *State) CPUModel() string {
	if len(st.VCPUs) == 0 {
		return ""
	}
	var b []byte
	for fn := uint32(0x8000_0002); fn <= 0x8000_0004; fn++ {
		for _, e := range st.VCPUs[0].CPUID {
			if e.Function == fn {
				for _, r := range []uint32{e.EAX, e.EBX, e.ECX, e.EDX} {
					b = append(b, byte(r), byte(r>>8), byte(r>>16), byte(r>>24))
				}
			}
		}
	}
	return strings.TrimSpace(strings.TrimRight(string(b), "\x00"))
}
