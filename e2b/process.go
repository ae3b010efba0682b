package e2b

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/e2b/envd/process"
	"github.com/capsa-sandbox/capsa/e2b/envd/process/processconnect"
)

// processService is envd's process.Process over a sandbox's agent.
type processService struct {
	s *Server
}

var _ processconnect.ProcessHandler = (*processService)(nil)

// Bounds on what a client may ask of processes.
const (
	maxProcs     = 1024 // live processes started through the API, per sandbox
	maxArgs      = 4096
	maxEnvs      = 1024
	maxKeepalive = 50 * time.Second
)

// proc is a process started through the API: what its later requests
// (input, resize, list) need.
type proc struct {
	pid   uint32
	id    int // in the agent's table
	cfg   *process.ProcessConfig
	tag   string
	pty   bool
	ap    *agent.Process
	stdin *io.PipeWriter // nil: none
	// writing holds one input write at a time: a process that does
	// not read cannot make the server hold more.
	writing chan struct{}
}

// closeProcs ends what the server holds of the guest's processes (their
// stdin); they run on.
func (g *guest) closeProcs() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for pid, p := range g.procs {
		if p.stdin != nil {
			p.stdin.Close()
		}
		delete(g.procs, pid)
	}
}

// sink carries a process's events from the agent's reader to a stream:
// the reader blocks while the stream is slow, and drops what comes once
// the stream's client has gone (the process goes on).
type sink struct {
	ch   chan *process.ProcessEvent
	gone chan struct{}
	once sync.Once
}

func newSink() *sink {
	return &sink{ch: make(chan *process.ProcessEvent, 16), gone: make(chan struct{})}
}

func (k *sink) send(ev *process.ProcessEvent) {
	select {
	case k.ch <- ev:
	case <-k.gone:
	}
}

func (k *sink) leave() { k.once.Do(func() { close(k.gone) }) }

// output is a writer of one of a process's streams into a sink.
type output struct {
	k    *sink
	kind int // 1 stdout, 2 stderr, 3 pty
}

func (o output) Write(b []byte) (int, error) {
	data := &process.ProcessEvent_DataEvent{}
	c := slices.Clone(b)
	switch o.kind {
	case 1:
		data.Output = &process.ProcessEvent_DataEvent_Stdout{Stdout: c}
	case 2:
		data.Output = &process.ProcessEvent_DataEvent_Stderr{Stderr: c}
	default:
		data.Output = &process.ProcessEvent_DataEvent_Pty{Pty: c}
	}
	o.k.send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: data}})
	return len(b), nil
}

// endEvent describes how a process ended.
func endEvent(st *agent.ExitStatus, err error) *process.ProcessEvent {
	end := &process.ProcessEvent_EndEvent{}
	switch {
	case err != nil:
		end.ExitCode = -1
		msg := err.Error()
		end.Status, end.Error = "error", &msg
	default:
		end.ExitCode = int32(st.Code)
		end.Exited = st.Signal == ""
		end.Status = "exit status " + strconv.Itoa(st.Code)
		if st.Signal != "" {
			end.Status = "signal: " + strings.ToLower(strings.TrimPrefix(st.Signal, "SIG"))
		}
		if st.TimedOut {
			end.Status += " (its timeout passed)"
		}
		if st.Code != 0 {
			msg := end.Status
			end.Error = &msg
		}
	}
	return &process.ProcessEvent{Event: &process.ProcessEvent_End{End: end}}
}

func startEvent(pid uint32) *process.ProcessEvent {
	return &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: pid}}}
}

func keepaliveEvent() *process.ProcessEvent {
	return &process.ProcessEvent{Event: &process.ProcessEvent_Keepalive{Keepalive: &process.ProcessEvent_KeepAlive{}}}
}

