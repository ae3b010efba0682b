package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// maxDirEntries bounds a directory listing the client accepts.
const maxDirEntries = 1 << 20

const (
	// DefaultMaxOutput bounds what Output collects from a process's
	// stdout and stderr together when ExecOptions.MaxOutput is 0.
	DefaultMaxOutput = 64 << 20
	// HostGrace is how long past ExecOptions.Timeout the host waits for
	// the guest's exit status before it gives up on the process itself:
	// the timeout is the agent's to enforce, but the agent is inside the
	// guest, and the guest may have stopped it.
	HostGrace = 10 * time.Second
)

var hostGrace = HostGrace // a variable for the tests

var (
	// ErrLimit is wrapped by errors for output or a file larger than the
	// limit the caller set.
	ErrLimit = errors.New("size limit exceeded")
	// ErrTimedOut is wrapped when the guest did not end a process at its
	// timeout (nor report it) within HostGrace.
	ErrTimedOut = errors.New("the guest did not end the process at its timeout")
)

// Client talks to an agent. Dial opens a new connection to it (over vsock,
// or anything else); each operation uses its own.
type Client struct {
	Dial func(ctx context.Context) (net.Conn, error)
	Name string // sent in Hello

	// Spare keeps one connection dialed ahead of the next operation, so
	// that an operation does not wait for a connection's set-up through
	// the guest. Only for a client that owns its transport: a spare
	// connection counts as somebody connected (a detached sandbox's idle
	// timeout). Close releases it.
	Spare bool

	// agent is the Hello the agent last answered: once known, a new
	// connection sends its Hello and its request together and checks the
	// answer after, saving a round trip through the guest per operation.
	agent atomic.Pointer[Hello]

	spareMu   sync.Mutex
	spare     net.Conn
	refilling bool
	closed    bool
}

// spareDialTimeout bounds a spare connection's dial.
const spareDialTimeout = 30 * time.Second

// Close closes the spare connection, if any, and keeps the client from
// dialing another.
func (cl *Client) Close() error {
	cl.spareMu.Lock()
	defer cl.spareMu.Unlock()
	cl.closed = true
	if cl.spare != nil {
		cl.spare.Close()
		cl.spare = nil
	}
	return nil
}

// takeSpare returns the spare connection, if there is one.
func (cl *Client) takeSpare() net.Conn {
	if !cl.Spare {
		return nil
	}
	cl.spareMu.Lock()
	defer cl.spareMu.Unlock()
	nc := cl.spare
	cl.spare = nil
	return nc
}

// startSpare starts dialing the next spare connection if none is there
// or coming; it is called once an operation got its connection and the
// agent's Hello (before the agent answered one, it may not listen yet).
func (cl *Client) startSpare() {
	if !cl.Spare {
		return
	}
	cl.spareMu.Lock()
	defer cl.spareMu.Unlock()
	if !cl.closed && !cl.refilling && cl.spare == nil {
		cl.refilling = true
		go cl.refill()
	}
}

func (cl *Client) refill() {
	ctx, cancel := context.WithTimeout(context.Background(), spareDialTimeout)
	defer cancel()
	nc, err := cl.Dial(ctx)
	cl.spareMu.Lock()
	defer cl.spareMu.Unlock()
	cl.refilling = false
	if err != nil {
		return
	}
	if cl.closed || cl.spare != nil {
		nc.Close()
		return
	}
	cl.spare = nc
}

// open dials (or takes the spare connection), exchanges Hellos and sends
// req. The connection closes when ctx ends.
func (cl *Client) open(ctx context.Context, req Request) (c *Conn, nc net.Conn, done func(), err error) {
	if spare := cl.takeSpare(); spare != nil {
		c, nc, done, err = cl.openOn(ctx, spare, req)
	}
	// No spare, or one the guest dropped meanwhile (a restore resets
	// every connection): that fails before the agent's Hello, so before
	// the agent read the request, and a new connection is dialed.
	if c == nil && (err == nil || errors.Is(err, errNoHello)) {
		fresh, derr := cl.Dial(ctx)
		if derr != nil {
			return nil, nil, nil, fmt.Errorf("agent: connect: %w", derr)
		}
		c, nc, done, err = cl.openOn(ctx, fresh, req)
	}
	if err == nil {
		cl.startSpare()
	}
	return c, nc, done, err
}

