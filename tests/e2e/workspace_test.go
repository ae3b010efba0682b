package e2e

import (
	_ "embed"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fsProbe is the probe TestWorkspaceFidelity runs in the guest: what mv,
// cp -a, git, pip and SQLite ask of a file system, one JSON result per
// probe.
//
//go:embed testdata/fsprobe.py
var fsProbe []byte

// localResults is what a local Linux file system gives each probe that
// does not simply succeed: the image's root disk (ext4 under overlayfs)
// must give exactly these, and every other probe "ok".
var localResults = map[string]string{
	"getxattr_missing":             "ENODATA",
	"rename_dir_over_nonempty_dir": "ENOTEMPTY",
	"rename_noreplace_existing":    "EEXIST",
}

// shareDifferences are the probes where a 9P share cannot give what a
// local disk gives, each with the share's result and why. A share that
// behaves better than this list says fails the test too, so the list (and
// the docs that repeat it) stay true.
var shareDifferences = map[string]struct{ got, why string }{
	"rename_exchange":  {"EINVAL", "9P2000.L's Trenameat has no flags: the guest kernel does RENAME_NOREPLACE itself (kernel/patches/0002), not an exchange"},
	"o_tmpfile":        {"ENOTSUP", "Linux's v9fs has no tmpfile operation (programs fall back to a named file)"},
	"setxattr_trusted": {"ENOTSUP", "only user.* attributes are served; trusted.* and security.* are the host's"},
}

// TestWorkspaceFidelity runs the file system probe in an image sandbox on
// a read-write share and on the image's own root disk. The disk must give
// what a local Linux file system gives; the share the same, except where
// shareDifferences says 9P cannot. User extended attributes on the share
// must behave as the host directory's own file system does (the nested
// host's may not have them).
func TestWorkspaceFidelity(t *testing.T) {
	workspaceFidelity(t, "9p", shareDifferences)
}

// virtioFSDifferences are shareDifferences for a virtio-fs share.
var virtioFSDifferences = map[string]struct{ got, why string }{
	"setxattr_trusted": {"ENOTSUP", "only user.* attributes are served; trusted.* and security.* are the host's"},
}

// TestWorkspaceFidelityVirtioFS is TestWorkspaceFidelity on a virtio-fs
// share (--share-fs virtiofs).
func TestWorkspaceFidelityVirtioFS(t *testing.T) {
	workspaceFidelity(t, "virtiofs", virtioFSDifferences)
}

// workspaceFidelity runs the probe with shares over transport shareFS,
// whose differences from the disk are differences.
func workspaceFidelity(t *testing.T, shareFS string, differences map[string]struct{ got, why string }) {
	ref := pythonImage(t, "workspace")
	share := xattrDir(t)
	if err := os.WriteFile(filepath.Join(share, "fsprobe.py"), fsProbe, 0o644); err != nil {
		t.Fatal(err)
	}
	shareXattr := "ok"
	if err := hostXattr(share, 1); err != nil {
		shareXattr = unix.ErrnoName(err.(unix.Errno))
	}
	r := capsa(t, 6*time.Minute, "run", "--image", ref, "-u", "0", "--memory", "512M", "--share-fs", shareFS, "-v", share+":/w", "-w", "/w", "--",
		"sh", "-c", "python3 /w/fsprobe.py /w && python3 /w/fsprobe.py /root && "+
			// A directory of the image itself (its lower layer) can be
			// renamed: overlayfs's redirect_dir.
			`python3 -c 'import os; os.rename("/etc/apt", "/root/apt"); os.rename("/root/apt", "/etc/apt"); print("image directory renamed")'`)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if r.code != 0 || len(lines) != 3 || lines[2] != "image directory renamed" {
		t.Fatalf("the probe: exit %d, %d lines; want 0, two lines of results and \"image directory renamed\"\nstderr:\n%s", r.code, len(lines), r.stderr)
	}
	var onShare, onDisk map[string]string
	if err := json.Unmarshal([]byte(lines[0]), &onShare); err != nil {
		t.Fatalf("the share's results %q: %v", lines[0], err)
	}
	if err := json.Unmarshal([]byte(lines[1]), &onDisk); err != nil {
		t.Fatalf("the disk's results %q: %v", lines[1], err)
	}
	names := make([]string, 0, len(onDisk))
	for name := range onDisk {
		names = append(names, name)
	}
	sort.Strings(names)
	if len(names) < 30 || len(onShare) != len(onDisk) {
		t.Fatalf("the probe gave %d results on the disk and %d on the share", len(onDisk), len(onShare))
	}
	for _, name := range names {
		local := localResults[name]
		if local == "" {
			local = "ok"
		}
		if got := onDisk[name]; got != local {
			t.Errorf("%s on the image's disk = %q, want %q (what a local file system gives)", name, got, local)
		}
		want, why := local, "as the disk"
		if d, ok := differences[name]; ok {
			want, why = d.got, d.why
		}
		if name == "xattr_user_round_trip" {
			want, why = shareXattr, "as the host directory's own file system"
		}
		if got := onShare[name]; got != want {
			t.Errorf("%s on the share = %q, want %q (%s)", name, got, want, why)
		}
	}
}

// xattrDir is a directory on a file system that keeps user extended
// attributes, as a user's home on ext4 or xfs does, for a share whose
// guest users own what they make (p9fs keeps owners in one): the test's
// own temporary directory where it does, else (the nested host's tmpfs,
// whose Linux 6.1 has none) an ext2 file system in a file, mounted from a
// loop device for the test.
func xattrDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if hostXattr(dir, 1) == nil {
		return dir
	}
	img := filepath.Join(t.TempDir(), "fs.img")
	f, err := os.Create(img)
	if err == nil {
		err = f.Truncate(256 << 20)
		f.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"mke2fs", "-F", "-I", "256", img}, {"mount", "-o", "loop", img, dir}} {
		if out, err := exec.Command("busybox", args...).CombinedOutput(); err != nil {
			t.Fatalf("busybox %v: %v\n%s", args, err, out)
		}
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v\n%s", dir, err, out)
		}
	})
	if err := hostXattr(dir, 1); err != nil {
		t.Fatalf("the ext2 file system at %s keeps no user attributes: %v", dir, err)
	}
	return dir
}
