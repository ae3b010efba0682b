package boot

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/internal/testkernel"
)

var le = binary.LittleEndian

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

func makeELF(entry uint64, machine elf.Machine, class elf.Class, segs ...seg) []byte {
	return testkernel.ELF(entry, machine, class, segs...)
}

func pvhNote(entry uint32) []byte {
	n := make([]byte, 12, 20)
	le.PutUint32(n[0:], 4)
	le.PutUint32(n[4:], 4)
	le.PutUint32(n[8:], xenElfNotePhys32Entry)
	n = append(n, "Xen\x00"...)
	return le.AppendUint32(n, entry)
}

func validELF() []byte {
	code := bytes.Repeat([]byte{0x90}, 0x100)
	return makeELF(0x100_0000, elf.EM_X86_64, elf.ELFCLASS64,
		seg{Paddr: 0x100_0000, Filesz: 0x100, Memsz: 0x2000, Type: elf.PT_LOAD, Data: code},
		seg{Type: elf.PT_NOTE, Filesz: 20, Memsz: 20, Data: pvhNote(0x100_0040)},
	)
}

// makeBzImage builds a minimal bzImage: boot sector, setup header, and a
// protected-mode payload.
func makeBzImage(version uint16, xload uint16, setupSects byte, payload int) []byte {
	img := make([]byte, (int(setupSects)+1)*512+payload)
	img[hdrSetupSects] = setupSects
	le.PutUint16(img[hdrBootFlag:], 0xaa55)
	img[hdrJump+1] = byte(hdrInitSize + 4 - 0x202) // header ends after init_size
	copy(img[hdrMagic:], "HdrS")
	le.PutUint16(img[hdrVersion:], version)
	le.PutUint32(img[hdrInitrdAddrMax:], 0x7fff_ffff)
	le.PutUint16(img[hdrXloadflags:], xload)
	le.PutUint32(img[hdrCmdlineSize:], 255)
	le.PutUint64(img[hdrPrefAddress:], 0x100_0000)
	le.PutUint32(img[hdrInitSize:], 0x40_0000)
	return img
}

func TestLoadELF(t *testing.T) {
	mem := newMem(t, 64<<20)
	k, err := LoadKernel(mem, validELF())
	if err != nil {
		t.Fatal(err)
	}
	if k.Format != FormatELF || k.Entry != 0x100_0000 || k.End != 0x100_2000 || k.PVHEntry != 0x100_0040 {
		t.Errorf("kernel = %+v", k)
	}
	b, _ := mem.Slice(0x100_0000, 0x2000)
	if b[0] != 0x90 || b[0xff] != 0x90 || b[0x100] != 0 || b[0x1fff] != 0 {
		t.Error("segment not copied and zero-filled")
	}
}

