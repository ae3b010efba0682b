package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// exitTimedOut is the exit code when --timeout kills the command, as
// timeout(1) uses.
const exitTimedOut = 124

// defaultWatchdog is generous: a guest only counts as hung when its agent
// is silent and its vCPUs stand still for all of it.
const defaultWatchdog = 5 * time.Minute

func runRun(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runOrCreate(ctx, "run", args, stdout, stderr)
}

// runCreate records a detached sandbox with run's flags without starting
// it: capsa start does.
func runCreate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runOrCreate(ctx, "create", args, stdout, stderr)
}

// runOrCreate is capsa run, or with cmdName "create" capsa create (run -d
// that records the sandbox and stops there).
func runOrCreate(ctx context.Context, cmdName string, args []string, stdout, stderr io.Writer) int {
	fs := newFlags(cmdName, "[flags] -- CMD [ARGS...]", stdout)
	cpus := fs.Int("cpus", 1, "number of vCPUs")
	memory := fs.String("memory", "512M", "guest memory (e.g. 512M, 2G)")
	balloon := fs.Bool("balloon", false, "give the host back the memory the guest frees, about 2 s after (a virtio-balloon with free page reporting)")
	env := fs.StringArrayP("env", "e", nil, "set K=V in the command's environment (repeatable)")
	dir := fs.StringP("workdir", "w", "", "working directory in the guest")
	interactive := fs.BoolP("interactive", "i", false, "pass standard input to the command")
	tty := fs.BoolP("tty", "t", false, "run the command on a terminal (with -i, capsa's terminal becomes it: raw, resized with it, ^C to the command)")
	timeout := fs.Duration("timeout", 0, "kill the command after this long (e.g. 30s); exit 124")
	kernel := fs.String("kernel", "", "use this kernel instead of the built-in one")
	initrd := fs.String("initrd", "", "use this initramfs instead of the built-in one")
	copies := fs.StringArray("copy", nil, "copy a host file or directory into the guest before the command starts: HOST:GUEST (repeatable; in an image, into the sandbox's own layer)")
	imageRef := fs.String("image", "", "run in this OCI image: its root filesystem, ENTRYPOINT, CMD (replaced by ARGS), ENV, WORKDIR and USER")
	pull := fs.String("pull", "missing", "with --image: pull always, missing (when not cached) or never")
	entrypoint := fs.String("entrypoint", "", "with --image: replace the image's ENTRYPOINT (and drop its CMD)")
	rootfsSize := fs.String("rootfs-size", "4G", "with --image: the root filesystem's size (the writable layer's bound)")
	insecure := fs.StringArray("insecure-registry", nil, "with --image: reach this registry (host[:port]) over plain HTTP (repeatable)")
	userFlag := fs.StringP("user", "u", "", "run as USER, UID, USER:GROUP or UID:GID (in an image: resolved in its /etc/passwd)")
	disks := fs.StringArray("disk", nil, "attach a host file as a block device, /dev/vda, /dev/vdb... in order: PATH[:ro] (repeatable)")
	host := addHostFlags(fs)
	noConfine := fs.Bool("no-confine", false, "do not confine the VMM process before its guest runs (seccomp, Landlock, the jail, capabilities, cgroup, rlimits: see docs/security.md)")
	jailUser := fs.String("jail-user", "", "as root: the VMM process, jailed, runs as this user and group from before its guest runs, UID[:GID] (numbers; GID defaults to UID)")
	verbose := fs.Bool("verbose", false, "log VMM events and the guest console to stderr")
	detach := fs.BoolP("detach", "d", false, "run detached: print the sandbox's name and leave it running (manage it with exec, ps, logs, stop, rm)")
	create := cmdName == "create"
	if create {
		fs.MarkHidden("detach")
		*detach = true
	}
	name := fs.String("name", "", "with -d: the sandbox's name (default: generated)")
	rm := fs.Bool("rm", false, "with -d: remove the sandbox's record when it ends")
	ttl := fs.Duration("ttl", 0, "with -d: stop the sandbox this long after it started (0: never)")
	idle := fs.Duration("idle-timeout", 0, "with -d: stop the sandbox once nobody has been connected to it (exec, cp) for this long (0: never)")
	watchdog := fs.Duration("watchdog", defaultWatchdog, "stop the sandbox as hung when its agent has not answered for this long and no vCPU moved; 0 turns it off")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "capsa "+cmdName+": "+format+"\n", a...)
		return 2
	}
	if fs.NArg() == 0 && *imageRef == "" {
		return fail("no command given (usage: capsa run [flags] -- CMD [ARGS...], or --image REF [-- ARGS...])")
	}
	if *imageRef == "" {
		for _, f := range []string{"pull", "entrypoint", "rootfs-size", "insecure-registry"} {
			if fs.Changed(f) {
				return fail("--%s needs --image", f)
			}
		}
	}
	if !*detach {
		for _, f := range []string{"name", "rm", "ttl", "idle-timeout"} {
			if fs.Changed(f) {
				return fail("--%s needs -d", f)
			}
		}
	} else {
		switch {
		case *interactive || *tty:
			return fail("-i and -t do not go together with -d: a detached sandbox has no terminal or standard input (use capsa exec -it)")
		case *verbose:
			return fail("--verbose and -d do not go together: see capsa logs --console")
		case *ttl < 0:
			return fail("--ttl %v: must not be negative", *ttl)
		case *idle < 0:
			return fail("--idle-timeout %v: must not be negative", *idle)
		}
		if *name != "" {
			if err := supervisor.CheckName(*name); err != nil {
				return fail("--name: %v", err)
			}
		}
	}
	var jailAs *supervisor.JailUser
	if *jailUser != "" {
		switch {
		case *noConfine:
			return fail("--jail-user and --no-confine do not go together")
		case os.Geteuid() != 0:
			return fail("--jail-user %s: capsa must run as root to change the VMM's user", *jailUser)
		}
		u, err := supervisor.ParseJailUser(*jailUser)
		if err != nil {
			return fail("--jail-user: %v", err)
		}
		jailAs = u
	}
	mem, err := parseSize(*memory)
	if err != nil {
		return fail("--memory: %v", err)
	}
	if mem%(1<<20) != 0 {
		return fail("--memory %s: must be a whole number of MiB", *memory)
	}
	var term *terminal
	var window agent.WindowSize
	if *tty && !*detach {
		if term, window, err = openTerminal(os.Stdin, *interactive); err != nil {
			return fail("%v", err)
		}
		*env = append([]string{"TERM=" + termName()}, *env...)
	}
	b := sandbox.New().CPUs(*cpus).Memory(int(mem >> 20)).Balloon(*balloon).Env(*env...).Watchdog(*watchdog)
	if err := host.apply(fs, b, *detach); err != nil {
		return fail("%v", err)
	}
	for _, c := range *copies {
		host, guest, ok := strings.Cut(c, ":")
		if !ok || host == "" || guest == "" {
			return fail("--copy %q: want HOST:GUEST", c)
		}
		b.CopyIn(host, guest)
	}
	for _, d := range *disks {
		path, mode, err := sandbox.ParseDisk(d)
		if err != nil {
			return fail("--disk: %v", err)
		}
		b.Disk(path, mode)
	}
	if *kernel != "" {
		b.Kernel(*kernel)
	}
	if *initrd != "" {
		b.Initrd(*initrd)
	}
	logger := slog.New(slog.DiscardHandler)
	if *verbose {
		logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
		b.Logger(logger).Console(stderr)
	} else if supervisor.ProbeRequested() {
		logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	if err := b.Err(); err != nil {
		return fail("%v", err)
	}
	var w *sandbox.Workload
	if *imageRef != "" {
		size, err := parseSize(*rootfsSize)
		if err != nil {
			return fail("--rootfs-size: %v", err)
		}
		b.Pull(sandbox.PullPolicy(*pull)).RootfsSize(int64(size)).InsecureRegistry(*insecure...).PullProgress(pullProgress(stderr))
		if fs.Changed("entrypoint") {
			if *entrypoint == "" {
				b.Entrypoint()
			} else {
				b.Entrypoint(*entrypoint)
			}
		}
		if err := b.Err(); err != nil {
			return fail("%v", err)
		}
		w = b.OCI(*imageRef, fs.Args()...)
	} else {
		w = b.Run(fs.Arg(0), fs.Args()[1:]...)
	}
	if err := w.Dir(*dir).User(*userFlag).Timeout(*timeout).Err(); err != nil {
		return fail("%v", err)
	}
	if *detach {
		rec := &supervisor.Record{Name: *name, TTL: *ttl, IdleTimeout: *idle, AutoRemove: *rm, NoConfine: *noConfine, JailUser: jailAs}
		return startDetached(ctx, w, rec, create, stdout, stderr)
	}
	fg := supervisor.Foreground{NoConfine: *noConfine, User: jailAs, Terminal: term != nil, Log: logger}
	if fg.NeedsJail() {
		code, err := fg.Reexec(append([]string{"run"}, args...), stdout, stderr)
		if err != nil {
			fmt.Fprintf(stderr, "capsa run: %v\n", err)
			return 125
		}
		return code
	}
	if term != nil {
		w.TTY(window)
	}
	w.Stdout(stdout).Stderr(stderr)
	if *host.secrets.netLog != "" {
		f, err := os.OpenFile(*host.secrets.netLog, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			return fail("--net-log: %v", err)
		}
		defer f.Close()
		w.NetAudit(f)
	}
	if *interactive {
		w.Stdin(os.Stdin)
	}
	// The VMM process's life is a supervisor's: confined once the VM is
	// built, before its guest runs; from now on Ctrl-\ asks for the VM's
	// state (before it runs, the goroutines').
	dump := func(state string) { fmt.Fprintf(stderr, "capsa run: on SIGQUIT, %s", state) }
	attach := func(sb *sandbox.Sandbox) (func(), error) {
		if term == nil || !*interactive {
			return nil, nil
		}
		if err := term.raw(sb.Resize); err != nil {
			return nil, fmt.Errorf("the terminal: %w", err)
		}
		return term.restore, nil // before any message
	}
	st, err := fg.Run(ctx, w, dump, attach)
	switch {
	case err != nil:
		fmt.Fprintf(stderr, "capsa run: %v\n", err)
		if re, ok := err.(*supervisor.RunError); ok && re.Unexplained != "" {
			fmt.Fprintf(stderr, "capsa run: %s", re.Unexplained)
		}
		return 125
	case st.TimedOut:
		fmt.Fprintf(stderr, "capsa run: the command timed out after %v\n", *timeout)
		return exitTimedOut
	}
	return st.Code
}
