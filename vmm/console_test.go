package vmm

import (
	"bytes"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestConsoleWatch(t *testing.T) {
	for _, tc := range []struct {
		name   string
		chunks []string
		panic  string
	}{
		{"quiet boot", []string{"hello\n", "world\n"}, ""},
		{"panic split across writes", []string{"[    1.2] Kernel pa", "nic - not syncing: Attempted to kill init! exitcode=0x00000300\r\n", "more\n"},
			"Attempted to kill init! exitcode=0x00000300"},
		{"first panic wins", []string{"Kernel panic - not syncing: one\nKernel panic - not syncing: two\n"}, "one"},
		{"unterminated", []string{"Kernel panic - not syncing: VFS: Unable to mount root fs"}, "VFS: Unable to mount root fs"},
		{"banner in a long line is still seen", []string{string(bytes.Repeat([]byte("x"), 100)) + "Kernel panic - not syncing: late\n"}, "late"},
	} {
		var out bytes.Buffer
		c := &consoleWatch{out: &out}
		var all string
		for _, ch := range tc.chunks {
			c.Write([]byte(ch))
			all += ch
		}
		got, ok := c.Panic()
		if got != tc.panic || ok != (tc.panic != "") {
			t.Errorf("%s: Panic() = %q, %v; want %q", tc.name, got, ok, tc.panic)
		}
		if out.String() != all {
			t.Errorf("%s: output not passed through", tc.name)
		}
	}
}

// blockingWriter blocks every Write until release is closed.
type blockingWriter struct {
	release chan struct{}
	mu      sync.Mutex
	b       bytes.Buffer
}

func (w *blockingWriter) Write(p []byte) (int, error) {
	<-w.release
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// TestConsoleNeverBlocksTheGuest: a console writer that does not return
// must not hold up the vCPU that writes the serial port, and what piles up
// meanwhile is bounded; once the writer moves, everything kept comes out,
// with a note of what was dropped.
func TestConsoleNeverBlocksTheGuest(t *testing.T) {
	w := &blockingWriter{release: make(chan struct{})}
	c := &consoleWatch{out: w}
	c.start()
	done := make(chan struct{})
	go func() {
		defer close(done)
		chunk := bytes.Repeat([]byte("x"), 4096)
		for range 2 * consolePendingCap / len(chunk) {
			c.Write(chunk)
		}
		c.Write([]byte("\nlast line\n"))
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Write blocked behind a stuck console writer")
	}
	c.mu.Lock()
	pending := len(c.pending)
	c.mu.Unlock()
	if pending > consolePendingCap {
		t.Errorf("%d bytes pending, more than the cap %d", pending, consolePendingCap)
	}
	start := time.Now()
	c.flush(200 * time.Millisecond)
	if time.Since(start) > 5*time.Second {
		t.Error("flush did not honour its timeout")
	}
	close(w.release)
	<-c.done
	w.mu.Lock()
	out := w.b.String()
	w.mu.Unlock()
	if !strings.Contains(out, "bytes of console output dropped") {
		t.Errorf("no note of the dropped output in %d bytes", len(out))
	}
	if !strings.Contains(c.Tail(), "last line") {
		t.Errorf("Tail() = ...%q, want the last line", tail(c.Tail(), 40))
	}
}

func tail(s string, n int) string { return s[max(0, len(s)-n):] }
