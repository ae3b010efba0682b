// Package boot loads a Linux kernel and initramfs into guest memory and lays
// out what the x86 64-bit boot protocol expects (Documentation/arch/x86/
// boot.rst): boot_params (the "zero page") with an e820 map, the command
// line, identity-mapped page tables, a GDT, and the vCPUs described twice:
// in an MP table (for kernels without ACPI, capsa's own) and in ACPI tables
// (for kernels that read only those, distributions'; see ACPITables).
//
// It knows nothing about KVM: it writes guest memory and returns the boot
// CPU's initial state as plain data, which the vmm package turns into KVM
// registers. Every input is checked: a malformed kernel gives an error,
// never a panic, and a kernel that fails to load leaves guest memory as it
// was.
//
// The guest physical layout below 1 MiB:
//
//	0x00500  GDT (6 entries)          0x0b000  4 page directories (to 0xf000)
//	0x00540  IDT (empty)              0x20000  command line
//	0x07000  boot_params              0x9fc00  end of the RAM given to the guest
//	0x08ff0  boot stack (grows down)  0xe0000  ACPI tables (e820 reserved)
//	0x09000  PML4                     0xf0000  MP table (e820 reserved)
//	0x0a000  PDPT                     0x100000 kernel (HighMemBase) and up
package boot

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// The guest physical layout.
const (
	GDTAddr        = 0x500
	IDTAddr        = 0x540
	BootParamsAddr = 0x7000
	BootStackAddr  = 0x8ff0
	PML4Addr       = 0x9000
	PDPTAddr       = 0xa000
	PDAddr         = 0xb000 // IdentityMapEnd/1 GiB consecutive page directories
	CmdlineAddr    = 0x20000
	EBDAStart      = 0x9fc00 // base memory ends here, as on a PC with a 1 KiB EBDA
	MPTableAddr    = 0xf0000 // in the BIOS area, which Linux scans for "_MP_"
	BIOSEnd        = 0x100000
	// HighMemBase is the first address a kernel may use: everything below
	// belongs to the boot structures. A bzImage is loaded here.
	HighMemBase = 0x100000
	// IdentityMapEnd is the end of the identity mapping the page tables set
	// up. The kernel, its decompression area, boot_params and the command
	// line must all lie below it.
	IdentityMapEnd = 4 << 30
	// DefaultCmdlineMax is COMMAND_LINE_SIZE on x86 (terminating NUL
	// included), the limit when the kernel does not state its own.
	DefaultCmdlineMax = 2048
)

// Format is a kernel image format.
type Format int

// Kernel image formats.
const (
	FormatELF     Format = iota + 1 // an uncompressed vmlinux
	FormatBzImage                   // a compressed bzImage
)

func (f Format) String() string {
	switch f {
	case FormatELF:
		return "vmlinux ELF"
	case FormatBzImage:
		return "bzImage"
	}
	return fmt.Sprintf("Format(%d)", int(f))
}

// Kernel is a kernel loaded into guest memory.
type Kernel struct {
	Format Format
	Entry  uint64 // 64-bit entry point (guest physical), entered with RSI = boot_params
	End    uint64 // first guest address above everything the kernel uses
	// PVHEntry is the 32-bit PVH entry point from a vmlinux's "Xen" ELF
	// note (XEN_ELFNOTE_PHYS32_ENTRY), or 0. Parsed only; capsa enters at
	// Entry.
	PVHEntry uint64
	// SetupHeader is a bzImage's setup header: the image bytes from 0x1f1
	// up to 0x202 + the byte at 0x201, copied into boot_params at the same
	// offset. Nil for an ELF.
	SetupHeader []byte
}

