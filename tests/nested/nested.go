// Package nested runs commands on a machine with KVM.
//
// Where /dev/kvm exists, a job runs directly on this machine. Where it does
// not (CI and the developers' machines have no KVM), the job runs inside an
// L1 Linux guest that QEMU emulates with TCG and an emulated AMD SVM: the L1
// kernel is Debian's linux-image-cloud-amd64, which loads kvm.ko and
// kvm-amd.ko and so offers a working /dev/kvm to the job.
//
// L1 has no network link. Its files come in an uncompressed initramfs built
// for each job (the job's files under /work, busybox, the KVM modules, and an
// /init script); the job's output comes back over L1's second serial port,
// followed by a line carrying its exit status.
package nested

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/capsa-sandbox/capsa/internal/cpio"
	"github.com/capsa-sandbox/capsa/kvm"
)

// Host describes where and how jobs run. The zero value is ready to use.
type Host struct {
	Log         *slog.Logger // nil: discard
	CacheDir    string       // default $CAPSA_CACHE, else ~/.cache/capsa
	L1Dir       string       // unpacked kernel package; default CacheDir/l1/current
	MemoryMB    int          // L1 memory; default 4096
	CPUs        int          // L1 vCPUs; default 2
	QEMU        string       // default CacheDir/qemu/current/bin/qemu-system-x86_64 (scripts/qemu-build.sh), else qemu-system-x86_64
	Busybox     string       // a static busybox; default /bin/busybox
	ForceNested bool         // use L1 even where /dev/kvm exists
	// KernelArgs are added to L1's kernel command line.
	KernelArgs string
	// Accel is QEMU's -accel for L1; default "tcg,thread=multi" (one host
	// thread per L1 vCPU).
	Accel string
	// L1Retries is how many more times a job runs when the L1 kernel
	// itself crashes (see ErrL1Crashed); 0 means never.
	L1Retries int
}

// ErrL1Crashed is wrapped when the L1 kernel oopsed or panicked before the
// job finished. QEMU's TCG emulation of SVM occasionally corrupts L1 under
// heavy nested use (seen: "BUG: TASK stack guard page was hit" in L1's
// exception entry while L2 guests ran); that says nothing of the job, so
// Run can run it again (Host.L1Retries).
var ErrL1Crashed = errors.New("the nested L1 host kernel crashed")

// l1TimerArgs keep L1's timer interrupts coming under TCG's emulated SVM:
// with the TSC-deadline timer and a tickless kernel, L1 sometimes stopped
// getting timer interrupts while it ran guests and then sat idle for good
// (RCU: "timer wakeup didn't happen ... Possible timer handling issue").
// The LAPIC's own timer and a periodic tick make that rarer.
const l1TimerArgs = "lapic=notscdeadline nohz=off"

// l1CrashMarkers are what Linux prints when it oopses or panics, or when
// it stalls (seen: L1's timer on one vCPU stops firing, and RCU and the
// hung-task detector report it while everything waits).
var l1CrashMarkers = []string{
	"Kernel panic - not syncing", "BUG: ", "Oops: ", "general protection fault",
	"rcu: INFO: rcu_preempt detected stalls", "rcu_preempt kthread starved", "blocked for more than",
}

// l1Heartbeat is the line L1's init writes to its console every 15 s
// while the job runs; l1Silence is how long the watcher waits for the
// next before it takes L1 for stopped. Seen once: for 25 minutes L1 kept
// its vCPUs busy and printed nothing, no crash marker and no output of the
// job, whose own timeouts never fired (its timers, it seems, had stopped):
// without the heartbeat that costs the job's whole timeout.
const l1Heartbeat = "capsa-nested heartbeat"

var l1Silence = 4 * time.Minute // a variable for the tests

