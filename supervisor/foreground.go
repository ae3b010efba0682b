package supervisor

// The foreground VMM process: `capsa run` without -d runs its sandbox in
// the CLI's own process, with the caller's terminal and stdio, not under
// a supervisor. Its life is a supervisor's (vmmProcess, process.go): the
// same start in a mount namespace of its own where it is to be jailed,
// the same confinement before its guest runs, the same SIGQUIT answer and
// the same shutdown. It differs in where it lives (no records, no logs,
// no control socket) and in that its caller waits for it.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"github.com/capsa-sandbox/capsa/agent"
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

// Foreground is a foreground VMM process: Reexec first where NeedsJail
// says so, then Run (in the process Reexec started, where it did).
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
	jailCommand(cmd, tmp, foregroundJailEnv+"="+tmp)
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

// RunError is a foreground run's failure after its sandbox started.
type RunError struct {
	Err error
	// Unexplained is the VM's state when it ended for no reason it gave
	// (vmm.Exit.Unexplained); "" otherwise.
	Unexplained string
}

func (e *RunError) Error() string { return e.Err.Error() }
func (e *RunError) Unwrap() error { return e.Err }

// Run runs w's sandbox in this process until its main process ends, and
// returns how it ended. The process lives as a supervisor does
// (vmmProcess): SIGQUIT is answered with dump from now on, and the
// process is confined (with NoConfine, not) once the VM is built and
// before its guest runs. Once the sandbox runs, attach is called (a
// terminal made raw, say) and what it returns, when not nil, is called
// after the main process ends and before the VM shuts down. An error
// before the sandbox ran is the start's; after, a *RunError.
func (f Foreground) Run(ctx context.Context, w *sandbox.Workload, dump func(state string), attach func(*sandbox.Sandbox) (func(), error)) (*agent.ExitStatus, error) {
	place := vmmPlace{Name: "run", NoConfine: f.NoConfine, User: f.User, Terminal: f.Terminal, Confined: "capsa run: confined"}
	if tmp := os.Getenv(foregroundJailEnv); tmp != "" {
		place.Own = []string{tmp}
	}
	if dir, err := DefaultDir(); err == nil {
		place.StateDir = dir
	}
	p := newVMMProcess(place, f.Log, dump)
	defer p.close()
	sb, err := p.start(nil, func(beforeRun func(*sandbox.Sandbox) error) (*sandbox.Sandbox, error) {
		return w.BeforeRun(beforeRun).Start(ctx)
	})
	if err != nil {
		return nil, err
	}
	defer sb.Close()
	detach := func() {}
	if attach != nil {
		d, err := attach(sb)
		if err != nil {
			p.shutdown(ctx, sb)
			return nil, &RunError{Err: err}
		}
		if d != nil {
			detach = d
		}
	}
	st, err := sb.Wait(ctx)
	detach()
	p.shutdown(ctx, sb)
	if err != nil {
		re := &RunError{Err: err}
		if d := sb.Exit().Unexplained(); d != nil {
			re.Unexplained = d.String()
		}
		return nil, re
	}
	return st, nil
}
