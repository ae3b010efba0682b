package supervisor

import (
	"context"
	"io"
	"time"

	"github.com/capsa-sandbox/capsa/store"
)

// Manager owns the named sandboxes of one state directory: every
// operation on a named sandbox is one of its methods, and with package
// store beneath it, it alone knows the directory's layout (the records'
// database, sandboxes/NAME with its sockets and logs, snapshots/). Front
// ends (the CLI, the MCP server, and later the HTTP API and the
// containerd shim) are adapters over a Manager, as gVisor's runsc
// commands are over container.Container.
type Manager struct {
	st *store.Store
}

// The records a Manager keeps, and their states, as package store has
// them: front ends name them through this package.
type (
	Record = store.Record
	State  = store.State
)

// A sandbox's states.
const (
	Creating = store.Creating
	Created  = store.Created
	Running  = store.Running
	Paused   = store.Paused
	Exited   = store.Exited
	Crashed  = store.Crashed
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
// the new one it got) once the sandbox runs or says why it cannot.
func (m *Manager) Launch(ctx context.Context, rec *Record, secrets map[string]string) (string, error) {
	if len(secrets) == 0 {
		return Launch(ctx, m.st, rec)
	}
	return LaunchSecrets(ctx, m.st, rec, secrets)
}

// Open returns a handle to the running sandbox name.
func (m *Manager) Open(ctx context.Context, name string) (*Handle, error) {
	return Open(ctx, m.st, name)
}

// Stop ends the sandbox name: SIGTERM to its main process, SIGKILL after
// timeout (at once with kill), then the VM stops.
func (m *Manager) Stop(ctx context.Context, name string, timeout time.Duration, kill bool) error {
	return Stop(ctx, m.st, name, timeout, kill)
}

// Remove kills the sandbox name if it runs and removes its record and
// files.
func (m *Manager) Remove(ctx context.Context, name string) error { return Destroy(ctx, m.st, name) }

// Pause pauses the running sandbox name.
func (m *Manager) Pause(ctx context.Context, name string) error { return Pause(ctx, m.st, name) }

// Resume runs the paused sandbox name again.
func (m *Manager) Resume(ctx context.Context, name string) error { return Resume(ctx, m.st, name) }

// SaveSnapshot writes the running sandbox name to the state directory's
// snapshot snap ("": DefaultSnapshotName's) and returns snap.
func (m *Manager) SaveSnapshot(ctx context.Context, name, snap string) (string, error) {
	if snap == "" {
		snap = DefaultSnapshotName(name, time.Now())
	}
	return snap, SaveSnapshot(ctx, m.st, name, snap)
}

// Restore starts a sandbox named name ("": a new name) from the state
// directory's snapshot snap, its guest taking hostname ("": the
// snapshot's), with its secrets' values (nil: none); rm removes it when
// it ends. It returns the sandbox's name.
func (m *Manager) Restore(ctx context.Context, snap, name, hostname string, rm bool, secrets map[string]string) (string, error) {
	if err := CheckSnapshotName(snap); err != nil {
		return "", err
	}
	if name != "" {
		if err := CheckName(name); err != nil {
			return "", err
		}
	}
	rec, err := RestoreRecord(m.st.SnapshotDir(snap), name, hostname, rm)
	if err != nil {
		return "", err
	}
	return m.Launch(ctx, rec, secrets)
}

// Fork makes count running copies of the running sandbox name (see Fork).
func (m *Manager) Fork(ctx context.Context, name string, count int) ([]string, []error, error) {
	return Fork(ctx, m.st, name, count)
}

// Logs writes the sandbox name's log file (MainLog or ConsoleLog) to w:
// its last lines (all: negative), then more as it comes with follow.
func (m *Manager) Logs(ctx context.Context, name, file string, lines int, follow bool, w io.Writer) error {
	return Logs(ctx, m.st, name, file, lines, follow, w)
}
