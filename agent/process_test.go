package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// startAndHangUp starts a process over a connection of its own and drops
// the connection at once, as a client that is killed does.
func startAndHangUp(t *testing.T, cl *Client, shell string) ExecStarted {
	t.Helper()
	ctx := context.Background()
	nc, err := cl.Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	c := NewConn(nc)
	c.WriteJSON(FrameHello, Hello{Version: ProtocolVersion, MinVersion: MinProtocolVersion})
	if err := c.ReadJSON(FrameHello, &Hello{}); err != nil {
		t.Fatal(err)
	}
	c.WriteJSON(FrameRequest, Request{Op: OpExec, Exec: &ExecRequest{Shell: shell}})
	var st ExecStarted
	if err := c.ReadJSON(FrameReply, &st); err != nil {
		t.Fatalf("exec %q: %v", shell, err)
	}
	return st
}

// syncBuffer is a bytes.Buffer that one goroutine writes while another
// reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// waitFor waits until buf holds want.
func waitFor(t *testing.T, buf *syncBuffer, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(buf.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("output %q never showed %q", buf.String(), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestProcessOutlivesItsClient: a process whose client hangs up goes on;
// any other connection lists it, attaches to it (recent output replayed,
// then the rest) and reads how it ended.
func TestProcessOutlivesItsClient(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	started := startAndHangUp(t, cl, "echo one; sleep 1; echo two; exit 7")
	procs, err := cl.Processes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var found *ProcessInfo
	for i := range procs {
		if procs[i].ID == started.ID {
			found = &procs[i]
		}
	}
	if found == nil || found.PID != started.PID || found.Exit != nil || len(found.Argv) != 3 || found.Argv[0] != "/bin/sh" {
		t.Fatalf("Processes() = %+v, want running process %+v", procs, started)
	}
	var out syncBuffer
	p, err := cl.Attach(ctx, started.ID, AttachOptions{Stdout: &out})
	if err != nil {
		t.Fatalf("Attach(%d) = %v", started.ID, err)
	}
	st, err := p.Wait()
	if err != nil || st.Code != 7 {
		t.Fatalf("attached Wait() = %+v, %v; want exit 7", st, err)
	}
	if out.String() != "one\ntwo\n" {
		t.Errorf("attached output = %q, want %q (replayed and followed)", out.String(), "one\ntwo\n")
	}
	if st, err := cl.Wait(ctx, started.ID); err != nil || st.Code != 7 {
		t.Errorf("Wait(%d) after the exit = %+v, %v; want exit 7", started.ID, st, err)
	}
	procs, _ = cl.Processes(ctx)
	if len(procs) != 1 || procs[0].Exit == nil || procs[0].Exit.Code != 7 {
		t.Errorf("Processes() after the exit = %+v, want it exited with 7", procs)
	}
	// Attaching to an exited process replays its output and its status.
	out = syncBuffer{}
	if p, err := cl.Attach(ctx, started.ID, AttachOptions{Stdout: &out}); err != nil {
		t.Errorf("Attach to the exited process = %v", err)
	} else if st, err := p.Wait(); err != nil || st.Code != 7 || out.String() != "one\ntwo\n" {
		t.Errorf("Attach to the exited process: %+v, %v, output %q", st, err, out.String())
	}
	if _, err := cl.Wait(ctx, 999); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("Wait(999) = %v, want ESRCH", err)
	}
	if err := cl.Signal(ctx, started.ID, "TERM"); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("Signal of the exited process = %v, want ESRCH", err)
	}
}

// TestAttachedInput: a client that attaches writes the process's stdin and
// signals it; detaching leaves the process running.
func TestAttachedInput(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	p, err := cl.Start(ctx, ExecOptions{Shell: "while read l; do echo got $l; done; echo eof", Stdin: neverEnds{}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Signal(ctx, "KILL")
	actx, detach := context.WithCancel(ctx)
	var out syncBuffer
	a, err := cl.Attach(actx, p.ID, AttachOptions{Stdin: strings.NewReader("x\n"), Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	// The attached client's end of input closes stdin: the loop ends.
	if st, err := a.Wait(); err != nil || st.Code != 0 || out.String() != "got x\neof\n" {
		t.Errorf("attached: %+v, %v, output %q", st, err, out.String())
	}
	detach()
	p2, err := cl.Start(ctx, ExecOptions{Argv: []string{"sleep", "100"}})
	if err != nil {
		t.Fatal(err)
	}
	actx, detach = context.WithCancel(ctx)
	a, err = cl.Attach(actx, p2.ID, AttachOptions{})
	if err != nil {
		t.Fatal(err)
	}
	detach()
	a.Wait()
	procs, _ := cl.Processes(ctx)
	for _, pi := range procs {
		if pi.ID == p2.ID && pi.Exit != nil {
			t.Errorf("detaching ended the process: %+v", pi)
		}
	}
	if err := p2.Signal(ctx, "TERM"); err != nil {
		t.Fatal(err)
	}
	if st, err := cl.Wait(ctx, p2.ID); err != nil || st.Signal != "SIGTERM" {
		t.Errorf("Wait() = %+v, %v; want SIGTERM", st, err)
	}
}

// neverEnds is stdin that blocks forever without data.
type neverEnds struct{}

func (neverEnds) Read([]byte) (int, error) { select {} }

// TestReplayIsBounded: a late attach gets the last 64 KiB, not everything.
func TestReplayIsBounded(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	started := startAndHangUp(t, cl, "head -c 300000 /dev/zero | tr '\\0' a; echo END")
	if _, err := cl.Wait(ctx, started.ID); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	p, err := cl.Attach(ctx, started.ID, AttachOptions{Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	p.Wait()
	if out.Len() > replayBytes || out.Len() < replayBytes/2 || !strings.HasSuffix(out.String(), "aaaEND\n") {
		t.Errorf("replay of %d bytes ending %q, want at most %d ending with the last output", out.Len(), out.String()[max(0, out.Len()-8):], replayBytes)
	}
}

// TestExitedProcessesAreForgotten: the table keeps the latest keepExited
// exited processes.
func TestExitedProcessesAreForgotten(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	var first int
	for i := range keepExited + 3 {
		p, err := cl.Start(ctx, ExecOptions{Argv: []string{"true"}})
		if err != nil {
			t.Fatal(err)
		}
		p.Wait()
		if i == 0 {
			first = p.ID
		}
	}
	procs, err := cl.Processes(ctx)
	if err != nil || len(procs) != keepExited {
		t.Fatalf("Processes() = %d processes, %v; want %d", len(procs), err, keepExited)
	}
	if _, err := cl.Wait(ctx, first); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("Wait(first) = %v, want ESRCH (forgotten)", err)
	}
}

// TestPTY: a process on a pty sees a terminal of the asked size, a resize
// reaches it, and ^C on its input interrupts it as a keyboard does.
func TestPTY(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	in, stdin := io.Pipe()
	defer stdin.Close()
	var out syncBuffer
	p, err := cl.Start(ctx, ExecOptions{
		Shell: `test -t 0 && echo tty; stty size; read a; stty size; trap "echo trapped" INT; sleep 100; echo done`,
		TTY:   &WindowSize{Rows: 24, Cols: 80}, Stdin: in, Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, &out, "24 80")
	if err := p.Resize(WindowSize{Rows: 30, Cols: 100}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the resize frame is on its way
	stdin.Write([]byte("x\r"))
	waitFor(t, &out, "30 100")
	time.Sleep(200 * time.Millisecond) // sleep is running
	stdin.Write([]byte{3})             // ^C
	st, err := p.Wait()
	if err != nil || st.Code != 0 {
		t.Fatalf("Wait() = %+v, %v (output %q)", st, err, out.String())
	}
	got := strings.ReplaceAll(out.String(), "\r\n", "\n")
	for _, want := range []string{"tty\n", "24 80\n", "30 100\n", "trapped\n", "done\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("pty output %q lacks %q", got, want)
		}
	}
	if _, err := cl.Start(ctx, ExecOptions{Argv: []string{"true"}, TTY: &WindowSize{}}); err == nil {
		t.Error("a 0x0 terminal was accepted")
	}
}

// TestHelloNegotiates: the agent picks the newest version both ranges
// hold and refuses ranges that do not meet; the client refuses an agent's
// choice outside its range and operations the agent did not announce.
func TestHelloNegotiates(t *testing.T) {
	for _, tc := range []struct {
		client Hello
		want   int // 0: refused
	}{
		{Hello{Version: ProtocolVersion}, ProtocolVersion},
		{Hello{Version: ProtocolVersion + 3, MinVersion: 1}, ProtocolVersion},
		{Hello{Version: ProtocolVersion + 3, MinVersion: ProtocolVersion + 1}, 0},
		{Hello{Version: MinProtocolVersion - 1}, 0},
		{Hello{Version: 3, MinVersion: 5}, 0},
	} {
		a, c := rawConn(t)
		c.WriteJSON(FrameHello, tc.client)
		var h Hello
		err := c.ReadJSON(FrameHello, &h)
		a.Close()
		switch {
		case tc.want == 0 && (err == nil || !strings.Contains(err.Error(), "version")):
			t.Errorf("Hello %+v: agent answered %+v, %v; want a version error", tc.client, h, err)
		case tc.want != 0 && (err != nil || h.Version != tc.want || !h.has(FeatureProcesses) || !h.has(FeaturePTY)):
			t.Errorf("Hello %+v: agent answered %+v, %v; want version %d with its features", tc.client, h, err, tc.want)
		}
	}
	old := func(h Hello) *Client {
		return &Client{Name: "test", Dial: func(ctx context.Context) (net.Conn, error) {
			a, b := net.Pipe()
			go func() {
				defer b.Close()
				c := NewConn(b)
				if c.ReadJSON(FrameHello, &Hello{}) != nil || c.WriteJSON(FrameHello, h) != nil {
					return
				}
				var req Request
				if c.ReadJSON(FrameRequest, &req) == nil {
					c.WriteJSON(FrameReply, Info{AgentVersion: "old"})
				}
			}()
			return a, nil
		}}
	}
	featureless := old(Hello{Version: ProtocolVersion, Name: "capsa-agent old"})
	if _, err := featureless.Processes(context.Background()); !errors.Is(err, ErrUnsupported) {
		t.Errorf("Processes() from an agent without %q = %v, want ErrUnsupported", FeatureProcesses, err)
	}
	if _, err := featureless.Start(context.Background(), ExecOptions{Argv: []string{"sh"}, TTY: &WindowSize{Rows: 1, Cols: 1}}); !errors.Is(err, ErrUnsupported) {
		t.Errorf("a pty exec on an agent without %q = %v, want ErrUnsupported", FeaturePTY, err)
	}
	if err := featureless.Sync(context.Background()); !errors.Is(err, ErrUnsupported) {
		t.Errorf("Sync() on an agent without %q = %v, want ErrUnsupported", FeatureSync, err)
	}
	if err := serve(t).Sync(context.Background()); err != nil {
		t.Errorf("Sync() = %v", err)
	}
	if in, err := featureless.Info(context.Background()); err != nil || in.AgentVersion != "old" {
		t.Errorf("Info() from an older agent = %+v, %v; want its answer", in, err)
	}
	if _, err := old(Hello{Version: ProtocolVersion + 1}).Info(context.Background()); !errors.Is(err, ErrVersion) {
		t.Errorf("an agent that chose a version the client does not speak: %v, want ErrVersion", err)
	}
}

// TestOperationsTable: the server handles exactly the operations of the
// table, each named once.
func TestOperationsTable(t *testing.T) {
	seen := map[string]bool{}
	for _, op := range Operations {
		if seen[op.Name] {
			t.Errorf("operation %q is in the table twice", op.Name)
		}
		seen[op.Name] = true
		if handlers[op.Name] == nil {
			t.Errorf("operation %q has no handler", op.Name)
		}
		if op.Doc == "" {
			t.Errorf("operation %q has no Doc", op.Name)
		}
	}
	for name := range handlers {
		if !seen[name] {
			t.Errorf("handler %q is not in the table", name)
		}
	}
}

// TestTimeoutKillsWhatTheProcessLeft: a process that ends before its
// timeout and leaves others running in its group (a fork bomb whose first
// copy the OOM killer took) has them killed at the deadline.
func TestTimeoutKillsWhatTheProcessLeft(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	out, err := cl.Output(ctx, ExecOptions{Argv: []string{"sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"}, Timeout: 500 * time.Millisecond})
	if err != nil || out.Code != 0 || out.TimedOut {
		t.Fatalf("Output(sleep in the background) = %+v, %v; want exit 0 before the timeout", out, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(out.Stdout)))
	if err != nil {
		t.Fatalf("the background pid %q: %v", out.Stdout, err)
	}
	defer syscall.Kill(pid, syscall.SIGKILL)
	// Gone, or a zombie waiting for whoever reaps orphans here.
	gone := func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return true
		}
		i := bytes.LastIndexByte(b, ')')
		return i > 0 && i+2 < len(b) && b[i+2] == 'Z'
	}
	if gone() {
		t.Fatalf("the background sleep %d is gone before the deadline", pid)
	}
	for range 100 {
		time.Sleep(50 * time.Millisecond)
		if gone() {
			return
		}
	}
	t.Errorf("the background sleep %d still runs 5 s after the exec's 500 ms timeout", pid)
}