func TestLoadKernelRejectsMalformed(t *testing.T) {
	good := validELF()
	code := make([]byte, 16)
	cases := map[string][]byte{
		"empty":              nil,
		"short":              []byte("\x7fELF"),
		"garbage":            bytes.Repeat([]byte("x"), 1000),
		"truncated header":   good[:40],
		"truncated phdrs":    good[:64+30],
		"32-bit class":       makeELF(0x100_0000, elf.EM_X86_64, elf.ELFCLASS32, seg{Paddr: 0x100_0000, Filesz: 16, Memsz: 16, Type: elf.PT_LOAD, Data: code}),
		"wrong machine":      makeELF(0x100_0000, elf.EM_AARCH64, elf.ELFCLASS64, seg{Paddr: 0x100_0000, Filesz: 16, Memsz: 16, Type: elf.PT_LOAD, Data: code}),
		"no load segments":   makeELF(0x100_0000, elf.EM_X86_64, elf.ELFCLASS64, seg{Type: elf.PT_NOTE, Filesz: 16, Memsz: 16, Data: code}),
		"filesz > memsz":     makeELF(0x100_0000, elf.EM_X86_64, elf.ELFCLASS64, seg{Paddr: 0x100_0000, Filesz: 16, Memsz: 8, Type: elf.PT_LOAD, Data: code}),
		"segment past file":  makeELF(0x100_0000, elf.EM_X86_64, elf.ELFCLASS64, seg{Paddr: 0x100_0000, Filesz: 4096, Memsz: 4096, Type: elf.PT_LOAD, Data: code}),
		"below 1 MiB":        makeELF(0x8000, elf.EM_X86_64, elf.ELFCLASS64, seg{Paddr: 0x7000, Filesz: 16, Memsz: 16, Type: elf.PT_LOAD, Data: code}),
		"beyond RAM":         makeELF(0x1_0000_0000, elf.EM_X86_64, elf.ELFCLASS64, seg{Paddr: 0x1_0000_0000, Filesz: 16, Memsz: 16, Type: elf.PT_LOAD, Data: code}),
		"address overflow":   makeELF(0x100_0000, elf.EM_X86_64, elf.ELFCLASS64, seg{Paddr: 0xffff_ffff_ffff_f000, Filesz: 16, Memsz: 0x2000, Type: elf.PT_LOAD, Data: code}),
		"entry outside":      makeELF(0x500_0000, elf.EM_X86_64, elf.ELFCLASS64, seg{Paddr: 0x100_0000, Filesz: 16, Memsz: 16, Type: elf.PT_LOAD, Data: code}),
		"bz bad boot flag":   func() []byte { b := makeBzImage(0x020f, 1, 4, 4096); b[hdrBootFlag] = 0; return b }(),
		"bz old protocol":    makeBzImage(0x0205, 1, 4, 4096),
		"bz 32-bit only":     makeBzImage(0x020f, 0, 4, 4096),
		"bz setup past file": makeBzImage(0x020f, 1, 200, 0)[:2048],
		"bz truncated":       makeBzImage(0x020f, 1, 4, 4096)[:0x220],
		"bz tiny payload":    makeBzImage(0x020f, 1, 4, 0x100),
		"bz header too long": func() []byte { b := makeBzImage(0x020f, 1, 4, 4096); b[hdrJump+1] = 0xff; return b }(),
		"bz init_size huge": func() []byte {
			b := makeBzImage(0x020f, 1, 4, 4096)
			le.PutUint32(b[hdrInitSize:], 0xffff_0000)
			return b
		}(),
	}
	for name, img := range cases {
		mem := newMem(t, 64<<20)
		k, err := LoadKernel(mem, img)
		if err == nil {
			t.Errorf("%s: loaded: %+v", name, k)
			continue
		}
		if strings.Contains(err.Error(), "%!") {
			t.Errorf("%s: badly formatted error %q", name, err)
		}
	}
}

func TestLoadBzImage(t *testing.T) {
	mem := newMem(t, 64<<20)
	img := makeBzImage(0x020f, 1, 4, 4096)
	img[5*512] = 0xcc
	k, err := LoadKernel(mem, img)
	if err != nil {
		t.Fatal(err)
	}
	if k.Format != FormatBzImage || k.Entry != 0x100200 || k.End != 0x140_0000 {
		t.Errorf("kernel = %+v", k)
	}
	if b, _ := mem.Uint8(HighMemStart); b != 0xcc {
		t.Error("protected-mode kernel not loaded at 1 MiB")
	}
	if len(k.SetupHeader) != hdrInitSize+4-hdrSetupSects {
		t.Errorf("setup header is %d bytes", len(k.SetupHeader))
	}
	// setup_sects 0 means 4.
	img0 := makeBzImage(0x020f, 1, 4, 4096)
	img0[hdrSetupSects] = 0
	if _, err := LoadKernel(newMem(t, 64<<20), img0); err != nil {
		t.Errorf("setup_sects 0: %v", err)
	}
}

