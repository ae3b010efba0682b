// Package testkernel builds tiny ELF64 "kernels" for tests: hand-written
// machine code in PT_LOAD segments, so the loader and the VMM can be tested
// without a Linux kernel.
package testkernel

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
)

// LoadAddr is where Code places its code, the usual vmlinux load address.
const LoadAddr = 0x100_0000

// Segment is one program header and its file contents.
type Segment struct {
	Type                 elf.ProgType
	Paddr, Filesz, Memsz uint64
	Data                 []byte
}

// ELF returns an ELF64 little-endian executable with the given header
// fields and segments, laid out header, program headers, segment data.
// Nothing is checked: tests use it to build malformed images too.
func ELF(entry uint64, machine elf.Machine, class elf.Class, segs ...Segment) []byte {
	const ehsize, phsize = 64, 56
	le := binary.LittleEndian
	off := uint64(ehsize + phsize*len(segs))
	var ph, body bytes.Buffer
	for _, s := range segs {
		p := make([]byte, phsize)
		le.PutUint32(p[0:], uint32(s.Type))
		le.PutUint32(p[4:], uint32(elf.PF_R|elf.PF_X))
		le.PutUint64(p[8:], off+uint64(body.Len()))
		le.PutUint64(p[16:], s.Paddr|0xffff_ffff_8000_0000)
		le.PutUint64(p[24:], s.Paddr)
		le.PutUint64(p[32:], s.Filesz)
		le.PutUint64(p[40:], s.Memsz)
		le.PutUint64(p[48:], 0x1000)
		ph.Write(p)
		body.Write(s.Data)
	}
	h := make([]byte, ehsize)
	copy(h, elf.ELFMAG)
	h[4] = byte(class)
	h[5] = byte(elf.ELFDATA2LSB)
	h[6] = byte(elf.EV_CURRENT)
	le.PutUint16(h[16:], uint16(elf.ET_EXEC))
	le.PutUint16(h[18:], uint16(machine))
	le.PutUint32(h[20:], uint32(elf.EV_CURRENT))
	le.PutUint64(h[24:], entry)
	le.PutUint64(h[32:], ehsize)
	le.PutUint16(h[52:], ehsize)
	le.PutUint16(h[54:], phsize)
	le.PutUint16(h[56:], uint16(len(segs)))
	return append(append(h, ph.Bytes()...), body.Bytes()...)
}

// Code returns a valid x86-64 vmlinux-like ELF whose entry point runs code
// (64-bit mode) at LoadAddr.
func Code(code []byte) []byte {
	return ELF(LoadAddr, elf.EM_X86_64, elf.ELFCLASS64,
		Segment{Type: elf.PT_LOAD, Paddr: LoadAddr, Filesz: uint64(len(code)), Memsz: 0x1000, Data: code})
}
