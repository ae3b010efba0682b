package boot

import (
	"bytes"
	"fmt"
	"testing"
)

// acpiTables is what parseACPI found, by signature.
type acpiTables map[string][]byte

// parseACPI walks the tables from the RSDP at the blob's start, as a kernel
// does, with the field offsets of ACPI 6.5 (5.2.5.3 RSDP, 5.2.6 the
// table header, 5.2.8 XSDT, 5.2.9 FADT), independently of the builder, and
// checks every checksum, length and pointer it follows.
func parseACPI(b []byte) (acpiTables, error) {
	at := func(addr uint64, n int) ([]byte, error) {
		if addr < ACPIAddr || addr-ACPIAddr+uint64(n) > uint64(len(b)) {
			return nil, fmt.Errorf("%d bytes at %#x: outside the tables", n, addr)
		}
		return b[addr-ACPIAddr : addr-ACPIAddr+uint64(n)], nil
	}
	table := func(addr uint64, sig string) ([]byte, error) {
		h, err := at(addr, 36)
		if err != nil {
			return nil, err
		}
		t, err := at(addr, int(tle.Uint32(h[4:])))
		switch {
		case err != nil:
			return nil, fmt.Errorf("%s: %w", sig, err)
		case string(t[:4]) != sig:
			return nil, fmt.Errorf("table at %#x is %q, want %q", addr, t[:4], sig)
		case addr%8 != 0:
			return nil, fmt.Errorf("%s at %#x: not 8-byte aligned", sig, addr)
		case byteSum(t) != 0:
			return nil, fmt.Errorf("%s: checksum: sum %#x", sig, byteSum(t))
		case string(t[10:16]) != "CAPSA " || string(t[16:24]) != ("CAPSA" + sig)[:8] || string(t[28:32]) != "CAPS":
			return nil, fmt.Errorf("%s: OEM %q, table %q, creator %q", sig, t[10:16], t[16:24], t[28:32])
		}
		return t, nil
	}
	if len(b) < 36 {
		return nil, fmt.Errorf("%d bytes", len(b))
	}
	r := b[:36]
	switch {
	case string(r[:8]) != "RSD PTR ":
		return nil, fmt.Errorf("RSDP signature %q", r[:8])
	case byteSum(r[:20]) != 0:
		return nil, fmt.Errorf("RSDP checksum (first 20 bytes): sum %#x", byteSum(r[:20]))
	case byteSum(r) != 0:
		return nil, fmt.Errorf("RSDP extended checksum: sum %#x", byteSum(r))
	case r[15] != 2 || tle.Uint32(r[20:]) != 36:
		return nil, fmt.Errorf("RSDP revision %d, length %d; want 2, 36", r[15], tle.Uint32(r[20:]))
	case string(r[9:15]) != "CAPSA " || tle.Uint32(r[16:]) != 0 || !allZero(r[33:36]):
		return nil, fmt.Errorf("RSDP OEM %q, RSDT %#x, reserved % x", r[9:15], tle.Uint32(r[16:]), r[33:36])
	}
	xsdt, err := table(tle.Uint64(r[24:]), "XSDT")
	if err != nil {
		return nil, err
	}
	if (len(xsdt)-36)%8 != 0 || xsdt[8] != 1 {
		return nil, fmt.Errorf("XSDT: %d bytes of entries, revision %d", len(xsdt)-36, xsdt[8])
	}
	got := acpiTables{"XSDT": xsdt}
	for off := 36; off < len(xsdt); off += 8 {
		addr := tle.Uint64(xsdt[off:])
		h, err := at(addr, 4)
		if err != nil {
			return nil, err
		}
		sig := string(h)
		if got[sig] != nil {
			return nil, fmt.Errorf("XSDT lists %s twice", sig)
		}
		if got[sig], err = table(addr, sig); err != nil {
			return nil, err
		}
	}
	fadt := got["FACP"]
	if fadt == nil {
		return nil, fmt.Errorf("XSDT lists no FADT")
	}
	if len(fadt) != 276 || fadt[8] != 6 || fadt[131] != 5 {
		return nil, fmt.Errorf("FADT: %d bytes, revision %d.%d; want 276, 6.5", len(fadt), fadt[8], fadt[131])
	}
	dsdtAddr := tle.Uint64(fadt[140:])
	if uint64(tle.Uint32(fadt[40:])) != dsdtAddr {
		return nil, fmt.Errorf("FADT: DSDT %#x, X_DSDT %#x", tle.Uint32(fadt[40:]), dsdtAddr)
	}
	if got["DSDT"], err = table(dsdtAddr, "DSDT"); err != nil {
		return nil, err
	}
	return got, nil
}

