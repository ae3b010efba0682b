package vmm

import (
	"testing"

	"github.com/capsa-sandbox/capsa/kvm"
)

func TestVCPUCPUID(t *testing.T) {
	supported := []kvm.CPUIDEntry{
		{Function: 0, EAX: 0xd},
		{Function: 1, EBX: 0x0000_0800, ECX: 0x1, EDX: 0x1},
		{Function: 0xb, Index: 0, EDX: 99},
		{Function: 0x8000_001e, EAX: 99},
	}
	for _, tc := range []struct {
		id, ncpus   int
		tscDeadline bool
	}{{0, 1, false}, {1, 2, true}, {3, 4, true}} {
		got := vcpuCPUID(supported, tc.id, tc.ncpus, tc.tscDeadline)
		l1 := got[1]
		if apic := int(l1.EBX >> 24); apic != tc.id {
			t.Errorf("vcpuCPUID(id %d): leaf 1 APIC id %d", tc.id, apic)
		}
		if n := int(l1.EBX >> 16 & 0xff); n != tc.ncpus {
			t.Errorf("vcpuCPUID(%d CPUs): leaf 1 logical count %d", tc.ncpus, n)
		}
		if l1.EBX&0xffff != 0x0800 || l1.ECX&1 == 0 || l1.EDX&1 == 0 {
			t.Errorf("vcpuCPUID: leaf 1 lost KVM's bits: %+v", l1)
		}
		if l1.ECX&cpuidHypervisor == 0 {
			t.Error("vcpuCPUID: no hypervisor bit")
		}
		if got := l1.ECX&cpuidTSCDeadline != 0; got != tc.tscDeadline {
			t.Errorf("vcpuCPUID(tscDeadline %v): TSC-deadline bit %v", tc.tscDeadline, got)
		}
		if got := l1.EDX&cpuidHyperThreads != 0; got != (tc.ncpus > 1) {
			t.Errorf("vcpuCPUID(%d CPUs): HTT bit %v", tc.ncpus, got)
		}
		if got[2].EDX != uint32(tc.id) || got[3].EAX != uint32(tc.id) {
			t.Errorf("vcpuCPUID(id %d): x2APIC id %d, extended APIC id %d", tc.id, got[2].EDX, got[3].EAX)
		}
	}
	if supported[1].ECX&cpuidHypervisor != 0 {
		t.Error("vcpuCPUID modified the table it was given")
	}
}
