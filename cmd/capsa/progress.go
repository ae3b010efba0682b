package main

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/term"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// isTerminal says whether w is a terminal (a file that is one).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// progressFlag adds --progress to fs: how long work (a snapshot, a fork)
// shows how far it has come.
func progressFlag(fs *pflag.FlagSet) *string {
	return fs.String("progress", "auto", "how to show progress on standard error: auto (a line redrawn in place on a terminal, nothing otherwise), plain (a line per step, and every 2 s of a long one) or none")
}

// plainEvery is how often plain progress repeats a step that goes on.
const plainEvery = 2 * time.Second

// progressShower shows the progress of what (a command's name) on w as
// mode says; done ends its line. An unknown mode is an error naming it.
type progressShower struct {
	w     io.Writer
	what  string
	live  bool          // redraw one line in place (a terminal)
	every time.Duration // plain: how often a step that goes on is shown again
	drawn bool          // a line is drawn and not ended
	step  string
	shown time.Time
}

func newProgress(mode string, w io.Writer, what string) (*progressShower, error) {
	p := &progressShower{w: w, what: what, every: plainEvery}
	switch mode {
	case "none":
		return nil, nil
	case "plain":
	case "auto":
		if !isTerminal(w) {
			return nil, nil
		}
		p.live = true
	default:
		return nil, fmt.Errorf("--progress %q: want auto, plain or none", mode)
	}
	return p, nil
}

// report is the function to give the manager (nil for none).
func (p *progressShower) report() func(sandbox.Progress) {
	if p == nil {
		return nil
	}
	return p.show
}

func (p *progressShower) show(sp sandbox.Progress) {
	line := "capsa " + p.what + ": " + sp.String()
	if p.live {
		// \x1b[K clears what a longer line left.
		fmt.Fprintf(p.w, "\r%s\x1b[K", line)
		p.drawn = true
		return
	}
	if sp.Step == p.step && time.Since(p.shown) < p.every && (sp.Total == 0 || sp.Done != sp.Total) {
		return
	}
	p.step, p.shown = sp.Step, time.Now()
	fmt.Fprintln(p.w, line)
}

// done ends a line drawn in place, before anything else is written.
func (p *progressShower) done() {
	if p != nil && p.drawn {
		fmt.Fprint(p.w, "\r\x1b[K")
		p.drawn = false
	}
}
