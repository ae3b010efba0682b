package boot

import (
	"encoding/binary"
	"fmt"
)

// ACPI tables (ACPI Specification 6.5) for kernels that learn their CPUs
// only from ACPI: a distribution's kernel built without CONFIG_X86_MPPARSE
// (Debian's cloud kernel) ignores the MP table and, finding neither, runs on
// the boot CPU alone. capsa's own kernel has no ACPI and reads the MP table;
// a kernel with both prefers ACPI.
//
// The tables describe a hardware-reduced ACPI machine (ACPI 6.5 4.1), as
// Firecracker's and QEMU's microvm do: no PM timer, no SCI, no legacy PIC
// handling. The RSDP (revision 2) points to an XSDT listing the FADT and
// the MADT; the FADT points to the DSDT. The MADT lists one enabled local
// APIC per vCPU (ids 0..n-1, the same as the MP table's) and the IOAPIC
// (id n, GSIs 0-23). A hardware-reduced kernel sets up no legacy ISA
// interrupts by itself, so the DSDT declares COM1 (PNP0501, ports
// 0x3f8-0x3ff, IRQ 4) for the kernel to find and wire, and the \_S5 sleep
// type, so that the kernel powers off through the sleep control register
// (ACPISleepControlPort). The FADT's reset register is the i8042's
// pulse-reset command, and its boot flags say there is no VGA, no MSI, no
// CMOS RTC and no i8042 to probe.
const (
	// ACPIAddr is where the RSDP goes, the other tables after it, all
	// below MPTableAddr: Linux finds the RSDP in boot_params or by
	// scanning 0xe0000-0xfffff on 16-byte boundaries.
	ACPIAddr = 0xe0000
	// ACPISleepControlPort and ACPISleepStatusPort are the I/O ports of
	// the FADT's sleep control and status registers (one byte each).
	ACPISleepControlPort = 0x600
	ACPISleepStatusPort  = 0x601
	// ACPISleepTypeS5 is the SLP_TYP of \_S5 (soft off) in the DSDT.
	ACPISleepTypeS5 = 5

	// acpiResetPort and acpiResetValue: the FADT's reset register is the
	// i8042's command port, and its value the pulse-reset command.
	acpiResetPort  = 0x64
	acpiResetValue = 0xfe

	acpiHeaderSize = 36
	rsdpSize       = 36
	fadtSize       = 276 // FADT revision 6
	acpiIOAPICAddr = 0xfec0_0000
	acpiLAPICAddr  = 0xfee0_0000
)

// FADT fixed feature flags (ACPI 6.5 table 5.10) and IA-PC boot
// architecture flags (table 5.11).
const (
	fadtPwrButton      = 1 << 4  // the power button, if any, is a control method device
	fadtSlpButton      = 1 << 5  // the same for the sleep button
	fadtResetRegSup    = 1 << 10 // RESET_REG is valid
	fadtHeadless       = 1 << 12 // no monitor or keyboard to detect
	fadtHWReducedACPI  = 1 << 20
	iapcVGANotPresent  = 1 << 2
	iapcMSINotPresent  = 1 << 3
	iapcPCIeASPMCtrl   = 1 << 4 // the OS must not enable PCIe ASPM
	iapcCMOSRTCMissing = 1 << 5
)

// Generic Address Structure address space ids (ACPI 6.5 table 5.1).
const gasSystemIO = 1