// watchL1Console polls L1's console file and calls crashed once, with
// why, if it shows a crash or stall, or if L1's heartbeats, once begun,
// stop for l1Silence; until ctx ends.
func watchL1Console(ctx context.Context, path string, crashed func(why string)) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	beats, last := 0, time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		if l1Crashed(b) {
			crashed("its console shows a crash or a stall")
			return
		}
		if n := bytes.Count(b, []byte(l1Heartbeat)); n != beats {
			beats, last = n, time.Now()
		} else if beats > 0 && time.Since(last) > l1Silence {
			crashed(fmt.Sprintf("its init wrote no heartbeat for %v (its timers or its userspace stopped)", l1Silence))
			return
		}
	}
}

// File is a host file or directory made available to a job at Dst, a path
// relative to the job's working directory.
type File struct {
	Src string
	Dst string
}

// Job is one command to run with KVM available.
type Job struct {
	Files  []File
	Argv   []string  // run in the working directory that holds Files
	Env    []string  // KEY=VALUE, added to the environment
	Output io.Writer // the command's stdout and stderr; nil: discard
}

// Result describes a finished job.
type Result struct {
	ExitCode int
	Nested   bool          // ran inside the L1 guest
	Ready    time.Duration // from start until KVM was usable (L1 boot and module load)
	Total    time.Duration
}

// ErrNoL1 is wrapped when the L1 kernel has not been unpacked.
var ErrNoL1 = errors.New("nested KVM host not installed (run `make nested-deps`)")

// HaveKVM reports whether this machine offers a /dev/kvm that can boot
// capsa's guest. PVM's /dev/kvm cannot (see kvm.IsPVM): there the jobs run
// in the nested host like on a machine without KVM.
func HaveKVM() bool {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return false
	}
	f.Close()
	return !kvm.IsPVM()
}

func (h *Host) log() *slog.Logger {
	if h.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return h.Log
}

// Run runs job and returns its exit status. An error means the job could not
// be run or its status is unknown; a job that ran and failed is a Result with
// a non-zero ExitCode.
func (h *Host) Run(ctx context.Context, job Job) (*Result, error) {
	if len(job.Argv) == 0 {
		return nil, errors.New("nested: job has no command")
	}
	if job.Output == nil {
		job.Output = io.Discard
	}
	for _, f := range job.Files {
		if err := checkDst(f.Dst); err != nil {
			return nil, err
		}
		if _, err := os.Stat(f.Src); err != nil {
			return nil, fmt.Errorf("nested: job file: %w", err)
		}
	}
	for _, e := range job.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" || strings.ContainsAny(k, " \t\n'\"$") {
			return nil, fmt.Errorf("nested: bad environment entry %q (want KEY=VALUE)", e)
		}
	}
	if !h.ForceNested && HaveKVM() {
		return h.runDirect(ctx, job)
	}
	for attempt := 1; ; attempt++ {
		res, err := h.runL1(ctx, job)
		if !errors.Is(err, ErrL1Crashed) || attempt > h.L1Retries || ctx.Err() != nil {
			return res, err
		}
		fmt.Fprintf(job.Output, "capsa-nested: %v\ncapsa-nested: running the job again (attempt %d of %d)\n", err, attempt+1, h.L1Retries+1)
		h.log().Warn("L1 crashed; running the job again", "attempt", attempt+1)
	}
}

func checkDst(dst string) error {
	c := filepath.Clean(dst)
	if dst == "" || filepath.IsAbs(dst) || c == "." || c == ".." || strings.HasPrefix(c, "../") {
		return fmt.Errorf("nested: file destination %q must be a relative path inside the work directory", dst)
	}
	return nil
}

