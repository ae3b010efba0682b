package vmm

import (
	"bytes"
	"io"
	"sync"
)

// panicBanner starts the line Linux prints when it panics. It is logged at
// KERN_EMERG, so it reaches the console even with `quiet`.
var panicBanner = []byte("Kernel panic - not syncing: ")

// consoleWatch passes the guest's console output through and remembers the
// first kernel panic message it sees, so that the reset which follows a
// panic (panic=-1) is reported as a panic, with its reason, and not as a
// reboot. Only the guest's own exit status depends on it.
type consoleWatch struct {
	out io.Writer

	mu    sync.Mutex
	line  []byte // the current line, capped
	panic string
}

const consoleLineCap = 512

func (c *consoleWatch) Write(p []byte) (int, error) {
	c.mu.Lock()
	for _, b := range p {
		if b == '\n' {
			c.endLine()
			continue
		}
		if len(c.line) < consoleLineCap {
			c.line = append(c.line, b)
		}
	}
	c.mu.Unlock()
	if c.out == nil {
		return len(p), nil
	}
	return c.out.Write(p)
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
