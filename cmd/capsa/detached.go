package main

// Detached sandboxes: `run -d` starts a supervisor process (capsa itself,
// `capsa supervise`, in a session of its own), and the commands here reach
// sandboxes by name through the store and supervisor packages.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/pflag"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// openManager opens the default state directory's sandboxes.
func openManager() (*supervisor.Manager, error) { return supervisor.OpenManager("") }

// startDetached records the sandbox (rec, with w's Spec), starts its
// supervisor and waits until the sandbox runs (or says why it cannot).
// With create (capsa create) it only records it, for capsa start.
func startDetached(ctx context.Context, w *sandbox.Workload, rec *supervisor.Record, create bool, stdout, stderr io.Writer) int {
	cmdName := "run"
	if create {
		cmdName = "create"
	}
	spec, err := w.Spec()
	if err != nil {
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmdName, err)
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmdName, err)
		return 125
	}
	rec.Spec = spec
	if !create {
		name, err := m.Launch(ctx, rec, w.SecretValues())
		return launched(cmdName, name, err, stdout, stderr)
	}
	name, err := m.Create(rec, w.SecretValues())
	return launched(cmdName, name, err, stdout, stderr)
}

// launched ends a command that started (or recorded) the detached
// sandbox name with err: it prints the name, or why it failed; the exit
// code is 2 for a name that is taken, 125 for any other failure.
func launched(cmdName, name string, err error, stdout, stderr io.Writer) int {
	switch {
	case errors.Is(err, supervisor.ErrExists):
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmdName, err)
		return 2
	case err != nil:
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmdName, err)
		return 125
	}
	fmt.Fprintln(stdout, name)
	return 0
}

// runStart starts sandboxes that capsa create recorded.
func runStart(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("start", "NAME...", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() == 0 {
		fmt.Fprintln(stderr, "capsa start: want NAME... (sandboxes made by capsa create)")
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa start: %v\n", err)
		return 125
	}
	code := 0
	for _, name := range fs.Args() {
		if c := launched("start", name, m.Start(ctx, name), stdout, stderr); c != 0 {
			code = c
		}
	}
	return code
}

// runSupervise is the supervisor process (`run -d` starts it), handed the
// sandbox's lock and the pipe on which it says the sandbox is ready as
// supervisor.LockFD and supervisor.ReadyFD.
func runSupervise(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("supervise", "[flags] NAME (started by `capsa run -d`)", stdout)
	stateDir := fs.String("state", "", "the state directory")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 || *stateDir == "" {
		fmt.Fprintln(stderr, "capsa supervise: want --state DIR NAME")
		return 2
	}
	lock := os.NewFile(supervisor.LockFD, "lock")
	ready := os.NewFile(supervisor.ReadyFD, "ready")
	if lock == nil || ready == nil {
		fmt.Fprintln(stderr, "capsa supervise: is started by `capsa run -d`")
		return 2
	}
	// The terminal that started us may be gone; its hangup is not ours.
	signal.Ignore(syscall.SIGHUP)
	m, err := supervisor.OpenManager(*stateDir)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	level := slog.LevelInfo
	if os.Getenv("CAPSA_DEBUG") != "" {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	if err := m.Supervise(ctx, fs.Arg(0), lock, ready, log); err != nil {
		return 1
	}
	return 0
}

// runExec runs a command in a detached sandbox.
func runExec(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("exec", "[flags] NAME -- CMD [ARGS...]", stdout)
	env := fs.StringArrayP("env", "e", nil, "set K=V in the command's environment (repeatable)")
	dir := fs.StringP("workdir", "w", "", "working directory in the guest")
	userFlag := fs.StringP("user", "u", "", "run as USER, UID, USER:GROUP or UID:GID")
	interactive := fs.BoolP("interactive", "i", false, "pass standard input to the command")
	tty := fs.BoolP("tty", "t", false, "run the command on a terminal (with -i, capsa's terminal becomes it: raw, resized with it, ^C to the command)")
	timeout := fs.Duration("timeout", 0, "kill the command after this long; exit 124")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() < 2 {
		fmt.Fprintln(stderr, "capsa exec: want NAME -- CMD [ARGS...]")
		return 2
	}
	var term *terminal
	var window *agent.WindowSize
	if *tty {
		t, ws, err := openTerminal(os.Stdin, *interactive)
		if err != nil {
			fmt.Fprintf(stderr, "capsa exec: %v\n", err)
			return 2
		}
		term, window = t, &ws
		*env = append([]string{"TERM=" + termName()}, *env...)
	}
	for _, e := range *env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" {
			fmt.Fprintf(stderr, "capsa exec: -e %q: want KEY=VALUE\n", e)
			return 2
		}
	}
	if *timeout < 0 {
		fmt.Fprintf(stderr, "capsa exec: --timeout %v: must not be negative\n", *timeout)
		return 2
	}
	h, ok := openHandle(ctx, "exec", fs.Arg(0), stderr)
	if !ok {
		return 125
	}
	o := sandbox.ExecOptions{Argv: fs.Args()[1:], Env: *env, Dir: *dir, User: *userFlag, Timeout: *timeout,
		Stdout: stdout, Stderr: stderr, TTY: window}
	if *interactive {
		o.Stdin = os.Stdin
	}
	p, err := h.Stream(ctx, o)
	if err != nil {
		fmt.Fprintf(stderr, "capsa exec: %v\n", err)
		return 125
	}
	if term != nil && *interactive {
		if err := term.raw(p.Resize); err != nil {
			p.Signal(ctx, "KILL")
			fmt.Fprintf(stderr, "capsa exec: the terminal: %v\n", err)
			return 125
		}
		defer term.restore()
	}
	es, err := p.Wait()
	if term != nil {
		term.restore() // before any message
	}
	switch {
	case err != nil:
		fmt.Fprintf(stderr, "capsa exec: %v\n", err)
		return 125
	case es.TimedOut:
		fmt.Fprintf(stderr, "capsa exec: the command timed out after %v\n", *timeout)
		return exitTimedOut
	}
	return es.Code
}

