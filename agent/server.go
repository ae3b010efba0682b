package agent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Version is the agent's version, reported by Info.
const Version = "0.1.0"

// DefaultPath is the guest's command search path.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/bbin"

// baseEnv is the environment every exec starts from.
var baseEnv = []string{
	"PATH=" + DefaultPath,
	"HOME=/root",
	"TERM=dumb",
}

// Server serves agent connections.
type Server struct {
	Log *slog.Logger
	// Shutdown is called after a shutdown request is acknowledged.
	Shutdown func()

	mu    sync.Mutex
	execs map[int]*execEntry // running execs by PID
}

// gatedWriter writes to w once ready is closed.
type gatedWriter struct {
	w     io.Writer
	ready <-chan struct{}
}

func (g gatedWriter) Write(p []byte) (int, error) {
	<-g.ready
	return g.w.Write(p)
}

// execEntry is a running exec: kill signals its process group.
type execEntry struct{ kill func(syscall.Signal) }

func (s *Server) log() *slog.Logger {
	if s.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return s.Log
}

// Serve accepts connections until l fails or ctx ends.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		go s.ServeConn(ctx, c)
	}
}

// ServeConn serves one connection and closes it.
func (s *Server) ServeConn(ctx context.Context, nc net.Conn) {
	defer nc.Close()
	defer func() {
		if r := recover(); r != nil {
			s.log().Error("agent: connection handler panicked", "panic", r)
		}
	}()
	c := NewConn(nc)
	var hello Hello
	if err := c.ReadJSON(FrameHello, &hello); err != nil {
		c.WriteError(err)
		return
	}
	if hello.Version != ProtocolVersion {
		c.WriteError(fmt.Errorf("%w: client speaks %d, agent %d", ErrVersion, hello.Version, ProtocolVersion))
		return
	}
	if err := c.WriteJSON(FrameHello, Hello{Version: ProtocolVersion, Name: "capsa-agent " + Version}); err != nil {
		return
	}
	var req Request
	if err := c.ReadJSON(FrameRequest, &req); err != nil {
		c.WriteError(err)
		return
	}
	if err := s.handle(ctx, c, &req); err != nil {
		c.WriteError(err)
	}
}

// handle runs one request. A returned error is sent to the client.
func (s *Server) handle(ctx context.Context, c *Conn, req *Request) error {
	switch req.Op {
	case OpExec, OpInfo, OpShutdown, OpSignal:
	case OpRead, OpWrite, OpStat, OpList, OpMkdir, OpRemove, OpExists, OpSymlink, OpChown:
		if !filepath.IsAbs(req.Path) {
			return fmt.Errorf("%s %q: path must be absolute", req.Op, req.Path)
		}
	default:
		return fmt.Errorf("unknown operation %q", req.Op)
	}
	reply := func(v any) error { return c.WriteJSON(FrameReply, v) }
	switch req.Op {
	case OpExec:
		if req.Exec == nil {
			return errors.New("exec: no command")
		}
		return s.exec(ctx, c, req.Exec)
	case OpSignal:
		sig, err := ParseSignal(req.Signal)
		if err != nil {
			return err
		}
		s.mu.Lock()
		e := s.execs[req.PID]
		s.mu.Unlock()
		if e == nil {
			return opError("signal", strconv.Itoa(req.PID), syscall.ESRCH)
		}
		e.kill(sig)
		return reply(Empty{})
	case OpRead:
		return readFile(c, req.Path)
	case OpWrite:
		return writeFile(c, req)
	case OpStat:
		st, err := os.Lstat(req.Path)
		if err != nil {
			return opError("stat", req.Path, err)
		}
		return reply(fileInfo(req.Path, st))
	case OpList:
		ents, err := os.ReadDir(req.Path)
		if err != nil {
			return opError("list", req.Path, err)
		}
		list := DirList{Entries: []FileInfo{}}
		for _, e := range ents {
			if st, err := e.Info(); err == nil {
				list.Entries = append(list.Entries, fileInfo(filepath.Join(req.Path, e.Name()), st))
			}
		}
		return reply(list)
	case OpMkdir:
		mode := os.FileMode(req.Mode).Perm()
		if mode == 0 {
			mode = 0o755
		}
		var err error
		if req.Parents {
			err = os.MkdirAll(req.Path, mode)
		} else {
			err = os.Mkdir(req.Path, mode)
		}
		if err != nil {
			return opError("mkdir", req.Path, err)
		}
		return reply(Empty{})
	case OpRemove:
		var err error
		if req.Recursive {
			if _, err = os.Lstat(req.Path); err == nil {
				err = os.RemoveAll(req.Path)
			}
		} else {
			err = os.Remove(req.Path)
		}
		if err != nil {
			return opError("remove", req.Path, err)
		}
		return reply(Empty{})
	case OpSymlink:
		if req.Target == "" {
			return fmt.Errorf("symlink %s: no target", req.Path)
		}
		if err := os.Symlink(req.Target, req.Path); err != nil {
			return opError("symlink", req.Path, err)
		}
		return reply(Empty{})
	case OpChown:
		if req.Owner == nil || req.Owner.UID < 0 || req.Owner.GID < 0 {
			return fmt.Errorf("chown %s: no owner", req.Path)
		}
		if err := os.Lchown(req.Path, req.Owner.UID, req.Owner.GID); err != nil {
			return opError("chown", req.Path, err)
		}
		return reply(Empty{})
	case OpExists:
		_, err := os.Lstat(req.Path)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return opError("exists", req.Path, err)
		}
		return reply(ExistsReply{Exists: err == nil})
	case OpInfo:
		return reply(guestInfo())
	case OpShutdown:
		if err := reply(Empty{}); err != nil {
			return nil
		}
		if s.Shutdown != nil {
			go s.Shutdown()
		}
		return nil
	}
	return fmt.Errorf("unknown operation %q", req.Op)
}