// abort closes a connection whose operation gave up on the guest at once
// where the transport can (vsock.Conn.Abort: a reset, with no close
// handshake left for a guest that reads nothing to answer later), with
// Close otherwise.
func abort(nc net.Conn) {
	if a, ok := nc.(interface{ Abort() error }); ok {
		a.Abort()
		return
	}
	nc.Close()
}

// errNoHello marks an open that failed reading the agent's Hello.
var errNoHello = errors.New("no hello from the agent")

// openOn is open on the connection nc.
func (cl *Client) openOn(ctx context.Context, nc net.Conn, req Request) (*Conn, net.Conn, func(), error) {
	// A context that ends before the agent's Hello aborts the connection
	// (nothing in the guest may be reading it); after, it is closed, so
	// that what was written (an attached process's input) still arrives.
	var answered atomic.Bool
	stop := context.AfterFunc(ctx, func() {
		if answered.Load() {
			nc.Close()
		} else {
			abort(nc)
		}
	})
	done := func() { stop(); nc.Close() }
	c := NewConn(nc)
	fail := func(err error) (*Conn, net.Conn, func(), error) {
		done()
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, nil, nil, err
	}
	op, ok := LookupOperation(req.Op)
	if !ok {
		return fail(fmt.Errorf("agent: unknown operation %q", req.Op))
	}
	mine := Hello{Version: ProtocolVersion, MinVersion: MinProtocolVersion, Name: cl.Name}
	if err := c.WriteJSON(FrameHello, mine); err != nil {
		return fail(fmt.Errorf("agent: hello: %w: %w", errNoHello, err))
	}
	need := op.Feature
	if req.Op == OpExec && req.Exec != nil && req.Exec.TTY != nil {
		need = FeaturePTY
	}
	if len(req.Xattrs) > 0 || req.WithXattrs || req.AllowNetwork {
		need = FeatureXattrs
	}
	// An agent whose Hello is known gets the request at once: the same
	// agent answers the same Hello, which is checked below before any
	// reply is read. The request is written while the Hello is read: a
	// transport that buffers nothing (net.Pipe) would otherwise hold both
	// ends in a write.
	known := cl.agent.Load()
	pipelined := known != nil && known.has(need)
	sent := make(chan error, 1)
	if pipelined {
		go func() { sent <- c.WriteJSON(FrameRequest, req) }()
	}
	var h Hello
	if err := c.ReadJSON(FrameHello, &h); err != nil {
		if pipelined {
			nc.Close()
			<-sent
		}
		if ctx.Err() == nil {
			err = fmt.Errorf("%w: %w", errNoHello, err)
		}
		return fail(fmt.Errorf("agent: hello: %w", err))
	}
	answered.Store(true)
	if pipelined {
		if err := <-sent; err != nil {
			return fail(fmt.Errorf("agent: %s: %w", req.Op, err))
		}
	}
	// The agent chose a version: it must be one this client speaks.
	if v, err := negotiate(mine, Hello{Version: h.Version}); err != nil || v != h.Version {
		return fail(fmt.Errorf("%w: the agent chose %d, the client speaks %d..%d", ErrVersion, h.Version, MinProtocolVersion, ProtocolVersion))
	}
	if !h.has(need) {
		return fail(fmt.Errorf("agent: %s: %w (%q lacks %q)", req.Op, ErrUnsupported, h.Name, need))
	}
	if pipelined {
		if h.Version != known.Version {
			// Another agent answered (the guest was restored from another
			// snapshot): the request went out in the version it replaced.
			cl.agent.Store(nil)
			return fail(fmt.Errorf("%w: the agent changed from version %d to %d during the request; try again", ErrVersion, known.Version, h.Version))
		}
		return c, nc, done, nil
	}
	cl.agent.Store(&h)
	if err := c.WriteJSON(FrameRequest, req); err != nil {
		return fail(fmt.Errorf("agent: %s: %w", req.Op, err))
	}
	return c, nc, done, nil
}

