package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/ratelimit"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/store"
	"github.com/capsa-sandbox/capsa/volume"
)

// Manager owns the named sandboxes of one state directory: every
// operation on a named sandbox is one of its methods, and with package
// store beneath it, it alone knows the directory's layout (the records'
// database, sandboxes/NAME with its sockets and logs, snapshots/). Front
// ends (the CLI, the MCP server, and later the HTTP API and the
// containerd shim) are adapters over a Manager, as gVisor's runsc
// commands are over container.Container.
type Manager struct {
	st    *store.Store
	stats statsHandles // Stats's
}

// The records a Manager keeps, and their states, as package store has
// them: front ends name them through this package.
type (
	Record = store.Record
	State  = store.State
)

// A sandbox's states.
const (
	Creating  = store.Creating
	Created   = store.Created
	Running   = store.Running
	Paused    = store.Paused
	Suspended = store.Suspended
	Exited    = store.Exited
	Crashed   = store.Crashed
)

// Errors a Manager's methods wrap.
var (
	ErrNotFound = store.ErrNotFound
	ErrExists   = store.ErrExists
)

// OpenManager opens the state directory dir ("": the default, $CAPSA_STATE
// or the user's state directory), making it if it is missing.
func OpenManager(dir string) (*Manager, error) {
	if dir == "" {
		var err error
		if dir, err = store.DefaultDir(); err != nil {
			return nil, err
		}
	}
	st, err := store.Open(dir)
	if err != nil {
		return nil, err
	}
	return &Manager{st: st}, nil
}

// Dir is the state directory.
func (m *Manager) Dir() string { return m.st.Dir() }

// Volumes are the state directory's named volumes.
func (m *Manager) Volumes() (*volume.Root, error) { return volume.Open(volume.DirIn(m.st.Dir())) }

// CheckName refuses a sandbox name that is not a plain name.
func CheckName(name string) error { return store.CheckName(name) }

// CheckSnapshotName refuses a snapshot name that is not a plain name.
func CheckSnapshotName(name string) error { return store.CheckSnapshotName(name) }

// Get returns the record of the sandbox name.
func (m *Manager) Get(name string) (*Record, error) { return m.st.Get(name) }

// List returns every sandbox's record.
func (m *Manager) List() ([]*Record, error) { return m.st.List() }

// Launch records rec and starts its supervisor, keeping the values of its
// secrets (nil: none) for it; it returns the sandbox's name (rec.Name, or
// the new one it got; "" with an error where nothing was recorded) once
// the sandbox runs or says why it cannot.
func (m *Manager) Launch(ctx context.Context, rec *Record, secrets map[string]string) (string, error) {
	return launch(ctx, m.st, rec, secrets)
}

// Open returns a handle to the running sandbox name.
func (m *Manager) Open(ctx context.Context, name string) (*Handle, error) {
	return openHandle(ctx, m.st, name)
}

// Stop ends the sandbox name: SIGTERM to its main process, SIGKILL after
// timeout (at once with kill), then the VM stops.
func (m *Manager) Stop(ctx context.Context, name string, timeout time.Duration, kill bool) error {
	return stopSandbox(ctx, m.st, name, timeout, kill)
}

// Remove kills the sandbox name if it runs and removes its record and
// files.
func (m *Manager) Remove(ctx context.Context, name string) error { return destroy(ctx, m.st, name) }

// Pause pauses the running sandbox name.
func (m *Manager) Pause(ctx context.Context, name string) error { return pauseSandbox(ctx, m.st, name) }

// Resume runs the paused sandbox name again; a suspended one is restored
// from its snapshot (its supervisor starts again, and Resume returns once
// the sandbox runs), and the snapshot goes.
func (m *Manager) Resume(ctx context.Context, name string) error {
	return m.resume(ctx, name, false)
}

// ResumeCold runs the paused image sandbox name again from its disk, not
// its memory: booted afresh with its writable root disk as its suspension
// left it, its main process started again (sandbox.Reboot); then the
// snapshot goes. One paused in memory is suspended first (one being
// suspended, at its timeout say, is waited for). A sandbox not of an
// image, or not paused, is refused.
func (m *Manager) ResumeCold(ctx context.Context, name string) error {
	return m.resume(ctx, name, true)
}

