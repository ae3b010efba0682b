package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// serve runs a real agent server on a Unix socket and returns a client.
func serve(t *testing.T) *Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go (&Server{}).Serve(ctx, l)
	return &Client{Name: "test", Dial: func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}
}

func TestExec(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	out, err := cl.Output(ctx, ExecOptions{Shell: "echo hi; echo err >&2; exit 3"})
	if err != nil {
		t.Fatal(err)
	}
	if string(out.Stdout) != "hi\n" || string(out.Stderr) != "err\n" || out.Code != 3 || out.Signal != "" {
		t.Errorf("output %+v stdout %q stderr %q", out.ExitStatus, out.Stdout, out.Stderr)
	}
	dir := t.TempDir()
	out, err = cl.Output(ctx, ExecOptions{Argv: []string{"sh", "-c", `echo "$FOO $(pwd)"`}, Env: []string{"FOO=bar baz"}, Dir: dir})
	if err != nil || strings.TrimSpace(string(out.Stdout)) != "bar baz "+dir {
		t.Errorf("env/dir: %q, %v", out.Stdout, err)
	}
	if _, err := cl.Output(ctx, ExecOptions{Argv: []string{"/nonexistent"}}); err == nil || !strings.Contains(err.Error(), "nonexistent") {
		t.Errorf("missing binary: %v", err)
	}
	if _, err := cl.Output(ctx, ExecOptions{}); err == nil {
		t.Error("empty exec accepted")
	}
	if _, err := cl.Output(ctx, ExecOptions{Argv: []string{"true"}, Env: []string{"NOEQUALS"}}); err == nil {
		t.Error("bad env accepted")
	}
}

func TestExecStdin(t *testing.T) {
	cl := serve(t)
	data := make([]byte, 3<<20)
	rand.Read(data)
	var out bytes.Buffer
	st, err := cl.Exec(context.Background(), ExecOptions{Argv: []string{"cat"}, Stdin: bytes.NewReader(data), Stdout: &out})
	if err != nil || st.Code != 0 {
		t.Fatalf("cat: %+v, %v", st, err)
	}
	if !bytes.Equal(out.Bytes(), data) {
		t.Errorf("cat returned %d bytes, sent %d", out.Len(), len(data))
	}
}