// call runs a request whose whole answer is one JSON reply.
func (cl *Client) call(ctx context.Context, req Request, reply any) error {
	return cl.callFor(ctx, req, FrameReply, reply)
}

// callFor runs a request whose whole answer is one JSON frame of type want.
func (cl *Client) callFor(ctx context.Context, req Request, want FrameType, reply any) error {
	c, _, done, err := cl.open(ctx, req)
	if err != nil {
		return err
	}
	defer done()
	return ctxErr(ctx, c.ReadJSON(want, reply))
}

// Stat describes path (without following a final symlink).
func (cl *Client) Stat(ctx context.Context, path string) (*FileInfo, error) {
	var fi FileInfo
	return &fi, cl.call(ctx, Request{Op: OpStat, Path: path}, &fi)
}

// StatXattrs is Stat with the file's user extended attributes
// (FileInfo.Xattrs).
func (cl *Client) StatXattrs(ctx context.Context, path string) (*FileInfo, error) {
	var fi FileInfo
	return &fi, cl.call(ctx, Request{Op: OpStat, Path: path, WithXattrs: true}, &fi)
}

// ListDir lists a directory.
func (cl *Client) ListDir(ctx context.Context, path string) ([]FileInfo, error) {
	return cl.listDir(ctx, Request{Op: OpList, Path: path})
}

// ListDirXattrs is ListDir with each file's user extended attributes.
func (cl *Client) ListDirXattrs(ctx context.Context, path string) ([]FileInfo, error) {
	return cl.listDir(ctx, Request{Op: OpList, Path: path, WithXattrs: true})
}

func (cl *Client) listDir(ctx context.Context, req Request) ([]FileInfo, error) {
	path := req.Path
	var l DirList
	if err := cl.call(ctx, req, &l); err != nil {
		return nil, err
	}
	if len(l.Entries) > maxDirEntries {
		return nil, fmt.Errorf("agent: list %s: %d entries is more than %d", path, len(l.Entries), maxDirEntries)
	}
	return l.Entries, nil
}

// Mkdir creates a directory, and its parents if asked.
func (cl *Client) Mkdir(ctx context.Context, path string, mode os.FileMode, parents bool) error {
	return cl.call(ctx, Request{Op: OpMkdir, Path: path, Mode: uint32(mode.Perm()), Parents: parents}, &Empty{})
}

// Remove removes a file or empty directory, or a whole tree if recursive.
func (cl *Client) Remove(ctx context.Context, path string, recursive bool) error {
	return cl.call(ctx, Request{Op: OpRemove, Path: path, Recursive: recursive}, &Empty{})
}

// Symlink makes link a symbolic link to target.
func (cl *Client) Symlink(ctx context.Context, target, link string) error {
	return cl.call(ctx, Request{Op: OpSymlink, Path: link, Target: target}, &Empty{})
}

// Chown sets path's owner and group (a symlink's own, not its target's).
func (cl *Client) Chown(ctx context.Context, path string, uid, gid int) error {
	return cl.call(ctx, Request{Op: OpChown, Path: path, Owner: &Owner{UID: uid, GID: gid}}, &Empty{})
}

// Exists reports whether path exists.
func (cl *Client) Exists(ctx context.Context, path string) (bool, error) {
	var r ExistsReply
	err := cl.call(ctx, Request{Op: OpExists, Path: path}, &r)
	return r.Exists, err
}

// Info describes the guest.
func (cl *Client) Info(ctx context.Context) (*Info, error) {
	var in Info
	return &in, cl.call(ctx, Request{Op: OpInfo}, &in)
}

// Sync writes what the guest's file systems hold in memory to their
// disks (sync(2)) and returns once written. An agent without FeatureSync
// answers an error wrapping ErrUnsupported.
func (cl *Client) Sync(ctx context.Context) error {
	return cl.call(ctx, Request{Op: OpSync}, &Empty{})
}

