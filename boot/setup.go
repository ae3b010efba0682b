package boot

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// Config is what Setup lays out for the kernel.
type Config struct {
	Kernel     *Kernel
	Cmdline    string
	InitrdAddr uint64 // from LoadInitrd; InitrdSize 0: no initramfs
	InitrdSize uint64
	CPUs       int // 1..MaxMPCPUs
}

// Segment is a segment register's hidden state in the layout of KVM's
// kvm_segment, with the limit already scaled by the granularity bit.
type Segment struct {
	Base                      uint64
	Limit                     uint32
	Selector                  uint16
	Type                      uint8
	Present, DPL, DB, S, L, G uint8
	AVL                       uint8
}

// CPUState is the boot CPU's state at the kernel's 64-bit entry: long mode,
// paging on with the identity map, interrupts off, RSI = boot_params.
type CPUState struct {
	RIP, RSP, RBP, RSI, RFLAGS uint64
	CR0, CR3, CR4, EFER        uint64
	GDTBase, IDTBase           uint64
	GDTLimit, IDTLimit         uint16
	CS, DS, ES, FS, GS, SS, TR Segment
}

// Control register and EFER bits for 64-bit mode.
const (
	CR0PE   = 1 << 0  // protected mode
	CR0ET   = 1 << 4  // extension type (hardwired to 1 on modern CPUs)
	CR0PG   = 1 << 31 // paging
	CR4PAE  = 1 << 5  // physical address extension, required for long mode
	EFERLME = 1 << 8  // long mode enable
	EFERLMA = 1 << 10 // long mode active
)

// Selectors of the GDT that Setup installs. boot.rst requires the 64-bit
// entry to see __BOOT_CS = 0x10 and __BOOT_DS = 0x18, so entry 1 is unused.
const (
	SelectorCode = 0x10
	SelectorData = 0x18
	SelectorTSS  = 0x20 // a 16-byte system descriptor: entries 4 and 5
)

// gdtEntry encodes a segment descriptor from its flags (bits 12-15 of
// flags: G, D/B, L, AVL) and access byte (bits 0-7: P, DPL, S, type).
func gdtEntry(flags uint16, base, limit uint32) uint64 {
	return uint64(base&0xff00_0000)<<32 |
		uint64(flags&0xf0ff)<<40 |
		uint64(limit&0x000f_0000)<<32 |
		uint64(base&0x00ff_ffff)<<16 |
		uint64(limit&0x0000_ffff)
}

// GDT returns the descriptor table Setup writes at GDTAddr: flat 4 GiB
// segments, all DPL 0.
func GDT() []uint64 {
	return []uint64{
		0,
		0,
		gdtEntry(0xa09b, 0, 0xfffff), // 0x10 code: G, L, present, execute/read, accessed
		gdtEntry(0xc093, 0, 0xfffff), // 0x18 data: G, D/B, present, read/write, accessed
		gdtEntry(0x808b, 0, 0xfffff), // 0x20 TSS: G, present, busy 64-bit TSS, base 0
		0,                            // upper half of the TSS descriptor: base 63:32
	}
}

// SegmentFromGDT decodes descriptor entry into the hidden segment state that
// loading selector would produce, so registers and GDT cannot disagree. For
// a 16-byte system descriptor (S = 0) entry is the low half, and bits 63:32
// of the base, in the high half, are not included.
func SegmentFromGDT(entry uint64, selector uint16) Segment {
	s := Segment{
		Base:     (entry>>16)&0xff_ffff | (entry>>32)&0xff00_0000,
		Limit:    uint32(entry&0xffff | (entry>>32)&0xf_0000),
		Selector: selector,
		Type:     uint8(entry>>40) & 0xf,
		S:        uint8(entry>>44) & 1,
		DPL:      uint8(entry>>45) & 3,
		Present:  uint8(entry>>47) & 1,
		AVL:      uint8(entry>>52) & 1,
		L:        uint8(entry>>53) & 1,
		DB:       uint8(entry>>54) & 1,
		G:        uint8(entry>>55) & 1,
	}
	if s.G == 1 {
		s.Limit = s.Limit<<12 | 0xfff
	}
	return s
}

