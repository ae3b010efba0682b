// Package boot loads a Linux kernel and initramfs into guest memory and lays
// out what the x86 64-bit boot protocol expects: boot_params (the "zero
// page") with an e820 map, the command line, identity-mapped page tables, a
// GDT, and an MP table describing the vCPUs.
//
// It knows nothing about KVM: it writes guest memory and returns the initial
// CPU state as plain data, which the vmm package turns into KVM registers.
// Every input is checked: a malformed kernel gives an error, never a panic
// or a write outside guest RAM.
package boot

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// The guest physical layout below 1 MiB, and where kernels load.
const (
	GDTAddr        = 0x500
	IDTAddr        = 0x520
	BootParamsAddr = 0x7000
	BootStackAddr  = 0x8ff0
	PML4Addr       = 0x9000
	PDPTAddr       = 0xa000
	PDAddr         = 0xb000
	CmdlineAddr    = 0x20000
	EBDAStart      = 0x9fc00
	MPTableAddr    = 0xf0000 // in the BIOS area Linux scans for the MP floating pointer
	BIOSEnd        = 0x100000
	// HighMemStart is where the kernel goes: nothing of a kernel may load
	// below it, where the boot structures live.
	HighMemStart = 0x100000
	// DefaultCmdlineMax is COMMAND_LINE_SIZE on x86, used when the kernel
	// does not state its own limit.
	DefaultCmdlineMax = 2048
)

// Format is a kernel image format.
type Format int

// Kernel image formats.
const (
	FormatELF Format = iota + 1
	FormatBzImage
)

func (f Format) String() string {
	switch f {
	case FormatELF:
		return "vmlinux ELF"
	case FormatBzImage:
		return "bzImage"
	}
	return "unknown"
}

// Kernel is a kernel loaded into guest memory.
type Kernel struct {
	Format Format
	Entry  uint64 // 64-bit entry point (guest physical)
	End    uint64 // first guest address above everything the kernel uses
	// PVHEntry is the 32-bit PVH entry point from the ELF note, or 0.
	PVHEntry uint64
	// SetupHeader is a bzImage's setup header (boot_params offset 0x1f1
	// on), copied into boot_params; nil for an ELF.
	SetupHeader []byte
}

// setup header fields, as offsets into the image (= offsets into boot_params).
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
	hdrXloadflags     = 0x236
	hdrCmdlineSize    = 0x238
	hdrPrefAddress    = 0x258
	hdrInitSize       = 0x260
	hdrMinEnd         = 0x264 // the header fields capsa reads end here
	setupHeaderLimit  = 0x290 // boot_params has room for the header up to here
	bootParamsSize    = 0x1000
	bpE820Entries     = 0x1e8
	bpExtRamdiskImage = 0x0c0
	bpExtRamdiskSize  = 0x0c4
	bpExtCmdLinePtr   = 0x0c8
	bpE820Table       = 0x2d0
	e820MaxEntries    = 128

	xlfKernel64          = 1 << 0
	loadedHigh           = 1 << 0
	canUseHeap           = 1 << 7
	minProtocol          = 0x020c // 2.12: xloadflags and the 64-bit entry
	bzImage64EntryOffset = 0x200
	defaultInitrdMax     = 0x37ff_ffff
)

// xenElfNotePhys32Entry is the PVH entry note type in a "Xen" ELF note.
const xenElfNotePhys32Entry = 18

var errTruncated = errors.New("truncated")

// LoadKernel detects the image's format and loads it into mem.
func LoadKernel(mem *guestmem.Memory, image []byte) (*Kernel, error) {
	switch {
	case len(image) >= 4 && bytes.Equal(image[:4], []byte(elf.ELFMAG)):
		return loadELF(mem, image)
	case len(image) >= hdrMagic+4 && string(image[hdrMagic:hdrMagic+4]) == "HdrS":
		return loadBzImage(mem, image)
	case len(image) < 64:
		return nil, fmt.Errorf("kernel image is %d bytes: too short to be a kernel", len(image))
	}
	return nil, errors.New("kernel image is neither a vmlinux ELF nor a bzImage (no ELF magic, no \"HdrS\" setup header)")
}

