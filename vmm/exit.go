package vmm

import (
	"fmt"
	"time"
)

// StopReason says why a VM stopped.
type StopReason int

const (
	// StopReboot: the guest reset itself, through the i8042 (reboot=k, or
	// the ACPI reset register, which is the i8042's), a triple fault, or a
	// reset system event. capsa treats a guest reset as its clean exit:
	// its own kernel has no ACPI and cannot power off.
	StopReboot StopReason = iota + 1
	// StopPanic: the guest kernel panicked (and, with panic=-1, reset).
	StopPanic
	// StopPowerOff: the guest powered off through the ACPI sleep control
	// register (S5), or asked KVM for a shutdown system event.
	StopPowerOff
	// StopHalted: a vCPU halted with interrupts disabled forever.
	StopHalted
	// StopCanceled: the host stopped the VM (context canceled).
	StopCanceled
	// StopError: the VMM could not go on (a failed ioctl, an entry failure,
	// an internal KVM error).
	StopError
	// StopTripleFault: a vCPU hit a fault while delivering a double
	// fault (KVM_EXIT_SHUTDOWN). A PC resets then; capsa reports it as the
	// guest's failure, never as a clean reboot.
	StopTripleFault
	// StopHung: the host stopped a guest that made no progress (for
	// example the sandbox's watchdog: its agent stopped answering and its
	// vCPUs stood still).
	StopHung
)

func (r StopReason) String() string {
	switch r {
	case StopReboot:
		return "guest rebooted"
	case StopPanic:
		return "guest kernel panic"
	case StopPowerOff:
		return "guest powered off"
	case StopHalted:
		return "guest halted"
	case StopCanceled:
		return "stopped by the host"
	case StopError:
		return "VMM error"
	case StopTripleFault:
		return "guest triple fault"
	case StopHung:
		return "guest hung"
	}
	return fmt.Sprintf("StopReason(%d)", int(r))
}

// Clean reports whether the stop counts as a successful run.
func (r StopReason) Clean() bool { return r == StopReboot || r == StopPowerOff }

// Exit describes how a VM stopped.
type Exit struct {
	Reason StopReason
	Detail string // the panic message, the failing operation, ...
	Err    error  // for StopError
	// BootTime is the time from the VMM's start to the guest's boot marker;
	// zero if the guest never wrote it.
	BootTime time.Duration
	// Debug is the VM's state after a stop that is not clean: the vCPUs'
	// registers, the virtqueues, the console's tail.
	Debug *Debug
}

func (e *Exit) String() string {
	s := e.Reason.String()
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unexplained is the VM's state to show with a stop the host did not ask
// for and the guest did not end cleanly (nil otherwise): what a front end
// prints beside the error.
func (e *Exit) Unexplained() *Debug {
	if e == nil || e.Reason == StopCanceled || e.Reason.Clean() {
		return nil
	}
	return e.Debug
}
