// Package agent is capsa's guest agent and its host client, and the
// protocol they share.
//
// One connection carries one operation, like HTTP/1.0: the client dials the
// agent's vsock port, the two exchange Hello frames, the client sends one
// Request, and the operation streams on that connection until it ends.
// Several operations run at once over several connections.
//
// Frames are [4-byte big-endian payload length][1-byte type][payload].
// Control payloads are JSON; stream payloads (stdin, stdout, stderr, file
// data) are raw bytes. Both sides treat the other as hostile: frames are
// bounded, JSON is strict, and every reply is checked against what the
// operation expects.
package agent

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/capsa-sandbox/capsa/internal/strictjson"
	"io"
	"slices"
	"sync"
	"syscall"
)

// ProtocolVersion is the newest protocol version this package speaks, and
// MinProtocolVersion the oldest. Each side's Hello gives its range; the
// agent answers with the newest version in both and the features it has,
// so a newer host still talks to an older agent (one frozen in a snapshot)
// and asks it only for what it announced.
const (
	ProtocolVersion    = 2
	MinProtocolVersion = 2
)

// Features an agent may announce in its Hello.
const (
	// FeatureProcesses: a process table (list, attach, wait); processes
	// outlive the connection that started them.
	FeatureProcesses = "processes"
	// FeaturePTY: processes on a pseudo-terminal, resized by Resize frames.
	FeaturePTY = "pty"
	// FeatureResumed: the host tells the guest it ran again after a pause
	// or a restore (OpResumed).
	FeatureResumed = "resumed"
	// FeatureRename: rename a file or directory (OpRename).
	FeatureRename = "rename"
	// FeatureWatch: a directory's changes as they happen (OpWatch).
	FeatureWatch = "watch"
	// FeatureOwners: FileInfo carries the owner and group, by ID and name.
	FeatureOwners = "owners"
	// FeatureDial: a TCP connection to a port of the guest (OpDial).
	FeatureDial = "dial"
	// FeatureXattrs: a write sets user extended attributes
	// (Request.Xattrs), a stat or list returns them (WithXattrs), and a
	// watch refuses a network file system unless asked (AllowNetwork).
	FeatureXattrs = "xattrs"
	// FeatureSync: the guest's dirty pages written to its disks (OpSync).
	FeatureSync = "sync"
)

// agentFeatures is what this package's agent announces.
var agentFeatures = []string{FeatureProcesses, FeaturePTY, FeatureResumed, FeatureRename, FeatureWatch, FeatureOwners, FeatureDial, FeatureXattrs, FeatureContainers, FeatureTree, FeatureReadFiles, FeatureSync}

// Port is the vsock port the agent listens on; ReadyPort is the host port
// the agent connects to once it is listening, to announce itself.
const (
	Port      = 1024
	ReadyPort = 1023
)

// MaxFrame bounds a frame's payload.
const MaxFrame = 1 << 20

// chunk is the size of stream frames the agent and client send.
const chunk = 256 << 10

// FrameType says what a frame carries.
type FrameType uint8

// Frame types.
const (
	FrameHello FrameType = iota + 1
	FrameError
	FrameRequest
	FrameReply // the operation's JSON reply
	FrameData
	FrameEnd
	FrameStdin
	FrameStdinClose
	FrameStdout
	FrameStderr
	FrameSignal
	FrameExit
	FrameResize // a pty process's new window size (WindowSize)
	frameLimit
)

func (t FrameType) String() string {
	names := [...]string{"", "Hello", "Error", "Request", "Reply", "Data", "End", "Stdin", "StdinClose",
		"Stdout", "Stderr", "Signal", "Exit", "Resize"}
	if t > 0 && t < frameLimit {
		return names[t]
	}
	return fmt.Sprintf("frame type %d", uint8(t))
}

// Hello opens a connection, from each side. The client's gives the range
// of versions it speaks; the agent's, the version chosen and its features.
type Hello struct {
	Version    int      `json:"version"`               // the newest spoken (agent: the one chosen)
	MinVersion int      `json:"min_version,omitempty"` // the oldest spoken; 0: only Version
	Name       string   `json:"name"`                  // client or agent name and version
	Features   []string `json:"features,omitempty"`    // the agent's
}

