// Package store records detached sandboxes: each one's name, description
// (sandbox.Spec), state, supervisor and exit. Its starting point is Open;
// Store.Create reserves a name and Store.Get and Store.List read records
// with their liveness checked.
//
// The state directory holds
//
//	state.db              the records (bbolt), opened per operation
//	sandboxes/NAME/       one sandbox's runtime files (0700):
//	    lock              held (flock) by its supervisor while it lives
//	    status.json       its supervisor's report of the run (Status)
//	    suspended/        the snapshot a suspension wrote (SuspendDir)
//	    agent.sock        the guest agent, hybrid-vsock style
//	    control.sock      the supervisor's control API
//	    main.log ...      the main process's output, bounded
//
// A supervisor holds its sandbox's lock for its whole life, so a record
// that says running while nobody holds the lock belongs to a supervisor
// that died (killed, or the host rebooted): reading it reports it crashed.
// Only the user's own processes write the records; a supervisor, confined,
// reports its run in its status file, of which the store takes only what
// a run reports (status.go).
// The directory and the sockets are the user's alone (0700, 0600): another
// local user gets a permission error, not a sandbox.
package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"time"

	"github.com/capsa-sandbox/capsa/confine"
	"github.com/capsa-sandbox/capsa/internal/statedir"
	"github.com/capsa-sandbox/capsa/sandbox"
	bolt "go.etcd.io/bbolt"
)

// State is where a sandbox is in its life.
type State string

const (
	Created  State = "created"  // recorded by capsa create, never started
	Creating State = "creating" // its supervisor is booting it
	Running  State = "running"
	Paused   State = "paused" // running, its guest stopped until resumed
	// Suspended: its whole state is on disk (RestoreFrom) and its VM is
	// gone, so it holds no memory; a resume restores it (Store.Start).
	Suspended State = "suspended"
	Exited    State = "exited"  // stopped, or its main process ended
	Crashed   State = "crashed" // its supervisor died without recording an end
)

// Record is what the store keeps of a sandbox.
type Record struct {
	Name    string       `json:"name"`
	ID      string       `json:"id"`
	Spec    sandbox.Spec `json:"spec"`
	PID     int          `json:"pid,omitempty"` // the supervisor's
	Created time.Time    `json:"created"`
	// Run is where its life is: the part its supervisor reports (Status).
	Run
	// TTL stops the sandbox this long after it started; IdleTimeout this
	// long after the last exec or copy. 0: never.
	TTL         time.Duration `json:"ttl_ns,omitempty"`
	IdleTimeout time.Duration `json:"idle_timeout_ns,omitempty"`
	// PauseAtTTL: when the TTL passes the sandbox is paused, not stopped
	// (a resume runs it on, without a TTL until one is set).
	PauseAtTTL bool `json:"pause_at_ttl,omitempty"`
	// PauseWithoutMemory: that pause of an image sandbox keeps its disk
	// alone, as Manager.SuspendWithoutMemory does; its resume boots it.
	PauseWithoutMemory bool `json:"pause_without_memory,omitempty"`
	// AutoRemove: the record goes when the sandbox ends (--rm).
	AutoRemove bool `json:"auto_remove,omitempty"`
	// RestoreFrom, when set, is the snapshot directory the sandbox starts
	// from instead of booting (capsa snapshot restore, capsa fork), and
	// Hostname the name its guest then takes ("": the snapshot's).
	RestoreFrom string `json:"restore_from,omitempty"`
	// Reboot: the sandbox starts from RestoreFrom's files, booted afresh
	// with its writable root disk, not from its memory (sandbox.Reboot;
	// Manager.ResumeCold).
	Reboot bool `json:"reboot,omitempty"`
	// NoConfine: the supervisor does not confine itself (run
	// --no-confine); Run.Confinement is what it got.
	NoConfine bool `json:"no_confine,omitempty"`
	// JailUser is the user and group the supervisor, jailed, drops to
	// before the guest runs (run --jail-user; root only). nil: it stays
	// root.
	JailUser *confine.User `json:"jail_user,omitempty"`
	// HostMounts: the host mounts on the sandbox's shares while it runs
	// (a containerd pod's container roots, on a directory it made a
	// shared mount), so its supervisor's jail follows the host's mounts
	// beneath them (confine.JailConfig.Follow).
	HostMounts bool   `json:"host_mounts,omitempty"`
	Hostname   string `json:"hostname,omitempty"`
	// Labels are a front end's own notes on the sandbox (the E2B API's
	// template, metadata and access token), kept with its record and
	// gone with it; capsa itself reads none of them.
	Labels map[string]string `json:"labels,omitempty"`
}