func TestSetupBootParams(t *testing.T) {
	mem := newMem(t, 128<<20)
	k, err := LoadKernel(mem, validELF())
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
	for name, tc := range map[string]struct{ got, want uint64 }{
		"boot_flag":      {uint64(le.Uint16(bp[0x1fe:])), 0xaa55},
		"header":         {uint64(le.Uint32(bp[0x202:])), 0x53726448},
		"type_of_loader": {uint64(bp[0x210]), 0xff},
		"loadflags":      {uint64(bp[0x211]), loadedHigh | canUseHeap},
		"ramdisk_image":  {uint64(le.Uint32(bp[0x218:])), addr},
		"ramdisk_size":   {uint64(le.Uint32(bp[0x21c:])), 10000},
		"cmd_line_ptr":   {uint64(le.Uint32(bp[0x228:])), CmdlineAddr},
		"e820_entries":   {uint64(bp[0x1e8]), 3},
		"e820[2].addr":   {le.Uint64(bp[0x2d0+40:]), HighMemStart},
		"e820[2].size":   {le.Uint64(bp[0x2d0+48:]), 128<<20 - HighMemStart},
		"e820[2].type":   {uint64(le.Uint32(bp[0x2d0+56:])), 1},
		"rip":            {st.RIP, 0x100_0000},
		"rsi":            {st.RSI, BootParamsAddr},
		"cr3":            {st.CR3, PML4Addr},
		"efer":           {st.EFER, eferLME | eferLMA},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %#x, want %#x", name, tc.got, tc.want)
		}
	}
	cl, _ := mem.Slice(CmdlineAddr, 20)
	if string(cl) != "console=ttyS0 quiet\x00" {
		t.Errorf("command line %q", cl)
	}
	if addr%4096 != 0 || addr < k.End || addr+size > mem.LowEnd() {
		t.Errorf("initrd at %#x+%d", addr, size)
	}
}

func TestE820(t *testing.T) {
	for _, tc := range []struct {
		size uint64
		want []E820Entry
	}{
		{64 << 20, []E820Entry{{0, EBDAStart, E820RAM}, {MPTableAddr, 0x10000, E820Reserved}, {HighMemStart, 64<<20 - HighMemStart, E820RAM}}},
		{guestmem.MMIOStart, []E820Entry{{0, EBDAStart, E820RAM}, {MPTableAddr, 0x10000, E820Reserved}, {HighMemStart, guestmem.MMIOStart - HighMemStart, E820RAM}}},
		{4 << 30, []E820Entry{{0, EBDAStart, E820RAM}, {MPTableAddr, 0x10000, E820Reserved}, {HighMemStart, guestmem.MMIOStart - HighMemStart, E820RAM},
			{guestmem.HighStart, 4<<30 - guestmem.MMIOStart, E820RAM}}},
	} {
		mem := newMem(t, tc.size) // MAP_NORESERVE: no real memory used
		got, err := E820(mem.Regions())
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(tc.want) {
			t.Fatalf("size %#x: %v, want %v", tc.size, got, tc.want)
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("size %#x entry %d: %+v, want %+v", tc.size, i, got[i], tc.want[i])
			}
		}
	}
	if _, err := E820(nil); err == nil {
		t.Error("empty memory accepted")
	}
}

func TestPageTablesIdentityMap(t *testing.T) {
	mem := newMem(t, 64<<20)
	if err := writePageTables(mem); err != nil {
		t.Fatal(err)
	}
	walk := func(va uint64) (uint64, bool) {
		pml4e, _ := mem.Uint64(PML4Addr + (va>>39&511)*8)
		if pml4e&1 == 0 {
			return 0, false
		}
		pdpte, _ := mem.Uint64(pml4e&^0xfff + (va>>30&511)*8)
		if pdpte&1 == 0 {
			return 0, false
		}
		pde, _ := mem.Uint64(pdpte&^0xfff + (va>>21&511)*8)
		if pde&1 == 0 || pde&0x80 == 0 {
			return 0, false
		}
		return pde&^0x1fffff | va&0x1fffff, true
	}
	for _, va := range []uint64{0, 0x1000, 0x100_0000, 0x123_4567, 1<<30 - 1} {
		if pa, ok := walk(va); !ok || pa != va {
			t.Errorf("%#x translates to %#x (mapped %v)", va, pa, ok)
		}
	}
	if _, ok := walk(1 << 30); ok {
		t.Error("1 GiB is mapped; only the first GiB should be")
	}
}

