// Package vmm is the one place where KVM meets the devices: it creates the
// VM and its vCPUs, lays out guest memory and the boot state with the boot
// package, attaches the devices, and runs one goroutine per vCPU, locked to
// its OS thread, that turns VM exits into device accesses.
//
// Every other package stays ignorant of KVM (devices, boot, guestmem) or of
// devices (kvm), so that each can be tested alone.
package vmm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/boot"
	"github.com/capsa-sandbox/capsa/devices"
	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/kvm"
	"github.com/capsa-sandbox/capsa/virtio"
)

// consoleFlushWait bounds how long Run waits for the console writer to take
// the guest's last output.
const consoleFlushWait = 5 * time.Second

// MaxCPUs is the largest vCPU count capsa configures (the guest kernel's
// NR_CPUS).
const MaxCPUs = 64

// Guest physical addresses KVM needs for itself on Intel (VMX): a 3-page TSS
// and the identity-map page, just below the BIOS area at the top of 4 GiB.
const (
	tssAddr         = 0xfffb_d000
	identityMapAddr = 0xfffb_c000
)

// Config describes a VM.
type Config struct {
	Kernel      []byte // vmlinux ELF or bzImage
	Initrd      []byte // optional
	Cmdline     string
	CPUs        int
	MemoryBytes uint64

	Console      io.Writer // guest serial output; nil discards it
	ConsoleInput io.Reader // optional: bytes fed to the guest's serial input

	// Devices are attached as virtio-mmio devices and declared on the
	// kernel command line, in this order at a boot; a restore places each
	// where its id was when the state was saved.
	Devices []Device

	Log        *slog.Logger
	DevicePath string    // default /dev/kvm
	Start      time.Time // the VMM's start, for the boot time; default: when New is called
}

// Machine is a configured VM, ready to Run once.
type Machine struct {
	cfg     Config
	log     *slog.Logger
	sys     *kvm.System
	vm      *kvm.VM
	mem     *guestmem.Memory
	vcpus   []*kvm.VCPU
	cpuid   [][]kvm.CPUIDEntry // each vCPU's, as set
	tids    []atomic.Int32     // OS thread of each running vCPU, 0 before it starts
	cpuBase []atomic.Int64     // each running vCPU thread's CPU time (ns) when it took the vCPU
	cpuDone atomic.Int64       // CPU time (ns) the vCPU threads that ended spent on their vCPUs
	ports   *devices.Bus
	mmio    *devices.Bus
	serial  *devices.Serial
	console *consoleWatch
	marker  *devices.BootMarker
	virtio  []*virtioSlot

	track []*vcpuTrack

	timeline timeline
	stats    []*kvm.Stats // each vCPU's KVM counters, for the timeline
	// bootTimeline is the timeline when the guest wrote its boot marker.
	bootTimeline atomic.Pointer[Timeline]

	// runMu guards running and paused against Debug, Pause, Resume and
	// Close.
	runMu   sync.Mutex
	running bool
	paused  *pause // non-nil while paused
	gate    *virtio.Gate

	stopOnce sync.Once
	stopped  chan struct{}
	stopping atomic.Bool
	exit     Exit
	ran      atomic.Bool
	unknown  atomic.Int64 // unhandled port and MMIO accesses, for the log's rate limit
}

// Device is a virtio device under the id that names it in the VM's saved
// state: unique in the VM, at most maxDeviceID bytes, and the same at a
// restore as when the state was saved (for example "vsock", "net0",
// "9p:/mnt/work", "blk:capsa-image"). A restore gives each device the
// state saved under its id and the place in the guest's memory map it had
// then, whatever Config.Devices' order (Firecracker keeps each device's
// state under its id too).
type Device struct {
	ID string
	virtio.Device
}

// maxDeviceID bounds a device id, in a configuration and in a state file.
const maxDeviceID = 256

