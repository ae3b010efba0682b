// Package sandbox runs commands in hardware-isolated microVMs: capsa's
// built-in kernel, an initramfs with u-root and the guest agent, and a
// virtio-vsock link over which the host runs processes and moves files.
//
// The builder enforces its required step with types: New returns a Builder,
// which has no Start; choosing the workload (Run now, OCI images later)
// returns a Workload, which does.
//
//	sb, err := sandbox.New().CPUs(2).Memory(512).
//		Run("sh", "-c", "sleep infinity").
//		Start(ctx)
//	out, err := sb.Exec(ctx, sandbox.Command("uname", "-a"))
package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/image"
	"github.com/capsa-sandbox/capsa/internal/assets"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/tlsproxy"
	virtioballoon "github.com/capsa-sandbox/capsa/virtio/balloon"
	virtioblk "github.com/capsa-sandbox/capsa/virtio/blk"
	"github.com/capsa-sandbox/capsa/virtio/vsock"
	"github.com/capsa-sandbox/capsa/vmm"
)

// guestCID is every sandbox's context id: each VM has its own vsock device.
const guestCID = 3

// balloonID is the memory balloon's device id.
const balloonID = "balloon"

// DefaultReadyTimeout bounds the wait for the guest agent.
const DefaultReadyTimeout = 60 * time.Second

// config is what a builder holds: the description, and what exists only
// while the sandbox runs.
type config struct {
	Spec
	log      *slog.Logger
	console  io.Writer
	progress func(image.Progress)
	errs     []error
	secrets  map[string]string // the values of Network.Secrets, by name, and of Network.Headers (headerKey)
	// installCA: a restore makes the interception's CA and installs it
	// in the guest, whose snapshot was taken without one.
	installCA bool
	netAudit  io.Writer    // the audit log of intercepted requests
	ca        *tlsproxy.CA // a restored sandbox's CA
	start     time.Time    // when a restore began (zero: at boot), for the timeline
	// beforeRun runs once the VM is built and before its vCPUs first run
	// (Workload.BeforeRun, RestoreOptions.BeforeRun).
	beforeRun func(*Sandbox) error
	// pausedForkCopy: a first fork writes the whole memory while paused
	// (Builder.PausedForkCopy).
	pausedForkCopy bool
}

// Builder configures a sandbox. Choose its workload with Run to get a
// Workload that can Start.
type Builder struct{ c config }

// New returns a builder: 1 vCPU, 512 MiB.
func New() *Builder {
	return &Builder{c: config{Spec: Spec{CPUs: 1, MemoryMiB: 512, ReadyTimeout: DefaultReadyTimeout}}}
}

// CPUs sets the number of vCPUs (1 to 64).
func (b *Builder) CPUs(n int) *Builder {
	if n < 1 || n > vmm.MaxCPUs {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %d CPUs: must be between 1 and %d", n, vmm.MaxCPUs))
	}
	b.c.CPUs = n
	return b
}

// Balloon gives the sandbox a memory balloon whose free page reporting
// its guest uses: about 2 s after the guest frees memory in whole 2 MiB
// blocks, the host has it back. It is off unless asked for, as in
// Firecracker and QEMU: the guest's next use of memory it gave back
// faults it in again, which a workload that keeps allocating and freeing
// (network streams) pays for, most in a nested host.
func (b *Builder) Balloon(on bool) *Builder {
	b.c.Balloon = on
	return b
}

// PausedForkCopy makes the sandbox's first fork write its whole memory
// while the sandbox is paused, as forks did before they copied it while
// it runs (guestmem.PreCopy): for comparison, and for a host where the
// copy's CPU time and the guest's write faults while it runs (each page's
// first write after the copy begins) cost more than a longer pause.
func (b *Builder) PausedForkCopy() *Builder {
	b.c.pausedForkCopy = true
	return b
}

// MaxCPUQuota bounds Builder.CPUQuota.
const MaxCPUQuota = 4096