func TestGDTSegments(t *testing.T) {
	g := GDT()
	for _, tc := range []struct {
		entry uint64
		sel   uint16
		want  Segment
	}{
		{g[1], SelectorCode, Segment{Limit: 0xffffffff, Selector: 0x08, Type: 0xb, Present: 1, S: 1, L: 1, G: 1}},
		{g[2], SelectorData, Segment{Limit: 0xffffffff, Selector: 0x10, Type: 0x3, Present: 1, S: 1, DB: 1, G: 1}},
		{g[3], SelectorTSS, Segment{Limit: 0xffffffff, Selector: 0x18, Type: 0xb, Present: 1, G: 1}},
	} {
		if got := SegmentFromGDT(tc.entry, tc.sel); got != tc.want {
			t.Errorf("selector %#x: %+v, want %+v", tc.sel, got, tc.want)
		}
	}
	if g[1] != 0x00af9b000000ffff || g[2] != 0x00cf93000000ffff {
		t.Errorf("GDT encodings %#x %#x", g[1], g[2])
	}
	if s := SegmentFromGDT(gdtEntry(0x0093, 0x12345678, 0xabcde), 0); s.Base != 0x12345678 || s.Limit != 0xabcde {
		t.Errorf("byte-granular segment %+v", s)
	}
}

func sum(b []byte) (s byte) {
	for _, c := range b {
		s += c
	}
	return s
}

func TestMPTable(t *testing.T) {
	for _, n := range []int{1, 2, 8, MaxMPCPUs} {
		tb, err := MPTable(n)
		if err != nil {
			t.Fatal(err)
		}
		fp := tb[:16]
		if string(fp[:4]) != "_MP_" || sum(fp) != 0 || fp[8] != 1 || fp[9] != 4 {
			t.Fatalf("%d CPUs: bad floating pointer % x", n, fp)
		}
		if le.Uint32(fp[4:]) != MPTableAddr+16 {
			t.Fatalf("config table pointer %#x", le.Uint32(fp[4:]))
		}
		hdr := tb[16:]
		length := int(le.Uint16(hdr[4:]))
		if string(hdr[:4]) != "PCMP" || length != len(hdr) || sum(hdr[:length]) != 0 {
			t.Fatalf("%d CPUs: bad config header", n)
		}
		if MPTableAddr+len(tb) > BIOSEnd {
			t.Fatalf("%d CPUs: table runs past the BIOS area", n)
		}
		counts := map[byte]int{}
		bsp := 0
		off := mpHeaderSize
		for i := 0; i < int(le.Uint16(hdr[34:])); i++ {
			typ := hdr[off]
			counts[typ]++
			switch typ {
			case mpEntryProcessor:
				if hdr[off+3]&mpCPUBSP != 0 {
					bsp++
				}
				if int(hdr[off+1]) != counts[typ]-1 || hdr[off+3]&mpCPUEnabled == 0 {
					t.Errorf("processor entry %d: apic id %d flags %#x", i, hdr[off+1], hdr[off+3])
				}
				off += 20
			case mpEntryIOAPIC:
				if int(hdr[off+1]) != n || le.Uint32(hdr[off+4:]) != mpIOAPICAddr {
					t.Errorf("IOAPIC entry: id %d addr %#x", hdr[off+1], le.Uint32(hdr[off+4:]))
				}
				off += 8
			default:
				off += 8
			}
		}
		if off != length {
			t.Errorf("%d CPUs: entries end at %d, table length %d", n, off, length)
		}
		if counts[mpEntryProcessor] != n || bsp != 1 || counts[mpEntryBus] != 1 || counts[mpEntryIOAPIC] != 1 ||
			counts[mpEntryIOIntr] != 24 || counts[mpEntryLocalIntr] != 2 {
			t.Errorf("%d CPUs: entry counts %v, %d boot CPUs", n, counts, bsp)
		}
	}
	for _, n := range []int{0, -1, MaxMPCPUs + 1} {
		if _, err := MPTable(n); err == nil {
			t.Errorf("MPTable(%d) succeeded", n)
		}
	}
}

