// Package supervisortest makes sandbox records in a state directory for
// the tests of the front ends (cmd/capsa, mcp), which reach sandboxes only
// through supervisor.Manager and never the store beneath it: a sandbox
// being created, or one that ended, as the manager then finds them,
// without booting one.
package supervisortest

import (
	"errors"
	"testing"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/store"
)

// Creating records a sandbox called name, of spec, being created in the
// state directory dir, as a launcher does before its VMM runs; the
// record's holder stays until the test ends.
func Creating(t testing.TB, dir, name string, spec sandbox.Spec) {
	t.Helper()
	lock := create(t, open(t, dir), name, spec)
	t.Cleanup(func() { lock.Close() })
}

// Exited records a sandbox called name, of spec, that ended with exit
// code code for reason, its holder gone.
func Exited(t testing.TB, dir, name string, spec sandbox.Spec, code int, reason string) {
	t.Helper()
	st := open(t, dir)
	lock := create(t, st, name, spec)
	defer lock.Close()
	err := st.Update(name, func(r *store.Record) error {
		r.State, r.ExitCode, r.Reason = store.Exited, &code, reason
		return nil
	})
	if err != nil {
		t.Fatalf("supervisortest: record %s as exited: %v", name, err)
	}
}

// create makes the record of a sandbox being created and holds it.
func create(t testing.TB, st *store.Store, name string, spec sandbox.Spec) *store.Lock {
	t.Helper()
	lock, err := st.Create(&store.Record{Name: name, Spec: spec})
	if err != nil {
		t.Fatalf("supervisortest: record %s: %v", name, err)
	}
	return lock
}

// Recorded reports whether dir holds a record called name.
func Recorded(t testing.TB, dir, name string) bool {
	t.Helper()
	_, err := open(t, dir).Get(name)
	switch {
	case err == nil:
		return true
	case errors.Is(err, store.ErrNotFound):
		return false
	}
	t.Fatalf("supervisortest: read record %s: %v", name, err)
	return false
}

func open(t testing.TB, dir string) *store.Store {
	t.Helper()
	st, err := store.Open(dir)
	if err != nil {
		t.Fatalf("supervisortest: open the state directory: %v", err)
	}
	return st
}