// runDirect runs the job on this machine in a temporary directory that links
// to the job's files.
func (h *Host) runDirect(ctx context.Context, job Job) (*Result, error) {
	start := time.Now()
	dir, err := os.MkdirTemp("", "capsa-nested-")
	if err != nil {
		return nil, fmt.Errorf("nested: %w", err)
	}
	defer os.RemoveAll(dir)
	for _, f := range job.Files {
		src, err := filepath.Abs(f.Src)
		if err != nil {
			return nil, fmt.Errorf("nested: %w", err)
		}
		dst := filepath.Join(dir, filepath.Clean(f.Dst))
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return nil, fmt.Errorf("nested: %w", err)
		}
		if err := os.Symlink(src, dst); err != nil {
			return nil, fmt.Errorf("nested: %w", err)
		}
	}
	cmd := exec.CommandContext(ctx, job.Argv[0], job.Argv[1:]...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), job.Env...)
	cmd.Stdout, cmd.Stderr = job.Output, job.Output
	h.log().Info("running directly: /dev/kvm present", "argv", job.Argv)
	err = cmd.Run()
	res := &Result{Total: time.Since(start)}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee) && ee.Exited():
		res.ExitCode = ee.ExitCode()
	default:
		return nil, fmt.Errorf("nested: run %s: %w", job.Argv[0], err)
	}
	return res, nil
}

func (h *Host) defaults() (cache, l1, qemu, busybox string, mem, cpus int) {
	cache = h.CacheDir
	if cache == "" {
		cache = os.Getenv("CAPSA_CACHE")
	}
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "capsa")
	}
	l1 = h.L1Dir
	if l1 == "" {
		l1 = filepath.Join(cache, "l1", "current")
	}
	qemu, busybox = h.QEMU, h.Busybox
	if qemu == "" {
		// scripts/qemu-build.sh's QEMU, with the fixes to its emulated
		// SVM that nested guests need; the system's when it is not built.
		qemu = filepath.Join(cache, "qemu", "current", "bin", "qemu-system-x86_64")
		if _, err := os.Stat(qemu); err != nil {
			qemu = "qemu-system-x86_64"
		}
	}
	if busybox == "" {
		busybox = "/bin/busybox"
	}
	mem, cpus = h.MemoryMB, h.CPUs
	if mem == 0 {
		mem = 4096
	}
	if cpus == 0 {
		cpus = 2
	}
	return
}