// Setup header fields, as offsets into the image (= offsets into boot_params).
const (
	hdrSetupSects     = 0x1f1
	hdrBootFlag       = 0x1fe
	hdrJump           = 0x200
	hdrMagic          = 0x202
	hdrVersion        = 0x206
	hdrTypeOfLoader   = 0x210
	hdrLoadflags      = 0x211
	hdrRamdiskImage   = 0x218
	hdrRamdiskSize    = 0x21c
	hdrHeapEndPtr     = 0x224
	hdrCmdLinePtr     = 0x228
	hdrInitrdAddrMax  = 0x22c
	hdrKernelAlign    = 0x230
	hdrRelocatable    = 0x234
	hdrXloadflags     = 0x236
	hdrCmdlineSize    = 0x238
	hdrPrefAddress    = 0x258
	hdrInitSize       = 0x260
	hdrMinEnd         = 0x264 // the header fields capsa reads end here
	setupHeaderLimit  = 0x290 // boot_params has room for the header up to here
	bootParamsSize    = 0x1000
	bpACPIRSDPAddr    = 0x070 // where the RSDP is, so the kernel need not scan for it
	bpExtRamdiskImage = 0x0c0
	bpExtRamdiskSize  = 0x0c4
	bpExtCmdLinePtr   = 0x0c8
	bpE820Entries     = 0x1e8
	bpE820Table       = 0x2d0
	e820EntrySize     = 20
	e820MaxEntries    = 128

	bootFlag             = 0xaa55
	headerMagic          = "HdrS"
	xlfKernel64          = 1 << 0
	loadedHigh           = 1 << 0
	canUseHeap           = 1 << 7
	minProtocol          = 0x020c // 2.12: xloadflags and the 64-bit entry
	bzImage64EntryOffset = 0x200
	defaultInitrdMax     = 0x37ff_ffff // boot.rst, when the header gives none
	vmlinuxInitrdMax     = 0x7fff_ffff // what x86-64 kernels put in initrd_addr_max
	pageSize             = 0x1000
)

// xenElfNotePhys32Entry is the PVH entry note type in a "Xen" ELF note.
const xenElfNotePhys32Entry = 18

// LoadKernel detects the image's format (vmlinux ELF or bzImage), checks it
// and loads it into mem. On error mem is left untouched.
func LoadKernel(mem *guestmem.Memory, image []byte) (*Kernel, error) {
	switch {
	case mem == nil:
		return nil, errors.New("boot: no guest memory")
	case len(image) >= 4 && string(image[:4]) == elf.ELFMAG:
		return loadELF(mem, image)
	case len(image) >= hdrMagic+4 && string(image[hdrMagic:hdrMagic+4]) == headerMagic:
		return loadBzImage(mem, image)
	case len(image) < hdrMagic+4:
		return nil, fmt.Errorf("kernel image is %d bytes: too short for an ELF or bzImage header", len(image))
	}
	return nil, errors.New(`kernel image is neither a vmlinux ELF nor a bzImage (no ELF magic, no "HdrS" at 0x202)`)
}

// ELF64 header and program header layout.
const (
	ehdrSize   = 64
	phdrSize   = 56
	eiClass    = 4
	eiData     = 5
	eType      = 16
	eMachine   = 18
	eEntry     = 24
	ePhoff     = 32
	ePhentsize = 54
	ePhnum     = 56
)

// prog is one program header.
type prog struct {
	typ                       elf.ProgType
	off, paddr, filesz, memsz uint64
}