func TestInitrdPlacement(t *testing.T) {
	mem := newMem(t, 32<<20)
	k := &Kernel{Format: FormatELF, End: 0x180_0000}
	addr, _, err := LoadInitrd(mem, k, make([]byte, 5000))
	if err != nil || addr != 32<<20-8192 {
		t.Errorf("addr %#x, %v", addr, err)
	}
	if _, _, err := LoadInitrd(mem, k, make([]byte, 9<<20)); err == nil {
		t.Error("an initrd overlapping the kernel was placed")
	}
	if _, _, err := LoadInitrd(mem, k, nil); err == nil {
		t.Error("an empty initrd was placed")
	}
	// The kernel's initrd_addr_max caps the address.
	bz := &Kernel{Format: FormatBzImage, End: 0x180_0000, SetupHeader: make([]byte, hdrInitSize+4-hdrSetupSects)}
	le.PutUint32(bz.SetupHeader[hdrInitrdAddrMax-hdrSetupSects:], 0x1ff_ffff)
	if addr, _, err := LoadInitrd(mem, bz, make([]byte, 4096)); err != nil || addr != 0x1ff_f000 {
		t.Errorf("capped addr %#x, %v", addr, err)
	}
}

func TestCmdlineTooLong(t *testing.T) {
	mem := newMem(t, 64<<20)
	k, err := LoadKernel(mem, validELF())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Setup(mem, Config{Kernel: k, Cmdline: strings.Repeat("a", 2047), CPUs: 1}); err != nil {
		t.Errorf("2047 bytes: %v", err)
	}
	if _, err := Setup(mem, Config{Kernel: k, Cmdline: strings.Repeat("a", 2048), CPUs: 1}); err == nil {
		t.Error("2048-byte command line accepted")
	}
	bzMem := newMem(t, 64<<20)
	bz, err := LoadKernel(bzMem, makeBzImage(0x020f, 1, 4, 4096)) // cmdline_size 255
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Setup(bzMem, Config{Kernel: bz, Cmdline: strings.Repeat("a", 256), CPUs: 1}); err == nil {
		t.Error("command line longer than the bzImage's cmdline_size accepted")
	}
}

// FuzzLoadKernel: no input may panic, and a successful load writes only
// inside guest RAM (the memory here is exactly the test's buffer).
func FuzzLoadKernel(f *testing.F) {
	f.Add(validELF())
	f.Add(makeBzImage(0x020f, 1, 4, 4096))
	f.Add(makeBzImage(0x020f, 1, 0, 600))
	buf := make([]byte, 32<<20) // reused: the invariant does not depend on its contents
	mem, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: buf})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, img []byte) {
		k, err := LoadKernel(mem, img)
		if err != nil {
			return
		}
		if k.Entry < HighMemStart || k.End > uint64(len(buf)) {
			t.Fatalf("loaded kernel claims %#x..%#x in %d bytes of RAM", k.Entry, k.End, len(buf))
		}
		if _, err := Setup(mem, Config{Kernel: k, Cmdline: "x", CPUs: 2}); err != nil {
			t.Fatalf("setup after a successful load: %v", err)
		}
	})
}