// checkDeviceIDs refuses an empty, overlong, unprintable or repeated id.
func checkDeviceIDs(devs []Device) error {
	seen := make(map[string]bool, len(devs))
	for i, d := range devs {
		if err := checkDeviceID(d.ID); err != nil {
			return fmt.Errorf("virtio device %d: %w", i, err)
		}
		if seen[d.ID] {
			return fmt.Errorf("two virtio devices have the id %q", d.ID)
		}
		seen[d.ID] = true
	}
	return nil
}

func checkDeviceID(id string) error {
	if id == "" || len(id) > maxDeviceID {
		return fmt.Errorf("device id of %d bytes, want 1 to %d", len(id), maxDeviceID)
	}
	for _, r := range id {
		if r < 0x20 || r == 0x7f || r == utf8.RuneError {
			return fmt.Errorf("device id %q: want printable UTF-8", id)
		}
	}
	return nil
}

// New creates the VM: it opens KVM, maps memory, loads the kernel and
// initramfs, writes the boot structures and configures every vCPU.
func New(ctx context.Context, cfg Config) (*Machine, error) {
	if len(cfg.Kernel) == 0 {
		return nil, errors.New("vmm: no kernel image")
	}
	return newMachine(ctx, cfg, nil, nil)
}

// Restore creates a VM in the state st (taken by State from a paused VM)
// on the guest memory mem, which it then owns (guestmem.Map maps a saved
// memory file copy-on-write). cfg must describe the same machine: its
// vCPU count and memory size are checked against st, and its Devices must
// be the devices whose ids st holds, each of the kind saved under its id;
// each is placed where it was and its state restored by its transport. No
// kernel is loaded; Run continues the guest where it was.
func Restore(ctx context.Context, cfg Config, st *State, mem *guestmem.Memory) (*Machine, error) {
	if mem == nil {
		return nil, errors.New("vmm: restore: no guest memory")
	}
	if mem.Size() != (cfg.MemoryBytes+4095)&^4095 {
		mem.Close()
		return nil, fmt.Errorf("vmm: restore: %d bytes of guest memory for a VM of %d", mem.Size(), cfg.MemoryBytes)
	}
	if err := st.Check(cfg); err != nil {
		mem.Close()
		return nil, fmt.Errorf("vmm: restore: %w", err)
	}
	cfg.Devices = st.deviceOrder(cfg.Devices)
	return newMachine(ctx, cfg, st, mem)
}