func loadELF(mem *guestmem.Memory, image []byte) (*Kernel, error) {
	le := binary.LittleEndian
	if len(image) < ehdrSize {
		return nil, fmt.Errorf("vmlinux: ELF header truncated: %d bytes, need %d", len(image), ehdrSize)
	}
	if c := elf.Class(image[eiClass]); c != elf.ELFCLASS64 {
		return nil, fmt.Errorf("vmlinux: ELF class %v: capsa boots 64-bit x86-64 kernels", c)
	}
	if d := elf.Data(image[eiData]); d != elf.ELFDATA2LSB {
		return nil, fmt.Errorf("vmlinux: ELF data encoding %v, want little-endian", d)
	}
	if m := elf.Machine(le.Uint16(image[eMachine:])); m != elf.EM_X86_64 {
		return nil, fmt.Errorf("vmlinux: machine %v: capsa boots x86-64 kernels", m)
	}
	if t := elf.Type(le.Uint16(image[eType:])); t != elf.ET_EXEC {
		return nil, fmt.Errorf("vmlinux: ELF type %v, want an executable (ET_EXEC)", t)
	}
	phoff, phnum := le.Uint64(image[ePhoff:]), uint64(le.Uint16(image[ePhnum:]))
	if n := le.Uint16(image[ePhentsize:]); n != phdrSize {
		return nil, fmt.Errorf("vmlinux: program header size %d, want %d", n, phdrSize)
	}
	if phnum == 0 {
		return nil, errors.New("vmlinux: no program headers")
	}
	if phoff > uint64(len(image)) || phnum*phdrSize > uint64(len(image))-phoff {
		return nil, fmt.Errorf("vmlinux: program header table truncated: %d entries at %#x in a %d-byte file", phnum, phoff, len(image))
	}
	k := &Kernel{Format: FormatELF, Entry: le.Uint64(image[eEntry:])}
	// Check every segment before writing any, so a bad image writes nothing.
	var loads []prog
	entryLoaded := false
	for i := range phnum {
		h := image[phoff+i*phdrSize:]
		p := prog{elf.ProgType(le.Uint32(h)), le.Uint64(h[8:]), le.Uint64(h[24:]), le.Uint64(h[32:]), le.Uint64(h[40:])}
		if p.typ == elf.PT_NOTE && k.PVHEntry == 0 {
			k.PVHEntry = pvhEntry(image, p)
		}
		if p.typ != elf.PT_LOAD {
			continue
		}
		if err := checkSegment(mem, image, p); err != nil {
			return nil, fmt.Errorf("vmlinux: segment %d: %w", i, err)
		}
		if p.memsz == 0 {
			continue
		}
		loads = append(loads, p)
		k.End = max(k.End, p.paddr+p.memsz)
		entryLoaded = entryLoaded || k.Entry >= p.paddr && k.Entry-p.paddr < p.memsz
	}
	switch {
	case len(loads) == 0:
		return nil, errors.New("vmlinux: no loadable segments")
	case k.Entry == 0:
		return nil, errors.New("vmlinux: entry point is zero")
	case !entryLoaded:
		return nil, fmt.Errorf("vmlinux: entry point %#x is in none of the loaded segments", k.Entry)
	}
	for _, p := range loads {
		dst, _ := mem.Slice(p.paddr, p.memsz) // checked above
		n := copy(dst, image[p.off:p.off+p.filesz])
		clear(dst[n:])
	}
	return k, nil
}

// checkSegment reports what, if anything, is wrong with PT_LOAD segment p.
func checkSegment(mem *guestmem.Memory, image []byte, p prog) error {
	switch {
	case p.filesz > p.memsz:
		return fmt.Errorf("file size %#x exceeds memory size %#x", p.filesz, p.memsz)
	case p.off > uint64(len(image)) || p.filesz > uint64(len(image))-p.off:
		return fmt.Errorf("%#x bytes at file offset %#x lie outside the %d-byte file", p.filesz, p.off, len(image))
	case p.memsz == 0:
		return nil
	case p.paddr+p.memsz < p.paddr:
		return fmt.Errorf("address %#x + size %#x overflows", p.paddr, p.memsz)
	case p.paddr < HighMemBase:
		return fmt.Errorf("loads at %#x, below 1 MiB where the boot structures live", p.paddr)
	case !mem.Contains(p.paddr, p.memsz):
		return fmt.Errorf("[%#x, %#x) is outside guest RAM (%d MiB)", p.paddr, p.paddr+p.memsz, mem.Size()>>20)
	case p.paddr+p.memsz > IdentityMapEnd:
		return fmt.Errorf("[%#x, %#x) is above the identity-mapped first %d GiB", p.paddr, p.paddr+p.memsz, IdentityMapEnd>>30)
	}
	return nil
}

