package boot

import (
	"bytes"
	"cmp"
	"debug/elf"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/internal/testkernel"
)

var tle = binary.LittleEndian

// allZero reports whether b is all zero bytes, quickly for large b.
func allZero(b []byte) bool {
	var zero [64 << 10]byte
	for len(b) > 0 {
		n := min(len(b), len(zero))
		if !bytes.Equal(b[:n], zero[:n]) {
			return false
		}
		b = b[n:]
	}
	return true
}

// newMem maps size bytes of x86-laid-out guest RAM (MAP_NORESERVE: even
// gigabytes cost nothing until touched).
func newMem(t testing.TB, size uint64) *guestmem.Memory {
	t.Helper()
	m, err := guestmem.New(size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

type seg = testkernel.Segment

func makeELF(entry uint64, segs ...seg) []byte {
	return testkernel.ELF(entry, elf.EM_X86_64, elf.ELFCLASS64, segs...)
}

// Offsets in the images makeELF builds.
const (
	phdr0    = ehdrSize // program header i is at phdr0 + i*phdrSize
	phOffset = 8        // p_offset within a program header
)

func note(name string, typ uint32, desc []byte) []byte {
	pad := func(b []byte) []byte { return append(b, make([]byte, (4-len(b)%4)%4)...) }
	n := tle.AppendUint32(nil, uint32(len(name)+1))
	n = tle.AppendUint32(n, uint32(len(desc)))
	n = tle.AppendUint32(n, typ)
	n = append(n, pad(append([]byte(name), 0))...)
	return append(n, pad(desc)...)
}

func pvhNote(entry uint32) []byte {
	return note("Xen", xenElfNotePhys32Entry, tle.AppendUint32(nil, entry))
}

func load(paddr, filesz, memsz uint64) seg {
	return seg{Type: elf.PT_LOAD, Paddr: paddr, Filesz: filesz, Memsz: memsz, Data: bytes.Repeat([]byte{0x90}, int(filesz))}
}

// validELF has two PT_LOAD segments with a gap between them and a PVH note.
func validELF() []byte {
	notes := append(note("GNU", 3, []byte("build-id")), pvhNote(0x100_0040)...)
	return makeELF(0x100_0000,
		load(0x100_0000, 0x100, 0x2000),
		seg{Type: elf.PT_NOTE, Filesz: uint64(len(notes)), Memsz: uint64(len(notes)), Data: notes},
		load(0x120_0000, 0x10, 0x1000),
	)
}

// patch returns a copy of b with v written little-endian at off.
func patch[T uint8 | uint16 | uint32 | uint64](b []byte, off int, v T) []byte {
	b = bytes.Clone(b)
	var buf []byte
	switch v := any(v).(type) {
	case uint8:
		buf = []byte{v}
	case uint16:
		buf = tle.AppendUint16(nil, v)
	case uint32:
		buf = tle.AppendUint32(nil, v)
	case uint64:
		buf = tle.AppendUint64(nil, v)
	}
	copy(b[off:], buf)
	return b
}

// makeBzImage builds a minimal bzImage: boot sector, a protocol 2.15 style
// setup header (ending after init_size), setup sectors and a protected-mode
// payload whose first byte is 0xcc. It is relocatable with a 2 MiB
// alignment and decompresses 4 MiB at 16 MiB.
func makeBzImage(setupSects byte, payload int) []byte {
	sects := int(setupSects)
	if sects == 0 {
		sects = 4
	}
	img := make([]byte, (sects+1)*512+payload)
	img[hdrSetupSects] = setupSects
	tle.PutUint16(img[hdrBootFlag:], bootFlag)
	img[hdrJump], img[hdrJump+1] = 0xeb, byte(hdrInitSize+4-0x202) // header ends after init_size
	copy(img[hdrMagic:], headerMagic)
	tle.PutUint16(img[hdrVersion:], 0x020f)
	tle.PutUint32(img[hdrInitrdAddrMax:], 0x7fff_ffff)
	tle.PutUint32(img[hdrKernelAlign:], 0x20_0000)
	img[hdrRelocatable] = 1
	tle.PutUint16(img[hdrXloadflags:], xlfKernel64|2)
	tle.PutUint32(img[hdrCmdlineSize:], 255)
	tle.PutUint64(img[hdrPrefAddress:], 0x100_0000)
	tle.PutUint32(img[hdrInitSize:], 0x40_0000)
	if payload > 0 {
		img[(sects+1)*512] = 0xcc
	}
	return img
}

func TestLoadELF(t *testing.T) {
	mem := newMem(t, 64<<20)
	k, err := LoadKernel(mem, validELF())
	if err != nil {
		t.Fatal(err)
	}
	want := Kernel{Format: FormatELF, Entry: 0x100_0000, End: 0x120_1000, PVHEntry: 0x100_0040}
	if k.Format != want.Format || k.Entry != want.Entry || k.End != want.End || k.PVHEntry != want.PVHEntry || k.SetupHeader != nil {
		t.Errorf("kernel = %+v, want %+v", *k, want)
	}
	for _, tc := range []struct {
		gpa  uint64
		want byte
	}{
		{0x100_0000, 0x90}, {0x100_00ff, 0x90}, {0x100_0100, 0}, {0x100_1fff, 0}, // copied, then zero-filled
		{0x120_0000, 0x90}, {0x120_000f, 0x90}, {0x120_0010, 0},
	} {
		if b, _ := mem.Uint8(tc.gpa); b != tc.want {
			t.Errorf("byte at %#x = %#x, want %#x", tc.gpa, b, tc.want)
		}
	}
	// Zero-filling really clears: load over dirty memory.
	mem.WriteAt(bytes.Repeat([]byte{0xee}, 0x2000), 0x100_0000)
	if _, err := LoadKernel(mem, validELF()); err != nil {
		t.Fatal(err)
	}
	if b, _ := mem.Uint8(0x100_1000); b != 0 {
		t.Error("bss not cleared over dirty memory")
	}
}

func TestPVHEntry(t *testing.T) {
	for _, tc := range []struct {
		name  string
		notes []byte
		want  uint64
	}{
		{"alone", pvhNote(0x123456), 0x123456},
		{"after another note", append(note("GNU", 3, []byte("abcdef")), pvhNote(0x1000)...), 0x1000},
		{"64-bit desc", note("Xen", xenElfNotePhys32Entry, tle.AppendUint64(nil, 0x2000)), 0x2000},
		{"other Xen note", note("Xen", 17, tle.AppendUint32(nil, 0x1000)), 0},
		{"other name", note("Xe", xenElfNotePhys32Entry, tle.AppendUint32(nil, 0x1000)), 0},
		{"truncated", pvhNote(0x1000)[:18], 0},
		{"huge namesz", patch(pvhNote(0x1000), 0, uint32(0xffff_ffff)), 0},
		{"huge descsz", patch(pvhNote(0x1000), 4, uint32(0xffff_fff0)), 0},
	} {
		p := prog{typ: elf.PT_NOTE, off: 0, filesz: uint64(len(tc.notes))}
		if got := pvhEntry(tc.notes, p); got != tc.want {
			t.Errorf("%s: PVH entry %#x, want %#x", tc.name, got, tc.want)
		}
	}
	// A later PT_NOTE without the note does not hide an earlier one.
	img := makeELF(0x100_0000, load(0x100_0000, 16, 16),
		seg{Type: elf.PT_NOTE, Filesz: 20, Memsz: 20, Data: pvhNote(0x100_0008)},
		seg{Type: elf.PT_NOTE, Filesz: 16, Memsz: 16, Data: note("GNU", 3, nil)})
	if k, err := LoadKernel(newMem(t, 32<<20), img); err != nil || k.PVHEntry != 0x100_0008 {
		t.Errorf("two notes: %+v, %v", k, err)
	}
}

func TestLoadKernelRejectsMalformed(t *testing.T) {
	good := validELF()
	ph := func(i, field int) int { return phdr0 + i*phdrSize + field }
	bz := makeBzImage(4, 4096)
	nonReloc := patch(bz, hdrRelocatable, uint8(0))
	buf := make([]byte, 32<<20) // shared: a failed load leaves it zero
	mem, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: buf})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, want string
		img        []byte
	}{
		{"empty", "too short", nil},
		{"garbage", "neither", bytes.Repeat([]byte("x"), 1000)},
		// vmlinux ELF
		{"truncated ELF header", "ELF header truncated", good[:40]},
		{"truncated phdr table", "program header table truncated", good[:phdr0+30]},
		{"phoff past file", "program header table truncated", patch(good, ePhoff, uint64(len(good)))},
		{"phoff overflow", "program header table truncated", patch(good, ePhoff, uint64(0xffff_ffff_ffff_ffc0))},
		{"32-bit ELF", "ELFCLASS32", testkernel.ELF(0x100_0000, elf.EM_X86_64, elf.ELFCLASS32, load(0x100_0000, 16, 16))},
		{"big-endian", "little-endian", patch(good, eiData, uint8(elf.ELFDATA2MSB))},
		{"wrong machine", "EM_AARCH64", testkernel.ELF(0x100_0000, elf.EM_AARCH64, elf.ELFCLASS64, load(0x100_0000, 16, 16))},
		{"shared object", "ET_EXEC", patch(good, eType, uint16(elf.ET_DYN))},
		{"phentsize", "program header size", patch(good, ePhentsize, uint16(32))},
		{"no phdrs", "no program headers", patch(good, ePhnum, uint16(0))},
		{"no PT_LOAD", "no loadable segments", makeELF(0x100_0000, seg{Type: elf.PT_NOTE, Filesz: 12, Memsz: 12, Data: pvhNote(1)})},
		{"only empty PT_LOAD", "no loadable segments", makeELF(0x100_0000, load(0x100_0000, 0, 0))},
		{"filesz > memsz", "exceeds memory size", makeELF(0x100_0000, load(0x100_0000, 16, 8))},
		{"segment past file", "outside the", patch(makeELF(0x100_0000, load(0x100_0000, 16, 0x2000)), ph(0, 32), uint64(4096))},
		{"offset past file", "outside the", patch(good, ph(0, phOffset), uint64(len(good)))},
		{"offset overflow", "outside the", patch(good, ph(0, phOffset), uint64(0xffff_ffff_ffff_fff8))},
		{"below 1 MiB", "below 1 MiB", makeELF(0x8000, load(0x7000, 16, 16))},
		{"straddles 1 MiB", "below 1 MiB", makeELF(0x10_0000, load(0xf_f000, 16, 0x2000))},
		{"beyond RAM", "outside guest RAM", makeELF(0x1_0000_0000, load(0x1_0000_0000, 16, 16))},
		{"past the end of RAM", "outside guest RAM", makeELF(0x1ff_f000, load(0x1ff_f000, 16, 0x2000))},
		{"address overflow", "overflows", makeELF(0x100_0000, load(0xffff_ffff_ffff_f000, 16, 0x2000))},
		{"zero entry", "entry point is zero", makeELF(0, load(0x100_0000, 16, 16))},
		{"entry outside", "none of the loaded segments", makeELF(0x200_0000, load(0x100_0000, 16, 16))},
		{"entry in gap", "none of the loaded segments", makeELF(0x110_0000, load(0x100_0000, 16, 16), load(0x120_0000, 16, 16))},
		{"second segment bad", "segment 2", patch(good, ph(2, 24), uint64(0x5000))},
		// bzImage
		{"bz truncated header", "setup header truncated", bz[:0x220]},
		{"bz boot flag", "0xaa55", patch(bz, hdrBootFlag, uint16(0))},
		{"bz old protocol", "too old", patch(bz, hdrVersion, uint16(0x0205))},
		{"bz 32-bit only", "XLF_KERNEL_64", patch(bz, hdrXloadflags, uint16(2))},
		{"bz setup past file", "run past the end", makeBzImage(200, 0)[:2048]},
		{"bz setup exactly the file", "run past the end", makeBzImage(4, 0)},
		{"bz tiny payload", "too short for its 64-bit entry", makeBzImage(4, 0x200)},
		{"bz header too long", "setup header ends", patch(bz, hdrJump+1, uint8(0xff))},
		{"bz header too short", "setup header ends", patch(bz, hdrJump+1, uint8(0x10))},
		{"bz init_size zero", "init_size is zero", patch(bz, hdrInitSize, uint32(0))},
		{"bz init_size huge", "beyond the", patch(bz, hdrInitSize, uint32(0xffff_0000))},
		{"bz pref_address huge", "beyond the", patch(bz, hdrPrefAddress, uint64(0x1_0000_0000))},
		{"bz bad alignment", "power of two", patch(bz, hdrKernelAlign, uint32(0x30_0000))},
		{"bz zero alignment", "power of two", patch(bz, hdrKernelAlign, uint32(0))},
		{"bz pref below 1 MiB", "below 1 MiB", patch(nonReloc, hdrPrefAddress, uint64(0x8000))},
		{"bz pref overflow", "overflows", patch(nonReloc, hdrPrefAddress, uint64(0xffff_ffff_ffff_0000))},
		{"bz payload beyond RAM", "beyond the", makeBzImage(4, 40<<20)},
	} {
		k, err := LoadKernel(mem, tc.img)
		if err == nil {
			t.Errorf("%s: loaded: %+v", tc.name, k)
			clear(buf)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "%!") {
			t.Errorf("%s: error %q, want it to mention %q", tc.name, err, tc.want)
		}
		// A failed load writes nothing.
		if !allZero(buf) {
			t.Errorf("%s: the failed load wrote guest memory", tc.name)
			clear(buf)
		}
	}
	if _, err := LoadKernel(nil, good); err == nil {
		t.Error("nil memory accepted")
	}
}