func loadELF(mem *guestmem.Memory, image []byte) (*Kernel, error) {
	f, err := elf.NewFile(bytes.NewReader(image))
	if err != nil {
		return nil, fmt.Errorf("vmlinux: %w", err)
	}
	if f.Class != elf.ELFCLASS64 || f.Machine != elf.EM_X86_64 {
		return nil, fmt.Errorf("vmlinux: %v %v kernel; capsa boots x86-64 kernels", f.Class, f.Machine)
	}
	if f.Type != elf.ET_EXEC {
		return nil, fmt.Errorf("vmlinux: ELF type %v, want an executable", f.Type)
	}
	k := &Kernel{Format: FormatELF, Entry: f.Entry}
	loaded := false
	for i, p := range f.Progs {
		switch p.Type {
		case elf.PT_LOAD:
		case elf.PT_NOTE:
			k.PVHEntry = pvhEntry(image, p)
			continue
		default:
			continue
		}
		if p.Filesz > p.Memsz {
			return nil, fmt.Errorf("vmlinux: segment %d: file size %d exceeds memory size %d", i, p.Filesz, p.Memsz)
		}
		if p.Off > uint64(len(image)) || p.Filesz > uint64(len(image))-p.Off {
			return nil, fmt.Errorf("vmlinux: segment %d: %d bytes at offset %#x lie beyond the %d-byte file", i, p.Filesz, p.Off, len(image))
		}
		if p.Paddr < HighMemStart {
			return nil, fmt.Errorf("vmlinux: segment %d loads at %#x, below 1 MiB where the boot structures live", i, p.Paddr)
		}
		if p.Paddr+p.Memsz < p.Paddr {
			return nil, fmt.Errorf("vmlinux: segment %d: address %#x + size %#x overflows", i, p.Paddr, p.Memsz)
		}
		dst, err := mem.Slice(p.Paddr, p.Memsz)
		if err != nil {
			return nil, fmt.Errorf("vmlinux: segment %d (%#x+%#x) does not fit in guest memory: %w", i, p.Paddr, p.Memsz, err)
		}
		n := copy(dst, image[p.Off:p.Off+p.Filesz])
		clear(dst[n:])
		k.End = max(k.End, p.Paddr+p.Memsz)
		loaded = true
	}
	if !loaded {
		return nil, errors.New("vmlinux: no loadable segments")
	}
	if k.Entry < HighMemStart || k.Entry >= k.End {
		return nil, fmt.Errorf("vmlinux: entry point %#x is outside the loaded kernel [%#x, %#x)", k.Entry, uint64(HighMemStart), k.End)
	}
	return k, nil
}

// pvhEntry returns the PVH entry from a PT_NOTE segment, or 0. Notes are
// 4-byte aligned records: namesz, descsz, type, name, desc.
func pvhEntry(image []byte, p *elf.Prog) uint64 {
	if p.Off > uint64(len(image)) || p.Filesz > uint64(len(image))-p.Off {
		return 0
	}
	b := image[p.Off : p.Off+p.Filesz]
	align := func(n uint32) uint64 { return (uint64(n) + 3) &^ 3 }
	for len(b) >= 12 {
		namesz := binary.LittleEndian.Uint32(b)
		descsz := binary.LittleEndian.Uint32(b[4:])
		typ := binary.LittleEndian.Uint32(b[8:])
		rest := b[12:]
		if align(namesz) > uint64(len(rest)) || align(descsz) > uint64(len(rest))-align(namesz) {
			return 0
		}
		name := rest[:namesz]
		desc := rest[align(namesz) : align(namesz)+uint64(descsz)]
		if typ == xenElfNotePhys32Entry && string(bytes.TrimRight(name, "\x00")) == "Xen" {
			switch len(desc) {
			case 4:
				return uint64(binary.LittleEndian.Uint32(desc))
			case 8:
				return binary.LittleEndian.Uint64(desc)
			}
		}
		b = rest[align(namesz)+align(descsz):]
	}
	return 0
}