// gasAt decodes the Generic Address Structure at b[off:] (ACPI 6.5 5.2.3.2).
func gasAt(b []byte, off int) [5]uint64 {
	return [5]uint64{uint64(b[off]), uint64(b[off+1]), uint64(b[off+2]), uint64(b[off+3]), tle.Uint64(b[off+4:])}
}

func TestACPITables(t *testing.T) {
	for _, n := range []int{1, 2, 4, 64, MaxMPCPUs} {
		b, err := ACPITables(n)
		if err != nil {
			t.Fatalf("ACPITables(%d) = %v", n, err)
		}
		if ACPIAddr+len(b) > MPTableAddr {
			t.Errorf("ACPITables(%d) is %d bytes: runs into the MP table", n, len(b))
		}
		tables, err := parseACPI(b)
		if err != nil {
			t.Fatalf("ACPITables(%d): %v", n, err)
		}
		if len(tables) != 4 {
			t.Errorf("ACPITables(%d) has %d tables, want XSDT, FACP, APIC, DSDT", n, len(tables))
		}

		f := tables["FACP"]
		for _, c := range []struct {
			name      string
			got, want uint64
		}{
			// Table 5.9, offsets 36-111: no FACS, no SCI, no SMI, no
			// PM1/PM2/PM timer/GPE blocks, no C-states, no RTC alarms.
			{"FIRMWARE_CTRL through CENTURY", boolInt(allZero(f[36:40]) && allZero(f[44:109])), 1},
			{"IAPC_BOOT_ARCH", uint64(tle.Uint16(f[109:])), 1<<2 | 1<<3 | 1<<4 | 1<<5}, // no VGA, no MSI, no ASPM, no CMOS RTC; no 8042, no legacy devices
			{"reserved (111)", uint64(f[111]), 0},
			// Table 5.10: PWR_BUTTON (4), SLP_BUTTON (5), RESET_REG_SUP
			// (10), HEADLESS (12), HW_REDUCED_ACPI (20).
			{"Flags", uint64(tle.Uint32(f[112:])), 1<<4 | 1<<5 | 1<<10 | 1<<12 | 1<<20},
			{"RESET_VALUE", uint64(f[128]), 0xfe},
			{"ARM_BOOT_ARCH", uint64(tle.Uint16(f[129:])), 0},
			{"X_FIRMWARE_CTRL", tle.Uint64(f[132:]), 0},
			{"X_PM1a_EVT_BLK through X_GPE1_BLK", boolInt(allZero(f[148:244])), 1},
		} {
			if c.got != c.want {
				t.Errorf("ACPITables(%d): FADT %s = %#x, want %#x", n, c.name, c.got, c.want)
			}
		}
		for _, g := range []struct {
			name string
			off  int
			port uint64
		}{{"RESET_REG", 116, 0x64}, {"SLEEP_CONTROL_REG", 244, ACPISleepControlPort}, {"SLEEP_STATUS_REG", 256, ACPISleepStatusPort}} {
			// System I/O, 8 bits wide at bit 0, byte access.
			if got, want := gasAt(f, g.off), [5]uint64{1, 8, 0, 1, g.port}; got != want {
				t.Errorf("ACPITables(%d): FADT %s = %v, want %v", n, g.name, got, want)
			}
		}
		if string(f[268:276]) != "CAPSAKVM" {
			t.Errorf("ACPITables(%d): FADT hypervisor vendor %q", n, f[268:276])
		}

		// iasl 20200925 (acpica-tools) compiles the ASL in dsdtAML's
		// comment to exactly these bytes.
		wantAML := []byte{
			0x10, 0x32, '_', 'S', 'B', '_', // Scope (\_SB), 0x32 bytes
			0x5b, 0x82, 0x2b, 'C', 'O', 'M', '1', // Device (COM1), 0x2b bytes
			0x08, '_', 'H', 'I', 'D', 0x0c, 0x41, 0xd0, 0x05, 0x01, // EisaId ("PNP0501") = 0x0105d041
			0x08, '_', 'U', 'I', 'D', 0x01,
			0x08, '_', 'C', 'R', 'S', 0x11, 0x10, 0x0a, 0x0d, // a 13-byte buffer
			0x47, 0x01, 0xf8, 0x03, 0xf8, 0x03, 0x00, 0x08, // IO (Decode16, 0x3f8, 0x3f8, 0, 8)
			0x22, 0x10, 0x00, // IRQNoFlags () {4}
			0x79, 0x00, // end tag
			0x08, '_', 'S', '5', '_', 0x12, 0x07, 0x04, 0x0a, 0x05, 0x00, 0x00, 0x00, // Package (4) {5, 0, 0, 0}
		}
		if d := tables["DSDT"]; d[8] != 2 || !bytes.Equal(d[36:], wantAML) {
			t.Errorf("ACPITables(%d): DSDT revision %d, AML\n% x\nwant\n% x", n, d[8], d[36:], wantAML)
		}

		m := tables["APIC"]
		var want []byte
		want = tle.AppendUint32(want, 0xfee0_0000)
		want = tle.AppendUint32(want, 1) // PCAT_COMPAT
		for id := range n {
			want = append(want, 0, 8, byte(id), byte(id), 1, 0, 0, 0) // Processor Local APIC, enabled
		}
		want = append(want, 1, 12, byte(n), 0, 0, 0, 0xc0, 0xfe, 0, 0, 0, 0) // I/O APIC id n at 0xfec00000, GSI base 0
		want = append(want, 4, 6, 0xff, 0, 0, 1)                             // Local APIC NMI: all processors, LINT1
		if m[8] != 5 || !bytes.Equal(m[36:], want) {
			t.Errorf("ACPITables(%d): MADT revision %d, body\n% x\nwant\n% x", n, m[8], m[36:], want)
		}
	}
	for _, n := range []int{0, -1, MaxMPCPUs + 1} {
		if _, err := ACPITables(n); err == nil {
			t.Errorf("ACPITables(%d) succeeded", n)
		}
	}
}