func (m *Manager) resume(ctx context.Context, name string, cold bool) error {
	rec, err := m.st.Get(name)
	if err != nil {
		return err
	}
	if cold && rec.Spec.Image == nil {
		return fmt.Errorf("supervisor: resume %s without its memory: it is not an image sandbox, and has no disk of its own to boot from", name)
	}
	if cold && rec.State != Suspended {
		if rec.State != Paused {
			return fmt.Errorf("supervisor: resume %s without its memory: it is %s, not paused", name, rec.State)
		}
		// It runs on first, so that its suspension syncs its disk.
		// Being suspended already, or suspended since it was read, it
		// refuses both: what counts is how it ends up.
		resumeSandbox(ctx, m.st, name)
		serr := m.SuspendWithoutMemory(ctx, name)
		if err := m.st.WaitUnlocked(ctx, name); err != nil {
			return fmt.Errorf("supervisor: resume %s without its memory: %w", name, err)
		}
		if rec, err = m.st.Get(name); err != nil {
			return err
		}
		if rec.State != Suspended {
			if serr != nil {
				return fmt.Errorf("supervisor: resume %s without its memory: %w", name, serr)
			}
			return fmt.Errorf("supervisor: resume %s without its memory: it ended instead of being suspended (%s)", name, describeEnd(rec))
		}
	}
	if rec.State != Suspended {
		err := resumeSandbox(ctx, m.st, name)
		if err == nil {
			return nil
		}
		// Its suspension was under way: restore it once it is done (its
		// supervisor records it, then exits). One that has just ended
		// suspended is restored too.
		if errors.Is(err, ErrBeingSuspended) {
			if werr := m.st.WaitUnlocked(ctx, name); werr != nil {
				return werr
			}
		}
		cur, gerr := m.st.Get(name)
		switch {
		case gerr != nil:
			return err
		case cur.State != Suspended && errors.Is(err, ErrBeingSuspended):
			return fmt.Errorf("supervisor: resume %s: it ended instead of being suspended (%s)", name, describeEnd(cur))
		case cur.State != Suspended:
			return err
		}
		rec = cur
	}
	// The supervisor that suspended it may still be on its way out.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err = m.st.WaitUnlocked(wctx, name)
	cancel()
	if err != nil {
		return fmt.Errorf("supervisor: resume %s: %w", name, err)
	}
	// How it starts is its record's to say, set with its start (under
	// its lock: a second resume at once is refused, not mixed in).
	lock, err := m.st.Start(name, func(r *Record) { r.Reboot = cold })
	if err != nil {
		return fmt.Errorf("supervisor: resume %s: %w", name, err)
	}
	if err := spawn(ctx, m.st, name, lock); err != nil {
		return fmt.Errorf("supervisor: resume %s from disk: %w", name, err)
	}
	// The restored VM maps the snapshot's memory copy-on-write and has its
	// own copy of the root disk: the files can go (the mapping keeps what
	// it reads until the VM ends).
	dir := rec.RestoreFrom
	if err := m.st.Update(name, func(r *Record) error {
		if r.RestoreFrom == dir {
			r.RestoreFrom, r.Reboot = "", false
		}
		return nil
	}); err != nil {
		return fmt.Errorf("supervisor: resume %s: %w", name, err)
	}
	if filepath.Dir(dir) == m.st.SandboxDir(name) {
		os.RemoveAll(dir)
	}
	return nil
}

// Suspend writes the whole running or paused sandbox name to disk and
// ends its VM, so that it holds no memory; Resume restores it, processes,
// memory and all. Its record says Suspended once Suspend returns. A
// sandbox that cannot be snapshotted (one with disks) is refused and runs
// on as it was.
func (m *Manager) Suspend(ctx context.Context, name string) error {
	return m.suspend(ctx, name, false)
}

// SuspendWithoutMemory is Suspend keeping an image sandbox's disk alone,
// after the guest synced it: no memory is written, and its resume boots
// it again from the disk (as ResumeCold does), its main process started
// afresh; what ran is lost, as after a power cut. E2B calls it a pause
// without memory. A sandbox not of an image is refused.
func (m *Manager) SuspendWithoutMemory(ctx context.Context, name string) error {
	return m.suspend(ctx, name, true)
}

// SuspendedWithoutMemory says whether the sandbox name is suspended with
// its disk alone (SuspendWithoutMemory): its resume boots it again.
func (m *Manager) SuspendedWithoutMemory(name string) bool {
	rec, err := m.st.Get(name)
	if err != nil || rec.State != Suspended {
		return false
	}
	dir := rec.RestoreFrom
	if dir == "" {
		dir = m.st.SuspendDir(name)
	}
	return diskOnly(dir)
}