// newMachine checks cfg and builds the VM: booted from cfg's kernel, or
// restored from st on mem.
func newMachine(ctx context.Context, cfg Config, st *State, mem *guestmem.Memory) (*Machine, error) {
	fail := func(err error) (*Machine, error) {
		if mem != nil {
			mem.Close()
		}
		return nil, err
	}
	if cfg.CPUs < 1 || cfg.CPUs > MaxCPUs {
		return fail(fmt.Errorf("vmm: %d vCPUs: must be between 1 and %d", cfg.CPUs, MaxCPUs))
	}
	if cfg.MemoryBytes < 32<<20 {
		return fail(fmt.Errorf("vmm: %d bytes of memory: at least 32 MiB is needed", cfg.MemoryBytes))
	}
	if err := checkDeviceIDs(cfg.Devices); err != nil {
		return fail(fmt.Errorf("vmm: %w", err))
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Start.IsZero() {
		cfg.Start = time.Now()
	}
	cfg.MemoryBytes = (cfg.MemoryBytes + 4095) &^ 4095
	m := &Machine{cfg: cfg, log: cfg.Log, stopped: make(chan struct{}), ports: devices.NewPortBus(), mmio: devices.NewMMIOBus(), gate: virtio.NewGate(), mem: mem}
	m.timeline.start = cfg.Start
	m.timeline.mark("vmm: configured")
	if err := m.build(ctx, st); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

// build creates the VM, then boots it or, with st, restores it; on error,
// Close releases what it made.
func (m *Machine) build(ctx context.Context, st *State) (err error) {
	cfg := m.cfg
	var images func() loadedImages
	if st == nil {
		// The kernel and initramfs are copied into guest memory while KVM
		// makes the VM: in the nested host each takes tens of milliseconds
		// and neither needs the other.
		if m.mem, err = guestmem.New(cfg.MemoryBytes); err != nil {
			return err
		}
		c := make(chan loadedImages, 1)
		go func() { c <- m.loadImages() }()
		images = sync.OnceValue(func() loadedImages { return <-c })
		// Close, after an error, must not unmap memory the copy writes.
		defer images()
	}
	if m.sys, err = kvm.OpenPath(cfg.DevicePath); err != nil {
		return err
	}
	if err = m.sys.CheckCapabilities(kvm.RequiredCaps...); err != nil {
		return err
	}
	if m.vm, err = m.sys.CreateVM(); err != nil {
		return err
	}
	if err = m.vm.SetTSSAddr(tssAddr); err != nil {
		return err
	}
	if err = m.vm.SetIdentityMapAddr(identityMapAddr); err != nil {
		return err
	}
	if err = m.vm.CreateIRQChip(); err != nil {
		return err
	}
	if err = m.vm.CreatePIT2(); err != nil {
		return err
	}
	// The guest keeps time with kvm-clock and its local APIC timer; the
	// PIT ticks only early in boot. Ticks it missed while the vCPU was
	// descheduled are not worth a burst of interrupts when it runs again.
	if err = m.vm.SetPITReinject(false); err != nil {
		return err
	}
	m.timeline.mark("vmm: KVM VM, interrupt controllers and PIT made")
	for i, r := range m.mem.Regions() {
		if err = m.vm.SetUserMemoryRegion(uint32(i), 0, r.GPA, r.Host); err != nil {
			return err
		}
	}
	m.timeline.mark("vmm: guest memory mapped")

	if err = m.attachDevices(); err != nil {
		return err
	}
	virtioArgs, err := m.attachVirtio()
	if err != nil {
		return err
	}
	m.timeline.mark("vmm: devices attached")
	if st != nil {
		if err = m.restoreState(st); err != nil {
			return fmt.Errorf("vmm: restore: %w", err)
		}
		m.openStats()
		m.timeline.mark("vmm: state restored")
		m.log.Debug("vm restored", "cpus", cfg.CPUs, "memory", cfg.MemoryBytes)
		return ctx.Err()
	}
	img := images()
	// They may be file mappings their caller releases once New returns.
	m.cfg.Kernel, m.cfg.Initrd = nil, nil
	if img.err != nil {
		return img.err
	}
	img.boot.Cmdline = cfg.Cmdline + virtioArgs
	state, err := boot.Setup(m.mem, img.boot)
	if err != nil {
		return fmt.Errorf("boot setup: %w", err)
	}
	m.timeline.mark("vmm: boot tables written")
	if err = m.createVCPUs(state); err != nil {
		return err
	}
	m.openStats()
	m.timeline.mark("vmm: vCPUs set up")
	m.log.Debug("vm created", "cpus", cfg.CPUs, "memory", cfg.MemoryBytes, "cmdline", cfg.Cmdline)
	return ctx.Err()
}

// loadedImages is where loadImages put the kernel and initramfs: the boot
// configuration but its command line.
type loadedImages struct {
	boot boot.Config
	err  error
}

// loadImages copies cfg's kernel and initramfs into guest memory.
//
// Reading them can fault if they are mappings of files truncated meanwhile
// (assets.MapFile); that fault is this VM's error, not the process's
// crash.
func (m *Machine) loadImages() (img loadedImages) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			f, ok := r.(interface{ Addr() uintptr })
			if !ok {
				panic(r)
			}
			img.err = fmt.Errorf("load kernel and initramfs: a fault reading them at %#x (was the file truncated?)", f.Addr())
		}
	}()
	k, err := boot.LoadKernel(m.mem, m.cfg.Kernel)
	if err != nil {
		return loadedImages{err: fmt.Errorf("load kernel: %w", err)}
	}
	img.boot = boot.Config{Kernel: k, CPUs: m.cfg.CPUs}
	if len(m.cfg.Initrd) > 0 {
		if img.boot.InitrdAddr, img.boot.InitrdSize, err = boot.LoadInitrd(m.mem, k, m.cfg.Initrd); err != nil {
			return loadedImages{err: fmt.Errorf("load initramfs: %w", err)}
		}
	}
	m.timeline.mark("vmm: kernel and initramfs loaded (beside KVM's setup)")
	return img
}

