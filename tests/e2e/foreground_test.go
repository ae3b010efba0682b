package e2e

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestForegroundSIGQUIT: Ctrl-\ on a foreground capsa run (SIGQUIT to its
// process group, as a terminal sends it) prints the VM's state, as a
// detached sandbox's supervisor logs it, and the sandbox runs on: its
// command finishes and capsa run exits with its code. As root the run is
// jailed, so the group holds the CLI and the VMM process it started again
// in a mount namespace; neither may die of the signal (Go's default).
func TestForegroundSIGQUIT(t *testing.T) {
	bin := artifact(t, "capsa")
	share := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "run", "-v", share+":/w", "--", "sh", "-c",
		"echo ready > /w/ready; while [ ! -e /w/go ]; do sleep 0.2; done; echo done; exit 7")
	var stdout, stderr syncBuffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	defer func() {
		t.Logf("capsa run: stdout %q\nstderr:\n%s", stdout.String(), stderr.String())
	}()
	until := func(what string, cond func() bool) {
		t.Helper()
		for !cond() {
			select {
			case err := <-waited:
				t.Fatalf("capsa run ended (%v) before %s", err, what)
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	until("its command ran", func() bool { _, err := os.Stat(filepath.Join(share, "ready")); return err == nil })
	if err := syscall.Kill(-cmd.Process.Pid, syscall.SIGQUIT); err != nil {
		t.Fatal(err)
	}
	until("the VM's state was printed", func() bool { return strings.Contains(stderr.String(), "vCPU 0:") })
	if err := os.WriteFile(filepath.Join(share, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	err := <-waited
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 7 {
		t.Fatalf("capsa run: %v; want exit 7, the command's, after the SIGQUIT", err)
	}
	if stdout.String() != "done\n" {
		t.Errorf("stdout %q; want the command's done", stdout.String())
	}
	if n := strings.Count(stderr.String(), "capsa run: on SIGQUIT, the VM's state:"); n != 1 {
		t.Errorf("the VM's state printed %d times for one SIGQUIT", n)
	}
	if strings.Contains(stderr.String(), "goroutine ") {
		t.Error("a process died of SIGQUIT, dumping its goroutines")
	}
}
