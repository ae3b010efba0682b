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
	InitrdAddr uint64 // 0: no initramfs
	InitrdSize uint64
	CPUs       int
}

// Segment is a segment register's hidden state, as KVM takes it (the limit
// already scaled by the granularity bit).
type Segment struct {
	Base                      uint64
	Limit                     uint32
	Selector                  uint16
	Type                      uint8
	Present, DPL, DB, S, L, G uint8
	AVL                       uint8
}

// CPUState is the boot CPU's state at the kernel's 64-bit entry.
type CPUState struct {
	RIP, RSP, RBP, RSI, RFLAGS uint64
	CR0, CR3, CR4, EFER        uint64
	GDTBase, IDTBase           uint64
	GDTLimit, IDTLimit         uint16
	CS, DS, ES, FS, GS, SS, TR Segment
}

// Control register and EFER bits for 64-bit mode.
const (
	cr0PE   = 1 << 0
	cr0ET   = 1 << 4
	cr0PG   = 1 << 31
	cr4PAE  = 1 << 5
	eferLME = 1 << 8
	eferLMA = 1 << 10
)

// The GDT: null, 64-bit code, data, and a TSS (KVM wants a usable TR).
const (
	SelectorCode = 0x08
	SelectorData = 0x10
	SelectorTSS  = 0x18
)

// gdtEntry encodes a descriptor from the access byte and flags nibble
// (flags: bits 12-15 of the 16-bit value, access: bits 0-7).
func gdtEntry(flags uint16, base, limit uint32) uint64 {
	return uint64(base&0xff00_0000)<<32 |
		uint64(flags&0xf0ff)<<40 |
		uint64(limit&0x000f_0000)<<32 |
		uint64(base&0x00ff_ffff)<<16 |
		uint64(limit&0x0000_ffff)
}

// GDT returns the descriptor table capsa installs.
func GDT() []uint64 {
	return []uint64{
		0,
		gdtEntry(0xa09b, 0, 0xfffff), // code: G, L, present, DPL 0, execute/read, accessed
		gdtEntry(0xc093, 0, 0xfffff), // data: G, D/B, present, DPL 0, read/write, accessed
		gdtEntry(0x808b, 0, 0xfffff), // TSS: G, present, busy 64-bit TSS
	}
}

// SegmentFromGDT decodes descriptor entry as the hidden segment state that
// loading selector would produce, so registers and GDT cannot disagree.
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

// E820 returns the memory map for RAM laid out as regions: base memory below
// the EBDA, the BIOS area reserved (it holds the MP table), RAM from 1 MiB to
// the end of the first region, then every other region as RAM.
func E820(regions []guestmem.Region) ([]E820Entry, error) {
	if len(regions) == 0 || regions[0].GPA != 0 || regions[0].End() <= HighMemStart {
		return nil, errors.New("e820: guest RAM must start at 0 and extend past 1 MiB")
	}
	m := []E820Entry{
		{0, EBDAStart, E820RAM},
		{MPTableAddr, BIOSEnd - MPTableAddr, E820Reserved},
		{HighMemStart, regions[0].End() - HighMemStart, E820RAM},
	}
	for _, r := range regions[1:] {
		m = append(m, E820Entry{r.GPA, uint64(len(r.Host)), E820RAM})
	}
	if len(m) > e820MaxEntries {
		return nil, fmt.Errorf("e820: %d entries, boot_params holds %d", len(m), e820MaxEntries)
	}
	return m, nil
}

// Setup writes the boot structures and returns the boot CPU's state.
func Setup(mem *guestmem.Memory, cfg Config) (*CPUState, error) {
	k := cfg.Kernel
	if k == nil {
		return nil, errors.New("boot: no kernel loaded")
	}
	if err := writeGDT(mem); err != nil {
		return nil, err
	}
	if err := writePageTables(mem); err != nil {
		return nil, err
	}
	if err := writeCmdline(mem, k, cfg.Cmdline); err != nil {
		return nil, err
	}
	mp, err := MPTable(cfg.CPUs)
	if err != nil {
		return nil, err
	}
	if err := mem.WriteAt(mp, MPTableAddr); err != nil {
		return nil, fmt.Errorf("boot: MP table: %w", err)
	}
	if err := writeBootParams(mem, cfg); err != nil {
		return nil, err
	}
	gdt := GDT()
	data := SegmentFromGDT(gdt[2], SelectorData)
	return &CPUState{
		RIP: k.Entry, RSP: BootStackAddr, RBP: BootStackAddr, RSI: BootParamsAddr, RFLAGS: 2,
		CR0: cr0PE | cr0ET | cr0PG, CR3: PML4Addr, CR4: cr4PAE, EFER: eferLME | eferLMA,
		GDTBase: GDTAddr, GDTLimit: uint16(len(gdt)*8 - 1),
		IDTBase: IDTAddr, IDTLimit: 7,
		CS: SegmentFromGDT(gdt[1], SelectorCode),
		DS: data, ES: data, FS: data, GS: data, SS: data,
		TR: SegmentFromGDT(gdt[3], SelectorTSS),
	}, nil
}