func TestLoadBzImage(t *testing.T) {
	for _, tc := range []struct {
		name    string
		img     []byte
		wantEnd uint64
	}{
		{"relocatable", makeBzImage(4, 4096), 0x100_0000 + 0x40_0000},
		{"setup_sects 0 means 4", makeBzImage(0, 4096), 0x140_0000},
		{"many setup sectors", makeBzImage(30, 4096), 0x140_0000},
		{"aligned load above pref_address", patch(makeBzImage(4, 4096), hdrPrefAddress, uint64(0x10_0000)), 0x20_0000 + 0x40_0000},
		{"non-relocatable at pref_address", patch(patch(makeBzImage(4, 4096), hdrRelocatable, uint8(0)), hdrPrefAddress, uint64(0x10_0000)), 0x10_0000 + 0x40_0000},
		{"image longer than init_size", patch(patch(makeBzImage(4, 6<<20), hdrInitSize, uint32(0x1000)), hdrPrefAddress, uint64(0x10_0000)), 0x10_0000 + 6<<20},
	} {
		mem := newMem(t, 64<<20)
		k, err := LoadKernel(mem, tc.img)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if k.Format != FormatBzImage || k.Entry != HighMemBase+0x200 || k.End != tc.wantEnd || k.PVHEntry != 0 {
			t.Errorf("%s: kernel = %+v, want End %#x", tc.name, k, tc.wantEnd)
		}
		if b, _ := mem.Uint8(HighMemBase); b != 0xcc {
			t.Errorf("%s: protected-mode kernel not loaded at 1 MiB", tc.name)
		}
		if hdr := tc.img[hdrSetupSects : hdrInitSize+4]; !bytes.Equal(k.SetupHeader, hdr) {
			t.Errorf("%s: setup header % x, want % x", tc.name, k.SetupHeader, hdr)
		}
	}
}

