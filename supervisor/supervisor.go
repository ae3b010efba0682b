// Package supervisor keeps a detached sandbox alive after the command that
// started it has gone, and reaches it by name. Its starting points are
// Manager, the one owner of a state directory's named sandboxes, whose
// methods are every operation on one (the CLI, MCP, the E2B API and the
// containerd shim are adapters over it; Manager.Open is a handle to a
// running sandbox with the same guest operations as one started
// in-process), and Run, the life of a supervisor process (one per
// sandbox, started by Manager.Launch and Manager.Start).
//
// A supervisor boots the sandbox its store record describes, serves the
// guest agent on the sandbox directory's agent.sock (the hybrid-vsock
// handshake, so `capsa exec` and any other client use the one agent
// client) and its own control API on control.sock (HTTP: stop),
// writes the main process's output and the guest console to bounded logs,
// and records every change of state. When the main process ends, or on
// stop, TTL or SIGTERM, it stops the VM and records how it ended.
package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime/debug"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/internal/selfpages"
	"github.com/capsa-sandbox/capsa/ratelimit"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/store"
)

// Files in a sandbox's directory.
const (
	AgentSocket   = "agent.sock"
	ControlSocket = "control.sock"
	MainLog       = "main.log"
	ConsoleLog    = "console.log"
	SupervisorLog = "supervisor.log" // the supervisor's own log (its stderr)
)

// DefaultLogLimit bounds each log a supervisor keeps (the live file and
// one rotated one, each at most half of it).
const DefaultLogLimit = 16 << 20

// DefaultStopTimeout is how long stop waits after SIGTERM before SIGKILL.
const DefaultStopTimeout = 10 * time.Second

// Options configure a supervisor.
type Options struct {
	Store *store.Store
	Name  string
	Log   *slog.Logger
	// Ready is called once: with nil when the sandbox runs and its record
	// says so, or with why it could not start.
	Ready func(error)
	// LogLimit bounds each log; 0 is DefaultLogLimit.
	LogLimit int64
}

// place is where a supervisor lives (vmmPlace): beside its sandbox's host
// paths, its sandbox's directory (its own, the jail user's where jailed
// as one) and the store's snapshots; not the records' database, since it
// reports its run in its own directory (store.Status). A layer's parent
// that another user's sandbox wrote there, which it may not open, is lent
// to it by the client asking for the layer (lend.go). A pod's
// supervisor's jail follows the host's mounts beneath its shares
// (Record.HostMounts).
func place(st *store.Store, rec *store.Record) vmmPlace {
	dir, snaps := st.SandboxDir(rec.Name), st.SnapshotsDir()
	return vmmPlace{
		Name: rec.Name, NoConfine: rec.NoConfine, User: rec.JailUser, FollowMounts: rec.HostMounts,
		StateDir: st.Dir(), Write: []string{dir, snaps}, Own: []string{dir}, Shared: []string{snaps},
		Confined: "supervisor: confined",
	}
}

// SharedFiles are the paths in write that lie directly in the state
// directory dir: the hub's files, which every sandbox granted the hub
// uses. A jail's user gets an ACL entry on them (confine.Config.Shared).
func SharedFiles(dir string, write []string) []string {
	var out []string
	for _, p := range write {
		if filepath.Dir(p) == filepath.Clean(dir) {
			out = append(out, p)
		}
	}
	return out
}

// Jailed reports whether a sandbox's VMM process is jailed (package
// confine): when capsa runs as root and the sandbox is confined. Such a
// process must be spawned in a mount namespace of its own.
func Jailed(noConfine bool) bool { return !noConfine && os.Geteuid() == 0 }

// TmpDir is the temporary directory of a jailed supervisor (its TMPDIR),
// in the sandbox's directory: what it makes there (an image's writable
// layer) it can remove again, and capsa rm removes what is left.
const TmpDir = "tmp"

// VMMOverhead is what a sandbox's VMM may hold beside its guest's memory
// in its cgroup: its own heap, the NAT's buffers and the host page cache
// its file I/O brings in (which the kernel reclaims at the limit).
const VMMOverhead = 512 << 20

