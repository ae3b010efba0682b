package e2e

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Guest triple faults, as the KVM below capsa saw them. KVM clears a
// vCPU's state when the guest shuts down (SVM's shutdown intercept
// reinitialises the VMCB), so capsa's own state dump after a triple fault
// shows only the reset vector; the kvm_exit tracepoint records the RIP and
// the event being delivered at the shutdown exit itself. The tests enable
// it in the nested host (root, tracefs) and print what it caught when a
// test fails; elsewhere this does nothing.

const tracefs = "/sys/kernel/tracing"

// svmExitShutdown is SVM's exit code for a shutdown (triple fault).
const svmExitShutdown = 0x7f

// traceShutdowns starts recording shutdown exits and returns the function
// that prints them (when the run failed) and stops recording.
func traceShutdowns(w io.Writer) func(failed bool) {
	ev := filepath.Join(tracefs, "events", "kvm", "kvm_exit")
	if _, err := os.Stat(ev); err != nil {
		// Mounted nowhere yet (the nested host's minimal init).
		unix.Mount("tracefs", tracefs, "tracefs", 0, "")
		if _, err := os.Stat(ev); err != nil {
			return func(bool) {}
		}
	}
	write := func(p, s string) error { return os.WriteFile(p, []byte(s), 0) }
	if write(filepath.Join(ev, "filter"), fmt.Sprintf("exit_reason == %d", svmExitShutdown)) != nil ||
		write(filepath.Join(tracefs, "trace"), "") != nil ||
		write(filepath.Join(ev, "enable"), "1") != nil {
		return func(bool) {}
	}
	return func(failed bool) {
		defer write(filepath.Join(ev, "enable"), "0")
		if !failed {
			return
		}
		f, err := os.Open(filepath.Join(tracefs, "trace"))
		if err != nil {
			return
		}
		defer f.Close()
		var lines []string
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if l := sc.Text(); strings.Contains(l, "reason shutdown") {
				lines = append(lines, strings.TrimSpace(l))
			}
		}
		if len(lines) > 0 {
			fmt.Fprintf(w, "guest triple faults seen by the KVM below capsa (RIP at the fault; intr_info and error_code: the event being delivered):\n  %s\n", strings.Join(lines, "\n  "))
		}
	}
}