// psRow is one sandbox as ps shows it.
type psRow struct {
	Name     string           `json:"name"`
	State    supervisor.State `json:"state"`
	Command  string           `json:"command"`
	Uptime   time.Duration    `json:"uptime_ns,omitempty"`
	CPUs     int              `json:"cpus"`
	Memory   int              `json:"memory_mib"`
	Ports    []string         `json:"ports,omitempty"`
	ExitCode *int             `json:"exit_code,omitempty"`
	Reason   string           `json:"reason,omitempty"`
	// Lifetimes: the sandbox stops TTL after it started, or once nobody
	// has been connected to it for IdleTimeout.
	TTL         time.Duration `json:"ttl_ns,omitempty"`
	IdleTimeout time.Duration `json:"idle_timeout_ns,omitempty"`
}

func runPs(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("ps", "[flags]", stdout)
	all := fs.BoolP("all", "a", false, "show sandboxes that ended too")
	format := fs.String("format", "table", "table or json")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *format != "table" && *format != "json" {
		fmt.Fprintf(stderr, "capsa ps: --format %q: want table or json\n", *format)
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa ps: %v\n", err)
		return 1
	}
	recs, err := m.List()
	if err != nil {
		fmt.Fprintf(stderr, "capsa ps: %v\n", err)
		return 1
	}
	rows := []psRow{}
	for _, r := range recs {
		if !*all && !r.Live() {
			continue
		}
		row := psRow{Name: r.Name, State: r.State, Command: supervisor.CommandLine(r.Spec), CPUs: r.Spec.CPUs,
			Memory: r.Spec.MemoryMiB, Ports: r.Ports, ExitCode: r.ExitCode, Reason: r.Reason,
			TTL: r.TTL, IdleTimeout: r.IdleTimeout}
		if (r.State == supervisor.Running || r.State == supervisor.Paused) && !r.Started.IsZero() {
			row.Uptime = time.Since(r.Started).Round(time.Second)
		}
		rows = append(rows, row)
	}
	if *format == "json" {
		writeJSON(stdout, rows)
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSTATE\tCOMMAND\tUPTIME\tCPUS\tMEMORY\tPORTS\tLIFETIME")
	for _, r := range rows {
		state := string(r.State)
		if r.ExitCode != nil {
			state += fmt.Sprintf(" (%d)", *r.ExitCode)
		}
		up := "-"
		if r.Uptime > 0 {
			up = r.Uptime.String()
		}
		var life []string
		if r.TTL > 0 {
			life = append(life, "ttl "+r.TTL.String())
		}
		if r.IdleTimeout > 0 {
			life = append(life, "idle "+r.IdleTimeout.String())
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%dM\t%s\t%s\n", r.Name, state, r.Command, up, r.CPUs, r.Memory,
			strings.Join(r.Ports, ","), strings.Join(life, ","))
	}
	tw.Flush()
	return 0
}

// eachName runs fn for every NAME argument, reporting failures; the exit
// code is 1 if any failed.
func eachName(ctx context.Context, cmdName string, names []string, stderr io.Writer, fn func(m *supervisor.Manager, name string) error) int {
	if len(names) == 0 {
		fmt.Fprintf(stderr, "capsa %s: want at least one NAME\n", cmdName)
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmdName, err)
		return 1
	}
	code := 0
	for _, n := range names {
		if err := fn(m, n); err != nil {
			fmt.Fprintf(stderr, "capsa %s: %v\n", cmdName, err)
			code = 1
		}
	}
	return code
}