// Run boots the sandbox recorded under o.Name and supervises it until it
// ends: its main process exits, a stop arrives, its TTL passes or ctx ends
// (a stop with DefaultStopTimeout). The caller holds the sandbox's lock.
func Run(ctx context.Context, o Options) error {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ready := o.Ready
	if ready == nil {
		ready = func(error) {}
	}
	limit := o.LogLimit
	if limit <= 0 {
		limit = DefaultLogLimit
	}
	st := o.Store
	rec, err := st.Get(o.Name)
	if err != nil {
		ready(err)
		return err
	}
	dir := st.SandboxDir(o.Name)
	// Sockets left by a supervisor that died would make Listen fail.
	for _, f := range []string{AgentSocket, ControlSocket} {
		os.Remove(filepath.Join(dir, f))
	}
	rep := &report{st: st, name: o.Name}
	end := func(code *int, reason string) {
		rep.set(log, func(s *store.Status) { s.State, s.ExitCode, s.Reason, s.Ended = store.Exited, code, reason, time.Now() })
	}
	// fail records that the sandbox could not start, and says why.
	fail := func(err error) error {
		end(nil, err.Error())
		ready(err)
		return err
	}
	mainLog, err := newRotatingLog(filepath.Join(dir, MainLog), limit)
	if err != nil {
		return fail(err)
	}
	defer mainLog.Close()
	consoleLog, err := newRotatingLog(filepath.Join(dir, ConsoleLog), limit)
	if err != nil {
		return fail(err)
	}
	defer consoleLog.Close()
	secrets, err := readSecrets(st, o.Name)
	if err != nil {
		return fail(err)
	}
	var netAudit io.Writer
	if nl, err := openNetLog(dir, rec.Spec, limit); err != nil {
		return fail(err)
	} else if nl != nil {
		defer nl.Close()
		netAudit = nl
	}

	spec := rec.Spec
	spec.VsockSocket = filepath.Join(dir, AgentSocket)
	// In the hub, the sandbox is known by its name, and its state
	// directory's hub is the one capsa kv and capsa mailbox use.
	if spec.Hub == nil {
		spec.Hub = &sandbox.HubSpec{}
	}
	spec.Hub.Identity = o.Name
	if spec.Hub.Dir == "" {
		spec.Hub.Dir = o.Store.Dir()
	}
	// The snapshots' directory, which the confined supervisor may write,
	// must exist before it is confined.
	if !rec.NoConfine {
		if err := os.MkdirAll(st.SnapshotsDir(), 0o700); err != nil {
			return fail(fmt.Errorf("supervisor: confine: %w", err))
		}
	}
	// SIGQUIT asks for the VM's state (vCPUs, interrupts, virtqueues,
	// console), into the supervisor's log; the sandbox runs on. Before
	// the VM runs, and after, the goroutines'. Once the VM is built,
	// before its guest's first instruction, the supervisor is confined
	// to its own files, the sandbox's, and the calls a running VMM makes.
	p := newVMMProcess(place(st, rec), log, func(state string) { log.Warn("supervisor: on SIGQUIT, " + state) })
	defer p.close()
	// A snapshot of the disk alone (capsa suspend --no-memory) can only
	// be booted again, whatever the record asked: decided here, with the
	// sandbox's lock held, from the files that will be read.
	reboot := rec.Reboot || (rec.RestoreFrom != "" && diskOnly(rec.RestoreFrom))
	sb, err := p.start(&spec, func(beforeRun func(*sandbox.Sandbox) error) (*sandbox.Sandbox, error) {
		if rec.RestoreFrom != "" {
			ro := sandbox.RestoreOptions{
				Logger: log, Console: consoleLog, Stdout: mainLog, Stderr: mainLog,
				VsockSocket: spec.VsockSocket, Settings: &spec, Hostname: rec.Hostname,
				Identity: o.Name, Secrets: secrets, NetAudit: netAudit, BeforeRun: beforeRun,
			}
			if reboot {
				return sandbox.Reboot(ctx, rec.RestoreFrom, ro)
			}
			return sandbox.Restore(ctx, rec.RestoreFrom, ro)
		}
		return sandbox.FromSpec(spec).Secrets(secrets).NetAudit(netAudit).BeforeRun(beforeRun).
			Logger(log).Console(consoleLog).Stdout(mainLog).Stderr(mainLog).Start(ctx)
	})
	if err != nil {
		return fail(err)
	}
	defer sb.Close()
	log.Info("supervisor: the sandbox runs", "restored", rec.RestoreFrom != "" && !reboot, "rebooted", reboot, "timeline", sb.Timeline().String())

	c := &control{sb: sb, rep: rep, stopc: make(chan stopRequest, 1), ttlc: make(chan time.Duration),
		suspendc: make(chan struct{}, 1), suspendDir: st.SuspendDir(o.Name), started: time.Now(), hostMounts: rec.HostMounts}
	srv, err := c.serve(filepath.Join(dir, ControlSocket), log)
	if err != nil {
		return fail(err)
	}
	defer srv.Close()

	env, wd := sb.Defaults()
	var ports []string
	for _, p := range sb.Published() {
		ports = append(ports, fmt.Sprintf("%s->%d/%s", p.Addr, p.Mapping.GuestPort, p.Addr.Network()))
	}
	err = rep.set(log, func(s *store.Status) {
		*s = store.Status{Run: store.Run{State: store.Running, Started: c.started, Env: env, Dir: wd, Ports: ports, Confinement: p.layers}}
	})
	if err != nil {
		ready(err)
		return err
	}
	ready(nil)
	log.Info("supervisor: running", "name", o.Name)
	// What the start left (decompression, image layers, JSON) is garbage
	// now: give its pages back, so that a VMM that runs for hours holds
	// only what it uses (BenchmarkDetachedExec/memory). The same for the
	// binary's own code and read-only data, which the start mapped and
	// most of which runs no more: what does comes back from the page
	// cache.
	debug.FreeOSMemory()
	if n, err := selfpages.Release(); err != nil {
		log.Warn("supervisor: giving back the binary's pages", "err", err)
	} else {
		log.Debug("supervisor: gave back the binary's pages", "bytes", n)
	}

	var mainStatus *agent.ExitStatus
	var mainErr error
	mainDone := make(chan struct{})
	go func() {
		mainStatus, mainErr = sb.Wait(context.WithoutCancel(ctx))
		close(mainDone)
	}()
	// The TTL counts from the start; the ttl operation sets a new one
	// (0: none) while the sandbox runs.
	ttlTimer := time.NewTimer(time.Hour)
	ttlTimer.Stop()
	defer ttlTimer.Stop()
	curTTL := rec.TTL
	var ttl <-chan time.Time
	setTTL := func(d time.Duration) {
		curTTL = d
		ttlTimer.Stop()
		ttl = nil
		if d > 0 {
			ttlTimer.Reset(time.Until(c.started.Add(d)))
			ttl = ttlTimer.C
		}
	}
	setTTL(rec.TTL)
	idle := watchIdle(sb, rec.IdleTimeout)
	var reason string
	suspended, suspendedAtTTL := false, false
	for reason == "" {
		select {
		case <-c.suspendc:
			reason, suspended = "suspended to disk", true
		case <-mainDone:
			reason = "its main process ended"
		case <-sb.Done():
			reason = fmt.Sprintf("the VM stopped: %v", sb.Exit())
		case req := <-c.stopc:
			reason = "stopped"
			if req.kill {
				reason = "killed"
			}
			c.stopMain(mainDone, req.timeout, req.kill, log)
		case d := <-c.ttlc:
			setTTL(d)
			log.Info("supervisor: TTL set", "ttl", d, "ends", c.started.Add(d))
		case <-ttl:
			if rec.PauseAtTTL {
				ttl = nil
				// To disk, where the sandbox can be snapshotted; else in
				// memory.
				err := c.suspend(ctx, rec.PauseWithoutMemory && rec.Spec.Image != nil, log)
				if err == nil {
					reason, suspended, suspendedAtTTL = fmt.Sprintf("suspended to disk at its TTL of %v", curTTL.Round(time.Second)), true, true
					continue
				}
				log.Info("supervisor: not suspended at its TTL: paused in memory instead", "err", err)
				if err := c.setPaused(ctx, true, log); err == nil {
					log.Info("supervisor: paused at its TTL", "ttl", curTTL.Round(time.Second))
					continue
				}
			}
			reason = fmt.Sprintf("its TTL of %v passed", curTTL.Round(time.Second))
			c.stopMain(mainDone, DefaultStopTimeout, false, log)
		case <-idle:
			reason = fmt.Sprintf("nobody was connected to it for its idle timeout of %v", rec.IdleTimeout)
			c.stopMain(mainDone, DefaultStopTimeout, false, log)
		case <-ctx.Done():
			reason = "its supervisor was told to stop"
			c.stopMain(mainDone, DefaultStopTimeout, false, log)
		}
	}
	if suspended {
		// The guest stays as the snapshot has it: no signal, no
		// shutdown; the VM goes with sb.Close. The status says the
		// sandbox is suspended (a resume restores it from its
		// SuspendDir, Store.Start) and, paused at its TTL, that it has
		// none (as an in-memory pause). The status first, the control
		// socket after: a resume that read the record just before either
		// reaches the socket (and hears that the suspension is under way)
		// or reads Suspended, never a closed socket beside a record
		// saying paused. The suspend request that ended the loop is
		// answered before the socket goes (closeControl).
		err := rep.set(log, func(s *store.Status) {
			s.State, s.Reason, s.Ended, s.TTLPassed = store.Suspended, reason, time.Now(), suspendedAtTTL
		})
		closeControl(srv)
		if err != nil {
			log.Error("supervisor: record the suspension", "err", err)
			return err
		}
		log.Info("supervisor: suspended", "name", o.Name, "dir", c.suspendDir)
		return nil
	}
	var code *int
	select {
	case <-mainDone:
		switch {
		case mainErr != nil:
			reason += fmt.Sprintf(" (main process: %v)", mainErr)
		case mainStatus != nil:
			code = &mainStatus.Code
		}
	default:
	}
	if err := p.shutdown(ctx, sb); err != nil {
		log.Warn("supervisor: shutdown", "err", err)
	}
	closeControl(srv)
	end(code, reason)
	log.Info("supervisor: ended", "name", o.Name, "reason", reason)
	return nil
}

