// Command testinit is the /init of the end-to-end tests' initramfs for the raw
// VMM: it proves the guest reached userspace, reports what it sees, and then
// does what the kernel command line asks (capsa.test=ACTION):
//
//	reboot  reboot the machine (the VMM must exit 0)
//	panic   exit, so the kernel panics with "Attempted to kill init"
//	hang    sleep forever
//
// It prints its report to /dev/console.
package main

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/internal/bootmark"
)

func main() {
	unix.Mount("proc", "/proc", "proc", 0, "")
	unix.Mount("sysfs", "/sys", "sysfs", 0, "")
	if err := bootmark.Signal(); err != nil {
		fmt.Printf("testinit: boot marker: %v\n", err)
	}
	cmdline, _ := os.ReadFile("/proc/cmdline")
	online, _ := os.ReadFile("/sys/devices/system/cpu/online")
	var uts unix.Utsname
	unix.Uname(&uts)
	fmt.Printf("capsa-testinit: userspace reached; kernel=%s cpus=%d online=%s\n",
		unix.ByteSliceToString(uts.Release[:]), runtime.NumCPU(), strings.TrimSpace(string(online)))
	action := ""
	for _, f := range strings.Fields(string(cmdline)) {
		if v, ok := strings.CutPrefix(f, "capsa.test="); ok {
			action = v
		}
	}
	switch action {
	case "panic":
		fmt.Println("capsa-testinit: exiting to make the kernel panic")
		os.Exit(3)
	case "hang":
		for {
			time.Sleep(time.Hour)
		}
	default:
		fmt.Println("capsa-testinit: rebooting")
		unix.Sync()
		if err := unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART); err != nil {
			fmt.Printf("capsa-testinit: reboot: %v\n", err)
		}
		select {}
	}
}
