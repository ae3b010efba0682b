package kvm

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The expected values in this file were printed by a C program including
// <linux/kvm.h> (Linux 6.12 uapi headers, x86_64).
func TestIoctlNumbers(t *testing.T) {
	for name, tc := range map[string]struct{ got, want uintptr }{
		"KVM_GET_API_VERSION":        {kvmGetAPIVersion, 0xae00},
		"KVM_CREATE_VM":              {kvmCreateVM, 0xae01},
		"KVM_GET_SUPPORTED_CPUID":    {kvmGetSupportedCPUID, 0xc008ae05},
		"KVM_CREATE_VCPU":            {kvmCreateVCPU, 0xae41},
		"KVM_SET_USER_MEMORY_REGION": {kvmSetUserMemoryRegion, 0x4020ae46},
		"KVM_SET_IDENTITY_MAP_ADDR":  {kvmSetIdentityMapAddr, 0x4008ae48},
		"KVM_IRQ_LINE":               {kvmIRQLine, 0x4008ae61},
		"KVM_REINJECT_CONTROL":       {kvmReinjectControl, 0xae71},
		"KVM_IRQFD":                  {kvmIRQFD, 0x4020ae76},
		"KVM_CREATE_PIT2":            {kvmCreatePIT2, 0x4040ae77},
		"KVM_IOEVENTFD":              {kvmIOEventFD, 0x4040ae79},
		"KVM_RUN":                    {kvmRun, 0xae80},
		"KVM_GET_REGS":               {kvmGetRegs, 0x8090ae81},
		"KVM_SET_REGS":               {kvmSetRegs, 0x4090ae82},
		"KVM_GET_SREGS":              {kvmGetSregs, 0x8138ae83},
		"KVM_SET_SREGS":              {kvmSetSregs, 0x4138ae84},
		"KVM_GET_MSRS":               {kvmGetMSRs, 0xc008ae88},
		"KVM_SET_MSRS":               {kvmSetMSRs, 0x4008ae89},
		"KVM_GET_FPU":                {kvmGetFPU, 0x81a0ae8c},
		"KVM_SET_FPU":                {kvmSetFPU, 0x41a0ae8d},
		"KVM_GET_LAPIC":              {kvmGetLAPIC, 0x8400ae8e},
		"KVM_SET_LAPIC":              {kvmSetLAPIC, 0x4400ae8f},
		"KVM_SET_CPUID2":             {kvmSetCPUID2, 0x4008ae90},
		"KVM_GET_MP_STATE":           {kvmGetMPState, 0x8004ae98},
		"KVM_SET_MP_STATE":           {kvmSetMPState, 0x4004ae99},
		"KVM_GET_VCPU_EVENTS":        {kvmGetVCPUEvents, 0x8040ae9f},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %#x, want %#x", name, tc.got, tc.want)
		}
		if opName(tc.got) != name {
			t.Errorf("opName(%#x) = %q, want %q", tc.got, opName(tc.got), name)
		}
	}
}

