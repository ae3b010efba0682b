package supervisor

// The foreground VMM process: `capsa run` without -d runs its sandbox in
// the CLI's own process, with the caller's terminal, not under a
// supervisor. It is confined by the same rules as a supervisor
// (vmmConfinement), started again in a mount namespace of its own to be
// jailed as Spawn starts a jailed supervisor, and prints the VM's state on
// SIGQUIT as a supervisor logs it (QuitCatcher).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/capsa-sandbox/capsa/confine"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// JailUser is the user a jailed VMM process runs as (--jail-user).
type JailUser = confine.User

// ParseJailUser reads USER[:GROUP], each a name or a number.
func ParseJailUser(s string) (*JailUser, error) {
	u, err := confine.ParseUser(s)
	if err != nil {
		return nil, err
	}
	return &u, nil
}

// ProbeRequested reports whether a test asked the confined process to try
// what its confinement must refuse (confine.ProbeEnv): the caller then
// logs warnings, where the probe's results go.
func ProbeRequested() bool { return os.Getenv(confine.ProbeEnv) != "" }

// foregroundJailEnv marks the foreground VMM process started in its own
// mount namespace. Its value is the temporary directory (its TMPDIR) the
// parent made for it and removes after it: the jailed child can empty
// what it makes there (an image's writable layer), not remove it.
const foregroundJailEnv = "CAPSA_JAIL_TMP"

// Foreground is a foreground VMM process's confinement: Reexec first
// where NeedsJail says so, then Confine in the sandbox's BeforeRun, once
// its VM is built and before its guest runs.
type Foreground struct {
	NoConfine bool
	User      *JailUser // nil: root's jail keeps root
	Terminal  bool      // the process keeps a terminal (its ioctls stay allowed)
	Log       *slog.Logger
}

// NeedsJail reports whether this process is to be jailed and is not yet
// in a mount namespace of its own: it must Reexec.
func (f Foreground) NeedsJail() bool {
	return Jailed(f.NoConfine) && os.Getenv(foregroundJailEnv) == ""
}

// Reexec runs this executable again with args, in a new mount namespace,
// with the same standard input and terminal, and returns its exit code
// (128+N for a signal N). Meanwhile it passes on SIGTERM and SIGHUP and
// lets the terminal's SIGINT and SIGQUIT reach the child alone (the child
// is in the terminal's process group): a SIGQUIT asks the child for the
// VM's state (QuitCatcher) and must not end this process. An error says it
// could not start it.
func (f Foreground) Reexec(args []string, stdout, stderr io.Writer) (int, error) {
	tmp, err := os.MkdirTemp("", "capsa-run-")
	if err != nil {
		return 0, fmt.Errorf("supervisor: jail: %w", err)
	}
	defer os.RemoveAll(tmp)
	if f.User != nil {
		if err := os.Chown(tmp, f.User.UID, f.User.GID); err != nil {
			return 0, fmt.Errorf("supervisor: jail: %w", err)
		}
	}
	cmd := exec.Command("/proc/self/exe", args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, stdout, stderr
	cmd.Env = append(os.Environ(), foregroundJailEnv+"="+tmp, "TMPDIR="+tmp)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("supervisor: start in a mount namespace of its own: %w", err)
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-sigs:
				if s == syscall.SIGTERM || s == syscall.SIGHUP {
					cmd.Process.Signal(s)
				}
			case <-done:
				return
			}
		}
	}()
	err = cmd.Wait()
	close(done)
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, nil
	case errors.As(err, &exit):
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal()), nil
		}
		return exit.ExitCode(), nil
	}
	return 0, fmt.Errorf("supervisor: the jailed process: %w", err)
}

// Confine confines this process, which runs sb, to what sb uses (package
// confine) and returns the layers in force; with NoConfine it does
// nothing. The rules are a supervisor's, less the state directory's
// records and snapshots, which a foreground run does not use.
func (f Foreground) Confine(sb *sandbox.Sandbox) (string, error) {
	if f.NoConfine {
		return "", nil
	}
	log := f.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := vmmConfinement(sb, sb.Spec(), "run", f.User)
	c.Terminal = f.Terminal
	if tmp := os.Getenv(foregroundJailEnv); tmp != "" {
		c.Own = []string{tmp}
	}
	if dir, err := DefaultDir(); err == nil {
		c.Shared = SharedFiles(dir, c.Write)
	}
	layers, err := applyConfinement(c, log, "capsa run: confined")
	if err != nil {
		return "", err
	}
	return layers.String(), nil
}

// applyConfinement confines this process as c says, logs the layers it
// got and how long that took under msg (at info level: a supervisor's log
// has it, and `capsa run --verbose` shows it), and runs the test
// hook's probe (confine.ProbeEnv): a supervisor's and a foreground run's
// last step before their guest runs.
func applyConfinement(c confine.Config, log *slog.Logger, msg string) (confine.Layers, error) {
	start := time.Now()
	layers, err := confine.Apply(c, log)
	if err != nil {
		return layers, err
	}
	log.Info(msg, "layers", layers.String(), "took", time.Since(start))
	confine.Probe(log)
	return layers, nil
}

// vmmConfinement is what a VMM process running sb, of spec, is confined
// to, the same for a supervisor and a foreground run: sb's host paths, a
// cgroup bounded to the guest's memory and VMMOverhead and to its CPU
// quota, and the jail's user.
func vmmConfinement(sb *sandbox.Sandbox, spec sandbox.Spec, name string, user *JailUser) confine.Config {
	read, write := sb.HostPaths()
	return confine.Config{
		Read: read, Write: write, Name: name, User: user,
		MemoryBytes: int64(spec.MemoryMiB)<<20 + VMMOverhead, CPUs: spec.EffectiveCPUQuota(),
	}
}

// QuitCatcher answers SIGQUIT from its making on, with what there is to
// see: the VM's state (vCPUs, interrupts, virtqueues, console) while the
// sandbox it watches runs, and the process's goroutines before the VM
// runs (a boot that hangs) or after it ended (a shutdown that does). The
// process goes on either way, where Go's default would end it.
type QuitCatcher struct {
	c    chan os.Signal
	sb   atomic.Pointer[sandbox.Sandbox]
	done chan struct{}
	once sync.Once
}

// CatchQuit starts answering SIGQUIT with dump; Watch gives it the
// sandbox, and Stop ends it.
func CatchQuit(dump func(state string)) *QuitCatcher {
	q := &QuitCatcher{c: make(chan os.Signal, 1), done: make(chan struct{})}
	signal.Notify(q.c, syscall.SIGQUIT)
	go func() {
		for {
			select {
			case <-q.c:
				dump(q.state())
			case <-q.done:
				return
			}
		}
	}()
	return q
}

// Watch makes sb the sandbox whose state a SIGQUIT shows.
func (q *QuitCatcher) Watch(sb *sandbox.Sandbox) { q.sb.Store(sb) }

func (q *QuitCatcher) state() string {
	if sb := q.sb.Load(); sb != nil {
		select {
		case <-sb.Done():
		default:
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			return "the VM's state:\n" + sb.Debug(ctx).String()
		}
	}
	buf := make([]byte, 1<<20)
	return "no VM runs; the process's goroutines:\n" + string(buf[:runtime.Stack(buf, true)])
}

// Stop stops answering SIGQUIT.
func (q *QuitCatcher) Stop() {
	q.once.Do(func() {
		signal.Stop(q.c)
		close(q.done)
	})
}
