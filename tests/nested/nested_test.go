package nested

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestOutputParser(t *testing.T) {
	var out bytes.Buffer
	p := &outputParser{nonce: "n1", out: &out, start: time.Now(), exit: -1}
	for _, chunk := range []string{
		"hello\r\n@@capsa-nested ready n1\n", "@@capsa-nested exit WRONG 0\n",
		"@@capsa-nested exit n1 4", "2\nlast line without newline",
	} {
		p.Write([]byte(chunk))
	}
	p.flush()
	if p.exit != 42 {
		t.Errorf("exit = %d, want 42", p.exit)
	}
	if p.ready == 0 {
		t.Error("ready line not seen")
	}
	want := "hello\r\n@@capsa-nested exit WRONG 0\nlast line without newline"
	if out.String() != want {
		t.Errorf("passed through %q, want %q", out.String(), want)
	}
}

func TestJobValidation(t *testing.T) {
	h := &Host{}
	ctx := context.Background()
	src := filepath.Join(t.TempDir(), "f")
	os.WriteFile(src, nil, 0o644)
	for _, job := range []Job{
		{},
		{Argv: []string{"true"}, Files: []File{{Src: src, Dst: "/abs"}}},
		{Argv: []string{"true"}, Files: []File{{Src: src, Dst: "../up"}}},
		{Argv: []string{"true"}, Files: []File{{Src: src, Dst: "."}}},
		{Argv: []string{"true"}, Files: []File{{Src: src + ".missing", Dst: "x"}}},
		{Argv: []string{"true"}, Env: []string{"NOEQUALS"}},
		{Argv: []string{"true"}, Env: []string{"A B=1"}},
	} {
		if _, err := h.Run(ctx, job); err == nil {
			t.Errorf("job %+v accepted", job)
		}
	}
}

func TestInitramfsContents(t *testing.T) {
	cpioBin, err := exec.LookPath("cpio")
	if err != nil {
		t.Skip("GNU cpio not installed")
	}
	dir := t.TempDir()
	mods := []string{filepath.Join(dir, "a.ko"), filepath.Join(dir, "b.ko")}
	for _, m := range append(mods, filepath.Join(dir, "busybox"), filepath.Join(dir, "payload")) {
		os.WriteFile(m, []byte(filepath.Base(m)), 0o755)
	}
	job := Job{
		Argv:  []string{"./x", "it's"},
		Env:   []string{"K=v w"},
		Files: []File{{Src: filepath.Join(dir, "payload"), Dst: "sub/dir/payload"}},
	}
	archive := filepath.Join(dir, "out.cpio")
	if err := (&Host{}).buildInitramfs(archive, job, "NONCE", mods, filepath.Join(dir, "busybox")); err != nil {
		t.Fatal(err)
	}
	ex := filepath.Join(dir, "ex")
	os.Mkdir(ex, 0o755)
	cmd := exec.Command(cpioBin, "-i", "-d", "--quiet", "--no-absolute-filenames", "-F", archive)
	cmd.Dir = ex
	if out, err := cmd.CombinedOutput(); err != nil && !strings.Contains(string(out), "dev/console") {
		t.Fatalf("cpio: %v\n%s", err, out)
	}
	for name, want := range map[string]string{
		"work/sub/dir/payload": "payload",
		"lib/kvm/0-a.ko":       "a.ko",
		"lib/kvm/1-b.ko":       "b.ko",
		"bin/busybox":          "busybox",
	} {
		if b, err := os.ReadFile(filepath.Join(ex, name)); err != nil || string(b) != want {
			t.Errorf("%s = %q, %v", name, b, err)
		}
	}
	script, _ := os.ReadFile(filepath.Join(ex, "job.sh"))
	if !strings.Contains(string(script), `export K='v w'`) || !strings.Contains(string(script), `exec './x' 'it'\''s'`) {
		t.Errorf("job.sh:\n%s", script)
	}
	init, _ := os.ReadFile(filepath.Join(ex, "init"))
	if !strings.Contains(string(init), "@@capsa-nested ready NONCE") || strings.Contains(string(init), "@NONCE@") {
		t.Errorf("nonce not substituted in init")
	}
}