func TestLayouts(t *testing.T) {
	var (
		s   Sregs
		seg Segment
		f   FPU
		c   CPUIDEntry
		m   MSREntry
		ie  ioeventfd
		ev  VCPUEvents
		irq irqfd
		cd  ClockData
		xc  XCRs
		dr  DebugRegs
		pit PITState
		ic  IRQChip
	)
	for name, tc := range map[string]struct{ got, want uintptr }{
		"kvm_segment.selector":                  {unsafe.Offsetof(seg.Selector), 0xc},
		"kvm_segment.type":                      {unsafe.Offsetof(seg.Type), 0xe},
		"kvm_segment.unusable":                  {unsafe.Offsetof(seg.Unusable), 0x16},
		"kvm_sregs.gdt":                         {unsafe.Offsetof(s.GDT), 0xc0},
		"kvm_sregs.cr0":                         {unsafe.Offsetof(s.CR0), 0xe0},
		"kvm_sregs.efer":                        {unsafe.Offsetof(s.EFER), 0x108},
		"kvm_sregs.apic_base":                   {unsafe.Offsetof(s.APICBase), 0x110},
		"kvm_sregs.interrupt_bitmap":            {unsafe.Offsetof(s.InterruptBitmap), 0x118},
		"kvm_fpu.fcw":                           {unsafe.Offsetof(f.FCW), 0x80},
		"kvm_fpu.last_ip":                       {unsafe.Offsetof(f.LastIP), 0x88},
		"kvm_fpu.xmm":                           {unsafe.Offsetof(f.XMM), 0x98},
		"kvm_fpu.mxcsr":                         {unsafe.Offsetof(f.MXCSR), 0x198},
		"kvm_cpuid_entry2.eax":                  {unsafe.Offsetof(c.EAX), 0xc},
		"kvm_msr_entry.data":                    {unsafe.Offsetof(m.Data), 0x8},
		"kvm_ioeventfd.len":                     {unsafe.Offsetof(ie.Len), 0x10},
		"kvm_ioeventfd.fd":                      {unsafe.Offsetof(ie.FD), 0x14},
		"kvm_ioeventfd.flags":                   {unsafe.Offsetof(ie.Flags), 0x18},
		"kvm_irqfd.flags":                       {unsafe.Offsetof(irq.Flags), 0x8},
		"kvm_vcpu_events.interrupt":             {unsafe.Offsetof(ev.InterruptInjected), 0x8},
		"kvm_vcpu_events.nmi":                   {unsafe.Offsetof(ev.NMIInjected), 0xc},
		"kvm_vcpu_events.sipi_vector":           {unsafe.Offsetof(ev.SIPIVector), 0x10},
		"kvm_vcpu_events.smi":                   {unsafe.Offsetof(ev.SMM), 0x18},
		"kvm_vcpu_events.triple_fault":          {unsafe.Offsetof(ev.TripleFaultPending), 0x1c},
		"kvm_vcpu_events.exception_has_payload": {unsafe.Offsetof(ev.ExceptionHasPayload), 0x37},
		"kvm_vcpu_events.exception_payload":     {unsafe.Offsetof(ev.ExceptionPayload), 0x38},
		"kvm_irqfd.resamplefd":                  {unsafe.Offsetof(irq.ResampleFD), 0xc},
		"kvm_clock_data.flags":                  {unsafe.Offsetof(cd.Flags), 0x8},
		"kvm_xcrs.xcrs":                         {unsafe.Offsetof(xc.XCRs), 0x8},
		"kvm_debugregs.dr7":                     {unsafe.Offsetof(dr.DR7), 0x28},
		"kvm_debugregs.flags":                   {unsafe.Offsetof(dr.Flags), 0x30},
		"kvm_pit_channel_state.count_load_time": {unsafe.Offsetof(pit.Channels[0].CountLoadTime), 0x10},
		"kvm_pit_state2.flags":                  {unsafe.Offsetof(pit.Flags), 0x48},
		"kvm_irqchip.chip":                      {unsafe.Offsetof(ic.Chip), 0x8},
		"kvm_clock_data.realtime":               {unsafe.Offsetof(cd.Realtime), 0x10},
		"kvm_clock_data.host_tsc":               {unsafe.Offsetof(cd.HostTSC), 0x18},
		// struct kvm_run offsets used by run_amd64.go.
		"kvm_run.immediate_exit":   {runImmediateExit, 0x1},
		"kvm_run.exit_reason":      {runExitReason, 0x8},
		"kvm_run.io":               {runExit, 0x20},
		"kvm_run.io.data_offset":   {runIODataOffset, 0x28},
		"kvm_run.mmio.data":        {runMMIOData, 0x28},
		"kvm_run.mmio.len":         {runMMIOLen, 0x30},
		"kvm_run.mmio.is_write":    {runMMIOIsWrite, 0x34},
		"sizeof(struct kvm_run)":   {runMinSize, 0x930},
		"sizeof(struct kvm_sregs)": {unsafe.Sizeof(s), 0x138},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %#x, want %#x", name, tc.got, tc.want)
		}
	}
}