// Resumed tells the guest it runs again after a pause or a restore.
func (cl *Client) Resumed(ctx context.Context, r Resumed) error {
	return cl.call(ctx, Request{Op: OpResumed, Resumed: &r}, &Empty{})
}

// Shutdown asks the guest to shut down.
func (cl *Client) Shutdown(ctx context.Context) error {
	return cl.call(ctx, Request{Op: OpShutdown}, &Empty{})
}

// ReadFile streams a guest file into w, never holding it whole.
func (cl *Client) ReadFile(ctx context.Context, path string, w io.Writer) (*FileInfo, error) {
	c, _, done, err := cl.open(ctx, Request{Op: OpRead, Path: path})
	if err != nil {
		return nil, err
	}
	defer done()
	var fi FileInfo
	if err := c.ReadJSON(FrameReply, &fi); err != nil {
		return nil, ctxErr(ctx, err)
	}
	var got int64
	for {
		t, b, err := c.ReadFrame()
		if err != nil {
			return nil, ctxErr(ctx, fmt.Errorf("agent: read %s: %w", path, err))
		}
		switch t {
		case FrameData:
			// The agent sends a regular file's announced size at most;
			// a size of 0 (procfs) announces nothing.
			if got += int64(len(b)); fi.Size > 0 && got > fi.Size {
				return nil, fmt.Errorf("agent: read %s: the guest sent more than the %d bytes it announced", path, fi.Size)
			}
			if _, err := w.Write(b); err != nil {
				return nil, fmt.Errorf("agent: read %s: %w", path, err)
			}
		case FrameEnd:
			return &fi, nil
		default:
			return nil, expectJSON(t, b, FrameData, nil)
		}
	}
}

// WriteFile streams r into a guest file, replacing it atomically.
func (cl *Client) WriteFile(ctx context.Context, path string, mode os.FileMode, r io.Reader) error {
	return cl.writeFile(ctx, Request{Op: OpWrite, Path: path, Mode: uint32(mode.Perm())}, r)
}

// WriteFileXattrs is WriteFile giving the file user extended attributes
// (names without "user."), set before it replaces what was there.
func (cl *Client) WriteFileXattrs(ctx context.Context, path string, mode os.FileMode, r io.Reader, xattrs map[string]string) error {
	return cl.writeFile(ctx, Request{Op: OpWrite, Path: path, Mode: uint32(mode.Perm()), Xattrs: xattrs}, r)
}

// AppendFile streams r onto the end of a guest file.
func (cl *Client) AppendFile(ctx context.Context, path string, mode os.FileMode, r io.Reader) error {
	return cl.writeFile(ctx, Request{Op: OpWrite, Path: path, Mode: uint32(mode.Perm()), Append: true}, r)
}

func (cl *Client) writeFile(ctx context.Context, req Request, r io.Reader) error {
	c, nc, done, err := cl.open(ctx, req)
	if err != nil {
		return err
	}
	defer done()
	if err := c.ReadJSON(FrameReply, &Empty{}); err != nil {
		return ctxErr(ctx, err)
	}
	buf := make([]byte, chunk)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			if err := c.WriteFrame(FrameData, buf[:n]); err != nil {
				// The agent stops reading when it fails (a full disk, say):
				// its Error frame says why better than the broken stream.
				nc.SetReadDeadline(time.Now().Add(time.Second))
				var re *RemoteError
				if rerr := c.ReadJSON(FrameReply, &Empty{}); errors.As(rerr, &re) {
					return re
				}
				return ctxErr(ctx, fmt.Errorf("agent: write %s: %w", req.Path, err))
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return rerr
		}
	}
	if err := c.WriteFrame(FrameEnd, nil); err != nil {
		return ctxErr(ctx, err)
	}
	return ctxErr(ctx, c.ReadJSON(FrameReply, &Empty{}))
}

