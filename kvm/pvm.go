package kvm

import "os"

// IsPVM reports whether /dev/kvm is served by PVM (the kvm_pvm module), a
// software KVM some cloud VMs offer without hardware virtualization. PVM
// runs the KVM API, so capsa's own tests of it pass, but it reaches a stock
// Linux guest's instructions through an emulator that stops at some of
// them (seen: cmpxchg16b in SLUB and xrstor in FPU init, each ending the
// boot with KVM_EXIT_INTERNAL_ERROR), so it cannot boot capsa's guest.
func IsPVM() bool {
	_, err := os.Stat("/sys/module/kvm_pvm")
	return err == nil
}
