package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/vmm"
)

// newSandbox starts a sandbox from the built kernel and initramfs.
func newSandbox(t testing.TB, ctx context.Context, cpus int) *sandbox.Sandbox {
	t.Helper()
	return startSandbox(t, ctx, sandbox.New().CPUs(cpus))
}

// startSandbox starts b's sandbox (256 MiB, the built kernel and
// initramfs, sleep as its main process), closes it at cleanup and logs its
// state if the test failed.
func startSandbox(t testing.TB, ctx context.Context, b *sandbox.Builder) *sandbox.Sandbox {
	t.Helper()
	return startSized(t, ctx, b.Memory(256))
}

// startSized is startSandbox for a builder that sets its own memory size.
func startSized(t testing.TB, ctx context.Context, b *sandbox.Builder) *sandbox.Sandbox {
	t.Helper()
	sb, err := b.
		Kernel(artifact(t, "vmlinux")).Initrd(artifact(t, "initramfs.cpio")).
		Run("sleep", "100000").Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the sandbox's state at the failure:\n%s", sb.Debug(context.Background()))
		}
		sb.Close()
	})
	return sb
}

func TestRunExitCodeAndOutput(t *testing.T) {
	r := capsa(t, 3*time.Minute, "run", "--", "sh", "-c", "echo hi; exit 3")
	if r.code != 3 || r.stdout != "hi\n" {
		t.Errorf("exit %d, stdout %q; want 3 and \"hi\\n\"", r.code, r.stdout)
	}
}

func TestRunStdinAndEnv(t *testing.T) {
	bin := artifact(t, "capsa")
	cmd := exec.Command(bin, "run", "-i", "-e", "WHO=capsa", "-w", "/tmp", "--", "sh", "-c", `cat; echo "$WHO in $(pwd)"`)
	cmd.Stdin = strings.NewReader("from stdin\n")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if string(out) != "from stdin\ncapsa in /tmp\n" {
		t.Errorf("stdout %q", out)
	}
}

func TestRunTimeout(t *testing.T) {
	start := time.Now()
	r := capsa(t, 3*time.Minute, "run", "--timeout", "2s", "--", "sh", "-c", "echo started; sleep 1000")
	if r.code != 124 || !strings.Contains(r.stderr, "timed out") || r.stdout != "started\n" {
		t.Errorf("exit %d stderr %q stdout %q", r.code, r.stderr, r.stdout)
	}
	t.Logf("timed out after %v in all", time.Since(start))
}

// stopAgent is a guest shell line, run by the agent, that stops the
// agent's server: the shell's parent (as TestGuestDeathEndsExecs kills
// it), not PID 1, which the kernel keeps SIGSTOP from; 19 is SIGSTOP
// (u-root's kill takes no names). It used to find the server by walking
// /proc with a cat per process, which took about two minutes in the
// nested host, where each fork is slow.
const stopAgent = `kill -19 $PPID`

// TestRunTimeoutWithoutTheAgent: a command that stops the agent (it runs
// as root in the guest) cannot make `capsa run --timeout` wait forever:
// the host gives up agent.HostGrace after the timeout, stops the sandbox
// and exits 124.
func TestRunTimeoutWithoutTheAgent(t *testing.T) {
	// The agent would end the command at 15 s; stopped at once, it
	// cannot, and the host gives up HostGrace later.
	start := time.Now()
	r := capsa(t, 3*time.Minute, "run", "--timeout", "15s", "--", "sh", "-c", stopAgent+"; sleep 1000")
	took := time.Since(start)
	if r.code != 124 || !strings.Contains(r.stderr, "timed out") {
		t.Errorf("exit %d stderr %q stdout %q", r.code, r.stderr, r.stdout)
	}
	if took < 15*time.Second+agent.HostGrace {
		t.Errorf("capsa run ended after %v: before the host's deadline (15s + %v), so the agent was not stopped and this tested nothing", took, agent.HostGrace)
	}
	t.Logf("timed out after %v in all", took)
}