// ACPITables returns the RSDP and, after it, the XSDT, FADT, DSDT and MADT
// for ncpus vCPUs, to be placed at ACPIAddr.
func ACPITables(ncpus int) ([]byte, error) {
	if ncpus < 1 || ncpus > MaxMPCPUs {
		return nil, fmt.Errorf("boot: ACPI tables for %d CPUs: must be between 1 and %d", ncpus, MaxMPCPUs)
	}
	le := binary.LittleEndian
	var blob []byte
	// place appends table at a 16-byte boundary and returns its address.
	place := func(table []byte) uint64 {
		for len(blob)%16 != 0 {
			blob = append(blob, 0)
		}
		addr := ACPIAddr + uint64(len(blob))
		blob = append(blob, table...)
		return addr
	}
	place(make([]byte, rsdpSize)) // filled in last
	dsdt := place(acpiTable("DSDT", 2, dsdtAML()))
	fadt := place(acpiTable("FACP", 6, fadtBody(dsdt)))
	madt := place(acpiTable("APIC", 5, madtBody(ncpus)))
	var xsdtBody []byte
	for _, a := range []uint64{fadt, madt} {
		xsdtBody = le.AppendUint64(xsdtBody, a)
	}
	xsdt := place(acpiTable("XSDT", 1, xsdtBody))

	rsdp := blob[:rsdpSize]
	copy(rsdp, "RSD PTR ")
	copy(rsdp[9:15], acpiOEMID)
	rsdp[15] = 2 // revision: ACPI 2.0 and later, with an XSDT
	// RsdtAddress (16) stays 0: there is no RSDT.
	le.PutUint32(rsdp[20:], rsdpSize)
	le.PutUint64(rsdp[24:], xsdt)
	rsdp[8] = checksum(rsdp[:20])
	rsdp[32] = checksum(rsdp)
	if ACPIAddr+len(blob) > MPTableAddr {
		return nil, fmt.Errorf("boot: ACPI tables for %d CPUs are %d bytes, more than fit at %#x", ncpus, len(blob), ACPIAddr)
	}
	return blob, nil
}

// acpiOEMID names capsa as the tables' maker.
const acpiOEMID = "CAPSA "

// acpiTable returns body behind a system description table header (ACPI
// 6.5 5.2.6), its checksum set.
func acpiTable(sig string, rev byte, body []byte) []byte {
	le := binary.LittleEndian
	t := make([]byte, acpiHeaderSize, acpiHeaderSize+len(body))
	copy(t, sig)
	le.PutUint32(t[4:], uint32(acpiHeaderSize+len(body)))
	t[8] = rev
	copy(t[10:16], acpiOEMID)
	copy(t[16:24], "CAPSA"+sig) // OEM table id
	le.PutUint32(t[24:], 1)     // OEM revision
	copy(t[28:32], "CAPS")      // creator id
	le.PutUint32(t[32:], 1)     // creator revision
	t = append(t, body...)
	t[9] = checksum(t)
	return t
}

// fadtBody returns the FADT after its header (ACPI 6.5 table 5.9): every
// legacy block absent, the hardware-reduced flag, the reset register, the
// sleep registers and the DSDT.
func fadtBody(dsdt uint64) []byte {
	le := binary.LittleEndian
	f := make([]byte, fadtSize)
	le.PutUint32(f[40:], uint32(dsdt)) // DSDT (32-bit)
	le.PutUint16(f[109:], iapcVGANotPresent|iapcMSINotPresent|iapcPCIeASPMCtrl|iapcCMOSRTCMissing)
	le.PutUint32(f[112:], fadtHWReducedACPI|fadtResetRegSup|fadtPwrButton|fadtSlpButton|fadtHeadless)
	gas(f[116:], acpiResetPort)
	f[128] = acpiResetValue
	f[131] = 5                  // FADT minor version: ACPI 6.5
	le.PutUint64(f[140:], dsdt) // X_DSDT
	gas(f[244:], ACPISleepControlPort)
	gas(f[256:], ACPISleepStatusPort)
	copy(f[268:276], "CAPSAKVM") // hypervisor vendor identity
	return f[acpiHeaderSize:]
}

// gas writes a Generic Address Structure (ACPI 6.5 5.2.3.2) for a one-byte
// register at an I/O port.
func gas(b []byte, port uint64) {
	b[0] = gasSystemIO
	b[1] = 8 // register bit width
	b[2] = 0 // bit offset
	b[3] = 1 // access size: byte
	binary.LittleEndian.PutUint64(b[4:], port)
}