// oldest is the oldest version h speaks.
func (h Hello) oldest() int {
	if h.MinVersion == 0 {
		return h.Version
	}
	return h.MinVersion
}

// negotiate picks the newest version both a client's and an agent's
// ranges hold.
func negotiate(client, agent Hello) (int, error) {
	v := min(client.Version, agent.Version)
	if client.oldest() > client.Version || v < max(client.oldest(), agent.oldest()) {
		return 0, fmt.Errorf("%w: client speaks %d..%d, agent %d..%d", ErrVersion,
			client.oldest(), client.Version, agent.oldest(), agent.Version)
	}
	return v, nil
}

// has reports whether the agent's Hello announced feature.
func (h Hello) has(feature string) bool {
	return feature == "" || slices.Contains(h.Features, feature)
}

// ErrorReply is an Error frame's payload.
type ErrorReply struct {
	Message string `json:"message"`
	Errno   int    `json:"errno,omitempty"` // the Linux errno behind it, if any
}

// maxErrno bounds the errno a reply may carry (Linux's are below 4096).
const maxErrno = 4095

// RemoteError is an error the other side reported. With Errno set it
// unwraps to it, so errors.Is(err, fs.ErrNotExist) works on a guest's
// "no such file".
type RemoteError struct {
	Message string
	Errno   syscall.Errno
}

func (e *RemoteError) Error() string { return e.Message }

func (e *RemoteError) Unwrap() error {
	if e.Errno == 0 {
		return nil
	}
	return e.Errno
}

// Operations' names; Operations describes each.
const (
	OpExec      = "exec"
	OpRead      = "read"
	OpWrite     = "write"
	OpStat      = "stat"
	OpList      = "list"
	OpMkdir     = "mkdir"
	OpRemove    = "remove"
	OpExists    = "exists"
	OpInfo      = "info"
	OpShutdown  = "shutdown"
	OpSignal    = "signal"
	OpSymlink   = "symlink"
	OpChown     = "chown"
	OpProcesses = "processes"
	OpAttach    = "attach"
	OpWait      = "wait"
	OpResumed   = "resumed"
	OpRename    = "rename"
	OpWatch     = "watch"
	OpDial      = "dial"
	OpSync      = "sync"
)

// An Operation is one request a client may make: the table that the
// agent's server, its client and the tools built on them (the CLI, the
// MCP server) all follow.
type Operation struct {
	Name string
	// Path: the request names a guest file in Request.Path, which must
	// be absolute.
	Path bool
	// Feature is what the agent must announce for it ("": every agent).
	Feature string
	Doc     string
}

// Operations is every operation the protocol has.
var Operations = []Operation{
	{Name: OpExec, Doc: "start a process (Request.Exec) and stream its input and output until it exits"},
	{Name: OpRead, Path: true, Doc: "stream a file's contents"},
	{Name: OpWrite, Path: true, Doc: "stream data into a file, replacing it atomically or appending"},
	{Name: OpStat, Path: true, Doc: "describe a file, not following a final symlink"},
	{Name: OpList, Path: true, Doc: "list a directory"},
	{Name: OpMkdir, Path: true, Doc: "make a directory, and its parents if asked"},
	{Name: OpRemove, Path: true, Doc: "remove a file, an empty directory or a whole tree"},
	{Name: OpExists, Path: true, Doc: "say whether a file exists"},
	{Name: OpSymlink, Path: true, Doc: "make Path a symbolic link to Target"},
	{Name: OpChown, Path: true, Doc: "set the owner of Path (a symlink's own)"},
	{Name: OpInfo, Doc: "describe the guest"},
	{Name: OpShutdown, Doc: "shut the guest down"},
	{Name: OpSignal, Doc: "signal a process's group, by ID"},
	{Name: OpProcesses, Feature: FeatureProcesses, Doc: "list the processes the agent started: running, and the most recent that exited"},
	{Name: OpAttach, Feature: FeatureProcesses, Doc: "replay a process's recent output, then stream it (and its input) until it exits"},
	{Name: OpWait, Feature: FeatureProcesses, Doc: "wait for a process to exit and return its status"},
	{Name: OpRename, Path: true, Feature: FeatureRename, Doc: "rename Path to Target (absolute), replacing a file there as rename(2) does"},
	{Name: OpWatch, Path: true, Feature: FeatureWatch, Doc: "stream the changes in directory Path (and below it with Recursive) as WatchEvent data frames, until the client hangs up"},
	{Name: OpDial, Feature: FeatureDial, Doc: "connect to the guest's TCP port Port on its loopback, then carry the connection's bytes both ways as Data frames (End: that side is done writing)"},
	{Name: OpTree, Path: true, Feature: FeatureTree, Doc: "stream the inventory of the tree under directory Path (every entry's path, type, size, times, inode, owner and link target, on Path's file system and below the mount points in Mounts) as data frames of entries, then End"},
	{Name: OpReadFiles, Feature: FeatureReadFiles, Doc: "read several small files in one reply (Paths: at most MaxReadFiles, each at most MaxReadFileSize bytes): each one's contents, or why it could not be read"},
	{Name: OpSync, Feature: FeatureSync, Doc: "write what the guest's file systems hold in memory to their disks (sync(2)), and answer once written"},
	{Name: OpResumed, Feature: FeatureResumed, Doc: "the guest runs again after a pause or a restore (Request.Resumed): set its wall clock, mix a seed into its random number generator, set its hostname"},
}

