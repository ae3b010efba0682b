// Command initramfs builds capsa's guest initramfs with u-root: u-root's
// core commands (those a sandbox can use: coreCommands) compiled into two
// busybox-style binaries, gosh as /bin/sh (so `sh -c` works), and capsa's
// guest agent as /init.
//
// Two busyboxes, because a Go busybox runs the init functions of every
// package any of its commands links before it looks at argv[0]: with the
// shell's line editor, net/http, TLS and strace's tables in the same
// binary, `true` took twice as long to run as a Go program that links
// none of them (BenchmarkExecTrue). The commands that link the network
// stack, TLS, a terminal UI, the crypto hashes, compression, archive
// formats or ELF and DWARF (heavyCommands) are /bbin/bbx; the rest, what
// a sandbox runs most (ls, cat, cp, mkdir, grep, true...), are /bbin/bb.
//
//	go run . -agent PATH -o OUT.cpio
//
// It is its own module: u-root v0.16 and hugelgupf/p9 (which the VMM needs)
// cannot be tidied into one module.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path"
	"path/filepath"

	"github.com/u-root/gobusybox/src/pkg/bb"
	"github.com/u-root/gobusybox/src/pkg/golang"
	"github.com/u-root/mkuimage/cpio"
	"github.com/u-root/mkuimage/uimage"
	"github.com/u-root/mkuimage/uimage/builder"
	"github.com/u-root/mkuimage/uimage/initramfs"
	"github.com/u-root/uio/llog"
)

func main() {
	agent := flag.String("agent", "", "the static capsa-agent binary, installed as /init")
	out := flag.String("o", "", "output cpio archive")
	verbose := flag.Bool("v", false, "log the build")
	flag.Parse()
	if *agent == "" || *out == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: initramfs -agent PATH -o OUT.cpio")
		os.Exit(2)
	}
	if st, err := os.Stat(*agent); err != nil || !st.Mode().IsRegular() {
		fmt.Fprintf(os.Stderr, "initramfs: -agent %s: not a regular file\n", *agent)
		os.Exit(2)
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	l := llog.New(level, func(format string, v ...any) { fmt.Fprintf(os.Stderr, format+"\n", v...) })
	tmp, err := os.MkdirTemp("", "capsa-initramfs-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "initramfs: %v\n", err)
		os.Exit(1)
	}
	defer os.RemoveAll(tmp)
	err = uimage.Create(l,
		uimage.WithTempDir(tmp),
		uimage.WithReplaceEnv(golang.Default(golang.DisableCGO())),
		uimage.WithBaseArchive(uimage.DefaultRamfs()),
		uimage.WithCPIOOutput(*out),
		// Every core command but those for machines a sandbox is not:
		// boot loaders and firmware tables, hardware (PCI, MSRs, port
		// I/O, watchdogs, the RTC), kernel modules (the guest kernel
		// has none), service managers, remote logins and network
		// configuration (the agent sets the guest up; the host keeps
		// its time). They were 4.6 MB of the 15.8 MB busybox binary,
		// 1.2 MB of the compressed initramfs capsa embeds.
		uimage.WithBusyboxCommands(coreCommands...),
		uimage.WithCommands(nil, namedBusybox("bbx"), heavyCommands...),
		uimage.WithShell("gosh"),
		uimage.WithFiles(*agent+":bin/capsa-agent"),
		// The agent is PID 1: it sets the machine up and reaps orphans.
		uimage.WithSymlink("init", "/bin/capsa-agent"),
		// Run as capsa, the agent is the guest's command for the
		// host's key-value store and mailbox.
		uimage.WithSymlink("usr/local/bin/capsa", "/bin/capsa-agent"),
	)
	if err != nil {
		os.RemoveAll(tmp)
		fmt.Fprintf(os.Stderr, "initramfs: %v\n", err)
		os.Exit(1)
	}
}

// coreCommands are u-root's core commands without those a sandbox has no
// use for (see main).
var coreCommands = func() []string {
	const core = "github.com/u-root/u-root/cmds/core/"
	cmds := []string{core + "*"}
	for _, c := range []string{
		"init", "switch_root", "sluinit", "kexec", "gpt", "rsdp", "lockmsrs", "msr", "pci", "io",
		"lsdrivers", "hwclock", "watchdog", "watchdogd", "insmod", "rmmod", "lsmod",
		"service", "update-rc.d", "sshd", "scp", "gpgv", "brctl", "dhclient", "ntpdate",
	} {
		cmds = append(cmds, "-"+core+c)
	}
	for _, c := range heavyCommands {
		cmds = append(cmds, "-"+c)
	}
	return cmds
}()

// heavyCommands are the core commands whose packages' init functions are
// most of a busybox's start (GODEBUG=inittrace=1 in the guest): those that
// link the network stack, TLS or a terminal UI (gosh, wget, netcat,
// netstat, ping, ip, strace), the crypto hashes (blkid, md5sum, shasum),
// compression and archives (gzip, tar, cpio) and ELF and DWARF
// (lddfiles). They get their own busybox (see the package comment). Any
// core command can be listed here; one that is not stays in /bbin/bb.
var heavyCommands = func() []string {
	const core = "github.com/u-root/u-root/cmds/core/"
	var cmds []string
	for _, c := range []string{
		"gosh", "wget", "netcat", "netstat", "ping", "ip", "strace",
		"blkid", "md5sum", "shasum", "gzip", "tar", "cpio", "lddfiles",
	} {
		cmds = append(cmds, core+c)
	}
	return cmds
}()

// namedBusybox builds its commands into one busybox binary at /bbin/NAME,
// with /bbin/COMMAND symlinks to it. It is uimage's GBBBuilder with another
// name: that one always writes /bbin/bb, and an initramfs with two
// busyboxes needs two names.
type namedBusybox string

func (namedBusybox) DefaultBinaryDir() string { return "bbin" }

func (b namedBusybox) Build(l *llog.Logger, af *initramfs.Files, opts builder.Opts) error {
	if opts.TempDir == "" || opts.Env == nil {
		return fmt.Errorf("busybox %s: no temporary directory or Go environment", string(b))
	}
	bin := filepath.Join(opts.TempDir, string(b))
	err := bb.BuildBusybox(l.AtLevel(slog.LevelInfo), &bb.Opts{
		Env:          opts.Env,
		GenSrcDir:    opts.TempDir,
		CommandPaths: opts.Packages,
		BinaryPath:   bin,
		GoBuildOpts:  opts.BuildOpts,
	})
	if err != nil {
		return fmt.Errorf("busybox %s: %w", string(b), err)
	}
	if err := af.AddFile(bin, path.Join(opts.BinaryDir, string(b))); err != nil {
		return err
	}
	for _, pkg := range opts.Packages {
		if err := af.AddRecord(cpio.Symlink(path.Join(opts.BinaryDir, path.Base(pkg)), string(b))); err != nil {
			return err
		}
	}
	return nil
}