// l1Kernel finds the L1 kernel image and its KVM modules in the unpacked
// package.
func l1Kernel(dir string) (vmlinuz string, modules []string, err error) {
	imgs, _ := filepath.Glob(filepath.Join(dir, "boot", "vmlinuz-*"))
	if len(imgs) != 1 {
		return "", nil, fmt.Errorf("%w: no single vmlinuz in %s/boot", ErrNoL1, dir)
	}
	// Load order matters: kvm needs irqbypass, kvm-amd needs kvm, bridge
	// needs stp, which needs llc. veth lets jobs build network namespaces
	// joined by veth pairs; bridge and overlay let them run a CNI bridge
	// network and containerd's overlayfs snapshotter; tun and the tc
	// modules join a pod's VM to its network (package shim); loop lets
	// a job mount a file system that keeps user extended attributes,
	// which L1's tmpfs does not.
	for _, m := range []string{"virt/lib/irqbypass.ko", "arch/x86/kvm/kvm.ko", "arch/x86/kvm/kvm-amd.ko", "drivers/net/veth.ko",
		"net/llc/llc.ko", "net/802/stp.ko", "net/bridge/bridge.ko", "fs/overlayfs/overlay.ko",
		"drivers/net/tun.ko", "net/sched/sch_ingress.ko", "net/sched/cls_u32.ko", "net/sched/act_mirred.ko",
		"drivers/block/loop.ko"} {
		found, _ := filepath.Glob(filepath.Join(dir, "lib", "modules", "*", "kernel", m))
		if len(found) != 1 {
			return "", nil, fmt.Errorf("%w: %s not found under %s", ErrNoL1, m, dir)
		}
		modules = append(modules, found[0])
	}
	return imgs[0], modules, nil
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// initScript is L1's /init. It reports progress on the output port with
// lines that carry a per-job nonce, so no output of the job can forge them.
const initScript = `#!/bin/busybox sh
/bin/busybox --install -s /bin
# The root moves from the initial ramfs, which pivot_root cannot take
# away, to a tmpfs, as an initramfs's /init hands over to a real root: the
# jail then takes the pivot_root path every real host takes.
if [ ! -e /.capsa-root ]; then
	mkdir -p /newroot && mount -t tmpfs -o size=75% tmpfs /newroot
	for d in /*; do
		case $d in /newroot | /proc | /sys | /dev) ;; *) cp -a "$d" /newroot/ ;; esac
	done
	mkdir -p /newroot/proc /newroot/sys /newroot/dev && touch /newroot/.capsa-root
	exec switch_root /newroot /init
fi
mkdir -p /proc /sys /dev /tmp
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts
mount -t devpts -o ptmxmode=0666 devpts /dev/pts
mount -t tmpfs tmpfs /tmp
# cgroup v2 with the memory, pids and cpu controllers given to the root's
# children, as a systemd host delegates them: a VMM's confinement joins
# a cgroup of its own here, so the tests exercise that layer.
mkdir -p /sys/fs/cgroup
mount -t cgroup2 cgroup2 /sys/fs/cgroup && echo "+memory +pids +cpu" >/sys/fs/cgroup/cgroup.subtree_control ||
	echo "nested: no cgroup v2 with memory, pids and cpu controllers" >/dev/ttyS1
ip link set lo up
stty -F /dev/ttyS1 raw -echo
exec 3>/dev/ttyS1
finish() { echo "@@capsa-nested exit @NONCE@ $1" >&3; sync; poweroff -f; }
for m in /lib/kvm/*.ko; do
	insmod "$m" || { echo "nested: insmod $m failed" >&3; finish 125; }
done
[ -c /dev/kvm ] || { echo "nested: /dev/kvm missing after loading the KVM modules" >&3; finish 125; }
echo "@@capsa-nested ready @NONCE@" >&3
# A heartbeat on the console while the job runs: capsa-nested takes its
# stopping for L1's.
( i=0; while sleep 15; do i=$((i+1)); echo "capsa-nested heartbeat $i" >/dev/ttyS0; done ) &
cd /work
/bin/sh /job.sh >&3 2>&3 </dev/null
finish $?
`

func (h *Host) buildInitramfs(path string, job Job, nonce string, modules []string, busybox string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	w := cpio.NewWriter(bw)
	var script strings.Builder
	script.WriteString("set -e\n")
	for _, e := range job.Env {
		k, v, _ := strings.Cut(e, "=")
		fmt.Fprintf(&script, "export %s=%s\n", k, shellQuote(v))
	}
	script.WriteString("exec")
	for _, a := range job.Argv {
		script.WriteString(" " + shellQuote(a))
	}
	script.WriteString("\n")

	steps := []func() error{
		func() error { return w.Dir("bin", 0o755) },
		func() error { return w.Dir("dev", 0o755) },
		func() error { return w.CharDev("dev/console", 0o600, 5, 1) },
		func() error { return w.Dir("lib", 0o755) },
		func() error { return w.Dir("lib/kvm", 0o755) },
		func() error { return w.Dir("work", 0o755) },
		func() error { return w.CopyFile("bin/busybox", busybox, 0o755) },
		func() error { return w.File("init", 0o755, []byte(strings.ReplaceAll(initScript, "@NONCE@", nonce))) },
		func() error { return w.File("job.sh", 0o644, []byte(script.String())) },
	}
	for i, m := range modules {
		name := fmt.Sprintf("lib/kvm/%d-%s", i, filepath.Base(m))
		steps = append(steps, func() error { return w.CopyFile(name, m, 0o644) })
	}
	// The job's files, directories walked recursively; every parent
	// directory is added before what it holds.
	type entry struct{ src, dst string }
	var files []entry
	dirs := map[string]bool{}
	addParents := func(dst string) {
		for d := filepath.Dir(dst); d != "work" && !dirs[d]; d = filepath.Dir(d) {
			dirs[d] = true
		}
	}
	for _, jf := range job.Files {
		root := filepath.Join("work", filepath.Clean(jf.Dst))
		err := filepath.WalkDir(jf.Src, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(jf.Src, p)
			dst := filepath.Join(root, rel)
			addParents(dst)
			if d.IsDir() {
				dirs[dst] = true
			} else {
				files = append(files, entry{p, dst})
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("nested: job file: %w", err)
		}
	}
	// Parents before children: sorted, a prefix comes first.
	for _, d := range slices.Sorted(maps.Keys(dirs)) {
		steps = append(steps, func() error { return w.Dir(d, 0o755) })
	}
	for _, e := range files {
		st, err := os.Stat(e.src) // follows links, as the direct mode does
		if err != nil {
			return fmt.Errorf("nested: job file: %w", err)
		}
		steps = append(steps, func() error { return w.CopyFile(e.dst, e.src, st.Mode().Perm()) })
	}
	steps = append(steps, w.Close, bw.Flush, f.Close)
	for _, s := range steps {
		if err := s(); err != nil {
			f.Close()
			return fmt.Errorf("nested: build L1 initramfs: %w", err)
		}
	}
	return nil
}

// runL1 boots the L1 guest with the job and waits for its exit line.
func (h *Host) runL1(ctx context.Context, job Job) (*Result, error) {
	start := time.Now()
	_, l1, qemu, busybox, mem, cpus := h.defaults()
	vmlinuz, modules, err := l1Kernel(l1)
	if err != nil {
		return nil, err
	}
	if _, err := exec.LookPath(qemu); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoL1, err)
	}
	if _, err := os.Stat(busybox); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoL1, err)
	}
	tmp, err := os.MkdirTemp("", "capsa-l1-")
	if err != nil {
		return nil, fmt.Errorf("nested: %w", err)
	}
	defer os.RemoveAll(tmp)
	var nb [8]byte
	rand.Read(nb[:])
	nonce := hex.EncodeToString(nb[:])
	initrd := filepath.Join(tmp, "initramfs.cpio")
	if err := h.buildInitramfs(initrd, job, nonce, modules, busybox); err != nil {
		return nil, err
	}
	console := filepath.Join(tmp, "console.log")
	args := []string{
		"-M", "q35", "-accel", cmp.Or(h.Accel, "tcg,thread=multi"), "-cpu", "EPYC,+svm,+npt",
		"-smp", strconv.Itoa(cpus), "-m", strconv.Itoa(mem),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-nic", "none",
		"-kernel", vmlinuz, "-initrd", initrd,
		"-append", strings.TrimSpace("console=ttyS0 quiet panic=-1 " + l1TimerArgs + " " + h.KernelArgs),
		"-serial", "file:" + console, "-serial", "stdio",
	}
	h.log().Info("booting nested KVM host", "qemu", qemu, "kernel", vmlinuz, "memory_mb", mem, "cpus", cpus)
	// A watcher stops L1 as soon as its console shows its kernel crashed
	// or stalled: a stalled L1 (its timers dead) would otherwise hold the
	// job until the overall timeout.
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	crashed := make(chan struct{})
	var crashWhy string
	go watchL1Console(runCtx, console, func(why string) { crashWhy = why; close(crashed); stopRun() })
	cmd := exec.CommandContext(runCtx, qemu, args...)
	cmd.WaitDelay = 5 * time.Second
	p := &outputParser{nonce: nonce, out: job.Output, start: start, exit: -1}
	cmd.Stdout = p
	var qerr bytes.Buffer
	cmd.Stderr = &qerr
	err = cmd.Run()
	p.flush()
	res := &Result{Nested: true, Ready: p.ready, Total: time.Since(start)}
	if p.exit >= 0 {
		res.ExitCode = p.exit
		return res, nil
	}
	tail, _ := os.ReadFile(console)
	if len(tail) > 4000 {
		tail = tail[len(tail)-4000:]
	}
	select {
	case <-crashed:
		return nil, fmt.Errorf("nested: %w: %s (QEMU TCG's emulated SVM; not the job's doing)\nL1 console tail:\n%s", ErrL1Crashed, crashWhy, tail)
	default:
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("nested: L1 guest stopped: %w\nL1 console tail:\n%s", ctx.Err(), tail)
	}
	if l1Crashed(tail) {
		return nil, fmt.Errorf("nested: %w (QEMU TCG's emulated SVM; not the job's doing)\nL1 console tail:\n%s", ErrL1Crashed, tail)
	}
	if why, ok := qemuCrashed(cmd.ProcessState, qerr.Bytes()); ok {
		// QEMU itself crashed (an assertion of its own, or a fault):
		// the machine L1 is died under it, whatever L1 ran; a real CPU
		// neither aborts nor faults. It counts as L1's crash, with the
		// same rules (run-e2e.sh: the tests it cut short run again
		// once; twice in a run fails it).
		when := "before the job started"
		if p.ready > 0 {
			when = "while the job ran"
		}
		return nil, fmt.Errorf("nested: %w: QEMU, which runs it, crashed %s (%s)\nL1 console tail:\n%s", ErrL1Crashed, when, why, tail)
	}
	return nil, fmt.Errorf("nested: L1 guest ended without reporting the job's status (qemu: %v %s)\nL1 console tail:\n%s",
		err, strings.TrimSpace(qerr.String()), tail)
}

