package vmm

import (
	"errors"
	"testing"
)

// TestExitUnexplained: a front end shows the VM's state with a stop
// nobody asked for, and not with a clean end or the host's own stop.
func TestExitUnexplained(t *testing.T) {
	d := &Debug{}
	for _, tc := range []struct {
		exit *Exit
		want *Debug
	}{
		{nil, nil},
		{&Exit{Reason: StopPowerOff, Debug: d}, nil},
		{&Exit{Reason: StopReboot, Debug: d}, nil},
		{&Exit{Reason: StopCanceled, Debug: d}, nil},
		{&Exit{Reason: StopError, Err: errors.New("KVM_RUN: EFAULT"), Debug: d}, d},
		{&Exit{Reason: StopTripleFault, Debug: d}, d},
		{&Exit{Reason: StopHung, Debug: d}, d},
		{&Exit{Reason: StopHalted}, nil},
	} {
		if got := tc.exit.Unexplained(); got != tc.want {
			t.Errorf("%v.Unexplained() = %p; want %p", tc.exit, got, tc.want)
		}
	}
}