// keepaliveInterval is the interval a stream's client asks for
// (Keepalive-Ping-Interval, seconds), within maxKeepalive.
func keepaliveInterval(h interface{ Get(string) string }) time.Duration {
	d := maxKeepalive
	if n, err := strconv.Atoi(h.Get("Keepalive-Ping-Interval")); err == nil && n > 0 && time.Duration(n)*time.Second < d {
		d = time.Duration(n) * time.Second
	}
	return d
}

// pump sends a sink's events on a stream (send), with keepalives, until
// the sink closes (the process ended) or the client goes.
func pump(ctx context.Context, k *sink, every time.Duration, send func(*process.ProcessEvent) error) error {
	defer k.leave()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case ev, ok := <-k.ch:
			if !ok {
				return nil
			}
			if err := send(ev); err != nil {
				return err
			}
		case <-t.C:
			if err := send(keepaliveEvent()); err != nil {
				return err
			}
		case <-ctx.Done():
			return nil
		}
	}
}

// Start runs a process and streams its events: start (its PID), its
// output as it comes, keepalives, and its end. The process belongs to
// the sandbox: it runs on if the client goes, until its timeout (the
// request's Connect-Timeout-Ms) if it has one.
func (ps *processService) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	g := guestFrom(ctx)
	cfg := req.Msg.GetProcess()
	if cfg == nil || cfg.Cmd == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("start: no process.cmd"))
	}
	if len(cfg.Args) > maxArgs || len(cfg.Envs) > maxEnvs {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("start: at most %d args and %d envs", maxArgs, maxEnvs))
	}
	g.mu.Lock()
	n := len(g.procs)
	g.mu.Unlock()
	if n >= maxProcs {
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("start: %d processes of this sandbox run already", n))
	}
	u, err := userOf(ctx, g, req.Header().Get("Authorization"))
	if err != nil {
		return err
	}
	envs := maps.Clone(g.env)
	if envs == nil {
		envs = map[string]string{}
	}
	maps.Copy(envs, cfg.Envs)
	env, err := envList(envs)
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("start: %w", err))
	}
	env = append(env, "HOME="+u.homeDir(), "USER="+u.name)
	dir := u.homeDir()
	if cfg.Cwd != nil && *cfg.Cwd != "" {
		dir = u.resolve(*cfg.Cwd)
	} else if !g.homeExists(ctx, dir) {
		dir = "/"
	}
	argv := append([]string{cfg.Cmd}, cfg.Args...)
	if cfg.Cmd == "/bin/bash" {
		argv[0] = ps.s.commandShell(ctx, g)
	}
	o := agent.ExecOptions{Argv: argv, Env: env, Dir: dir, User: u.execUser()}
	if d, ok := ctx.Deadline(); ok {
		o.Timeout = max(time.Until(d), time.Millisecond)
	}
	var pty bool
	if p := req.Msg.Pty; p != nil {
		pty = true
		size := p.GetSize()
		o.TTY = &agent.WindowSize{Rows: clampSize(size.GetRows(), 24), Cols: clampSize(size.GetCols(), 80)}
	}
	var stdinW *io.PipeWriter
	if req.Msg.GetStdin() || pty {
		var r *io.PipeReader
		r, stdinW = io.Pipe()
		o.Stdin = r
	}
	k := newSink()
	if pty {
		o.Stdout = output{k, 3}
	} else {
		o.Stdout, o.Stderr = output{k, 1}, output{k, 2}
	}
	// The process's own context: not the request's, which ends with
	// the client (the agent kills a process whose context ends).
	ap, err := g.h.Stream(context.Background(), o)
	if err != nil {
		if stdinW != nil {
			stdinW.Close()
		}
		return connect.NewError(connect.CodeInternal, fmt.Errorf("start %s: %w", cfg.Cmd, err))
	}
	p := &proc{pid: uint32(ap.PID), id: ap.ID, cfg: cfg, tag: req.Msg.GetTag(), pty: pty, ap: ap, stdin: stdinW,
		writing: make(chan struct{}, 1)}
	g.mu.Lock()
	g.procs[p.pid] = p
	g.mu.Unlock()
	go func() {
		st, err := ap.Wait()
		k.send(endEvent(st, err))
		close(k.ch)
		if stdinW != nil {
			stdinW.CloseWithError(errors.New("the process ended"))
		}
		g.mu.Lock()
		if g.procs[p.pid] == p {
			delete(g.procs, p.pid)
		}
		g.mu.Unlock()
	}()
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.StartResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		k.leave()
		return nil
	}
	return pump(ctx, k, keepaliveInterval(req.Header()), send)
}

