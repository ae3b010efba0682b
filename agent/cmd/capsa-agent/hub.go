package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/hub/proto"
)

// guestCommand is where every guest finds capsa's own command: the
// initramfs links it to this binary, and an image gets this binary bound
// there (bindGuestCommand).
const guestCommand = "/usr/local/bin/capsa"

// runGuestCommand is this binary run as `capsa` inside a sandbox: the
// hub's `capsa kv ...` and `capsa mailbox ...`, over vsock to the host.
func runGuestCommand(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		w := stderr
		if len(args) > 0 {
			w = stdout
		}
		fmt.Fprintf(w, "usage: capsa kv|mailbox VERB ...\n\nInside a sandbox, capsa reaches the host's key-value store and mailbox\n(what the sandbox was granted with --kv and --mailbox). Run `capsa kv --help`\nor `capsa mailbox --help` for the verbs.\n")
		if len(args) == 0 {
			return proto.ExitUsage
		}
		return 0
	}
	if args[0] != "kv" && args[0] != "mailbox" {
		fmt.Fprintf(stderr, "capsa %s: not available inside a sandbox (here capsa has kv and mailbox)\n", args[0])
		return proto.ExitUsage
	}
	c := &proto.Client{Dial: func(ctx context.Context) (net.Conn, error) {
		return vsock.Dial(vsock.Host, proto.Port, nil)
	}}
	defer c.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, unix.SIGTERM)
	defer stop()
	return proto.RunCLI(ctx, c, args, stdin, stdout, stderr)
}

// bindGuestCommand makes guestCommand this binary in an image's root
// (where the initramfs's link is not), read-only. /proc/self/exe is a
// magic link to this very file, so it is reachable after the chroot.
func bindGuestCommand() error {
	if err := os.MkdirAll(filepath.Dir(guestCommand), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(guestCommand, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o755)
	if err != nil {
		return fmt.Errorf("make %s: %w", guestCommand, err)
	}
	f.Close()
	if err := unix.Mount("/proc/self/exe", guestCommand, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", guestCommand, err)
	}
	return unix.Mount("", guestCommand, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, "")
}