// segment decodes the descriptor selector picks in gdt, with the high half
// of a system descriptor's base.
func segment(gdt []uint64, selector uint16) Segment {
	i := int(selector >> 3)
	s := SegmentFromGDT(gdt[i], selector)
	if s.S == 0 && i+1 < len(gdt) {
		s.Base |= gdt[i+1] << 32
	}
	return s
}

// E820Type is an e820 memory range type.
type E820Type uint32

// e820 types.
const (
	E820RAM      E820Type = 1
	E820Reserved E820Type = 2
)

// E820Entry is one range of the BIOS memory map.
type E820Entry struct {
	Addr, Size uint64
	Type       E820Type
}

// E820 returns the memory map for guest RAM laid out as regions (sorted, the
// first at 0, as guestmem.Memory.Regions returns them): base memory
// [0, EBDAStart) as RAM, the BIOS area holding the ACPI and MP tables
// reserved, RAM from HighMemBase to the end of the first region, then every
// other region as RAM. [EBDAStart, ACPIAddr) is left out: the guest sees no
// RAM there.
func E820(regions []guestmem.Region) ([]E820Entry, error) {
	if len(regions) == 0 || regions[0].GPA != 0 || regions[0].End() <= HighMemBase {
		return nil, errors.New("e820: guest RAM must start at 0 and extend past 1 MiB")
	}
	m := []E820Entry{
		{0, EBDAStart, E820RAM},
		{ACPIAddr, BIOSEnd - ACPIAddr, E820Reserved},
		{HighMemBase, regions[0].End() - HighMemBase, E820RAM},
	}
	for _, r := range regions[1:] {
		m = append(m, E820Entry{r.GPA, uint64(len(r.Host)), E820RAM})
	}
	if len(m) > e820MaxEntries {
		return nil, fmt.Errorf("e820: %d entries, boot_params holds %d", len(m), e820MaxEntries)
	}
	return m, nil
}

// Setup writes the boot structures for cfg into mem (the layout is in the
// package documentation) and returns the boot CPU's state. The kernel and
// initramfs must already be loaded.
func Setup(mem *guestmem.Memory, cfg Config) (*CPUState, error) {
	le := binary.LittleEndian
	k := cfg.Kernel
	switch {
	case mem == nil:
		return nil, errors.New("boot: no guest memory")
	case k == nil:
		return nil, errors.New("boot: no kernel loaded")
	case cfg.InitrdSize > 0 && (cfg.InitrdAddr < HighMemBase || !mem.Contains(cfg.InitrdAddr, cfg.InitrdSize)):
		return nil, fmt.Errorf("boot: initramfs at %#x (%d bytes) is not in guest RAM above 1 MiB", cfg.InitrdAddr, cfg.InitrdSize)
	}
	if limit := k.cmdlineMax(); uint64(len(cfg.Cmdline)) > limit {
		return nil, fmt.Errorf("boot: kernel command line is %d bytes, the kernel accepts at most %d", len(cfg.Cmdline), limit)
	}
	mp, err := MPTable(cfg.CPUs)
	if err != nil {
		return nil, err
	}
	acpi, err := ACPITables(cfg.CPUs)
	if err != nil {
		return nil, err
	}
	bp, err := bootParams(mem, cfg)
	if err != nil {
		return nil, err
	}
	gdt := GDT()
	tables := make([]byte, 0, len(gdt)*8)
	for _, e := range gdt {
		tables = le.AppendUint64(tables, e)
	}
	for _, w := range []struct {
		what string
		addr uint64
		b    []byte
	}{
		{"GDT", GDTAddr, tables},
		{"IDT", IDTAddr, make([]byte, 8)},
		{"page tables", PML4Addr, pageTables()},
		{"command line", CmdlineAddr, append([]byte(cfg.Cmdline), 0)},
		{"MP table", MPTableAddr, mp},
		{"ACPI tables", ACPIAddr, acpi},
		{"boot_params", BootParamsAddr, bp},
	} {
		if err := mem.WriteAt(w.b, w.addr); err != nil {
			return nil, fmt.Errorf("boot: %s: %w", w.what, err)
		}
	}
	data := segment(gdt, SelectorData)
	return &CPUState{
		RIP: k.Entry, RSP: BootStackAddr, RBP: BootStackAddr, RSI: BootParamsAddr,
		RFLAGS: 2, // reserved bit 1; IF clear
		CR0:    CR0PE | CR0ET | CR0PG, CR3: PML4Addr, CR4: CR4PAE, EFER: EFERLME | EFERLMA,
		GDTBase: GDTAddr, GDTLimit: uint16(len(gdt)*8 - 1),
		IDTBase: IDTAddr, IDTLimit: 7, // one (empty) gate: any exception triple-faults
		CS: segment(gdt, SelectorCode),
		DS: data, ES: data, FS: data, GS: data, SS: data,
		TR: segment(gdt, SelectorTSS),
	}, nil
}