func loadBzImage(mem *guestmem.Memory, image []byte) (*Kernel, error) {
	if len(image) < hdrMinEnd {
		return nil, fmt.Errorf("bzImage: setup header %w (%d bytes)", errTruncated, len(image))
	}
	le := binary.LittleEndian
	if le.Uint16(image[hdrBootFlag:]) != 0xaa55 {
		return nil, errors.New("bzImage: boot sector signature 0xAA55 missing")
	}
	if v := le.Uint16(image[hdrVersion:]); v < minProtocol {
		return nil, fmt.Errorf("bzImage: boot protocol %d.%02d is too old (need 2.12 or later)", v>>8, v&0xff)
	}
	if le.Uint16(image[hdrXloadflags:])&xlfKernel64 == 0 {
		return nil, errors.New("bzImage: kernel has no 64-bit entry point (XLF_KERNEL_64 not set)")
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
	if hdrEnd < hdrMinEnd || hdrEnd > pmOff || hdrEnd > setupHeaderLimit {
		return nil, fmt.Errorf("bzImage: setup header length %d is invalid", hdrEnd-hdrSetupSects)
	}
	pm := image[pmOff:]
	k := &Kernel{
		Format:      FormatBzImage,
		Entry:       HighMemStart + bzImage64EntryOffset,
		SetupHeader: append([]byte(nil), image[hdrSetupSects:hdrEnd]...),
	}
	if uint64(len(pm)) <= bzImage64EntryOffset {
		return nil, fmt.Errorf("bzImage: protected-mode kernel is %d bytes, too short for its 64-bit entry", len(pm))
	}
	if err := mem.WriteAt(pm, HighMemStart); err != nil {
		return nil, fmt.Errorf("bzImage: %d-byte kernel does not fit in guest memory at %#x: %w", len(pm), HighMemStart, err)
	}
	// The kernel decompresses itself in place, using init_size bytes from
	// its preferred address (or the load address).
	base := max(le.Uint64(image[hdrPrefAddress:]), HighMemStart)
	initSize := uint64(le.Uint32(image[hdrInitSize:]))
	k.End = max(HighMemStart+uint64(len(pm)), base+initSize)
	if base+initSize < base || !mem.Contains(base, initSize) {
		return nil, fmt.Errorf("bzImage: needs %d bytes at %#x to decompress, beyond guest memory", initSize, base)
	}
	return k, nil
}

// initrdAddrMax is the highest address the kernel accepts an initramfs at.
func (k *Kernel) initrdAddrMax() uint64 {
	if k.Format == FormatBzImage {
		if v := binary.LittleEndian.Uint32(k.SetupHeader[hdrInitrdAddrMax-hdrSetupSects:]); v != 0 {
			return uint64(v)
		}
		return defaultInitrdMax
	}
	// A vmlinux carries no setup header; 6.12 kernels advertise 0x7fffffff.
	return 0x7fff_ffff
}

// LoadInitrd copies the initramfs to the highest page-aligned address below
// both the top of low RAM and the kernel's limit, above the kernel.
func LoadInitrd(mem *guestmem.Memory, k *Kernel, initrd []byte) (addr, size uint64, err error) {
	size = uint64(len(initrd))
	if size == 0 {
		return 0, 0, errors.New("initramfs is empty")
	}
	top := min(mem.LowEnd(), k.initrdAddrMax()+1)
	if size > top || (top-size)&^0xfff < k.End {
		return 0, 0, fmt.Errorf("initramfs of %d bytes does not fit between the kernel's end (%#x) and %#x: give the VM more memory", size, k.End, top)
	}
	addr = (top - size) &^ 0xfff
	if err := mem.WriteAt(initrd, addr); err != nil {
		return 0, 0, fmt.Errorf("initramfs: %w", err)
	}
	return addr, size, nil
}
