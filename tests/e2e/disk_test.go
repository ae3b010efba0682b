package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestDisks: a read-only and a writable host file become /dev/vda and
// /dev/vdb; the guest reads the first whole, copies it onto the second,
// cannot write the first, and the copy reaches the host file.
func TestDisks(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir := t.TempDir()
	data := make([]byte, 4<<20)
	rand.Read(data)
	roPath, rwPath := filepath.Join(dir, "data.img"), filepath.Join(dir, "scratch.img")
	if err := os.WriteFile(roPath, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(rwPath, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(rwPath, 8<<20); err != nil {
		t.Fatal(err)
	}
	sb := startSandbox(t, ctx, sandbox.New().Disk(roPath, sandbox.ReadOnly).Disk(rwPath, sandbox.ReadWrite))
	if err := sb.WaitReady(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	run := func(o sandbox.ExecOptions) *sandbox.Output {
		t.Helper()
		out, err := sb.Exec(ctx, o)
		if err != nil {
			t.Fatalf("exec %v: %v", o.Argv, err)
		}
		return out
	}
	var got []string
	for _, f := range []string{"vda/serial", "vda/ro", "vda/size", "vdb/serial", "vdb/ro", "vdb/size"} {
		b, err := sb.ReadFile(ctx, "/sys/block/"+f)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, strings.TrimSpace(string(b)))
	}
	if want := []string{"capsa-disk-0", "1", "8192", "capsa-disk-1", "0", "16384"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("serial, ro and size of vda and vdb = %q, want %q", got, want)
	}
	sum := sha256.Sum256(data)
	out := run(sandbox.Command("shasum", "-a", "256", "/dev/vda"))
	if !strings.Contains(string(out.Stdout), hex.EncodeToString(sum[:])) {
		t.Errorf("shasum of /dev/vda = %q, want %x", out.Stdout, sum)
	}
	if out = run(sandbox.Command("dd", "if=/dev/vda", "of=/dev/vdb", "bs=65536")); out.Code != 0 {
		t.Fatalf("dd from vda to vdb: exit %d, stderr %q", out.Code, out.Stderr)
	}
	if out = run(sandbox.Command("sync")); out.Code != 0 {
		t.Errorf("sync: exit %d, stderr %q", out.Code, out.Stderr)
	}
	copied, err := os.ReadFile(rwPath)
	if err != nil {
		t.Fatal(err)
	}
	if len(copied) != 8<<20 || !bytes.Equal(copied[:len(data)], data) || !bytes.Equal(copied[len(data):], make([]byte, len(copied)-len(data))) {
		t.Errorf("the writable disk's host file (%d bytes) does not hold the copy followed by zeros", len(copied))
	}
	if out = run(sandbox.Command("dd", "if=/dev/zero", "of=/dev/vda", "bs=512", "count=1")); out.Code == 0 {
		t.Errorf("dd onto the read-only disk succeeded in the guest (stderr %q)", out.Stderr)
	}
	if after, _ := os.ReadFile(roPath); !bytes.Equal(after, data) {
		t.Error("the read-only disk's host file changed")
	}
}

// TestDiskErrorsBeforeBoot: bad --disk arguments are clear errors and
// nothing boots.
func TestDiskErrorsBeforeBoot(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--disk", filepath.Join(dir, "missing.img")}, "missing.img: no such file or directory"},
		{[]string{"--disk", dir}, "not a regular file"},
		{[]string{"--disk", img, "--disk", img}, "in use by another VM"},
	} {
		r := capsa(t, time.Minute, append(append([]string{"run"}, tc.args...), "--", "true")...)
		if r.code == 0 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("capsa run %v: exit %d, stderr %q; want an error containing %q", tc.args, r.code, r.stderr, tc.want)
		}
	}
}