// CPUQuota sets the most host CPUs the sandbox's VMM process may use, its
// vCPUs and its own threads (device I/O, the NAT) together: 1.5 is one
// and a half CPUs' time. It is its cgroup's cpu.max, set where the VMM
// confines itself (capsa run and detached sandboxes, package confine),
// not by a program that runs sandboxes in its own process. Default: the
// vCPU count.
func (b *Builder) CPUQuota(cpus float64) *Builder {
	if !(cpus >= 0.01 && cpus <= MaxCPUQuota) {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: a CPU quota of %g CPUs: must be between 0.01 and %d", cpus, MaxCPUQuota))
	}
	b.c.CPUQuota = cpus
	return b
}

// EffectiveCPUQuota is the quota of a sandbox of s: its CPUQuota, else
// its vCPU count (1 when unset).
func (s Spec) EffectiveCPUQuota() float64 {
	if s.CPUQuota > 0 {
		return s.CPUQuota
	}
	return float64(max(s.CPUs, 1))
}

// Memory sets the guest memory in MiB (at least 64).
func (b *Builder) Memory(mib int) *Builder {
	if mib < 64 || mib > 1<<20 {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %d MiB of memory: must be between 64 and %d", mib, 1<<20))
	}
	b.c.MemoryMiB = mib
	return b
}

// Env adds KEY=VALUE entries to the environment of every process the
// sandbox runs.
func (b *Builder) Env(kv ...string) *Builder {
	for _, e := range kv {
		if k, _, ok := bytes.Cut([]byte(e), []byte("=")); !ok || len(k) == 0 {
			b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: environment entry %q: want KEY=VALUE", e))
		}
	}
	b.c.Env = append(b.c.Env, kv...)
	return b
}

// Kernel replaces the built-in kernel with a vmlinux or bzImage file.
func (b *Builder) Kernel(path string) *Builder { b.c.Kernel = path; return b }

// Initrd replaces the built-in initramfs. It must start the capsa agent.
func (b *Builder) Initrd(path string) *Builder { b.c.Initrd = path; return b }

// Logger receives the VMM's log.
func (b *Builder) Logger(l *slog.Logger) *Builder { b.c.log = l; return b }

// Console receives the guest's serial console (quiet unless it fails).
func (b *Builder) Console(w io.Writer) *Builder { b.c.console = w; return b }

// VsockSocket serves the sandbox's vsock on a Unix socket at path with
// Firecracker's hybrid-vsock handshake ("CONNECT <port>\n", answered
// "OK <hostport>\n"), so tools that speak it reach guest ports; guest
// connections to a port P nobody listens on go to "<path>_P".
func (b *Builder) VsockSocket(path string) *Builder { b.c.VsockSocket = path; return b }

// ReadyTimeout bounds how long Start waits for the guest agent.
func (b *Builder) ReadyTimeout(d time.Duration) *Builder { b.c.ReadyTimeout = d; return b }

// OutputLimit bounds what the host holds of one guest answer: the output
// Exec collects (unless ExecOptions.MaxOutput says otherwise) and the file
// ReadFile returns. 0 is agent.DefaultMaxOutput (64 MiB); negative is no
// limit. Stream and ReadFileTo pass data on and have none.
func (b *Builder) OutputLimit(n int64) *Builder { b.c.OutputLimit = n; return b }

func (c config) logger() *slog.Logger {
	if c.log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return c.log
}

// Err reports what is wrong with the configuration so far, the same
// error Start would return before booting anything.
func (b *Builder) Err() error { return b.c.err() }

// Err reports what is wrong with the workload's settings so far, its
// builder's included; Start and Spec report the same.
func (w *Workload) Err() error { return w.c.err() }

func (c *config) err() error { return errors.Join(append(c.errs, c.checkNetwork())...) }

// Run chooses the sandbox's main process: argv, run once the guest is up.
func (b *Builder) Run(cmd string, args ...string) *Workload {
	w := &Workload{c: b.c}
	w.c.Main.Argv = append([]string{cmd}, args...)
	if cmd == "" {
		w.c.errs = append(w.c.errs, errors.New("sandbox: Run needs a command"))
	}
	if b.c.Image != nil {
		w.c.errs = append(w.c.errs, errors.New("sandbox: image options (ImageStore, Pull, RootfsSize, Entrypoint...) need OCI, not Run"))
	}
	return w
}

// Workload is a configured sandbox with its main process chosen.
type Workload struct {
	c      config
	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer
	tty    *agent.WindowSize
}

