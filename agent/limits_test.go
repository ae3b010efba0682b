package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeAgent is a client whose every connection is answered by script after
// the Hellos and the request: a guest agent that does not play fair.
func fakeAgent(script func(c *Conn, nc net.Conn, req Request)) *Client {
	return &Client{Name: "test", Dial: func(ctx context.Context) (net.Conn, error) {
		a, b := net.Pipe()
		go func() {
			defer b.Close()
			c := NewConn(b)
			if c.ReadJSON(FrameHello, &Hello{}) != nil {
				return
			}
			if c.WriteJSON(FrameHello, Hello{Version: ProtocolVersion}) != nil {
				return
			}
			var req Request
			if c.ReadJSON(FrameRequest, &req) != nil {
				return
			}
			script(c, b, req)
		}()
		return a, nil
	}}
}

// TestSignalWhileStdinIsFull: a process that never reads its stdin can
// still be signalled while the host keeps writing to it.
func TestSignalWhileStdinIsFull(t *testing.T) {
	cl := serve(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// An endless stdin: the pipe, the agent's queue and the connection
	// fill up behind a process that reads none of it.
	p, err := cl.Start(ctx, ExecOptions{Argv: []string{"sleep", "100"}, Stdin: zeros{}})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	sctx, scancel := context.WithTimeout(ctx, 5*time.Second)
	defer scancel()
	if err := p.Signal(sctx, "SIGTERM"); err != nil {
		t.Fatalf("Signal with stdin full = %v", err)
	}
	st, err := p.Wait()
	if err != nil || st.Signal != "SIGTERM" {
		t.Errorf("Wait() = %+v, %v; want the SIGTERM", st, err)
	}
	if err := p.Signal(sctx, "SIGTERM"); err == nil || !strings.Contains(err.Error(), "no such process") {
		t.Errorf("Signal after the exit = %v, want ESRCH", err)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

func TestOutputLimit(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	_, err := cl.Output(ctx, ExecOptions{Shell: "head -c 100000 /dev/zero; sleep 100", MaxOutput: 1000})
	if !errors.Is(err, ErrLimit) || !strings.Contains(err.Error(), "1000 bytes") {
		t.Fatalf("Output of 100000 bytes with MaxOutput 1000 = %v, want ErrLimit naming the limit", err)
	}
	out, err := cl.Output(ctx, ExecOptions{Shell: "head -c 1000 /dev/zero; head -c 10 /dev/zero >&2", MaxOutput: 1010})
	if err != nil || len(out.Stdout) != 1000 || len(out.Stderr) != 10 {
		t.Fatalf("Output at the limit = %v", err)
	}
	out, err = cl.Output(ctx, ExecOptions{Shell: "head -c 100000 /dev/zero", MaxOutput: -1})
	if err != nil || len(out.Stdout) != 100000 {
		t.Fatalf("Output with no limit = %v", err)
	}
}

// TestReadFileRefusesMoreThanAnnounced: a guest that announces a 1-byte
// file and sends more is refused.
func TestReadFileRefusesMoreThanAnnounced(t *testing.T) {
	cl := fakeAgent(func(c *Conn, _ net.Conn, _ Request) {
		c.WriteJSON(FrameReply, FileInfo{Name: "f", Size: 1, Mode: 0o644})
		for range 100 {
			if c.WriteFrame(FrameData, make([]byte, 64<<10)) != nil {
				return
			}
		}
		c.WriteFrame(FrameEnd, nil)
	})
	var got bytes.Buffer
	_, err := cl.ReadFile(context.Background(), "/f", &got)
	if err == nil || !strings.Contains(err.Error(), "more than the 1 bytes") {
		t.Fatalf("ReadFile = %v, want a refusal", err)
	}
	if got.Len() > 0 {
		t.Errorf("%d bytes written past the announced size", got.Len())
	}
}

// TestHostSideTimeout: a guest that never reports the end of a process
// with a timeout is given up on HostGrace after it, its connection
// aborted (a guest that stopped answering is left no close handshake).
func TestHostSideTimeout(t *testing.T) {
	old := hostGrace
	hostGrace = 200 * time.Millisecond
	defer func() { hostGrace = old }()
	cl := fakeAgent(func(c *Conn, nc net.Conn, _ Request) {
		c.WriteJSON(FrameReply, ExecStarted{PID: 42})
		io.Copy(io.Discard, nc) // and never an exit status
	})
	var conn *abortConn
	dial := cl.Dial
	cl.Dial = func(ctx context.Context) (net.Conn, error) {
		nc, err := dial(ctx)
		if err == nil && conn == nil {
			conn = &abortConn{Conn: nc}
			return conn, nil
		}
		return nc, err
	}
	start := time.Now()
	_, err := cl.Exec(context.Background(), ExecOptions{Argv: []string{"x"}, Timeout: 100 * time.Millisecond})
	if !errors.Is(err, ErrTimedOut) {
		t.Fatalf("Exec = %v, want ErrTimedOut", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("gave up after %v", d)
	}
	if conn == nil || !conn.aborted.Load() {
		t.Errorf("the exec's connection was not aborted when the host gave up on the guest")
	}
}

// FuzzClientReplies: whatever a guest answers, every client call returns
// (an error or a result) without panicking, hanging or holding more than
// its limits.
func FuzzClientReplies(f *testing.F) {
	f.Add([]byte{0, 0, 0, 2, byte(FrameReply), '{', '}'})
	f.Add(append([]byte{0, 0, 0, 10, byte(FrameReply)}, `{"pid":1}`+" "...))
	f.Add([]byte{0, 0, 0, 0, byte(FrameEnd)})
	f.Fuzz(func(t *testing.T, reply []byte) {
		cl := fakeAgent(func(_ *Conn, nc net.Conn, _ Request) {
			nc.Write(reply)
		})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		cl.Stat(ctx, "/x")
		cl.ListDir(ctx, "/x")
		cl.Info(ctx)
		var b bytes.Buffer
		cl.ReadFile(ctx, "/x", &b)
		if out, err := cl.Output(ctx, ExecOptions{Argv: []string{"x"}, MaxOutput: 100}); err == nil && len(out.Stdout)+len(out.Stderr) > 100 {
			t.Fatalf("Output held %d bytes past its limit", len(out.Stdout)+len(out.Stderr))
		}
		if ctx.Err() != nil {
			t.Fatal("a call waited for the deadline on a closed connection")
		}
	})
}

func TestReadAllLimit(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	path := t.TempDir() + "/f"
	if err := os.WriteFile(path, make([]byte, 5000), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.ReadAll(ctx, path, 1000); !errors.Is(err, ErrLimit) || !strings.Contains(err.Error(), "1000 bytes") {
		t.Errorf("ReadAll(5000-byte file, 1000) = %v, want ErrLimit naming the limit", err)
	}
	for _, max := range []int64{0, 5000, -1} {
		if b, err := cl.ReadAll(ctx, path, max); err != nil || len(b) != 5000 {
			t.Errorf("ReadAll(5000-byte file, %d) = %d bytes, %v", max, len(b), err)
		}
	}
}

// TestHelloAndRequestTogether: once the client knows the agent's Hello,
// it sends the request without waiting for the agent's Hello. The agent
// here reads the request before it answers the Hello, which only a
// pipelined client passes; the first call (nothing known yet) may not.
func TestHelloAndRequestTogether(t *testing.T) {
	var calls atomic.Int32
	cl := &Client{Name: "test", Dial: func(ctx context.Context) (net.Conn, error) {
		a, b := net.Pipe()
		first := calls.Add(1) == 1
		go func() {
			defer b.Close()
			c := NewConn(b)
			if c.ReadJSON(FrameHello, &Hello{}) != nil {
				return
			}
			var req Request
			if first {
				if c.WriteJSON(FrameHello, Hello{Version: ProtocolVersion, Features: agentFeatures}) != nil || c.ReadJSON(FrameRequest, &req) != nil {
					return
				}
			} else {
				b.SetReadDeadline(time.Now().Add(2 * time.Second))
				if err := c.ReadJSON(FrameRequest, &req); err != nil {
					c.WriteError(fmt.Errorf("the request did not come with the Hello: %w", err))
					return
				}
				b.SetReadDeadline(time.Time{})
				c.WriteJSON(FrameHello, Hello{Version: ProtocolVersion, Features: agentFeatures})
			}
			c.WriteJSON(FrameReply, FileInfo{Name: req.Path})
		}()
		return a, nil
	}}
	ctx := context.Background()
	for i := range 3 {
		fi, err := cl.Stat(ctx, "/x")
		if err != nil || fi.Name != "/x" {
			t.Fatalf("Stat #%d = %+v, %v; want /x", i+1, fi, err)
		}
	}
}

// TestSpareConnection: a client with Spare dials the next connection
// ahead, and one the guest dropped meanwhile is replaced, not reported.
func TestSpareConnection(t *testing.T) {
	var mu sync.Mutex
	var dials int
	var ends []net.Conn
	cl := &Client{Name: "test", Spare: true, Dial: func(ctx context.Context) (net.Conn, error) {
		a, b := net.Pipe()
		mu.Lock()
		dials++
		ends = append(ends, b)
		mu.Unlock()
		go func() {
			defer b.Close()
			c := NewConn(b)
			var req Request
			if c.ReadJSON(FrameHello, &Hello{}) != nil || c.WriteJSON(FrameHello, Hello{Version: ProtocolVersion, Features: agentFeatures}) != nil ||
				c.ReadJSON(FrameRequest, &req) != nil {
				return
			}
			c.WriteJSON(FrameReply, FileInfo{Name: req.Path})
		}()
		return a, nil
	}}
	defer cl.Close()
	ctx := context.Background()
	stat := func(what string) {
		t.Helper()
		if fi, err := cl.Stat(ctx, "/x"); err != nil || fi.Name != "/x" {
			t.Fatalf("Stat (%s) = %+v, %v; want /x", what, fi, err)
		}
	}
	waitSpare := func() {
		t.Helper()
		for range 200 {
			cl.spareMu.Lock()
			ready := cl.spare != nil
			cl.spareMu.Unlock()
			if ready {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatal("no spare connection was dialed")
	}
	stat("first")
	waitSpare()
	mu.Lock()
	before := dials
	mu.Unlock()
	stat("on the spare")
	mu.Lock()
	if dials > before+1 {
		t.Errorf("Stat on a spare dialed %d times, want at most 1 (the next spare)", dials-before)
	}
	mu.Unlock()
	waitSpare()
	// The guest drops every connection (a restore's transport reset).
	mu.Lock()
	for _, e := range ends {
		e.Close()
	}
	mu.Unlock()
	stat("after the spare was dropped")
}
