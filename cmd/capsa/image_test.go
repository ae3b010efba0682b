package main

import (
	"bytes"
	"context"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/creack/pty"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// TestPullProgress: `capsa image pull` shows each layer's bytes and rate
// while pulling and the conversion at the end when stderr is a terminal
// (a real pseudo-terminal here), says which layers were cached on a second
// pull, and writes nothing to stderr when it is not a terminal.
func TestPullProgress(t *testing.T) {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	ref := strings.TrimPrefix(srv.URL, "http://") + "/progress/img:1"
	img, err := random.Image(2<<20, 2)
	if err != nil {
		t.Fatal(err)
	}
	tag, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(tag, img); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}

	// stderr a terminal: per-layer progress.
	t.Setenv("CAPSA_CACHE", t.TempDir())
	onTTY := func() string {
		t.Helper()
		ptmx, tty, err := pty.Open()
		if err != nil {
			t.Fatalf("pty.Open() = %v", err)
		}
		defer ptmx.Close()
		read := make(chan string)
		go func() {
			b, _ := io.ReadAll(ptmx) // ends with EIO once tty is closed
			read <- string(b)
		}()
		var stdout bytes.Buffer
		code := imagePull(context.Background(), []string{ref}, &stdout, tty)
		tty.Close()
		out := <-read
		if code != 0 || !strings.HasPrefix(stdout.String(), "sha256:") {
			t.Fatalf("capsa image pull %s = exit %d, stdout %q, terminal %q", ref, code, stdout.String(), out)
		}
		return out
	}
	out := onTTY()
	for _, want := range []string{"layer 1/2 ", "layer 2/2 ", " / 2.0 MiB (", "MiB/s)", "converted to a root filesystem"} {
		if !strings.Contains(out, want) {
			t.Errorf("capsa image pull on a terminal wrote %q, want it to contain %q", out, want)
		}
	}
	out = onTTY()
	if strings.Count(out, ": cached") != 2 {
		t.Errorf("a second pull on a terminal wrote %q, want both layers cached", out)
	}

	// stderr not a terminal: silent.
	t.Setenv("CAPSA_CACHE", t.TempDir())
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var stdout bytes.Buffer
	code := imagePull(context.Background(), []string{ref}, &stdout, w)
	w.Close()
	errOut, _ := io.ReadAll(r)
	if code != 0 || len(errOut) != 0 {
		t.Errorf("capsa image pull with stderr a pipe = exit %d, stderr %q, want 0 and nothing", code, errOut)
	}
}
