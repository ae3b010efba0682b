package agent

import (
	"bufio"
	"bytes"
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
	"sync/atomic"
	"syscall"
	"time"

	"github.com/creack/pty"
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
	// ExecCgroups, if set, is the cgroup directory under which each
	// command started outside a container gets a cgroup of its own, so
	// that its timeout ends everything it started (the guest's agent sets
	// ExecCgroups); unset, the timeout ends the command's process group.
	ExecCgroups string

	procs procTable

	execSeq   atomic.Uint64
	lingerMu  sync.Mutex
	lingering map[string]bool // exec cgroups whose command left processes behind
}

// execCgroup makes the cgroup of a command about to start, and first
// removes those of earlier commands whose processes have all ended since.
func (s *Server) execCgroup() (*os.File, string, error) {
	s.lingerMu.Lock()
	for path := range s.lingering {
		if err := os.Remove(path); err == nil || errors.Is(err, os.ErrNotExist) {
			delete(s.lingering, path)
		}
	}
	s.lingerMu.Unlock()
	name := "e" + strconv.FormatUint(s.execSeq.Add(1), 10)
	f, err := makeExecCgroup(s.ExecCgroups, name)
	if err != nil {
		return nil, "", err
	}
	return f, filepath.Join(s.ExecCgroups, name), nil
}

// execEnded removes the cgroup of a command whose first process has
// ended, or, while processes it started live on, remembers it for later.
func (s *Server) execEnded(path string) {
	if err := os.Remove(path); err == nil || errors.Is(err, os.ErrNotExist) {
		return
	}
	s.lingerMu.Lock()
	defer s.lingerMu.Unlock()
	if s.lingering == nil {
		s.lingering = map[string]bool{}
	}
	s.lingering[path] = true
}

// execKilled forgets the cgroup of a command that killCgroup ended.
func (s *Server) execKilled(path string) {
	s.lingerMu.Lock()
	defer s.lingerMu.Unlock()
	delete(s.lingering, path)
}

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
	v, err := negotiate(hello, Hello{Version: ProtocolVersion, MinVersion: MinProtocolVersion})
	if err != nil {
		c.WriteError(err)
		return
	}
	if err := c.WriteJSON(FrameHello, Hello{Version: v, MinVersion: MinProtocolVersion,
		Name: "capsa-agent " + Version, Features: agentFeatures}); err != nil {
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
	op, ok := LookupOperation(req.Op)
	h := handlers[req.Op]
	if !ok || h == nil {
		return fmt.Errorf("unknown operation %q", req.Op)
	}
	if op.Path && !filepath.IsAbs(req.Path) {
		return fmt.Errorf("%s %q: path must be absolute", req.Op, req.Path)
	}
	return h(s, ctx, c, req)
}