// LookupOperation returns the operation named name.
func LookupOperation(name string) (Operation, bool) {
	for _, op := range Operations {
		if op.Name == name {
			return op, true
		}
	}
	return Operation{}, false
}

// ErrUnsupported is wrapped by the error for an operation the agent did
// not announce (an older agent).
var ErrUnsupported = errors.New("not supported by this agent")

// Owner is a file's numeric owner and group.
type Owner struct {
	UID int `json:"uid"`
	GID int `json:"gid"`
}

// Request is the one request of a connection.
type Request struct {
	Op        string       `json:"op"`
	Exec      *ExecRequest `json:"exec,omitempty"`
	Path      string       `json:"path,omitempty"`
	Mode      uint32       `json:"mode,omitempty"`
	Parents   bool         `json:"parents,omitempty"`
	Recursive bool         `json:"recursive,omitempty"`
	Append    bool         `json:"append,omitempty"`
	ID        int          `json:"id,omitempty"`        // OpSignal, OpAttach, OpWait: the process's ExecStarted.ID
	Signal    string       `json:"signal,omitempty"`    // OpSignal: the signal's name
	Target    string       `json:"target,omitempty"`    // OpSymlink: where the link points; OpRename: the new path
	Owner     *Owner       `json:"owner,omitempty"`     // OpChown
	Resumed   *Resumed     `json:"resumed,omitempty"`   // OpResumed
	NoReplay  bool         `json:"no_replay,omitempty"` // OpAttach: only output from now on
	Port      int          `json:"port,omitempty"`      // OpDial: the guest's TCP port
	// OpWrite: user extended attributes (names without "user.") the
	// file gets (FeatureXattrs).
	Xattrs map[string]string `json:"xattrs,omitempty"`
	// OpStat, OpList: FileInfo.Xattrs filled (FeatureXattrs).
	WithXattrs bool `json:"with_xattrs,omitempty"`
	// OpWatch: a directory on a network file system (9P, NFS, SMB) is
	// watched, though only the guest's own changes show (FeatureXattrs).
	AllowNetwork bool `json:"allow_network,omitempty"`
	// OpTree: mount points below Path whose trees are walked too.
	Mounts []string `json:"mounts,omitempty"`
	// OpReadFiles: the files read, absolute paths.
	Paths []string `json:"paths,omitempty"`
}

// Resumed is what the host tells a guest that runs again after a pause or
// a restore from a snapshot: its own clock stood still meanwhile, and a
// restored copy must not share its random state and name with the others.
type Resumed struct {
	TimeNs   int64  `json:"time_ns"`            // the wall clock, in Unix nanoseconds
	Seed     []byte `json:"seed,omitempty"`     // mixed into the kernel's random number generator
	Hostname string `json:"hostname,omitempty"` // set when not empty
}