func writeGDT(mem *guestmem.Memory) error {
	for i, e := range GDT() {
		if err := mem.PutUint64(GDTAddr+uint64(i)*8, e); err != nil {
			return fmt.Errorf("boot: GDT: %w", err)
		}
	}
	if err := mem.Zero(IDTAddr, 8); err != nil {
		return fmt.Errorf("boot: IDT: %w", err)
	}
	return nil
}

// writePageTables identity-maps the first 1 GiB with 2 MiB pages: enough
// for the kernel's 64-bit entry, which builds its own tables at once.
func writePageTables(mem *guestmem.Memory) error {
	const present, writable, huge = 1, 2, 0x80
	err := errors.Join(
		mem.PutUint64(PML4Addr, PDPTAddr|present|writable),
		mem.PutUint64(PDPTAddr, PDAddr|present|writable),
	)
	for i := uint64(0); i < 512 && err == nil; i++ {
		err = mem.PutUint64(PDAddr+i*8, i<<21|present|writable|huge)
	}
	if err != nil {
		return fmt.Errorf("boot: page tables: %w", err)
	}
	return nil
}

func cmdlineMax(k *Kernel) uint64 {
	if k.Format == FormatBzImage {
		hdr := k.SetupHeader
		v := binary.LittleEndian.Uint16(hdr[hdrVersion-hdrSetupSects:])
		if n := binary.LittleEndian.Uint32(hdr[hdrCmdlineSize-hdrSetupSects:]); v >= 0x0206 && n > 0 {
			return uint64(min(n, CmdlineAddr)) // never past the next structure
		}
	}
	return DefaultCmdlineMax - 1
}

func writeCmdline(mem *guestmem.Memory, k *Kernel, cmdline string) error {
	if limit := cmdlineMax(k); uint64(len(cmdline)) > limit {
		return fmt.Errorf("boot: kernel command line is %d bytes, the kernel accepts at most %d", len(cmdline), limit)
	}
	b := append([]byte(cmdline), 0)
	if err := mem.WriteAt(b, CmdlineAddr); err != nil {
		return fmt.Errorf("boot: command line: %w", err)
	}
	return nil
}

func writeBootParams(mem *guestmem.Memory, cfg Config) error {
	bp := make([]byte, bootParamsSize)
	le := binary.LittleEndian
	k := cfg.Kernel
	if k.SetupHeader != nil {
		copy(bp[hdrSetupSects:], k.SetupHeader)
	} else {
		le.PutUint16(bp[hdrBootFlag:], 0xaa55)
		copy(bp[hdrMagic:], "HdrS")
		le.PutUint16(bp[hdrVersion:], minProtocol)
		le.PutUint32(bp[hdrKernelAlign:], 0x0100_0000)
		le.PutUint32(bp[hdrCmdlineSize:], DefaultCmdlineMax-1)
	}
	bp[hdrTypeOfLoader] = 0xff // an undefined boot loader
	bp[hdrLoadflags] |= loadedHigh | canUseHeap
	le.PutUint16(bp[hdrHeapEndPtr:], 0xfe00)
	le.PutUint32(bp[hdrCmdLinePtr:], CmdlineAddr)
	if cfg.InitrdSize > 0 {
		le.PutUint32(bp[hdrRamdiskImage:], uint32(cfg.InitrdAddr))
		le.PutUint32(bp[hdrRamdiskSize:], uint32(cfg.InitrdSize))
		le.PutUint32(bp[bpExtRamdiskImage:], uint32(cfg.InitrdAddr>>32))
		le.PutUint32(bp[bpExtRamdiskSize:], uint32(cfg.InitrdSize>>32))
	}
	e820, err := E820(mem.Regions())
	if err != nil {
		return fmt.Errorf("boot: %w", err)
	}
	bp[bpE820Entries] = uint8(len(e820))
	for i, e := range e820 {
		off := bpE820Table + i*20
		le.PutUint64(bp[off:], e.Addr)
		le.PutUint64(bp[off+8:], e.Size)
		le.PutUint32(bp[off+16:], uint32(e.Type))
	}
	if err := mem.WriteAt(bp, BootParamsAddr); err != nil {
		return fmt.Errorf("boot: boot_params: %w", err)
	}
	return nil
}