func TestSetupBootParams(t *testing.T) {
	for _, tc := range []struct {
		name  string
		image []byte
		mem   func(t *testing.T) *guestmem.Memory
		e820  []E820Entry
		hdr   map[int]uint64 // boot_params offset -> expected little-endian value of len 1, 2 or 4
	}{
		{
			name: "vmlinux", image: validELF(),
			mem:  func(t *testing.T) *guestmem.Memory { return newMem(t, 128<<20) },
			e820: []E820Entry{{0, 0x9fc00, E820RAM}, {0xe0000, 0x20000, E820Reserved}, {0x10_0000, 128<<20 - 0x10_0000, E820RAM}},
			hdr:  map[int]uint64{0x1f1: 0, 0x206: 0x020c, 0x230: 0x100_0000, 0x238: 2047},
		},
		{
			name: "bzImage with RAM above 4 GiB", image: makeBzImage(4, 4096),
			mem: func(t *testing.T) *guestmem.Memory {
				m, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: make([]byte, 64<<20)},
					guestmem.Region{GPA: guestmem.HighStart, Host: make([]byte, 8192)})
				if err != nil {
					t.Fatal(err)
				}
				return m
			},
			e820: []E820Entry{{0, 0x9fc00, E820RAM}, {0xe0000, 0x20000, E820Reserved}, {0x10_0000, 63 << 20, E820RAM}, {1 << 32, 8192, E820RAM}},
			hdr:  map[int]uint64{0x1f1: 4, 0x201: 0x62, 0x206: 0x020f, 0x230: 0x20_0000, 0x234: 1, 0x236: 3, 0x238: 255, 0x22c: 0x7fff_ffff},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem := tc.mem(t)
			k, err := LoadKernel(mem, tc.image)
			if err != nil {
				t.Fatal(err)
			}
			addr, size, err := LoadInitrd(mem, k, bytes.Repeat([]byte{1}, 10000))
			if err != nil {
				t.Fatal(err)
			}
			st, err := Setup(mem, Config{Kernel: k, Cmdline: "console=ttyS0 quiet", InitrdAddr: addr, InitrdSize: size, CPUs: 2})
			if err != nil {
				t.Fatal(err)
			}
			bp, _ := mem.Slice(BootParamsAddr, bootParamsSize)
			get := func(off, n int) uint64 {
				return tle.Uint64(append(bytes.Clone(bp[off:off+n]), make([]byte, 8-n)...))
			}
			type field struct {
				name   string
				off, n int
				want   uint64
			}
			fields := []field{
				{"sentinel", 0x1ef, 1, 0},
				{"boot_flag", 0x1fe, 2, 0xaa55},
				{"header", 0x202, 4, 0x53726448},
				{"type_of_loader", 0x210, 1, 0xff},
				{"loadflags", 0x211, 1, loadedHigh | canUseHeap},
				{"ramdisk_image", 0x218, 4, addr},
				{"ramdisk_size", 0x21c, 4, 10000},
				{"heap_end_ptr", 0x224, 2, 0xfe00},
				{"cmd_line_ptr", 0x228, 4, CmdlineAddr},
				{"ext_ramdisk_image", 0x0c0, 4, 0},
				{"ext_ramdisk_size", 0x0c4, 4, 0},
				{"ext_cmd_line_ptr", 0x0c8, 4, 0},
				{"e820_entries", 0x1e8, 1, uint64(len(tc.e820))},
				{"acpi_rsdp_addr", 0x070, 8, 0xe0000},
			}
			for off, v := range tc.hdr {
				n := map[int]int{0x1f1: 1, 0x201: 1, 0x234: 1, 0x206: 2, 0x236: 2}[off]
				fields = append(fields, field{"header field", off, cmp.Or(n, 4), v})
			}
			for _, f := range fields {
				if got := get(f.off, f.n); got != f.want {
					t.Errorf("%s at %#x = %#x, want %#x", f.name, f.off, got, f.want)
				}
			}
			for i, e := range tc.e820 {
				off := 0x2d0 + 20*i
				if got := (E820Entry{tle.Uint64(bp[off:]), tle.Uint64(bp[off+8:]), E820Type(tle.Uint32(bp[off+16:]))}); got != e {
					t.Errorf("e820[%d] = %+v, want %+v", i, got, e)
				}
			}
			if rest := bp[0x2d0+20*len(tc.e820) : 0x2d0+20*128]; !allZero(rest) {
				t.Error("e820 table has bytes past its last entry")
			}
			cl, _ := mem.Slice(CmdlineAddr, 20)
			if string(cl) != "console=ttyS0 quiet\x00" {
				t.Errorf("command line %q", cl)
			}
			// The vCPUs in both tables, where the kernel looks.
			mp, _ := mem.Slice(MPTableAddr, BIOSEnd-MPTableAddr)
			mp = mp[:16+int(tle.Uint16(mp[16+4:]))] // the floating pointer, then the table and its length
			if s, err := parseMP(mp); err != nil || len(s.cpus) != 2 {
				t.Errorf("MP table in memory: %+v, %v; want 2 CPUs", s, err)
			}
			acpi, _ := mem.Slice(ACPIAddr, MPTableAddr-ACPIAddr)
			if tables, err := parseACPI(acpi); err != nil || len(tables["APIC"]) != 36+8+2*8+12+6 {
				t.Errorf("ACPI tables in memory: %v; want a MADT for 2 CPUs", err)
			}
			for name, v := range map[string][2]uint64{
				"rip": {st.RIP, k.Entry}, "rsi": {st.RSI, BootParamsAddr}, "rsp": {st.RSP, BootStackAddr},
				"rflags": {st.RFLAGS, 2}, "cr0": {st.CR0, 0x8000_0011}, "cr3": {st.CR3, PML4Addr}, "cr4": {st.CR4, 0x20},
				"efer": {st.EFER, 0x500}, "gdt": {st.GDTBase, GDTAddr}, "gdt limit": {uint64(st.GDTLimit), 47},
				"idt": {st.IDTBase, IDTAddr}, "idt limit": {uint64(st.IDTLimit), 7},
			} {
				if v[0] != v[1] {
					t.Errorf("%s = %#x, want %#x", name, v[0], v[1])
				}
			}
		})
	}
}

