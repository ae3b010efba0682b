package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestShareReadFromTheCLI: `capsa run -v` shares a host directory read-only
// and the command reads a host file through it.
func TestShareReadFromTheCLI(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "hello.txt"), []byte("hello from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := capsa(t, 3*time.Minute, "run", "-v", dir+":/data:ro", "--", "cat", "/data/hello.txt")
	if r.code != 0 || r.stdout != "hello from the host\n" {
		t.Fatalf("capsa run -v: exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = capsa(t, time.Minute, "run", "-v", dir+"/missing:/data", "--", "true")
	if r.code != 2 || !strings.Contains(r.stderr, "missing: no such file or directory") {
		t.Errorf("a missing host directory: exit %d, stderr %q", r.code, r.stderr)
	}
}

func TestShares(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	base := t.TempDir()
	rw, ro, tree := filepath.Join(base, "rw"), filepath.Join(base, "ro"), filepath.Join(base, "tree")
	for _, d := range []string{rw, ro, tree} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A secret beside the shares, and a host symlink inside one that
	// points at it.
	secret := filepath.Join(base, "secret.txt")
	if err := os.WriteFile(secret, []byte("TOPSECRET"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(secret, filepath.Join(rw, "planted")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ro, "keep.txt"), []byte("unchanged"), 0o644); err != nil {
		t.Fatal(err)
	}
	want := makeTree(t, tree)

	// The VMM's log and the guest console explain a failure.
	var vmmLog, console syncBuffer
	defer func() {
		if t.Failed() {
			t.Logf("VMM log:\n%s\nguest console:\n%s", vmmLog.String(), console.String())
		}
	}()
	sb, err := sandbox.New().Memory(256).
		Logger(slog.New(slog.NewTextHandler(&vmmLog, &slog.HandlerOptions{Level: slog.LevelInfo}))).Console(&console).
		Kernel(artifact(t, "vmlinux")).Initrd(artifact(t, "initramfs.cpio")).
		Share(rw, "/mnt/rw", sandbox.ReadWrite).
		Share(ro, "/mnt/ro", sandbox.ReadOnly).
		Share(tree, "/srv/tree", sandbox.ReadOnly).
		Run("sleep", "100000").Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	defer func() {
		if t.Failed() {
			t.Logf("the sandbox's state at the failure:\n%s", sb.Debug(context.Background()))
		}
	}()
	sh := func(script string) (string, int) {
		t.Helper()
		ectx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		r, err := sb.Exec(ectx, sandbox.ExecOptions{Shell: script, Timeout: time.Minute})
		if err == nil && r.TimedOut {
			err = errors.New("timed out")
		}
		if err != nil {
			// What every guest process waits on.
			dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			diag, _ := sb.Exec(dctx, sandbox.ExecOptions{Timeout: 20 * time.Second,
				Shell: `for p in /proc/[0-9]*; do echo "$p $(cat $p/comm) $(cat $p/wchan) $(cat $p/stat)"; done`})
			if diag != nil {
				t.Logf("guest processes:\n%s", diag.Stdout)
			}
			t.Fatalf("exec %q: %v", script, err)
		}
		return string(r.Stdout) + string(r.Stderr), r.Code
	}

	// The guest writes; the host sees it.
	if out, code := sh("mkdir -p /mnt/rw/sub && echo written by the guest > /mnt/rw/sub/out.txt && cat /mnt/rw/sub/out.txt"); code != 0 {
		t.Fatalf("write to the share: %d %s", code, out)
	}
	if got, err := os.ReadFile(filepath.Join(rw, "sub", "out.txt")); err != nil || string(got) != "written by the guest\n" {
		t.Errorf("host reads %q, %v", got, err)
	}
	// The agent's file API and the share agree.
	if got, err := sb.ReadFile(ctx, "/mnt/rw/sub/out.txt"); err != nil || string(got) != "written by the guest\n" {
		t.Errorf("ReadFile through the agent: %q, %v", got, err)
	}

	// Reads are cached in the guest (cache=readahead), yet every open
	// sees the host's latest contents, and the guest's own writes.
	co := filepath.Join(rw, "co.txt")
	for i, content := range []string{"first", "second, longer", "SECOND, LONGER"} {
		if err := os.WriteFile(co, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, code := sh("cat /mnt/rw/co.txt"); code != 0 || out != content {
			t.Errorf("after host write %d, the guest's cat /mnt/rw/co.txt = %q (exit %d), want %q", i+1, out, code, content)
		}
	}
	if out, code := sh("echo a > /mnt/rw/gw.txt; cat /mnt/rw/gw.txt; echo bbb > /mnt/rw/gw.txt; cat /mnt/rw/gw.txt; echo C >> /mnt/rw/gw.txt; cat /mnt/rw/gw.txt"); code != 0 || out != "a\nbbb\nbbb\nC\n" {
		t.Errorf("the guest rewriting and reading back a shared file: %q (exit %d), want %q", out, code, "a\nbbb\nbbb\nC\n")
	}

	// Read-only: refused, and the host tree is untouched.
	// (u-root's mkdir reports the error but exits 0, so only its message
	// is checked.)
	for _, op := range []string{"echo x > /mnt/ro/new.txt", "echo x >> /mnt/ro/keep.txt", "rm /mnt/ro/keep.txt", "mkdir /mnt/ro/d"} {
		out, code := sh(op)
		if (code == 0 && !strings.HasPrefix(op, "mkdir")) || !strings.Contains(strings.ToLower(out), "read-only file system") {
			t.Errorf("%s on a read-only share: exit %d, %q", op, code, out)
		}
	}
	if got, err := os.ReadFile(filepath.Join(ro, "keep.txt")); err != nil || string(got) != "unchanged" {
		t.Errorf("read-only share changed: %q, %v", got, err)
	}
	if ents, _ := os.ReadDir(ro); len(ents) != 1 {
		t.Errorf("read-only share holds %d entries, want 1", len(ents))
	}

	// Symlinks are the guest's own: they resolve inside the guest, never
	// to the host's files.
	out, _ := sh(fmt.Sprintf("ln -s %s /mnt/rw/mine; ln -s ../secret.txt /mnt/rw/rel; cat /mnt/rw/mine /mnt/rw/rel /mnt/rw/planted; cat /mnt/rw/../secret.txt", secret))
	if strings.Contains(out, "TOPSECRET") {
		t.Errorf("the guest read a host file outside the share: %q", out)
	}
	if target, err := os.Readlink(filepath.Join(rw, "mine")); err != nil || target != secret {
		t.Errorf("the guest's symlink on the host: %q, %v", target, err)
	}

	// A pipeline over a shared tree gives the host's checksums.
	sh("cd /srv/tree && find . -type f > /tmp/list && wc -l /tmp/list")
	sh("sort /tmp/list > /tmp/sorted && wc -l /tmp/sorted")
	sh("cd /srv/tree && xargs shasum -a 256 < /tmp/sorted > /tmp/sums && wc -l /tmp/sums")
	out, code := sh("cd /srv/tree && find . -type f | sort | xargs shasum -a 256")
	if code != 0 {
		t.Fatalf("find | xargs shasum: %d %s", code, out)
	}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			t.Fatalf("shasum line %q", line)
		}
		got = append(got, strings.TrimPrefix(f[len(f)-1], "./")+" "+f[0])
	}
	sort.Strings(got)
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("guest checksums:\n%s\nhost checksums:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// makeTree writes a few hundred files of varied sizes under dir and
// returns "path sha256" lines, sorted.
func makeTree(t *testing.T, dir string) []string {
	t.Helper()
	var lines []string
	for i := range 300 {
		rel := filepath.Join(fmt.Sprintf("d%d", i%7), fmt.Sprintf("e%d", i%3), fmt.Sprintf("f%03d.bin", i))
		data := []byte(strings.Repeat(fmt.Sprintf("file %d;", i), 1+i*37%5000))
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(data)
		lines = append(lines, rel+" "+hex.EncodeToString(sum[:]))
	}
	sort.Strings(lines)
	return lines
}
