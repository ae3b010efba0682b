package e2e

import (
	"archive/tar"
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// probeEnv makes the test binary, as /bin/probe in a test image, a small
// program that reports what a process in an image sees.
const probeEnv = "CAPSA_E2E_PROBE"

// probe runs one action: report, write PATH TEXT, cat PATH, fill PATH
// (os.File writes), fillraw PATH (write(2) calls),
// copy SRC DST (1 MiB read and write calls), hold PATH OUT (reads on
// from a file kept open), wait (forever), daemon (wait, and a copy waiting
// in a session of its own), gone (no process left with an argument), eat (memory), forkbomb, and the
// hub's cas, ping and pong (hubProbe).
func probe(args []string) int {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "probe: no action")
		return 2
	}
	switch args[0] {
	case "report":
		wd, _ := os.Getwd()
		hosts, _ := os.ReadFile("/etc/hosts")
		host, _ := os.Hostname()
		_, goneErr := os.Stat("/data/gone.txt")
		kept, _ := os.ReadFile("/data/kept.txt")
		fmt.Printf("uid=%d gid=%d cwd=%s greeting=%s home=%s hosts=%v gone=%v kept=%s\n",
			os.Getuid(), os.Getgid(), wd, os.Getenv("GREETING"), os.Getenv("HOME"),
			strings.Contains(string(hosts), host), errors.Is(goneErr, os.ErrNotExist), kept)
	case "write":
		if err := os.WriteFile(args[1], []byte(args[2]), 0o644); err != nil {
			fmt.Println(err)
			return 1
		}
	case "cat":
		b, err := os.ReadFile(args[1])
		if err != nil {
			fmt.Println(err)
			return 1
		}
		os.Stdout.Write(b)
	case "fill":
		f, err := os.Create(args[1])
		if err != nil {
			fmt.Println(err)
			return 1
		}
		buf := make([]byte, 1<<20)
		n := 0
		for {
			if _, err = f.Write(buf); err != nil {
				break
			}
			n++
		}
		if err == nil {
			err = f.Sync()
		}
		fmt.Printf("wrote %d MiB: %v enospc=%v\n", n, err, errors.Is(err, syscall.ENOSPC))
	case "fillraw":
		// Like fill, with write(2) itself: a short write goes on
		// with the rest, and the first error (or a write of 0
		// bytes) ends it.
		fd, err := syscall.Open(args[1], syscall.O_CREAT|syscall.O_WRONLY|syscall.O_TRUNC, 0o644)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		buf := make([]byte, 1<<20)
		var total int64
		for {
			n, err := syscall.Write(fd, buf)
			if n > 0 {
				total += int64(n)
			}
			if err != nil || n == 0 {
				fmt.Printf("wrote %d bytes: %v enospc=%v\n", total, err, errors.Is(err, syscall.ENOSPC))
				break
			}
		}
		syscall.Close(fd)
	case "copy":
		if err := copyPlain(args[1], args[2]); err != nil {
			fmt.Println(err)
			return 1
		}
	case "hold":
		// Opens PATH, writes its first line to OUT.1, waits for OUT.go
		// to exist, then writes its next line (from the same open file)
		// to OUT.2.
		f, err := os.Open(args[1])
		if err != nil {
			fmt.Println(err)
			return 1
		}
		r := bufio.NewReader(f)
		for i, last := 1, false; !last; i++ {
			line, err := r.ReadString('\n')
			if err != nil {
				fmt.Println(err)
				return 1
			}
			if err := os.WriteFile(fmt.Sprintf("%s.%d", args[2], i), []byte(line), 0o644); err != nil {
				fmt.Println(err)
				return 1
			}
			for last = i == 2; !last; time.Sleep(50 * time.Millisecond) {
				if _, err := os.Stat(args[2] + ".go"); err == nil {
					break
				}
			}
		}
	case "gone":
		// gone ARG SECONDS: waits, for at most SECONDS, until no other
		// process has ARG as an argument; lists those left if any are.
		secs, _ := strconv.Atoi(args[2])
		var left []string
		for end := time.Now().Add(time.Duration(secs) * time.Second); ; time.Sleep(time.Second) {
			left = left[:0]
			procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
			for _, f := range procs {
				b, _ := os.ReadFile(f)
				if f != fmt.Sprintf("/proc/%d/cmdline", os.Getpid()) && slices.Contains(strings.Split(string(b), "\x00"), args[1]) {
					left = append(left, f+": "+strings.ReplaceAll(string(b), "\x00", " "))
				}
			}
			if len(left) == 0 {
				return 0
			}
			if time.Now().After(end) {
				fmt.Printf("%d left, among them:\n%s\n", len(left), strings.Join(left[:min(len(left), 10)], "\n"))
				return 1
			}
		}
	case "daemon":
		// Starts a copy of itself that waits forever in a session of its
		// own (its command line "wait daemon-7777"), then waits too.
		self, err := os.Executable()
		if err != nil {
			fmt.Println(err)
			return 1
		}
		d := exec.Command(self, "wait", "daemon-7777")
		d.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := d.Start(); err != nil {
			fmt.Println(err)
			return 1
		}
		for {
			time.Sleep(time.Hour)
		}
	case "wait":
		for {
			time.Sleep(time.Hour)
		}
	case "eat":
		// Takes memory 1 MiB at a time, touching every page, until the
		// guest's OOM killer ends it.
		var held [][]byte
		for i := 1; ; i++ {
			b := make([]byte, 1<<20)
			for j := 0; j < len(b); j += 4096 {
				b[j] = 1
			}
			held = append(held, b)
			if i%32 == 0 {
				fmt.Printf("holding %d MiB\n", i)
			}
		}
	case "forkbomb":
		// Every copy starts copies of itself as fast as it can, forever.
		self, err := os.Executable()
		if err != nil {
			fmt.Println(err)
			return 1
		}
		for {
			exec.Command(self, "forkbomb").Start()
		}
	case "cas", "ping", "pong":
		return hubProbe(args)
	default:
		fmt.Fprintln(os.Stderr, "probe: unknown action", args[0])
		return 2
	}
	return 0
}