func TestL1CrashDetection(t *testing.T) {
	for console, want := range map[string]bool{
		"[   25.09] BUG: TASK stack guard page was hit at 0000000077f1e3de\n":                              true,
		"[   25.10] Kernel panic - not syncing: corrupted stack end\n":                                     true,
		"[    7.01] kvm [97]: vcpu0, guest rIP: 0xffffffff810039ab Unhandled WRMSR(0xc0010007) = 0xffff\n": false,
		"": false,
	} {
		if got := l1Crashed([]byte(console)); got != want {
			t.Errorf("l1Crashed(%q) = %v", console, got)
		}
	}
}

// TestL1HeartbeatWatch: L1 is taken for stopped when its heartbeats,
// once begun, stop for l1Silence; a console that has shown none yet (L1
// still booting) is not, and a crash marker is reported as such.
func TestL1HeartbeatWatch(t *testing.T) {
	old := l1Silence
	l1Silence = 500 * time.Millisecond
	defer func() { l1Silence = old }()
	watch := func(console string, within time.Duration) string {
		path := filepath.Join(t.TempDir(), "console.log")
		if err := os.WriteFile(path, []byte(console), 0o644); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), within)
		defer cancel()
		why := make(chan string, 1)
		go watchL1Console(ctx, path, func(w string) { why <- w })
		select {
		case w := <-why:
			return w
		case <-ctx.Done():
			return ""
		}
	}
	if why := watch("booting\n", 5*time.Second); why != "" {
		t.Errorf("no heartbeat yet: taken for stopped (%s)", why)
	}
	if why := watch(l1Heartbeat+" 1\n", 8*time.Second); !strings.Contains(why, "heartbeat") {
		t.Errorf("heartbeats that stopped: %q; want L1 taken for stopped", why)
	}
	if why := watch("[ 1.0] Kernel panic - not syncing: x\n", 5*time.Second); !strings.Contains(why, "crash") {
		t.Errorf("a panic: %q; want a crash", why)
	}
}

// TestQEMUCrashDetection: QEMU ending on SIGABRT (its own assertion) or on
// a fault is told from other ends, with the assertion or the signal as the
// reason: a real process that aborts, one that faults, one that exits,
// and one killed otherwise.
func TestQEMUCrashDetection(t *testing.T) {
	run := func(script string) *os.ProcessState {
		cmd := exec.Command("sh", "-c", script)
		cmd.Run()
		return cmd.ProcessState
	}
	stderr := []byte("qemu-system-x86_64: warning: TCG doesn't support requested feature: CPUID.0DH:EAX.xsavec [bit 1]\n" +
		"qemu-system-x86_64: ../system/memory.c:2451: memory_region_get_ram_ptr: Assertion `mr->ram_block' failed.\n")
	why, ok := qemuCrashed(run("ulimit -c 0; kill -ABRT $$"), stderr)
	if !ok || !strings.Contains(why, "memory_region_get_ram_ptr: Assertion") {
		t.Errorf("an aborted QEMU: %q, %v; want its assertion", why, ok)
	}
	if why, ok := qemuCrashed(run("ulimit -c 0; kill -ABRT $$"), []byte("qemu: something\n")); !ok || why != "qemu: something" {
		t.Errorf("an aborted QEMU without an assertion: %q, %v; want its last line", why, ok)
	}
	if why, ok := qemuCrashed(run("ulimit -c 0; kill -SEGV $$"), stderr); !ok || why != "killed by segmentation fault" {
		t.Errorf("a QEMU that faulted: %q, %v; want the signal", why, ok)
	}
	for _, script := range []string{"exit 1", "kill -KILL $$", "kill -TERM $$"} {
		if why, ok := qemuCrashed(run(script), stderr); ok {
			t.Errorf("%s: %q, true; want not an abort", script, why)
		}
	}
	if _, ok := qemuCrashed(nil, stderr); ok {
		t.Error("no process state: an abort")
	}
}
