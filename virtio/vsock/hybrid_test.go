package vsock

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestHybridConnect(t *testing.T) {
	g := newGuest(t)
	_, path := serveHybrid(t, g)
	_, r, hostPort := hybridConnect(t, g, path, 52, "early")
	if p := g.expect(opRW); string(p.data) != "early" {
		t.Errorf("bytes after CONNECT: %q", p.data)
	}
	g.send(header{SrcPort: 52, DstPort: hostPort, Op: opRW, BufAlloc: 64 << 10}, []byte("from guest"))
	g.send(header{SrcPort: 52, DstPort: hostPort, Op: opShutdown, Flags: shutdownSend}, nil)
	got, _ := io.ReadAll(r)
	if string(got) != "from guest" {
		t.Errorf("client read %q", got)
	}
}

func TestHybridBadHandshake(t *testing.T) {
	g := newGuest(t)
	_, path := serveHybrid(t, g)
	for _, hello := range []string{"HELLO 52\n", "CONNECT x\n", "CONNECT 99999999999\n"} {
		c, _ := net.Dial("unix", path)
		c.Write([]byte(hello))
		line, _ := bufio.NewReader(c).ReadString('\n')
		if !strings.HasPrefix(line, "ERR ") {
			t.Errorf("%q: reply %q", hello, line)
		}
		c.Close()
	}
}

func TestHybridForwardsGuestConnections(t *testing.T) {
	g := newGuest(t)
	_, path := serveHybrid(t, g)
	c := forwarded(t, g, path, 700)
	g.send(header{SrcPort: 9, DstPort: 700, Op: opRW, BufAlloc: 64 << 10}, []byte("ping"))
	buf := make([]byte, 4)
	io.ReadFull(c, buf)
	if string(buf) != "ping" {
		t.Errorf("forwarded %q", buf)
	}
	// No socket for this port: refused.
	g.connect(701, 9)
	g.expect(opRst)
}

// TestHybridCloseEndsEveryConnection: Close ends the connections it joined
// (both ways) and waits for their goroutines, so none outlives it.
func TestHybridCloseEndsEveryConnection(t *testing.T) {
	g := newGuest(t)
	h, path := serveHybrid(t, g)
	_, r, _ := hybridConnect(t, g, path, 52, "") // a client joined to guest port 52
	fc := forwarded(t, g, path, 700)             // a guest connection forwarded to a host socket

	done := make(chan error, 1)
	go func() { done <- h.Close() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return with two joined connections")
	}
	for name, conn := range map[string]io.Reader{"client": r, "forwarded": fc} {
		if n, err := io.Copy(io.Discard, conn); err != nil {
			t.Errorf("%s connection after Close: %d bytes, %v; want EOF", name, n, err)
		}
	}
}

// serveHybrid starts a hybrid socket on the guest's device, closed at the
// test's end (Close may be called again).
func serveHybrid(t *testing.T, g *guest) (*HybridSocket, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "v.sock")
	h, err := g.dev.ServeUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h, path
}

// hybridConnect sends "CONNECT <port>\n" and extra to the socket at path,
// answers the device's request as the guest's port would, and reads the
// OK line. It returns the client, its reader and the host port.
func hybridConnect(t *testing.T, g *guest, path string, port uint32, extra string) (net.Conn, *bufio.Reader, uint32) {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.Write([]byte(fmt.Sprintf("CONNECT %d\n%s", port, extra)))
	req := g.expect(opRequest)
	g.send(header{SrcPort: port, DstPort: req.h.SrcPort, Op: opResponse, BufAlloc: 64 << 10}, nil)
	r := bufio.NewReader(c)
	if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "OK ") {
		t.Fatalf("handshake reply %q, %v", line, err)
	}
	return c, r, req.h.SrcPort
}

// forwarded has the guest connect from port 9 to port, which the socket
// at path forwards to "<path>_<port>", and returns the host's end.
func forwarded(t *testing.T, g *guest, path string, port uint32) net.Conn {
	t.Helper()
	ul, err := net.Listen("unix", fmt.Sprintf("%s_%d", path, port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ul.Close() })
	g.connect(port, 9)
	g.expect(opResponse)
	c, err := ul.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// DialHybrid is the handshake's client: what the guest sends right after
// the OK line reaches the caller, and a refusal is an error.
func TestDialHybrid(t *testing.T) {
	g := newGuest(t)
	_, path := serveHybrid(t, g)
	type result struct {
		c   net.Conn
		err error
	}
	done := make(chan result, 1)
	go func() {
		c, err := DialHybrid(context.Background(), path, 52)
		done <- result{c, err}
	}()
	req := g.expect(opRequest)
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opResponse, BufAlloc: 64 << 10}, nil)
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opRW, BufAlloc: 64 << 10}, []byte("hello"))
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opShutdown, Flags: shutdownSend}, nil)
	r := <-done
	if r.err != nil {
		t.Fatalf("DialHybrid(%s, 52) = %v", path, r.err)
	}
	defer r.c.Close()
	if got, err := io.ReadAll(r.c); string(got) != "hello" {
		t.Errorf("read after DialHybrid = %q, %v; want %q", got, err, "hello")
	}

	// Nobody listens on the guest's port 53: the device is refused.
	go func() {
		_, err := DialHybrid(context.Background(), path, 53)
		done <- result{nil, err}
	}()
	req = g.expect(opRequest)
	g.send(header{SrcPort: 53, DstPort: req.h.SrcPort, Op: opRst}, nil)
	if r := <-done; r.err == nil {
		t.Error("DialHybrid to a refused port succeeded")
	}
}

// TestHybridActivity: clients are counted while connected, and the time of
// the last one to come or go is kept; guest connections forwarded out are
// not clients.
func TestHybridActivity(t *testing.T) {
	g := newGuest(t)
	h, path := serveHybrid(t, g)
	if n, last := h.Activity(); n != 0 || !last.IsZero() {
		t.Fatalf("Activity() before any client = %d, %v; want 0, zero time", n, last)
	}
	forwarded(t, g, path, 700)
	if n, _ := h.Activity(); n != 0 {
		t.Errorf("Activity() with a forwarded guest connection = %d clients, want 0", n)
	}
	before := time.Now()
	c, _, hostPort := hybridConnect(t, g, path, 52, "")
	if n, last := h.Activity(); n != 1 || last.Before(before) {
		t.Errorf("Activity() with a client = %d, %v; want 1, after %v", n, last, before)
	}
	c.Close()
	g.send(header{SrcPort: 52, DstPort: hostPort, Op: opRst}, nil)
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, last := h.Activity()
		if n == 0 && !last.Before(before) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Activity() after the client left = %d, %v; want 0", n, last)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
