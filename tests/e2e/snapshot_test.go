package e2e

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"math"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// restoreSandbox restores the snapshot in dir and closes the sandbox at
// cleanup, logging its state on failure.
func restoreSandbox(t *testing.T, ctx context.Context, dir string, o sandbox.RestoreOptions) *sandbox.Sandbox {
	t.Helper()
	sb, err := sandbox.Restore(ctx, dir, o)
	if err != nil {
		t.Fatalf("Restore(%s) = %v", dir, err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the restored sandbox's state at the failure:\n%s", sb.Debug(context.Background()))
		}
		sb.Close()
	})
	return sb
}

// readCount reads the number a counting loop keeps writing to path (it
// truncates the file before each write: a read may fall between).
func readCount(t *testing.T, ctx context.Context, sb *sandbox.Sandbox, path string) int {
	t.Helper()
	for range 20 {
		b, err := sb.ReadFile(ctx, path)
		if err != nil {
			t.Fatalf("ReadFile(%s) = %v", path, err)
		}
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			return n
		}
	}
	t.Fatalf("%s was never whole in 20 reads", path)
	return 0
}

// TestSnapshotRollback is cersei-vms' rollback recipe, and more: files
// prepared, a snapshot taken (the sandbox runs on), the files broken; the
// sandbox restored from the snapshot has them intact, execs, keeps the
// process that was counting at snapshot time counting, and has the host's
// wall clock. Two restores of one snapshot are independent copies whose
// random numbers differ.
func TestSnapshotRollback(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	sb := startSandbox(t, ctx, sandbox.New())
	if err := sb.WriteFile(ctx, "/tmp/data", []byte("prepared"), 0o644); err != nil {
		t.Fatal(err)
	}
	loop, err := sb.Stream(ctx, sandbox.ExecOptions{Argv: []string{"sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.01; done"}})
	if err != nil {
		t.Fatal(err)
	}
	defer loop.Signal(context.Background(), "SIGKILL")
	time.Sleep(time.Second)
	dir := filepath.Join(t.TempDir(), "snap")
	start := time.Now()
	if err := sb.Snapshot(ctx, dir); err != nil {
		t.Fatalf("Snapshot() = %v", err)
	}
	t.Logf("Snapshot() took %v", time.Since(start).Round(time.Millisecond))
	if sb.Paused() {
		t.Error("the sandbox is paused after Snapshot, want it running")
	}
	if err := sb.Snapshot(ctx, dir); err == nil {
		t.Error("Snapshot() into an existing snapshot = nil error")
	}
	// Broken after the snapshot.
	if out, err := sb.Exec(ctx, sandbox.Shell("rm /tmp/data")); err != nil || out.Code != 0 {
		t.Fatalf("rm /tmp/data = %v, %v", out, err)
	}
	atSnapshot := readCount(t, ctx, sb, "/tmp/count")

	start = time.Now()
	r := restoreSandbox(t, ctx, dir, sandbox.RestoreOptions{})
	t.Logf("Restore() took %v", time.Since(start).Round(time.Millisecond))
	if b, err := r.ReadFile(ctx, "/tmp/data"); err != nil || string(b) != "prepared" {
		t.Errorf("restored /tmp/data = %q, %v; want the prepared file back", b, err)
	}
	if out, err := r.Exec(ctx, sandbox.ExecOptions{Argv: []string{"echo", "restored"}}); err != nil || string(out.Stdout) != "restored\n" {
		t.Errorf("exec in the restored sandbox = %+v, %v", out, err)
	}
	c1 := readCount(t, ctx, r, "/tmp/count")
	time.Sleep(time.Second)
	if c2 := readCount(t, ctx, r, "/tmp/count"); c2 <= c1 || c1 > atSnapshot+1000 {
		t.Errorf("the counting loop in the restored sandbox went %d -> %d (the source was at %d); want it going on from the snapshot", c1, c2, atSnapshot)
	}
	procs, err := r.Processes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var looping bool
	for _, p := range procs {
		looping = looping || (p.Exit == nil && len(p.Argv) == 3 && strings.Contains(p.Argv[2], "/tmp/count"))
	}
	if !looping {
		t.Errorf("Processes() in the restored sandbox = %+v; want the loop running", procs)
	}
	hostNow := time.Now()
	if err := r.WriteFile(ctx, "/tmp/now", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if fi, err := r.Stat(ctx, "/tmp/now"); err != nil || math.Abs(time.Unix(0, fi.ModTimeNs).Sub(hostNow).Seconds()) > 2 {
		t.Errorf("the restored guest's wall clock: a file written now is stamped %v (%v), the host says %v", time.Unix(0, fi.ModTimeNs), err, hostNow)
	}

	// A second copy: its own files, its own random numbers.
	r2 := restoreSandbox(t, ctx, dir, sandbox.RestoreOptions{})
	if err := r.WriteFile(ctx, "/tmp/only-in-first", []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := r2.Stat(ctx, "/tmp/only-in-first"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a file written in one restored copy: Stat in the other = %v, want not found", err)
	}
	random := func(s *sandbox.Sandbox) []byte {
		out, err := s.Exec(ctx, sandbox.Shell("dd if=/dev/urandom bs=32 count=1 2>/dev/null"))
		if err != nil || len(out.Stdout) != 32 {
			t.Fatalf("32 random bytes = %q, %v", out.Stdout, err)
		}
		return out.Stdout
	}
	if a, b := random(r), random(r2); bytes.Equal(a, b) {
		t.Errorf("two copies restored from one snapshot drew the same random bytes % x", a)
	}
}