// clampSize keeps a terminal dimension within what a terminal has (0:
// def).
func clampSize(n uint32, def uint16) uint16 {
	if n == 0 {
		return def
	}
	return uint16(min(n, 1000))
}

// Connect streams a running process's events again: start, what it wrote
// lately, then its output until it ends.
func (ps *processService) Connect(ctx context.Context, req *connect.Request[process.ConnectRequest], stream *connect.ServerStream[process.ConnectResponse]) error {
	g := guestFrom(ctx)
	pid, id, p, err := ps.find(ctx, g, req.Msg.GetProcess(), "connect")
	if err != nil {
		return err
	}
	k := newSink()
	ao := agent.AttachOptions{Stdout: output{k, 1}, Stderr: output{k, 2}}
	if p != nil && p.pty {
		ao.Stdout = output{k, 3}
	}
	ap, err := g.h.Attach(context.Background(), id, ao)
	if err != nil {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("connect to process %d: %w", pid, err))
	}
	go func() {
		st, err := ap.Wait()
		k.send(endEvent(st, err))
		close(k.ch)
	}()
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.ConnectResponse{Event: ev}) }
	if err := send(startEvent(pid)); err != nil {
		k.leave()
		return nil
	}
	err = pump(ctx, k, keepaliveInterval(req.Header()), send)
	// Detaching leaves the process running.
	return err
}

// find resolves a process selector: its PID, its ID in the agent's table,
// and the API's record of it (nil: not started through the API).
func (ps *processService) find(ctx context.Context, g *guest, sel *process.ProcessSelector, op string) (uint32, int, *proc, error) {
	if sel == nil {
		return 0, 0, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s: no process selector", op))
	}
	g.mu.Lock()
	var p *proc
	switch s := sel.Selector.(type) {
	case *process.ProcessSelector_Pid:
		p = g.procs[s.Pid]
	case *process.ProcessSelector_Tag:
		for _, q := range g.procs {
			if q.tag != "" && q.tag == s.Tag {
				p = q
				break
			}
		}
	}
	g.mu.Unlock()
	if p != nil {
		return p.pid, p.id, p, nil
	}
	pid, ok := sel.Selector.(*process.ProcessSelector_Pid)
	if !ok {
		return 0, 0, nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("%s: no running process has that tag", op))
	}
	list, err := g.h.Processes(ctx)
	if err != nil {
		return 0, 0, nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s: %w", op, err))
	}
	for _, q := range list {
		if uint32(q.PID) == pid.Pid && q.Exit == nil {
			return pid.Pid, q.ID, nil, nil
		}
	}
	return 0, 0, nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("%s: no running process %d", op, pid.Pid))
}

// List describes the running processes.
func (ps *processService) List(ctx context.Context, req *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	g := guestFrom(ctx)
	list, err := g.h.Processes(ctx)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("list: %w", err))
	}
	res := &process.ListResponse{}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, q := range list {
		if q.Exit != nil {
			continue
		}
		info := &process.ProcessInfo{Pid: uint32(q.PID)}
		if p := g.procs[uint32(q.PID)]; p != nil && p.id == q.ID {
			info.Config = p.cfg
			if p.tag != "" {
				info.Tag = &p.tag
			}
		} else if len(q.Argv) > 0 {
			info.Config = &process.ProcessConfig{Cmd: q.Argv[0], Args: q.Argv[1:]}
		} else {
			info.Config = &process.ProcessConfig{}
		}
		res.Processes = append(res.Processes, info)
	}
	return connect.NewResponse(res), nil
}