func TestSetupRejects(t *testing.T) {
	mem := newMem(t, 64<<20)
	k, err := LoadKernel(mem, validELF())
	if err != nil {
		t.Fatal(err)
	}
	tiny, _ := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: make([]byte, 1<<20)})
	for _, tc := range []struct {
		name, want string
		mem        *guestmem.Memory
		cfg        Config
	}{
		{"no kernel", "no kernel", mem, Config{CPUs: 1}},
		{"no memory", "no guest memory", nil, Config{Kernel: k, CPUs: 1}},
		{"no CPUs", "between 1 and 254", mem, Config{Kernel: k}},
		{"too many CPUs", "between 1 and 254", mem, Config{Kernel: k, CPUs: 255}},
		{"initrd outside RAM", "initramfs", mem, Config{Kernel: k, CPUs: 1, InitrdAddr: 63 << 20, InitrdSize: 2 << 20}},
		{"initrd below 1 MiB", "initramfs", mem, Config{Kernel: k, CPUs: 1, InitrdAddr: 0x8000, InitrdSize: 16}},
		{"no RAM above 1 MiB", "e820", tiny, Config{Kernel: &Kernel{Format: FormatELF}, CPUs: 1}},
	} {
		st, err := Setup(tc.mem, tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %+v, %v; want an error about %q", tc.name, st, err, tc.want)
		}
	}
	// Nothing was written below 1 MiB.
	if low, _ := mem.Slice(0, HighMemBase); !allZero(low) {
		t.Error("a failed Setup wrote boot structures")
	}
}