// stopByName stops a running sandbox; one that is not running is fine.
func stopByName(ctx context.Context, m *supervisor.Manager, name string, timeout time.Duration, kill bool) error {
	wctx, cancel := context.WithTimeout(ctx, timeout+30*time.Second)
	defer cancel()
	err := m.Stop(wctx, name, timeout, kill)
	if errors.Is(err, supervisor.ErrNotRunning) {
		return nil
	}
	return err
}

func runPause(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return pauseOrResume(ctx, "pause", (*supervisor.Manager).Pause, args, stdout, stderr)
}

func runSuspend(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return pauseOrResumeOr(ctx, "suspend", "no-memory", "keep an image sandbox's disk alone (synced first), not its memory: faster and smaller; its resume boots it again, its processes started afresh",
		(*supervisor.Manager).Suspend, (*supervisor.Manager).SuspendWithoutMemory, args, stdout, stderr)
}

func runResume(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return pauseOrResumeOr(ctx, "resume", "reboot", "boot an image sandbox again from its disk, not its memory: its files kept, its processes started afresh (suspends one paused in memory first)",
		(*supervisor.Manager).Resume, (*supervisor.Manager).ResumeCold, args, stdout, stderr)
}

// pauseOrResumeOr is pauseOrResume of op, or of alt for the command's
// boolean flag (help says what it does).
func pauseOrResumeOr(ctx context.Context, name, flag, help string, op, alt func(*supervisor.Manager, context.Context, string) error, args []string, stdout, stderr io.Writer) int {
	var set *bool
	either := func(m *supervisor.Manager, ctx context.Context, n string) error {
		if *set {
			return alt(m, ctx, n)
		}
		return op(m, ctx, n)
	}
	return pauseOrResume(ctx, name, either, args, stdout, stderr, func(fs *pflag.FlagSet) { set = fs.Bool(flag, false, help) })
}

// pauseOrResume runs op on each named detached sandbox and prints the
// names it did; flags, when given, adds the command's own flags.
func pauseOrResume(ctx context.Context, name string, op func(*supervisor.Manager, context.Context, string) error, args []string, stdout, stderr io.Writer, flags ...func(*pflag.FlagSet)) int {
	fs := newFlags(name, "[flags] NAME...", stdout)
	for _, f := range flags {
		f(fs)
	}
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	return eachName(ctx, name, fs.Args(), stderr, func(m *supervisor.Manager, n string) error {
		if err := op(m, ctx, n); err != nil {
			return err
		}
		fmt.Fprintln(stdout, n)
		return nil
	})
}