// Stdin feeds the main process's standard input.
func (w *Workload) Stdin(r io.Reader) *Workload { w.stdin = r; return w }

// Stdout receives the main process's standard output as it comes.
func (w *Workload) Stdout(o io.Writer) *Workload { w.stdout = o; return w }

// Stderr receives the main process's standard error as it comes.
func (w *Workload) Stderr(o io.Writer) *Workload { w.stderr = o; return w }

// TTY runs the main process on a pseudo-terminal of size ws: all its
// output comes to Stdout, Stdin goes to the terminal (^C interrupts), and
// Sandbox.Resize changes its size.
func (w *Workload) TTY(ws agent.WindowSize) *Workload { w.tty = &ws; return w }

// Dir sets the main process's working directory.
func (w *Workload) Dir(dir string) *Workload { w.c.Main.Dir = dir; return w }

// User runs the main process as USER, UID, USER:GROUP or UID:GID, looked
// up in the guest's /etc/passwd and /etc/group (an image's, with OCI).
func (w *Workload) User(u string) *Workload { w.c.Main.User = u; return w }

// BeforeRun has fn called once the VM is built (its memory, devices and
// KVM state made) and before its vCPUs first run: where a process
// confines itself (package confine, with the sandbox's HostPaths), so
// that nothing a guest does, from its kernel's first instruction, runs
// beside an unconfined VMM. Only the sandbox's HostPaths and Spec are
// meaningful then. An error from fn ends the start with it.
func (w *Workload) BeforeRun(fn func(*Sandbox) error) *Workload { w.c.beforeRun = fn; return w }

// Timeout kills the main process after d.
func (w *Workload) Timeout(d time.Duration) *Workload {
	if d < 0 {
		w.c.errs = append(w.c.errs, fmt.Errorf("sandbox: timeout %v: must not be negative", d))
	}
	w.c.Main.Timeout = d
	return w
}

// ExecOptions describe a process to run in the sandbox.
type ExecOptions = agent.ExecOptions

// Command returns options that run argv.
func Command(name string, args ...string) ExecOptions {
	return ExecOptions{Argv: append([]string{name}, args...)}
}

// Shell returns options that run script with /bin/sh -c.
func Shell(script string) ExecOptions { return ExecOptions{Shell: script} }

// Sandbox is a running sandbox.
type Sandbox struct {
	c       config
	vm      *vmm.Machine
	dev     *vsock.Device
	Guest   // the agent's operations: Exec, Stream, files, Info
	cancel  context.CancelFunc
	vmDone  chan struct{}
	exit    *vmm.Exit
	ready   chan struct{}
	started time.Time
	readyAt atomic.Int64 // when the agent first answered (UnixNano); 0 before
	hybrid  *vsock.HybridSocket
	hub     *hubServer // the guest's mailbox and key-value store
	shares  []shareDevice
	shareFS []reopener // the shares' file servers, by c.Shares's order
	disks   []*virtioblk.Device
	balloon *virtioballoon.Device // nil: restored from a snapshot without one
	rootfs  *rootfs
	net     *network
	lim     *limiters // the devices' I/O limits

	resumeErr error // a restored guest's agent's answer to being resumed

	// snapMu: one snapshot at a time, and no Pause or Resume meanwhile
	// (a fork maps the memory from what it wrote while the VM is still
	// paused). It guards the fork chain (SnapshotOptions.Fork): its
	// directory (forkOwn: made here, for Fork), its base, open, which
	// the memory is mapped from (nil: none, or the memory is its own),
	// and every snapshot written there, removed when the sandbox ends.
	// forkUse is held shared by each Fork until its copies are restored,
	// and taken alone to prune the chain. lastPause is the last
	// snapshot's pause, in nanoseconds; forkRemaps counts the forks that
	// mapped the memory from a new base (Stats.MemoryRemaps).
	snapMu      sync.Mutex
	forkChain   string
	forkOwn     bool
	forkBase    *snapshot.Snapshot
	forkWritten []string
	forkUse     sync.RWMutex
	lastPause   atomic.Int64
	forkRemaps  atomic.Uint64
	// clearRefs is /proc/self/clear_refs, opened before the process is
	// confined, for a first fork's memory copy begun while the sandbox
	// runs (guestmem.PreCopy); nil where the kernel does not track
	// soft-dirty pages, or the memory is a snapshot's.
	clearRefs *os.File

	mu       sync.Mutex
	main     *agent.Process
	mainErr  error
	closeErr error
	closed   bool
}