func ctxErr(ctx context.Context, err error) error {
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// ExecOptions describe a process to run in the guest.
type ExecOptions struct {
	Argv   []string // or Shell
	Shell  string
	Env    []string
	Dir    string
	User   string
	Stdin  io.Reader // nil: no input
	Stdout io.Writer // nil: discarded
	Stderr io.Writer // nil: discarded
	// Timeout kills the process after this long (the agent does; the host
	// gives up HostGrace later if the guest did not).
	Timeout time.Duration
	// MaxOutput bounds what Output collects from stdout and stderr
	// together (0: DefaultMaxOutput; negative: no limit). Past it the
	// process is killed and Output fails with ErrLimit.
	MaxOutput int64
	// TTY runs the process on a pseudo-terminal of this size: its output
	// all comes to Stdout, Stdin goes to the terminal, Process.Resize
	// changes its size.
	TTY *WindowSize
	// Container runs the process as a container's (see Container): Env
	// is then its whole environment and Dir a path in the container.
	Container *Container
}

// Process is a guest process this client started or attached to.
type Process struct {
	ID   int // in the agent's table
	PID  int // in the guest
	cl   *Client
	c    *Conn
	done func()
	wait chan struct{}
	st   *ExitStatus
	err  error
}

// Start starts a process and streams its output as it comes. The process
// belongs to the agent: it goes on if this client or its connection goes
// (Attach reaches it again), but Start kills it if ctx ends, a writer
// fails or the host's deadline passes first.
func (cl *Client) Start(ctx context.Context, o ExecOptions) (*Process, error) {
	req := &ExecRequest{Argv: o.Argv, Shell: o.Shell, Env: o.Env, Dir: o.Dir, User: o.User,
		Stdin: o.Stdin != nil, TimeoutMs: o.Timeout.Milliseconds(), TTY: o.TTY, Container: o.Container}
	if o.Timeout > 0 && req.TimeoutMs == 0 {
		req.TimeoutMs = 1
	}
	return cl.follow(ctx, Request{Op: OpExec, Exec: req}, req.name(), o.Stdin, o.Stdout, o.Stderr, o.Timeout, true)
}

// AttachOptions say where an attached process's streams go.
type AttachOptions struct {
	Stdin  io.Reader // nil: none
	Stdout io.Writer // nil: discarded
	Stderr io.Writer // nil: discarded
	// NoReplay leaves out what the process wrote before: only its output
	// from now on.
	NoReplay bool
}

// Attach reaches a process by its ID: what it wrote lately (up to 64 KiB)
// and then everything until it exits. Detaching (ctx ending) leaves the
// process running.
func (cl *Client) Attach(ctx context.Context, id int, o AttachOptions) (*Process, error) {
	return cl.follow(ctx, Request{Op: OpAttach, ID: id, NoReplay: o.NoReplay}, fmt.Sprintf("process %d", id), o.Stdin, o.Stdout, o.Stderr, 0, false)
}

// follow opens req (an exec or an attach) and streams the process on it.
// kill: the process is killed if the client stops following it first.
func (cl *Client) follow(ctx context.Context, req Request, name string, stdin io.Reader, stdoutW, stderrW io.Writer, timeout time.Duration, kill bool) (*Process, error) {
	c, nc, done, err := cl.open(ctx, req)
	if err != nil {
		return nil, err
	}
	var started ExecStarted
	if err := c.ReadJSON(FrameReply, &started); err != nil {
		done()
		return nil, ctxErr(ctx, err)
	}
	p := &Process{ID: started.ID, PID: started.PID, cl: cl, c: c, done: done, wait: make(chan struct{})}
	if stdin != nil {
		go func() {
			io.Copy(frameWriter{c, FrameStdin}, stdin)
			c.WriteFrame(FrameStdinClose, nil)
		}()
	}
	// The host's own deadline, for a guest that does not end the process
	// at its timeout: it counts only time spent waiting for the guest,
	// not time the caller's writers take.
	var hostTimedOut, writing atomic.Bool
	stopTimer := func() bool { return false }
	if timeout > 0 {
		var t *time.Timer
		t = time.AfterFunc(timeout+hostGrace, func() {
			if writing.Load() {
				t.Reset(time.Second)
				return
			}
			hostTimedOut.Store(true)
			abort(nc) // the guest stopped answering: nothing to hand over
			done()
		})
		stopTimer = t.Stop
	}
	// abandon kills a process the client stops waiting for, over a
	// connection of its own (the agent keeps processes whose client went).
	abandon := func() {
		if !kill {
			return
		}
		go func() {
			kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			cl.Signal(kctx, p.ID, "SIGKILL")
		}()
	}
	stdout, stderr := orDiscard(stdoutW), orDiscard(stderrW)
	go func() {
		defer close(p.wait)
		defer done()
		defer stopTimer()
		for {
			t, b, err := c.ReadFrame()
			if err != nil {
				// Given up on (ctx, the host's deadline): killed. A
				// connection that was merely lost leaves the process to
				// the agent, to be attached to again.
				if ctx.Err() != nil || hostTimedOut.Load() {
					abandon()
				}
				if hostTimedOut.Load() {
					p.err = fmt.Errorf("agent: exec %s: %w (no exit status %v after its %v timeout)", name, ErrTimedOut, hostGrace, timeout)
					return
				}
				p.err = ctxErr(ctx, fmt.Errorf("agent: %s: connection lost: %w", name, err))
				return
			}
			switch t {
			case FrameStdout, FrameStderr:
				w := stdout
				if t == FrameStderr {
					w = stderr
				}
				// A writer that fails (a full buffer, a closed pipe)
				// ends the exec: the process is killed.
				writing.Store(true)
				_, err := w.Write(b)
				writing.Store(false)
				if err != nil {
					abandon()
					p.err = fmt.Errorf("agent: %s: %w", name, err)
					return
				}
			default:
				var st ExitStatus
				if p.err = expectJSON(t, b, FrameExit, &st); p.err == nil {
					p.st = &st
				}
				return
			}
		}
	}()
	return p, nil
}

// Resize gives a process on a pty (ExecOptions.TTY) a new window size.
func (p *Process) Resize(ws WindowSize) error {
	if ws.Rows == 0 || ws.Cols == 0 {
		return fmt.Errorf("agent: resize to %dx%d: want rows and columns above 0", ws.Cols, ws.Rows)
	}
	return p.c.WriteJSON(FrameResize, ws)
}

// Signal sends a signal ("SIGTERM", "TERM", ...) to a process's group by
// its ID, on a connection of its own (so a process that does not read its
// stdin, with its connection full of it, can still be signalled).
func (cl *Client) Signal(ctx context.Context, id int, name string) error {
	if _, err := ParseSignal(name); err != nil {
		return err
	}
	return cl.call(ctx, Request{Op: OpSignal, ID: id, Signal: name}, &Empty{})
}

// maxProcesses bounds a process list the client accepts.
const maxProcesses = 1 << 16

// Processes lists the agent's processes: the running ones and the most
// recent that exited, by ID.
func (cl *Client) Processes(ctx context.Context) ([]ProcessInfo, error) {
	var l ProcessList
	if err := cl.call(ctx, Request{Op: OpProcesses}, &l); err != nil {
		return nil, err
	}
	if len(l.Processes) > maxProcesses {
		return nil, fmt.Errorf("agent: processes: %d is more than %d", len(l.Processes), maxProcesses)
	}
	return l.Processes, nil
}

// Wait waits for the process with ID id to exit and returns how it ended.
func (cl *Client) Wait(ctx context.Context, id int) (*ExitStatus, error) {
	var st ExitStatus
	if err := cl.callFor(ctx, Request{Op: OpWait, ID: id}, FrameExit, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// Signal sends a signal ("SIGTERM", "TERM", ...) to the process group
// (Client.Signal).
func (p *Process) Signal(ctx context.Context, name string) error {
	return p.cl.Signal(ctx, p.ID, name)
}

// Wait waits for the process to end and its output to be delivered.
func (p *Process) Wait() (*ExitStatus, error) {
	<-p.wait
	return p.st, p.err
}

// Exec runs a process to the end.
func (cl *Client) Exec(ctx context.Context, o ExecOptions) (*ExitStatus, error) {
	p, err := cl.Start(ctx, o)
	if err != nil {
		return nil, err
	}
	return p.Wait()
}

// Output is what a collected exec produced.
type Output struct {
	ExitStatus
	Stdout, Stderr []byte
}

// budget is a size limit shared by collectors: left bytes may still be
// collected (negative: no limit); what names the limit in the error.
type budget struct {
	left, max int64
	what      string
}

// newBudget is a budget of max bytes: 0 is DefaultMaxOutput, negative is
// none.
func newBudget(max int64, what string) *budget {
	if max == 0 {
		max = DefaultMaxOutput
	}
	return &budget{left: max, max: max, what: what}
}

// collector gathers what one goroutine writes, to be read after, within
// its budget.
type collector struct {
	buf []byte
	b   *budget
}

func (c *collector) Write(p []byte) (int, error) {
	if c.b.left >= 0 {
		if int64(len(p)) > c.b.left {
			return 0, fmt.Errorf("%w: %s exceeds %d bytes", ErrLimit, c.b.what, c.b.max)
		}
		c.b.left -= int64(len(p))
	}
	c.buf = append(c.buf, p...)
	return len(p), nil
}

// ReadAll returns a guest file's contents, up to max bytes (0:
// DefaultMaxOutput; negative: no limit); past it the error wraps ErrLimit.
func (cl *Client) ReadAll(ctx context.Context, path string, max int64) ([]byte, error) {
	c := &collector{b: newBudget(max, "the file")}
	if _, err := cl.ReadFile(ctx, path, c); err != nil {
		return nil, err
	}
	return c.buf, nil
}

// Output runs a process and collects its output, up to o.MaxOutput.
func (cl *Client) Output(ctx context.Context, o ExecOptions) (*Output, error) {
	b := newBudget(o.MaxOutput, "output (ExecOptions.MaxOutput)")
	out, errb := &collector{b: b}, &collector{b: b}
	o.Stdout, o.Stderr = out, errb
	st, err := cl.Exec(ctx, o)
	if err != nil {
		return nil, err
	}
	return &Output{ExitStatus: *st, Stdout: out.buf, Stderr: errb.buf}, nil
}

// Rename renames from to to (both absolute), as rename(2) does.
func (cl *Client) Rename(ctx context.Context, from, to string) error {
	return cl.call(ctx, Request{Op: OpRename, Path: from, Target: to}, &Empty{})
}

// Watcher is a directory watch (Client.Watch).
type Watcher struct {
	c    *Conn
	done func()
	ctx  context.Context
}

// Watch watches the directory dir (and every directory below it with
// recursive) and returns once the guest watches it; Next gives its
// changes. It ends when ctx does or Close is called. A directory on a
// network file system is refused unless allowNetwork.
func (cl *Client) Watch(ctx context.Context, dir string, recursive, allowNetwork bool) (*Watcher, error) {
	c, _, done, err := cl.openStream(ctx, Request{Op: OpWatch, Path: dir, Recursive: recursive, AllowNetwork: allowNetwork})
	if err != nil {
		return nil, err
	}
	return &Watcher{c: c, done: done, ctx: ctx}, nil
}

// openStream opens req, an operation that replies once it has begun and
// then streams on the connection, and waits for that reply.
func (cl *Client) openStream(ctx context.Context, req Request) (*Conn, net.Conn, func(), error) {
	c, nc, done, err := cl.open(ctx, req)
	if err != nil {
		return nil, nil, nil, err
	}
	if err := c.ReadJSON(FrameReply, &Empty{}); err != nil {
		done()
		return nil, nil, nil, ctxErr(ctx, err)
	}
	return c, nc, done, nil
}

// Next waits for the watched directory's next change.
func (w *Watcher) Next() (WatchEvent, error) {
	var ev WatchEvent
	if err := w.c.ReadJSON(FrameData, &ev); err != nil {
		return ev, ctxErr(w.ctx, err)
	}
	return ev, nil
}

// Close ends the watch.
func (w *Watcher) Close() error { w.done(); return nil }
