// Command testinit is the /init of the end-to-end tests' initramfs for the raw
// VMM: it proves the guest reached userspace, reports what it sees, and then
// does what the kernel command line asks (capsa.test=ACTION):
//
//	reboot  reboot the machine (the VMM must exit 0)
//	poweroff  power the machine off (through ACPI, where the kernel has it)
//	panic   exit, so the kernel panics with "Attempted to kill init"
//	hang    sleep forever
//	vsock   talk to the host over vsock (see vsockTest), then reboot
//	info    print the CPU flags and the kernel log, then reboot
//	stress  run the stress workload capsa.stress=CONFIG names (see
//	        tests/stressload), mounting the 9p share tagged "stress" first
//
// Run as a program rather than as init (`testinit stress CONFIG`), it runs
// the stress workload and exits: that is how a capsa sandbox runs it.
//
// It prints its report to /dev/console.
package main

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/internal/bootmark"
	"github.com/capsa-sandbox/capsa/tests/stressload"
)

func main() {
	if os.Getpid() != 1 {
		if len(os.Args) == 3 && os.Args[1] == "stress" {
			if err := stress(os.Args[2], false); err != nil {
				fmt.Fprintf(os.Stderr, "testinit: %v\n", err)
				os.Exit(1)
			}
			return
		}
		fmt.Fprintln(os.Stderr, "usage: testinit stress CONFIG (or as a VM's /init)")
		os.Exit(2)
	}
	unix.Mount("proc", "/proc", "proc", 0, "")
	unix.Mount("sysfs", "/sys", "sysfs", 0, "")
	unix.Mount("devtmpfs", "/dev", "devtmpfs", 0, "")
	if err := bootmark.Signal(); err != nil {
		fmt.Printf("testinit: boot marker: %v\n", err)
	}
	cmdline, _ := os.ReadFile("/proc/cmdline")
	online, _ := os.ReadFile("/sys/devices/system/cpu/online")
	var uts unix.Utsname
	unix.Uname(&uts)
	fmt.Printf("capsa-testinit: userspace reached; kernel=%s cpus=%d online=%s\n",
		unix.ByteSliceToString(uts.Release[:]), runtime.NumCPU(), strings.TrimSpace(string(online)))
	action, stressConfig := "", ""
	for _, f := range strings.Fields(string(cmdline)) {
		if v, ok := strings.CutPrefix(f, "capsa.test="); ok {
			action = v
		}
		if v, ok := strings.CutPrefix(f, "capsa.stress="); ok {
			stressConfig = v
		}
	}
	switch action {
	case "panic":
		fmt.Println("capsa-testinit: exiting to make the kernel panic")
		os.Exit(3)
	case "vsock":
		if err := vsockTest(); err != nil {
			fmt.Printf("capsa-testinit: vsock: %v\n", err)
		} else {
			fmt.Println("capsa-testinit: vsock ok")
		}
		reboot()
	case "stress":
		if err := stress(stressConfig, true); err != nil {
			fmt.Printf("capsa-testinit: stress: %v\n", err)
		}
		reboot()
	case "info":
		cpuinfo, _ := os.ReadFile("/proc/cpuinfo")
		for _, l := range strings.Split(string(cpuinfo), "\n") {
			if strings.HasPrefix(l, "flags") || strings.HasPrefix(l, "model name") {
				fmt.Printf("capsa-testinit: %s\n", l)
			}
		}
		buf := make([]byte, 1<<20)
		if n, err := unix.Klogctl(unix.SYSLOG_ACTION_READ_ALL, buf); err == nil {
			fmt.Printf("capsa-testinit: kernel log:\n%s\n", buf[:n])
		}
		reboot()
	case "poweroff":
		fmt.Println("capsa-testinit: powering off")
		unix.Sync()
		if err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
			fmt.Printf("capsa-testinit: power off: %v\n", err)
		}
		select {}
	case "hang":
		for {
			time.Sleep(time.Hour)
		}
	default:
		reboot()
	}
}

func reboot() {
	fmt.Println("capsa-testinit: rebooting")
	unix.Sync()
	if err := unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART); err != nil {
		fmt.Printf("capsa-testinit: reboot: %v\n", err)
	}
	select {}
}

// vsockTest connects to the host's port 1024, sends a greeting and reads
// the reply to EOF; then listens on port 1025 and echoes one host
// connection back until the host half-closes it.
func vsockTest() error {
	c, err := vsock.Dial(vsock.Host, 1024, nil)
	if err != nil {
		return fmt.Errorf("dial host: %w", err)
	}
	if _, err := c.Write([]byte("hello from the guest\n")); err != nil {
		return err
	}
	c.CloseWrite()
	reply, err := io.ReadAll(c)
	if err != nil {
		return fmt.Errorf("read reply: %w", err)
	}
	c.Close()
	fmt.Printf("capsa-testinit: host said %q\n", reply)
	l, err := vsock.Listen(1025, nil)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	defer l.Close()
	e, err := l.Accept()
	if err != nil {
		return fmt.Errorf("accept: %w", err)
	}
	defer e.Close()
	n, err := io.Copy(e, e)
	if err != nil {
		return fmt.Errorf("echo: %w", err)
	}
	e.(*vsock.Conn).CloseWrite()
	fmt.Printf("capsa-testinit: echoed %d bytes\n", n)
	return nil
}

// stress runs the stress workload; as init, it first mounts the 9p share
// tagged "stress" at the workload's directory, as capsa's agent mounts a
// share (the same options).
func stress(config string, mount bool) error {
	c, err := stressload.Parse(config)
	if err != nil {
		return err
	}
	if mount && slices.Contains(c.Work, "9p") {
		os.MkdirAll(c.Dir, 0o755)
		if err := unix.Mount("stress", c.Dir, "9p", 0, "trans=virtio,version=9p2000.L,access=client,msize=262144"); err != nil {
			return fmt.Errorf("mount 9p share at %s: %w", c.Dir, err)
		}
		defer unix.Unmount(c.Dir, 0)
	}
	return stressload.Run(c, os.Stdout)
}
