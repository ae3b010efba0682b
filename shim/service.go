package shim

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	cgstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/errdefs"
	"github.com/containerd/containerd/identifiers"
	"github.com/containerd/containerd/mount"
	"github.com/containerd/containerd/namespaces"
	"github.com/containerd/containerd/pkg/shutdown"
	"github.com/containerd/containerd/protobuf"
	ptypes "github.com/containerd/containerd/protobuf/types"
	"github.com/containerd/containerd/runtime"
	cdshim "github.com/containerd/containerd/runtime/v2/shim"
	"github.com/containerd/fifo"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	"github.com/moby/sys/mountinfo"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

var _ taskAPI.TaskService = (*service)(nil)

// podGuestDir is where the pod's directory appears in its guest.
const podGuestDir = "/capsa-pod"

// service is containerd's Task service for one pod: the containers of
// one group, in one capsa sandbox.
type service struct {
	ctx       context.Context
	log       *slog.Logger
	publisher cdshim.Publisher
	shutdown  shutdown.Service
	ns        string
	// bundles is the directory of containerd's bundles for this
	// namespace: a bundle elsewhere is refused.
	bundles string

	mu         sync.Mutex
	containers map[string]*container
	pod        *pod
}

// pod is the group's VM: a named sandbox of the state directory's
// manager, with a host directory shared into it at podGuestDir.
type pod struct {
	podInfo
	mgr    *supervisor.Manager
	handle *supervisor.Handle
	pid    uint32 // the supervisor's (the VMM's) host PID
}

// podInfo is what a bundle's podFile records.
type podInfo struct {
	Name    string `json:"name"`    // the capsa sandbox
	State   string `json:"state"`   // its state directory
	Dir     string `json:"dir"`     // the shared host directory
	Sandbox bool   `json:"sandbox"` // this container is the pod's sandbox container
}

type container struct {
	id, bundle string
	spec       *specs.Spec
	rootfs     string // its root's mount point on the host, in the pod directory
	sandbox    bool
	// podSandbox: CRI's sandbox (pause) container, which is the pod VM
	// itself: it runs no process of its own, and ends when killed.
	podSandbox bool
	paused     bool              // its pod VM is paused (Pause, a pod of one container)
	frozen     bool              // its cgroup in the guest is frozen (Pause, in a pod of several)
	binds      map[string]string // bind mounts' host sources to guest paths
	init       *process
	execs      map[string]*process
}

// process is a container's init or one of its execs.
type process struct {
	c                     *container
	execID                string
	spec                  *specs.Process
	stdin, stdout, stderr string
	terminal              bool

	// oomKills is its container's count of OOM kills when the process
	// started: one more when it ends by SIGKILL is reported as its OOM.
	oomKills int64

	mu       sync.Mutex
	status   task.Status
	proc     *agent.Process
	in       io.Closer // the stdin fifo, closed by CloseIO
	exitCode uint32
	exitedAt time.Time
	done     chan struct{}
}

func newService(ctx context.Context, log *slog.Logger, publisher cdshim.Publisher, sd shutdown.Service) (*service, error) {
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, err
	}
	cwd, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	s := &service{ctx: ctx, log: log, publisher: publisher, shutdown: sd, ns: ns,
		bundles: filepath.Dir(cwd), containers: map[string]*container{}}
	sd.RegisterCallback(func(context.Context) error {
		s.stopPod()
		return nil
	})
	return s, nil
}

// RegisterTTRPC serves the Task API v2.
func (s *service) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTaskService(server, s)
	return nil
}

// UnaryInterceptor gives every error the status code of the errdefs
// error it wraps, as containerd reads it (a kill of a process that has
// ended must read as not found, not unknown).
func (s *service) UnaryInterceptor() ttrpc.UnaryServerInterceptor {
	return func(ctx context.Context, um ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, m ttrpc.Method) (any, error) {
		resp, err := m(ctx, um)
		return resp, errdefs.ToGRPC(err)
	}
}

func (s *service) publish(topic string, event any) {
	ctx := namespaces.WithNamespace(context.WithoutCancel(s.ctx), s.ns)
	if err := s.publisher.Publish(ctx, topic, event); err != nil {
		s.log.Warn("shim: publish an event", "topic", topic, "err", err)
	}
}

// stateDir is the capsa state directory the shim's pods live in: the
// default one (CAPSA_STATE or the user's), else /var/lib/capsa, as
// containerd's services often have no home.
func stateDir() string {
	if d := os.Getenv("CAPSA_STATE"); d != "" {
		return d
	}
	if h, err := os.UserHomeDir(); err == nil && h != "" && h != "/" {
		return filepath.Join(h, ".local", "state", "capsa")
	}
	return "/var/lib/capsa"
}

