package supervisor

// Starting detached sandboxes: what `capsa run -d`, create/start,
// snapshot restore, fork and the MCP server share. A sandbox is recorded
// in the store (record, create with its secrets), then its supervisor
// process, this binary's `capsa supervise`, is started in a session of
// its own holding the sandbox's lock (spawn); launch does both. All of it
// is the Manager's to call: nothing here is exported but the names and
// records its callers give it.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/confine"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/store"
)

// The descriptors spawn hands a supervisor process (`capsa supervise`):
// the sandbox's lock, held while it lives, and the pipe on which it says
// the sandbox runs ("ok") or why not. They are the first of
// exec.Cmd.ExtraFiles, which start at 3.
const (
	LockFD  = 3
	ReadyFD = 4
)

// MaxFork bounds the copies one Fork makes.
const MaxFork = 256

// record records rec in st, under a new name if it has none (rec.Name is
// set to it), in state Creating, and returns the sandbox's lock for spawn.
// A name that is taken is an error wrapping store.ErrExists.
func record(st *store.Store, rec *store.Record) (*store.Lock, error) {
	if rec.Name == "" {
		var err error
		if rec.Name, err = st.NewName(); err != nil {
			return nil, err
		}
	}
	lock, err := st.Create(rec)
	if errors.Is(err, store.ErrExists) {
		return nil, fmt.Errorf("the name %q is taken: %w", rec.Name, err)
	}
	return lock, err
}

// spawn starts the supervisor of the recorded sandbox name (`capsa
// supervise`, from this process's own executable), handing it lock, and
// waits until the sandbox runs or says why it cannot (the error then
// starts with the name). The store removes a record that asks for it
// (Record.AutoRemove) once its sandbox has ended. The supervisor outlives
// ctx and this process; lock is closed here.
func spawn(ctx context.Context, st *store.Store, name string, lock *store.Lock) error {
	defer lock.Close()
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find capsa's own binary: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(st.SandboxDir(name), SupervisorLog), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return err
	}
	defer readyR.Close()
	rec, err := st.Get(name)
	if err != nil {
		readyW.Close()
		return err
	}
	st.RemoveStale(sweepAge)
	cmd := exec.Command(exe, "supervise", "--state", st.Dir(), name)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{lock.File(), readyW} // LockFD and ReadyFD
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if Jailed(rec.NoConfine) {
		// The jail needs a mount namespace made with the process (see
		// package confine), and a temporary directory the jailed
		// supervisor can clean.
		tmp := filepath.Join(st.SandboxDir(name), TmpDir)
		if err := os.MkdirAll(tmp, 0o700); err != nil {
			readyW.Close()
			return err
		}
		jailCommand(cmd, tmp)
	}
	if err := cmd.Start(); err != nil {
		readyW.Close()
		st.Update(name, func(r *store.Record) error { r.State, r.Reason = store.Exited, err.Error(); return nil })
		return fmt.Errorf("start the supervisor: %w", err)
	}
	readyW.Close()
	// The record names the supervisor by what this process started, not
	// by what the supervisor says.
	pid := cmd.Process.Pid
	cmd.Process.Release()
	if err := st.Update(name, func(r *store.Record) error { r.PID = pid; return nil }); err != nil {
		return fmt.Errorf("record the supervisor: %w", err)
	}
	// The supervisor writes "ok" once the sandbox runs, or why it failed;
	// if it dies first, the pipe just closes.
	msg, _ := io.ReadAll(io.LimitReader(readyR, 64<<10))
	if strings.TrimSpace(string(msg)) == "ok" {
		return nil
	}
	if len(msg) == 0 {
		var last strings.Builder
		if err := logs(ctx, st, name, SupervisorLog, 20, false, &last); err != nil {
			last.WriteString(err.Error())
		}
		msg = []byte("the supervisor ended before the sandbox ran; its log:\n" + last.String())
	}
	return fmt.Errorf("%s: %s", name, strings.TrimSpace(string(msg)))
}

// sweepAge is how long a sandbox directory with no record stays before
// spawn removes it (store.RemoveStale): a new sandbox's directory has no
// record for a moment. Such directories are what a record's removal
// leaves when its directory could not go with it.
const sweepAge = time.Minute

