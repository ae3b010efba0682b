package devices

// ACPISleep is a hardware-reduced ACPI machine's sleep control and status
// registers (ACPI 6.5 4.8.3.7), one byte each at consecutive ports: the
// guest powers off by writing SLP_EN with the SLP_TYP of \_S5 to the
// control register, which calls poweroff. Other sleep states are not
// offered (the DSDT declares only \_S5), so their writes are ignored and
// the guest runs on. The status register reads 0 (no wake event) and
// ignores writes (the guest clears WAK_STS before sleeping).
type ACPISleep struct {
	s5       byte
	poweroff func()
}

// Sleep control register bits.
const (
	acpiSleepEnable    = 0x20 // SLP_EN
	acpiSleepTypeShift = 2    // SLP_TYP, bits 2-4
	acpiSleepTypeMask  = 0x7
)

// NewACPISleep returns the registers for a guest told that \_S5's SLP_TYP
// is s5.
func NewACPISleep(s5 byte, poweroff func()) *ACPISleep {
	return &ACPISleep{s5: s5, poweroff: poweroff}
}

// Read implements Device: both registers read 0.
func (a *ACPISleep) Read(_ uint64, data []byte) { clear(data) }

// Write implements Device.
func (a *ACPISleep) Write(off uint64, data []byte) {
	if off != 0 || len(data) == 0 {
		return
	}
	v := data[0]
	if v&acpiSleepEnable != 0 && v>>acpiSleepTypeShift&acpiSleepTypeMask == a.s5 && a.poweroff != nil {
		a.poweroff()
	}
}