// pvhEntry returns the PVH entry point from a PT_NOTE segment, or 0 when it
// has none or is malformed (the note is optional). Notes are 4-byte aligned
// records: namesz, descsz, type, name, desc.
func pvhEntry(image []byte, p prog) uint64 {
	le := binary.LittleEndian
	if p.off > uint64(len(image)) || p.filesz > uint64(len(image))-p.off {
		return 0
	}
	b := image[p.off : p.off+p.filesz]
	align := func(n uint32) uint64 { return (uint64(n) + 3) &^ 3 }
	for len(b) >= 12 {
		namesz, descsz, typ := le.Uint32(b), le.Uint32(b[4:]), le.Uint32(b[8:])
		rest := b[12:]
		if align(namesz) > uint64(len(rest)) || align(descsz) > uint64(len(rest))-align(namesz) {
			return 0
		}
		name := rest[:namesz]
		desc := rest[align(namesz) : align(namesz)+uint64(descsz)]
		if typ == xenElfNotePhys32Entry && string(bytes.TrimRight(name, "\x00")) == "Xen" {
			switch len(desc) {
			case 4:
				return uint64(le.Uint32(desc))
			case 8:
				return le.Uint64(desc)
			}
		}
		b = rest[align(namesz)+align(descsz):]
	}
	return 0
}

// loadBzImage loads a bzImage's protected-mode kernel at HighMemBase, the
// classic address every bzImage accepts, rather than at pref_address: the
// kernel's own startup code moves itself to its decompression area at
// max(pref_address, HighMemBase aligned up to kernel_alignment), so capsa
// only checks that this area (init_size bytes) fits in RAM.
func loadBzImage(mem *guestmem.Memory, image []byte) (*Kernel, error) {
	le := binary.LittleEndian
	if len(image) < hdrMinEnd {
		return nil, fmt.Errorf("bzImage: setup header truncated: %d bytes, need %d", len(image), hdrMinEnd)
	}
	if le.Uint16(image[hdrBootFlag:]) != bootFlag {
		return nil, fmt.Errorf("bzImage: boot sector signature %#04x at 0x1fe, want 0xaa55", le.Uint16(image[hdrBootFlag:]))
	}
	if string(image[hdrMagic:hdrMagic+4]) != headerMagic {
		return nil, errors.New(`bzImage: no "HdrS" setup header magic at 0x202`)
	}
	if v := le.Uint16(image[hdrVersion:]); v < minProtocol {
		return nil, fmt.Errorf("bzImage: boot protocol %d.%02d is too old (need 2.12 or later)", v>>8, v&0xff)
	}
	if le.Uint16(image[hdrXloadflags:])&xlfKernel64 == 0 {
		return nil, errors.New("bzImage: 32-bit-only kernel: XLF_KERNEL_64 is not set, there is no 64-bit entry point")
	}
	sects := int(image[hdrSetupSects])
	if sects == 0 {
		sects = 4
	}
	pmOff := (sects + 1) * 512
	if pmOff >= len(image) {
		return nil, fmt.Errorf("bzImage: %d setup sectors run past the end of the %d-byte image", sects, len(image))
	}
	hdrEnd := 0x202 + int(image[hdrJump+1])
	if hdrEnd < hdrMinEnd || hdrEnd > setupHeaderLimit { // and so below pmOff >= 0x400
		return nil, fmt.Errorf("bzImage: setup header ends at %#x (0x202 + byte at 0x201), want %#x..%#x", hdrEnd, hdrMinEnd, setupHeaderLimit)
	}
	pm := image[pmOff:]
	if len(pm) <= bzImage64EntryOffset {
		return nil, fmt.Errorf("bzImage: protected-mode kernel is %d bytes, too short for its 64-bit entry at +0x200", len(pm))
	}
	initSize := uint64(le.Uint32(image[hdrInitSize:]))
	if initSize == 0 {
		return nil, errors.New("bzImage: init_size is zero")
	}
	base := le.Uint64(image[hdrPrefAddress:])
	if align := uint64(le.Uint32(image[hdrKernelAlign:])); image[hdrRelocatable] != 0 {
		if align == 0 || align&(align-1) != 0 {
			return nil, fmt.Errorf("bzImage: kernel_alignment %#x is not a power of two", align)
		}
		base = max(base, (HighMemBase+align-1)&^(align-1))
	}
	end := max(HighMemBase+uint64(len(pm)), base+initSize)
	switch {
	case base < HighMemBase:
		return nil, fmt.Errorf("bzImage: decompresses at %#x, below 1 MiB where the boot structures live", base)
	case base+initSize < base:
		return nil, fmt.Errorf("bzImage: pref_address %#x + init_size %#x overflows", base, initSize)
	case !mem.Contains(HighMemBase, end-HighMemBase):
		return nil, fmt.Errorf("bzImage: kernel needs guest RAM up to %#x (%d-byte image at %#x, %#x bytes to decompress at %#x), beyond the end of low RAM at %#x",
			end, len(pm), HighMemBase, initSize, base, mem.LowEnd())
	case end > IdentityMapEnd:
		return nil, fmt.Errorf("bzImage: kernel needs RAM up to %#x, above the identity-mapped first %d GiB", end, IdentityMapEnd>>30)
	}
	if err := mem.WriteAt(pm, HighMemBase); err != nil {
		return nil, fmt.Errorf("bzImage: %w", err) // unreachable: checked above
	}
	return &Kernel{
		Format:      FormatBzImage,
		Entry:       HighMemBase + bzImage64EntryOffset,
		End:         end,
		SetupHeader: append([]byte(nil), image[hdrSetupSects:hdrEnd]...),
	}, nil
}