// diskOnly says whether the snapshot in dir holds a sandbox's disk alone
// (snapshot.Manifest.DiskOnly): a start from it boots; false if it cannot
// be read.
func diskOnly(dir string) bool {
	m, _, err := snapshot.ReadManifest(dir)
	return err == nil && m.DiskOnly
}

func (m *Manager) suspend(ctx context.Context, name string, withoutMemory bool) error {
	if err := callLive(ctx, m.st, name, opSuspend, suspendBody{WithoutMemory: withoutMemory}); err != nil {
		return err
	}
	// Its supervisor records the suspension, then exits.
	if err := m.st.WaitUnlocked(ctx, name); err != nil {
		return err
	}
	rec, err := m.st.Get(name)
	if err != nil {
		return err
	}
	if rec.State != Suspended {
		return fmt.Errorf("supervisor: suspend %s: it ended instead (%s)", name, describeEnd(rec))
	}
	return nil
}

// SaveSnapshot writes the running sandbox name to the state directory's
// snapshot snap ("": DefaultSnapshotName's), as a layer over the snapshot
// parent if that is not empty, and returns snap. Its steps go to
// progress, when not nil, as the supervisor reports them
// (sandbox.SnapshotOptions.Progress).
func (m *Manager) SaveSnapshot(ctx context.Context, name, snap, parent string, progress func(sandbox.Progress)) (string, error) {
	if snap == "" {
		snap = DefaultSnapshotName(name, time.Now())
	}
	return snap, saveSnapshot(ctx, m.st, name, snap, parent, progress)
}

// Restore starts a sandbox named name ("": a new name) from the state
// directory's snapshot snap, as RestoreDir does.
func (m *Manager) Restore(ctx context.Context, snap, name, hostname string, rm bool, settings *sandbox.Spec, secrets map[string]string) (string, error) {
	dir, err := m.SnapshotDir(snap, false)
	if err != nil {
		return "", err
	}
	return m.RestoreDir(ctx, dir, name, hostname, rm, settings, secrets)
}

// Fork makes count running copies of the running sandbox name (see fork),
// reporting its steps to progress when that is not nil: the snapshot's,
// then how many of the copies have done starting, started or failed
// (sandbox.StepStartCopies).
func (m *Manager) Fork(ctx context.Context, name string, count int, progress func(sandbox.Progress)) ([]string, []error, error) {
	return fork(ctx, m.st, name, count, progress)
}

// Logs writes the sandbox name's log file (MainLog or ConsoleLog) to w:
// its last lines (all: negative), then more as it comes with follow.
func (m *Manager) Logs(ctx context.Context, name, file string, lines int, follow bool, w io.Writer) error {
	if _, err := m.st.Get(name); err != nil {
		return err
	}
	return logs(ctx, m.st, name, file, lines, follow, w)
}

// Create records rec without starting it (state Created, for Start),
// keeping its secrets' values (nil: none), and returns its name (rec.Name,
// or the new one it got; "" with an error where nothing was recorded).
func (m *Manager) Create(rec *Record, secrets map[string]string) (string, error) {
	lock, left, err := create(m.st, rec, secrets)
	if err != nil {
		return left, err
	}
	defer lock.Close()
	return rec.Name, m.st.Update(rec.Name, func(r *store.Record) error { r.State = store.Created; return nil })
}

// Start starts the sandbox name that Create recorded, and waits until it
// runs or says why it cannot; only a created sandbox starts (and a
// suspended one, which Resume restores).
func (m *Manager) Start(ctx context.Context, name string) error {
	if rec, err := m.st.Get(name); err == nil && rec.State == Suspended {
		return m.Resume(ctx, name)
	}
	lock, err := m.st.Start(name)
	if err != nil {
		return err
	}
	return spawn(ctx, m.st, name, lock)
}

// Supervise is the life of the supervisor process of the sandbox name
// (Run): lock and ready are the files spawn handed it (LockFD, ReadyFD);
// it writes "ok" on ready once the sandbox runs, or why it could not. The
// lock goes with the process. The supervisor reports its run in a status
// file (store.Status): it cannot write the records.
func (m *Manager) Supervise(ctx context.Context, name string, lock, ready *os.File, log *slog.Logger) error {
	defer lock.Close() // held until here, not left to the file's finalizer
	err := Run(ctx, Options{Store: m.st, Name: name, Log: log, Ready: func(err error) {
		if err != nil {
			fmt.Fprintln(ready, err)
		} else {
			fmt.Fprintln(ready, "ok")
		}
		ready.Close()
	}})
	if err != nil {
		log.Error("supervisor", "err", err)
	}
	return err
}