// RestoreRecord is the record of a detached sandbox named name ("": a new
// name) that starts from the snapshot in dir instead of booting, its guest
// taking hostname ("": the snapshot's), with the host-facing settings
// given (nil: none; sandbox.RestoredSpec: never the snapshot's own); rm
// removes it when it ends. Give it to Launch. A snapshot that cannot be
// read, or settings that do not fit it, are an error wrapping
// ErrBadSnapshot.
func RestoreRecord(dir, name, hostname string, rm bool, settings *sandbox.Spec) (*store.Record, error) {
	spec, err := sandbox.RestoredSpec(dir, settings)
	if err != nil {
		return nil, badSnapshot{err}
	}
	return &store.Record{Name: name, Spec: spec, AutoRemove: rm, RestoreFrom: dir, Hostname: hostname}, nil
}

// ErrBadSnapshot is wrapped by a restore's error when the snapshot cannot
// be read (RestoreRecord): the user's input, not a failed start.
var ErrBadSnapshot = errors.New("the snapshot cannot be read")

// badSnapshot is err, as it says, wrapping ErrBadSnapshot too.
type badSnapshot struct{ err error }

func (e badSnapshot) Error() string   { return e.err.Error() }
func (e badSnapshot) Unwrap() []error { return []error{e.err, ErrBadSnapshot} }

// ErrSnapshotExists is wrapped by SaveSnapshot's error when the snapshot's
// name is taken.
var ErrSnapshotExists = errors.New("a snapshot with that name exists")

// DefaultSnapshotName is a snapshot's name when none is given: the
// sandbox's, then the time (NAME-YYYYMMDD-HHMMSS).
func DefaultSnapshotName(name string, t time.Time) string {
	return name + "-" + t.Format("20060102-150405")
}

// saveSnapshot writes the running detached sandbox name to the state
// directory's snapshot snap (Store.SnapshotDir) through its supervisor,
// with an inventory (a checkpoint that Manager.Diff compares), as a layer
// over the state directory's snapshot parent if that is not empty
// (sandbox.SnapshotOptions.Parent). A snapshot of that name must not
// exist.
func saveSnapshot(ctx context.Context, st *store.Store, name, snap, parent string, progress func(sandbox.Progress)) error {
	if err := store.CheckSnapshotName(snap); err != nil {
		return err
	}
	o := sandbox.SnapshotOptions{Inventory: true, Progress: progress}
	if parent != "" {
		if err := store.CheckSnapshotName(parent); err != nil {
			return err
		}
		o.Parent = st.SnapshotDir(parent)
		if _, err := os.Stat(filepath.Join(o.Parent, snapshot.ManifestFile)); err != nil {
			return fmt.Errorf("supervisor: snapshot %s: no snapshot called %s to lie over", snap, parent)
		}
	}
	dir := st.SnapshotDir(snap)
	if _, err := os.Lstat(dir); err == nil {
		return fmt.Errorf("supervisor: snapshot %s: %w", snap, ErrSnapshotExists)
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return err
	}
	return snapshotLive(ctx, st, name, dir, o)
}