// startPod boots the group's VM, sized by the sandbox container's spec.
func (s *service) startPod(ctx context.Context, spec *specs.Spec, group string) (*pod, error) {
	mgr, err := supervisor.OpenManager(stateDir())
	if err != nil {
		return nil, fmt.Errorf("open capsa's state: %w", err)
	}
	name := podName(s.ns, group)
	dir := filepath.Join(mgr.Dir(), "pods", name)
	if old, err := mgr.Get(name); err == nil {
		if old.Alive() {
			// Its directory is that pod's: left as it is.
			return nil, fmt.Errorf("pod %s runs already", name)
		}
		mgr.Remove(ctx, name) // a pod of the same id that ended
	}
	// A pod that does not start leaves no directory behind, even one
	// sharePodDir made and then failed to mount.
	started := false
	defer func() {
		if !started {
			if rerr := removePodDir(dir); rerr != nil {
				s.log.Warn("shim: the pod's directory", "pod", name, "err", rerr)
			}
		}
	}()
	if err := sharePodDir(dir); err != nil {
		return nil, err
	}
	cpus, mem := podSize(spec)
	hostname := spec.Hostname
	if supervisor.CheckName(hostname) != nil {
		hostname = ""
	}
	// launch boots the VM, with the NIC tap if not nil.
	launch := func(tap *sandbox.TapSpec) error {
		b := sandbox.New().CPUs(cpus).Memory(mem).Share(dir, podGuestDir, sandbox.ReadWrite)
		if tap != nil {
			b.Tap(*tap)
		}
		sp, err := b.Run("sleep", "2147483647").Spec() // the VM lives until the shim stops it
		if err != nil {
			return fmt.Errorf("pod %s: %w", name, err)
		}
		rec := &supervisor.Record{Name: name, Spec: sp, HostMounts: true, Hostname: hostname,
			Labels: map[string]string{"containerd.namespace": s.ns, "containerd.pod": group}}
		if _, err := mgr.Launch(ctx, rec, nil); err != nil {
			return fmt.Errorf("boot the pod VM: %w", err)
		}
		return nil
	}
	if ns := netnsPath(spec); ns != "" {
		// CRI's pod: the VM's supervisor starts in the pod's network
		// namespace, its NIC on a tap joined to the pod's interface.
		err = inNetns(ns, func() error {
			tap, err := joinPodNetwork()
			if err != nil {
				return err
			}
			return launch(tap)
		})
	} else {
		err = launch(nil)
	}
	if err != nil {
		return nil, err
	}
	h, err := mgr.Open(ctx, name)
	if err != nil {
		// Stopped even where the request was canceled: its directory
		// goes next.
		stopCtx := context.WithoutCancel(ctx)
		mgr.Stop(stopCtx, name, 0, true)
		mgr.Remove(stopCtx, name)
		return nil, err
	}
	started = true
	r, _ := mgr.Get(name)
	p := &pod{podInfo: podInfo{Name: name, State: mgr.Dir(), Dir: dir}, mgr: mgr, handle: h}
	if r != nil {
		p.pid = uint32(r.PID)
	}
	return p, nil
}

// podPID is the pod VM's supervisor's host PID, the task's PID containerd
// sees (0 without a VM).
func (s *service) podPID() uint32 {
	if pd := s.currentPod(); pd != nil {
		return pd.pid
	}
	return 0
}

// currentPod is the pod VM, or nil once it is gone.
func (s *service) currentPod() *pod {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pod
}

// execsOf is a container's execs at this moment.
func (s *service) execsOf(c *container) []*process {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Collect(maps.Values(c.execs))
}

// stopPod stops and removes the pod VM, if there is one.
func (s *service) stopPod() {
	s.mu.Lock()
	p := s.pod
	s.pod = nil
	s.mu.Unlock()
	if p == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.mgr.Stop(ctx, p.Name, 0, true); err != nil && !errors.Is(err, supervisor.ErrNotFound) {
		s.log.Warn("shim: stop the pod VM", "pod", p.Name, "err", err)
	}
	p.mgr.Remove(ctx, p.Name)
	if err := removePodDir(p.Dir); err != nil {
		s.log.Warn("shim: the pod's directory", "pod", p.Name, "err", err)
	}
}

// sharePodDir makes the pod's directory, which the pod VM shares, a mount
// of its own with shared propagation, in a peer group of its own: the
// container roots and binds mounted beneath it later, in the shim's mount
// namespace, then reach the VM's supervisor, whose jail holds the
// directory as a slave of it (store.Record.HostMounts), and nothing else.
// (A bind made where / is shared, systemd's default, would join /'s peer
// group, and each mount beneath it would be copied to every mount
// namespace of the host: made private first, it leaves that group.) A
// directory left a mount by a shim that died is made shared again, not
// mounted twice.
func sharePodDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("the pod's directory: %w", err)
	}
	mounted, err := mountinfo.Mounted(dir)
	if err != nil {
		return fmt.Errorf("the pod's directory: %w", err)
	}
	if !mounted {
		if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("the pod's directory: bind %s on itself: %w", dir, err)
		}
	}
	for _, p := range []struct {
		flag uintptr
		kind string
	}{{unix.MS_PRIVATE, "private"}, {unix.MS_SHARED, "shared"}} {
		if err := unix.Mount("", dir, "", p.flag, ""); err != nil {
			unix.Unmount(dir, unix.MNT_DETACH)
			return fmt.Errorf("the pod's directory: make %s %s: %w", dir, p.kind, err)
		}
	}
	return nil
}

// removePodDir undoes sharePodDir, with whatever is still mounted
// beneath, and removes the directory, unless something is still mounted
// at or beneath it then (a removal would go into it).
func removePodDir(dir string) error {
	// mountinfo's table holds real paths: a symbolic link above dir
	// would hide what is mounted beneath it from the check below.
	real, err := filepath.EvalSymlinks(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return fmt.Errorf("the pod's directory: %w", err)
	}
	dir = real
	ok, err := mountinfo.Mounted(dir)
	if err != nil {
		return fmt.Errorf("the pod's directory: %w", err)
	}
	if ok {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("the pod's directory: unmount %s: %w", dir, err)
		}
	}
	if left, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir)); err != nil || len(left) > 0 {
		return fmt.Errorf("the pod's directory %s: %d mounts left at or beneath it (%v): not removed", dir, len(left), err)
	}
	return os.RemoveAll(dir)
}