// opError words an error as "op path: reason".
func opError(op, path string, err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	return fmt.Errorf("%s %s: %w", op, path, err)
}

// fileInfo describes the file at path, which st describes; a symlink
// says where it points.
func fileInfo(path string, st os.FileInfo) FileInfo {
	fi := FileInfo{
		Name: st.Name(), Size: st.Size(), Mode: uint32(st.Mode()), ModTimeNs: st.ModTime().UnixNano(),
		IsDir: st.IsDir(), IsSymlink: st.Mode()&os.ModeSymlink != 0,
	}
	if fi.IsSymlink {
		fi.Target, _ = os.Readlink(path)
	}
	return fi
}

func guestInfo() Info {
	var uts unix.Utsname
	unix.Uname(&uts)
	var si unix.Sysinfo_t
	unix.Sysinfo(&si)
	host, _ := os.Hostname()
	return Info{
		KernelVersion: unix.ByteSliceToString(uts.Release[:]),
		Hostname:      host,
		CPUs:          runtime.NumCPU(),
		MemoryBytes:   uint64(si.Totalram) * uint64(si.Unit),
		AgentVersion:  Version,
	}
}

func readFile(c *Conn, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return opError("read", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return opError("read", path, err)
	}
	if st.IsDir() {
		return fmt.Errorf("read %s: is a directory", path)
	}
	if err := c.WriteJSON(FrameReply, fileInfo(path, st)); err != nil {
		return nil
	}
	// A regular file sends at most the size it announced (the client
	// refuses more); one whose size says nothing (procfs) until EOF.
	var r io.Reader = f
	if st.Mode().IsRegular() && st.Size() > 0 {
		r = io.LimitReader(f, st.Size())
	}
	buf := make([]byte, chunk)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if werr := c.WriteFrame(FrameData, buf[:n]); werr != nil {
				return nil
			}
		}
		if err == io.EOF {
			return c.WriteFrame(FrameEnd, nil)
		}
		if err != nil {
			return opError("read", path, err)
		}
	}
}

// writeFile streams Data frames into a temporary file beside the target and
// renames it into place at End, so readers never see a partial file.
func writeFile(c *Conn, req *Request) error {
	mode := os.FileMode(req.Mode).Perm()
	if mode == 0 {
		mode = 0o644
	}
	var f *os.File
	var err error
	if req.Append {
		f, err = os.OpenFile(req.Path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, mode)
	} else {
		f, err = os.CreateTemp(filepath.Dir(req.Path), "."+filepath.Base(req.Path)+".capsa-*")
	}
	if err != nil {
		return opError("write", req.Path, err)
	}
	tmp := f.Name()
	fail := func(err error) error {
		f.Close()
		if !req.Append {
			os.Remove(tmp)
		}
		return opError("write", req.Path, err)
	}
	if err := c.WriteJSON(FrameReply, Empty{}); err != nil { // ready for data
		return fail(err)
	}
	w := bufio.NewWriterSize(f, chunk)
	for {
		t, b, err := c.ReadFrame()
		if err != nil {
			return fail(err)
		}
		if t == FrameEnd {
			break
		}
		if t != FrameData {
			return fail(fmt.Errorf("got a %v frame in file data", t))
		}
		if _, err := w.Write(b); err != nil {
			return fail(err)
		}
	}
	if err := w.Flush(); err != nil {
		return fail(err)
	}
	if !req.Append {
		if err := f.Chmod(mode); err != nil {
			return fail(err)
		}
	}
	if err := f.Close(); err != nil {
		return fail(err)
	}
	if !req.Append {
		if err := os.Rename(tmp, req.Path); err != nil {
			os.Remove(tmp)
			return opError("write", req.Path, err)
		}
	}
	return c.WriteJSON(FrameReply, Empty{})
}