func (m *Machine) attachDevices() error {
	m.console = &consoleWatch{out: m.cfg.Console, first: func() { m.timeline.mark("guest: first console output") }}
	m.serial = devices.NewSerial(m.console, m.irqLevel(devices.SerialIRQCOM1))
	m.marker = devices.NewBootMarker(m.cfg.Start, func(d time.Duration) {
		m.log.Debug("guest reached userspace", "after", d)
		m.timeline.mark("guest: userspace (boot marker)")
		tl := m.Timeline()
		m.bootTimeline.Store(&tl)
	})
	i8042 := devices.NewI8042(func() { m.stop(StopReboot, "reset through the i8042", nil) })
	sleep := devices.NewACPISleep(boot.ACPISleepTypeS5, func() { m.stop(StopPowerOff, "ACPI soft off (S5)", nil) })
	for _, d := range []struct {
		base, size uint64
		dev        devices.Device
	}{
		{devices.SerialPortCOM1, 8, m.serial},
		{devices.I8042DataPort, 5, i8042},
		{devices.BootMarkerPort, 1, m.marker},
		{boot.ACPISleepControlPort, 2, sleep},
	} {
		if err := m.ports.Register(d.base, d.size, d.dev); err != nil {
			return fmt.Errorf("vmm: attach device: %w", err)
		}
	}
	return nil
}

// irqLevel returns a callback that sets the level of an interrupt line of
// the in-kernel PIC and IOAPIC.
func (m *Machine) irqLevel(line uint32) devices.IRQLevel {
	return func(high bool) {
		if err := m.vm.IRQLine(line, high); err != nil {
			m.log.Warn("set interrupt line", "line", line, "high", high, "err", err)
		}
	}
}

// ConsoleTail returns the last few KiB of the guest's console.
func (m *Machine) ConsoleTail() string { return m.console.Tail() }

// Memory returns the guest's memory (for devices added by later layers).
func (m *Machine) Memory() *guestmem.Memory { return m.mem }

// Run runs the VM until it stops, and says why. It may be called once.
func (m *Machine) Run(ctx context.Context) *Exit {
	if m.ran.Swap(true) {
		return &Exit{Reason: StopError, Err: errors.New("vmm: Run called twice")}
	}
	m.console.start()
	if in := m.cfg.ConsoleInput; in != nil {
		go m.pumpInput(in)
	}
	m.startVirtio()
	m.runMu.Lock()
	m.running = true
	m.runMu.Unlock()
	m.timeline.mark("vmm: vCPUs started")
	var wg sync.WaitGroup
	for i := range m.vcpus {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.runVCPU(i)
		}()
	}
	select {
	case <-ctx.Done():
		m.stop(StopCanceled, context.Cause(ctx).Error(), nil)
	case <-m.stopped:
	}
	m.kickAll()
	wg.Wait()
	m.runMu.Lock()
	m.running = false
	m.runMu.Unlock()
	m.console.flush(consoleFlushWait)
	exit := m.exit
	exit.BootTime, _ = m.marker.Elapsed()
	// A panic is followed by a reset (panic=-1): report the panic.
	if msg, ok := m.console.Panic(); ok && (exit.Reason == StopReboot || exit.Reason == StopHalted) {
		exit.Reason, exit.Detail = StopPanic, msg
	}
	if !exit.Reason.Clean() {
		exit.Debug = m.Debug(context.Background())
	}
	return &exit
}

