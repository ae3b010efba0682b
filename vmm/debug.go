package vmm

import (
	"context"
	"encoding/binary"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/capsa-sandbox/capsa/kvm"
	"github.com/capsa-sandbox/capsa/virtio"
)

// Debug is what a VM was doing when it was asked: enough to diagnose a
// hang or a failure from one occurrence. Machine.Debug takes it from a
// running VM (each vCPU reports its own state between two KVM_RUNs) or
// from a stopped one.
type Debug struct {
	Taken   time.Time
	Running bool
	Paused  bool // running, but paused (Machine.Pause)
	VCPUs   []VCPUDebug
	Virtio  []virtio.TransportDebug
	// Exits counts the VM exits to userspace by reason, over all vCPUs.
	Exits map[string]uint64
	// Console is the tail of the guest's serial console.
	Console string
}

// VCPUDebug is one vCPU's state.
type VCPUDebug struct {
	ID int
	// Err is set when the state could not be read: the vCPU did not leave
	// KVM_RUN in time, or is stuck in the VMM handling an exit (Busy says
	// which).
	Err  error
	Busy string

	Regs    kvm.Regs
	Sregs   kvm.Sregs
	Events  kvm.VCPUEvents
	MPState kvm.MPState
	// LAPIC registers: the interrupt request and in-service vectors, the
	// task priority, the timer's LVT and current count.
	IRR, ISR  []int
	TPR       uint32
	LVTTimer  uint32
	TimerCCR  uint32
	LAPICBase uint64
	// Stack is the first words at RSP and Code the bytes at RIP, read
	// through the guest's page tables (empty where they map nothing).
	Stack []uint64
	Code  []byte
	// Impossible says why this state cannot be the guest's own doing,
	// when it cannot: a page table root outside the guest's memory is
	// what a hypervisor below capsa leaves when it loads its own state
	// into the vCPU (seen under QEMU TCG's emulated SVM: the registers
	// of L1's VMRUN). Empty otherwise.
	Impossible string
}

// LAPIC register offsets in struct kvm_lapic_state used by Debug.
const (
	apicTPR      = 0x80
	apicISR      = 0x100
	apicIRR      = 0x200
	apicLVTTimer = 0x320
	apicTimerCCR = 0x390
)

// Impossible reports whether some vCPU's state cannot come from the guest
// (VCPUDebug.Impossible), and why.
func (d *Debug) Impossible() (string, bool) {
	for _, v := range d.VCPUs {
		if v.Impossible != "" {
			return fmt.Sprintf("vCPU %d: %s", v.ID, v.Impossible), true
		}
	}
	return "", false
}

