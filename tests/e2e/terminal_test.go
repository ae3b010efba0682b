package e2e

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/store"
	"github.com/capsa-sandbox/capsa/supervisor"
	"github.com/creack/pty"
	"golang.org/x/sys/unix"
)

// TestProcessOutlivesExec: a process whose `capsa exec` is killed keeps
// running and finishes its work; the library lists it, attaches to it
// (its earlier output replayed) and reads how it ended.
func TestProcessOutlivesExec(t *testing.T) {
	dir := t.TempDir()
	cli := detachedCLI(t, dir)
	t.Cleanup(func() {
		if t.Failed() {
			logSandboxFiles(t, dir)
		}
		stopAll(t, dir)
	})
	if r := cli(3*time.Minute, "run", "-d", "--name", "p", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --name p = exit %d, stderr %q", r.code, r.stderr)
	}
	const script = "echo begun; sleep 5; echo finished > /tmp/done; echo out; exit 7"
	cmd := exec.Command(artifact(t, "capsa"), "exec", "p", "--", "sh", "-c", script)
	cmd.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "begun\n" {
		cmd.Process.Kill()
		t.Fatalf("capsa exec p's first line = %q, %v; want %q", line, err, "begun\n")
	}
	cmd.Process.Kill() // SIGKILL: no goodbye to the guest
	cmd.Wait()

	st, err := store.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	h, err := supervisor.Open(ctx, st, "p")
	if err != nil {
		t.Fatalf("supervisor.Open(p) = %v", err)
	}
	procs, err := h.Processes(ctx)
	if err != nil {
		t.Fatalf("Processes() = %v", err)
	}
	var found *agent.ProcessInfo
	for i, p := range procs {
		if len(p.Argv) == 3 && p.Argv[2] == script {
			found = &procs[i]
		}
	}
	if found == nil || found.Exit != nil {
		t.Fatalf("Processes() = %+v; want the killed exec's process, running", procs)
	}
	var out strings.Builder
	p, err := h.Attach(ctx, found.ID, agent.AttachOptions{Stdout: &out})
	if err != nil {
		t.Fatalf("Attach(%d) = %v", found.ID, err)
	}
	es, err := p.Wait()
	if err != nil || es.Code != 7 || out.String() != "begun\nout\n" {
		t.Errorf("attached to process %d: %+v, %v, output %q; want exit 7 and %q", found.ID, es, err, out.String(), "begun\nout\n")
	}
	if es, err := h.WaitProcess(ctx, found.ID); err != nil || es.Code != 7 {
		t.Errorf("WaitProcess(%d) = %+v, %v; want exit 7", found.ID, es, err)
	}
	if b, err := h.ReadFile(ctx, "/tmp/done"); err != nil || string(b) != "finished\n" {
		t.Errorf("the process's work: /tmp/done = %q, %v", b, err)
	}
}

// screen collects what a terminal shows.
type screen struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *screen) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// after waits until what the screen shows past offset from holds want, and
// returns the offset past it.
func (s *screen) after(t *testing.T, from int, want string) int {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		s.mu.Lock()
		text := s.b.String()
		s.mu.Unlock()
		if i := strings.Index(text[from:], want); i >= 0 {
			return from + i + len(want)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the terminal never showed %q; it shows:\n%s", want, text[from:])
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestTerminal: `capsa exec -it NAME sh` on a terminal, typed at as a
// person does: the shell's prompt, `stty size` as the terminal's, a resize
// followed, ^C interrupting `sleep 100` with the shell still there, its
// exit code passed through, and the terminal as it was afterwards.
func TestTerminal(t *testing.T) {
	startRegistry(t)
	ref := registryAddr + "/capsa-test/python:tty"
	pushPythonImage(t, ref)
	t.Setenv("CAPSA_CACHE", t.TempDir())
	dir := t.TempDir()
	cli := detachedCLI(t, dir)
	t.Cleanup(func() {
		if t.Failed() {
			logSandboxFiles(t, dir)
		}
		stopAll(t, dir)
	})
	if r := cli(5*time.Minute, "run", "-d", "--name", "tty", "--image", ref, "-u", "0", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --image %s = exit %d, stderr %q", ref, r.code, r.stderr)
	}

	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	defer tty.Close()
	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: 30, Cols: 100}); err != nil {
		t.Fatal(err)
	}
	before, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(artifact(t, "capsa"), "exec", "-it", "tty", "--", "sh")
	cmd.Env = append(os.Environ(), "CAPSA_STATE="+dir, "TERM=xterm")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var scr screen
	go io.Copy(&scr, ptmx)
	typeIn := func(s string) {
		for _, r := range s { // a key at a time
			ptmx.Write([]byte(string(r)))
			time.Sleep(20 * time.Millisecond)
		}
	}
	at := scr.after(t, 0, "# ")
	typeIn("stty size\r")
	at = scr.after(t, at, "30 100\r\n")
	at = scr.after(t, at, "# ")

	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: 40, Cols: 120}); err != nil { // SIGWINCH to capsa
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	typeIn("stty size\r")
	at = scr.after(t, at, "40 120\r\n")
	at = scr.after(t, at, "# ")

	typeIn("sleep 100\r")
	time.Sleep(2 * time.Second)
	start := time.Now()
	ptmx.Write([]byte{3}) // ^C
	at = scr.after(t, at, "# ")
	if d := time.Since(start); d > 60*time.Second {
		t.Errorf("^C took %v to end sleep 100", d)
	}
	typeIn("echo alive-$?\r")
	at = scr.after(t, at, "alive-130\r\n")
	typeIn("exit 3\r")

	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 3 {
			t.Errorf("capsa exec -it tty -- sh after exit 3: %v, want exit code 3", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("capsa exec -it did not end after the shell's exit")
	}
	after, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	if *after != *before {
		t.Errorf("the terminal after capsa exec -it = %+v, want it restored to %+v", after, before)
	}
}