// Create makes a container: the pod VM if it is the first, the
// container's root mounted into the pod's directory.
func (s *service) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *taskAPI.CreateTaskResponse, retErr error) {
	if err := identifiers.Validate(r.ID); err != nil {
		return nil, fmt.Errorf("create: the task's id: %w", err)
	}
	if r.Checkpoint != "" {
		return nil, fmt.Errorf("create %s: restoring a checkpoint: %w", r.ID, errdefs.ErrNotImplemented)
	}
	if filepath.Clean(r.Bundle) != filepath.Join(s.bundles, r.ID) {
		return nil, fmt.Errorf("create %s: bundle %s is not containerd's bundle for it: %w", r.ID, r.Bundle, errdefs.ErrInvalidArgument)
	}
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", r.ID, err)
	}
	if err := checkSpec(spec); err != nil {
		return nil, fmt.Errorf("create %s: %w: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	for _, p := range []string{r.Stdin, r.Stdout, r.Stderr} {
		if p != "" && !filepath.IsAbs(p) {
			return nil, fmt.Errorf("create %s: stdio %q: only fifo paths are supported: %w", r.ID, p, errdefs.ErrNotImplemented)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.containers[r.ID]; ok {
		return nil, fmt.Errorf("create %s: %w", r.ID, errdefs.ErrAlreadyExists)
	}
	first := s.pod == nil
	if first {
		p, err := s.startPod(ctx, spec, groupID(spec, r.ID))
		if err != nil {
			return nil, fmt.Errorf("create %s: %w", r.ID, err)
		}
		s.pod = p
		defer func() {
			if retErr != nil && len(s.containers) == 0 {
				s.mu.Unlock()
				s.stopPod()
				s.mu.Lock()
			}
		}()
	}
	c := &container{id: r.ID, bundle: r.Bundle, spec: spec, sandbox: first && isSandbox(spec), execs: map[string]*process{},
		podSandbox: spec.Annotations[annotationContainerType] == containerTypeSandbox}
	cdir := filepath.Join(s.pod.Dir, r.ID)
	c.rootfs = filepath.Join(cdir, "rootfs")
	if err := os.MkdirAll(c.rootfs, 0o700); err != nil {
		return nil, fmt.Errorf("create %s: %w", r.ID, err)
	}
	var mounts []mount.Mount
	for _, m := range r.Rootfs {
		mounts = append(mounts, mount.Mount{Type: m.Type, Source: m.Source, Target: m.Target, Options: m.Options})
	}
	if len(mounts) == 0 { // the bundle's own root directory
		root := spec.Root.Path
		if !filepath.IsAbs(root) {
			root = filepath.Join(r.Bundle, root)
		}
		mounts = []mount.Mount{{Type: "bind", Source: root, Options: []string{"rbind", "rw"}}}
	}
	if err := mount.All(mounts, c.rootfs); err != nil {
		os.RemoveAll(cdir)
		return nil, fmt.Errorf("create %s: mount its root: %w", r.ID, err)
	}
	undo := func() {
		unmountUnder(cdir)
		os.RemoveAll(cdir)
	}
	// The spec's bind mounts: each host source bound into the pod's
	// directory, where the guest reaches it; read-only on the host too
	// where every mount of it is read-only, so that not even the VMM
	// that serves it can write it.
	readOnly := map[string]bool{}
	for _, m := range spec.Mounts {
		if isBind(m) && !isPodShm(m) {
			ro, seen := readOnly[m.Source]
			readOnly[m.Source] = slices.Contains(m.Options, "ro") && (ro || !seen)
		}
	}
	binds := map[string]string{}
	for i, m := range spec.Mounts {
		if !isBind(m) || isPodShm(m) {
			continue
		}
		if _, ok := binds[m.Source]; ok {
			continue
		}
		st, err := os.Stat(m.Source)
		if err != nil {
			undo()
			return nil, fmt.Errorf("create %s: mount %s: %w", r.ID, m.Destination, err)
		}
		host := filepath.Join(cdir, "mounts", fmt.Sprint(i))
		if err := makeTarget(host, st.IsDir()); err != nil {
			undo()
			return nil, fmt.Errorf("create %s: %w", r.ID, err)
		}
		if err := unix.Mount(m.Source, host, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			undo()
			return nil, fmt.Errorf("create %s: share mount %s: %w", r.ID, m.Destination, err)
		}
		if readOnly[m.Source] {
			if err := unix.Mount("", host, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
				undo()
				return nil, fmt.Errorf("create %s: share mount %s read-only: %w", r.ID, m.Destination, err)
			}
		}
		binds[m.Source] = filepath.Join(podGuestDir, r.ID, "mounts", fmt.Sprint(i))
	}
	c.init = &process{c: c, spec: spec.Process, stdin: r.Stdin, stdout: r.Stdout, stderr: r.Stderr,
		terminal: r.Terminal || spec.Process.Terminal, status: task.Status_CREATED, done: make(chan struct{})}
	if _, err := s.containerRequest(c, spec.Process, binds); err != nil {
		undo()
		return nil, fmt.Errorf("create %s: %w: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	c.binds = binds
	info := s.pod.podInfo
	info.Sandbox = c.sandbox
	if data, err := json.Marshal(info); err == nil {
		os.WriteFile(filepath.Join(r.Bundle, podFile), data, 0o600)
	}
	s.containers[r.ID] = c
	s.publish(runtime.TaskCreateEventTopic, &eventstypes.TaskCreate{
		ContainerID: r.ID, Bundle: r.Bundle, Rootfs: r.Rootfs,
		IO:  &eventstypes.TaskIO{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: c.init.terminal},
		Pid: s.pod.pid,
	})
	return &taskAPI.CreateTaskResponse{Pid: s.pod.pid}, nil
}

// containerRequest is the agent's container for a process of c.
func (s *service) containerRequest(c *container, p *specs.Process, binds map[string]string) (*agent.Container, error) {
	return containerOf(c.spec, p, c.id, filepath.Join(podGuestDir, c.id, "rootfs"), binds)
}

func makeTarget(path string, dir bool) error {
	if dir {
		return os.MkdirAll(path, 0o700)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	return f.Close()
}

// unmountUnder unmounts every mount at or beneath dir, deepest first.
func unmountUnder(dir string) {
	binds := filepath.Join(dir, "mounts")
	entries, _ := os.ReadDir(binds)
	for _, e := range entries {
		mount.UnmountAll(filepath.Join(binds, e.Name()), unix.MNT_DETACH)
	}
	mount.UnmountAll(filepath.Join(dir, "rootfs"), unix.MNT_DETACH)
}

func (s *service) get(id, execID string) (*container, *process, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.containers[id]
	if !ok {
		return nil, nil, fmt.Errorf("container %s: %w", id, errdefs.ErrNotFound)
	}
	if execID == "" {
		return c, c.init, nil
	}
	p, ok := c.execs[execID]
	if !ok {
		return nil, nil, fmt.Errorf("container %s: exec %s: %w", id, execID, errdefs.ErrNotFound)
	}
	return c, p, nil
}

// Start starts a container's init process or one of its execs in the pod VM.
func (s *service) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	c, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if s.isFrozen(c) {
		return nil, fmt.Errorf("start %s: it is paused (resume it first): %w", r.ID, errdefs.ErrFailedPrecondition)
	}
	if r.ExecID != "" && c.init.state() != task.Status_RUNNING {
		return nil, fmt.Errorf("start exec %s: container %s is not running: %w", r.ExecID, r.ID, errdefs.ErrFailedPrecondition)
	}
	pd := s.currentPod()
	if pd == nil {
		return nil, fmt.Errorf("start %s: the pod VM is gone: %w", r.ID, errdefs.ErrFailedPrecondition)
	}
	if c.podSandbox && r.ExecID == "" {
		p.mu.Lock()
		if p.status != task.Status_CREATED {
			p.mu.Unlock()
			return nil, fmt.Errorf("start %s: it is %s, not created: %w", r.ID, p.status, errdefs.ErrFailedPrecondition)
		}
		p.status = task.Status_RUNNING
		p.mu.Unlock()
	} else if err := s.startProcess(ctx, pd, p); err != nil {
		return nil, fmt.Errorf("start %s: %w", r.ID, err)
	}
	if r.ExecID == "" {
		s.publish(runtime.TaskStartEventTopic, &eventstypes.TaskStart{ContainerID: r.ID, Pid: pd.pid})
	} else {
		s.publish(runtime.TaskExecStartedEventTopic, &eventstypes.TaskExecStarted{ContainerID: r.ID, ExecID: r.ExecID, Pid: pd.pid})
	}
	return &taskAPI.StartResponse{Pid: pd.pid}, nil
}

// startProcess runs p in the pod VM, its stdio on containerd's fifos.
func (s *service) startProcess(ctx context.Context, pd *pod, p *process) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.status != task.Status_CREATED {
		return fmt.Errorf("process is %s, not created: %w", p.status, errdefs.ErrFailedPrecondition)
	}
	creq, err := s.containerRequest(p.c, p.spec, p.c.binds)
	if err != nil {
		return err
	}
	// The fifos are opened for as long as the process runs, not for
	// the request: ctx ends with the Start call.
	bg := context.WithoutCancel(ctx)
	var closers []io.Closer
	fail := func(err error) error {
		for _, c := range closers {
			c.Close()
		}
		return err
	}
	opts := agent.ExecOptions{Argv: p.spec.Args, Env: p.spec.Env, Dir: p.spec.Cwd, Container: creq}
	var outsAndIn []io.Closer // closed once the process has ended
	if p.stdin != "" {
		in, err := fifo.OpenFifo(bg, p.stdin, syscall.O_RDONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			return fail(fmt.Errorf("open stdin: %w", err))
		}
		closers = append(closers, in)
		// A writer of the shim's own keeps the fifo from ending when
		// containerd's client closes its end: the input ends at CloseIO,
		// once what the client wrote has been read, as runc's shim does.
		keep, err := fifo.OpenFifo(bg, p.stdin, syscall.O_WRONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			return fail(fmt.Errorf("open stdin: %w", err))
		}
		closers = append(closers, keep)
		opts.Stdin, p.in = in, keep
		outsAndIn = append(outsAndIn, in)
	}
	if p.stdout != "" {
		out, err := fifo.OpenFifo(bg, p.stdout, syscall.O_WRONLY, 0)
		if err != nil {
			return fail(fmt.Errorf("open stdout: %w", err))
		}
		closers, outsAndIn = append(closers, out), append(outsAndIn, out)
		opts.Stdout = lenient{w: out}
	}
	if p.stderr != "" && !p.terminal {
		errw, err := fifo.OpenFifo(bg, p.stderr, syscall.O_WRONLY, 0)
		if err != nil {
			return fail(fmt.Errorf("open stderr: %w", err))
		}
		closers, outsAndIn = append(closers, errw), append(outsAndIn, errw)
		opts.Stderr = lenient{w: errw}
	}
	if p.terminal {
		opts.TTY = &agent.WindowSize{Rows: 24, Cols: 80}
	}
	// The container's cgroup is new when its init starts: no OOM kills.
	if p.execID != "" {
		p.oomKills = oomKills(ctx, pd, p.c.id)
	}
	proc, err := pd.handle.Stream(bg, opts)
	if err != nil {
		return fail(err)
	}
	p.proc, p.status = proc, task.Status_RUNNING
	go s.waitProcess(p, proc, outsAndIn)
	return nil
}

// oomKills is the count of OOM kills in the container's cgroup in the
// guest (memory.events' oom_kill: the processes of the container that any
// OOM killer took, its cgroup's or the guest's), -1 if it cannot be read.
// A process that ends by SIGKILL while the count rose is reported as
// killed for memory.
func oomKills(ctx context.Context, pd *pod, id string) int64 {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	b, err := pd.handle.ReadFile(ctx, path.Join(agent.ContainerCgroupPath(id), "memory.events"))
	if err != nil {
		return -1
	}
	return statValue(b, "oom_kill")
}

// statValue reads a key's number from a cgroup file's "key value" lines
// (-1: none).
func statValue(text []byte, key string) int64 {
	for _, l := range strings.Split(string(text), "\n") {
		if v, ok := strings.CutPrefix(l, key+" "); ok {
			if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
				return n
			}
		}
	}
	return -1
}

// lenient is a process's output fifo: once containerd's reader has gone,
// output is dropped rather than ending the process (the agent client
// kills a process whose writer fails).
type lenient struct{ w io.Writer }

func (l lenient) Write(b []byte) (int, error) {
	l.w.Write(b) // an error is containerd's reader gone: dropped
	return len(b), nil
}

// waitProcess follows p to its end and says so to containerd. A pod VM
// that is lost ends its processes with 255 and why in the shim's log.
func (s *service) waitProcess(p *process, proc *agent.Process, outs []io.Closer) {
	st, err := proc.Wait()
	code := uint32(255)
	if err != nil {
		s.log.Warn("shim: a process ended without an exit status (the pod VM was lost?)", "container", p.c.id, "exec", p.execID, "err", err)
	} else {
		code = uint32(st.Code)
		if st.Signal == "SIGKILL" && p.oomKills >= 0 {
			pd := s.currentPod()
			if pd != nil && oomKills(context.Background(), pd, p.c.id) > p.oomKills {
				s.publish(runtime.TaskOOMEventTopic, &eventstypes.TaskOOM{ContainerID: p.c.id})
			}
		}
	}
	for _, c := range outs {
		c.Close()
	}
	p.mu.Lock()
	if p.in != nil {
		p.in.Close()
	}
	p.status, p.exitCode, p.exitedAt = task.Status_STOPPED, code, time.Now()
	close(p.done)
	p.mu.Unlock()
	if p.execID == "" {
		// The init process's end ends the container's execs, as a pid
		// namespace's end does.
		for _, e := range s.execsOf(p.c) {
			e.signal(context.Background(), unix.SIGKILL)
			<-e.doneIfStarted()
		}
	}
	pid := s.podPID()
	id := p.execID
	if id == "" {
		id = p.c.id
	}
	s.publish(runtime.TaskExitEventTopic, &eventstypes.TaskExit{ContainerID: p.c.id, ID: id, Pid: pid,
		ExitStatus: code, ExitedAt: protobuf.ToTimestamp(p.exitedAt)})
}

func (p *process) state() task.Status {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.status
}

// doneIfStarted is closed once p has ended, or at once if it never started.
func (p *process) doneIfStarted() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.status == task.Status_CREATED {
		c := make(chan struct{})
		close(c)
		return c
	}
	return p.done
}

// signal signals a running process's group in the guest.
func (p *process) signal(ctx context.Context, sig syscall.Signal) error {
	p.mu.Lock()
	proc, status := p.proc, p.status
	p.mu.Unlock()
	if status != task.Status_RUNNING || proc == nil {
		return fmt.Errorf("process is not running: %w", errdefs.ErrNotFound)
	}
	return proc.Signal(ctx, unix.SignalName(sig))
}

// Delete removes an exec, or a stopped container with its root; the
// last container takes the pod VM with it.
func (s *service) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	c, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if st := p.state(); st == task.Status_RUNNING {
		return nil, fmt.Errorf("delete %s: the process is running: %w", r.ID, errdefs.ErrFailedPrecondition)
	}
	pid := s.podPID()
	s.mu.Lock()
	if r.ExecID != "" {
		delete(c.execs, r.ExecID)
		s.mu.Unlock()
	} else {
		delete(s.containers, r.ID)
		last := len(s.containers) == 0
		s.mu.Unlock()
		unmountUnder(filepath.Dir(c.rootfs))
		os.RemoveAll(filepath.Dir(c.rootfs))
		os.Remove(filepath.Join(c.bundle, podFile))
		if last {
			s.stopPod()
		} else if pd := s.currentPod(); pd != nil && !c.podSandbox {
			// Its processes have ended: its cgroup in the guest goes.
			if err := pd.handle.Remove(ctx, agent.ContainerCgroupPath(r.ID), false); err != nil {
				s.log.Debug("shim: remove the container's cgroup", "container", r.ID, "err", err)
			}
		}
	}
	p.mu.Lock()
	code, at := p.exitCode, p.exitedAt
	p.mu.Unlock()
	if at.IsZero() {
		at = time.Now()
	}
	if r.ExecID == "" {
		s.publish(runtime.TaskDeleteEventTopic, &eventstypes.TaskDelete{ContainerID: r.ID, ID: r.ID, Pid: pid,
			ExitStatus: code, ExitedAt: protobuf.ToTimestamp(at)})
	}
	return &taskAPI.DeleteResponse{Pid: pid, ExitStatus: code, ExitedAt: protobuf.ToTimestamp(at)}, nil
}