func (m *Machine) pumpInput(in io.Reader) {
	buf := make([]byte, 4096)
	for {
		n, err := in.Read(buf)
		if n > 0 {
			m.serial.Input(buf[:n])
		}
		if err != nil || m.stopping.Load() {
			return
		}
	}
}

// Stop makes a running VM stop for the host's reason: Run returns an Exit
// with it (unless the VM was stopping already).
func (m *Machine) Stop(reason StopReason, detail string) { m.stop(reason, detail, nil) }

// stop records the first reason the VM stops and wakes Run.
func (m *Machine) stop(reason StopReason, detail string, err error) {
	m.stopOnce.Do(func() {
		m.exit = Exit{Reason: reason, Detail: detail, Err: err}
		m.stopping.Store(true)
		m.log.Debug("vm stopping", "reason", reason, "detail", detail, "err", err)
		close(m.stopped)
	})
}

// kickAll makes every vCPU leave KVM_RUN: immediate_exit makes the next
// KVM_RUN return at once, and a signal interrupts one in progress. SIGURG is
// used because the Go runtime always handles it (it is its preemption
// signal), so an extra one is harmless.
func (m *Machine) kickAll() {
	for i := range m.vcpus {
		m.kick(i)
	}
}

// kick makes vCPU i leave KVM_RUN, as kickAll does for all.
func (m *Machine) kick(i int) {
	m.vcpus[i].SetImmediateExit(true)
	if tid := m.tids[i].Load(); tid != 0 {
		unix.Tgkill(unix.Getpid(), int(tid), unix.SIGURG)
	}
}

func (m *Machine) runVCPU(i int) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// The thread may have run other goroutines before: only its time
	// from here on is the vCPU's.
	m.cpuBase[i].Store(int64(threadCPUTime()))
	m.tids[i].Store(int32(unix.Gettid()))
	defer func() {
		// Cleared before the time is added: Stats counts a thread
		// either live or here, at worst briefly neither.
		m.tids[i].Store(0)
		m.cpuDone.Add(int64(threadCPUTime()) - m.cpuBase[i].Load())
	}()
	v := m.vcpus[i]
	t := m.track[i]
	for !m.stopping.Load() {
		if err := v.Run(); err != nil {
			if errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) {
				if !m.interrupted(i) {
					return
				}
				continue
			}
			m.stop(StopError, fmt.Sprintf("vCPU %d", i), err)
			return
		}
		ok := m.handleExit(i, v, t)
		t.leave()
		if !ok {
			return
		}
	}
}

// interrupted handles a KVM_RUN that a signal or immediate_exit ended: a
// stop (false: the vCPU is done; the kicker's immediate_exit stays set) or
// a request for the vCPU's state, answered here on its own thread.
func (m *Machine) interrupted(i int) bool {
	if m.stopping.Load() {
		return false
	}
	// Cleared before the requests are taken and the stop flag read again,
	// so that neither a new request nor a stop is missed.
	m.vcpus[i].SetImmediateExit(false)
	if m.stopping.Load() {
		m.vcpus[i].SetImmediateExit(true)
		return false
	}
	m.serveRequests(i)
	return true
}

