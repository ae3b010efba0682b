package e2e

import (
	"archive/tar"
	"bytes"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"
)

// registryAddr is where startRegistry serves: loopback, so capsa reaches it
// over plain HTTP without --insecure-registry, as Docker does.
const registryAddr = "127.0.0.1:5000"

// startRegistry runs the reference registry (Debian's docker-registry, from
// scripts/test-images.sh) on registryAddr with its storage in a temporary
// directory, until the test ends.
func startRegistry(t testing.TB) {
	t.Helper()
	wrapper := artifact(t, "testimages/registry/registry")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yml")
	conf := fmt.Sprintf("version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n", filepath.Join(dir, "data"), registryAddr)
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	cmd := exec.Command("/bin/sh", wrapper, cfg)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the registry: %v", err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("the registry's log:\n%s", logs.String())
		}
	})
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(100 * time.Millisecond) {
		resp, err := http.Get("http://" + registryAddr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			err = fmt.Errorf("status %s", resp.Status)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the registry did not answer GET /v2/ within a minute: %v\n%s", err, logs.String())
		}
	}
}

// pythonMain is the test image's default command: what a process of the
// image sees, one line.
const pythonMain = `import os, sys
print("uid=%d cwd=%s greeting=%s perl=%s python=%d.%d" % (os.getuid(), os.getcwd(),
      os.environ.get("GREETING"), os.path.exists("/usr/bin/perl"), *sys.version_info[:2]))
`

// pushPythonImage layers Debian's python root (scripts/test-images.sh) into
// an image and pushes it to the registry as ref: the root as the first
// layer, then a layer that deletes /usr/bin/perl (a whiteout) and adds the
// program, then any extra layers; the config runs it as nobody in /app.
func pushPythonImage(t testing.TB, ref string, extra ...v1.Layer) {
	t.Helper()
	base, err := tarball.LayerFromFile(artifact(t, "testimages/python.tar.gz"))
	if err != nil {
		t.Fatalf("the python root layer: %v", err)
	}
	top := tarLayer(t,
		layerEntry{h: tar.Header{Name: "usr/bin/.wh.perl", Typeflag: tar.TypeReg, Mode: 0o644}},
		layerEntry{h: tar.Header{Name: "app/", Typeflag: tar.TypeDir, Mode: 0o755}},
		layerEntry{tar.Header{Name: "app/main.py", Typeflag: tar.TypeReg, Mode: 0o644}, []byte(pythonMain)},
	)
	pushImage(t, ref, v1.Config{
		Cmd:        []string{"python3", "/app/main.py"},
		Env:        []string{"PATH=" + imagePath, "GREETING=from-image"},
		WorkingDir: "/app",
		User:       "nobody",
	}, append([]v1.Layer{base, top}, extra...)...)
}

// imagePath is the test images' PATH.
const imagePath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// pushImage pushes an image of layers and config (for linux/amd64) to
// the registry as ref.
func pushImage(t testing.TB, ref string, config v1.Config, layers ...v1.Layer) {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config = config
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := remote.Write(r, img); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	t.Logf("pushed %s in %v", ref, time.Since(start).Round(time.Millisecond))
}

// pythonImage starts the registry, pushes the python image to it as
// python:TAG and gives the test a cache of its own, so that its pull and
// conversion are its own; it returns the image's reference.
func pythonImage(tb testing.TB, tag string) string {
	tb.Helper()
	startRegistry(tb)
	ref := registryAddr + "/capsa-test/python:" + tag
	pushPythonImage(tb, ref)
	tb.Setenv("CAPSA_CACHE", tb.TempDir())
	return ref
}

// hostXattr sets a user attribute of size bytes on dir and removes it
// again: nil where the host directory's file system holds such an
// attribute, which is what a share over it can offer the guest.
func hostXattr(dir string, size int) error {
	err := unix.Setxattr(dir, "user.capsa-test", make([]byte, size), 0)
	unix.Removexattr(dir, "user.capsa-test")
	return err
}