// handlers serve the operations of Operations, one each.
var handlers = map[string]func(s *Server, ctx context.Context, c *Conn, req *Request) error{
	OpExec: func(s *Server, ctx context.Context, c *Conn, req *Request) error {
		if req.Exec == nil {
			return errors.New("exec: no command")
		}
		return s.exec(ctx, c, req.Exec)
	},
	OpSignal: func(s *Server, _ context.Context, c *Conn, req *Request) error {
		sig, err := ParseSignal(req.Signal)
		if err != nil {
			return err
		}
		p, err := s.procs.lookup("signal", req.ID)
		if err != nil {
			return err
		}
		if p.exit.Load() != nil {
			return opError("signal", "process "+strconv.Itoa(req.ID), syscall.ESRCH)
		}
		p.kill(sig)
		return reply(c, Empty{})
	},
	OpProcesses: func(s *Server, _ context.Context, c *Conn, _ *Request) error {
		return reply(c, ProcessList{Processes: s.procs.list()})
	},
	OpAttach: func(s *Server, _ context.Context, c *Conn, req *Request) error {
		p, err := s.procs.lookup("attach", req.ID)
		if err != nil {
			return err
		}
		if err := reply(c, ExecStarted{ID: p.info.ID, PID: p.info.PID}); err != nil {
			return nil
		}
		if running, err := p.attach(c, !req.NoReplay); running && err == nil {
			p.follow(c)
		}
		return nil
	},
	OpWait: func(s *Server, _ context.Context, c *Conn, req *Request) error {
		p, err := s.procs.lookup("wait", req.ID)
		if err != nil {
			return err
		}
		gone := make(chan struct{})
		go func() { c.ReadFrame(); close(gone) }() // the client hanging up
		select {
		case <-p.done:
			return c.WriteJSON(FrameExit, p.exit.Load())
		case <-gone:
			return nil
		}
	},
	OpRead:  func(_ *Server, _ context.Context, c *Conn, req *Request) error { return readFile(c, req.Path) },
	OpWrite: func(_ *Server, _ context.Context, c *Conn, req *Request) error { return writeFile(c, req) },
	OpStat: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
		st, err := os.Lstat(req.Path)
		if err != nil {
			return opError("stat", req.Path, err)
		}
		fi := newOwnerNames().fileInfo(req.Path, st)
		if req.WithXattrs {
			fi.Xattrs = userXattrs(req.Path)
		}
		return reply(c, fi)
	},
	OpList: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
		ents, err := os.ReadDir(req.Path)
		if err != nil {
			return opError("list", req.Path, err)
		}
		list := DirList{Entries: []FileInfo{}}
		names := newOwnerNames()
		for _, e := range ents {
			if st, err := e.Info(); err == nil {
				p := filepath.Join(req.Path, e.Name())
				fi := names.fileInfo(p, st)
				if req.WithXattrs {
					fi.Xattrs = userXattrs(p)
				}
				list.Entries = append(list.Entries, fi)
			}
		}
		return reply(c, list)
	},
	OpMkdir: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
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
		return reply(c, Empty{})
	},
	OpRemove: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
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
		return reply(c, Empty{})
	},
	OpSymlink: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
		if req.Target == "" {
			return fmt.Errorf("symlink %s: no target", req.Path)
		}
		if err := os.Symlink(req.Target, req.Path); err != nil {
			return opError("symlink", req.Path, err)
		}
		return reply(c, Empty{})
	},
	OpChown: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
		if req.Owner == nil || req.Owner.UID < 0 || req.Owner.GID < 0 {
			return fmt.Errorf("chown %s: no owner", req.Path)
		}
		if err := os.Lchown(req.Path, req.Owner.UID, req.Owner.GID); err != nil {
			return opError("chown", req.Path, err)
		}
		return reply(c, Empty{})
	},
	OpRename: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
		if !filepath.IsAbs(req.Target) {
			return fmt.Errorf("rename %s: target %q must be absolute", req.Path, req.Target)
		}
		if err := os.Rename(req.Path, req.Target); err != nil {
			return opError("rename", req.Path, err)
		}
		return reply(c, Empty{})
	},
	OpWatch: func(_ *Server, ctx context.Context, c *Conn, req *Request) error {
		if !req.AllowNetwork && networkFS(req.Path) {
			return fmt.Errorf("watch %s: a network file system, where changes made elsewhere do not show (allow it to watch the guest's own)", req.Path)
		}
		return watch(ctx, c, req.Path, req.Recursive)
	},
	OpTree: func(_ *Server, ctx context.Context, c *Conn, req *Request) error { return serveTree(ctx, c, req) },
	OpReadFiles: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
		files, err := readFiles(req.Paths)
		if err != nil {
			return err
		}
		return reply(c, files)
	},
	OpSync: func(_ *Server, _ context.Context, c *Conn, _ *Request) error {
		unix.Sync()
		return reply(c, Empty{})
	},
	OpDial: func(_ *Server, ctx context.Context, c *Conn, req *Request) error {
		return dialPort(ctx, c, req.Port)
	},
	OpExists: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
		_, err := os.Lstat(req.Path)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return opError("exists", req.Path, err)
		}
		return reply(c, ExistsReply{Exists: err == nil})
	},
	OpInfo: func(_ *Server, _ context.Context, c *Conn, _ *Request) error { return reply(c, guestInfo()) },
	OpResumed: func(_ *Server, _ context.Context, c *Conn, req *Request) error {
		if err := resumed(req.Resumed); err != nil {
			return err
		}
		return reply(c, Empty{})
	},
	OpShutdown: func(s *Server, _ context.Context, c *Conn, _ *Request) error {
		if err := reply(c, Empty{}); err != nil {
			return nil
		}
		if s.Shutdown != nil {
			go s.Shutdown()
		}
		return nil
	},
}

