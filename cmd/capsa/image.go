package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/capsa-sandbox/capsa/image"
)

// runImage is `capsa image VERB ...`.
func runImage(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runVerbs(ctx, "image", map[string]func(context.Context, []string, io.Writer, io.Writer) int{
		"pull": imagePull, "ls": imageList, "rm": imageRemove, "inspect": imageInspect,
		"prune": imagePrune, "import": imageImport,
	}, args, stdout, stderr)
}

func openStore(stderr io.Writer, name string) (*image.Store, bool) {
	dir, err := image.DefaultDir()
	if err == nil {
		var s *image.Store
		if s, err = image.Open(dir, nil); err == nil {
			return s, true
		}
	}
	fmt.Fprintf(stderr, "capsa image %s: %v\n", name, err)
	return nil, false
}

// pullProgress shows per-layer progress (bytes and rate) on a terminal
// and nothing otherwise.
func pullProgress(w io.Writer) func(image.Progress) {
	if !isTerminal(w) {
		return nil
	}
	start := time.Now()
	var shown time.Time // the last in-flight line, redrawn at most 10 times a second
	return func(p image.Progress) {
		if !p.Complete && time.Since(shown) < 100*time.Millisecond {
			return
		}
		shown = time.Now()
		switch {
		case p.Layer < 0:
			fmt.Fprintf(w, "\rconverted to a root filesystem: %s of files%s\n", mib(p.Done), strings.Repeat(" ", 20))
		case p.Cached && p.Complete:
			fmt.Fprintf(w, "layer %d/%d %s: cached\n", p.Layer+1, p.Layers, short(p.Digest))
		default:
			rate := float64(p.Done) / time.Since(start).Seconds()
			end := ""
			if p.Complete {
				end = "\n"
				start = time.Now()
			}
			fmt.Fprintf(w, "\rlayer %d/%d %s: %s / %s (%s/s)   %s", p.Layer+1, p.Layers, short(p.Digest), mib(p.Done), mib(p.Total), mib(int64(rate)), end)
		}
	}
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

func short(digest string) string {
	d := strings.TrimPrefix(digest, "sha256:")
	if len(d) > 12 {
		d = d[:12]
	}
	return d
}

func imagePull(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("image pull", "[--insecure-registry HOST]... REF", stdout)
	insecure := fs.StringArray("insecure-registry", nil, "reach this registry (host[:port]) over plain HTTP; loopback registries always are")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "capsa image pull: want one image reference")
		return 2
	}
	s, ok := openStore(stderr, "pull")
	if !ok {
		return 1
	}
	img, err := s.Pull(ctx, fs.Arg(0), image.Options{Insecure: *insecure, Progress: pullProgress(stderr)})
	if err != nil {
		fmt.Fprintf(stderr, "capsa image pull: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, img.Digest)
	return 0
}

func imageImport(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("image import", "FILE [REF]   (a docker save tarball or an OCI image layout directory)", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() < 1 || fs.NArg() > 2 {
		fmt.Fprintln(stderr, "capsa image import: want FILE [REF]")
		return 2
	}
	s, ok := openStore(stderr, "import")
	if !ok {
		return 1
	}
	img, err := s.Import(ctx, fs.Arg(0), fs.Arg(1), image.Options{Progress: pullProgress(stderr)})
	if err != nil {
		fmt.Fprintf(stderr, "capsa image import: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, img.Digest)
	return 0
}

func imageList(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("image ls", "[--format table|json]", stdout)
	format := fs.String("format", "table", "table or json")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	s, ok := openStore(stderr, "ls")
	if !ok {
		return 1
	}
	imgs, err := s.List()
	if err != nil {
		fmt.Fprintf(stderr, "capsa image ls: %v\n", err)
		return 1
	}
	switch *format {
	case "json":
		if imgs == nil {
			imgs = []*image.Image{}
		}
		writeJSON(stdout, imgs)
	case "table":
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "REFERENCE\tDIGEST\tSIZE\tROOTFS\tPULLED")
		for _, img := range imgs {
			refs := img.Refs
			if len(refs) == 0 {
				refs = []string{"<none>"}
			}
			for _, r := range refs {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", r, short(img.Digest), mib(img.Size), mib(img.RootfsSize), img.Pulled.Local().Format(time.DateTime))
			}
		}
		tw.Flush()
	default:
		fmt.Fprintf(stderr, "capsa image ls: --format %q: want table or json\n", *format)
		return 2
	}
	return 0
}

func imageInspect(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("image inspect", "REF|DIGEST", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "capsa image inspect: want one image")
		return 2
	}
	s, ok := openStore(stderr, "inspect")
	if !ok {
		return 1
	}
	img, err := s.Get(fs.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "capsa image inspect: %v\n", err)
		return 1
	}
	writeJSON(stdout, img)
	return 0
}

func imageRemove(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("image rm", "REF|DIGEST...", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() == 0 {
		fmt.Fprintln(stderr, "capsa image rm: want at least one image")
		return 2
	}
	s, ok := openStore(stderr, "rm")
	if !ok {
		return 1
	}
	code := 0
	for _, ref := range fs.Args() {
		if err := s.Remove(ref); err != nil {
			fmt.Fprintf(stderr, "capsa image rm: %v\n", err)
			code = 1
			continue
		}
		fmt.Fprintln(stdout, ref)
	}
	return code
}

func imagePrune(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("image prune", "", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	s, ok := openStore(stderr, "prune")
	if !ok {
		return 1
	}
	freed, err := s.Prune()
	if err != nil {
		fmt.Fprintf(stderr, "capsa image prune: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "freed %s\n", mib(freed))
	return 0
}