// UpdateLimits changes the sandbox name's I/O limits by spec, written as
// `capsa run --limit` takes them (ratelimit.ParseLimits), on top of those
// it has: at once if it runs, and in its record for its next start. It
// returns the limits it has now, as ratelimit.Limits.String writes them.
func (m *Manager) UpdateLimits(ctx context.Context, name, spec string) (string, error) {
	rec, err := m.st.Get(name)
	if err != nil {
		return "", err
	}
	l, err := ratelimit.ParseLimits(spec, rec.Spec.Limits)
	if err != nil {
		return "", fmt.Errorf("supervisor: update %s: %w", name, err)
	}
	if rec.Alive() {
		if err := setLimits(ctx, m.st, name, l); err != nil {
			return "", err
		}
	}
	if err := m.st.Update(name, func(r *Record) error { r.Spec.Limits = l; return nil }); err != nil {
		return "", fmt.Errorf("supervisor: update %s: %w", name, err)
	}
	return l.String(), nil
}

// SetNetworkPolicy puts p (nil: public-only) in force on the sandbox
// name's NAT: at once if it runs (for every new connection and DNS query;
// those under way go on), and in its record for its next start (a start,
// a resume from disk). A sandbox made without capsa's NAT (no network, or
// a tap) is refused: sandbox.ErrNoNAT.
func (m *Manager) SetNetworkPolicy(ctx context.Context, name string, p *netstack.Policy) error {
	return m.withSettings(ctx, name, func() error { return m.setNetworkPolicy(ctx, name, p) })
}

// setNetworkPolicy is SetNetworkPolicy with the settings lock held
// (withSettings): no other change of the sandbox's network comes between
// its record and the running sandbox.
func (m *Manager) setNetworkPolicy(ctx context.Context, name string, p *netstack.Policy) error {
	rec, err := m.st.Get(name)
	if err != nil {
		return err
	}
	if n := rec.Spec.Network; n == nil || n.Tap != nil {
		return fmt.Errorf("supervisor: set the network policy of %s: %w", name, sandbox.ErrNoNAT)
	}
	if p == nil {
		p = netstack.PublicOnly()
	}
	// The record first: a start or resume that reads it from now on
	// gets the new policy; the sandbox, if it runs now, after.
	err = m.st.Update(name, func(r *Record) error {
		if r.Spec.Network == nil {
			return sandbox.ErrNoNAT
		}
		r.Spec.Network.Policy = p
		return nil
	})
	if err != nil {
		return fmt.Errorf("supervisor: set the network policy of %s: %w", name, err)
	}
	if rec, err = m.st.Get(name); err == nil && rec.Alive() {
		err = sendNetworkPolicy(ctx, m.st, name, p)
	}
	return err
}

// SetTTL gives the sandbox name a new TTL, counted from its start (0:
// none): a running sandbox ends when it passes (at once if it has), and
// the record keeps it.
func (m *Manager) SetTTL(ctx context.Context, name string, ttl time.Duration) error {
	if ttl < 0 {
		return fmt.Errorf("supervisor: set the TTL of %s: negative TTL %v", name, ttl)
	}
	rec, err := m.st.Get(name)
	if err != nil {
		return err
	}
	// The record first: a supervisor that restarts the timer has the
	// record agree with it.
	if err := m.st.Update(name, func(r *Record) error { r.TTL = ttl; return nil }); err != nil {
		return err
	}
	if rec.Alive() {
		return callLive(ctx, m.st, name, opTTL, ttlBody{TTL: ttl})
	}
	return nil
}

// SetLabels changes the labels of the sandbox name's record (Record.Labels)
// with set, which is given the record's labels (a map it may change) and
// returns an error to change nothing.
func (m *Manager) SetLabels(name string, set func(map[string]string) error) error {
	return m.st.Update(name, func(r *Record) error {
		if r.Labels == nil {
			r.Labels = map[string]string{}
		}
		return set(r.Labels)
	})
}

// NetLogs writes the sandbox name's egress audit log (its DNS queries,
// flows and intercepted requests) to w, as Logs does.
func (m *Manager) NetLogs(ctx context.Context, name string, lines int, follow bool, w io.Writer) error {
	if _, err := m.st.Get(name); err != nil {
		return err
	}
	return netLogs(ctx, m.st, name, lines, follow, w)
}

// DefaultDir is the default state directory: $CAPSA_STATE, else the
// user's state directory's capsa.
func DefaultDir() (string, error) { return store.DefaultDir() }