// handleExit handles one VM exit; false means this vCPU is done.
func (m *Machine) handleExit(i int, v *kvm.VCPU, t *vcpuTrack) bool {
	reason := v.ExitReason()
	t.enter(reason, 0)
	if !m.timeline.exitSeen.Load() && reason != kvm.ExitIntr && !m.timeline.exitSeen.Swap(true) {
		m.timeline.mark("guest: first exit to the VMM (" + reason.String() + ")")
	}
	switch reason {
	case kvm.ExitIO:
		io, err := v.IO()
		if err != nil {
			m.stop(StopError, fmt.Sprintf("vCPU %d: port I/O exit", i), err)
			return false
		}
		t.busyAddr.Store(uint64(io.Port))
		size := int(io.Size)
		for c := 0; c+size <= len(io.Data); c += size {
			chunk := io.Data[c : c+size]
			var claimed bool
			if io.Out {
				claimed = m.ports.Write(uint64(io.Port), chunk)
			} else {
				claimed = m.ports.Read(uint64(io.Port), chunk)
			}
			if !claimed {
				m.unhandled("port", uint64(io.Port), io.Out)
			}
		}
	case kvm.ExitMMIO:
		mmio := v.MMIO()
		t.busyAddr.Store(mmio.PhysAddr)
		var claimed bool
		if mmio.IsWrite {
			claimed = m.mmio.Write(mmio.PhysAddr, mmio.Data)
		} else {
			claimed = m.mmio.Read(mmio.PhysAddr, mmio.Data)
		}
		if !claimed {
			m.unhandled("mmio", mmio.PhysAddr, mmio.IsWrite)
		}
		m.markVirtio(mmio.PhysAddr, mmio.IsWrite)
	case kvm.ExitShutdown:
		m.stop(StopTripleFault, fmt.Sprintf("vCPU %d: KVM_EXIT_SHUTDOWN", i), nil)
		return false
	case kvm.ExitSystemEvent:
		switch ev := v.SystemEventType(); ev {
		case kvm.SystemEventShutdown:
			m.stop(StopPowerOff, "", nil)
		case kvm.SystemEventReset:
			m.stop(StopReboot, "reset system event", nil)
		case kvm.SystemEventCrash:
			m.stop(StopPanic, "crash system event", nil)
		default:
			m.stop(StopError, fmt.Sprintf("vCPU %d: unknown system event %d", i, ev), nil)
		}
		return false
	case kvm.ExitHLT:
		m.stop(StopHalted, fmt.Sprintf("vCPU %d executed HLT", i), nil)
		return false
	case kvm.ExitIntr:
		// A signal arrived: a stop or a state request.
		return m.interrupted(i)
	case kvm.ExitFailEntry:
		m.stop(StopError, fmt.Sprintf("vCPU %d: KVM_EXIT_FAIL_ENTRY, hardware entry failure reason %#x", i, v.FailEntryReason()), nil)
		return false
	case kvm.ExitInternalError:
		why := fmt.Sprintf("vCPU %d: KVM_EXIT_INTERNAL_ERROR, suberror %d", i, v.InternalErrorSuberror())
		if kvm.IsPVM() {
			why += " (this /dev/kvm is PVM, the kvm_pvm module: its instruction emulator cannot run every instruction of a stock Linux guest; use hardware KVM)"
		}
		m.stop(StopError, why, nil)
		return false
	default:
		m.stop(StopError, fmt.Sprintf("vCPU %d: unexpected exit %v", i, reason), nil)
		return false
	}
	return true
}

// unhandled logs accesses nobody claimed, rate-limited: a guest can make
// any number of them.
func (m *Machine) unhandled(kind string, addr uint64, write bool) {
	if n := m.unknown.Add(1); n <= 20 {
		m.log.Debug("unhandled guest access", "kind", kind, "addr", fmt.Sprintf("%#x", addr), "write", write)
		if n == 20 {
			m.log.Debug("further unhandled accesses are not logged")
		}
	}
}

// Close releases the vCPUs, the VM, its memory and KVM. It is safe to call
// on a partly built Machine.
func (m *Machine) Close() error {
	m.runMu.Lock()
	defer m.runMu.Unlock()
	errs := []error{m.closeVirtio()}
	for _, s := range m.stats {
		errs = append(errs, s.Close())
	}
	m.stats = nil
	for _, v := range m.vcpus {
		errs = append(errs, v.Close())
	}
	m.vcpus = nil
	if m.vm != nil {
		errs = append(errs, m.vm.Close())
		m.vm = nil
	}
	if m.mem != nil {
		errs = append(errs, m.mem.Close())
		m.mem = nil
	}
	if m.sys != nil {
		errs = append(errs, m.sys.Close())
		m.sys = nil
	}
	return errors.Join(errs...)
}
