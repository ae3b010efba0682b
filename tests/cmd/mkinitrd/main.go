// Command mkinitrd writes a minimal initramfs: a static /init program, the
// /dev/console node the kernel opens for it, and the mount points it uses.
//
//	mkinitrd -init PATH -o OUT.cpio
package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"

	"github.com/capsa-sandbox/capsa/internal/cpio"
)

func main() {
	init := flag.String("init", "", "static binary to install as /init")
	out := flag.String("o", "", "output cpio archive")
	flag.Parse()
	if *init == "" || *out == "" {
		fmt.Fprintln(os.Stderr, "usage: mkinitrd -init PATH -o OUT.cpio")
		os.Exit(2)
	}
	if err := write(*init, *out); err != nil {
		fmt.Fprintf(os.Stderr, "mkinitrd: %v\n", err)
		os.Exit(1)
	}
}

func write(init, out string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(f)
	w := cpio.NewWriter(bw)
	for _, step := range []func() error{
		func() error { return w.Dir("dev", 0o755) },
		func() error { return w.CharDev("dev/console", 0o600, 5, 1) },
		func() error { return w.Dir("proc", 0o755) },
		func() error { return w.Dir("sys", 0o755) },
		func() error { return w.Dir("tmp", 0o1777) },
		func() error { return w.CopyFile("init", init, 0o755) },
		w.Close, bw.Flush, f.Close,
	} {
		if err := step(); err != nil {
			f.Close()
			return err
		}
	}
	return nil
}
