package store

// A supervisor's report of its run. The VMM process that supervises a
// sandbox runs the guest's devices, so it is treated as possibly
// compromised: once confined it cannot open the records' database, which
// holds every sandbox's description (the host directories it shares, its
// jail user, its labels: the E2B API's access tokens). It writes what the
// record needs from it into one file in its own sandbox directory, and the
// store, read by the user's own processes, takes from that file only the
// fields a run reports, checked and bounded. Nothing a supervisor writes
// changes a record's description, another sandbox's record, or where a
// sandbox restores from.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/capsa-sandbox/capsa/confine"
	"github.com/capsa-sandbox/capsa/internal/strictjson"
)

// Run is the part of a record that its sandbox's run decides: where it
// is in its life, and what the guest and the host gave it when it
// started. A supervisor reports it (Status); only the store writes it
// into the record.
type Run struct {
	State   State     `json:"state"`
	Started time.Time `json:"started,omitzero"`
	Ended   time.Time `json:"ended,omitzero"`
	// ExitCode is the main process's exit code once it has one.
	ExitCode *int `json:"exit_code,omitempty"`
	// Reason says why the sandbox ended or crashed.
	Reason string `json:"reason,omitempty"`
	// Env and Dir are the defaults every exec gets (an image's): see
	// sandbox.Guest.Defaults.
	Env []string `json:"env,omitempty"`
	Dir string   `json:"dir,omitempty"`
	// Ports are the published ports with the host addresses they got.
	Ports []string `json:"ports,omitempty"`
	// Confinement is what the supervisor got (package confine).
	Confinement *confine.Layers `json:"confinement,omitempty"`
}

// Status is what a sandbox's supervisor reports of the run it supervises
// (Store.WriteStatus): its Run, whose State is Running, Paused, Exited or
// Suspended (to the sandbox's SuspendDir). The store lays it over the
// record while the supervisor holds the sandbox's lock, and folds it into
// the record once the supervisor has gone.
type Status struct {
	Run
	// TTLPassed: suspended because its TTL passed (Record.PauseAtTTL), so
	// the record keeps no TTL.
	TTLPassed bool `json:"ttl_passed,omitempty"`
}

// Bounds on a status file: it comes from a process that may be hostile.
const (
	maxStatusBytes = 1 << 20
	maxStatusList  = 4096 // entries of Env, and of Ports
	maxStatusText  = 16 << 10
)

// statusFile is the status's name in the sandbox's directory.
const statusFile = "status.json"

// suspendDir is where a suspended sandbox's snapshot is kept, in its
// directory.
const suspendDir = "suspended"

// SuspendDir is where the sandbox name's supervisor writes the snapshot it
// suspends to, and what a record that says Suspended restores from.
func (s *Store) SuspendDir(name string) string { return filepath.Join(s.SandboxDir(name), suspendDir) }

// WriteStatus replaces the status of name's run (its supervisor's
// report), whole: written beside and renamed, so a reader sees the old one
// or the new one. A reason longer than a status may hold is cut.
func (s *Store) WriteStatus(name string, st *Status) error {
	if len(st.Reason) > maxStatusText {
		cut := *st
		cut.Reason = strings.ToValidUTF8(st.Reason[:maxStatusText-len(" ...")], "") + " ..."
		st = &cut
	}
	if err := st.check(); err != nil {
		return fmt.Errorf("store: status of %s: %w", name, err)
	}
	b, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("store: status of %s: %w", name, err)
	}
	path := filepath.Join(s.SandboxDir(name), statusFile)
	tmp := path + ".new"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("store: status of %s: %w", name, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("store: status of %s: %w", name, err)
	}
	return nil
}

// errNoStatus: the supervisor has written no status yet.
var errNoStatus = errors.New("no status")

// readStatus reads the status name's supervisor wrote: errNoStatus if
// none, an error naming what is wrong if it is not a regular file of at
// most maxStatusBytes holding a valid Status and nothing else.
func (s *Store) readStatus(name string) (*Status, error) {
	path := filepath.Join(s.SandboxDir(name), statusFile)
	// Not followed, and not waited on: the file's writer may have made it
	// a link or a FIFO.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, errNoStatus
	}
	if err != nil {
		return nil, fmt.Errorf("its supervisor's status: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("its supervisor's status: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("its supervisor's status: %s is not a regular file (%s)", statusFile, fi.Mode().Type())
	}
	b, err := io.ReadAll(io.LimitReader(f, maxStatusBytes+1))
	if err != nil {
		return nil, fmt.Errorf("its supervisor's status: %w", err)
	}
	if len(b) > maxStatusBytes {
		return nil, fmt.Errorf("its supervisor's status: larger than %d bytes", maxStatusBytes)
	}
	var st Status
	if err := strictjson.Decode(b, &st); err != nil {
		return nil, fmt.Errorf("its supervisor's status: %w", err)
	}
	if err := st.check(); err != nil {
		return nil, fmt.Errorf("its supervisor's status: %w", err)
	}
	return &st, nil
}

// check refuses a status no supervisor should write.
func (st *Status) check() error {
	switch st.State {
	case Running, Paused, Exited, Suspended:
	default:
		return fmt.Errorf("state %q: a run is running, paused, exited or suspended", st.State)
	}
	if len(st.Env) > maxStatusList || len(st.Ports) > maxStatusList {
		return fmt.Errorf("%d environment variables and %d ports: at most %d each", len(st.Env), len(st.Ports), maxStatusList)
	}
	for _, s := range append([]string{st.Reason, st.Dir}, st.Ports...) {
		if len(s) > maxStatusText {
			return fmt.Errorf("a text of %d bytes: at most %d", len(s), maxStatusText)
		}
	}
	return nil
}

// overlay gives r what st reports of the run: its state, times, exit and
// what the guest and the published ports got. Nothing else of r changes;
// a suspension restores from the sandbox's own SuspendDir.
func (s *Store) overlay(r *Record, st *Status) {
	r.Run = st.Run
	if st.State == Suspended {
		r.RestoreFrom, r.PID = s.SuspendDir(r.Name), 0
		if st.TTLPassed {
			r.TTL = 0
		}
	}
}

// removeStatus removes name's status (a run's that was folded into its
// record, or one left by an earlier run); the caller holds name's lock.
func (s *Store) removeStatus(name string) {
	p := filepath.Join(s.SandboxDir(name), statusFile)
	os.RemoveAll(p) // what a hostile supervisor left there, whatever it is
	os.RemoveAll(p + ".new")
}