// closeControl stops the control server: no new connection, and the
// requests under way (the suspend or stop that ended the sandbox) are
// answered first, for at most a few seconds. Closing at once lost the
// answer to a suspension now and then: the client saw EOF for a suspend
// that had succeeded.
func closeControl(srv *http.Server) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if srv.Shutdown(ctx) != nil {
		srv.Close()
	}
}

// watchIdle returns a channel closed once nobody has been connected to the
// sandbox's agent socket for timeout (never for 0); it stops looking when
// the sandbox ends.
func watchIdle(sb *sandbox.Sandbox, timeout time.Duration) <-chan struct{} {
	idle := make(chan struct{})
	if timeout <= 0 {
		return idle
	}
	go func() {
		tick := time.NewTicker(min(time.Second, max(timeout/10, 10*time.Millisecond)))
		defer tick.Stop()
		// Idle time counts from this at the earliest: now, when the
		// sandbox is served (its start reported, its control open),
		// then whenever it is seen paused (its idle time counts from
		// its resume).
		from := time.Now()
		for {
			select {
			case <-sb.Done():
				return
			case <-tick.C:
			}
			// A paused sandbox is kept, not idle.
			if sb.Paused() {
				from = time.Now()
				continue
			}
			since, ok := sb.IdleSince()
			if since.Before(from) {
				since = from
			}
			if ok && time.Since(since) >= timeout {
				close(idle)
				return
			}
		}
	}()
	return idle
}

