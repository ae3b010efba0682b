package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/image"
)

// Guest is what runs in a sandbox's guest, through its agent: processes,
// files and the guest's description. A Sandbox started here has it, and so
// does a detached sandbox reached by name (supervisor.Manager.Open): each
// operation has this one implementation.
type Guest struct {
	client  *agent.Client
	env     []string // every process's environment before its own
	dir     string   // every process's default working directory
	limit   int64    // Exec's and ReadFile's bound (Builder.OutputLimit)
	explain func(error) error
}

// NewGuest reaches the agent through client. Every process gets env (the
// sandbox's environment, under its own) and starts in dir unless it names
// one; limit bounds collected output as Builder.OutputLimit does. explain,
// if not nil, adds to an error why the sandbox may have gone.
func NewGuest(client *agent.Client, env []string, dir string, limit int64, explain func(error) error) *Guest {
	if explain == nil {
		explain = func(err error) error { return err }
	}
	return &Guest{client: client, env: env, dir: dir, limit: limit, explain: explain}
}

// Agent is the agent's client, for what Guest does not wrap.
func (s *Guest) Agent() *agent.Client { return s.client }

// Output is what a collected exec produced.
type Output = agent.Output

// Exec runs a process to the end and collects its output.
func (s *Guest) Exec(ctx context.Context, o ExecOptions) (*Output, error) {
	o = s.defaults(o)
	if o.MaxOutput == 0 {
		o.MaxOutput = s.limit
	}
	out, err := s.client.Output(ctx, o)
	return out, s.explain(err)
}

// Stream starts a process whose output streams to o.Stdout and o.Stderr;
// the Process can be signalled and waited for.
func (s *Guest) Stream(ctx context.Context, o ExecOptions) (*agent.Process, error) {
	o = s.defaults(o)
	p, err := s.client.Start(ctx, o)
	return p, s.explain(err)
}

// Processes lists the processes the agent started: the running ones and
// the most recent that exited, with how they ended. Processes outlive the
// connection (and the capsa exec) that started them.
func (s *Guest) Processes(ctx context.Context) ([]agent.ProcessInfo, error) {
	ps, err := s.client.Processes(ctx)
	return ps, s.explain(err)
}

// Attach follows a process by its ID (ProcessInfo.ID, Process.ID): its
// recent output replayed, then the rest until it exits. Ending ctx
// detaches and leaves the process running.
func (s *Guest) Attach(ctx context.Context, id int, o agent.AttachOptions) (*agent.Process, error) {
	p, err := s.client.Attach(ctx, id, o)
	return p, s.explain(err)
}

// WaitProcess waits for the process with ID id to exit and says how it
// ended.
func (s *Guest) WaitProcess(ctx context.Context, id int) (*agent.ExitStatus, error) {
	st, err := s.client.Wait(ctx, id)
	return st, s.explain(err)
}

// SignalProcess signals the process group of the process with ID id
// ("TERM", "SIGKILL", ...).
func (s *Guest) SignalProcess(ctx context.Context, id int, signal string) error {
	return s.explain(s.client.Signal(ctx, id, signal))
}

// defaults gives a process the sandbox's environment (the image's, then
// Env's) under its own, and the image's working directory unless it
// names one.
func (s *Guest) defaults(o ExecOptions) ExecOptions {
	if o.Container != nil {
		return o // a container's process has the container's own
	}
	o.Env = image.MergeEnv(s.env, o.Env)
	if o.Dir == "" {
		o.Dir = s.dir
	}
	return o
}

// Sync writes what the guest's file systems hold in memory to their
// disks, and returns once written: a copy of its disk taken then holds
// what it wrote. An agent that predates the operation (one restored from
// an older snapshot) runs the guest's sync program instead.
func (s *Guest) Sync(ctx context.Context) error {
	err := s.client.Sync(ctx)
	if errors.Is(err, agent.ErrUnsupported) {
		o := Command("sync")
		o.User = "0"
		var r *Output
		if r, err = s.Exec(ctx, o); err == nil && r.Code != 0 {
			err = fmt.Errorf("sandbox: sync: exit %d: %s", r.Code, bytes.TrimSpace(r.Stderr))
		}
	}
	return s.explain(err)
}

// ReadFile returns a guest file's contents, up to the OutputLimit (past
// it the error wraps agent.ErrLimit; ReadFileTo streams without one).
func (s *Guest) ReadFile(ctx context.Context, path string) ([]byte, error) {
	b, err := s.client.ReadAll(ctx, path, s.limit)
	if errors.Is(err, agent.ErrLimit) {
		return nil, fmt.Errorf("%w (Builder.OutputLimit; ReadFileTo streams it)", err)
	}
	return b, s.explain(err)
}

// ReadFiles reads several small guest files (at most agent.MaxReadFiles,
// each at most agent.MaxReadFileSize bytes) in one request: for each path,
// in order, its contents or the error reading it gave. A guest whose agent
// predates the operation (one restored from an older snapshot) is asked
// one file at a time, with the same bound on each.
func (s *Guest) ReadFiles(ctx context.Context, paths []string) ([]agent.FileResult, error) {
	files, err := s.client.ReadFiles(ctx, paths)
	if !errors.Is(err, agent.ErrUnsupported) {
		return files, s.explain(err)
	}
	files = make([]agent.FileResult, len(paths))
	for i, p := range paths {
		b, err := s.client.ReadAll(ctx, p, agent.MaxReadFileSize)
		var remote *agent.RemoteError
		switch {
		case errors.Is(err, agent.ErrLimit):
			err = fmt.Errorf("read %s: %w (%d bytes at most)", p, syscall.EFBIG, agent.MaxReadFileSize)
		case err != nil && !errors.As(err, &remote):
			// The connection, not the file: the rest would fail too.
			return nil, s.explain(err)
		}
		files[i] = agent.FileResult{Data: b, Err: err}
	}
	return files, nil
}