// signals are the names an exec may be sent.
var signals = map[string]syscall.Signal{
	"SIGHUP": unix.SIGHUP, "SIGINT": unix.SIGINT, "SIGQUIT": unix.SIGQUIT, "SIGKILL": unix.SIGKILL,
	"SIGUSR1": unix.SIGUSR1, "SIGUSR2": unix.SIGUSR2, "SIGTERM": unix.SIGTERM, "SIGCONT": unix.SIGCONT,
	"SIGSTOP": unix.SIGSTOP, "SIGTSTP": unix.SIGTSTP, "SIGWINCH": unix.SIGWINCH, "SIGALRM": unix.SIGALRM,
	"SIGPIPE": unix.SIGPIPE,
}

// ParseSignal returns the signal named name ("SIGTERM" or "TERM").
func ParseSignal(name string) (syscall.Signal, error) {
	n := strings.ToUpper(name)
	if !strings.HasPrefix(n, "SIG") {
		n = "SIG" + n
	}
	if s, ok := signals[n]; ok {
		return s, nil
	}
	return 0, fmt.Errorf("unknown signal %q", name)
}

// frameWriter turns writes into stream frames.
type frameWriter struct {
	c *Conn
	t FrameType
}

func (w frameWriter) Write(p []byte) (int, error) {
	for off := 0; off < len(p); off += chunk {
		if err := w.c.WriteFrame(w.t, p[off:min(off+chunk, len(p))]); err != nil {
			return off, err
		}
	}
	return len(p), nil
}

func credential(spec string) (*syscall.Credential, string, error) {
	if spec == "" {
		return nil, "", nil
	}
	name, group, _ := strings.Cut(spec, ":")
	var u *user.User
	uid, err := strconv.ParseUint(name, 10, 32)
	if err != nil {
		if u, err = user.Lookup(name); err != nil {
			return nil, "", fmt.Errorf("user %q: %w", name, err)
		}
		uid, _ = strconv.ParseUint(u.Uid, 10, 32)
	} else {
		u, _ = user.LookupId(name) // a uid need not have an entry
	}
	var gid uint64 // root's group for a uid without an entry, as Docker
	home := "/"
	if u != nil {
		gid, _ = strconv.ParseUint(u.Gid, 10, 32)
		if u.HomeDir != "" {
			home = u.HomeDir
		}
	}
	if group != "" {
		if gid, err = strconv.ParseUint(group, 10, 32); err != nil {
			g, err := user.LookupGroup(group)
			if err != nil {
				return nil, "", fmt.Errorf("group %q: %w", group, err)
			}
			gid, _ = strconv.ParseUint(g.Gid, 10, 32)
		}
	}
	cred := &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	if u != nil && group == "" {
		if ids, err := u.GroupIds(); err == nil {
			for _, id := range ids {
				if n, err := strconv.ParseUint(id, 10, 32); err == nil && n != gid {
					cred.Groups = append(cred.Groups, uint32(n))
				}
			}
		}
	}
	return cred, home, nil
}

// envValue is the last value of key in env.
func envValue(env []string, key string) string {
	v := ""
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val
		}
	}
	return v
}

// lookPath finds an executable named file in the directories of path.
func lookPath(file, path string) (string, error) {
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, file)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", &exec.Error{Name: file, Err: exec.ErrNotFound}
}