// copyPlain copies src to dst with read and write calls of 1 MiB, and
// nothing cleverer: io.Copy would hand *os.File pairs to copy_file_range
// or splice, which measure the kernel's page-cache paths instead.
func copyPlain(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for {
		n, rerr := io.ReadFull(in, buf)
		if n > 0 {
			if _, err := out.Write(buf[:n]); err != nil {
				out.Close()
				return err
			}
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			break
		} else if rerr != nil {
			out.Close()
			return rerr
		}
	}
	return out.Close()
}

// layerEntry is one entry of a test layer: its header and, for a regular
// file, its data.
type layerEntry struct {
	h    tar.Header
	data []byte
}

// tarLayer builds an image layer of entries, in order: a regular file's
// size is its data's, and every entry has one fixed time.
func tarLayer(t testing.TB, entries ...layerEntry) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.h
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.data))
		}
		h.ModTime = time.Unix(1700000000, 0)
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(e.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// probeImage writes a `docker save` tarball of a two-layer image: the test
// binary as /bin/probe, passwd and group with a user app (1000), a file
// the second layer whites out, and a config with ENTRYPOINT, CMD, ENV,
// WORKDIR and USER.
func probeImage(t *testing.T, path, ref string) {
	t.Helper()
	self, err := os.ReadFile("/proc/self/exe")
	if err != nil {
		t.Fatal(err)
	}
	file := func(name, content string, mode int64, uid int) layerEntry {
		return layerEntry{tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: mode, Uid: uid, Gid: uid}, []byte(content)}
	}
	dir := func(name string, mode int64, uid int) layerEntry {
		return layerEntry{h: tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: mode, Uid: uid, Gid: uid}}
	}
	probe := file("bin/probe", "", 0o755, 0)
	probe.data = self
	base := tarLayer(t,
		dir("bin/", 0o755, 0), probe,
		dir("etc/", 0o755, 0),
		file("etc/passwd", "root:x:0:0:root:/root:/bin/probe\napp:x:1000:1000:app:/home/app:/bin/probe\n", 0o644, 0),
		file("etc/group", "root:x:0:\napp:x:1000:\n", 0o644, 0),
		dir("home/", 0o755, 0), dir("home/app/", 0o755, 1000),
		dir("data/", 0o755, 0), file("data/gone.txt", "gone", 0o644, 0), file("data/kept.txt", "kept", 0o644, 0),
	)
	top := tarLayer(t, file("data/.wh.gone.txt", "", 0o644, 0))
	img, err := mutate.AppendLayers(empty.Image, base, top)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config = v1.Config{
		Entrypoint: []string{"/bin/probe"}, Cmd: []string{"report"},
		Env:        []string{"PATH=/bin", probeEnv + "=1", "GREETING=from-image"},
		WorkingDir: "/home/app", User: "app",
	}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := tarball.WriteToFile(path, tag, img); err != nil {
		t.Fatal(err)
	}
}