// stopRequest asks the supervisor to stop the sandbox.
type stopRequest struct {
	timeout time.Duration
	kill    bool
}

// control is the supervisor's control API.
type control struct {
	sb      *sandbox.Sandbox
	rep     *report
	stopc   chan stopRequest
	ttlc    chan time.Duration // a new TTL, from its start
	started time.Time
	pauseMu sync.Mutex // one pause or resume at a time
	// suspendc says the sandbox was written to suspendDir and is to end
	// there (suspend); suspending is set then, under pauseMu, so that
	// nothing runs the guest on past its snapshot.
	suspendc   chan struct{}
	suspendDir string
	suspending bool
	// hostMounts: the host mounts beneath its shares while it runs
	// (store.Record.HostMounts, a containerd pod's), which it cannot be
	// suspended, snapshotted or forked with: a resumed or restored VM's
	// file server takes the guest's files again from the root it pinned
	// before its jail, which follows no mount made after.
	hostMounts bool
}

// ErrBeingSuspended refuses a pause, resume or second suspension of a
// sandbox whose suspension is under way; a client's error wraps it too
// (controlErrorCodes).
var ErrBeingSuspended = errors.New("the sandbox is being suspended")

// suspend writes the whole sandbox to c.suspendDir, its guest paused
// from then on, and has the supervisor end there (suspendc): the record
// then says Suspended, and a resume restores the sandbox from the
// directory. withoutMemory keeps an image sandbox's disk alone
// (sandbox.SnapshotOptions.DiskOnly), which a resume boots again. A
// sandbox that cannot be snapshotted (it has disks) stays as it was,
// with the error.
func (c *control) suspend(ctx context.Context, withoutMemory bool, log *slog.Logger) error {
	if c.hostMounts {
		return errors.New("suspend: a containerd pod's VM cannot be suspended: its containers' roots are mounts its shim makes while it runs, which a resumed VM would not follow")
	}
	// Kept without its memory, a paused guest runs for its sync: what
	// its page cache held would be lost otherwise. A failure pauses it
	// again.
	repause := false
	if withoutMemory && c.sb.Paused() {
		if err := c.setPaused(ctx, false, log); err != nil {
			return fmt.Errorf("suspend: run the paused guest for its sync: %w", err)
		}
		repause = true
	}
	if !c.sb.Paused() && c.sb.Spec().Image != nil {
		// What the guest wrote is put on its disk first: a resume
		// without the memory (Manager.ResumeCold) boots from the
		// disk alone. A guest that does not answer is suspended all
		// the same.
		sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
		if err := c.sb.Sync(sctx); err != nil {
			log.Warn("supervisor: sync before the suspension", "err", err)
		}
		scancel()
	}
	c.pauseMu.Lock()
	defer c.pauseMu.Unlock()
	if c.suspending {
		return &controlError{http.StatusConflict, ErrBeingSuspended}
	}
	if err := c.sb.Snapshottable(); err != nil {
		return fmt.Errorf("suspend: %w", err)
	}
	if repause {
		defer func() {
			if !c.suspending && !c.sb.Paused() {
				if err := c.sb.Pause(context.WithoutCancel(ctx)); err == nil {
					c.setState(store.Paused, log)
				}
			}
		}()
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	wasPaused := c.sb.Paused()
	if err := c.sb.Pause(ctx); err != nil {
		return fmt.Errorf("suspend: %w", err)
	}
	c.setState(store.Paused, log) // while the snapshot is written
	// Written beside, then renamed: a suspension that fails leaves the
	// last one (if any) whole.
	tmp := c.suspendDir + ".new"
	os.RemoveAll(tmp)
	err := c.sb.SnapshotWith(ctx, tmp, sandbox.SnapshotOptions{DiskOnly: withoutMemory})
	if err == nil {
		os.RemoveAll(c.suspendDir)
		err = os.Rename(tmp, c.suspendDir)
	}
	if err != nil {
		os.RemoveAll(tmp)
		if !wasPaused {
			if rerr := c.sb.Resume(context.WithoutCancel(ctx)); rerr != nil {
				log.Warn("supervisor: resume after a failed suspension", "err", rerr)
			} else {
				c.setState(store.Running, log)
			}
		}
		log.Warn("supervisor: suspend", "err", err)
		return fmt.Errorf("suspend: %w", err)
	}
	c.suspending = true
	c.suspendc <- struct{}{}
	log.Info("supervisor: snapshot for the suspension written", "dir", c.suspendDir, "without_memory", withoutMemory)
	return nil
}

// stopMain ends the main process: SIGTERM, then SIGKILL after timeout (at
// once with kill).
func (c *control) stopMain(mainDone <-chan struct{}, timeout time.Duration, kill bool, log *slog.Logger) {
	// A paused guest cannot take a signal: it runs again to end.
	c.pauseMu.Lock()
	if c.sb.Paused() {
		ctx, cancel := context.WithTimeout(context.Background(), pauseTimeout)
		if err := c.sb.Resume(ctx); err != nil {
			log.Warn("supervisor: resume to stop", "err", err)
		}
		cancel()
	}
	c.pauseMu.Unlock()
	sig := func(name string) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := c.sb.Signal(ctx, name); err != nil {
			log.Warn("supervisor: signal the main process", "signal", name, "err", err)
		}
	}
	if !kill {
		sig("SIGTERM")
		select {
		case <-mainDone:
			return
		case <-time.After(timeout):
		}
	}
	sig("SIGKILL")
	select {
	case <-mainDone:
	case <-time.After(5 * time.Second):
	}
}

