package vsock

import (
	"bufio"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestHybridConnect(t *testing.T) {
	g := newGuest(t)
	path := filepath.Join(t.TempDir(), "v.sock")
	h, err := g.dev.ServeUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("CONNECT 52\nearly"))
	req := g.expect(opRequest)
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opResponse, BufAlloc: 64 << 10}, nil)
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "OK ") {
		t.Fatalf("handshake reply %q, %v", line, err)
	}
	if p := g.expect(opRW); string(p.data) != "early" {
		t.Errorf("bytes after CONNECT: %q", p.data)
	}
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opRW, BufAlloc: 64 << 10}, []byte("from guest"))
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opShutdown, Flags: shutdownSend}, nil)
	got, _ := io.ReadAll(r)
	if string(got) != "from guest" {
		t.Errorf("client read %q", got)
	}
}

func TestHybridBadHandshake(t *testing.T) {
	g := newGuest(t)
	path := filepath.Join(t.TempDir(), "v.sock")
	h, _ := g.dev.ServeUnix(path)
	defer h.Close()
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
	path := filepath.Join(t.TempDir(), "v.sock")
	h, _ := g.dev.ServeUnix(path)
	defer h.Close()
	ul, err := net.Listen("unix", path+"_700")
	if err != nil {
		t.Fatal(err)
	}
	defer ul.Close()
	g.connect(700, 9)
	g.expect(opResponse)
	c, err := ul.Accept()
	if err != nil {
		t.Fatal(err)
	}
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
	path := filepath.Join(t.TempDir(), "v.sock")
	h, err := g.dev.ServeUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	// A client joined to guest port 52.
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("CONNECT 52\n"))
	req := g.expect(opRequest)
	g.send(header{SrcPort: 52, DstPort: req.h.SrcPort, Op: opResponse, BufAlloc: 64 << 10}, nil)
	r := bufio.NewReader(c)
	if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "OK ") {
		t.Fatalf("handshake reply %q, %v", line, err)
	}
	// A guest connection forwarded to a host socket.
	ul, err := net.Listen("unix", path+"_700")
	if err != nil {
		t.Fatal(err)
	}
	defer ul.Close()
	g.connect(700, 9)
	g.expect(opResponse)
	fc, err := ul.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer fc.Close()

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