// TestImageRun: an image imported from a `docker save` tarball runs with
// its config honoured, each sandbox on its own writable layer over an
// unchanged base, inside a bounded root filesystem.
func TestImageRun(t *testing.T) {
	cache := t.TempDir()
	t.Setenv("CAPSA_CACHE", cache)
	tarPath := filepath.Join(t.TempDir(), "probe.tar")
	probeImage(t, tarPath, "capsa.test/probe:1")

	r := capsa(t, 2*time.Minute, "image", "import", tarPath)
	if r.code != 0 || !strings.HasPrefix(r.stdout, "sha256:") {
		t.Fatalf("capsa image import: exit %d, stdout %q", r.code, r.stdout)
	}
	r = capsa(t, time.Minute, "image", "ls", "--format", "json")
	var imgs []struct {
		Refs   []string `json:"refs"`
		Digest string   `json:"digest"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &imgs); err != nil || len(imgs) != 1 || len(imgs[0].Refs) != 1 || imgs[0].Refs[0] != "capsa.test/probe:1" {
		t.Fatalf("capsa image ls --format json = %q (%v), want the imported image", r.stdout, err)
	}
	rootfs := filepath.Join(cache, "images", "rootfs", "sha256", strings.TrimPrefix(imgs[0].Digest, "sha256:")+".erofs")
	before := fileSum(t, rootfs)

	r = capsa(t, 3*time.Minute, "run", "--image", "capsa.test/probe:1")
	if want := "uid=1000 gid=1000 cwd=/home/app greeting=from-image home=/home/app hosts=true gone=true kept=kept\n"; r.code != 0 || r.stdout != want {
		t.Errorf("capsa run --image (the image's defaults): exit %d, stdout %q, want %q", r.code, r.stdout, want)
	}
	r = capsa(t, 3*time.Minute, "run", "--image", "capsa.test/probe:1", "-e", "GREETING=override", "-u", "0:0", "-w", "/", "--", "report")
	if want := "uid=0 gid=0 cwd=/ greeting=override home=/root"; r.code != 0 || !strings.HasPrefix(r.stdout, want) {
		t.Errorf("capsa run --image with -e, -u and -w: exit %d, stdout %q, want it to start %q", r.code, r.stdout, want)
	}
	// Two sandboxes of the image at once write the same path: each reads
	// its own, a third the image's.
	_, cli := detachedState(t)
	for _, n := range []string{"a", "b"} {
		if r := cli(3*time.Minute, "run", "-d", "--name", n, "--image", "capsa.test/probe:1", "--", "wait"); r.code != 0 {
			t.Fatalf("capsa run -d --name %s --image: exit %d, stderr %q", n, r.code, r.stderr)
		}
		if r := cli(time.Minute, "exec", "-u", "0", n, "--", "/bin/probe", "write", "/data/kept.txt", "from-"+n); r.code != 0 {
			t.Errorf("writing over an image file in %s: exit %d, stdout %q", n, r.code, r.stdout)
		}
	}
	for _, n := range []string{"a", "b"} {
		if r := cli(time.Minute, "exec", n, "--", "/bin/probe", "cat", "/data/kept.txt"); r.code != 0 || r.stdout != "from-"+n {
			t.Errorf("sandbox %s reads %q (exit %d), want its own from-%s", n, r.stdout, r.code, n)
		}
		cli(time.Minute, "stop", n)
	}
	r = capsa(t, 3*time.Minute, "run", "--image", "capsa.test/probe:1", "--", "cat", "/data/kept.txt")
	if r.code != 0 || r.stdout != "kept" {
		t.Errorf("a third sandbox reads %q (exit %d), want the image's kept", r.stdout, r.code)
	}
	if after := fileSum(t, rootfs); after != before {
		t.Error("the image's root filesystem changed on the host")
	}
	r = capsa(t, 4*time.Minute, "run", "--image", "capsa.test/probe:1", "--rootfs-size", "96M", "--", "fill", "/tmp/big")
	if r.code != 0 || !strings.Contains(r.stdout, "enospc=true") {
		t.Errorf("filling a 96M root: exit %d, stdout %q; want ENOSPC", r.code, r.stdout)
	} else if n := 0; func() bool { k, _ := fmt.Sscanf(r.stdout, "wrote %d MiB", &n); return k != 1 || n > 96 }() {
		t.Errorf("filling a 96M root wrote %q, want at most 96 MiB", r.stdout)
	}
	r = capsa(t, time.Minute, "run", "--image", "capsa.test/nope:1", "--pull", "never")
	if r.code == 0 || !strings.Contains(r.stderr, "not found") {
		t.Errorf("an image not in the store with --pull never: exit %d, stderr %q", r.code, r.stderr)
	}
}

func fileSum(t *testing.T, p string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}