// serve listens on the control socket path and serves the control
// protocol on it.
func (c *control) serve(path string, log *slog.Logger) (*http.Server, error) {
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("supervisor: control socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("supervisor: control socket: %w", err)
	}
	srv := &http.Server{Handler: c.mux(log), ReadHeaderTimeout: 10 * time.Second, ConnContext: withLendingConn,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	go srv.Serve(lendingListener{l.(*net.UnixListener)})
	return srv, nil
}

// mux is the control protocol's server: a handler for each operation of
// controlOps.
func (c *control) mux(log *slog.Logger) *http.ServeMux {
	mux := http.NewServeMux()
	opStop.register(mux, func(_ context.Context, req stopBody) (noBody, error) {
		if req.Timeout < 0 {
			return noBody{}, badRequest("bad stop request: negative timeout")
		}
		select {
		case c.stopc <- stopRequest{timeout: req.Timeout, kill: req.Kill}:
		default: // a stop is already under way
		}
		return noBody{}, nil
	})
	opPause.register(mux, func(ctx context.Context, _ noBody) (noBody, error) {
		return noBody{}, c.setPaused(ctx, true, log)
	})
	opResume.register(mux, func(ctx context.Context, _ noBody) (noBody, error) {
		return noBody{}, c.setPaused(ctx, false, log)
	})
	opSnapshot.register(mux, func(ctx context.Context, req snapshotBody, progress func(sandbox.Progress)) error {
		lent := lentFiles(ctx)
		if c.hostMounts {
			// A restore or a fork would run without the mounts (see
			// hostMounts), its containers' roots empty.
			closeFiles(lent)
			return errors.New("snapshot: a containerd pod's VM cannot be snapshotted or forked: its containers' roots are mounts its shim makes while it runs, which a restored copy would not have")
		}
		if !filepath.IsAbs(req.Dir) || req.Parent != "" && !filepath.IsAbs(req.Parent) {
			closeFiles(lent)
			return badRequest("bad snapshot request: %q or %q is not an absolute directory", req.Dir, req.Parent)
		}
		o := sandbox.SnapshotOptions{Inventory: req.Inventory, Parent: req.Parent, Fork: req.Fork, Progress: progress}
		if len(lent) > 0 {
			// The parent, opened by the client: this process may not
			// read it (it holds no capability to).
			if req.Parent == "" {
				closeFiles(lent)
				return badRequest("bad snapshot request: files lent without a parent")
			}
			p, err := snapshot.OpenLent(req.Parent, lent)
			if err != nil {
				return badRequest("bad snapshot request: the parent: %v", err)
			}
			defer p.Close()
			o.ParentOpen = p
		}
		c.pauseMu.Lock()
		defer c.pauseMu.Unlock()
		if err := c.sb.SnapshotWith(ctx, req.Dir, o); err != nil {
			log.Warn("supervisor: snapshot", "err", err)
			return err
		}
		log.Info("supervisor: snapshot written", "dir", req.Dir, "paused", c.sb.LastPause())
		return nil
	})
	opSuspend.register(mux, func(ctx context.Context, req suspendBody) (noBody, error) {
		if req.WithoutMemory && c.sb.Spec().Image == nil {
			return noBody{}, badRequest("suspend without the memory: not an image sandbox, it has no disk of its own to boot again from")
		}
		return noBody{}, c.suspend(ctx, req.WithoutMemory, log)
	})
	opLimits.register(mux, func(_ context.Context, l ratelimit.Limits) (ratelimit.Limits, error) {
		if err := l.Check(); err != nil {
			return ratelimit.Limits{}, badRequest("bad limits: %v", err)
		}
		if err := c.sb.SetLimits(l); err != nil {
			return ratelimit.Limits{}, err
		}
		log.Info("supervisor: I/O limits set", "limits", l.String())
		return c.sb.Limits(), nil
	})
	opNetwork.register(mux, func(_ context.Context, req networkBody) (noBody, error) {
		if err := c.sb.SetNetworkPolicy(req.Policy); errors.Is(err, sandbox.ErrNoNAT) {
			return noBody{}, badRequest("%v", err)
		} else if err != nil {
			return noBody{}, err
		}
		log.Info("supervisor: network policy set", "policy", c.sb.NetworkPolicy().String())
		return noBody{}, nil
	})
	opHeaders.register(mux, func(_ context.Context, req headersBody) (noBody, error) {
		// Every failure is the rules': their checks, a host outside
		// the CA, no interception.
		if err := c.sb.SetHeaderRules(req.Rules); err != nil {
			return noBody{}, badRequest("%v", err)
		}
		log.Info("supervisor: header rules set", "rules", len(req.Rules))
		return noBody{}, nil
	})
	opEgress.register(mux, func(_ context.Context, req egressBody) (noBody, error) {
		// Every failure is the proxy's settings' or a sandbox without
		// capsa's NAT.
		if err := c.sb.SetEgressProxy(req.Proxy); err != nil {
			return noBody{}, badRequest("%v", err)
		}
		in := "none"
		if req.Proxy != nil {
			in = req.Proxy.String() // never the password
		}
		log.Info("supervisor: egress proxy set", "proxy", in)
		return noBody{}, nil
	})
	opTTL.register(mux, func(ctx context.Context, req ttlBody) (noBody, error) {
		if req.TTL < 0 {
			return noBody{}, badRequest("bad TTL request: negative TTL")
		}
		// The record is the caller's (Manager.SetTTL writes it first).
		select {
		case c.ttlc <- req.TTL:
			return noBody{}, nil
		case <-ctx.Done():
			return noBody{}, ctx.Err()
		case <-c.sb.Done():
			return noBody{}, &controlError{http.StatusConflict, errors.New("the sandbox has ended")}
		}
	})
	opStats.register(mux, func(context.Context, noBody) (sandbox.Stats, error) {
		st, err := c.sb.Stats()
		if err != nil {
			return sandbox.Stats{}, &controlError{http.StatusInternalServerError, err}
		}
		return *st, nil
	})
	return mux
}

// setState reports the live sandbox's state (running or paused).
func (c *control) setState(state store.State, log *slog.Logger) error {
	return c.rep.set(log, func(s *store.Status) {
		if s.State == store.Running || s.State == store.Paused {
			s.State = state
		}
	})
}

// report is the supervisor's status of its run (store.Status), which it
// writes whole at each change: the record's state, times and exit come
// from it (the supervisor cannot write the records themselves).
type report struct {
	mu   sync.Mutex
	st   *store.Store
	name string
	s    store.Status
}

// set changes the status with f and writes it.
func (r *report) set(log *slog.Logger, f func(*store.Status)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.s)
	err := r.st.WriteStatus(r.name, &r.s)
	if err != nil {
		log.Error("supervisor: record the status", "state", r.s.State, "err", err)
	}
	return err
}

// setPaused pauses or resumes the sandbox and records its state.
func (c *control) setPaused(ctx context.Context, pause bool, log *slog.Logger) error {
	c.pauseMu.Lock()
	defer c.pauseMu.Unlock()
	if c.suspending {
		return &controlError{http.StatusConflict, ErrBeingSuspended}
	}
	ctx, cancel := context.WithTimeout(ctx, pauseTimeout)
	defer cancel()
	op, state := "resume", store.Running
	var err error
	if pause {
		op, state = "pause", store.Paused
		err = c.sb.Pause(ctx)
	} else {
		err = c.sb.Resume(ctx)
	}
	if err == nil {
		err = c.setState(state, log)
	}
	if err != nil {
		log.Warn("supervisor: "+op, "err", err)
		return err
	}
	log.Info("supervisor: " + op + "d")
	return nil
}

// pauseTimeout bounds a pause: the devices finish the requests they hold
// within it, or the sandbox runs on and the pause fails.
const pauseTimeout = 30 * time.Second