// TestFlexArray checks the buffer handed to KVM_SET_CPUID2 and KVM_*_MSRS:
// the entry count, 4 bytes of padding, then the entries.
func TestFlexArray(t *testing.T) {
	entries := []MSREntry{{Index: 0x174, Data: 0x10}, {Index: 0x175, Data: 0x20}}
	_, hdr := flexArray(entries)
	b := unsafe.Slice((*byte)(hdr), flexHeaderSize+2*16)
	want := []byte{
		2, 0, 0, 0, 0, 0, 0, 0, // nmsrs, pad
		0x74, 1, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0,
		0x75, 1, 0, 0, 0, 0, 0, 0, 0x20, 0, 0, 0, 0, 0, 0, 0,
	}
	if string(b) != string(want) {
		t.Errorf("kvm_msrs buffer % x\nwant             % x", b, want)
	}
	buf, hdr := flexArray([]CPUIDEntry{{Function: 7, EAX: 9}})
	if *(*uint32)(hdr) != 1 || uintptr(hdr)+flexHeaderSize != uintptr(unsafe.Pointer(&buf[1])) {
		t.Error("kvm_cpuid2 header is not directly before its entries")
	}
	if _, hdr := flexArray[CPUIDEntry](nil); *(*uint32)(hdr) != 0 {
		t.Error("empty kvm_cpuid2: nent != 0")
	}
}

func TestRunDecoding(t *testing.T) {
	v := &VCPU{run: make(run, runMinSize)}
	r := v.run
	r[runExitReason] = byte(ExitIO)
	r[runExit], r[runExit+1] = 1, 2 // out, size 2
	r[runExit+2], r[runExit+3] = 0xf8, 0x03
	r[runExit+4] = 3 // count
	r[runIODataOffset] = 0x40
	io, err := v.IO()
	if err != nil || !io.Out || io.Size != 2 || io.Port != 0x3f8 || io.Count != 3 || len(io.Data) != 6 {
		t.Fatalf("IO() = %+v, %v", io, err)
	}
	if v.ExitReason() != ExitIO || v.ExitReason().String() != "KVM_EXIT_IO" {
		t.Errorf("exit reason %v", v.ExitReason())
	}
	// A data offset outside the mapping is refused, not followed.
	r[runIODataOffset+1] = 0x10
	if _, err := v.IO(); err == nil {
		t.Error("out-of-range data offset accepted")
	}
	r[runIODataOffset+1] = 0
	r[runExit+1] = 3
	if _, err := v.IO(); err == nil {
		t.Error("access size 3 accepted")
	}
	r[runMMIOLen] = 200 // more than the 8-byte data field
	if m := v.MMIO(); len(m.Data) != 8 {
		t.Errorf("MMIO data length %d, want capped at 8", len(m.Data))
	}
	v.SetImmediateExit(true)
	if r[runImmediateExit] != 1 {
		t.Error("immediate_exit not set")
	}
}

func TestErrorsNameTheIoctl(t *testing.T) {
	_, err := ioctl(-1, kvmSetUserMemoryRegion, 0)
	if err == nil || !strings.HasPrefix(err.Error(), "KVM_SET_USER_MEMORY_REGION: ") || !errors.Is(err, unix.EBADF) {
		t.Errorf("error %v", err)
	}
}

func TestOpenErrors(t *testing.T) {
	_, err := OpenPath("/nonexistent/kvm")
	if err == nil || !strings.Contains(err.Error(), "no KVM") || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing device: %v", err)
	}
	_, err = OpenPath("/dev/null")
	if err == nil || !strings.Contains(err.Error(), "not a KVM device") {
		t.Errorf("/dev/null: %v", err)
	}
	t.Run("permission", func(t *testing.T) {
		if os.Geteuid() == 0 {
			t.Skip("running as root: permission checks do not apply")
		}
		noperm := filepath.Join(t.TempDir(), "kvm")
		if err := os.WriteFile(noperm, nil, 0); err != nil {
			t.Fatal(err)
		}
		_, err := OpenPath(noperm)
		if err == nil || !strings.Contains(err.Error(), "permission denied: add your user to the group") {
			t.Errorf("unreadable device: %v", err)
		}
	})
}