func TestLargeFileRoundTrip(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	sb := newSandbox(t, ctx, 1)
	data := make([]byte, 64<<20)
	rand.Read(data)
	if err := sb.WriteFileFrom(ctx, "/tmp/big", bytes.NewReader(data), 0o600); err != nil {
		t.Fatal(err)
	}
	st, err := sb.Stat(ctx, "/tmp/big")
	if err != nil || st.Size != int64(len(data)) {
		t.Fatalf("stat %+v, %v", st, err)
	}
	// The guest computes the same checksum.
	out, err := sb.Exec(ctx, sandbox.Command("shasum", "-a", "256", "/tmp/big"))
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%x", sha256.Sum256(data))
	if !strings.HasPrefix(string(out.Stdout), want) {
		t.Errorf("guest sha256 %q, want %s", out.Stdout, want)
	}
	h := sha256.New()
	if err := sb.ReadFileTo(ctx, "/tmp/big", h); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprintf("%x", h.Sum(nil)) != want {
		t.Error("read back a different file")
	}
}

func TestFilesystemCalls(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	sb := newSandbox(t, ctx, 1)
	if err := sb.MkdirAll(ctx, "/tmp/a/b", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := sb.WriteFile(ctx, "/tmp/a/b/f", []byte("x"), 0o640); err != nil {
		t.Fatal(err)
	}
	ents, err := sb.ListDir(ctx, "/tmp/a/b")
	if err != nil || len(ents) != 1 || ents[0].Name != "f" {
		t.Fatalf("list %+v, %v", ents, err)
	}
	if ok, _ := sb.Exists(ctx, "/tmp/a/b/f"); !ok {
		t.Error("written file does not exist")
	}
	if err := sb.Remove(ctx, "/tmp/a", true); err != nil {
		t.Fatal(err)
	}
	if ok, _ := sb.Exists(ctx, "/tmp/a"); ok {
		t.Error("removed tree exists")
	}
	if _, err := sb.ReadFile(ctx, "/nonexistent"); err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("missing file: %v", err)
	}
	info, err := sb.Info(ctx)
	if err != nil || info.Hostname != "capsa" || info.CPUs != 1 || !strings.HasSuffix(info.KernelVersion, "-capsa") {
		t.Errorf("info %+v, %v", info, err)
	}
	// Streaming exec with a signal.
	var out bytes.Buffer
	p, err := sb.Stream(ctx, sandbox.ExecOptions{Shell: "echo ready; sleep 1000", Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); !strings.Contains(out.String(), "ready") && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	p.Signal(ctx, "SIGTERM")
	st, err := p.Wait()
	if err != nil || st.Signal != "SIGTERM" {
		t.Errorf("signalled exec: %+v, %v", st, err)
	}
	if err := sb.Shutdown(ctx); err != nil {
		t.Errorf("shutdown: %v", err)
	}
	if exit := sb.Exit(); exit == nil || !exit.Reason.Clean() {
		t.Errorf("after shutdown the VM exit is %v", exit)
	}
}

func TestFourSandboxesInParallel(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := sandbox.New().Memory(256).
				Kernel(artifact(t, "vmlinux")).Initrd(artifact(t, "initramfs.cpio")).
				Run("sleep", "100000").Start(ctx)
			if err != nil {
				t.Errorf("sandbox %d: %v", i, err)
				return
			}
			defer sb.Close()
			// Each sandbox is its own machine: a file written in one is
			// not in another.
			name := fmt.Sprintf("/tmp/mine-%d", i)
			if err := sb.WriteFile(ctx, name, []byte("x"), 0o644); err != nil {
				t.Errorf("sandbox %d: write %s: %v", i, name, err)
				return
			}
			out, err := sb.Exec(ctx, sandbox.Shell("ls /tmp | grep mine"))
			if err != nil {
				t.Errorf("sandbox %d: exec: %v", i, err)
				return
			}
			if got := strings.TrimSpace(string(out.Stdout)); got != fmt.Sprintf("mine-%d", i) {
				t.Errorf("sandbox %d sees %q", i, got)
			}
		}()
	}
	wg.Wait()
}

func TestExampleProgram(t *testing.T) {
	bin := artifact(t, "example-sandbox")
	cmd := exec.Command(bin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("%v\n%s%s", err, out.String(), errb.String())
	}
	// The kernel is Debian's current 6.12 source with capsa's config: its
	// patch level moves with the package.
	for _, want := range []string{`exec: hello from capsa\n`, `file: capsa was here\n`, `info: kernel 6\.12\.[0-9]+-capsa, 2 CPUs`} {
		if !regexp.MustCompile(want).MatchString(out.String()) {
			t.Errorf("example output lacks %q:\n%s", want, out.String())
		}
	}
}