// ReadFileTo streams a guest file into w.
func (s *Guest) ReadFileTo(ctx context.Context, path string, w io.Writer) error {
	_, err := s.client.ReadFile(ctx, path, w)
	return s.explain(err)
}

// WriteFile writes data to a guest file with mode.
func (s *Guest) WriteFile(ctx context.Context, path string, data []byte, mode os.FileMode) error {
	return s.explain(s.client.WriteFile(ctx, path, mode, bytes.NewReader(data)))
}

// WriteFileFrom streams r into a guest file with mode.
func (s *Guest) WriteFileFrom(ctx context.Context, path string, r io.Reader, mode os.FileMode) error {
	return s.explain(s.client.WriteFile(ctx, path, mode, r))
}

// AppendFile appends data to a guest file in place (a cgroup's or
// another kernel interface's files, which a replaced file would not set).
func (s *Guest) AppendFile(ctx context.Context, path string, data []byte) error {
	return s.explain(s.client.AppendFile(ctx, path, 0o644, bytes.NewReader(data)))
}

// Stat describes a guest path.
func (s *Guest) Stat(ctx context.Context, path string) (*agent.FileInfo, error) {
	fi, err := s.client.Stat(ctx, path)
	return fi, s.explain(err)
}

// ListDir lists a guest directory.
func (s *Guest) ListDir(ctx context.Context, path string) ([]agent.FileInfo, error) {
	l, err := s.client.ListDir(ctx, path)
	return l, s.explain(err)
}

// Mkdir makes a guest directory; MkdirAll its parents too.
func (s *Guest) Mkdir(ctx context.Context, path string, mode os.FileMode) error {
	return s.explain(s.client.Mkdir(ctx, path, mode, false))
}

// MkdirAll makes a guest directory and its parents (mkdir -p).
func (s *Guest) MkdirAll(ctx context.Context, path string, mode os.FileMode) error {
	return s.explain(s.client.Mkdir(ctx, path, mode, true))
}

// Remove removes a guest path; recursive removes a tree.
func (s *Guest) Remove(ctx context.Context, path string, recursive bool) error {
	return s.explain(s.client.Remove(ctx, path, recursive))
}

// Exists reports whether a guest path exists.
func (s *Guest) Exists(ctx context.Context, path string) (bool, error) {
	ok, err := s.client.Exists(ctx, path)
	return ok, s.explain(err)
}

// Info describes the guest.
func (s *Guest) Info(ctx context.Context) (*agent.Info, error) {
	in, err := s.client.Info(ctx)
	return in, s.explain(err)
}

// Defaults are what every process gets unless it says otherwise: the
// sandbox's environment and working directory (an image's, then the
// builder's).
func (s *Guest) Defaults() (env []string, dir string) {
	return append([]string(nil), s.env...), s.dir
}

// Rename renames a guest path (both absolute), as rename(2) does.
func (s *Guest) Rename(ctx context.Context, from, to string) error {
	return s.explain(s.client.Rename(ctx, from, to))
}

// Chown sets a guest path's owner and group (a symlink's own).
func (s *Guest) Chown(ctx context.Context, path string, uid, gid int) error {
	return s.explain(s.client.Chown(ctx, path, uid, gid))
}

// Watch watches a guest directory (and below it with recursive) until ctx
// ends or the Watcher is closed; one on a network file system (a share)
// only with allowNetwork.
func (s *Guest) Watch(ctx context.Context, dir string, recursive, allowNetwork bool) (*agent.Watcher, error) {
	w, err := s.client.Watch(ctx, dir, recursive, allowNetwork)
	return w, s.explain(err)
}

// StatXattrs describes a guest path with its user extended attributes.
func (s *Guest) StatXattrs(ctx context.Context, path string) (*agent.FileInfo, error) {
	fi, err := s.client.StatXattrs(ctx, path)
	return fi, s.explain(err)
}

// ListDirXattrs lists a guest directory with each file's user extended
// attributes.
func (s *Guest) ListDirXattrs(ctx context.Context, path string) ([]agent.FileInfo, error) {
	l, err := s.client.ListDirXattrs(ctx, path)
	return l, s.explain(err)
}

// WriteFileXattrs streams r into a guest file with mode and the user
// extended attributes xattrs (names without "user.").
func (s *Guest) WriteFileXattrs(ctx context.Context, path string, r io.Reader, mode os.FileMode, xattrs map[string]string) error {
	return s.explain(s.client.WriteFileXattrs(ctx, path, mode, r, xattrs))
}

// DialPort connects to the guest's TCP port on its loopback, through the
// agent: no network device needed. The connection lives until closed,
// whatever ctx does once it is made.
func (s *Guest) DialPort(ctx context.Context, port int) (net.Conn, error) {
	c, err := s.client.DialPort(context.WithoutCancel(ctx), port)
	if err != nil {
		return nil, s.explain(err)
	}
	return c, nil
}
