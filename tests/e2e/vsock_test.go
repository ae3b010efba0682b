package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/virtio/vsock"
	"github.com/capsa-sandbox/capsa/vmm"
)

// syncBuffer is a bytes.Buffer safe for the console writer and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestVsockWithRealGuest boots the real kernel with a virtio-vsock device:
// the guest's kernel driver and a Go program using AF_VSOCK talk to the
// device's host end in both directions, half-closes included.
func TestVsockWithRealGuest(t *testing.T) {
	kernel, err := os.ReadFile(artifact(t, "vmlinux"))
	if err != nil {
		t.Fatal(err)
	}
	initrd, err := os.ReadFile(artifact(t, "testinitrd.cpio"))
	if err != nil {
		t.Fatal(err)
	}
	dev, err := vsock.New(3, nil)
	if err != nil {
		t.Fatal(err)
	}
	l, err := dev.Listen(1024)
	if err != nil {
		t.Fatal(err)
	}
	var console syncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	m, err := vmm.New(ctx, vmm.Config{
		Kernel: kernel, Initrd: initrd, CPUs: 2, MemoryBytes: 256 << 20,
		Cmdline: "console=ttyS0 quiet reboot=k panic=-1 capsa.test=vsock",
		Console: &console, Devices: []vmm.Device{{ID: "vsock", Device: dev}},
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	// A VM that stops early ends the wait for its connections at once.
	exitc := make(chan *vmm.Exit, 1)
	go func() {
		e := m.Run(ctx)
		l.Close()
		exitc <- e
	}()

	// Guest to host.
	c, err := l.Accept()
	if err != nil {
		t.Fatalf("accept: %v (VM exit: %v)\nconsole:\n%s", err, <-exitc, console.String())
	}
	c.SetDeadline(time.Now().Add(2 * time.Minute))
	greeting, err := io.ReadAll(c)
	if err != nil || string(greeting) != "hello from the guest\n" {
		t.Fatalf("guest sent %q, %v", greeting, err)
	}
	c.Write([]byte("hello from the host"))
	c.Close()

	// Host to guest: 4 MiB through the guest's echo, with the guest
	// granting credit as it reads.
	var conn *vsock.Conn
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		if conn, err = dev.Dial(ctx, 1025); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatalf("dial guest: %v\nconsole:\n%s", err, console.String())
	}
	conn.SetDeadline(time.Now().Add(2 * time.Minute))
	data := make([]byte, 4<<20)
	rand.Read(data)
	go func() {
		conn.Write(data)
		conn.CloseWrite()
	}()
	echo, err := io.ReadAll(conn)
	if err != nil {
		t.Fatalf("read echo: %v", err)
	}
	conn.Close()
	if sha256.Sum256(echo) != sha256.Sum256(data) {
		t.Fatalf("echo of %d bytes differs (got %d bytes)", len(data), len(echo))
	}

	exit := <-exitc
	out := console.String()
	t.Logf("console:\n%s", out)
	if exit.Reason != vmm.StopReboot {
		t.Errorf("exit %v", exit)
	}
	for _, want := range []string{`host said "hello from the host"`, "echoed 4194304 bytes", "vsock ok"} {
		if !strings.Contains(out, want) {
			t.Errorf("console lacks %q", want)
		}
	}
}
