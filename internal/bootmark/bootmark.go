// Package bootmark is the guest side of capsa's boot-time marker: a guest
// program calls Signal once userspace is up, and the VMM records the time.
package bootmark

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/devices"
)

// outb writes v to an x86 I/O port (outb_amd64.s).
func outb(port uint16, v uint8)

// Signal writes the marker to the VMM's debug port. It needs CAP_SYS_RAWIO
// (the guest init has it). I/O permissions belong to an OS thread, so the
// goroutine stays on one from ioperm to the write.
func Signal() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.Ioperm(devices.BootMarkerPort, 1, 1); err != nil {
		return fmt.Errorf("ioperm %#x: %w", devices.BootMarkerPort, err)
	}
	outb(devices.BootMarkerPort, devices.BootMarkerValue)
	return unix.Ioperm(devices.BootMarkerPort, 1, 0)
}