// ExecRequest starts a process: Argv, or Shell run by /bin/sh -c.
type ExecRequest struct {
	Argv      []string `json:"argv,omitempty"`
	Shell     string   `json:"shell,omitempty"`
	Env       []string `json:"env,omitempty"` // KEY=VALUE, added to the agent's base environment
	Dir       string   `json:"dir,omitempty"`
	User      string   `json:"user,omitempty"` // name or uid[:gid]; empty: root
	Stdin     bool     `json:"stdin,omitempty"`
	TimeoutMs int64    `json:"timeout_ms,omitempty"`
	// TTY, if set, runs the process on a pseudo-terminal of this size
	// (FeaturePTY): stdout carries its merged output, stdin goes to the
	// terminal (so ^C is an interrupt), Resize frames change its size.
	TTY *WindowSize `json:"tty,omitempty"`
	// Container, if set, runs the process as a container's
	// (FeatureContainers): see Container.
	Container *Container `json:"container,omitempty"`
}

// WindowSize is a terminal's size in characters.
type WindowSize struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// name is how errors name the process: its program, or the shell.
func (r *ExecRequest) name() string {
	if len(r.Argv) > 0 {
		return r.Argv[0]
	}
	return "/bin/sh -c"
}

// ExecStarted is the reply to an exec or attach request.
type ExecStarted struct {
	ID  int `json:"id"`  // the process's ID in the agent's table
	PID int `json:"pid"` // its guest PID (and process group)
}

// ProcessInfo describes a process in the agent's table.
type ProcessInfo struct {
	ID        int         `json:"id"`
	PID       int         `json:"pid"`
	Argv      []string    `json:"argv"` // as run (a shell command as /bin/sh -c)
	TTY       bool        `json:"tty,omitempty"`
	StartedNs int64       `json:"started_ns"` // guest wall clock
	Exit      *ExitStatus `json:"exit,omitempty"`
}

// ProcessList is the reply to a processes request.
type ProcessList struct {
	Processes []ProcessInfo `json:"processes"`
}

// ExitStatus ends an exec: how the process ended.
type ExitStatus struct {
	Code     int    `json:"code"`             // exit code, or 128+signal
	Signal   string `json:"signal,omitempty"` // the terminating signal, if any
	TimedOut bool   `json:"timed_out,omitempty"`
}

// SignalRequest asks the agent to signal a running exec's process group.
type SignalRequest struct {
	Name string `json:"name"`
}

// FileInfo describes a file.
type FileInfo struct {
	Name      string `json:"name"`
	Size      int64  `json:"size"`
	Mode      uint32 `json:"mode"` // permission bits and type bits as in os.FileMode
	ModTimeNs int64  `json:"mtime_ns"`
	IsDir     bool   `json:"is_dir,omitempty"`
	IsSymlink bool   `json:"is_symlink,omitempty"`
	Target    string `json:"target,omitempty"` // a symlink's
	// The owner and group (FeatureOwners), by ID and by the guest's name
	// for it ("": none in its /etc/passwd or /etc/group).
	UID   int    `json:"uid"`
	GID   int    `json:"gid"`
	Owner string `json:"owner,omitempty"`
	Group string `json:"group,omitempty"`
	// Xattrs are its user extended attributes, names without "user."
	// (asked with WithXattrs; at most MaxXattrs, values that are text).
	Xattrs map[string]string `json:"xattrs,omitempty"`
}

// Bounds on user extended attributes as the agent sets and reports them.
const (
	MaxXattrs     = 64
	MaxXattrName  = 200
	MaxXattrValue = 4096
)

// WatchEvent is one change in a watched directory (OpWatch): Name is the
// changed file's path relative to the watched directory, Op what happened
// to it. Op "overflow" says that events were lost (the guest kernel's
// queue filled); Name is then empty.
type WatchEvent struct {
	Name string `json:"name"`
	Op   string `json:"op"` // create, write, remove, rename, chmod or overflow
}

// What a WatchEvent's Op says.
const (
	WatchCreate   = "create"
	WatchWrite    = "write"
	WatchRemove   = "remove"
	WatchRename   = "rename"
	WatchChmod    = "chmod"
	WatchOverflow = "overflow"
)

// DirList is the reply to a list request.
type DirList struct {
	Entries []FileInfo `json:"entries"`
}

// ExistsReply is the reply to an exists request.
type ExistsReply struct {
	Exists bool `json:"exists"`
}

// Info describes the guest.
type Info struct {
	KernelVersion string `json:"kernel_version"`
	Hostname      string `json:"hostname"`
	CPUs          int    `json:"cpus"`
	MemoryBytes   uint64 `json:"memory_bytes"`
	AgentVersion  string `json:"agent_version"`
}

