package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestProgressModes: plain progress is a line per step begun, the end of
// a counted step, and nothing between (within its interval, 2 s); auto writes nothing
// where standard error is not a terminal; none is nothing; an unknown
// mode is refused, named.
func TestProgressModes(t *testing.T) {
	var b bytes.Buffer
	p, err := newProgress("plain", &b, "fork")
	if err != nil || p == nil || p.every != plainEvery {
		t.Fatalf("newProgress(plain) = %+v, %v", p, err)
	}
	p.every = time.Hour // however slow this machine is between the events
	report := p.report()
	report(sandbox.Progress{Step: sandbox.StepCopyRunning, Total: 64 << 20, Bytes: true})
	for i := int64(1); i <= 8; i++ {
		report(sandbox.Progress{Step: sandbox.StepCopyRunning, Done: i << 23, Total: 64 << 20, Bytes: true})
	}
	report(sandbox.Progress{Step: sandbox.StepStartCopies, Total: 2})
	report(sandbox.Progress{Step: sandbox.StepStartCopies, Done: 1, Total: 2})
	report(sandbox.Progress{Step: sandbox.StepStartCopies, Done: 2, Total: 2})
	p.done()
	want := "capsa fork: copying memory while it runs: 0.0 of 64.0 MiB\n" +
		"capsa fork: copying memory while it runs: 64.0 of 64.0 MiB\n" +
		"capsa fork: starting copies: 0 of 2\n" +
		"capsa fork: starting copies: 2 of 2\n"
	if b.String() != want {
		t.Errorf("plain progress:\n%s\nwant:\n%s", b.String(), want)
	}
	for _, mode := range []string{"auto", "none"} {
		b.Reset()
		p, err := newProgress(mode, &b, "fork")
		if err != nil {
			t.Fatalf("newProgress(%s) = %v", mode, err)
		}
		if r := p.report(); r != nil {
			r(sandbox.Progress{Step: sandbox.StepMemory})
		}
		p.done()
		if b.Len() != 0 {
			t.Errorf("%s progress to a buffer wrote %q; want nothing", mode, b.String())
		}
	}
	if _, err := newProgress("fancy", &b, "fork"); err == nil || !strings.Contains(err.Error(), `"fancy"`) {
		t.Errorf("newProgress(fancy) = %v; want it refused, named", err)
	}
}

// TestProgressLive: on a terminal each event redraws one line, which done
// clears before anything else is written.
func TestProgressLive(t *testing.T) {
	var b bytes.Buffer
	p := &progressShower{w: &b, what: "snapshot create", live: true}
	p.show(sandbox.Progress{Step: sandbox.StepInventory})
	p.show(sandbox.Progress{Step: sandbox.StepMemory, Done: 1 << 20, Total: 4 << 20, Bytes: true})
	p.done()
	want := "\rcapsa snapshot create: listing the guest's files\x1b[K\rcapsa snapshot create: writing memory: 1.0 of 4.0 MiB\x1b[K\r\x1b[K"
	if b.String() != want {
		t.Errorf("live progress = %q; want %q", b.String(), want)
	}
}