func runStop(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("stop", "[flags] NAME...", stdout)
	timeout := fs.DurationP("time", "t", supervisor.DefaultStopTimeout, "how long the main process has after SIGTERM before SIGKILL")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *timeout < 0 {
		fmt.Fprintf(stderr, "capsa stop: --time %v: must not be negative\n", *timeout)
		return 2
	}
	return eachName(ctx, "stop", fs.Args(), stderr, func(m *supervisor.Manager, name string) error {
		if err := stopByName(ctx, m, name, *timeout, false); err != nil {
			return err
		}
		fmt.Fprintln(stdout, name)
		return nil
	})
}

func runKill(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("kill", "NAME...", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	return eachName(ctx, "kill", fs.Args(), stderr, func(m *supervisor.Manager, name string) error {
		if err := stopByName(ctx, m, name, 0, true); err != nil {
			return err
		}
		fmt.Fprintln(stdout, name)
		return nil
	})
}

func runRm(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("rm", "[flags] NAME...", stdout)
	force := fs.BoolP("force", "f", false, "kill a running sandbox first")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	return eachName(ctx, "rm", fs.Args(), stderr, func(m *supervisor.Manager, name string) error {
		r, err := m.Get(name)
		if err != nil {
			return err
		}
		if r.Alive() && !*force {
			return fmt.Errorf("%s is %s: stop it first, or rm -f", name, r.State)
		}
		if err := m.Remove(ctx, name); err != nil {
			return err
		}
		fmt.Fprintln(stdout, name)
		return nil
	})
}

func runInspect(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("inspect", "NAME...", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	// Each record, and its I/O limits in words ("none" when it has
	// none).
	type inspected struct {
		*supervisor.Record
		Limits string `json:"limits"`
	}
	var recs []inspected
	code := eachName(ctx, "inspect", fs.Args(), stderr, func(m *supervisor.Manager, name string) error {
		r, err := m.Get(name)
		if err == nil {
			recs = append(recs, inspected{r, r.Spec.Limits.String()})
		}
		return err
	})
	if len(recs) > 0 {
		writeJSON(stdout, recs)
	}
	return code
}

// runUpdate changes sandboxes' I/O limits and network policy, as docker
// update does their resources: at once where they run, and in their
// records.
func runUpdate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("update", "[--limit KEY=RATE[,...]] [--net MODE [--allow RULE]... [--deny RULE]...] [--egress-proxy [USER@]HOST:PORT|none] NAME...", stdout)
	limits := fs.StringArray("limit", nil, "I/O limits to set, as capsa run --limit takes them, on top of those the sandbox has (a rate of 0 removes one; repeatable)")
	netMode := fs.String("net", "", "a new network policy, replacing the one it has: public-only, allow-all or deny-all, with --allow and --deny as capsa run takes them (for new connections; those open go on)")
	allow := fs.StringArray("allow", nil, "with --net: a destination the new policy allows (repeatable)")
	deny := fs.StringArray("deny", nil, "with --net: a destination the new policy denies (repeatable)")
	egress := fs.String("egress-proxy", "", "a SOCKS5 proxy for its outbound TCP from now on, as capsa run takes it (the password from $"+egressProxyPasswordEnv+"), replacing the one it has; none: straight out")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if len(*limits) == 0 && *netMode == "" && len(*allow)+len(*deny) == 0 && *egress == "" {
		fmt.Fprintln(stderr, "capsa update: nothing to change: give --limit, --net or --egress-proxy")
		return 2
	}
	var proxy *sandbox.EgressProxy
	if *egress != "" && *egress != "none" {
		var err error
		if proxy, err = parseEgressProxy(*egress); err != nil {
			fmt.Fprintf(stderr, "capsa update: %v\n", err)
			return 2
		}
	}
	var policy *netstack.Policy
	switch {
	case *netMode != "":
		var err error
		if policy, err = netstack.ParsePolicy(*netMode, *allow, *deny); err != nil {
			fmt.Fprintf(stderr, "capsa update: --net: %v\n", err)
			return 2
		}
	case len(*allow) > 0 || len(*deny) > 0:
		fmt.Fprintln(stderr, "capsa update: --allow and --deny need --net MODE: the whole policy is replaced")
		return 2
	}
	return eachName(ctx, "update", fs.Args(), stderr, func(m *supervisor.Manager, name string) error {
		if len(*limits) > 0 {
			now, err := m.UpdateLimits(ctx, name, strings.Join(*limits, ","))
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "%s: %s\n", name, now)
		}
		// Both at once in the order that lets nothing out directly
		// that either setting would tunnel.
		if err := m.UpdateNetwork(ctx, name, supervisor.NetworkUpdate{Policy: policy, SetProxy: *egress != "", Proxy: proxy}); err != nil {
			return err
		}
		if policy != nil {
			fmt.Fprintf(stdout, "%s: network %s\n", name, policy)
		}
		if *egress != "" {
			via := "none"
			if proxy != nil {
				via = proxy.String()
			}
			fmt.Fprintf(stdout, "%s: egress proxy %s\n", name, via)
		}
		return nil
	})
}