func boolInt(b bool) uint64 {
	if b {
		return 1
	}
	return 0
}

// TestACPIParserCatchesCorruption: every byte the kernel reads is under a
// checksum parseACPI checks, or is a pointer or length it follows.
func TestACPIParserCatchesCorruption(t *testing.T) {
	b, err := ACPITables(2)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := parseACPI(b)
	if err != nil {
		t.Fatal(err)
	}
	used := make([]bool, len(b))
	for i := range 36 {
		used[i] = true
	}
	for _, tb := range tables {
		off := bytes.Index(b, tb)
		for i := range tb {
			used[off+i] = true
		}
	}
	for i := range b {
		if !used[i] {
			if b[i] != 0 {
				t.Errorf("byte %d (%#x) is in no table", i, b[i])
			}
			continue
		}
		bad := bytes.Clone(b)
		bad[i] ^= 0x40
		if _, err := parseACPI(bad); err == nil {
			t.Errorf("corrupting byte %d went unnoticed", i)
		}
	}
}

// decodePkgLength decodes an AML PkgLength (ACPI 6.5 20.2.4): the length
// and how many bytes encode it.
func decodePkgLength(b []byte) (n, size int) {
	lead := b[0]
	size = 1 + int(lead>>6)
	if size == 1 {
		return int(lead & 0x3f), 1
	}
	n = int(lead & 0xf)
	for i := 1; i < size; i++ {
		n |= int(b[i]) << (4 + 8*(i-1))
	}
	return n, size
}

func TestAMLPkgLength(t *testing.T) {
	for _, body := range []int{0, 1, 61, 62, 63, 64, 4092, 4093, 4094, 1<<20 - 4, 1<<20 - 3, 1 << 20} {
		p := amlPkg([]byte{0x12}, make([]byte, body))
		n, size := decodePkgLength(p[1:])
		wantSize := map[bool]int{true: 1}[body+1 < 64]
		if wantSize == 0 {
			switch {
			case body+2 < 1<<12:
				wantSize = 2
			case body+3 < 1<<20:
				wantSize = 3
			default:
				wantSize = 4
			}
		}
		if n != len(p)-1 || size != wantSize || len(p) != 1+size+body {
			t.Errorf("amlPkg(%d-byte body): PkgLength %d in %d bytes, package %d bytes; want %d in %d", body, n, size, len(p), len(p)-1, wantSize)
		}
	}
}