// Alive reports whether the sandbox's supervisor may still be running.
func (r *Record) Alive() bool { return r.State == Creating || r.State == Running || r.State == Paused }

// Live reports whether the sandbox has not ended: alive, or suspended to
// disk (what ps lists without -a).
func (r *Record) Live() bool { return r.Alive() || r.State == Suspended }

var (
	// ErrNotFound is returned for a name with no record.
	ErrNotFound = errors.New("no such sandbox")
	// ErrExists is returned when a name is taken.
	ErrExists = errors.New("a sandbox with that name exists")
)

// Store is the state directory. Several processes may use it at once:
// bbolt serializes their transactions.
type Store struct {
	dir string
}

// CheckName refuses a name that cannot be a sandbox's (it names a
// directory and appears in socket paths): statedir.ValidName's rule.
func CheckName(name string) error {
	if !statedir.ValidName(name) {
		return fmt.Errorf("store: sandbox name %q: want %s", name, statedir.NameRule)
	}
	return nil
}

// DefaultDir is the CLI's state directory: $CAPSA_STATE, else
// $XDG_STATE_HOME/capsa, else ~/.local/state/capsa (statedir.Default).
func DefaultDir() (string, error) {
	d, err := statedir.Default()
	if err != nil {
		return "", fmt.Errorf("store: %w", err)
	}
	return d, nil
}

// Open returns the store in dir, making it (0700) if needed.
func Open(dir string) (*Store, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("store: open %s: %w", dir, err)
	}
	if err := os.MkdirAll(filepath.Join(abs, "sandboxes"), 0o700); err != nil {
		return nil, fmt.Errorf("store: open %s: %w", dir, err)
	}
	return &Store{dir: abs}, nil
}

// SnapshotDir is where the CLI keeps the snapshot called name.
func (s *Store) SnapshotDir(name string) string { return filepath.Join(s.SnapshotsDir(), name) }

// ForkDir is the running sandbox name's fork chain's directory (its fork
// snapshots: sandbox.SnapshotOptions.Fork), hidden among the snapshots,
// where its copies' supervisors may read it. Remove removes it.
func (s *Store) ForkDir(name string) string { return filepath.Join(s.SnapshotsDir(), ".fork-"+name) }

// SnapshotsDir holds the CLI's named snapshots, one directory each.
func (s *Store) SnapshotsDir() string { return filepath.Join(s.dir, snapshotsDir) }

// dbPath is the records' database file.
func (s *Store) dbPath() string { return filepath.Join(s.dir, dbFile) }

// The state directory's layout: only this package names its entries.
const (
	snapshotsDir = "snapshots"
	dbFile       = "state.db"
)

// CheckSnapshotName refuses a snapshot name that is not a plain name (the
// same rule as a sandbox's).
func CheckSnapshotName(name string) error {
	if !statedir.ValidName(name) {
		return fmt.Errorf("store: snapshot name %q: want %s", name, statedir.NameRule)
	}
	return nil
}

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

// SandboxDir is where name's runtime files live.
func (s *Store) SandboxDir(name string) string { return filepath.Join(s.dir, sandboxesDir, name) }

// sandboxesDir holds one directory per sandbox in the state directory.
const sandboxesDir = "sandboxes"

var bucket = []byte("sandboxes") // name -> Record (JSON)

func (s *Store) db(write bool, fn func(b *bolt.Bucket) error) error {
	db, err := bolt.Open(s.dbPath(), 0o600, &bolt.Options{Timeout: 30 * time.Second})
	if err != nil {
		return fmt.Errorf("store: open %s: %w", dbFile, err)
	}
	defer db.Close()
	if write {
		return db.Update(func(tx *bolt.Tx) error {
			b, err := tx.CreateBucketIfNotExists(bucket)
			if err != nil {
				return err
			}
			return fn(b)
		})
	}
	return db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucket)
		if b == nil {
			return fn(nil)
		}
		return fn(b)
	})
}

func get(b *bolt.Bucket, name string) (*Record, error) {
	var v []byte
	if b != nil {
		v = b.Get([]byte(name))
	}
	if v == nil {
		return nil, fmt.Errorf("store: %s: %w", name, ErrNotFound)
	}
	var r Record
	if err := json.Unmarshal(v, &r); err != nil {
		return nil, fmt.Errorf("store: record of %s: %w", name, err)
	}
	return &r, nil
}

func put(b *bolt.Bucket, r *Record) error {
	v, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("store: record of %s: %w", r.Name, err)
	}
	return b.Put([]byte(r.Name), v)
}