// TestImageFromRegistry: a python image from Debian's packages, pushed to
// the reference registry on loopback, is pulled and run: its default
// command with its Env, WorkingDir and non-root User, a command in its
// place, and python reaching the network and a share from inside it.
func TestImageFromRegistry(t *testing.T) {
	ref := pythonImage(t, "3.11")

	start := time.Now()
	r := capsa(t, 5*time.Minute, "image", "pull", ref)
	if r.code != 0 || !strings.HasPrefix(r.stdout, "sha256:") {
		t.Fatalf("capsa image pull %s: exit %d, stdout %q, want the image's digest", ref, r.code, r.stdout)
	}
	t.Logf("pulled and converted in %v", time.Since(start).Round(time.Millisecond))

	r = capsa(t, 4*time.Minute, "run", "--image", ref, "--pull", "never")
	if want := "uid=65534 cwd=/app greeting=from-image perl=False python=3.11\n"; r.code != 0 || r.stdout != want {
		t.Errorf("capsa run --image %s (its default command) = exit %d, %q; want 0, %q", ref, r.code, r.stdout, want)
	}
	// A command in place of Cmd, with a host tree copied into the
	// sandbox's layer first (modes and symlinks kept).
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "sub", "x.txt"), []byte("copied"), 0o644)
	os.WriteFile(filepath.Join(src, "run.sh"), []byte("#!/bin/sh\n"), 0o750)
	os.Symlink("sub/x.txt", filepath.Join(src, "link"))
	check := `import os, sys
print(sys.version.split()[0][:5], open("/opt/extra/link").read(), oct(os.stat("/opt/extra/run.sh").st_mode & 0o777), os.readlink("/opt/extra/link"))`
	r = capsa(t, 4*time.Minute, "run", "--image", ref, "--copy", src+":/opt/extra", "--", "python3", "-c", check)
	if want := "3.11. copied 0o750 sub/x.txt\n"; r.code != 0 || r.stdout != want {
		t.Errorf("capsa run --image %s --copy %s:/opt/extra -- python3 -c ... = exit %d, %q; want 0, %q", ref, src, r.code, r.stdout, want)
	}

	// Network and a share, from python in the image.
	w := setupNetWorld(t)
	share := t.TempDir()
	if err := os.WriteFile(filepath.Join(share, "in.txt"), []byte("from the host"), 0o644); err != nil {
		t.Fatal(err)
	}
	script := `import urllib.request
print(urllib.request.urlopen("http://public.example.test/", timeout=60).read().decode(), end="")
print(open("/mnt/share/in.txt").read())
open("/mnt/share/out.txt", "w").write("from python")
`
	r = capsa(t, 4*time.Minute, "run", "--image", ref, "-u", "0", "--net", "--dns-server", w.dns,
		"-v", share+":/mnt/share", "--", "python3", "-c", script)
	if want := "public page\nfrom the host\n"; r.code != 0 || r.stdout != want {
		t.Errorf("python fetching a page and reading a share in the image = exit %d, %q; want 0, %q", r.code, r.stdout, want)
	}
	if b, err := os.ReadFile(filepath.Join(share, "out.txt")); err != nil || string(b) != "from python" {
		t.Errorf("the file python wrote to the share: %q, %v; want %q", b, err, "from python")
	}

	// The hub's wire protocol, spoken by python's own sockets as the
	// docs/cli.md shows (no capsa command involved), and seen by the host.
	t.Setenv("CAPSA_STATE", t.TempDir())
	wire := `import json, socket, base64
s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM); s.connect((2, 1030))
s.sendall(b'{"id":1,"op":"kv.set","key":"jobs/py","value":"%s"}\n' % base64.b64encode(b"hi from python"))
print(json.loads(s.makefile().readline()))
s.sendall(b'{"id":2,"op":"kv.get","key":"secret"}\n')
print(json.loads(s.makefile().readline())["code"])
`
	r = capsa(t, 4*time.Minute, "run", "--image", ref, "--kv", "jobs/", "--", "python3", "-c", wire)
	if want := "{'id': 1, 'version': 1}\npermission\n"; r.code != 0 || r.stdout != want {
		t.Errorf("python speaking the hub's protocol = exit %d, %q; want 0, %q", r.code, r.stdout, want)
	}
	if r := capsa(t, time.Minute, "kv", "get", "jobs/py"); r.code != 0 || r.stdout != "hi from python\n" {
		t.Errorf("capsa kv get jobs/py (set by python in a sandbox) = exit %d, %q", r.code, r.stdout)
	}
}

// TestImageAsKVMGroupUser: pulling and running an image needs no root on
// the host: an ordinary user whose only privilege is the kvm group does it
// all, with the cache in its own home.
func TestImageAsKVMGroupUser(t *testing.T) {
	artifact(t, "capsa") // skips where no /dev/kvm boots Linux (the unit tier)
	if os.Geteuid() != 0 {
		t.Skip("needs root to set up the unprivileged user (the nested host runs the tests as root)")
	}
	const uid, kvmGID = 1000, 990
	// /dev/kvm as a distribution sets it up: root:kvm 0660.
	st, err := os.Stat("/dev/kvm")
	if err != nil {
		t.Fatal(err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	if err := os.Chown("/dev/kvm", 0, kvmGID); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod("/dev/kvm", 0o660); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.Chown("/dev/kvm", int(sys.Uid), int(sys.Gid))
		os.Chmod("/dev/kvm", st.Mode().Perm())
	})
	startRegistry(t)
	ref := registryAddr + "/capsa-test/python:3.11"
	pushPythonImage(t, ref)

	home, err := os.MkdirTemp("", "capsa-user-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	if err := os.Chmod(home, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(home, uid, uid); err != nil {
		t.Fatal(err)
	}
	// The capsa binary must be reachable by the user too.
	bin := artifact(t, "capsa")
	for d := filepath.Dir(bin); d != "/"; d = filepath.Dir(d) {
		if st, err := os.Stat(d); err == nil && st.Mode().Perm()&0o001 == 0 {
			t.Skipf("%s is not searchable by other users", d)
		}
	}
	asUser := func(cmd *exec.Cmd) {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{kvmGID}}}
		cmd.Dir = home
		cmd.Env = []string{"HOME=" + home, "PATH=/bin:/usr/bin", "TMPDIR=" + home, "CAPSA_CACHE=" + filepath.Join(home, ".cache", "capsa")}
	}
	r := capsaWith(t, 5*time.Minute, asUser, "image", "pull", ref)
	if r.code != 0 {
		t.Fatalf("capsa image pull as uid %d in the kvm group: exit %d, stderr %q", uid, r.code, r.stderr)
	}
	r = capsaWith(t, 4*time.Minute, asUser, "run", "--image", ref, "--", "python3", "-c", "import os; print(os.getuid())")
	if r.code != 0 || r.stdout != "65534\n" {
		t.Errorf("capsa run --image as uid %d in the kvm group = exit %d, %q; want 0, %q (the image's user)", uid, r.code, r.stdout, "65534\n")
	}
	// Everything capsa wrote is the user's.
	filepath.WalkDir(home, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if info, err := d.Info(); err == nil && info.Sys().(*syscall.Stat_t).Uid != uid {
			t.Errorf("%s is owned by uid %d, want %d", p, info.Sys().(*syscall.Stat_t).Uid, uid)
		}
		return nil
	})
}
