package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// openHandle reaches a detached sandbox by name for command cmd, or says
// why not on stderr.
func openHandle(ctx context.Context, cmd, name string, stderr io.Writer) (*supervisor.Handle, bool) {
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmd, err)
		return nil, false
	}
	h, err := m.Open(ctx, name)
	if err != nil {
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmd, err)
		return nil, false
	}
	return h, true
}

// runTop lists the processes a detached sandbox's agent started (exec'd
// and the main process), running and recently exited.
func runTop(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("top", "[flags] NAME", stdout)
	format := fs.String("format", "table", "table or json")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "capsa top: want one NAME")
		return 2
	}
	if *format != "table" && *format != "json" {
		fmt.Fprintf(stderr, "capsa top: --format %q: want table or json\n", *format)
		return 2
	}
	h, ok := openHandle(ctx, "top", fs.Arg(0), stderr)
	if !ok {
		return 1
	}
	procs, err := h.Processes(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "capsa top: %v\n", err)
		return 1
	}
	if *format == "json" {
		writeJSON(stdout, procs)
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tPID\tSTATE\tSTARTED\tCOMMAND")
	for _, p := range procs {
		state := processState(p.Exit)
		if p.TTY {
			state += ", tty"
		}
		started := time.Since(time.Unix(0, p.StartedNs)).Round(time.Second).String() + " ago"
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\n", p.ID, p.PID, state, started, strings.Join(p.Argv, " "))
	}
	tw.Flush()
	return 0
}

// processState is how capsa top and capsa snapshot diff show a process:
// running, or exited with its code.
func processState(exit *agent.ExitStatus) string {
	if exit == nil {
		return "running"
	}
	return "exited (" + strconv.Itoa(exit.Code) + ")"
}

// runAttach follows a process of a detached sandbox by its ID (from
// capsa top): its recent output, then the rest, and its exit code.
func runAttach(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("attach", "[flags] NAME ID", stdout)
	interactive := fs.BoolP("interactive", "i", false, "pass standard input to the process")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 2 {
		fmt.Fprintln(stderr, "capsa attach: want NAME ID")
		return 2
	}
	id, err := strconv.Atoi(fs.Arg(1))
	if err != nil || id <= 0 {
		fmt.Fprintf(stderr, "capsa attach: ID %q: want a process ID from capsa top\n", fs.Arg(1))
		return 2
	}
	h, ok := openHandle(ctx, "attach", fs.Arg(0), stderr)
	if !ok {
		return 125
	}
	o := agent.AttachOptions{Stdout: stdout, Stderr: stderr}
	if *interactive {
		o.Stdin = os.Stdin
	}
	p, err := h.Attach(ctx, id, o)
	if err != nil {
		fmt.Fprintf(stderr, "capsa attach: %v\n", err)
		return 125
	}
	es, err := p.Wait()
	if err != nil {
		fmt.Fprintf(stderr, "capsa attach: %v\n", err)
		return 125
	}
	return es.Code
}