// qemuCrashed reports whether QEMU itself crashed, and why: it ended on
// SIGABRT (the last line of its stderr that names a failed assertion,
// else its last line; seen once in make test, before the session's job
// had printed anything: "memory_region_get_ram_ptr: Assertion
// `mr->ram_block' failed"), or on a fault (SIGSEGV, SIGBUS, SIGILL,
// SIGFPE: the signal; a SIGSEGV seen once in make test, as L1 booted,
// its console still empty). A QEMU killed otherwise (SIGKILL: the host's
// OOM killer, a timeout) or exiting did not crash.
func qemuCrashed(st *os.ProcessState, stderr []byte) (string, bool) {
	if st == nil {
		return "", false
	}
	ws, ok := st.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() {
		return "", false
	}
	switch sig := ws.Signal(); sig {
	case syscall.SIGABRT:
		return abortReason(stderr), true
	case syscall.SIGSEGV, syscall.SIGBUS, syscall.SIGILL, syscall.SIGFPE:
		return "killed by " + sig.String(), true
	}
	return "", false
}

// abortReason picks the line of QEMU's stderr that says why it aborted.
func abortReason(stderr []byte) string {
	lines := strings.Split(strings.TrimSpace(string(stderr)), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], "Assertion") || strings.Contains(lines[i], "assertion") {
			return strings.TrimSpace(lines[i])
		}
	}
	if last := strings.TrimSpace(lines[len(lines)-1]); last != "" {
		return last
	}
	return "no message"
}

