package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"text/tabwriter"
	"time"

	"github.com/capsa-sandbox/capsa/e2b"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// runTemplate is `capsa template create|ls|rm`: the templates `capsa
// serve` makes sandboxes from (package e2b).
func runTemplate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	usage := "capsa template create NAME --image REF [--cpus N] [--memory SIZE] [-e K=V]... [--start-cmd CMD] [--ready-cmd CMD] [--preboot] | ls | rm NAME..."
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: "+usage)
		return 2
	}
	m, err := supervisor.OpenManager("")
	if err != nil {
		fmt.Fprintf(stderr, "capsa template: %v\n", err)
		return 1
	}
	ts, err := e2b.OpenTemplates(m.Dir())
	if err != nil {
		fmt.Fprintf(stderr, "capsa template: %v\n", err)
		return 1
	}
	switch args[0] {
	case "create":
		return templateCreate(ctx, m, ts, args[1:], stdout, stderr)
	case "ls":
		if len(args) != 1 {
			fmt.Fprintln(stderr, "capsa template ls: takes no arguments")
			return 2
		}
		list, err := ts.List()
		if err != nil {
			fmt.Fprintf(stderr, "capsa template ls: %v\n", err)
			return 1
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tIMAGE\tPREBOOTED\tSTART\tCREATED")
		for _, t := range list {
			pre := "no"
			if t.Snapshot != "" {
				pre = t.Snapshot
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", t.Name, t.Image, pre, t.StartCmd, t.Created.Format(time.RFC3339))
		}
		tw.Flush()
		return 0
	case "rm":
		if len(args) < 2 {
			fmt.Fprintln(stderr, "usage: capsa template rm NAME...")
			return 2
		}
		code := 0
		for _, name := range args[1:] {
			if err := ts.Remove(m, name); err != nil {
				fmt.Fprintf(stderr, "capsa template rm: %v\n", err)
				code = 1
			}
		}
		return code
	}
	fmt.Fprintf(stderr, "capsa template: unknown subcommand %q (usage: %s)\n", args[0], usage)
	return 2
}

func templateCreate(ctx context.Context, m *supervisor.Manager, ts *e2b.Templates, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("template create", "NAME --image REF [flags]", stdout)
	image := fs.String("image", "", "the OCI image the template's sandboxes run (required)")
	cpus := fs.Int("cpus", 0, "vCPUs (default 1)")
	memory := fs.String("memory", "", "guest memory (e.g. 512M, 2G; default 512M)")
	env := fs.StringArrayP("env", "e", nil, "an environment entry KEY=VALUE for every process (repeatable)")
	start := fs.String("start-cmd", "", "a command run in the background once the sandbox boots (as the user commands run as)")
	ready := fs.String("ready-cmd", "", "with --preboot: pre-booting waits until this command exits 0")
	preboot := fs.Bool("preboot", false, "boot the template now, run its start command, wait for --ready-cmd, and snapshot it: every create restores that instead of booting")
	readyTimeout := fs.Duration("ready-timeout", 5*time.Minute, "how long --preboot waits for --ready-cmd")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "capsa template create: want one NAME (see --help)")
		return 2
	}
	t := e2b.Template{Name: fs.Arg(0), Image: *image, CPUs: *cpus, Env: *env, StartCmd: *start, ReadyCmd: *ready, Created: time.Now().UTC().Truncate(time.Second)}
	if *memory != "" {
		n, err := parseSize(*memory)
		if err != nil {
			fmt.Fprintf(stderr, "capsa template create: --memory: %v\n", err)
			return 2
		}
		t.MemoryMiB = int(n >> 20)
	}
	if *ready != "" && !*preboot {
		fmt.Fprintln(stderr, "capsa template create: --ready-cmd is for --preboot")
		return 2
	}
	if *readyTimeout <= 0 {
		fmt.Fprintln(stderr, "capsa template create: --ready-timeout: want a positive duration")
		return 2
	}
	if err := t.Check(); err != nil {
		fmt.Fprintf(stderr, "capsa template create: %v\n", err)
		return 2
	}
	if _, ok := ts.Get(t.Name); ok {
		fmt.Fprintf(stderr, "capsa template create: a template named %s exists (capsa template rm %s first)\n", t.Name, t.Name)
		return 1
	}
	if *preboot {
		log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
		if os.Getenv("CAPSA_DEBUG") == "" {
			log = slog.New(slog.DiscardHandler)
		}
		if err := e2b.Preboot(ctx, m, &t, *readyTimeout, log); err != nil {
			fmt.Fprintf(stderr, "capsa template create: %v\n", err)
			return 1
		}
	}
	if err := ts.Add(t); err != nil {
		if t.Snapshot != "" {
			m.RemoveSnapshot(t.Snapshot)
		}
		fmt.Fprintf(stderr, "capsa template create: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, t.Name)
	return 0
}
