// Command packassets packs a guest kernel and initramfs into an asset set
// (package assets): `make capsa` runs it to make build/assets, which it
// embeds in capsa, leaves in the build cache and `make install` installs.
//
//	packassets -version V -o DIR [-o DIR...] KERNEL INITRAMFS
//
// It compresses with the zstd command (level 20): klauspost/compress's
// encoder, which capsa decodes with, compresses these files 1.2 MB less
// well at its best level. Compressed files are kept in
// $CAPSA_CACHE/zstd under their content's hash, so packing the same
// kernel again takes no time.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/capsa-sandbox/capsa/internal/assets"
)

func main() {
	version := flag.String("version", "dev", "the capsa version the set is built from")
	var outs []string
	flag.Func("o", "a directory to write the set to (repeatable)", func(s string) error { outs = append(outs, s); return nil })
	flag.Parse()
	if len(outs) == 0 || flag.NArg() != 2 {
		fmt.Fprintln(os.Stderr, "usage: packassets -version V -o DIR [-o DIR...] KERNEL INITRAMFS")
		os.Exit(2)
	}
	cache := ""
	if d := os.Getenv("CAPSA_CACHE"); d != "" {
		cache = filepath.Join(d, "zstd")
	}
	for _, out := range outs {
		m, err := assets.Pack(out, *version, flag.Arg(0), flag.Arg(1), func(src, dst, sum string) error { return compress(cache, src, dst, sum) })
		if err != nil {
			fmt.Fprintf(os.Stderr, "packassets: %v\n", err)
			os.Exit(1)
		}
		for _, f := range []assets.File{m.Kernel, m.Initramfs} {
			st, err := os.Stat(filepath.Join(out, f.Name))
			if err != nil {
				fmt.Fprintf(os.Stderr, "packassets: %v\n", err)
				os.Exit(1)
			}
			fmt.Fprintf(os.Stderr, "packassets: %s: %d bytes from %d\n", filepath.Join(out, f.Name), st.Size(), f.Size)
		}
	}
}

// compress writes src (content hash sum) compressed to dst, through the
// cache when there is one.
func compress(cache, src, dst, sum string) error {
	if cache == "" {
		return zstd(src, dst)
	}
	cached := filepath.Join(cache, sum+".zst")
	if _, err := os.Stat(cached); err != nil {
		if err := os.MkdirAll(cache, 0o755); err != nil {
			return err
		}
		if err := zstd(src, cached+".tmp"); err != nil {
			return err
		}
		if err := os.Rename(cached+".tmp", cached); err != nil {
			return err
		}
	}
	return copyFile(cached, dst)
}

func zstd(src, dst string) error {
	cmd := exec.Command("zstd", "-q", "-f", "--ultra", "-20", "-T0", src, "-o", dst)
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("zstd %s: %w", src, err)
	}
	return nil
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
