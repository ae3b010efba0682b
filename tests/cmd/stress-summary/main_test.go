package main

import (
	"strings"
	"testing"
)

func TestCountsAttributeL1CrashesToTheRunningVMM(t *testing.T) {
	log := `stress-start: boot|capsa
stress-result: boot|capsa|ok
stress-start: boot|qemu
stress-result: boot|qemu|ok
stress-start: work|capsa
stress-result: work|capsa|reset
stress-start: work|qemu
capsa-nested: nested: the nested L1 host kernel crashed (QEMU TCG's emulated SVM; not the job's doing)
stress-start: boot|capsa
stress-result: boot|capsa|ok
`
	c := counts{}
	if err := c.read(strings.NewReader(log)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		phase, vmm, outcome string
		want                int
	}{
		{"boot", "capsa", "ok", 2},
		{"boot", "qemu", "ok", 1},
		{"work", "capsa", "reset", 1},
		{"work", "qemu", l1Outcome, 1},
	} {
		if got := c[tc.phase][tc.vmm][tc.outcome]; got != tc.want {
			t.Errorf("counts[%s][%s][%s] = %d, want %d", tc.phase, tc.vmm, tc.outcome, got, tc.want)
		}
	}
	if w := c.worse("capsa", "qemu"); len(w) != 0 {
		t.Errorf("worse(capsa, qemu) = %v, want none: both failed 1 of 1 in work", w)
	}
	c.add("boot", "capsa", "hang")
	if w := c.worse("capsa", "qemu"); len(w) != 1 || !strings.HasPrefix(w[0], "boot:") {
		t.Errorf("worse(capsa, qemu) = %v, want the boot phase", w)
	}
	var b strings.Builder
	c.print(&b)
	if !strings.Contains(b.String(), "1 l1-crash") || !strings.Contains(b.String(), "1 hang") {
		t.Errorf("table:\n%s", b.String())
	}
}