// l1Crashed reports whether L1's console shows its kernel crashed.
func l1Crashed(console []byte) bool {
	for _, m := range l1CrashMarkers {
		if bytes.Contains(console, []byte(m)) {
			return true
		}
	}
	return false
}

// outputParser passes the job's output through line by line and takes the
// nonce-tagged status lines out of it.
type outputParser struct {
	nonce string
	out   io.Writer
	start time.Time
	buf   []byte
	ready time.Duration
	exit  int // -1 until the exit line arrives
}

func (p *outputParser) Write(b []byte) (int, error) {
	p.buf = append(p.buf, b...)
	for {
		i := bytes.IndexByte(p.buf, '\n')
		if i < 0 {
			break
		}
		p.line(p.buf[:i+1])
		p.buf = p.buf[i+1:]
	}
	return len(b), nil
}

func (p *outputParser) line(l []byte) {
	s := strings.TrimRight(string(l), "\r\n")
	if rest, ok := strings.CutPrefix(s, "@@capsa-nested "); ok {
		f := strings.Fields(rest)
		switch {
		case len(f) == 2 && f[0] == "ready" && f[1] == p.nonce:
			p.ready = time.Since(p.start)
			return
		case len(f) == 3 && f[0] == "exit" && f[1] == p.nonce:
			if n, err := strconv.Atoi(f[2]); err == nil {
				p.exit = n
				return
			}
		}
	}
	p.out.Write(l)
}

func (p *outputParser) flush() {
	if len(p.buf) > 0 {
		p.out.Write(p.buf)
		p.buf = nil
	}
}