func TestExecTimeoutWithStdinOpen(t *testing.T) {
	cl := serve(t)
	pr, pw := io.Pipe() // stdin that never ends
	defer pw.Close()
	start := time.Now()
	st, err := cl.Exec(context.Background(), ExecOptions{Shell: "sleep 100", Stdin: pr, Timeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if !st.TimedOut || st.Signal != "SIGKILL" || time.Since(start) > 10*time.Second {
		t.Errorf("status %+v after %v", st, time.Since(start))
	}
}

func TestExecSignal(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	p, err := cl.Start(ctx, ExecOptions{Argv: []string{"sleep", "100"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Signal(ctx, "BOGUS"); err == nil {
		t.Error("unknown signal accepted")
	}
	if err := p.Signal(ctx, "SIGTERM"); err != nil {
		t.Fatal(err)
	}
	st, err := p.Wait()
	if err != nil || st.Signal != "SIGTERM" || st.Code != 128+15 {
		t.Errorf("status %+v, %v", st, err)
	}
}

func TestExecConcurrent(t *testing.T) {
	cl := serve(t)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := cl.Output(context.Background(), ExecOptions{Shell: "sleep 0.2; echo $N", Env: []string{"N=" + string(rune('a'+i))}})
			if err != nil || strings.TrimSpace(string(out.Stdout)) != string(rune('a'+i)) {
				t.Errorf("exec %d: %q, %v", i, out.Stdout, err)
			}
		}()
	}
	wg.Wait()
}

func TestExecContextCancel(t *testing.T) {
	cl := serve(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := cl.Exec(ctx, ExecOptions{Shell: "sleep 100"}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("canceled exec: %v", err)
	}
}

// abortConn is a connection that records an Abort (vsock.Conn's).
type abortConn struct {
	net.Conn
	aborted atomic.Bool
}

func (c *abortConn) Abort() error {
	c.aborted.Store(true)
	return c.Conn.Close()
}

// TestContextEndAborts: an operation whose context ends before the agent's
// Hello closes its connection with Abort where the transport has one (no
// close handshake for a guest that reads nothing), and with Close after
// it (what was written still arrives).
func TestContextEndAborts(t *testing.T) {
	var conns []*abortConn
	cl := &Client{Dial: func(ctx context.Context) (net.Conn, error) {
		a, b := net.Pipe()
		go io.Copy(io.Discard, b) // a peer that reads and never answers
		c := &abortConn{Conn: a}
		conns = append(conns, c)
		return c, nil
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := cl.Info(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Info() from a silent peer = %v, want the deadline", err)
	}
	if len(conns) != 1 || !conns[0].aborted.Load() {
		t.Errorf("the connection was not aborted when the context ended")
	}

	answered := serve(t)
	base := answered.Dial
	var mu sync.Mutex
	var dialed []*abortConn
	answered.Dial = func(ctx context.Context) (net.Conn, error) {
		nc, err := base(ctx)
		if err != nil {
			return nil, err
		}
		c := &abortConn{Conn: nc}
		mu.Lock()
		dialed = append(dialed, c)
		mu.Unlock()
		return c, nil
	}
	ctx, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := answered.Exec(ctx, ExecOptions{Shell: "sleep 100"}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Exec(sleep 100) = %v, want the deadline", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(dialed) == 0 || dialed[0].aborted.Load() {
		t.Errorf("the exec's connection, which the agent had answered, was aborted when its context ended; want it closed")
	}
}

func TestFiles(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	dir := t.TempDir()
	data := make([]byte, 64<<20)
	rand.Read(data)
	path := filepath.Join(dir, "big")
	if err := cl.WriteFile(ctx, path, 0o600, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	fi, err := cl.ReadFile(ctx, path, h)
	if err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(data); !bytes.Equal(h.Sum(nil), sum[:]) || fi.Size != int64(len(data)) || os.FileMode(fi.Mode).Perm() != 0o600 {
		t.Errorf("read back: size %d mode %v, checksum match %v", fi.Size, os.FileMode(fi.Mode), bytes.Equal(h.Sum(nil), sum[:]))
	}
	if err := cl.AppendFile(ctx, path, 0, strings.NewReader("tail")); err != nil {
		t.Fatal(err)
	}
	if st, _ := cl.Stat(ctx, path); st.Size != int64(len(data))+4 {
		t.Errorf("after append: %d bytes", st.Size)
	}
	deep := filepath.Join(dir, "a/b/c")
	if err := cl.Mkdir(ctx, deep, 0o750, true); err != nil {
		t.Fatal(err)
	}
	if err := cl.Mkdir(ctx, filepath.Join(dir, "x/y"), 0o750, false); err == nil {
		t.Error("mkdir without parents made parents")
	}
	ents, err := cl.ListDir(ctx, dir)
	if err != nil || len(ents) != 2 {
		t.Fatalf("list: %+v, %v", ents, err)
	}
	if ok, _ := cl.Exists(ctx, deep); !ok {
		t.Error("made directory does not exist")
	}
	if err := cl.Remove(ctx, filepath.Join(dir, "a"), false); err == nil {
		t.Error("non-recursive remove of a tree succeeded")
	}
	if err := cl.Remove(ctx, filepath.Join(dir, "a"), true); err != nil {
		t.Fatal(err)
	}
	if ok, _ := cl.Exists(ctx, deep); ok {
		t.Error("removed tree still exists")
	}
	for name, err := range map[string]error{
		"relative":  cl.Mkdir(ctx, "rel/path", 0, true),
		"missing":   func() error { _, err := cl.Stat(ctx, "/nonexistent/x"); return err }(),
		"read dir":  func() error { _, err := cl.ReadFile(ctx, dir, io.Discard); return err }(),
		"write dir": cl.WriteFile(ctx, filepath.Join(dir, "nope/x"), 0, strings.NewReader("x")),
	} {
		var re *RemoteError
		if !errors.As(err, &re) {
			t.Errorf("%s: %v, want a remote error", name, err)
		}
	}
	if _, err := cl.Stat(ctx, "/nonexistent/x"); err == nil || err.Error() != "stat /nonexistent/x: no such file or directory" {
		t.Errorf("error wording: %v", err)
	} else if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Stat(/nonexistent/x) = %v, want it to match fs.ErrNotExist (the guest's errno)", err)
	}
	link := filepath.Join(dir, "link")
	if err := cl.Symlink(ctx, "big", link); err != nil {
		t.Fatalf("Symlink(big, %s) = %v", link, err)
	}
	if got, err := os.Readlink(link); err != nil || got != "big" {
		t.Errorf("Readlink(%s) = %q, %v; want big", link, got, err)
	}
	if err := cl.Symlink(ctx, "big", link); !errors.Is(err, fs.ErrExist) {
		t.Errorf("Symlink over an existing path = %v, want fs.ErrExist", err)
	}
	// Chown to this process's own ids works without privileges; it acts
	// on the link itself.
	if err := cl.Chown(ctx, link, os.Getuid(), os.Getgid()); err != nil {
		t.Errorf("Chown(%s) = %v", link, err)
	}
	if err := cl.Chown(ctx, filepath.Join(dir, "none"), 0, 0); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Chown of a missing path = %v, want fs.ErrNotExist", err)
	}
	info, err := cl.Info(ctx)
	if err != nil || info.CPUs < 1 || info.MemoryBytes == 0 || info.KernelVersion == "" {
		t.Errorf("info %+v, %v", info, err)
	}
}

// rawConn talks to a server byte by byte.
func rawConn(t *testing.T) (net.Conn, *Conn) {
	a, b := net.Pipe()
	go (&Server{}).ServeConn(context.Background(), b)
	return a, NewConn(a)
}

func TestProtocolRobustness(t *testing.T) {
	// Version mismatch.
	a, c := rawConn(t)
	c.WriteJSON(FrameHello, Hello{Version: 99})
	if err := c.ReadJSON(FrameHello, &Hello{}); err == nil || !strings.Contains(err.Error(), "version") {
		t.Errorf("version mismatch: %v", err)
	}
	a.Close()
	for name, raw := range map[string][]byte{
		"oversized frame": binary.BigEndian.AppendUint32(nil, MaxFrame+1),
		"unknown type":    {0, 0, 0, 0, 99},
		"garbage":         []byte("GET / HTTP/1.1\r\n\r\n"),
		"truncated":       {0, 0, 0, 10, byte(FrameHello), '{'},
		"bad json":        append([]byte{0, 0, 0, 2, byte(FrameHello)}, "{]"...),
		"unknown field":   append([]byte{0, 0, 0, 13, byte(FrameHello)}, `{"version":1,`...),
	} {
		a, c := rawConn(t)
		a.SetDeadline(time.Now().Add(time.Second))
		go a.Write(raw)
		if name == "oversized frame" {
			go a.Write([]byte{byte(FrameHello)})
		}
		t1, _, err := c.ReadFrame()
		if err == nil && t1 != FrameError {
			t.Errorf("%s: server answered %v", name, t1)
		}
		a.Close()
	}
	// A request with an unknown operation or an extra field.
	a, c = rawConn(t)
	c.WriteJSON(FrameHello, Hello{Version: ProtocolVersion})
	c.ReadJSON(FrameHello, &Hello{})
	c.WriteFrame(FrameRequest, []byte(`{"op":"format-disk"}`))
	if err := c.ReadJSON(FrameReply, &Empty{}); err == nil || !strings.Contains(err.Error(), "unknown operation") {
		t.Errorf("unknown op: %v", err)
	}
	a.Close()
}

func FuzzReadFrame(f *testing.F) {
	f.Add([]byte{0, 0, 0, 2, 1, '{', '}'})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 5})
	f.Fuzz(func(t *testing.T, b []byte) {
		c := NewConn(struct {
			io.Reader
			io.Writer
		}{bytes.NewReader(b), io.Discard})
		for range 4 {
			ft, p, err := c.ReadFrame()
			if err != nil {
				return
			}
			if ft == 0 || ft >= frameLimit || len(p) > MaxFrame {
				t.Fatalf("accepted frame type %d of %d bytes", ft, len(p))
			}
			var h Hello
			expectJSON(ft, p, FrameHello, &h)
		}
	})
}

// FuzzServeConn feeds arbitrary bytes to a server connection: it must
// answer or close, never panic or hang.
func FuzzServeConn(f *testing.F) {
	f.Add([]byte{0, 0, 0, 13, 1, '{', '"', 'v', 'e', 'r', 's', 'i', 'o', 'n', '"', ':', '2', '}'})
	f.Fuzz(func(t *testing.T, b []byte) {
		a, srv := net.Pipe()
		done := make(chan struct{})
		go func() {
			defer close(done)
			(&Server{}).ServeConn(context.Background(), srv)
		}()
		a.SetDeadline(time.Now().Add(2 * time.Second))
		go func() { a.Write(b); io.Copy(io.Discard, a) }()
		time.Sleep(time.Millisecond)
		a.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("server did not finish")
		}
	})
}

// TestExecLooksUpTheProcessPATH: a bare command is found in the PATH the
// request gives (an image's), not the agent's, and keeps its argv[0].
func TestExecLooksUpTheProcessPATH(t *testing.T) {
	cl := serve(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "only-here"), []byte("#!/bin/sh\necho \"$0 ran\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	var out *Output
	var err error
	for range 10 {
		// ETXTBSY: a process forked meanwhile by another test of this
		// process may still hold the script's write descriptor.
		out, err = cl.Output(context.Background(), ExecOptions{Argv: []string{"only-here"}, Env: []string{"PATH=" + dir}})
		if err == nil || !strings.Contains(err.Error(), "text file busy") {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("exec only-here with PATH=%s: %v", dir, err)
	}
	if string(out.Stdout) != filepath.Join(dir, "only-here")+" ran\n" && string(out.Stdout) != "only-here ran\n" {
		t.Errorf("exec only-here with PATH=%s = %q", dir, out.Stdout)
	}
	if _, err := cl.Output(context.Background(), ExecOptions{Argv: []string{"only-here"}}); err == nil {
		t.Error("a command outside the agent's PATH ran without the request's PATH")
	}
}
