package vmm

import (
	"testing"

	"github.com/capsa-sandbox/capsa/guestmem"
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

// TestReadVirt walks hand-built 4-level page tables: a 4 KiB page, a 2 MiB
// page, a read across two pages, and an unmapped address.
func TestReadVirt(t *testing.T) {
	mem, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: make([]byte, 8<<20)})
	if err != nil {
		t.Fatal(err)
	}
	m := &Machine{mem: mem}
	const pml4, pdpt, pd, pt = 0x1000, 0x2000, 0x3000, 0x4000
	va4k := uint64(0xffff_8000_0000_0000) // PML4 256, PDPT 0, PD 0, PT 0
	put := func(addr, v uint64) { mem.PutUint64(addr, v) }
	put(pml4+8*256, pdpt|ptePres)
	put(pdpt, pd|ptePres)
	put(pd, pt|ptePres)
	put(pt, 0x10000|ptePres)                  // va4k -> 0x10000
	put(pt+8, 0x20000|ptePres)                // va4k+4K -> 0x20000
	put(pd+8, 0x200000|ptePres|ptePS)         // va4k+2M -> 2 MiB page at 0x200000
	mem.WriteAt([]byte("ABCD"), 0x10000+4094) // spans into the next page
	mem.WriteAt([]byte("EF"), 0x20000)
	mem.WriteAt([]byte("big page"), 0x200000+0x1234)
	s := &kvm.Sregs{CR0: cr0PG, CR4: cr4PAE, EFER: eferLMA, CR3: pml4}
	if got := string(m.readVirt(s, va4k+4094, 4)); got != "ABEF" {
		t.Errorf("readVirt(across pages) = %q, want %q", got, "ABEF")
	}
	if got := string(m.readVirt(s, va4k+2<<20+0x1234, 8)); got != "big page" {
		t.Errorf("readVirt(2 MiB page) = %q", got)
	}
	if got := m.readVirt(s, va4k+4<<20, 8); len(got) != 0 {
		t.Errorf("readVirt(unmapped) = % x, want nothing", got)
	}
	if got := m.readVirt(&kvm.Sregs{}, va4k, 8); len(got) != 0 {
		t.Errorf("readVirt without paging = % x", got)
	}
}

// TestImpossibleState: a page table root outside guest memory is flagged,
// one inside is not.
func TestImpossibleState(t *testing.T) {
	mem, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: make([]byte, 8<<20)})
	if err != nil {
		t.Fatal(err)
	}
	m := &Machine{mem: mem}
	for _, tc := range []struct {
		cr3  uint64
		want bool
	}{{0x1000, false}, {0x100348000, true}, {8 << 20, true}} {
		s := &kvm.Sregs{CR0: cr0PG, CR4: cr4PAE, EFER: eferLMA, CR3: tc.cr3}
		d := VCPUDebug{}
		m.checkState(&d, s)
		if got := d.Impossible != ""; got != tc.want {
			t.Errorf("checkState(CR3 %#x): impossible %v (%q), want %v", tc.cr3, got, d.Impossible, tc.want)
		}
	}
}