// Exec adds a process to a running container.
func (s *service) Exec(ctx context.Context, r *taskAPI.ExecProcessRequest) (*ptypes.Empty, error) {
	c, _, err := s.get(r.ID, "")
	if err != nil {
		return nil, err
	}
	if err := identifiers.Validate(r.ExecID); err != nil {
		return nil, fmt.Errorf("exec in %s: the exec's id: %w", r.ID, err)
	}
	if r.Spec == nil {
		return nil, fmt.Errorf("exec %s: no process spec: %w", r.ExecID, errdefs.ErrInvalidArgument)
	}
	v, err := typeurl.UnmarshalAny(r.Spec)
	if err != nil {
		return nil, fmt.Errorf("exec %s: the process spec: %w", r.ExecID, err)
	}
	ps, ok := v.(*specs.Process)
	if !ok || len(ps.Args) == 0 {
		return nil, fmt.Errorf("exec %s: the spec is not a process with args: %w", r.ExecID, errdefs.ErrInvalidArgument)
	}
	if caps := ps.Capabilities; caps != nil && slices.Contains(caps.Bounding, "CAP_SYS_ADMIN") {
		return nil, fmt.Errorf("exec %s: process.capabilities: a privileged exec is refused: %w", r.ExecID, errdefs.ErrInvalidArgument)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := c.execs[r.ExecID]; ok {
		return nil, fmt.Errorf("exec %s: %w", r.ExecID, errdefs.ErrAlreadyExists)
	}
	c.execs[r.ExecID] = &process{c: c, execID: r.ExecID, spec: ps, stdin: r.Stdin, stdout: r.Stdout, stderr: r.Stderr,
		terminal: r.Terminal || ps.Terminal, status: task.Status_CREATED, done: make(chan struct{})}
	s.publish(runtime.TaskExecAddedEventTopic, &eventstypes.TaskExecAdded{ContainerID: r.ID, ExecID: r.ExecID})
	return &ptypes.Empty{}, nil
}

// ResizePty resizes a process's terminal.
func (s *service) ResizePty(ctx context.Context, r *taskAPI.ResizePtyRequest) (*ptypes.Empty, error) {
	_, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	proc := p.proc
	p.mu.Unlock()
	if proc == nil || !p.terminal {
		return nil, fmt.Errorf("resize %s: no running process on a terminal: %w", r.ID, errdefs.ErrFailedPrecondition)
	}
	if r.Width == 0 || r.Height == 0 || r.Width > 0xffff || r.Height > 0xffff {
		return nil, fmt.Errorf("resize %s: %dx%d: %w", r.ID, r.Width, r.Height, errdefs.ErrInvalidArgument)
	}
	if err := proc.Resize(agent.WindowSize{Rows: uint16(r.Height), Cols: uint16(r.Width)}); err != nil {
		return nil, err
	}
	return &ptypes.Empty{}, nil
}

// State reports a process's state.
func (s *service) State(ctx context.Context, r *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	c, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	pid := s.podPID()
	paused := s.isFrozen(c)
	p.mu.Lock()
	defer p.mu.Unlock()
	status := p.status
	if paused && status == task.Status_RUNNING {
		status = task.Status_PAUSED
	}
	return &taskAPI.StateResponse{
		ID: r.ID, ExecID: r.ExecID, Bundle: c.bundle, Pid: pid, Status: status,
		Stdin: p.stdin, Stdout: p.stdout, Stderr: p.stderr, Terminal: p.terminal,
		ExitStatus: p.exitCode, ExitedAt: protobuf.ToTimestamp(p.exitedAt),
	}, nil
}

// Pause pauses a container. A pod of one container pauses its VM (its
// vCPUs stop; capsa pause); in a pod of several, the container's cgroup
// in the guest is frozen (cgroup.freeze), and the others run on.
func (s *service) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	return s.pauseResume(ctx, r.ID, true)
}