// madtBody returns the MADT after its header (ACPI 6.5 5.2.12): the local
// APIC address, PCAT_COMPAT (KVM's in-kernel 8259s exist), one processor
// local APIC per vCPU, the IOAPIC and every local APIC's LINT1 as NMI, as
// in the MP table.
func madtBody(ncpus int) []byte {
	le := binary.LittleEndian
	b := le.AppendUint32(nil, acpiLAPICAddr)
	b = le.AppendUint32(b, 1) // flags: PCAT_COMPAT
	for id := range ncpus {
		// Processor Local APIC: type 0, length 8, ACPI processor UID,
		// APIC id, flags (Enabled).
		b = append(b, 0, 8, byte(id), byte(id))
		b = le.AppendUint32(b, 1)
	}
	// I/O APIC: type 1, length 12, id, reserved, address, GSI base.
	b = append(b, 1, 12, byte(ncpus), 0)
	b = le.AppendUint32(b, acpiIOAPICAddr)
	b = le.AppendUint32(b, 0)
	// Local APIC NMI: type 4, length 6, every processor (UID 0xff),
	// flags 0 (the bus's default polarity and trigger), LINT1.
	b = append(b, 4, 6, 0xff, 0, 0, 1)
	return b
}

// dsdtAML returns the DSDT's definition block:
//
//	Scope (\_SB) {
//	    Device (COM1) {
//	        Name (_HID, EisaId ("PNP0501"))
//	        Name (_UID, One)
//	        Name (_CRS, ResourceTemplate () {
//	            IO (Decode16, 0x03F8, 0x03F8, 0x00, 0x08)
//	            IRQNoFlags () {4}
//	        })
//	    }
//	}
//	Name (\_S5, Package (0x04) { 0x05, Zero, Zero, Zero })
func dsdtAML() []byte {
	crs := []byte{
		0x47, 0x01, 0xf8, 0x03, 0xf8, 0x03, 0x00, 0x08, // I/O port descriptor: decode16, min, max, alignment, length
		0x22, 0x10, 0x00, // IRQ descriptor, no flags: mask 1<<4
		0x79, 0x00, // end tag, checksum 0: not computed
	}
	com1 := amlConcat(
		amlName("_HID", []byte{amlDWordPrefix, 0x41, 0xd0, 0x05, 0x01}), // EisaId("PNP0501")
		amlName("_UID", []byte{amlOne}),
		amlName("_CRS", amlPkg([]byte{amlBufferOp}, append([]byte{amlBytePrefix, byte(len(crs))}, crs...))),
	)
	sb := amlPkg([]byte{amlScopeOp}, amlConcat([]byte("_SB_"),
		amlPkg([]byte{amlExtOpPrefix, amlDeviceOp}, amlConcat([]byte("COM1"), com1))))
	s5 := amlName("_S5_", amlPkg([]byte{amlPackageOp}, []byte{4, amlBytePrefix, ACPISleepTypeS5, amlZero, amlZero, amlZero}))
	return amlConcat(sb, s5)
}

// AML opcodes and prefixes (ACPI 6.5 chapter 20).
const (
	amlZero        = 0x00
	amlOne         = 0x01
	amlNameOp      = 0x08
	amlBytePrefix  = 0x0a
	amlDWordPrefix = 0x0c
	amlScopeOp     = 0x10
	amlBufferOp    = 0x11
	amlPackageOp   = 0x12
	amlExtOpPrefix = 0x5b
	amlDeviceOp    = 0x82
)

func amlConcat(parts ...[]byte) []byte {
	var b []byte
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

// amlName is Name (seg, value): seg is a 4-character name segment.
func amlName(seg string, value []byte) []byte {
	return append(append([]byte{amlNameOp}, seg...), value...)
}

// amlPkg is op, a PkgLength, then body (which starts with the object's
// name, if it has one; ACPI 6.5 20.2.4 and 20.2.5): the length counts
// itself and body; it takes one byte below 64, else a lead byte with the
// low 4 bits and the count of following bytes (up to 3) with the rest.
func amlPkg(op, body []byte) []byte {
	n := len(body) + 1
	var pl []byte
	switch {
	case n < 1<<6:
		pl = []byte{byte(n)}
	case n+1 < 1<<12:
		n++
		pl = []byte{1<<6 | byte(n&0xf), byte(n >> 4)}
	case n+2 < 1<<20:
		n += 2
		pl = []byte{2<<6 | byte(n&0xf), byte(n >> 4), byte(n >> 12)}
	default:
		n += 3
		pl = []byte{3<<6 | byte(n&0xf), byte(n >> 4), byte(n >> 12), byte(n >> 20)}
	}
	return amlConcat(op, pl, body)
}