// String formats the report for a log or a test failure.
func (d *Debug) String() string {
	var b strings.Builder
	state := "stopped"
	if d.Running {
		state = "running"
	}
	if d.Paused {
		state = "paused"
	}
	fmt.Fprintf(&b, "VM debug state (%s, taken %s)\n", state, d.Taken.Format(time.RFC3339Nano))
	for _, v := range d.VCPUs {
		if v.Err != nil {
			fmt.Fprintf(&b, "vCPU %d: %v", v.ID, v.Err)
			if v.Busy != "" {
				fmt.Fprintf(&b, " (busy: %s)", v.Busy)
			}
			b.WriteString("\n")
			continue
		}
		r, s, e := &v.Regs, &v.Sregs, &v.Events
		fmt.Fprintf(&b, "vCPU %d: mp_state %s rip %#x rsp %#x rflags %#x cs %#x cpl %d\n",
			v.ID, mpStateName(v.MPState), r.RIP, r.RSP, r.RFLAGS, s.CS.Selector, s.CS.DPL)
		if v.Impossible != "" {
			fmt.Fprintf(&b, "  impossible state: %s\n", v.Impossible)
		}
		fmt.Fprintf(&b, "  rax %#x rbx %#x rcx %#x rdx %#x rsi %#x rdi %#x rbp %#x\n", r.RAX, r.RBX, r.RCX, r.RDX, r.RSI, r.RDI, r.RBP)
		fmt.Fprintf(&b, "  cr0 %#x cr2 %#x cr3 %#x cr4 %#x cr8 %#x efer %#x apic_base %#x gdt %#x/%#x idt %#x/%#x\n",
			s.CR0, s.CR2, s.CR3, s.CR4, s.CR8, s.EFER, s.APICBase, s.GDT.Base, s.GDT.Limit, s.IDT.Base, s.IDT.Limit)
		fmt.Fprintf(&b, "  events: exception injected=%d pending=%d nr=%d err=%#x; interrupt injected=%d nr=%d shadow=%d; nmi injected=%d pending=%d masked=%d\n",
			e.ExceptionInjected, e.ExceptionPending, e.ExceptionNr, e.ExceptionErrorCode,
			e.InterruptInjected, e.InterruptNr, e.InterruptShadow, e.NMIInjected, e.NMIPending, e.NMIMasked)
		fmt.Fprintf(&b, "  lapic: irr %v isr %v tpr %#x lvt_timer %#x timer_ccr %d\n", v.IRR, v.ISR, v.TPR, v.LVTTimer, v.TimerCCR)
		if len(v.Code) > 0 {
			fmt.Fprintf(&b, "  code at rip: % x\n", v.Code)
		}
		if len(v.Stack) > 0 {
			fmt.Fprintf(&b, "  stack:")
			for _, w := range v.Stack {
				fmt.Fprintf(&b, " %#x", w)
			}
			b.WriteString("\n")
		}
	}
	for _, t := range d.Virtio {
		b.WriteString(t.String())
		b.WriteString("\n")
	}
	if len(d.Exits) > 0 {
		fmt.Fprintf(&b, "exits to the VMM: %v\n", d.Exits)
	}
	if d.Console != "" {
		fmt.Fprintf(&b, "console tail:\n%s\n", d.Console)
	}
	return b.String()
}

func mpStateName(s kvm.MPState) string {
	switch s {
	case kvm.MPStateRunnable:
		return "runnable"
	case kvm.MPStateUninitialized:
		return "uninitialized"
	case kvm.MPStateHalted:
		return "halted"
	}
	return fmt.Sprintf("%d", s)
}

// vcpuTrack is what the VMM records about one vCPU for diagnostics, and
// its channel for state requests.
type vcpuTrack struct {
	exits [64]atomic.Uint64 // by exit reason; larger reasons count in [0]
	// While the vCPU thread handles an exit: the reason, the port or
	// address, and when it started (unix nanoseconds); 0 in the guest.
	busyReason atomic.Uint32
	busyAddr   atomic.Uint64
	busySince  atomic.Int64
	// requests are run on the vCPU's own thread between two KVM_RUNs:
	// state reads (Debug) and parking (Pause).
	requests chan func()
}

func newVCPUTrack() *vcpuTrack { return &vcpuTrack{requests: make(chan func(), 4)} }

func (t *vcpuTrack) enter(reason kvm.ExitReason, addr uint64) {
	switch {
	case reason == kvm.ExitIntr:
		// A signal, often the VMM's own kick (Debug, a stop): not the
		// guest's doing, so not counted.
	case int(reason) < len(t.exits):
		t.exits[reason].Add(1)
	default:
		t.exits[0].Add(1)
	}
	t.busyReason.Store(uint32(reason))
	t.busyAddr.Store(addr)
	t.busySince.Store(time.Now().UnixNano())
}

func (t *vcpuTrack) leave() { t.busySince.Store(0) }

func (t *vcpuTrack) busy() string {
	since := t.busySince.Load()
	if since == 0 {
		return ""
	}
	return fmt.Sprintf("handling %v at %#x for %v", kvm.ExitReason(t.busyReason.Load()), t.busyAddr.Load(),
		time.Since(time.Unix(0, since)).Round(time.Millisecond))
}