func runLogs(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("logs", "[flags] NAME", stdout)
	follow := fs.BoolP("follow", "f", false, "keep printing output as it comes, until the sandbox ends")
	lines := fs.Int("tail", -1, "print only the last N lines first (-1: all that is kept)")
	console := fs.Bool("console", false, "the guest's serial console instead of the main process's output")
	netLog := fs.Bool("net", false, "the network's audit log, a JSON line each: DNS queries, connections and flows opened, refused and closed, intercepted HTTPS requests")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if *console && *netLog {
		fmt.Fprintln(stderr, "capsa logs: --console and --net: choose one")
		return 2
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "capsa logs: want one NAME")
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa logs: %v\n", err)
		return 1
	}
	name := fs.Arg(0)
	file := supervisor.MainLog
	if *console {
		file = supervisor.ConsoleLog
	}
	if *netLog {
		err = m.NetLogs(ctx, name, *lines, *follow, stdout)
	} else {
		err = m.Logs(ctx, name, file, *lines, *follow, stdout)
	}
	if err != nil {
		fmt.Fprintf(stderr, "capsa logs: %v\n", err)
		return 1
	}
	return 0
}

// splitSandboxPath reads NAME:/PATH; ok is false for a host path.
func splitSandboxPath(s string) (name, p string, ok bool) {
	name, p, found := strings.Cut(s, ":")
	if !found || !strings.HasPrefix(p, "/") || supervisor.CheckName(name) != nil {
		return "", "", false
	}
	return name, p, true
}

func runCp(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("cp", "SRC DST (one of them NAME:/PATH in a detached sandbox)", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 2 {
		fmt.Fprintln(stderr, "capsa cp: want SRC DST, one of them NAME:/PATH")
		return 2
	}
	srcName, srcPath, srcIn := splitSandboxPath(fs.Arg(0))
	dstName, dstPath, dstIn := splitSandboxPath(fs.Arg(1))
	if srcIn == dstIn {
		fmt.Fprintln(stderr, "capsa cp: exactly one of SRC and DST must be NAME:/PATH (a path in a detached sandbox)")
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa cp: %v\n", err)
		return 1
	}
	name := srcName
	if dstIn {
		name = dstName
	}
	h, err := m.Open(ctx, name)
	if err != nil {
		fmt.Fprintf(stderr, "capsa cp: %v\n", err)
		return 1
	}
	if srcIn {
		err = h.CopyOut(ctx, srcPath, fs.Arg(1))
	} else {
		err = h.CopyIn(ctx, fs.Arg(0), dstPath)
	}
	if err != nil {
		fmt.Fprintf(stderr, "capsa cp: %v\n", err)
		return 1
	}
	return 0
}