// pageTables returns the PML4, the PDPT and IdentityMapEnd/1 GiB page
// directories, contiguous from PML4Addr, identity-mapping [0, IdentityMapEnd)
// with 2 MiB pages: enough for the kernel's 64-bit entry, which soon
// installs its own tables.
func pageTables() []byte {
	le := binary.LittleEndian
	const present, writable, huge = 1, 2, 0x80
	const pds = IdentityMapEnd >> 30
	b := make([]byte, PDAddr-PML4Addr+pds*pageSize)
	le.PutUint64(b, PDPTAddr|present|writable)
	for i := range uint64(pds) {
		le.PutUint64(b[PDPTAddr-PML4Addr+i*8:], (PDAddr+i*pageSize)|present|writable)
	}
	for i := range uint64(pds * 512) {
		le.PutUint64(b[PDAddr-PML4Addr+i*8:], i<<21|present|writable|huge)
	}
	return b
}

// bootParams returns the zero page: a bzImage's setup header (or, for a
// vmlinux, the few header fields the kernel reads), the loader's fields,
// and the e820 map.
func bootParams(mem *guestmem.Memory, cfg Config) ([]byte, error) {
	le := binary.LittleEndian
	bp := make([]byte, bootParamsSize)
	k := cfg.Kernel
	if k.SetupHeader != nil {
		copy(bp[hdrSetupSects:setupHeaderLimit], k.SetupHeader)
	} else {
		le.PutUint16(bp[hdrBootFlag:], bootFlag)
		copy(bp[hdrMagic:], headerMagic)
		le.PutUint16(bp[hdrVersion:], minProtocol)
		le.PutUint32(bp[hdrKernelAlign:], 0x100_0000)
	}
	le.PutUint32(bp[hdrCmdlineSize:], uint32(k.cmdlineMax()))
	bp[hdrTypeOfLoader] = 0xff // no assigned boot loader id
	bp[hdrLoadflags] |= loadedHigh | canUseHeap
	le.PutUint16(bp[hdrHeapEndPtr:], 0xfe00)
	le.PutUint32(bp[hdrCmdLinePtr:], CmdlineAddr)
	le.PutUint32(bp[bpExtCmdLinePtr:], 0)
	if cfg.InitrdSize > 0 {
		le.PutUint32(bp[hdrRamdiskImage:], uint32(cfg.InitrdAddr))
		le.PutUint32(bp[hdrRamdiskSize:], uint32(cfg.InitrdSize))
		le.PutUint32(bp[bpExtRamdiskImage:], uint32(cfg.InitrdAddr>>32))
		le.PutUint32(bp[bpExtRamdiskSize:], uint32(cfg.InitrdSize>>32))
	}
	le.PutUint64(bp[bpACPIRSDPAddr:], ACPIAddr)
	e820, err := E820(mem.Regions())
	if err != nil {
		return nil, fmt.Errorf("boot: %w", err)
	}
	bp[bpE820Entries] = uint8(len(e820))
	for i, e := range e820 {
		off := bpE820Table + i*e820EntrySize
		le.PutUint64(bp[off:], e.Addr)
		le.PutUint64(bp[off+8:], e.Size)
		le.PutUint32(bp[off+16:], uint32(e.Type))
	}
	return bp, nil
}