// Spec is what the sandbox was built from (its Builder's settings, or a
// restored one's), a copy.
func (s *Sandbox) Spec() Spec { return s.c.Spec }

// Start boots the sandbox, waits for its agent and starts the main process.
func (w *Workload) Start(ctx context.Context) (*Sandbox, error) {
	return w.boot(ctx, nil)
}

// boot is Start with the image sandbox's root given (nil: the image's,
// with a new writable layer); on failure root is removed too.
func (w *Workload) boot(ctx context.Context, root *rootfs) (*Sandbox, error) {
	if err := w.c.err(); err != nil {
		root.remove()
		return nil, err
	}
	opts := ExecOptions{Argv: w.c.Main.Argv, Dir: w.c.Main.Dir, User: w.c.Main.User, Timeout: w.c.Main.Timeout,
		Stdin: w.stdin, Stdout: w.stdout, Stderr: w.stderr, TTY: w.tty}
	if w.c.Image != nil {
		if root == nil {
			var err error
			if root, err = prepareImage(ctx, w.c); err != nil {
				return nil, err
			}
		}
		opts.Argv, opts.Env, opts.Dir, opts.User = root.proc.Argv, root.proc.Env, root.proc.Dir, root.proc.User
	} else {
		opts.Env = append(append([]string(nil), w.c.Env...), opts.Env...)
	}
	s, err := startVM(ctx, w.c, root, nil, "")
	if err != nil {
		return nil, err
	}
	// Errors are explained by the VM's end before Close ends it anyway.
	if in := s.net.interception(); in != nil {
		err = installCA(ctx, s.client, in.ca)
	}
	if err == nil {
		err = applyPatches(ctx, s.client, w.c.Patches)
	}
	if err != nil {
		err = s.vmErr(err)
		s.Close()
		return nil, err
	}
	p, err := s.client.Start(ctx, opts)
	if err != nil {
		err = fmt.Errorf("sandbox: start %s: %w", opts.Argv[0], s.vmErr(err))
		var re *agent.RemoteError
		if !errors.As(err, &re) {
			// Not the agent's refusal (no such program...): it said it
			// was ready and then did not answer, and the guest's state
			// is what explains that.
			err = fmt.Errorf("%w; the VM's state:\n%s", err, s.Debug(ctx))
		}
		s.Close()
		return nil, err
	}
	s.running(p)
	return s, nil
}

// running records the sandbox's main process and starts its watchdog, if
// it has one: the last step of a start or a restore.
func (s *Sandbox) running(main *agent.Process) {
	s.mu.Lock()
	s.main = main
	s.mu.Unlock()
	if s.c.Watchdog > 0 {
		go s.watch(s.c.Watchdog)
	}
}