// debugWait bounds how long Debug waits for a running vCPU to report.
const debugWait = 2 * time.Second

// Debug returns the VM's state. While the VM runs, each vCPU is made to
// leave KVM_RUN (as for a stop, but it goes on afterwards) and reports its
// own state; a vCPU that does not report within a few seconds is named
// with what it is busy with. It never stops the VM.
func (m *Machine) Debug(ctx context.Context) *Debug {
	d := &Debug{Taken: time.Now(), Console: m.console.Tail(), Exits: map[string]uint64{}}
	m.runMu.Lock()
	// A paused VM's vCPUs are parked outside KVM_RUN: read them from here.
	running := m.running && m.paused == nil
	defer m.runMu.Unlock()
	d.Running, d.Paused = m.running, m.paused != nil
	replies := make([]chan VCPUDebug, len(m.vcpus))
	for i := range m.vcpus {
		if !running {
			continue
		}
		reply := make(chan VCPUDebug, 1)
		if m.request(i, func() { reply <- m.vcpuDebug(i) }) {
			replies[i] = reply
		}
	}
	timeout := time.NewTimer(debugWait)
	defer timeout.Stop()
	for i := range m.vcpus {
		switch {
		case !running:
			d.VCPUs = append(d.VCPUs, m.vcpuDebug(i))
		case replies[i] == nil:
			d.VCPUs = append(d.VCPUs, VCPUDebug{ID: i, Err: fmt.Errorf("earlier state requests still pending"), Busy: m.track[i].busy()})
		default:
			select {
			case r := <-replies[i]:
				d.VCPUs = append(d.VCPUs, r)
			case <-timeout.C:
				d.VCPUs = append(d.VCPUs, VCPUDebug{ID: i, Err: fmt.Errorf("did not report within %v", debugWait), Busy: m.track[i].busy()})
			case <-ctx.Done():
				d.VCPUs = append(d.VCPUs, VCPUDebug{ID: i, Err: ctx.Err(), Busy: m.track[i].busy()})
			}
		}
	}
	for _, t := range m.track {
		for r := range t.exits {
			if n := t.exits[r].Load(); n > 0 {
				name := kvm.ExitReason(r).String()
				if r == 0 {
					name = "other"
				}
				d.Exits[name] += n
			}
		}
	}
	for _, s := range m.virtio {
		d.Virtio = append(d.Virtio, s.transport.Debug(fmt.Sprintf("virtio-mmio@%#x gsi %d", s.base, s.gsi)))
	}
	return d
}

// request queues f to run on vCPU i's own thread and kicks the vCPU out of
// KVM_RUN; false if too many requests are pending already.
func (m *Machine) request(i int, f func()) bool {
	select {
	case m.track[i].requests <- f:
	default:
		return false
	}
	m.kick(i)
	return true
}

// serveRequests runs pending requests on vCPU i's own thread, between two
// KVM_RUNs.
func (m *Machine) serveRequests(i int) {
	for {
		select {
		case f := <-m.track[i].requests:
			f()
		default:
			return
		}
	}
}