// resumed applies what the host says of a guest that runs again: its wall
// clock, a seed credited to the random number generator (RNDADDENTROPY,
// so that copies restored from one snapshot draw different numbers at
// once), its hostname.
func resumed(r *Resumed) error {
	if r == nil || r.TimeNs <= 0 {
		return errors.New("resumed: no wall clock time")
	}
	if len(r.Seed) > 4096 {
		return fmt.Errorf("resumed: a seed of %d bytes, at most 4096", len(r.Seed))
	}
	ts := unix.NsecToTimespec(r.TimeNs)
	if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
		return fmt.Errorf("resumed: set the clock: %w", err)
	}
	if len(r.Seed) > 0 {
		if err := addEntropy(r.Seed); err != nil {
			return fmt.Errorf("resumed: seed the random number generator: %w", err)
		}
	}
	if r.Hostname != "" {
		if err := unix.Sethostname([]byte(r.Hostname)); err != nil {
			return fmt.Errorf("resumed: set the hostname %q: %w", r.Hostname, err)
		}
		renameInHosts("/etc/hosts", r.Hostname)
	}
	return nil
}

// renameInHosts points the hosts file's 127.0.1.1 line, the one init
// wrote for the hostname, at the new name; a file without one is left.
func renameInHosts(path, name string) {
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	lines := strings.Split(string(b), "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "127.0.1.1") {
			lines[i] = "127.0.1.1\t" + name
			os.WriteFile(path, []byte(strings.Join(lines, "\n")), 0o644)
			return
		}
	}
}

// addEntropy mixes seed into the kernel's input pool (a write to
// /dev/urandom) and then reseeds its generator from the pool at once
// (RNDRESEEDCRNG), so that numbers drawn from now on depend on the seed.
// Without the reseed a restored copy would go on drawing what every other
// copy draws until the kernel's next periodic reseed.
func addEntropy(seed []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write(seed); err != nil {
		return err
	}
	return unix.IoctlSetInt(int(f.Fd()), unix.RNDRESEEDCRNG, 0)
}

// reply sends an operation's JSON reply.
func reply(c *Conn, v any) error { return c.WriteJSON(FrameReply, v) }

// opError words an error as "op path: reason".
func opError(op, path string, err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	return fmt.Errorf("%s %s: %w", op, path, err)
}

// fileInfo describes the file at path, which st describes; a symlink
// says where it points, and the owner and group are named as names finds
// them (nil names: by ID only).
func (names *ownerNames) fileInfo(path string, st os.FileInfo) FileInfo {
	fi := FileInfo{
		Name: st.Name(), Size: st.Size(), Mode: uint32(st.Mode()), ModTimeNs: st.ModTime().UnixNano(),
		IsDir: st.IsDir(), IsSymlink: st.Mode()&os.ModeSymlink != 0,
	}
	if fi.IsSymlink {
		fi.Target, _ = os.Readlink(path)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		fi.UID, fi.GID = int(sys.Uid), int(sys.Gid)
		if names != nil {
			fi.Owner, fi.Group = names.user(fi.UID), names.group(fi.GID)
		}
	}
	return fi
}

// ownerNames names users and groups from the guest's /etc/passwd and
// /etc/group, each read once (a listing names many files).
type ownerNames struct {
	users, groups map[int]string
}

func newOwnerNames() *ownerNames { return &ownerNames{} }

func (n *ownerNames) user(id int) string {
	if n.users == nil {
		n.users = readIDNames("/etc/passwd")
	}
	return n.users[id]
}

func (n *ownerNames) group(id int) string {
	if n.groups == nil {
		n.groups = readIDNames("/etc/group")
	}
	return n.groups[id]
}