// TestHybridVsockSocket reaches the guest agent through the sandbox's Unix
// socket with Firecracker's handshake, as a tool outside Go would.
func TestHybridVsockSocket(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	sock := filepath.Join(t.TempDir(), "vsock.sock")
	sb, err := sandbox.New().Memory(256).VsockSocket(sock).
		Kernel(artifact(t, "vmlinux")).Initrd(artifact(t, "initramfs.cpio")).
		Run("sleep", "100000").Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	cl := &agent.Client{Name: "hybrid-test", Dial: func(ctx context.Context) (net.Conn, error) {
		c, err := net.Dial("unix", sock)
		if err != nil {
			return nil, err
		}
		fmt.Fprintf(c, "CONNECT %d\n", agent.Port)
		// Read the reply a byte at a time: what follows it is the stream.
		var line []byte
		b := make([]byte, 1)
		for len(line) == 0 || line[len(line)-1] != '\n' {
			if _, err := c.Read(b); err != nil {
				return nil, err
			}
			line = append(line, b[0])
		}
		if !strings.HasPrefix(string(line), "OK ") {
			return nil, fmt.Errorf("handshake: %q", line)
		}
		return c, nil
	}}
	info, err := cl.Info(ctx)
	if err != nil || info.Hostname != "capsa" {
		t.Fatalf("info through the hybrid socket: %+v, %v", info, err)
	}
	out, err := cl.Output(ctx, agent.ExecOptions{Shell: "echo via unix socket"})
	if err != nil {
		t.Errorf("exec through the hybrid socket: %v", err)
	} else if string(out.Stdout) != "via unix socket\n" {
		t.Errorf("exec through the hybrid socket: %q", out.Stdout)
	}
}

// TestGuestDeathEndsExecs: when the guest goes away, calls in flight fail
// at once with the VM's exit, not when their contexts run out.
func TestGuestDeathEndsExecs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sb := newSandbox(t, ctx, 1)
	errc := make(chan error, 1)
	go func() {
		_, err := sb.Exec(ctx, sandbox.Shell("sleep 100000"))
		errc <- err
	}()
	// Killing the agent makes the guest's init reboot the machine.
	if _, err := sb.Exec(ctx, sandbox.Shell("sleep 1; kill -9 $PPID")); err == nil {
		t.Log("the exec that killed the agent returned without error")
	}
	// The exec fails when its connection drops with the agent, or when
	// the VM stops, whichever comes first; never by its context.
	err := <-errc
	if err == nil || ctx.Err() != nil {
		t.Fatalf("exec in flight when the guest died: %v (context: %v)", err, ctx.Err())
	}
	select {
	case <-sb.Done():
	case <-ctx.Done():
		t.Fatal("the VM did not stop after its agent was killed")
	}
	if _, err := sb.Exec(ctx, sandbox.Command("true")); err == nil {
		t.Error("exec after the guest died succeeded")
	}
}

// TestWatchdogReportsAHungGuest: a guest whose agent stops answering while
// its vCPUs idle is stopped by the host as hung, with its state, instead
// of leaving the caller waiting forever.
func TestWatchdogReportsAHungGuest(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sb, err := sandbox.New().Memory(256).Watchdog(20*time.Second).
		Kernel(artifact(t, "vmlinux")).Initrd(artifact(t, "initramfs.cpio")).
		Run("sleep", "100000").Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	// Stopping the agent's server silences the agent, and the guest goes
	// idle.
	r, err := sb.Exec(ctx, sandbox.Shell(stopAgent+"; sleep 1"))
	if err == nil {
		t.Fatalf("Exec returned no error from a guest whose agent was stopped: exit %d, stdout %q, stderr %q", r.Code, r.Stdout, r.Stderr)
	}
	if ctx.Err() != nil {
		t.Fatalf("Exec waited until the test's deadline: %v", err)
	}
	e := sb.Exit()
	if e == nil || e.Reason != vmm.StopHung {
		t.Fatalf("Exit() = %v, want %v", e, vmm.StopHung)
	}
	if e.Debug == nil || len(e.Debug.VCPUs) != 1 || !strings.Contains(err.Error(), "guest hung") {
		t.Errorf("a hung guest's error %q and state %v", err, e.Debug)
	}
	t.Logf("reported: %v\n%s", err, e.Debug)
}