// Empty is the reply of operations that only succeed or fail.
type Empty struct{}

// Conn frames a connection. Writes are safe for concurrent use; reads
// belong to one goroutine.
type Conn struct {
	rw  io.ReadWriter
	wmu sync.Mutex
	hdr [5]byte
}

// NewConn frames rw.
func NewConn(rw io.ReadWriter) *Conn { return &Conn{rw: rw} }

// WriteFrame sends one frame.
func (c *Conn) WriteFrame(t FrameType, payload []byte) error {
	if len(payload) > MaxFrame {
		return fmt.Errorf("agent: %v frame of %d bytes exceeds %d", t, len(payload), MaxFrame)
	}
	// A small frame goes out in one write. Above all, a frame never ends
	// with a separate empty write: the peer may have read the header of an
	// empty End frame, answered and closed by then.
	if len(payload) <= smallFrame {
		buf := make([]byte, 5, 5+len(payload))
		binary.BigEndian.PutUint32(buf, uint32(len(payload)))
		buf[4] = byte(t)
		c.wmu.Lock()
		defer c.wmu.Unlock()
		_, err := c.rw.Write(append(buf, payload...))
		return err
	}
	var hdr [5]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(payload)))
	hdr[4] = byte(t)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if _, err := c.rw.Write(hdr[:]); err != nil {
		return err
	}
	_, err := c.rw.Write(payload)
	return err
}

// smallFrame is the largest payload sent in the same write as its header.
const smallFrame = 4096

// WriteJSON sends v as a frame of type t.
func (c *Conn) WriteJSON(t FrameType, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return c.WriteFrame(t, b)
}

// WriteError sends an Error frame.
func (c *Conn) WriteError(err error) error {
	return c.WriteJSON(FrameError, errorReplyOf(err))
}

// errorReplyOf is err as the other side reads it: its message, and the
// errno behind it, if any.
func errorReplyOf(err error) ErrorReply {
	r := ErrorReply{Message: err.Error()}
	var errno syscall.Errno
	if errors.As(err, &errno) && errno > 0 && errno <= maxErrno {
		r.Errno = int(errno)
	}
	return r
}

// remote is an ErrorReply received as the error it stands for, checked.
func (e ErrorReply) remote() error {
	if e.Errno < 0 || e.Errno > maxErrno {
		return fmt.Errorf("agent: bad %T: errno %d", e, e.Errno)
	}
	return &RemoteError{Message: e.Message, Errno: syscall.Errno(e.Errno)}
}

// ReadFrame reads one frame. The payload is valid until the next call.
func (c *Conn) ReadFrame() (FrameType, []byte, error) {
	if _, err := io.ReadFull(c.rw, c.hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(c.hdr[:])
	t := FrameType(c.hdr[4])
	if t == 0 || t >= frameLimit {
		return 0, nil, fmt.Errorf("agent: unknown frame type %d", c.hdr[4])
	}
	if n > MaxFrame {
		return 0, nil, fmt.Errorf("agent: %v frame of %d bytes exceeds %d", t, n, MaxFrame)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(c.rw, b); err != nil {
		return 0, nil, fmt.Errorf("agent: truncated %v frame: %w", t, err)
	}
	return t, b, nil
}

// decodeStrict decodes JSON that must match v exactly.
func decodeStrict(b []byte, v any) error {
	if err := strictjson.Decode(b, v); err != nil {
		return fmt.Errorf("agent: bad %T: %w", v, err)
	}
	return nil
}

// ReadJSON reads a frame of type want into v. An Error frame is returned as
// a *RemoteError; any other type is a protocol error.
func (c *Conn) ReadJSON(want FrameType, v any) error {
	t, b, err := c.ReadFrame()
	if err != nil {
		return err
	}
	return expectJSON(t, b, want, v)
}

func expectJSON(t FrameType, b []byte, want FrameType, v any) error {
	switch t {
	case want:
		return decodeStrict(b, v)
	case FrameError:
		var e ErrorReply
		if err := decodeStrict(b, &e); err != nil {
			return err
		}
		return e.remote()
	}
	return fmt.Errorf("agent: got a %v frame, expected %v", t, want)
}

// ErrVersion is returned when the two sides speak different versions.
var ErrVersion = errors.New("agent: protocol version mismatch")
