package supervisor

// A detached sandbox's secrets and the audit log of its intercepted
// requests. A secret's value is in no record, Spec or snapshot: the
// command that starts the sandbox writes the values to SecretsFile in the
// sandbox's directory (0600, in a state directory that is 0700), where
// its supervisor reads them (and `capsa start` and fork find them again);
// it goes with the sandbox's directory at rm.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/store"
)

// Files in a sandbox's directory.
const (
	// SecretsFile holds the values of the sandbox's secrets by name (JSON).
	SecretsFile = "secrets.json"
	// NetLog is the sandbox's egress audit log, JSON lines (netstack.Flow
	// and tlsproxy.Record, told apart by "kind"), bounded like the other
	// logs.
	NetLog = "net.log"
)

// maxSecretsFile bounds what readSecrets reads.
const maxSecretsFile = 1 << 20

// writeSecrets keeps the values of the recorded sandbox name's secrets
// for its supervisor, in SecretsFile (0600). For none, nothing is written
// and a file kept before goes.
func writeSecrets(st *store.Store, name string, values map[string]string) error {
	if len(values) == 0 {
		err := os.Remove(filepath.Join(st.SandboxDir(name), SecretsFile))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("supervisor: secrets of %s: %w", name, err)
		}
		return nil
	}
	b, err := json.Marshal(values)
	if err != nil {
		return fmt.Errorf("supervisor: secrets of %s: %w", name, err)
	}
	// Beside, then renamed over: a reader (a supervisor starting) never
	// sees half a file, and a failed write leaves the last one whole.
	dir := st.SandboxDir(name)
	f, err := os.CreateTemp(dir, "."+SecretsFile+".tmp-") // 0600
	if err != nil {
		return fmt.Errorf("supervisor: secrets of %s: %w", name, err)
	}
	defer os.Remove(f.Name())
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), filepath.Join(dir, SecretsFile))
	}
	if err != nil {
		return fmt.Errorf("supervisor: secrets of %s: %w", name, err)
	}
	return nil
}

// readSecrets reads what writeSecrets kept for name (nil if nothing).
func readSecrets(st *store.Store, name string) (map[string]string, error) {
	f, err := os.Open(filepath.Join(st.SandboxDir(name), SecretsFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("supervisor: secrets of %s: %w", name, err)
	}
	defer f.Close()
	var values map[string]string
	if err := json.NewDecoder(io.LimitReader(f, maxSecretsFile)).Decode(&values); err != nil {
		return nil, fmt.Errorf("supervisor: secrets of %s: %w", name, err)
	}
	return values, nil
}

// launch records rec (create, with the values of its secrets, nil for
// none) and starts it (spawn), returning its name: rec.Name, or the new
// one it got; "" with an error where nothing was recorded (a name that is
// taken is another's).
func launch(ctx context.Context, st *store.Store, rec *store.Record, values map[string]string) (string, error) {
	lock, left, err := create(st, rec, values)
	if err != nil {
		return left, err
	}
	return rec.Name, spawn(ctx, st, rec.Name, lock)
}

// create records rec (record) and keeps the values of its secrets (nil:
// none) for its supervisor (writeSecrets), and returns the sandbox's lock.
// If they cannot be kept, the record says so and has ended, and its name
// is left, beside the error; where nothing was recorded, left is "".
func create(st *store.Store, rec *store.Record, values map[string]string) (lock *store.Lock, left string, err error) {
	if lock, err = record(st, rec); err != nil {
		return nil, "", err
	}
	if err := writeSecrets(st, rec.Name, values); err != nil {
		st.Update(rec.Name, func(r *store.Record) error { r.State, r.Reason = store.Exited, err.Error(); return nil })
		lock.Close()
		return nil, rec.Name, err
	}
	return lock, "", nil
}

// hasNetwork reports whether a sandbox of spec has a network, and so an
// egress audit log.
func hasNetwork(spec sandbox.Spec) bool { return spec.Network != nil }

// openNetLog opens the egress audit log of a sandbox of spec in dir, if
// it has a network (nil otherwise).
func openNetLog(dir string, spec sandbox.Spec, limit int64) (*rotatingLog, error) {
	if !hasNetwork(spec) {
		return nil, nil
	}
	return newRotatingLog(filepath.Join(dir, NetLog), limit)
}

// netLogs writes the egress audit log of the detached sandbox name to w,
// as Logs does for its other logs.
func netLogs(ctx context.Context, st *store.Store, name string, lines int, follow bool, w io.Writer) error {
	rec, err := st.Get(name)
	if err != nil {
		return err
	}
	if !hasNetwork(rec.Spec) {
		return fmt.Errorf("supervisor: %s has no network (it was started without --net): no network audit log", name)
	}
	return logs(ctx, st, name, NetLog, lines, follow, w)
}
