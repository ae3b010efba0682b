package supervisor

// A VMM process's life, written once for both kinds: a detached
// sandbox's supervisor (Run, started by spawn) and a foreground `capsa
// run` (Foreground.Run, started again by Foreground.Reexec where it is to
// be jailed). Both
//   - are started in a mount namespace of their own where they are to be
//     jailed, with a temporary directory they may empty (jailCommand);
//   - answer SIGQUIT with the VM's state (QuitCatcher);
//   - build the VM, then confine themselves by one set of rules before
//     its guest's first instruction (vmmProcess.start, vmmProcess.config);
//   - shut the VM down the same way (vmmProcess.shutdown).
// What differs is where they are (vmmPlace): a supervisor also writes its
// sandbox's directory and the store's snapshots; a foreground run writes
// nothing of the store's.

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/capsa-sandbox/capsa/confine"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// ShutdownTimeout bounds a VMM process's shutdown of its VM: the guest's
// own shutdown, then the VM's end.
const ShutdownTimeout = 10 * time.Second

// jailCommand has cmd start in a mount namespace of its own, which the
// jail needs made with the process (package confine), with tmp as its
// temporary directory (TMPDIR) and env added to its environment. The
// namespace is the clone's (Cloneflags), not an unshare after it
// (Unshareflags), after which Go's os/exec makes every mount private:
// a jail that follows the host's mounts (confine.JailConfig.Follow) needs
// the host's shared mounts still peers of its copies, and Jail makes them
// private or slaves itself.
func jailCommand(cmd *exec.Cmd, tmp string, env ...string) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWNS
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(append(cmd.Env, env...), "TMPDIR="+tmp)
}

// vmmPlace is where a VMM process lives, beside the host paths of the
// sandbox it runs: what its confinement adds to them.
type vmmPlace struct {
	Name      string // the sandbox's name, for the cgroup
	NoConfine bool
	User      *JailUser // the jail's user; nil: root's jail keeps root
	// FollowMounts: the host mounts beneath its shares while it runs (a
	// pod's supervisor: its containers' roots), and its jail takes them
	// (confine.Config.Follow).
	FollowMounts bool
	Terminal     bool // the process keeps a terminal (its ioctls stay allowed)
	// StateDir is the state directory whose shared files (the hub's)
	// the jail's user is let into, where the sandbox uses them; "": none.
	StateDir string
	Write    []string // written beside the sandbox's host paths
	Own      []string // the jail's user's own
	Shared   []string // the jail's user is let into, beside StateDir's
	// Confined is what the log says once the process is confined.
	Confined string
}

// vmmProcess is one VMM process's life: made before the VM (SIGQUIT is
// answered from then on), start, shutdown, close.
type vmmProcess struct {
	place  vmmPlace
	log    *slog.Logger
	quit   *QuitCatcher
	layers *confine.Layers // what confines the process; nil while nothing does
}

// newVMMProcess begins a VMM process's life at place, logging to log and
// giving SIGQUIT's answers to dump.
func newVMMProcess(place vmmPlace, log *slog.Logger, dump func(state string)) *vmmProcess {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &vmmProcess{place: place, log: log, quit: CatchQuit(dump)}
}

// config is what the process running a sandbox of spec, whose host paths
// are read and write (Sandbox.HostPaths) and which serves host files or
// not (Sandbox.ServesHostFiles), is confined to: those paths and the
// place's, a cgroup bounded to the guest's memory and VMMOverhead and to
// its CPU quota, the jail's user, and the file server's capabilities for
// root only where it serves files.
func (p *vmmProcess) config(read, write []string, files bool, spec sandbox.Spec) confine.Config {
	c := confine.Config{
		Read: read, Write: slices.Concat(write, p.place.Write), HostFiles: files, Name: p.place.Name, User: p.place.User,
		MemoryBytes: int64(spec.MemoryMiB)<<20 + VMMOverhead, CPUs: spec.EffectiveCPUQuota(),
		Own: p.place.Own, Terminal: p.place.Terminal,
	}
	if p.place.FollowMounts {
		c.Follow = write // its shares, where the host mounts
	}
	if p.place.StateDir != "" {
		c.Shared = SharedFiles(p.place.StateDir, c.Write)
	}
	c.Shared = append(c.Shared, p.place.Shared...)
	return c
}

// start builds a sandbox with build, giving it the hook that confines
// this process (config, for spec, or for the sandbox's own where spec is
// nil) once the VM is built and before its guest runs, and has SIGQUIT
// show the VM from then on.
func (p *vmmProcess) start(spec *sandbox.Spec, build func(beforeRun func(*sandbox.Sandbox) error) (*sandbox.Sandbox, error)) (*sandbox.Sandbox, error) {
	sb, err := build(func(sb *sandbox.Sandbox) error {
		if p.place.NoConfine {
			return nil
		}
		s := sb.Spec()
		if spec != nil {
			s = *spec
		}
		read, write := sb.HostPaths()
		l, err := applyConfinement(p.config(read, write, sb.ServesHostFiles(), s), p.log, p.place.Confined)
		if err != nil {
			return err
		}
		p.layers = &l
		if p.place.FollowMounts {
			// The shares' roots, pinned before the jail, in the jail's
			// binds that take the host's mounts.
			if err := sb.ReopenShares(); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	p.quit.Watch(sb)
	return sb, nil
}

// shutdown ends sb's VM: the guest shuts down, for at most
// ShutdownTimeout, then the VM stops.
func (p *vmmProcess) shutdown(ctx context.Context, sb *sandbox.Sandbox) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ShutdownTimeout)
	defer cancel()
	return sb.Shutdown(ctx)
}

// close ends the process's answers to SIGQUIT.
func (p *vmmProcess) close() { p.quit.Stop() }

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