// exec runs a process, streaming its output, until it exits.
func (s *Server) exec(ctx context.Context, c *Conn, req *ExecRequest) error {
	var argv []string
	switch {
	case len(req.Argv) > 0 && req.Shell == "":
		argv = req.Argv
	case len(req.Argv) == 0 && req.Shell != "":
		argv = []string{"/bin/sh", "-c", req.Shell}
	default:
		return errors.New("exec: give exactly one of argv and shell")
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	if !strings.Contains(argv[0], "/") {
		// A bare name is looked up in the process's own PATH (an
		// image's), not the agent's.
		cmd.Path, cmd.Err = lookPath(argv[0], envValue(append(append([]string(nil), baseEnv...), req.Env...), "PATH"))
		// u-root's busybox finds which command to be by following
		// argv[0] as a path to its symlink, so a bare name that
		// resolved there becomes the path.
		if cmd.Err == nil {
			if real, err := filepath.EvalSymlinks(cmd.Path); err == nil && strings.HasPrefix(real, "/bbin/") {
				cmd.Args[0] = cmd.Path
			}
		}
	}
	for _, e := range req.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" {
			return fmt.Errorf("exec: bad environment entry %q (want KEY=VALUE)", e)
		}
	}
	cred, home, err := credential(req.User)
	if err != nil {
		return fmt.Errorf("exec: %w", err)
	}
	env := append([]string(nil), baseEnv...)
	if home != "" {
		env = append(env, "HOME="+home)
	}
	cmd.Env = append(env, req.Env...)
	cmd.Dir = req.Dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: cred}
	// Output waits until the client has its ExecStarted reply.
	started := make(chan struct{})
	startOnce := sync.OnceFunc(func() { close(started) })
	defer startOnce()
	cmd.Stdout = gatedWriter{frameWriter{c, FrameStdout}, started}
	cmd.Stderr = gatedWriter{frameWriter{c, FrameStderr}, started}
	cmd.WaitDelay = 2 * time.Second // background children holding the pipes
	var stdin io.WriteCloser
	if req.Stdin {
		if stdin, err = cmd.StdinPipe(); err != nil {
			return fmt.Errorf("exec: %w", err)
		}
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("exec %s: %w", cmd.Args[0], err)
	}
	pgid := cmd.Process.Pid
	var mu sync.Mutex
	timedOut, exited := false, false
	// killGroup signals the process group while it can still be ours: once
	// Wait has reaped the leader, the id may be reused.
	killGroup := func(sig syscall.Signal) {
		mu.Lock()
		defer mu.Unlock()
		if !exited {
			unix.Kill(-pgid, sig)
		}
	}
	if req.TimeoutMs > 0 {
		t := time.AfterFunc(time.Duration(req.TimeoutMs)*time.Millisecond, func() {
			mu.Lock()
			timedOut = !exited
			mu.Unlock()
			killGroup(unix.SIGKILL)
		})
		defer t.Stop()
	}
	stop := context.AfterFunc(ctx, func() { killGroup(unix.SIGKILL) })
	defer stop()
	// Registered before the client learns the PID, so a Signal right
	// after it finds the exec; removed only while it is still this one's
	// (the PID may be reused by a later exec once this one is reaped).
	entry := &execEntry{kill: killGroup}
	s.mu.Lock()
	if s.execs == nil {
		s.execs = map[int]*execEntry{}
	}
	s.execs[pgid] = entry
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		if s.execs[pgid] == entry {
			delete(s.execs, pgid)
		}
		s.mu.Unlock()
	}()
	if err := c.WriteJSON(FrameReply, ExecStarted{PID: pgid}); err != nil {
		killGroup(unix.SIGKILL)
	}
	startOnce()

	// stdin is written from its own goroutine, so a process slow to read
	// it does not hold up the frame reader below; the queue bounds what is
	// held, and past it the reader waits (the client signals on
	// connections of its own, and kills a process it gives up on the same
	// way, so neither needs this reader).
	exitedCh := make(chan struct{})
	defer close(exitedCh)
	var stdinCh chan []byte
	if stdin != nil {
		stdinCh = make(chan []byte, 16)
		go func() {
			for b := range stdinCh {
				if b == nil {
					stdin.Close()
					continue
				}
				stdin.Write(b)
			}
		}()
	}
	toStdin := func(b []byte) {
		if stdinCh == nil {
			return
		}
		select {
		case stdinCh <- b:
		case <-exitedCh:
		}
	}

	// The client's frames: stdin, its end, and signals. A client that goes
	// away kills the process.
	go func() {
		if stdinCh != nil {
			defer close(stdinCh)
		}
		for {
			t, b, err := c.ReadFrame()
			if err != nil {
				killGroup(unix.SIGKILL)
				return
			}
			switch t {
			case FrameStdin:
				toStdin(b)
			case FrameStdinClose:
				toStdin(nil)
			case FrameSignal:
				var sr SignalRequest
				if decodeStrict(b, &sr) == nil {
					if sig, err := ParseSignal(sr.Name); err == nil {
						killGroup(sig)
					}
				}
			default:
				killGroup(unix.SIGKILL)
				return
			}
		}
	}()

	werr := cmd.Wait()
	mu.Lock()
	exited = true
	mu.Unlock()
	st := ExitStatus{}
	if ps := cmd.ProcessState; ps != nil {
		ws := ps.Sys().(syscall.WaitStatus)
		switch {
		case ws.Signaled():
			st.Signal = unix.SignalName(ws.Signal())
			st.Code = 128 + int(ws.Signal())
		default:
			st.Code = ws.ExitStatus()
		}
	} else if werr != nil {
		return fmt.Errorf("exec %s: %w", cmd.Args[0], werr)
	}
	mu.Lock()
	st.TimedOut = timedOut
	mu.Unlock()
	return c.WriteJSON(FrameExit, st)
}
