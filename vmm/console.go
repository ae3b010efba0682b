package vmm

import (
	"bytes"
	"fmt"
	"io"
	"sync"
	"time"
)

// panicBanner starts the line Linux prints when it panics. It is logged at
// KERN_EMERG, so it reaches the console even with `quiet`.
var panicBanner = []byte("Kernel panic - not syncing: ")

// consoleWatch passes the guest's console output through, keeps its last
// few KiB for diagnostics, and remembers the first kernel panic message it
// sees, so that the reset which follows a panic (panic=-1) is reported as a
// panic, with its reason, and not as a reboot. Only the guest's own exit
// status depends on it.
//
// The output itself is written by a goroutine of its own (start, flush):
// the serial port calls Write on a vCPU thread, in the middle of the
// guest's OUT instruction, and a slow or stuck writer (a pipe nobody
// reads) must not freeze that vCPU while the guest holds its console
// lock. Bytes the writer has not taken yet are bounded; past the bound
// they are dropped and counted, so a chatty guest cannot grow the host.
type consoleWatch struct {
	out   io.Writer
	first func() // called at the first byte (the boot timeline), if set

	mu      sync.Mutex
	line    []byte // the current line, capped
	panic   string
	tail    []byte // the last consoleTailCap bytes
	pending []byte // not yet written to out
	dropped int    // bytes dropped since the last write
	closing bool
	wake    chan struct{}
	done    chan struct{}
}

const (
	consoleLineCap    = 512
	consoleTailCap    = 4096
	consolePendingCap = 1 << 20
)

// start runs the writer goroutine; without it, Write writes through.
func (c *consoleWatch) start() {
	if c.out == nil {
		return
	}
	c.wake, c.done = make(chan struct{}, 1), make(chan struct{})
	go func() {
		defer close(c.done)
		var buf []byte
		for {
			c.mu.Lock()
			buf, c.pending = c.pending, buf[:0]
			dropped, closing := c.dropped, c.closing
			c.dropped = 0
			c.mu.Unlock()
			if len(buf) > 0 {
				c.out.Write(buf) // a failing console must not stop the guest
			}
			if dropped > 0 {
				fmt.Fprintf(c.out, "\n[capsa: %d bytes of console output dropped: the console writer fell behind]\n", dropped)
			}
			if len(buf) == 0 && dropped == 0 {
				if closing {
					return
				}
				<-c.wake
			}
		}
	}()
}

// flush waits until the writer has written everything, at most timeout,
// and ends it.
func (c *consoleWatch) flush(timeout time.Duration) {
	if c.done == nil {
		return
	}
	c.mu.Lock()
	c.closing = true
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-c.done:
	case <-t.C:
	}
}

func (c *consoleWatch) Write(p []byte) (int, error) {
	c.mu.Lock()
	if c.first != nil && len(p) > 0 {
		c.first()
		c.first = nil
	}
	// Trimmed only at twice the cap: the serial port writes a byte at a time.
	c.tail = append(c.tail, p...)
	if len(c.tail) > 2*consoleTailCap {
		c.tail = append(c.tail[:0], c.tail[len(c.tail)-consoleTailCap:]...)
	}
	for _, b := range p {
		if b == '\n' {
			c.endLine()
			continue
		}
		if len(c.line) < consoleLineCap {
			c.line = append(c.line, b)
		}
	}
	if c.wake == nil {
		c.mu.Unlock()
		if c.out != nil {
			c.out.Write(p)
		}
		return len(p), nil
	}
	if room := consolePendingCap - len(c.pending); len(p) > room {
		c.dropped += len(p) - room
		p = p[:room]
	}
	c.pending = append(c.pending, p...)
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (c *consoleWatch) endLine() {
	if c.panic == "" {
		if i := bytes.Index(c.line, panicBanner); i >= 0 {
			c.panic = string(bytes.TrimRight(c.line[i+len(panicBanner):], "\r"))
			if c.panic == "" {
				c.panic = "(no message)"
			}
		}
	}
	c.line = c.line[:0]
}

// Panic returns the guest's panic message, if it printed one.
func (c *consoleWatch) Panic() (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.endLine() // an unterminated last line counts too
	return c.panic, c.panic != ""
}

// Tail returns the last few KiB the guest wrote to its console.
func (c *consoleWatch) Tail() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return string(c.tail[max(0, len(c.tail)-consoleTailCap):])
}