func TestCmdlineLimits(t *testing.T) {
	hugeBz := patch(makeBzImage(4, 4096), hdrCmdlineSize, uint32(0xffff_ffff))
	for _, tc := range []struct {
		name  string
		image []byte
		max   int
	}{
		{"vmlinux: COMMAND_LINE_SIZE", validELF(), 2047},
		{"bzImage: cmdline_size", makeBzImage(4, 4096), 255},
		{"bzImage: capped by base memory", hugeBz, EBDAStart - CmdlineAddr - 1},
	} {
		mem := newMem(t, 64<<20)
		k, err := LoadKernel(mem, tc.image)
		if err != nil {
			t.Fatal(err)
		}
		mem.WriteAt(bytes.Repeat([]byte{'z'}, tc.max+8), CmdlineAddr) // dirty: the NUL must be written
		if _, err := Setup(mem, Config{Kernel: k, Cmdline: strings.Repeat("a", tc.max), CPUs: 1}); err != nil {
			t.Errorf("%s: %d bytes: %v", tc.name, tc.max, err)
		}
		if b, _ := mem.Uint8(CmdlineAddr + uint64(tc.max)); b != 0 {
			t.Errorf("%s: command line not NUL-terminated", tc.name)
		}
		if n, _ := mem.Uint32(BootParamsAddr + hdrCmdlineSize); int(n) != tc.max {
			t.Errorf("%s: boot_params cmdline_size %d, want %d", tc.name, n, tc.max)
		}
		_, err = Setup(mem, Config{Kernel: k, Cmdline: strings.Repeat("a", tc.max+1), CPUs: 1})
		if err == nil || !strings.Contains(err.Error(), "command line") {
			t.Errorf("%s: %d bytes: %v, want a too-long error", tc.name, tc.max+1, err)
		}
	}
}

