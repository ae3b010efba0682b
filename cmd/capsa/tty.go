package main

import (
	"errors"
	"os"
	"os/signal"
	"syscall"

	"github.com/capsa-sandbox/capsa/agent"
	"golang.org/x/term"
)

// defaultWindow is a -t process's terminal size when capsa's standard
// input is not a terminal.
var defaultWindow = agent.WindowSize{Rows: 24, Cols: 80}

// terminal is the host side of a -t process: capsa's own terminal, raw
// while the process runs (so ^C and every other key reach the guest's
// terminal, which acts on them) and restored on every way out.
type terminal struct {
	fd    int
	state *term.State // nil: not a terminal, or not raw
	winch chan os.Signal
}

// openTerminal prepares a -t process: the size of capsa's terminal on
// stdin (or defaultWindow when stdin is not one and there is no input to
// pass). -i -t needs a terminal.
func openTerminal(stdin *os.File, interactive bool) (*terminal, agent.WindowSize, error) {
	t := &terminal{fd: int(stdin.Fd())}
	if !term.IsTerminal(t.fd) {
		if interactive {
			return nil, agent.WindowSize{}, errors.New("-i -t: standard input is not a terminal (drop -t to pipe input)")
		}
		t.fd = -1
		return t, defaultWindow, nil
	}
	cols, rows, err := term.GetSize(t.fd)
	if err != nil || rows <= 0 || cols <= 0 {
		return t, defaultWindow, nil
	}
	return t, agent.WindowSize{Rows: uint16(min(rows, 0xffff)), Cols: uint16(min(cols, 0xffff))}, nil
}

// raw puts the terminal in raw mode and passes its size changes to resize
// until restore.
func (t *terminal) raw(resize func(agent.WindowSize) error) error {
	if t.fd < 0 {
		return nil
	}
	st, err := term.MakeRaw(t.fd)
	if err != nil {
		return err
	}
	t.state = st
	t.winch = make(chan os.Signal, 1)
	signal.Notify(t.winch, syscall.SIGWINCH)
	go func(ch chan os.Signal) {
		for range ch {
			if cols, rows, err := term.GetSize(t.fd); err == nil && rows > 0 && cols > 0 {
				resize(agent.WindowSize{Rows: uint16(min(rows, 0xffff)), Cols: uint16(min(cols, 0xffff))})
			}
		}
	}(t.winch)
	return nil
}

// restore gives the terminal back as it was. It may be called more than
// once.
func (t *terminal) restore() {
	if t.winch != nil {
		signal.Stop(t.winch)
		close(t.winch)
		t.winch = nil
	}
	if t.state != nil {
		term.Restore(t.fd, t.state)
		t.state = nil
	}
}

// termName is the terminal type a -t process gets: capsa's own.
func termName() string {
	if t := os.Getenv("TERM"); t != "" && t != "dumb" {
		return t
	}
	return "xterm"
}