// fork makes count running detached copies of the running detached
// sandbox name: it is snapshotted into a hidden directory of the state
// directory, and each copy restored from that at once, named and
// hostnamed NAME-1, NAME-2... (the first free names). It returns the
// copies' names and, beside each, why that copy did not start (nil: it
// runs); err is for what failed before any copy. The snapshot is a fork
// snapshot (sandbox.SnapshotOptions.Fork) in the sandbox's fork chain
// (Store.ForkDir): the first writes the memory in use, each later one
// what the sandbox wrote since; the chain goes when the sandbox ends.
func fork(ctx context.Context, st *store.Store, name string, count int, progress func(sandbox.Progress)) (names []string, errs []error, err error) {
	if count < 1 || count > MaxFork {
		return nil, nil, fmt.Errorf("supervisor: fork %s: %d copies: want 1 to %d", name, count, MaxFork)
	}
	src, err := st.Get(name)
	if err != nil {
		return nil, nil, err
	}
	if src.HostMounts {
		// The supervisor refuses it too (its snapshot operation); said
		// here before a fork chain is made for it.
		return nil, nil, fmt.Errorf("supervisor: fork %s: a containerd pod's VM cannot be forked: its containers' roots are mounts its shim makes while it runs, which a copy would not have", name)
	}
	for i := 1; len(names) < count; i++ {
		n := fmt.Sprintf("%s-%d", name, i)
		_, err := st.Get(n)
		switch {
		case errors.Is(err, store.ErrNotFound):
			names = append(names, n)
		case err != nil:
			return nil, nil, fmt.Errorf("supervisor: fork %s: %w", name, err) // a name too long
		}
	}
	if err := os.MkdirAll(st.SnapshotsDir(), 0o700); err != nil {
		return nil, nil, err
	}
	chain := st.ForkDir(name)
	cf, err := openForkChain(chain, src.JailUser)
	if err != nil {
		return nil, nil, err
	}
	defer cf.Close()
	// Held shared while this fork's copies restore; pruned alone after.
	if err := unix.Flock(int(cf.Fd()), unix.LOCK_SH); err != nil {
		return nil, nil, fmt.Errorf("supervisor: fork %s: lock its fork chain: %w", name, err)
	}
	defer func() {
		unix.Flock(int(cf.Fd()), unix.LOCK_UN)
		if unix.Flock(int(cf.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
			snapshot.PruneChain(chain)
		}
	}()
	dir := filepath.Join(chain, strconv.FormatInt(time.Now().UnixNano(), 10))
	if err := snapshotLive(ctx, st, name, dir, sandbox.SnapshotOptions{Fork: true, Progress: progress}); err != nil {
		return nil, nil, err
	}
	secrets, err := readSecrets(st, name) // the copies use the same
	if err != nil {
		return nil, nil, err
	}
	errs = make([]error, len(names))
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		started int64
	)
	report := func() {
		if progress != nil {
			progress(sandbox.Progress{Step: sandbox.StepStartCopies, Done: started, Total: int64(len(names))})
		}
	}
	report()
	for i, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec, err := RestoreRecord(dir, n, n, false, &src.Spec) // the source's own settings
			if err == nil {
				_, err = launch(ctx, st, rec, secrets)
			}
			errs[i] = err
			mu.Lock()
			defer mu.Unlock()
			started++
			report()
		}()
	}
	wg.Wait()
	return names, errs, nil
}

// openForkChain opens the fork chain's directory path, made if missing,
// for the sandbox's supervisor to write in: a directory of its own (the
// jail's user's, or this process's), 0700. The snapshots directory is
// every jailed supervisor's to write in, so anything else found under
// the name (a symbolic link, another's directory, one others may enter)
// is removed and the directory made again; it is opened without
// following a link and changed through that descriptor.
func openForkChain(path string, u *confine.User) (*os.File, error) {
	uid, gid := os.Geteuid(), os.Getegid()
	if u != nil {
		uid, gid = u.UID, u.GID
	}
	for range 3 {
		err := os.Mkdir(path, 0o700)
		if err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, err
		}
		made := err == nil
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err == nil {
			f := os.NewFile(uintptr(fd), path)
			var st unix.Stat_t
			err = unix.Fstat(fd, &st)
			switch {
			case err != nil:
			case st.Mode&0o077 != 0:
				err = fmt.Errorf("mode %04o", st.Mode&0o7777)
			case made && int(st.Uid) == os.Geteuid():
				if uid != int(st.Uid) {
					err = unix.Fchown(fd, uid, gid)
				}
				if err == nil {
					return f, nil
				}
			case !made && int(st.Uid) == uid:
				return f, nil
			default:
				err = fmt.Errorf("owned by %d", st.Uid)
			}
			f.Close()
		}
		// Not the directory capsa made: away with it.
		if rerr := os.RemoveAll(path); rerr != nil {
			return nil, fmt.Errorf("supervisor: fork chain %s (%v): %w", path, err, rerr)
		}
	}
	return nil, fmt.Errorf("supervisor: fork chain %s: something else keeps taking its place", path)
}

// CommandLine is what a sandbox runs, in one line: its image and
// arguments, or its command.
func CommandLine(s sandbox.Spec) string {
	if s.Image != nil {
		return strings.TrimSpace(s.Image.Ref + " " + strings.Join(s.Image.Args, " "))
	}
	return strings.Join(s.Main.Argv, " ")
}

// destroy kills the detached sandbox name if it runs (stopSandbox with kill) and
// removes its record and files (Store.Remove).
func destroy(ctx context.Context, st *store.Store, name string) error {
	rec, err := st.Get(name)
	if err != nil {
		return err
	}
	if rec.Alive() {
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := stopSandbox(sctx, st, name, 0, true)
		cancel()
		if err != nil && !errors.Is(err, ErrNotRunning) {
			return err
		}
	}
	// A supervisor holds the sandbox's lock for a moment after recording
	// its end, and Remove refuses it meanwhile: try again for a while.
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := st.Remove(name)
		if err == nil || errors.Is(err, store.ErrNotFound) {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(100 * time.Millisecond):
		}
	}
}