// Resume runs a paused container again.
func (s *service) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	return s.pauseResume(ctx, r.ID, false)
}

func (s *service) pauseResume(ctx context.Context, id string, pause bool) (*ptypes.Empty, error) {
	what := map[bool]string{true: "pause", false: "resume"}[pause]
	c, p, err := s.get(id, "")
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	pd, n, frozen := s.pod, len(s.containers), c.frozen
	s.mu.Unlock()
	if pd == nil {
		return nil, fmt.Errorf("%s %s: the pod VM is gone: %w", what, id, errdefs.ErrFailedPrecondition)
	}
	if st := p.state(); st != task.Status_RUNNING && st != task.Status_PAUSED {
		return nil, fmt.Errorf("%s %s: it is %s: %w", what, id, st, errdefs.ErrFailedPrecondition)
	}
	if n > 1 || frozen {
		if c.podSandbox {
			return nil, fmt.Errorf("%s %s: the pod's sandbox is its VM, which its %d containers share: %w", what, id, n, errdefs.ErrNotImplemented)
		}
		if err := freeze(ctx, pd, id, pause); err != nil {
			return nil, fmt.Errorf("%s %s: %w", what, id, err)
		}
		s.mu.Lock()
		c.frozen = pause
		s.mu.Unlock()
	} else {
		if pause {
			err = pd.mgr.Pause(ctx, pd.Name)
		} else {
			err = pd.mgr.Resume(ctx, pd.Name)
		}
		if err != nil {
			return nil, fmt.Errorf("%s %s: %w", what, id, err)
		}
		s.mu.Lock()
		c.paused = pause
		s.mu.Unlock()
	}
	if pause {
		s.publish(runtime.TaskPausedEventTopic, &eventstypes.TaskPaused{ContainerID: id})
	} else {
		s.publish(runtime.TaskResumedEventTopic, &eventstypes.TaskResumed{ContainerID: id})
	}
	return &ptypes.Empty{}, nil
}

