// Command sandbox shows capsa as a library: it starts a sandbox, runs a
// command, moves a file in and out, asks the guest about itself, and shuts
// the sandbox down.
//
// Built as any Go program is, it boots the guest kernel and initramfs
// found where `make capsa` leaves them (the build cache) or `make install`
// puts them (/usr/local/share/capsa), or in $CAPSA_ASSETS:
//
//	go build ./examples/sandbox
//
// Built with the capsa_builtin tag after `make capsa`, it carries them
// inside, as the capsa binary does:
//
//	go build -tags capsa_builtin ./examples/sandbox
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "example: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	b := sandbox.New().CPUs(2).Memory(256).Env("GREETING=hello")
	if k := os.Getenv("CAPSA_KERNEL"); k != "" { // an override, as tests use
		b.Kernel(k)
	}
	if i := os.Getenv("CAPSA_INITRD"); i != "" {
		b.Initrd(i)
	}
	sb, err := b.Run("sleep", "3600").Start(ctx) // the sandbox's main process
	if err != nil {
		return err
	}
	defer sb.Close()

	out, err := sb.Exec(ctx, sandbox.Shell(`echo "$GREETING from $(hostname)"`))
	if err != nil {
		return err
	}
	fmt.Printf("exec: %s", out.Stdout)

	if err := sb.WriteFile(ctx, "/tmp/in.txt", []byte("capsa\n"), 0o644); err != nil {
		return err
	}
	if _, err := sb.Exec(ctx, sandbox.Shell(`echo "$(cat /tmp/in.txt) was here" > /tmp/out.txt`)); err != nil {
		return err
	}
	data, err := sb.ReadFile(ctx, "/tmp/out.txt")
	if err != nil {
		return err
	}
	fmt.Printf("file: %s", data)

	info, err := sb.Info(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("info: kernel %s, %d CPUs, %d MiB\n", info.KernelVersion, info.CPUs, info.MemoryBytes>>20)
	return sb.Shutdown(ctx)
}