// readIDNames reads a passwd or group file's NAME:x:ID: lines into a map
// from ID to name (the first name an ID has); a missing file is none. At
// most 1 MiB of it is read: the guest's files are the guest's.
func readIDNames(path string) map[int]string {
	m := map[int]string{}
	f, err := os.Open(path)
	if err != nil {
		return m
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(f, 1<<20))
	for line := range strings.SplitSeq(string(b), "\n") {
		fields := strings.SplitN(line, ":", 4)
		if len(fields) < 3 || fields[0] == "" {
			continue
		}
		if id, err := strconv.Atoi(fields[2]); err == nil {
			if _, ok := m[id]; !ok {
				m[id] = fields[0]
			}
		}
	}
	return m
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
	f, st, err := openToRead(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := c.WriteJSON(FrameReply, (*ownerNames)(nil).fileInfo(path, st)); err != nil {
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

// openToRead opens path for reading, refusing a directory, and describes
// it; errors name the read.
func openToRead(path string) (*os.File, os.FileInfo, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, opError("read", path, err)
	}
	st, err := f.Stat()
	if err == nil && st.IsDir() {
		err = errors.New("is a directory")
	}
	if err != nil {
		f.Close()
		return nil, nil, opError("read", path, err)
	}
	return f, st, nil
}

// writeFile streams Data frames into a temporary file beside the target and
// renames it into place at End, so readers never see a partial file.
func writeFile(c *Conn, req *Request) error {
	if err := checkXattrs(req.Xattrs); err != nil {
		return fmt.Errorf("write %s: %w", req.Path, err)
	}
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
	if err := setXattrs(f, req.Xattrs); err != nil {
		return fail(err)
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

// exec starts a process, enters it in the table and follows it on c until
// it exits or the client goes; it goes on without the client.
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
	if req.Container != nil {
		if req.User != "" {
			return errors.New("exec: a container's process takes its ids from the container, not a user")
		}
		if err := req.Container.Check(); err != nil {
			return fmt.Errorf("exec: %w", err)
		}
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	if req.Container != nil {
		// The helper resolves the program in the container's root.
		path, args, env, err := containerCommand(req, argv)
		if err != nil {
			return fmt.Errorf("exec: %w", err)
		}
		cmd = exec.Command(path)
		cmd.Args, cmd.Env = args, env
	} else if !strings.Contains(argv[0], "/") {
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
	if req.TTY != nil && (req.TTY.Rows == 0 || req.TTY.Cols == 0) {
		return fmt.Errorf("exec: terminal size %dx%d: want rows and columns above 0", req.TTY.Cols, req.TTY.Rows)
	}
	cred, home, err := credential(req.User)
	if err != nil {
		return fmt.Errorf("exec: %w", err)
	}
	env := append([]string(nil), baseEnv...)
	if home != "" {
		env = append(env, "HOME="+home)
	}
	if req.TTY != nil {
		env = append(env, "TERM=xterm") // unless the request names its own
	}
	if req.Container == nil {
		cmd.Env = append(env, req.Env...)
		cmd.Dir = req.Dir
	}
	// A container's process gets a mount namespace of its own, and, in
	// its container's cgroup, a cgroup namespace.
	sys := &syscall.SysProcAttr{Credential: cred}
	if req.Container != nil {
		sys.Unshareflags = syscall.CLONE_NEWNS
	}
	if req.Container != nil && req.Container.Cgroup != nil {
		cg, err := enterCgroup(req.Container.Cgroup)
		if err != nil {
			return fmt.Errorf("exec: %w", err)
		}
		defer cg.Close() // the process is in it once started
		sys.UseCgroupFD, sys.CgroupFD = true, int(cg.Fd())
		sys.Unshareflags |= syscall.CLONE_NEWCGROUP
	}
	// Any other command gets a cgroup of its own (ExecCgroups); without
	// one, its timeout falls back to its process group.
	var cgPath string
	if req.Container == nil && s.ExecCgroups != "" {
		cg, path, err := s.execCgroup()
		if err != nil {
			s.log().Warn("exec: no cgroup of its own; its timeout ends its process group", "err", err)
		} else {
			defer cg.Close()
			sys.UseCgroupFD, sys.CgroupFD = true, int(cg.Fd())
			cgPath = path
			defer func() {
				if cmd.Process == nil { // it never started
					os.Remove(path)
				}
			}()
		}
	}

	p := newProc(argv, req.TTY != nil, req.Stdin)
	// Output waits until the client has the process's ID and is attached.
	gate := make(chan struct{})
	openGate := sync.OnceFunc(func() { close(gate) })
	defer openGate()
	var in io.Writer // where input goes
	var eof func()   // ends the input
	var drain func() // after the exit: waits for the last output
	if req.TTY != nil {
		ptmx, err := startPTY(cmd, sys, *req.TTY)
		if err != nil {
			return fmt.Errorf("exec %s: %w", cmd.Args[0], err)
		}
		in, eof = ptmx, func() { ptmx.Write([]byte{4}) } // ^D
		p.resize = func(ws WindowSize) error {
			return pty.Setsize(ptmx, &pty.Winsize{Rows: ws.Rows, Cols: ws.Cols})
		}
		read := make(chan struct{})
		go func() {
			defer close(read)
			buf := make([]byte, chunk)
			for {
				n, err := ptmx.Read(buf)
				if n > 0 {
					<-gate
					p.output(FrameStdout, buf[:n])
				}
				if err != nil { // EIO once no one holds the terminal
					return
				}
			}
		}()
		drain = func() {
			// A background process may keep the terminal open.
			select {
			case <-read:
			case <-time.After(2 * time.Second):
			}
			ptmx.Close()
			<-read
		}
	} else {
		sys.Setpgid = true
		cmd.SysProcAttr = sys
		cmd.Stdout = procWriter{p, FrameStdout, gate}
		cmd.Stderr = procWriter{p, FrameStderr, gate}
		cmd.WaitDelay = 2 * time.Second // background children holding the pipes
		if req.Stdin {
			stdin, err := cmd.StdinPipe()
			if err != nil {
				return fmt.Errorf("exec: %w", err)
			}
			in, eof = stdin, func() { stdin.Close() }
		}
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("exec %s: %w", cmd.Args[0], err)
		}
		drain = func() {}
	}
	pgid := cmd.Process.Pid
	p.info.PID = pgid
	// The command inherited the server's exemption from the OOM killer
	// (ProtectFromOOM): give it back the default, so that a command that
	// exhausts the guest's memory is what the OOM killer takes.
	if err := setOOMScoreAdj(strconv.Itoa(pgid), 0); err != nil {
		s.log().Warn("exec: the command's OOM score", "pid", pgid, "err", err)
	}
	var mu sync.Mutex
	timedOut, exited := false, false
	// kill signals the process group while it can still be ours: once
	// Wait has reaped the leader, the id may be reused.
	p.kill = func(sig syscall.Signal) {
		mu.Lock()
		defer mu.Unlock()
		if !exited {
			unix.Kill(-pgid, sig)
		}
	}
	if req.TimeoutMs > 0 {
		// The timeout bounds the whole process group: what the process
		// left running in it when it ended (a fork bomb's copies after
		// the OOM killer took the first) is killed at the deadline too.
		time.AfterFunc(time.Duration(req.TimeoutMs)*time.Millisecond, func() {
			mu.Lock()
			timedOut = !exited
			ended := exited
			mu.Unlock()
			if !ended {
				p.kill(unix.SIGKILL)
			}
			if cgPath == "" {
				killLeftovers(pgid)
				return
			}
			if err := killCgroup(cgPath); err != nil {
				s.log().Error("exec: ending what the command left at its timeout; its process group next", "argv", argv, "err", err)
				killLeftovers(pgid)
				return
			}
			s.execKilled(cgPath)
		})
	}
	stop := context.AfterFunc(ctx, func() { p.kill(unix.SIGKILL) })
	if p.input != nil {
		// Input is written from its own goroutine, so a process slow to
		// read it holds up no connection's reader beyond the queue.
		go func() {
			for {
				select {
				case b := <-p.input:
					if b == nil {
						eof()
						continue
					}
					in.Write(b)
				case <-p.done:
					return
				}
			}
		}()
	}
	s.procs.add(p)
	go func() {
		werr := cmd.Wait()
		drain()
		if cgPath != "" {
			s.execEnded(cgPath)
		}
		mu.Lock()
		exited = true
		st := ExitStatus{TimedOut: timedOut}
		mu.Unlock()
		stop()
		if ps := cmd.ProcessState; ps != nil {
			ws := ps.Sys().(syscall.WaitStatus)
			if ws.Signaled() {
				st.Signal = unix.SignalName(ws.Signal())
				st.Code = 128 + int(ws.Signal())
			} else {
				st.Code = ws.ExitStatus()
			}
		} else {
			s.log().Error("agent: wait", "argv", argv, "err", werr)
			st.Code = 255
		}
		// The table first: a client that saw the exit then finds the
		// table as it is after it (the oldest exited ones forgotten).
		s.procs.ended(p)
		p.finish(st)
	}()
	// Registered before the client learns the ID, so a Signal right after
	// it finds the process.
	if err := reply(c, ExecStarted{ID: p.info.ID, PID: pgid}); err != nil {
		return nil // the process goes on; it can be attached to
	}
	if _, err := p.attach(c, false); err != nil {
		return nil
	}
	openGate()
	p.follow(c)
	return nil
}

// startPTY starts cmd as the leader of a new session whose controlling
// terminal is a new pty of size ws, and returns the pty's master side;
// sys says the rest of how it starts.
func startPTY(cmd *exec.Cmd, sys *syscall.SysProcAttr, ws WindowSize) (*os.File, error) {
	ptmx, tty, err := pty.Open()
	if err != nil {
		return nil, fmt.Errorf("open a pty: %w", err)
	}
	defer tty.Close()
	fail := func(err error) (*os.File, error) { ptmx.Close(); return nil, err }
	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: ws.Rows, Cols: ws.Cols}); err != nil {
		return fail(fmt.Errorf("size the pty: %w", err))
	}
	if cred := sys.Credential; cred != nil { // the user's own terminal, as login makes it
		if err := tty.Chown(int(cred.Uid), int(cred.Gid)); err != nil {
			return fail(fmt.Errorf("give the pty to %d: %w", cred.Uid, err))
		}
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	sys.Setsid, sys.Setctty, sys.Ctty = true, true, 0
	cmd.SysProcAttr = sys
	if err := cmd.Start(); err != nil {
		return fail(err)
	}
	return ptmx, nil
}

// killLeftovers kills process group pgid until none of it lives, for at
// most killLeftoversFor: a fork bomb's copies fork while a kill goes
// through the group, and those the kill missed fork again at once, so it
// signals the group in bursts until a look at /proc finds none alive. The
// group's id cannot have been given to another group while a member
// lives (the kernel keeps the number while it is in use, a zombie's too),
// and it is only signalled after a member was seen.
func killLeftovers(pgid int) {
	deadline := time.Now().Add(killLeftoversFor)
	for groupHasMembers(pgid) && time.Now().Before(deadline) {
		for range 64 {
			if unix.Kill(-pgid, unix.SIGKILL) != nil {
				break // ESRCH: none left to signal
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// killLeftoversFor bounds killLeftovers.
const killLeftoversFor = 10 * time.Second

// groupHasMembers reports whether a live process of group pgid exists
// (a zombie, killed and not yet reaped, does not count), from
// /proc/PID/stat (the state is the third field and the group the fifth,
// after the command's name in parentheses, which may itself hold any
// byte).
func groupHasMembers(pgid int) bool {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return false
	}
	want := strconv.Itoa(pgid)
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 2 && f[2] == want && f[0] != "Z" && f[0] != "X" {
			return true
		}
	}
	return false
}

// ProtectFromOOM exempts the calling process (the agent server) from the
// guest's OOM killer: otherwise, once a command (a fork bomb, a memory
// eater) has exhausted the guest's memory, the server, with more memory
// than any one of the command's processes, is the killer's choice, and the
// sandbox stops answering (TestHostileWorkloads). Every command the server
// starts gets the default back at once; what the command forks before
// that (it has not run its own code yet when Start returns, so in
// practice nothing) keeps the exemption.
func ProtectFromOOM() error { return setOOMScoreAdj("self", -1000) }

// setOOMScoreAdj writes /proc/PID/oom_score_adj.
func setOOMScoreAdj(pid string, adj int) error {
	if err := os.WriteFile("/proc/"+pid+"/oom_score_adj", []byte(strconv.Itoa(adj)), 0); err != nil {
		return fmt.Errorf("oom_score_adj: %w", err)
	}
	return nil
}
