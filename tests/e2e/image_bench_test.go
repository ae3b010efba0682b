package e2e

import (
	"archive/tar"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// imageBenchFile is the file the read benchmark reads, from the image's
// disk, a 9P share and through the agent.
const imageBenchFile = 256 << 20

// benchData is imageBenchFile bytes of a pattern gzip squeezes (the layer
// stays small on the wire) that no filesystem stores as a hole.
func benchData() []byte {
	data := make([]byte, imageBenchFile)
	for i := range data {
		data[i] = byte(i*7 + 1)
	}
	return data
}

// BenchmarkImage measures the python image (Debian bookworm minbase with
// python3, about 170 MB unpacked) from the reference registry on loopback:
// pull and convert with an empty cache and again with it cached, boot to
// agent-ready from the image beside the built-in initramfs,
// `python3 -c pass` through exec, and a sequential read of one file from
// the image's disk beside the same file through 9P and the agent.
//
//	make bench   (runs it in the nested host with -test.benchtime 5x)
func BenchmarkImage(b *testing.B) {
	ctx := context.Background()
	startRegistry(b)
	ref := registryAddr + "/capsa-test/python-bench:1"
	data := benchData()
	big := tarLayer(b,
		layerEntry{h: tar.Header{Name: "data/", Typeflag: tar.TypeDir, Mode: 0o755}},
		layerEntry{tar.Header{Name: "data/big", Typeflag: tar.TypeReg, Mode: 0o644}, data},
	)
	pushPythonImage(b, ref, big)

	cache := b.TempDir()
	b.Setenv("CAPSA_CACHE", cache)
	pull := func(b *testing.B, cacheDir string) time.Duration {
		start := time.Now()
		r := capsaWith(b, 10*time.Minute, func(c *exec.Cmd) { c.Env = append(os.Environ(), "CAPSA_CACHE="+cacheDir) }, "image", "pull", ref)
		if r.code != 0 {
			b.Fatalf("capsa image pull %s: exit %d: %s", ref, r.code, r.stderr)
		}
		return time.Since(start)
	}
	b.Run("pull-convert-cold", func(b *testing.B) {
		var samples []time.Duration
		for b.Loop() {
			// Each pull's cache goes as soon as it is timed: five
			// converted images would crowd the nested host's memory.
			dir, err := os.MkdirTemp("", "capsa-cold-")
			if err != nil {
				b.Fatal(err)
			}
			samples = append(samples, pull(b, dir))
			os.RemoveAll(dir)
		}
		reportSpread(b, samples)
	})
	pull(b, cache)
	b.Run("pull-cached", func(b *testing.B) {
		var samples []time.Duration
		for b.Loop() {
			samples = append(samples, pull(b, cache))
		}
		reportSpread(b, samples)
	})

	kernel, initrd := artifactB(b, "vmlinux"), artifactB(b, "initramfs.cpio")
	builder := func() *sandbox.Builder {
		return sandbox.New().Memory(512).Kernel(kernel).Initrd(initrd)
	}
	for _, v := range []struct {
		name  string
		start func() (*sandbox.Sandbox, error)
	}{
		{"boot-initramfs", func() (*sandbox.Sandbox, error) { return builder().Run("true").Start(ctx) }},
		{"boot-image", func() (*sandbox.Sandbox, error) { return builder().Pull(sandbox.PullNever).OCI(ref, "true").Start(ctx) }},
	} {
		b.Run(v.name, func(b *testing.B) {
			var samples []time.Duration
			for b.Loop() {
				start := time.Now()
				sb, err := v.start()
				if err != nil {
					b.Fatal(err)
				}
				samples = append(samples, time.Since(start))
				sb.Close()
			}
			reportSpread(b, samples)
		})
	}

	// One image sandbox for the rest, with the file also on a share.
	dir := b.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "big"), data, 0o644); err != nil {
		b.Fatal(err)
	}
	sb, err := builder().Memory(1024).Share(dir, "/mnt/share", sandbox.ReadOnly).OCI(ref, "sleep", "100000").User("0").Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	sh := func(b *testing.B, script string) { guestShell(b, ctx, sb, script) }
	b.Run("exec-python-pass", func(b *testing.B) {
		var samples []time.Duration
		for b.Loop() {
			start := time.Now()
			out, err := sb.Exec(ctx, sandbox.Command("python3", "-c", "pass"))
			if err != nil || out.Code != 0 {
				b.Fatalf("python3 -c pass: %+v, %v", out, err)
			}
			samples = append(samples, time.Since(start))
		}
		reportSpread(b, samples)
	})
	// Each read starts cold: the guest's page cache is dropped first.
	for _, v := range []struct{ name, script string }{
		{"read-image-disk", dropCaches + "; dd if=/data/big of=/dev/null bs=1M"},
		{"read-9p", dropCaches + "; dd if=/mnt/share/big of=/dev/null bs=1M"},
	} {
		b.Run(v.name, func(b *testing.B) {
			b.SetBytes(imageBenchFile)
			for b.Loop() {
				sh(b, v.script)
			}
		})
	}
	b.Run("read-agent", func(b *testing.B) {
		b.SetBytes(imageBenchFile)
		for b.Loop() {
			b.StopTimer()
			sh(b, dropCaches)
			b.StartTimer()
			if err := sb.ReadFileTo(ctx, "/data/big", io.Discard); err != nil {
				b.Fatal(err)
			}
		}
	})
}