// freezeWait bounds how long a freeze may take to settle.
const freezeWait = 10 * time.Second

// freeze freezes or thaws the container's cgroup in the guest and waits
// until the kernel says it is done (cgroup.events' frozen).
func freeze(ctx context.Context, pd *pod, id string, on bool) error {
	dir := agent.ContainerCgroupPath(id)
	want := map[bool]string{true: "1", false: "0"}[on]
	if err := pd.handle.AppendFile(ctx, path.Join(dir, "cgroup.freeze"), []byte(want)); err != nil {
		return err
	}
	deadline := time.Now().Add(freezeWait)
	for {
		b, err := pd.handle.ReadFile(ctx, path.Join(dir, "cgroup.events"))
		if err != nil {
			return err
		}
		if strconv.FormatInt(statValue(b, "frozen"), 10) == want {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the container's cgroup did not settle (frozen=%s) in %v", want, freezeWait)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// isPaused reports whether c's pod VM is paused.
func (s *service) isPaused(c *container) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return c.paused
}

// isFrozen reports whether c is paused, by its VM or its cgroup.
func (s *service) isFrozen(c *container) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return c.paused || c.frozen
}

// Kill signals a process; with All, every process of the container.
func (s *service) Kill(ctx context.Context, r *taskAPI.KillRequest) (*ptypes.Empty, error) {
	c, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if s.isPaused(c) {
		return nil, fmt.Errorf("kill %s: its VM is paused (resume it first): %w", r.ID, errdefs.ErrFailedPrecondition)
	}
	sig := syscall.Signal(r.Signal)
	if unix.SignalName(sig) == "" {
		return nil, fmt.Errorf("kill %s: signal %d: %w", r.ID, r.Signal, errdefs.ErrInvalidArgument)
	}
	if r.All && r.ExecID == "" {
		for _, e := range s.execsOf(c) {
			e.signal(ctx, sig)
		}
	}
	if p.state() == task.Status_CREATED || c.podSandbox && r.ExecID == "" {
		if err := s.endWithoutProcess(p, sig); err != nil {
			return nil, fmt.Errorf("kill %s: %w", r.ID, err)
		}
		return &ptypes.Empty{}, nil
	}
	if err := p.signal(ctx, sig); err != nil {
		return nil, fmt.Errorf("kill %s: %w", r.ID, err)
	}
	return &ptypes.Empty{}, nil
}

// endWithoutProcess ends a process that has none in the guest, CRI's
// sandbox container or a process not started (its start may have
// failed), at a signal that would end a process that waits (pause, or
// runc's init before its start): its exit code is 128+signal. Others it
// ignores, as pause does.
func (s *service) endWithoutProcess(p *process, sig syscall.Signal) error {
	switch sig {
	case unix.SIGKILL, unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT:
	default:
		return nil
	}
	p.mu.Lock()
	if p.status != task.Status_CREATED && (p.status != task.Status_RUNNING || p.proc != nil) {
		p.mu.Unlock()
		return fmt.Errorf("process is not running: %w", errdefs.ErrNotFound)
	}
	p.status, p.exitCode, p.exitedAt = task.Status_STOPPED, 128+uint32(sig), time.Now()
	close(p.done)
	p.mu.Unlock()
	pid := s.podPID()
	s.publish(runtime.TaskExitEventTopic, &eventstypes.TaskExit{ContainerID: p.c.id, ID: cmp.Or(p.execID, p.c.id), Pid: pid,
		ExitStatus: p.exitCode, ExitedAt: protobuf.ToTimestamp(p.exitedAt)})
	return nil
}

// Pids lists a container's processes by the pod VM's host PID: their
// guest PIDs mean nothing on the host.
func (s *service) Pids(ctx context.Context, r *taskAPI.PidsRequest) (*taskAPI.PidsResponse, error) {
	if _, _, err := s.get(r.ID, ""); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pod == nil {
		return &taskAPI.PidsResponse{}, nil
	}
	return &taskAPI.PidsResponse{Processes: []*task.ProcessInfo{{Pid: s.pod.pid}}}, nil
}

// CloseIO closes a process's stdin.
func (s *service) CloseIO(ctx context.Context, r *taskAPI.CloseIORequest) (*ptypes.Empty, error) {
	_, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	in := p.in
	p.in = nil
	p.mu.Unlock()
	if in != nil && r.Stdin {
		in.Close()
	}
	return &ptypes.Empty{}, nil
}

func (s *service) Checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (*ptypes.Empty, error) {
	return nil, fmt.Errorf("checkpoint %s: %w", r.ID, errdefs.ErrNotImplemented)
}

// Connect reports the shim's PID and the pod VM's.
func (s *service) Connect(ctx context.Context, r *taskAPI.ConnectRequest) (*taskAPI.ConnectResponse, error) {
	pid := s.podPID()
	return &taskAPI.ConnectResponse{ShimPid: uint32(os.Getpid()), TaskPid: pid, Version: "capsa"}, nil
}

// Shutdown ends the shim once it serves no container.
func (s *service) Shutdown(ctx context.Context, r *taskAPI.ShutdownRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	n := len(s.containers)
	s.mu.Unlock()
	if n > 0 {
		return &ptypes.Empty{}, nil
	}
	s.shutdown.Shutdown()
	return &ptypes.Empty{}, nil
}

// Stats reports a container's use as cgroup v2 metrics, the type
// containerd and its CRI plugin decode. A container that runs processes
// reports its cgroup's in the guest (CPU time, memory with its limit,
// pids, OOM events); CRI's sandbox container, which is the pod VM,
// reports the VM's: the vCPUs' and the VMM's CPU time, the guest RAM the
// host holds against the guest's size, and its disks' I/O.
func (s *service) Stats(ctx context.Context, r *taskAPI.StatsRequest) (*taskAPI.StatsResponse, error) {
	c, _, err := s.get(r.ID, "")
	if err != nil {
		return nil, err
	}
	pd := s.currentPod()
	if pd == nil {
		return nil, fmt.Errorf("stats %s: the pod VM is gone: %w", r.ID, errdefs.ErrNotFound)
	}
	st, err := pd.handle.Stats(ctx)
	if err != nil {
		return nil, fmt.Errorf("stats %s: %w", r.ID, err)
	}
	m := metricsOf(st)
	if !c.podSandbox {
		// A container whose first process has not started has no
		// cgroup yet: the VM's figures stand.
		if files, err := readCgroup(ctx, pd, r.ID); err == nil {
			m = containerMetrics(files, st.MemoryBytes)
		}
	}
	data, err := typeurl.MarshalAny(m)
	if err != nil {
		return nil, fmt.Errorf("stats %s: %w", r.ID, err)
	}
	return &taskAPI.StatsResponse{Stats: protobuf.FromAny(data)}, nil
}

// metricsOf is a pod VM's use as cgroup v2 metrics.
func metricsOf(st *sandbox.Stats) *cgstats.Metrics {
	cpu := uint64((st.CPUTime + st.VMMCPUTime) / time.Microsecond)
	return &cgstats.Metrics{
		CPU: &cgstats.CPUStat{UsageUsec: cpu, UserUsec: uint64(st.CPUTime / time.Microsecond), SystemUsec: uint64(st.VMMCPUTime / time.Microsecond)},
		Memory: &cgstats.MemoryStat{Usage: st.MemoryResident, UsageLimit: st.MemoryBytes,
			Anon: st.MemoryResident},
		Io: &cgstats.IOStat{Usage: []*cgstats.IOEntry{{Rbytes: st.DiskReadBytes, Wbytes: st.DiskWriteBytes, Rios: st.DiskReads, Wios: st.DiskWrites}}},
	}
}

// cgroupStatFiles are the container cgroup's files Stats reads.
var cgroupStatFiles = []string{"memory.current", "memory.max", "memory.stat", "memory.events", "cpu.stat", "pids.current", "pids.max"}

// readCgroup reads the container's cgroup files in the guest, in one
// request (a CRI runtime asks for every container's statistics every few
// seconds, containerd 2.x every second); an error if its memory.current
// cannot be read (no cgroup).
func readCgroup(ctx context.Context, pd *pod, id string) (map[string][]byte, error) {
	paths := make([]string, len(cgroupStatFiles))
	for i, f := range cgroupStatFiles {
		paths[i] = path.Join(agent.ContainerCgroupPath(id), f)
	}
	files, err := pd.handle.ReadFiles(ctx, paths)
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	for i, f := range cgroupStatFiles {
		if files[i].Err != nil && f == "memory.current" {
			return nil, files[i].Err
		}
		out[f] = files[i].Data
	}
	return out, nil
}

// containerMetrics are a container's cgroup files as metrics; a memory
// limit of "max" is the VM's memory, vmMemory.
func containerMetrics(files map[string][]byte, vmMemory uint64) *cgstats.Metrics {
	num := func(name string) uint64 { // a file holding one number; "max" is 0
		v, _ := strconv.ParseUint(strings.TrimSpace(string(files[name])), 10, 64)
		return v
	}
	stat := func(name, key string) uint64 { return uint64(max(statValue(files[name], key), 0)) }
	limit := vmMemory
	if v := num("memory.max"); v > 0 && v < limit {
		limit = v
	}
	mem := func(key string) uint64 { return stat("memory.stat", key) }
	cpu := func(key string) uint64 { return stat("cpu.stat", key) }
	ev := func(key string) uint64 { return stat("memory.events", key) }
	return &cgstats.Metrics{
		Pids: &cgstats.PidsStat{Current: num("pids.current"), Limit: num("pids.max")},
		CPU: &cgstats.CPUStat{UsageUsec: cpu("usage_usec"), UserUsec: cpu("user_usec"), SystemUsec: cpu("system_usec"),
			NrPeriods: cpu("nr_periods"), NrThrottled: cpu("nr_throttled"), ThrottledUsec: cpu("throttled_usec")},
		Memory: &cgstats.MemoryStat{Usage: num("memory.current"), UsageLimit: limit,
			Anon: mem("anon"), File: mem("file"), KernelStack: mem("kernel_stack"), Slab: mem("slab"), Sock: mem("sock"),
			Shmem: mem("shmem"), FileMapped: mem("file_mapped"), FileDirty: mem("file_dirty"), FileWriteback: mem("file_writeback"),
			AnonThp: mem("anon_thp"), InactiveAnon: mem("inactive_anon"), ActiveAnon: mem("active_anon"),
			InactiveFile: mem("inactive_file"), ActiveFile: mem("active_file"), Unevictable: mem("unevictable"),
			Pgfault: mem("pgfault"), Pgmajfault: mem("pgmajfault")},
		MemoryEvents: &cgstats.MemoryEvents{Low: ev("low"), High: ev("high"), Max: ev("max"), Oom: ev("oom"), OomKill: ev("oom_kill")},
	}
}

// Update sets a running container's resource limits: its cgroup's in the
// guest. CRI's sandbox container is the pod VM, whose size is fixed.
func (s *service) Update(ctx context.Context, r *taskAPI.UpdateTaskRequest) (*ptypes.Empty, error) {
	c, _, err := s.get(r.ID, "")
	if err != nil {
		return nil, err
	}
	if c.podSandbox {
		return nil, fmt.Errorf("update %s: a pod VM's vCPUs and memory are fixed when it starts: %w", r.ID, errdefs.ErrNotImplemented)
	}
	if r.Resources == nil {
		return &ptypes.Empty{}, nil
	}
	v, err := typeurl.UnmarshalAny(r.Resources)
	if err != nil {
		return nil, fmt.Errorf("update %s: the resources: %w: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	res, ok := v.(*specs.LinuxResources)
	if !ok {
		return nil, fmt.Errorf("update %s: resources of type %T, want Linux resources: %w", r.ID, v, errdefs.ErrInvalidArgument)
	}
	limits := limitsOf(res)
	if err := limits.Check(); err != nil {
		return nil, fmt.Errorf("update %s: %w: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	pd := s.currentPod()
	if pd == nil {
		return nil, fmt.Errorf("update %s: the pod VM is gone: %w", r.ID, errdefs.ErrNotFound)
	}
	dir := agent.ContainerCgroupPath(r.ID)
	for _, f := range limits.Files() {
		// Appending writes the file in place, as a cgroup's files
		// must be written.
		if err := pd.handle.AppendFile(ctx, path.Join(dir, f[0]), []byte(f[1])); err != nil {
			return nil, fmt.Errorf("update %s: %s %s: %w", r.ID, f[0], f[1], err)
		}
	}
	return &ptypes.Empty{}, nil
}

// Wait waits for a process to end.
func (s *service) Wait(ctx context.Context, r *taskAPI.WaitRequest) (*taskAPI.WaitResponse, error) {
	_, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	select {
	case <-done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return &taskAPI.WaitResponse{ExitStatus: p.exitCode, ExitedAt: protobuf.ToTimestamp(p.exitedAt)}, nil
}

// readPodFile reads a bundle's podFile.
func readPodFile(bundle string) (*podInfo, error) {
	data, err := os.ReadFile(filepath.Join(bundle, podFile))
	if err != nil {
		return nil, err
	}
	var p podInfo
	if err := json.Unmarshal(data, &p); err != nil {
		return nil, err
	}
	return &p, nil
}
