package boot

import (
	"bytes"
	"debug/elf"
	"testing"

	"github.com/capsa-sandbox/capsa/guestmem"
)

// FuzzLoadKernel: no image may panic; a load writes only inside guest RAM,
// never below HighMemBase and, when it succeeds, nothing at or past the
// kernel's End; a failed load writes nothing; Setup accepts every loaded
// kernel.
func FuzzLoadKernel(f *testing.F) {
	const size = 2 << 20 // small, so that checking all of it after every run is cheap
	// Small seeds (minimizing what they lead to is quick) that fit in size:
	// an ELF at 1 MiB with a PVH note, bzImages decompressing 512 KiB at 1 MiB.
	f.Add(makeELF(0x10_0000, load(0x10_0000, 0x100, 0x3000),
		seg{Type: elf.PT_NOTE, Filesz: 20, Memsz: 20, Data: pvhNote(0x10_0040)}))
	small := func(b []byte) []byte {
		b = patch(b, hdrPrefAddress, uint64(0x10_0000))
		return patch(patch(b, hdrKernelAlign, uint32(0x10_0000)), hdrInitSize, uint32(0x8_0000))
	}
	f.Add(small(makeBzImage(1, 0x240)))
	f.Add(small(makeBzImage(0, 0x240)))
	f.Add(small(patch(makeBzImage(1, 0x240), hdrRelocatable, uint8(0))))
	f.Add(validELF()) // too big for this memory

	// The guest memory is exactly buf: guestmem bounds every write to it,
	// and the sentinel bytes show which ones a load touched.
	sentinel := bytes.Repeat([]byte{0xa5}, size)
	buf := bytes.Clone(sentinel)
	mem, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: buf})
	if err != nil {
		f.Fatal(err)
	}
	setupMem, err := guestmem.FromRegions(guestmem.Region{GPA: 0, Host: make([]byte, 2<<20)})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, img []byte) {
		k, err := LoadKernel(mem, img)
		if err != nil {
			if !bytes.Equal(buf, sentinel) {
				copy(buf, sentinel)
				t.Fatalf("failed load (%v) wrote guest memory", err)
			}
			return
		}
		defer copy(buf, sentinel) // for the next input
		if k.Entry < HighMemBase || k.Entry >= k.End || k.End > size {
			t.Fatalf("loaded kernel %+v: entry or end outside [1 MiB, %#x)", k, size)
		}
		if !bytes.Equal(buf[:HighMemBase], sentinel[:HighMemBase]) || !bytes.Equal(buf[k.End:], sentinel[k.End:]) {
			t.Fatalf("load of %+v wrote outside [1 MiB, End)", k)
		}
		if _, err := Setup(setupMem, Config{Kernel: k, Cmdline: "console=ttyS0", CPUs: 2}); err != nil {
			t.Fatalf("setup after a successful load: %v", err)
		}
	})
}
