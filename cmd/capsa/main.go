// Command capsa runs microVMs on KVM.
//
//	capsa run [flags] -- CMD  run CMD in a sandbox, stream its output, exit with its code
//	capsa run -d [--name N] -- CMD  the same, detached: the sandbox outlives the command
//	capsa exec|cp|ps|logs|stop|kill|rm|inspect|stats|top|attach  manage detached sandboxes by name
//	capsa vm [flags]        boot a kernel (the built-in one by default) and show its console
//	capsa version           print the version
//
// Every command takes --help.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/capsa-sandbox/capsa/shim"
)

// version is set at link time by the Makefile.
var version = "dev"

// startTime is the VMM's start, from which the boot time is measured.
var startTime = time.Now()

type command struct {
	name, summary string
	run           func(ctx context.Context, args []string, stdout, stderr io.Writer) int
	hidden        bool // not listed: started by capsa itself
}

func commands() []command {
	return []command{
		{"run", "run a command in a sandbox and exit with its exit code (-d: detached, by name)", runRun, false},
		{"create", "record a detached sandbox with run's flags, to start later", runCreate, false},
		{"start", "start sandboxes made by create", runStart, false},
		{"exec", "run a command in a detached sandbox (-it: on a terminal)", runExec, false},
		{"top", "list the processes started in a detached sandbox, running and exited", runTop, false},
		{"attach", "follow a process of a detached sandbox by its ID (from top)", runAttach, false},
		{"cp", "copy files and directories into and out of a detached sandbox", runCp, false},
		{"ps", "list detached sandboxes", runPs, false},
		{"logs", "print a detached sandbox's output", runLogs, false},
		{"pause", "pause detached sandboxes: no vCPU runs, the guest's clocks stand still", runPause, false},
		{"resume", "resume paused sandboxes (and set their clocks); restore suspended ones", runResume, false},
		{"suspend", "suspend detached sandboxes to disk: their VMs end and hold no memory until resumed", runSuspend, false},
		{"snapshot", "snapshot detached sandboxes, restore, list and remove snapshots", runSnapshot, false},
		{"fork", "make running copies of a detached sandbox", runFork, false},
		{"stop", "stop detached sandboxes (SIGTERM, then SIGKILL)", runStop, false},
		{"kill", "kill detached sandboxes' main processes and stop them", runKill, false},
		{"rm", "remove ended detached sandboxes", runRm, false},
		{"inspect", "describe detached sandboxes (JSON)", runInspect, false},
		{"update", "change detached sandboxes' I/O limits and network policy, running or not", runUpdate, false},
		{"stats", "show detached sandboxes' CPU, memory, network and disk use", runStats, false},
		{"metrics", "serve detached sandboxes' use as Prometheus metrics", runMetrics, false},
		{"mcp", "serve sandboxes to LLM agents as MCP tools (stdio, or HTTP on loopback)", runMCP, false},
		{"serve", "serve E2B's API, so E2B's SDKs drive capsa sandboxes; serve key: its API keys", runServe, false},
		{"template", "the templates capsa serve makes sandboxes from (pre-booted: restored, not booted)", runTemplate, false},
		{"kv", "the key-value store sandboxes share: get, set, cas, rm, ls, watch", runKV, false},
		{"mailbox", "the mailbox sandboxes share: publish, read, subscribe", runMailbox, false},
		{"supervise", "", runSupervise, true},
		{"vm", "boot a kernel in a raw microVM and show its console", runVM, false},
		{"image", "pull, import, list, inspect and remove OCI images", runImage, false},
		{"volume", "named volumes that sandboxes share, with a size quota: create, ls, inspect, rm", runVolume, false},
		{"version", "print capsa's version", runVersion, false},
	}
}

func main() {
	if filepath.Base(os.Args[0]) == shim.BinaryName {
		// containerd runs capsa under the shim's name (make install's link).
		shim.Main()
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := dispatch(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func usage(w io.Writer) {
	fmt.Fprintf(w, "capsa runs commands in hardware-isolated microVMs on KVM.\n\nusage: capsa COMMAND [flags]\n\ncommands:\n")
	for _, c := range commands() {
		if !c.hidden {
			fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
		}
	}
	fmt.Fprintf(w, "\nRun `capsa COMMAND --help` for a command's flags.\n")
}

func dispatch(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "-h", "--help", "help":
		usage(stdout)
		return 0
	case "--version":
		return runVersion(ctx, nil, stdout, stderr)
	}
	for _, c := range commands() {
		if c.name == args[0] {
			return c.run(ctx, args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "capsa: unknown command %q (run `capsa --help` for the list)\n", args[0])
	return 2
}

// newFlags returns a flag set whose errors and help go to stderr/stdout in
// one consistent form.
func newFlags(name, synopsis string, stdout io.Writer) *pflag.FlagSet {
	fs := pflag.NewFlagSet("capsa "+name, pflag.ContinueOnError)
	fs.SortFlags = false
	fs.SetOutput(io.Discard)
	fs.Usage = func() {
		fmt.Fprintf(stdout, "usage: capsa %s %s\n\nflags:\n%s", name, synopsis, fs.FlagUsages())
	}
	return fs
}

// writeJSON prints v as indented JSON, as the --format json of every
// command does.
func writeJSON(w io.Writer, v any) {
	e := json.NewEncoder(w)
	e.SetIndent("", "  ")
	e.Encode(v)
}

// parseFlags parses args; it returns -1 to go on, else the exit code.
func parseFlags(fs *pflag.FlagSet, args []string, stderr io.Writer) int {
	err := fs.Parse(args)
	switch {
	case err == nil:
		return -1
	case errors.Is(err, pflag.ErrHelp):
		return 0 // pflag has printed the usage
	default:
		fmt.Fprintf(stderr, "%s: %v (see `%s --help`)\n", fs.Name(), err, fs.Name())
		return 2
	}
}

func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("version", "", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	fmt.Fprintf(stdout, "capsa %s\n", version)
	return 0
}
