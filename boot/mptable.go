package boot

import (
	"encoding/binary"
	"fmt"
)

// MP table constants (Intel MultiProcessor Specification 1.4).
const (
	mpSpecRev     = 4
	mpLAPICAddr   = 0xfee0_0000
	mpIOAPICAddr  = 0xfec0_0000
	mpAPICVersion = 0x14
	mpIOAPICVer   = 0x11
	mpIRQs        = 24 // IOAPIC pins

	mpEntryProcessor = 0
	mpEntryBus       = 1
	mpEntryIOAPIC    = 2
	mpEntryIOIntr    = 3
	mpEntryLocalIntr = 4

	mpIntINT    = 0
	mpIntNMI    = 1
	mpIntExtINT = 3

	mpCPUEnabled = 1
	mpCPUBSP     = 2

	mpFloatSize  = 16
	mpHeaderSize = 44

	// MaxMPCPUs is the most vCPUs the table describes: APIC ids are a
	// byte, and the IOAPIC takes the id after the last CPU's.
	MaxMPCPUs = 254
)

// MPTable builds the MP floating pointer and, right after it, the
// configuration table for ncpus vCPUs, to be placed at MPTableAddr: one
// processor entry per vCPU (APIC ids 0..n-1, the first the boot CPU), an
// ISA bus, one IOAPIC (id n, at 0xfec00000) whose pins 0-23 carry IRQs
// 0-23, and every local APIC's LINT0 as ExtINT and LINT1 as NMI.
//
// The table lives in the BIOS area rather than at the end of base memory
// (0x9fc00): the 1 KiB there holds entries for only 37 CPUs, and Linux
// scans both places for the floating pointer.
func MPTable(ncpus int) ([]byte, error) {
	if ncpus < 1 || ncpus > MaxMPCPUs {
		return nil, fmt.Errorf("boot: MP table for %d CPUs: must be between 1 and %d", ncpus, MaxMPCPUs)
	}
	le := binary.LittleEndian
	var entries []byte
	count := 0
	add := func(e []byte) { entries = append(entries, e...); count++ }
	for id := range ncpus {
		e := make([]byte, 20)
		e[0] = mpEntryProcessor
		e[1] = byte(id)
		e[2] = mpAPICVersion
		e[3] = mpCPUEnabled
		if id == 0 {
			e[3] |= mpCPUBSP
		}
		le.PutUint32(e[4:], 0x600)     // CPU signature: family 6
		le.PutUint32(e[8:], 1<<0|1<<9) // features: FPU, APIC
		add(e)
	}
	add([]byte{mpEntryBus, 0, 'I', 'S', 'A', ' ', ' ', ' '})
	ioapicID := byte(ncpus)
	ioapic := []byte{mpEntryIOAPIC, ioapicID, mpIOAPICVer, 1, 0, 0, 0, 0}
	le.PutUint32(ioapic[4:], mpIOAPICAddr)
	add(ioapic)
	for irq := range mpIRQs {
		// Flags 0: the bus's default (conforming) polarity and trigger.
		add([]byte{mpEntryIOIntr, mpIntINT, 0, 0, 0, byte(irq), ioapicID, byte(irq)})
	}
	add([]byte{mpEntryLocalIntr, mpIntExtINT, 0, 0, 0, 0, 0xff, 0})
	add([]byte{mpEntryLocalIntr, mpIntNMI, 0, 0, 0, 0, 0xff, 1})

	table := make([]byte, mpFloatSize+mpHeaderSize+len(entries))
	fp, hdr := table[:mpFloatSize], table[mpFloatSize:]
	copy(fp, "_MP_")
	le.PutUint32(fp[4:], MPTableAddr+mpFloatSize) // the config table follows
	fp[8] = 1                                     // length in 16-byte units
	fp[9] = mpSpecRev
	fp[10] = checksum(fp)

	copy(hdr, "PCMP")
	le.PutUint16(hdr[4:], uint16(len(hdr)))
	hdr[6] = mpSpecRev
	copy(hdr[8:16], "CAPSA   ")
	copy(hdr[16:28], "MICROVM     ")
	le.PutUint16(hdr[34:], uint16(count))
	le.PutUint32(hdr[36:], mpLAPICAddr)
	copy(hdr[mpHeaderSize:], entries)
	hdr[7] = checksum(hdr)
	if MPTableAddr+len(table) > BIOSEnd {
		return nil, fmt.Errorf("boot: MP table for %d CPUs is %d bytes, more than fit at %#x", ncpus, len(table), MPTableAddr)
	}
	return table, nil
}

// checksum returns the byte that makes b sum to zero (b's checksum byte
// must be zero when called).
func checksum(b []byte) byte {
	var s byte
	for _, c := range b {
		s += c
	}
	return -s
}
