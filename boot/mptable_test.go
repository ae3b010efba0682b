package boot

import (
	"fmt"
	"testing"
)

func byteSum(b []byte) (s byte) {
	for _, c := range b {
		s += c
	}
	return s
}

// mpSummary is what parseMP found in a table.
type mpSummary struct {
	cpus     []byte // APIC ids, in order
	bsp      int    // APIC id of the boot CPU
	ioapicID byte
	irqs     int // I/O interrupt entries
	lints    [2]byte
}

// parseMP walks an MP table the way a kernel would, independently of the
// builder's constants, and checks every field it reads.
func parseMP(t []byte) (*mpSummary, error) {
	if len(t) < 16 {
		return nil, fmt.Errorf("table is %d bytes", len(t))
	}
	fp := t[:16]
	switch {
	case string(fp[:4]) != "_MP_":
		return nil, fmt.Errorf("floating pointer signature %q", fp[:4])
	case byteSum(fp) != 0:
		return nil, fmt.Errorf("floating pointer checksum: sum %#x", byteSum(fp))
	case fp[8] != 1 || fp[9] != 4:
		return nil, fmt.Errorf("floating pointer length %d, spec rev %d", fp[8], fp[9])
	case fp[11] != 0 || fp[12] != 0 || fp[13] != 0 || fp[14] != 0 || fp[15] != 0:
		return nil, fmt.Errorf("feature bytes % x: want a configuration table, no default config, no IMCR", fp[11:])
	}
	ptr := tle.Uint32(fp[4:])
	if ptr < MPTableAddr || ptr%4 != 0 || int(ptr-MPTableAddr) >= len(t) {
		return nil, fmt.Errorf("configuration table pointer %#x", ptr)
	}
	h := t[ptr-MPTableAddr:]
	if len(h) < 44 {
		return nil, fmt.Errorf("configuration header is %d bytes", len(h))
	}
	length := int(tle.Uint16(h[4:]))
	switch {
	case string(h[:4]) != "PCMP":
		return nil, fmt.Errorf("configuration signature %q", h[:4])
	case length != len(h):
		return nil, fmt.Errorf("base table length %d, %d bytes follow the pointer", length, len(h))
	case byteSum(h) != 0:
		return nil, fmt.Errorf("configuration checksum: sum %#x", byteSum(h))
	case h[6] != 4:
		return nil, fmt.Errorf("spec rev %d", h[6])
	case string(h[8:16]) != "CAPSA   ":
		return nil, fmt.Errorf("OEM id %q", h[8:16])
	case tle.Uint32(h[28:]) != 0 || tle.Uint16(h[32:]) != 0 || tle.Uint16(h[40:]) != 0 || h[42] != 0:
		return nil, fmt.Errorf("OEM table or extended table present")
	case tle.Uint32(h[36:]) != 0xfee0_0000:
		return nil, fmt.Errorf("local APIC address %#x", tle.Uint32(h[36:]))
	}
	s := &mpSummary{bsp: -1, ioapicID: 0xff}
	sizes := map[byte]int{0: 20, 1: 8, 2: 8, 3: 8, 4: 8}
	off, count := 44, int(tle.Uint16(h[34:]))
	for i := range count {
		if off >= len(h) || off+sizes[h[off]] > len(h) || sizes[h[off]] == 0 {
			return nil, fmt.Errorf("entry %d at %d: type %d does not fit", i, off, h[off])
		}
		e := h[off : off+sizes[h[off]]]
		off += len(e)
		switch e[0] {
		case 0: // processor
			if e[2] != 0x14 || e[3]&1 == 0 || tle.Uint32(e[4:]) != 0x600 || tle.Uint32(e[8:]) != 0x201 {
				return nil, fmt.Errorf("processor entry % x", e)
			}
			if e[3]&2 != 0 {
				if s.bsp >= 0 {
					return nil, fmt.Errorf("two boot CPUs")
				}
				s.bsp = int(e[1])
			}
			s.cpus = append(s.cpus, e[1])
		case 1: // bus
			if e[1] != 0 || string(e[2:8]) != "ISA   " {
				return nil, fmt.Errorf("bus entry % x", e)
			}
		case 2: // IOAPIC
			if e[2] != 0x11 || e[3] != 1 || tle.Uint32(e[4:]) != 0xfec0_0000 {
				return nil, fmt.Errorf("IOAPIC entry % x", e)
			}
			s.ioapicID = e[1]
		case 3: // I/O interrupt: INT, conforming, ISA IRQ n -> IOAPIC pin n
			if e[1] != 0 || tle.Uint16(e[2:]) != 0 || e[4] != 0 || e[5] != byte(s.irqs) || e[6] != s.ioapicID || e[7] != byte(s.irqs) {
				return nil, fmt.Errorf("I/O interrupt entry %d: % x", s.irqs, e)
			}
			s.irqs++
		case 4: // local interrupt, to every local APIC
			if e[6] != 0xff || e[7] > 1 || tle.Uint16(e[2:]) != 0 {
				return nil, fmt.Errorf("local interrupt entry % x", e)
			}
			s.lints[e[7]] = e[1]
		}
	}
	if off != len(h) {
		return nil, fmt.Errorf("%d entries end at %d, table is %d bytes", count, off, len(h))
	}
	return s, nil
}

func TestMPTable(t *testing.T) {
	for _, n := range []int{1, 2, 8, 37, MaxMPCPUs} {
		tb, err := MPTable(n)
		if err != nil {
			t.Fatalf("%d CPUs: %v", n, err)
		}
		if MPTableAddr+len(tb) > BIOSEnd {
			t.Errorf("%d CPUs: %d-byte table runs past the BIOS area", n, len(tb))
		}
		s, err := parseMP(tb)
		if err != nil {
			t.Errorf("%d CPUs: %v", n, err)
			continue
		}
		if len(s.cpus) != n || s.bsp != 0 || s.ioapicID != byte(n) || s.irqs != 24 || s.lints != [2]byte{3, 1} {
			t.Errorf("%d CPUs: %+v; want %d CPUs, BSP 0, IOAPIC id %d, 24 IRQs, LINT0 ExtINT, LINT1 NMI", n, s, n, n)
		}
		for i, id := range s.cpus {
			if int(id) != i {
				t.Errorf("%d CPUs: processor %d has APIC id %d", n, i, id)
			}
		}
	}
	for _, n := range []int{0, -1, MaxMPCPUs + 1} {
		if _, err := MPTable(n); err == nil {
			t.Errorf("MPTable(%d) succeeded", n)
		}
	}
}

// TestMPTableParserCatchesCorruption makes sure both checksums cover every
// byte and that parseMP checks them: flipping any byte must be noticed.
func TestMPTableParserCatchesCorruption(t *testing.T) {
	tb, err := MPTable(2)
	if err != nil {
		t.Fatal(err)
	}
	for i := range tb {
		bad := append([]byte(nil), tb...)
		bad[i] ^= 0x40
		if _, err := parseMP(bad); err == nil {
			t.Errorf("corrupting byte %d went unnoticed", i)
		}
	}
}