// vcpuDebug reads vCPU i's state; the vCPU must not be in KVM_RUN.
func (m *Machine) vcpuDebug(i int) VCPUDebug {
	v := m.vcpus[i]
	d := VCPUDebug{ID: i}
	fail := func(err error) VCPUDebug { d.Err = err; return d }
	regs, err := v.GetRegs()
	if err != nil {
		return fail(err)
	}
	sregs, err := v.GetSregs()
	if err != nil {
		return fail(err)
	}
	ev, err := v.GetVCPUEvents()
	if err != nil {
		return fail(err)
	}
	if d.MPState, err = v.GetMPState(); err != nil {
		return fail(err)
	}
	lapic, err := v.GetLAPIC()
	if err != nil {
		return fail(err)
	}
	d.Regs, d.Sregs, d.Events = *regs, *sregs, *ev
	d.IRR, d.ISR = apicVectors(lapic, apicIRR), apicVectors(lapic, apicISR)
	le := binary.LittleEndian
	d.TPR = le.Uint32(lapic.Regs[apicTPR:])
	d.LVTTimer = le.Uint32(lapic.Regs[apicLVTTimer:])
	d.TimerCCR = le.Uint32(lapic.Regs[apicTimerCCR:])
	d.LAPICBase = sregs.APICBase
	m.checkState(&d, sregs)
	d.Code = m.readVirt(sregs, regs.RIP, 32)
	if stack := m.readVirt(sregs, regs.RSP, 16*8); len(stack) > 0 {
		for i := 0; i+8 <= len(stack); i += 8 {
			d.Stack = append(d.Stack, le.Uint64(stack[i:]))
		}
	}
	return d
}

// checkState sets d.Impossible when the vCPU's state cannot be the guest's.
func (m *Machine) checkState(d *VCPUDebug, s *kvm.Sregs) {
	if s.CR0&cr0PG != 0 && !m.mem.Contains(s.CR3&pteAddr, pageSize) {
		d.Impossible = fmt.Sprintf("CR3 %#x is outside the guest's %d MiB of memory: the guest cannot have loaded it; the hypervisor below capsa replaced the vCPU's state", s.CR3, m.mem.Size()>>20)
	}
}

// Paging bits for readVirt.
const (
	cr0PG    = 1 << 31
	cr4PAE   = 1 << 5
	cr4LA57  = 1 << 12
	eferLMA  = 1 << 10
	ptePres  = 1 << 0
	ptePS    = 1 << 7
	pteAddr  = 0x000f_ffff_ffff_f000
	pageSize = 4096
)

// readVirt reads up to n bytes at a guest virtual address through the
// vCPU's 4- or 5-level page tables (64-bit mode only), stopping at the
// first unmapped page; it reads guest memory and never fails otherwise.
func (m *Machine) readVirt(s *kvm.Sregs, va uint64, n int) []byte {
	if s.CR0&cr0PG == 0 || s.CR4&cr4PAE == 0 || s.EFER&eferLMA == 0 {
		return nil
	}
	var out []byte
	for len(out) < n {
		gpa, ok := m.translate(s.CR3, s.CR4&cr4LA57 != 0, va)
		if !ok {
			break
		}
		k := min(n-len(out), int(pageSize-va%pageSize))
		buf := make([]byte, k)
		if m.mem.ReadAt(buf, gpa) != nil {
			break
		}
		out = append(out, buf...)
		va += uint64(k)
	}
	return out
}

// translate walks the guest's page tables for va.
func (m *Machine) translate(cr3 uint64, la57 bool, va uint64) (uint64, bool) {
	levels := 4
	if la57 {
		levels = 5
	}
	table := cr3 & pteAddr
	for l := levels; l >= 1; l-- {
		shift := 12 + 9*uint(l-1)
		pte, err := m.mem.Uint64(table + 8*((va>>shift)&0x1ff))
		if err != nil || pte&ptePres == 0 {
			return 0, false
		}
		if l <= 3 && l > 1 && pte&ptePS != 0 { // a 1 GiB or 2 MiB page
			mask := uint64(1)<<shift - 1
			return pte&pteAddr&^mask | va&mask, true
		}
		table = pte & pteAddr
	}
	return table | va&(pageSize-1), true
}

// apicVectors lists the vectors set in a 256-bit LAPIC register (IRR, ISR):
// eight 32-bit words, each on a 16-byte boundary.
func apicVectors(l *kvm.LAPICState, off int) []int {
	var vs []int
	for w := range 8 {
		bits := binary.LittleEndian.Uint32(l.Regs[off+16*w:])
		for b := range 32 {
			if bits&(1<<b) != 0 {
				vs = append(vs, 32*w+b)
			}
		}
	}
	return vs
}