// SendInput writes to a process's stdin (or terminal).
func (ps *processService) SendInput(ctx context.Context, req *connect.Request[process.SendInputRequest]) (*connect.Response[process.SendInputResponse], error) {
	g := guestFrom(ctx)
	pid, _, p, err := ps.find(ctx, g, req.Msg.GetProcess(), "send input")
	if err != nil {
		return nil, err
	}
	if p == nil || p.stdin == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("send input: process %d was not started with stdin", pid))
	}
	var data []byte
	switch in := req.Msg.GetInput().GetInput().(type) {
	case *process.ProcessInput_Stdin:
		data = in.Stdin
	case *process.ProcessInput_Pty:
		data = in.Pty
	}
	select {
	case p.writing <- struct{}{}:
	default:
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("send input to process %d: an earlier input is still waiting for it to read", pid))
	}
	written := make(chan error, 1)
	go func() {
		_, err := p.stdin.Write(data)
		<-p.writing
		written <- err
	}()
	select {
	case err := <-written:
		if err != nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("send input to process %d: %w", pid, err))
		}
	case <-ctx.Done():
		return nil, connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("send input to process %d: it is not reading", pid))
	}
	return connect.NewResponse(&process.SendInputResponse{}), nil
}

// CloseStdin closes a process's stdin.
func (ps *processService) CloseStdin(ctx context.Context, req *connect.Request[process.CloseStdinRequest]) (*connect.Response[process.CloseStdinResponse], error) {
	g := guestFrom(ctx)
	pid, _, p, err := ps.find(ctx, g, req.Msg.GetProcess(), "close stdin")
	if err != nil {
		return nil, err
	}
	if p == nil || p.stdin == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("close stdin: process %d was not started with stdin", pid))
	}
	p.stdin.Close()
	return connect.NewResponse(&process.CloseStdinResponse{}), nil
}

// SendSignal sends SIGTERM or SIGKILL to a process (its process group).
func (ps *processService) SendSignal(ctx context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	g := guestFrom(ctx)
	var sig string
	switch req.Msg.Signal {
	case process.Signal_SIGNAL_SIGKILL:
		sig = "SIGKILL"
	case process.Signal_SIGNAL_SIGTERM:
		sig = "SIGTERM"
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("send signal: %v is not SIGTERM or SIGKILL", req.Msg.Signal))
	}
	pid, id, _, err := ps.find(ctx, g, req.Msg.GetProcess(), "send signal")
	if err != nil {
		return nil, err
	}
	if err := g.h.SignalProcess(ctx, id, sig); err != nil {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("send %s to process %d: %w", sig, pid, err))
	}
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

// Update resizes a process's terminal.
func (ps *processService) Update(ctx context.Context, req *connect.Request[process.UpdateRequest]) (*connect.Response[process.UpdateResponse], error) {
	g := guestFrom(ctx)
	pid, _, p, err := ps.find(ctx, g, req.Msg.GetProcess(), "update")
	if err != nil {
		return nil, err
	}
	if size := req.Msg.GetPty().GetSize(); size != nil {
		if p == nil || p.ap == nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("resize process %d: not started on a terminal through this server", pid))
		}
		ws := agent.WindowSize{Rows: clampSize(size.Rows, 24), Cols: clampSize(size.Cols, 80)}
		if err := p.ap.Resize(ws); err != nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("resize process %d: %w", pid, err))
		}
	}
	return connect.NewResponse(&process.UpdateResponse{}), nil
}

// StreamInput is not served: the SDKs send input with SendInput (a
// browser's fetch cannot stream a request body).
func (ps *processService) StreamInput(ctx context.Context, _ *connect.ClientStream[process.StreamInputRequest]) (*connect.Response[process.StreamInputResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("stream input: use SendInput"))
}