// NewName makes a name no record has: "sb-" and six hex digits.
func (s *Store) NewName() (string, error) {
	for range 100 {
		var b [3]byte
		rand.Read(b[:])
		name := "sb-" + hex.EncodeToString(b[:])
		if _, err := s.Get(name); errors.Is(err, ErrNotFound) {
			return name, nil
		}
	}
	return "", errors.New("store: no free sandbox name")
}

// Lock is a sandbox's liveness lock: whoever holds it is its supervisor.
type Lock struct{ f *os.File }

// File is the lock's open file, for handing it to a child process (the
// lock goes with the open file, not the process).
func (l *Lock) File() *os.File { return l.f }

// Close releases the lock (if no other process holds the file open).
func (l *Lock) Close() error { return l.f.Close() }

// lock takes name's lock without waiting: an error wrapping ErrExists
// means a live supervisor holds it.
func (s *Store) lock(name string) (*Lock, error) {
	dir := s.SandboxDir(name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("store: %s: %w", name, err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDWR|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("store: %s: lock: %w", name, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("store: %s: %w (its supervisor runs)", name, ErrExists)
		}
		return nil, fmt.Errorf("store: %s: lock: %w", name, err)
	}
	return &Lock{f}, nil
}

// WaitUnlocked waits until nobody holds name's lock (its supervisor has
// exited), or ctx ends.
func (s *Store) WaitUnlocked(ctx context.Context, name string) error {
	for {
		l, err := s.lock(name)
		if err == nil {
			l.Close()
			return nil
		}
		if !errors.Is(err, ErrExists) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("store: %s: its supervisor still runs: %w", name, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// SettingsLock takes name's settings lock, waiting for another holder
// until ctx ends: whoever changes a sandbox's network settings (its
// record's policy, proxy and header rules, and the secrets kept with
// them) holds it from reading them to writing them, and, for a running
// sandbox, across handing the change to its supervisor, so that two front
// ends changing one sandbox at once (a CLI and capsa serve, say) neither
// lose an update nor leave the sandbox running one setting while its
// record says the other. It is a flock of the sandbox's directory itself,
// which adds no file there (a file made while capsa rm empties the
// directory would keep it from going); the liveness lock, which a
// supervisor holds for its whole run, is its "lock" file. flock excludes
// across goroutines too, each opening the directory anew. Never wait for
// the liveness lock while holding it.
func (s *Store) SettingsLock(ctx context.Context, name string) (*Lock, error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	if _, err := s.getRaw(name); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(s.SandboxDir(name), os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("store: %s: settings lock: %w", name, err)
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return &Lock{f}, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("store: %s: settings lock: %w", name, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("store: %s: waiting for another change of its settings to end: %w", name, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// RemoveStale removes the directories of sandboxes that have no record,
// were last changed more than age ago and whose lock nobody holds (taken
// while the directory goes, as Remove does). Errors are skipped: it is
// tidying, and the next call tries again.
func (s *Store) RemoveStale(age time.Duration) {
	recs, err := s.List()
	if err != nil {
		return
	}
	recorded := map[string]bool{}
	for _, r := range recs {
		recorded[r.Name] = true
	}
	ents, _ := os.ReadDir(filepath.Join(s.dir, sandboxesDir))
	for _, e := range ents {
		name := e.Name()
		fi, err := e.Info()
		if err != nil || recorded[name] || !fi.IsDir() || time.Since(fi.ModTime()) < age || CheckName(name) != nil {
			continue
		}
		if l, err := s.lock(name); err == nil {
			os.RemoveAll(s.SandboxDir(name))
			l.Close()
		}
	}
}

// Create records a new sandbox in state Creating and returns its lock,
// which the caller hands to the supervisor. The name must be free: no
// record of it, running or ended (remove it first), and nobody holding
// its lock.
func (s *Store) Create(r *Record) (*Lock, error) {
	if err := CheckName(r.Name); err != nil {
		return nil, err
	}
	l, err := s.lock(r.Name)
	if err != nil {
		return nil, err
	}
	// A sandbox of this name that has ended since its record was last
	// read is folded in first: removed, if it asked to be.
	if _, err := s.settle(r.Name); errors.Is(err, errAutoRemoved) {
		// Its directory went, and the lock file with it: lock anew.
		l.Close()
		if l, err = s.lock(r.Name); err != nil {
			return nil, err
		}
	} else if err != nil && !errors.Is(err, ErrNotFound) {
		l.Close()
		return nil, err
	}
	var idb [8]byte
	rand.Read(idb[:])
	r.ID, r.State, r.Created = hex.EncodeToString(idb[:]), Creating, time.Now()
	err = s.db(true, func(b *bolt.Bucket) error {
		if old, err := get(b, r.Name); err == nil {
			return fmt.Errorf("store: %s: %w (%s; remove it first)", r.Name, ErrExists, old.State)
		}
		return put(b, r)
	})
	if err != nil {
		l.Close()
		return nil, err
	}
	s.removeStatus(r.Name) // an earlier sandbox's of this name
	return l, nil
}

// Start claims a sandbox that capsa create recorded (state Created), or
// one suspended to disk (Suspended), for its supervisor: it returns the
// sandbox's lock with the record in state Creating, and set applied to it
// in the same change. Any other state is an error that says it.
func (s *Store) Start(name string, set ...func(*Record)) (*Lock, error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	if _, err := s.getRaw(name); err != nil {
		return nil, err
	}
	l, err := s.lockCreated(name)
	if err != nil {
		return nil, fmt.Errorf("store: start %s: it is running", name)
	}
	// A run that ended since the record was last read is folded in
	// first (a suspension, say), and its status goes: the next run
	// writes its own.
	if _, err := s.settle(name); err != nil {
		l.Close()
		return nil, fmt.Errorf("store: start %s: %w", name, err)
	}
	err = s.Update(name, func(r *Record) error {
		if r.State != Created && r.State != Suspended {
			return fmt.Errorf("store: start %s: it is %s; only a created or suspended sandbox starts (run a new one)", name, r.State)
		}
		r.State = Creating
		for _, f := range set {
			f(r)
		}
		return nil
	})
	if err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// settingsWait bounds how long Start waits for a lock held while the
// record says the sandbox is not running: a WhileStopped rewriting a
// record and a file or two, or a supervisor on its way out.
const settingsWait = 2 * time.Second

// lockCreated takes name's lock for Start. While the record says Created
// or Suspended, a holder is a WhileStopped changing its settings (or a
// supervisor that has just ended), and is waited for, up to settingsWait;
// once the record says the sandbox runs, a held lock is refused at once,
// as lock does.
func (s *Store) lockCreated(name string) (*Lock, error) {
	deadline := time.Now().Add(settingsWait)
	for {
		l, err := s.lock(name)
		if err == nil || !errors.Is(err, ErrExists) || time.Now().After(deadline) {
			return l, err
		}
		if r, gerr := s.getRaw(name); gerr != nil || (r.State != Created && r.State != Suspended) {
			return nil, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// WhileStopped runs fn with name's record while holding its lock, if no
// supervisor holds it and the record says the sandbox is not running (a
// run that ended is folded in first, as Start does): a change of a stopped
// sandbox's settings that a start cannot interleave with, since Start
// waits for it instead of beginning from the record it is replacing.
// stopped is false, and fn not run, when a supervisor holds the lock or
// the record says the sandbox is starting or running.
func (s *Store) WhileStopped(name string, fn func(*Record) error) (stopped bool, err error) {
	if err := CheckName(name); err != nil {
		return false, err
	}
	if _, err := s.getRaw(name); err != nil {
		return false, err
	}
	l, err := s.lock(name)
	if errors.Is(err, ErrExists) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer l.Close()
	r, err := s.settle(name)
	if err != nil {
		return false, fmt.Errorf("store: %s: %w", name, err)
	}
	if r.Alive() {
		return false, nil
	}
	return true, fn(r)
}

// Update changes name's record with fn, in one transaction.
func (s *Store) Update(name string, fn func(*Record) error) error {
	return s.db(true, func(b *bolt.Bucket) error {
		r, err := get(b, name)
		if err != nil {
			return err
		}
		if err := fn(r); err != nil {
			return err
		}
		r.Name = name
		return put(b, r)
	})
}

// Get returns name's record, with a dead supervisor's sandbox reported
// (and recorded) as crashed.
func (s *Store) Get(name string) (*Record, error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	r, err := s.getRaw(name)
	if err != nil {
		return nil, err
	}
	if r = s.checkAlive(r); r == nil {
		return nil, fmt.Errorf("store: %s: %w", name, errAutoRemoved)
	}
	return r, nil
}

// List returns every record, by name, liveness checked as Get does.
func (s *Store) List() ([]*Record, error) {
	var rs []*Record
	err := s.db(false, func(b *bolt.Bucket) error {
		if b == nil {
			return nil
		}
		return b.ForEach(func(k, v []byte) error {
			var r Record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("store: record of %s: %w", k, err)
			}
			rs = append(rs, &r)
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	live := rs[:0]
	for _, r := range rs {
		if r = s.checkAlive(r); r != nil {
			live = append(live, r)
		}
	}
	rs = live
	sort.Slice(rs, func(i, j int) bool { return rs[i].Name < rs[j].Name })
	return rs, nil
}

// checkAlive returns r as it is now. A record that is not alive is what
// it says. One whose supervisor holds its lock gets the supervisor's
// status laid over it (Status). One whose supervisor is gone gets its
// status folded in (settle): it ended as the status says, or crashed;
// nil if that removed it (AutoRemove).
func (s *Store) checkAlive(r *Record) *Record {
	if !r.Alive() {
		return r
	}
	l, err := s.lock(r.Name)
	if err != nil {
		// Held: its supervisor runs (or the lock cannot be read: say
		// what the record and the status say).
		st, err := s.readStatus(r.Name)
		cur := *r
		switch {
		case err == nil:
			s.overlay(&cur, st)
		case !errors.Is(err, errNoStatus):
			cur.Reason = err.Error()
		}
		return &cur
	}
	defer l.Close()
	cur, err := s.settle(r.Name)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return r
	}
	return cur
}

// errAutoRemoved: the record went when its sandbox ended (AutoRemove).
var errAutoRemoved = fmt.Errorf("%w (removed when it ended)", ErrNotFound)

// settle folds the status of name's ended run into its record, the
// caller holding name's lock (so no supervisor runs it): it ended as the
// status says (exited, or suspended), or, with no such status, crashed. A
// record that asked for it (AutoRemove) goes then, with its directory,
// unless suspended; settle then returns an error wrapping ErrNotFound.
func (s *Store) settle(name string) (*Record, error) {
	// Most calls (Create, Start) find nothing to fold: a read, not a
	// write transaction and its sync.
	if r, err := s.getRaw(name); err != nil || !r.Alive() {
		if err == nil {
			s.removeStatus(name)
		}
		return r, err
	}
	var out *Record
	gone := false
	err := s.db(true, func(b *bolt.Bucket) error {
		r, err := get(b, name)
		if err != nil {
			return err
		}
		out = r
		if !r.Alive() {
			return nil
		}
		st, serr := s.readStatus(name)
		switch {
		case serr == nil && (st.State == Exited || st.State == Suspended):
			s.overlay(r, st)
			if r.Ended.IsZero() {
				r.Ended = time.Now()
			}
		default:
			if serr == nil {
				s.overlay(r, st) // what it last reported, then
			}
			r.State, r.Ended = Crashed, time.Now()
			switch {
			case serr != nil && !errors.Is(serr, errNoStatus):
				r.Reason = fmt.Sprintf("its supervisor ended, and %v", serr)
			case r.PID == 0:
				r.Reason = "its supervisor never started"
			default:
				r.Reason = fmt.Sprintf("its supervisor (pid %d) ended without recording why (killed, or the host restarted)", r.PID)
			}
		}
		if r.AutoRemove && r.State != Suspended {
			gone = true
			return b.Delete([]byte(name))
		}
		return put(b, r)
	})
	if err != nil {
		return nil, err
	}
	if gone {
		os.RemoveAll(s.SandboxDir(name))
		return nil, fmt.Errorf("store: %s: %w", name, errAutoRemoved)
	}
	s.removeStatus(name)
	return out, nil
}

// getRaw reads name's record as it is, liveness unchecked.
func (s *Store) getRaw(name string) (*Record, error) {
	var r *Record
	err := s.db(false, func(b *bolt.Bucket) error {
		var err error
		r, err = get(b, name)
		return err
	})
	return r, err
}

// Remove deletes name's record and runtime files. A sandbox whose
// supervisor runs is refused (stop it first).
func (s *Store) Remove(name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	if _, err := s.getRaw(name); err != nil {
		return err
	}
	l, err := s.lock(name)
	if err != nil {
		return fmt.Errorf("store: remove %s: it is running (stop it first)", name)
	}
	defer l.Close()
	err = s.db(true, func(b *bolt.Bucket) error { return b.Delete([]byte(name)) })
	if err != nil {
		return fmt.Errorf("store: remove %s: %w", name, err)
	}
	// A fork chain the sandbox's supervisor could not remove whole.
	if err := os.RemoveAll(s.ForkDir(name)); err != nil {
		return fmt.Errorf("store: remove %s: %w", name, err)
	}
	// The lock file goes last, while still held, so a new sandbox of this
	// name cannot lock it before the directory is gone.
	if err := os.RemoveAll(s.SandboxDir(name)); err != nil {
		return fmt.Errorf("store: remove %s: %w", name, err)
	}
	return nil
}