// startVM boots the VM (or restores it from snap) and waits for its
// agent; on failure nothing it made is left, root included.
func startVM(ctx context.Context, c config, root *rootfs, snap *snapshot.Snapshot, hostname string) (*Sandbox, error) {
	s, err := boot(ctx, c, root, snap, hostname)
	if err != nil {
		root.remove()
		return nil, err
	}
	if err := s.WaitReady(ctx, c.ReadyTimeout); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// readOr maps the file at path (assets.MapFile) or, with no path, returns
// the built-in asset; release gives back what it holds once the guest's
// memory has a copy.
func readOr(path string, builtinData func() ([]byte, error)) (data []byte, release func(), err error) {
	if path != "" {
		return assets.MapFile(path)
	}
	if data, err = builtinData(); err != nil {
		return nil, nil, err
	}
	return data, func() { assets.Evict(data) }, nil
}

// boot starts the VM and the host end of its vsock link; with root, the
// guest's / is that image. With snap, the VM is restored from it instead
// of booted: its devices are made as for a boot, in the same order, and
// take their state from it.
func boot(ctx context.Context, c config, root *rootfs, snap *snapshot.Snapshot, hostname string) (_ *Sandbox, err error) {
	start := time.Now()
	if !c.start.IsZero() {
		start = c.start
	}
	var kernel, initrd []byte
	if snap == nil {
		var release func()
		if kernel, release, err = readOr(c.Kernel, assets.Kernel); err != nil {
			return nil, fmt.Errorf("sandbox: kernel: %w", err)
		}
		defer release()
		if initrd, release, err = readOr(c.Initrd, assets.Initramfs); err != nil {
			return nil, fmt.Errorf("sandbox: initramfs: %w", err)
		}
		defer release()
	}
	log := c.logger()
	s := &Sandbox{c: c, vmDone: make(chan struct{}), ready: make(chan struct{}), started: start, rootfs: root, lim: newLimiters(c.Limits)}
	s.Guest = Guest{env: c.Env, limit: c.OutputLimit, explain: s.vmErr}
	if root != nil {
		s.env = image.MergeEnv(root.img.Env(), c.Env)
		s.dir = root.proc.Dir
	}
	// Until the VM runs, a failure releases what was set up so far.
	defer func() {
		if err != nil {
			s.release()
		}
	}()
	if s.dev, err = vsock.New(guestCID, log); err != nil {
		return nil, err
	}
	if snap != nil {
		s.dev.OnResetHandled(func(handled bool) {
			if handled {
				s.vm.Mark("guest: vsock transport reset handled (seen at the host's next send)")
			} else {
				s.vm.Mark("vsock: transport reset not acknowledged in time")
			}
		})
	}
	readyL, err := s.dev.Listen(agent.ReadyPort)
	if err != nil {
		return nil, err
	}
	if s.hub, err = serveHub(s.dev, c.Hub, log); err != nil {
		return nil, err
	}
	if c.VsockSocket != "" {
		if s.hybrid, err = s.dev.ServeUnix(c.VsockSocket); err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
	}
	cmdline := []string{"console=ttyS0 quiet reboot=k panic=-1"}
	// Each device's id names its state in a snapshot: what it is to the
	// guest (a share's path, a disk's serial), never its position.
	devices := []vmm.Device{{ID: "vsock", Device: s.dev}}
	if root != nil {
		// The image and its writable layer are the first disks (vda,
		// vdb); init finds them by serial.
		devs, err := root.devices(c, s.lim.disk())
		if err != nil {
			return nil, err
		}
		s.disks = append(s.disks, devs...)
		for i, d := range devs {
			devices = append(devices, vmm.Device{ID: "blk:" + rootSerials[i], Device: d})
		}
		cmdline = append(cmdline, "capsa.root=image")
	}
	if c.Network != nil {
		var ipArg string
		if s.net, ipArg, err = startNetwork(context.WithoutCancel(ctx), c, s.lim, log); err != nil {
			return nil, err
		}
		cmdline = append(cmdline, ipArg)
		devices = append(devices, vmm.Device{ID: "net0", Device: s.net.nic})
	}
	if s.shares, s.shareFS, err = shareDevices(c.Shares, c.ShareFS, s.lim, log); err != nil {
		return nil, err
	}
	for i, d := range s.shares {
		cmdline = append(cmdline, shareArg(i, c.Shares[i], c.ShareFS))
		devices = append(devices, vmm.Device{ID: shareDeviceID(c.Shares[i], c.ShareFS), Device: d})
	}
	// Volumes are shares too, numbered after them (in this order at a
	// restore as at a boot), and closed with them.
	vols, err := volumeDevices(c.Volumes, len(c.Shares), s.lim, log)
	for _, v := range vols {
		s.shares = append(s.shares, v)
	}
	if err != nil {
		return nil, err
	}
	for i, d := range vols {
		cmdline = append(cmdline, volumeArg(len(c.Shares)+i, c.Volumes[i]))
		devices = append(devices, vmm.Device{ID: "9p:" + c.Volumes[i].Guest, Device: d})
	}
	userDisks, err := diskDevices(c.Disks, c, s.lim)
	if err != nil {
		return nil, err
	}
	s.disks = append(s.disks, userDisks...)
	for i, d := range userDisks {
		devices = append(devices, vmm.Device{ID: "blk:" + diskSerial(i), Device: d})
	}
	// The balloon, when asked for, gives the host back the memory the
	// guest frees; a restore has one where its snapshot has.
	if (snap == nil && c.Balloon) || (snap != nil && snap.State.HasDevice(balloonID)) {
		s.balloon = virtioballoon.New(log)
		devices = append(devices, vmm.Device{ID: balloonID, Device: s.balloon})
	}
	vcfg := vmm.Config{
		Kernel: kernel, Initrd: initrd, CPUs: c.CPUs, MemoryBytes: uint64(c.MemoryMiB) << 20,
		Cmdline: strings.Join(cmdline, " "), Console: c.console,
		Devices: devices, Log: log, Start: start,
	}
	if snap == nil {
		s.vm, err = vmm.New(ctx, vcfg) // the deferred releases give back kernel and initrd
		if err == nil && !c.pausedForkCopy {
			if s.clearRefs, err = guestmem.OpenClearRefs(); err != nil {
				log.Debug("sandbox: a fork pauses for its whole first snapshot", "err", err)
				s.clearRefs, err = nil, nil
			}
		}
	} else {
		var mem *guestmem.Memory
		if mem, err = snap.MapMemory(); err != nil {
			return nil, fmt.Errorf("sandbox: restore: %w", err)
		}
		s.vm, err = vmm.Restore(ctx, vcfg, snap.State, mem)
	}
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	if c.beforeRun != nil {
		if err = c.beforeRun(s); err != nil {
			return nil, fmt.Errorf("sandbox: before the guest runs: %w", err)
		}
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	dev := s.dev
	s.client = &agent.Client{Name: "capsa", Spare: true, Dial: func(ctx context.Context) (net.Conn, error) {
		return dev.Dial(ctx, agent.Port)
	}}
	vm := s.vm
	go func() {
		s.exit = vm.Run(runCtx)
		close(s.vmDone)
		// A stopped guest answers nothing more: every vsock connection
		// fails now rather than waiting on its context.
		dev.Reset()
		readyL.Close()
	}()
	if snap != nil {
		// A restored agent announced itself long ago: it is ready once
		// it answers.
		readyL.Close()
		go s.awaitAgent(c.ReadyTimeout, hostname)
		return s, nil
	}
	go func() {
		if conn, err := readyL.Accept(); err == nil {
			conn.Close()
			vm.Mark("guest: agent ready")
			if log := c.logger(); log.Enabled(context.Background(), slog.LevelDebug) {
				log.Debug("sandbox: agent ready", "timeline", vm.Timeline().String())
			}
			s.markReady()
		}
		readyL.Close()
	}()
	return s, nil
}

// release frees the VM and its devices' host resources; the VM must
// have stopped or never run.
func (s *Sandbox) release() error {
	// A snapshot under way finishes before the memory it reads goes.
	s.snapMu.Lock()
	if s.forkBase != nil {
		s.forkBase.Close()
		s.forkBase = nil
	}
	if s.clearRefs != nil {
		s.clearRefs.Close()
		s.clearRefs = nil
	}
	// What the fork chain holds is the sandbox's: its copies keep what
	// they mapped. The directory goes if it made it, else if empty (a
	// jailed supervisor may not remove it: the store does).
	for _, d := range s.forkWritten {
		os.RemoveAll(d)
	}
	if s.forkOwn {
		os.RemoveAll(s.forkChain)
	} else if s.forkChain != "" {
		os.Remove(s.forkChain)
	}
	s.forkWritten, s.forkChain = nil, ""
	s.snapMu.Unlock()
	var err error
	if s.client != nil {
		s.client.Close()
	}
	// The devices that act on guest memory from goroutines of their own
	// stop, and wait for them, before the VM's Close unmaps that memory:
	// a balloon still at work would discard pages of whatever is mapped
	// there next.
	if s.balloon != nil {
		err = s.balloon.Close()
	}
	err = errors.Join(err, closeDisks(s.disks))
	if s.vm != nil {
		err = errors.Join(err, s.vm.Close())
	}
	if s.hybrid != nil {
		err = errors.Join(err, s.hybrid.Close())
	}
	err = errors.Join(err, s.hub.close())
	for _, d := range s.shares {
		err = errors.Join(err, d.Close())
	}
	err = errors.Join(err, s.rootfs.remove())
	return errors.Join(err, s.net.close())
}

// WaitReady waits until the guest agent accepts requests.
func (s *Sandbox) WaitReady(ctx context.Context, timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-s.ready:
		return nil
	case <-s.vmDone:
		return fmt.Errorf("sandbox: the VM stopped before its agent was ready: %v\nguest console:\n%s", s.exit, s.vm.ConsoleTail())
	case <-t.C:
		return fmt.Errorf("sandbox: the guest agent was not ready after %v; the VM's state:\n%s", timeout, s.Debug(ctx))
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Wait waits for the main process and returns how it ended.
func (s *Sandbox) Wait(ctx context.Context) (*agent.ExitStatus, error) {
	s.mu.Lock()
	p := s.main
	s.mu.Unlock()
	done := make(chan struct{})
	var st *agent.ExitStatus
	var err error
	go func() { st, err = p.Wait(); close(done) }()
	select {
	case <-done:
		if errors.Is(err, agent.ErrTimedOut) {
			// The guest did not enforce the timeout (its agent stopped
			// or hung): it is trusted with nothing more.
			s.c.logger().Warn("the guest did not end the main process at its timeout; stopping the sandbox", "err", err)
			s.Close()
			return &agent.ExitStatus{Code: 128 + 9, Signal: "SIGKILL", TimedOut: true}, nil
		}
		return st, s.vmErr(err)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// vmErr explains an agent error by the VM's end, if it has ended.
func (s *Sandbox) vmErr(err error) error {
	if err == nil {
		return nil
	}
	select {
	case <-s.vmDone:
		return fmt.Errorf("sandbox: the VM stopped (%v): %w", s.exit, err)
	default:
		return err
	}
}

// Signal sends a signal ("SIGTERM", "KILL"...) to the main process's
// process group.
func (s *Sandbox) Signal(ctx context.Context, name string) error {
	s.mu.Lock()
	p := s.main
	s.mu.Unlock()
	if p == nil {
		return errors.New("sandbox: signal: no main process")
	}
	return s.vmErr(p.Signal(ctx, name))
}

// Resize gives the main process's terminal (Workload.TTY) a new size.
func (s *Sandbox) Resize(ws agent.WindowSize) error {
	s.mu.Lock()
	p := s.main
	s.mu.Unlock()
	if p == nil {
		return errors.New("sandbox: resize: no main process")
	}
	return p.Resize(ws)
}

// Shutdown asks the guest to stop and waits for the VM to end; if the guest
// does not stop by ctx's end, the VM is stopped from the host.
func (s *Sandbox) Shutdown(ctx context.Context) error {
	err := s.client.Shutdown(ctx)
	select {
	case <-s.vmDone:
	case <-ctx.Done():
	}
	return errors.Join(s.vmErr(err), s.Close())
}

// Vsock is the sandbox's vsock device: Dial reaches guest ports, Listen
// accepts guest connections to host ports.
func (s *Sandbox) Vsock() *vsock.Device { return s.dev }

// Debug returns the VM's state for diagnosing a hang or a failure: each
// vCPU's registers and pending interrupts, the virtqueues' indices, the
// exits to the VMM and the console's tail. A running VM goes on running.
// After Close it is the state taken when the VM stopped, if it failed.
func (s *Sandbox) Debug(ctx context.Context) *vmm.Debug {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		if e := s.Exit(); e != nil {
			return e.Debug
		}
		return nil
	}
	return s.vm.Debug(ctx)
}

// Done is closed when the VM has stopped.
func (s *Sandbox) Done() <-chan struct{} { return s.vmDone }

// Exit says why the VM stopped; nil while it runs.
func (s *Sandbox) Exit() *vmm.Exit {
	select {
	case <-s.vmDone:
		return s.exit
	default:
		return nil
	}
}

// Close stops the VM if it still runs and releases everything.
func (s *Sandbox) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return s.closeErr
	}
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	<-s.vmDone
	err := s.release()
	s.mu.Lock()
	s.closeErr = err
	s.mu.Unlock()
	return err
}
