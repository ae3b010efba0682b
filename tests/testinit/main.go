// Command testinit is the /init of the end-to-end tests' initramfs for the raw
// VMM: it proves the guest reached userspace, reports what it sees, and then
// does what the kernel command line asks (capsa.test=ACTION):
//
//	reboot  reboot the machine (the VMM must exit 0)
//	panic   exit, so the kernel panics with "Attempted to kill init"
//	hang    sleep forever
//	vsock   talk to the host over vsock (see vsockTest), then reboot
//
// It prints its report to /dev/console.
package main

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/internal/bootmark"
)

func main() {
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
	case "vsock":
		if err := vsockTest(); err != nil {
			fmt.Printf("capsa-testinit: vsock: %v\n", err)
		} else {
			fmt.Println("capsa-testinit: vsock ok")
		}
		reboot()
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
