package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// defaultCmdline keeps the console quiet (every byte costs a VM exit),
// resets through the i8042 on reboot, and turns a panic into a reset.
const defaultCmdline = "console=ttyS0 quiet reboot=k panic=-1"

func runVM(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("vm", "[--kernel PATH] [--initrd PATH] [--cmdline \"...\"] [--cpus N] [--memory SIZE]", stdout)
	kernel := fs.String("kernel", "", "kernel image: a vmlinux ELF or a bzImage (default: the built-in kernel)")
	initrd := fs.String("initrd", "", "initramfs to load (default: none)")
	cmdline := fs.String("cmdline", defaultCmdline, "kernel command line")
	appendArgs := fs.String("append", "", "arguments appended to the kernel command line")
	cpus := fs.Int("cpus", 1, "number of vCPUs")
	memory := fs.String("memory", "512M", "guest memory (e.g. 512M, 2G)")
	console := fs.String("console", "-", "where the guest console goes: - for the terminal, or a file path")
	bootTime := fs.Bool("boot-time", false, "print the time from VMM start to guest userspace, where it went (the VMM's steps, the guest's milestones) and the VM exits until then")
	disks := fs.StringArray("disk", nil, "attach a host file as a virtio block device, /dev/vda, /dev/vdb... in order: PATH[:ro] (repeatable)")
	verbose := fs.BoolP("verbose", "v", false, "log VMM events to stderr")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "capsa vm: "+format+"\n", a...)
		return 2
	}
	if fs.NArg() > 0 {
		return fail("unexpected argument %q", fs.Arg(0))
	}
	mem, err := parseSize(*memory)
	if err != nil {
		return fail("--memory: %v", err)
	}
	raw := sandbox.RawVM{Kernel: *kernel, Initrd: *initrd, Cmdline: *cmdline, CPUs: *cpus, MemoryBytes: mem,
		Disks: *disks, Console: stdout, ConsoleInput: os.Stdin, Start: startTime}
	if *appendArgs != "" {
		raw.Cmdline += " " + *appendArgs
	}
	if *console != "-" {
		f, err := os.Create(*console)
		if err != nil {
			return fail("--console: %v", err)
		}
		defer f.Close()
		raw.Console = f
	}
	if err := raw.Check(); err != nil {
		return fail("%v", err)
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelDebug
	}
	raw.Log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	m, err := raw.Boot(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "capsa vm: %v\n", err)
		return 1
	}
	// SIGQUIT prints the VM's state (vCPUs, virtqueues, console tail) and
	// lets it run on: how to look inside a guest that seems stuck.
	quit := make(chan os.Signal, 1)
	signal.Notify(quit, syscall.SIGQUIT)
	go func() {
		for range quit {
			fmt.Fprintf(stderr, "capsa vm: SIGQUIT: %s", m.Debug(ctx))
		}
	}()
	exit := m.Run(ctx)
	signal.Stop(quit)
	close(quit)
	bootTL, booted := m.BootTimeline()
	m.Close()
	if *bootTime {
		if exit.BootTime > 0 {
			fmt.Fprintf(stderr, "capsa vm: boot time: guest userspace reached after %.1f ms\n", float64(exit.BootTime.Microseconds())/1000)
			if booted {
				fmt.Fprintf(stderr, "capsa vm: boot %s", bootTL)
			}
		} else {
			fmt.Fprintf(stderr, "capsa vm: boot time: the guest never signalled userspace (port %#x)\n", 0x3f0)
		}
	}
	fmt.Fprintf(stderr, "capsa vm: %s\n", exit)
	if d := exit.Unexplained(); d != nil {
		fmt.Fprintf(stderr, "capsa vm: %s", d)
	}
	if exit.Reason.Clean() {
		return 0
	}
	return 1
}