func TestE820(t *testing.T) {
	low := func(end uint64) E820Entry { return E820Entry{HighMemBase, end - HighMemBase, E820RAM} }
	base := []E820Entry{{0, EBDAStart, E820RAM}, {ACPIAddr, 0x20000, E820Reserved}}
	for _, tc := range []struct {
		size uint64
		want []E820Entry
	}{
		{2 << 20, append(base, low(2<<20))},
		{64 << 20, append(base, low(64<<20))},
		{guestmem.MMIOStart - 4096, append(base, low(guestmem.MMIOStart-4096))},
		{guestmem.MMIOStart, append(base, low(guestmem.MMIOStart))},
		{guestmem.MMIOStart + 4096, append(base, low(guestmem.MMIOStart), E820Entry{guestmem.HighStart, 4096, E820RAM})},
		{4 << 30, append(base, low(guestmem.MMIOStart), E820Entry{guestmem.HighStart, 4<<30 - guestmem.MMIOStart, E820RAM})},
	} {
		mem := newMem(t, tc.size) // MAP_NORESERVE: no real memory used
		got, err := E820(mem.Regions())
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(tc.want) {
			t.Errorf("size %#x: %v, want %v", tc.size, got, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("size %#x entry %d: %+v, want %+v", tc.size, i, got[i], tc.want[i])
			}
		}
	}
	for name, regions := range map[string][]guestmem.Region{
		"no RAM":             nil,
		"not at 0":           {{GPA: 0x10_0000, Host: make([]byte, 4096)}},
		"nothing above 1MiB": {{GPA: 0, Host: make([]byte, 1<<20)}},
	} {
		if _, err := E820(regions); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestLayout checks that the boot structures are disjoint and below 1 MiB.
func TestLayout(t *testing.T) {
	mp, err := MPTable(MaxMPCPUs)
	if err != nil {
		t.Fatal(err)
	}
	acpi, err := ACPITables(MaxMPCPUs)
	if err != nil {
		t.Fatal(err)
	}
	type area struct {
		name       string
		start, end uint64
	}
	areas := []area{
		{"GDT", GDTAddr, GDTAddr + uint64(len(GDT())*8)},
		{"IDT", IDTAddr, IDTAddr + 8},
		{"boot_params", BootParamsAddr, BootParamsAddr + bootParamsSize},
		{"stack", BootStackAddr - 0xff0, BootStackAddr},
		{"page tables", PML4Addr, PML4Addr + uint64(len(pageTables()))},
		{"command line", CmdlineAddr, EBDAStart},
		{"MP table", MPTableAddr, MPTableAddr + uint64(len(mp))},
		{"ACPI tables", ACPIAddr, ACPIAddr + uint64(len(acpi))},
	}
	for i, a := range areas {
		if a.end > HighMemBase || a.start >= a.end {
			t.Errorf("%s [%#x, %#x) is not below 1 MiB", a.name, a.start, a.end)
		}
		for _, b := range areas[i+1:] {
			if a.start < b.end && b.start < a.end {
				t.Errorf("%s [%#x, %#x) overlaps %s [%#x, %#x)", a.name, a.start, a.end, b.name, b.start, b.end)
			}
		}
	}
	if PDPTAddr != PML4Addr+pageSize || PDAddr != PDPTAddr+pageSize {
		t.Error("page tables are not contiguous")
	}
}

func TestPageTablesIdentityMap(t *testing.T) {
	mem := newMem(t, 64<<20)
	if err := mem.WriteAt(pageTables(), PML4Addr); err != nil {
		t.Fatal(err)
	}
	const present, writable, huge = 1, 2, 0x80
	walk := func(va uint64) (uint64, bool) {
		e, _ := mem.Uint64(PML4Addr + (va>>39&511)*8)
		if e&(present|writable) != present|writable {
			return 0, false
		}
		e, _ = mem.Uint64(e&^0xfff + (va>>30&511)*8)
		if e&(present|writable) != present|writable {
			return 0, false
		}
		e, _ = mem.Uint64(e&^0xfff + (va>>21&511)*8)
		if e&(present|writable|huge) != present|writable|huge {
			return 0, false
		}
		return e&^0x1f_ffff | va&0x1f_ffff, true
	}
	for _, va := range []uint64{0, 0x1000, BootParamsAddr, 0x100_0000, 0x123_4567, 1<<30 - 1, 1 << 30, 0xabcd_ef01, guestmem.MMIOStart - 1, IdentityMapEnd - 1} {
		if pa, ok := walk(va); !ok || pa != va {
			t.Errorf("%#x translates to %#x (mapped %v)", va, pa, ok)
		}
	}
	for _, va := range []uint64{IdentityMapEnd, 1 << 39, 0xffff_ffff_8100_0000} {
		if pa, ok := walk(va); ok {
			t.Errorf("%#x is mapped (to %#x); only the first %d GiB should be", va, pa, IdentityMapEnd>>30)
		}
	}
}

func TestGDTSegments(t *testing.T) {
	g := GDT()
	flat := Segment{Limit: 0xffff_ffff, Present: 1, G: 1}
	code, data, tss := flat, flat, flat
	code.Selector, code.Type, code.S, code.L = 0x10, 0xb, 1, 1
	data.Selector, data.Type, data.S, data.DB = 0x18, 0x3, 1, 1
	tss.Selector, tss.Type = 0x20, 0xb
	for _, tc := range []struct {
		sel  uint16
		want Segment
	}{{SelectorCode, code}, {SelectorData, data}, {SelectorTSS, tss}} {
		if got := SegmentFromGDT(g[tc.sel>>3], tc.sel); got != tc.want {
			t.Errorf("selector %#x: %+v, want %+v", tc.sel, got, tc.want)
		}
	}
	if len(g) != 6 || g[0] != 0 || g[1] != 0 || g[5] != 0 {
		t.Errorf("GDT %#x: want null, unused, code, data, 16-byte TSS", g)
	}
	if g[2] != 0x00af_9b00_0000_ffff || g[3] != 0x00cf_9300_0000_ffff || g[4] != 0x008f_8b00_0000_ffff {
		t.Errorf("GDT encodings %#x", g)
	}
	// Field extraction, byte granularity, and the high base of a 16-byte
	// system descriptor.
	if s := SegmentFromGDT(gdtEntry(0x1073, 0x1234_5678, 0xabcde), 0x2b); s != (Segment{Base: 0x1234_5678, Limit: 0xabcde, Selector: 0x2b, Type: 3, DPL: 3, S: 1, AVL: 1}) {
		t.Errorf("decoded %+v", s)
	}
	if s := segment([]uint64{0, gdtEntry(0x0089, 0x1000, 0x67), 0xffff_8000}, 0x08); s.Base != 0xffff_8000_0000_1000 || s.Limit != 0x67 {
		t.Errorf("system descriptor base %#x limit %#x", s.Base, s.Limit)
	}
}

// TestCPUStateMatchesMemory decodes the GDT Setup wrote and compares it with
// the segments it returned, and checks what KVM requires of 64-bit segments.
func TestCPUStateMatchesMemory(t *testing.T) {
	mem := newMem(t, 64<<20)
	k, err := LoadKernel(mem, validELF())
	if err != nil {
		t.Fatal(err)
	}
	st, err := Setup(mem, Config{Kernel: k, Cmdline: "x", CPUs: 1})
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := mem.Slice(st.GDTBase, uint64(st.GDTLimit)+1)
	var gdt []uint64
	for i := 0; i < len(raw); i += 8 {
		gdt = append(gdt, tle.Uint64(raw[i:]))
	}
	for name, s := range map[string]Segment{"cs": st.CS, "ds": st.DS, "es": st.ES, "fs": st.FS, "gs": st.GS, "ss": st.SS, "tr": st.TR} {
		if got := segment(gdt, s.Selector); got != s {
			t.Errorf("%s: state %+v, GDT in memory says %+v", name, s, got)
		}
		if s.Present != 1 || s.DPL != 0 || s.Base != 0 {
			t.Errorf("%s: %+v is not a present flat ring-0 segment", name, s)
		}
	}
	if st.CS.L != 1 || st.CS.DB != 0 || st.CS.Type&0x8 == 0 || st.CS.Selector != 0x10 {
		t.Errorf("CS %+v is not 64-bit code at __BOOT_CS", st.CS)
	}
	if st.SS.Type&0x2 == 0 || st.DS.Selector != 0x18 {
		t.Errorf("SS/DS %+v is not writable data at __BOOT_DS", st.SS)
	}
	if st.TR.S != 0 || st.TR.Type != 0xb {
		t.Errorf("TR %+v is not a busy 64-bit TSS", st.TR)
	}
	if idt, _ := mem.Uint64(IDTAddr); idt != 0 {
		t.Error("IDT not empty")
	}
}

func TestInitrdPlacement(t *testing.T) {
	bz := func(initrdMax uint32) *Kernel {
		k := &Kernel{Format: FormatBzImage, End: 0x180_0000, SetupHeader: make([]byte, hdrInitSize+4-hdrSetupSects)}
		tle.PutUint32(k.SetupHeader[hdrInitrdAddrMax-hdrSetupSects:], initrdMax)
		return k
	}
	elfK := func(end uint64) *Kernel { return &Kernel{Format: FormatELF, End: end} }
	const top = 32 << 20
	for _, tc := range []struct {
		name     string
		k        *Kernel
		size     int
		wantAddr uint64 // 0: must fail
	}{
		{"at the top, page aligned", elfK(0x180_0000), 5000, top - 8192},
		{"exactly a page", elfK(0x180_0000), 4096, top - 4096},
		{"fills all above the kernel", elfK(0x180_0000), top - 0x180_0000, 0x180_0000},
		{"overlaps the kernel", elfK(0x180_0000), top - 0x180_0000 + 1, 0},
		{"above an unaligned kernel end", elfK(top - 8191), 4096, top - 4096},
		{"below an unaligned kernel end", elfK(top - 8191), 4097, 0},
		{"larger than RAM", elfK(0x180_0000), top + 1, 0},
		{"kernel end above RAM", elfK(1 << 40), 4096, 0},
		{"hand-made kernel: not below 1 MiB", elfK(0), top - 0x10_0000 + 1, 0},
		{"empty", elfK(0x180_0000), 0, 0},
		{"initrd_addr_max caps", bz(0x1ff_ffff), 4096, 0x1ff_f000},
		{"initrd_addr_max is the last byte", bz(0x1ff_ffff), 4097, 0x1ff_e000},
		{"initrd_addr_max 0 means 0x37ffffff", bz(0), 4096, top - 4096},
		{"initrd_addr_max below the kernel", bz(0x17f_ffff), 4096, 0},
		{"hand-made bzImage without header", &Kernel{Format: FormatBzImage, End: 0x180_0000}, 4096, top - 4096},
	} {
		mem := newMem(t, top)
		initrd := bytes.Repeat([]byte{0x5a}, tc.size)
		addr, size, err := LoadInitrd(mem, tc.k, initrd)
		if tc.wantAddr == 0 {
			if err == nil {
				t.Errorf("%s: placed at %#x", tc.name, addr)
			}
			continue
		}
		if err != nil || addr != tc.wantAddr || size != uint64(tc.size) {
			t.Errorf("%s: %#x+%d, %v; want %#x", tc.name, addr, size, err, tc.wantAddr)
			continue
		}
		if got, _ := mem.Slice(addr, size); !bytes.Equal(got, initrd) {
			t.Errorf("%s: contents not copied", tc.name)
		}
	}
	if _, _, err := LoadInitrd(newMem(t, top), nil, []byte{1}); err == nil {
		t.Error("nil kernel accepted")
	}
}