// hdr32 reads the 32-bit setup header field at boot_params offset off, or
// 0 when the kernel has no setup header or it is too short.
func (k *Kernel) hdr32(off int) uint32 {
	if i := off - hdrSetupSects; k.SetupHeader != nil && i+4 <= len(k.SetupHeader) {
		return binary.LittleEndian.Uint32(k.SetupHeader[i:])
	}
	return 0
}

// initrdAddrMax is the highest address the kernel accepts an initramfs byte
// at: initrd_addr_max from a bzImage's header; for a vmlinux, which has no
// header, the value x86-64 kernels advertise there.
func (k *Kernel) initrdAddrMax() uint64 {
	if k.Format != FormatBzImage {
		return vmlinuxInitrdMax
	}
	if v := k.hdr32(hdrInitrdAddrMax); v != 0 {
		return uint64(v)
	}
	return defaultInitrdMax
}

// cmdlineMax is the longest command line the kernel takes, NUL excluded:
// a bzImage's cmdline_size, else COMMAND_LINE_SIZE-1; never more than fits
// between CmdlineAddr and the end of base memory.
func (k *Kernel) cmdlineMax() uint64 {
	n := uint64(DefaultCmdlineMax - 1)
	if v := k.hdr32(hdrCmdlineSize); k.Format == FormatBzImage && v != 0 {
		n = uint64(v) // the header is protocol 2.12+, so cmdline_size (2.06+) is valid
	}
	return min(n, EBDAStart-CmdlineAddr-1)
}

// LoadInitrd copies the initramfs to the highest page-aligned address at
// which it lies entirely below both the top of low RAM and the kernel's
// initrd_addr_max, and above the kernel. It returns the address and size
// for Config.
func LoadInitrd(mem *guestmem.Memory, k *Kernel, initrd []byte) (addr, size uint64, err error) {
	if mem == nil || k == nil {
		return 0, 0, errors.New("initramfs: no guest memory or no kernel loaded")
	}
	size = uint64(len(initrd))
	if size == 0 {
		return 0, 0, errors.New("initramfs is empty")
	}
	top := min(mem.LowEnd(), k.initrdAddrMax()+1)
	floor := (max(k.End, HighMemBase) + pageSize - 1) &^ (pageSize - 1)
	if size > top || k.End > top || (top-size)&^(pageSize-1) < floor {
		return 0, 0, fmt.Errorf("initramfs of %d bytes does not fit between the kernel's end (%#x) and %#x: give the VM more memory", size, floor, top)
	}
	addr = (top - size) &^ (pageSize - 1)
	if err := mem.WriteAt(initrd, addr); err != nil {
		return 0, 0, fmt.Errorf("initramfs: %w", err)
	}
	return addr, size, nil
}
