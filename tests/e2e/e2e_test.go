// Package e2e holds the end-to-end tests: they run the real capsa binary,
// which boots the real guest kernel under KVM. `make test-e2e` builds the
// binary, the kernel and the test initramfs and runs these tests where
// /dev/kvm works (inside the nested host when this machine has none).
package e2e

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/tests/nested"
)

// artifact finds a file built by `make test-e2e`: $CAPSA_E2E_DIR/name, else
// ./name (the nested host puts the files beside the test binary).
func artifact(t testing.TB, name string) string {
	t.Helper()
	if !nested.HaveKVM() {
		t.Skip("no /dev/kvm that boots Linux: end-to-end tests run through `make test-e2e`")
	}
	p, err := filepath.Abs(filepath.Join(artifactDir(), name))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Skipf("%s not built: run `make test-e2e`", name)
	}
	return p
}

func artifactDir() string {
	if dir := os.Getenv("CAPSA_E2E_DIR"); dir != "" {
		return dir
	}
	return "."
}

type result struct {
	stdout, stderr string
	code           int
}

func capsa(t *testing.T, timeout time.Duration, args ...string) result {
	t.Helper()
	return capsaWith(t, timeout, nil, args...)
}

// capsaWith runs capsa as capsa does, with setup (if not nil) changing the
// command first (its environment or credentials).
func capsaWith(t testing.TB, timeout time.Duration, setup func(*exec.Cmd), args ...string) result {
	t.Helper()
	bin := artifact(t, "capsa")
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	if setup != nil {
		setup(cmd)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		t.Fatalf("capsa %v: timed out after %v\nstdout:\n%s\nstderr:\n%s", args, timeout, r.stdout, r.stderr)
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	case err != nil:
		t.Fatalf("capsa %v: %v", args, err)
	}
	t.Logf("capsa %s: exit %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	return r
}

func TestBootToUserspace(t *testing.T) {
	initrd := artifact(t, "testinitrd.cpio")
	for _, cpus := range []string{"1", "2"} {
		t.Run("cpus="+cpus, func(t *testing.T) {
			r := capsa(t, 3*time.Minute, "vm", "--initrd", initrd, "--cpus", cpus, "--memory", "256M", "--boot-time")
			if r.code != 0 {
				t.Fatalf("exit %d, want 0 (the test init reboots)", r.code)
			}
			if !strings.Contains(r.stdout, "capsa-testinit: userspace reached") {
				t.Fatal("the guest did not reach userspace")
			}
			want := map[string]string{"1": `cpus=1 online=0\r?\n`, "2": `cpus=2 online=0-1\r?\n`}[cpus]
			if !regexp.MustCompile(want).MatchString(r.stdout) {
				t.Errorf("guest did not report %q", want)
			}
			if !strings.Contains(r.stderr, "boot time: guest userspace reached after") {
				t.Error("--boot-time printed no boot time")
			}
			if !strings.Contains(r.stderr, "guest rebooted") {
				t.Error("the exit reason does not say the guest rebooted")
			}
		})
	}
}

func TestGuestPanicExitsNonZero(t *testing.T) {
	initrd := artifact(t, "testinitrd.cpio")
	r := capsa(t, 3*time.Minute, "vm", "--initrd", initrd, "--memory", "256M", "--append", "capsa.test=panic")
	if r.code == 0 {
		t.Fatal("a guest panic exited 0")
	}
	if !strings.Contains(r.stderr, "kernel panic") || !strings.Contains(r.stderr, "Attempted to kill init") {
		t.Errorf("the exit reason does not name the panic: %q", r.stderr)
	}
}

func TestBadKernelIsAClearError(t *testing.T) {
	bogus := filepath.Join(t.TempDir(), "bogus")
	os.WriteFile(bogus, []byte("not a kernel"), 0o644)
	r := capsa(t, time.Minute, "vm", "--kernel", bogus)
	if r.code == 0 || !strings.Contains(r.stderr, "kernel") {
		t.Errorf("a bogus kernel: exit %d, stderr %q", r.code, r.stderr)
	}
}
