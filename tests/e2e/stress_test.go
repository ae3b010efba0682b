package e2e

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/p9fs"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/tests/stressload"
	virtionet "github.com/capsa-sandbox/capsa/virtio/net"
	"github.com/capsa-sandbox/capsa/virtio/ninep"
	"github.com/capsa-sandbox/capsa/vmm"
)

// The stress run's size. `make test` runs TestStress with these defaults
// (a short run); `make stress` passes larger counts.
var (
	stressBoots     = flag.Int("stress.boots", 3, "TestStress: boots of the test init under each VMM")
	stressRounds    = flag.Int("stress.rounds", 0, "TestStress: rounds of the 9p and network workload under each VMM")
	stressBytes     = flag.Int64("stress.bytes", 16<<20, "TestStress: bytes each way over TCP")
	stressFile      = flag.Int64("stress.filebytes", 16<<20, "TestStress: the size of the file copied over 9p")
	stressKernel2   = flag.String("stress.kernel2", "", "TestStress: a second kernel (e.g. a distribution's bzImage) to boot too")
	stressBoots2    = flag.Int("stress.boots2", 3, "TestStress: boots of -stress.kernel2 under each VMM")
	stressKernelIRQ = flag.Bool("stress.qemu-kernel-irqchip", false, "TestStress: also run the workload under QEMU with KVM's in-kernel IOAPIC and PIC, as capsa has them")
	stressWait      = flag.Duration("stress.watchdog", 5*time.Minute, "TestStress: a run that takes longer is counted as a hang")
)

// The lines TestStress prints for each run, for tests/cmd/stress-summary.
const (
	stressStart  = "stress-start: "
	stressResult = "stress-result: "
)

// outcome is how one run of a guest ended.
type outcome string

const (
	outcomeOK    outcome = "ok"
	outcomeHang  outcome = "hang"  // the watchdog fired
	outcomeReset outcome = "reset" // the guest reset (a triple fault) before it finished
	outcomePanic outcome = "panic" // the guest kernel panicked
	outcomeWrong outcome = "wrong" // it finished with wrong output
	outcomeError outcome = "error" // anything else: the VMM failed, the guest's program failed
	// The vCPU held a state the guest cannot have loaded (vmm.Debug's
	// Impossible): the hypervisor below capsa replaced it.
	outcomeL1State outcome = "l1-state"
)

var outcomes = []outcome{outcomeOK, outcomeHang, outcomeReset, outcomePanic, outcomeWrong, outcomeError, outcomeL1State}

// tally counts the outcomes of one VMM in one phase.
type tally map[outcome]int

func (t tally) runs() (n int) {
	for _, c := range t {
		n += c
	}
	return n
}

func (t tally) failures() int { return t.runs() - t[outcomeOK] }

func (t tally) String() string {
	s := fmt.Sprintf("%3d runs, %3d failed (%4.1f%%):", t.runs(), t.failures(), 100*float64(t.failures())/float64(max(1, t.runs())))
	for _, o := range outcomes[1:] {
		s += fmt.Sprintf(" %d %s", t[o], o)
	}
	return s
}

// TestStress is the control experiment for guest hangs and resets: the
// same kernel, the same guest program and the same work, under capsa and
// under QEMU's microvm in the same nested host, interleaved run by run, with
// every failure counted by kind and explained in the log (capsa's with the
// VM's debug state: registers, pending interrupts, virtqueue indices).
// Any capsa failure fails the test; QEMU's are the control.
//
// Phases: boots of tests/testinit to userspace and back (2 vCPUs); the
// same with -stress.kernel2 when given; and rounds of the heavy workload
// (tests/stressload): hash a 300-file tree over a virtio-9p share, copy a
// file over it, and send and receive -stress.bytes over TCP through the
// VMM's network to a host server. capsa runs the workload in a sandbox
// through its agent; QEMU runs it as the guest's init, over its own
// virtio-9p-device (-fsdev local) and virtio-net-device (user networking).
//
//	make stress           # 100 boots and 10 rounds, in one nested host
func TestStress(t *testing.T) {
	if *stressBoots == 0 && *stressRounds == 0 {
		t.Skip("-stress.boots and -stress.rounds are 0")
	}
	kernel, initrd := artifact(t, "vmlinux"), artifact(t, "testinitrd.cpio")
	qemu := qemuPath(t)
	results := map[string]map[string]tally{}
	var phases []string
	record := func(phase, vmm string, o outcome) {
		if results[phase] == nil {
			results[phase] = map[string]tally{}
			phases = append(phases, phase)
		}
		if results[phase][vmm] == nil {
			results[phase][vmm] = tally{}
		}
		results[phase][vmm][o]++
	}
	// run runs one guest and records how it ended. The start and result
	// lines go to standard output as they happen, so that a run cut short
	// by L1's own crash is still counted, against the VMM that was running
	// (tests/cmd/stress-summary adds up the lines of several sessions).
	run := func(phase, vmm string, f func() outcome) {
		fmt.Printf("%s%s|%s\n", stressStart, phase, vmm)
		o := f()
		fmt.Printf("%s%s|%s|%s\n", stressResult, phase, vmm, o)
		record(phase, vmm, o)
	}
	defer func() {
		var b strings.Builder
		for _, p := range phases {
			for _, v := range []string{"capsa", "capsa-raw", "qemu-microvm", "qemu-microvm-kirq"} {
				if results[p][v] == nil {
					continue
				}
				fmt.Fprintf(&b, "stress: %-34s %-13s %s\n", p, v, results[p][v])
			}
		}
		t.Logf("stress results:\n%s", b.String())
		for _, p := range phases {
			if n := results[p]["capsa"].failures(); n > 0 {
				t.Errorf("%s: capsa failed %d of %d runs (QEMU's microvm: %d of %d)", p, n, results[p]["capsa"].runs(),
					results[p]["qemu-microvm"].failures(), results[p]["qemu-microvm"].runs())
			}
		}
	}()

	bootCmdline := "console=ttyS0 quiet reboot=k panic=-1"
	// QEMU's microvm describes its devices in ACPI unless told otherwise;
	// capsa's kernel has no ACPI, so they go on the command line instead,
	// as capsa does. A distribution kernel boots with ACPI on, its default.
	bootPhase := func(phase, kernel, machine string, n int) {
		for i := range n {
			run(phase, "capsa", func() outcome {
				return runCapsaVM(t, []string{"vm", "--kernel", kernel, "--initrd", initrd, "--cpus", "2", "--memory", "256M", "--cmdline", bootCmdline})
			})
			run(phase, "qemu-microvm", func() outcome {
				return runQEMU(t, qemu, machine, "kvm", kernel, initrd, bootCmdline, "2", nil, "capsa-testinit: rebooting", nil)
			})
			t.Logf("%s: boot %d of %d done", phase, i+1, n)
		}
	}
	bootPhase("boot testinit (2 vCPUs)", kernel, "microvm,acpi=off", *stressBoots)
	if *stressKernel2 != "" {
		bootPhase("boot testinit, "+filepath.Base(*stressKernel2), *stressKernel2, "microvm", *stressBoots2)
	}
	if *stressRounds == 0 {
		return
	}

	// The workload's host side: the shared directory and the TCP server.
	dir := t.TempDir()
	makeTree(t, filepath.Join(dir, "tree"))
	big, err := os.Create(filepath.Join(dir, "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(big, stressload.Pattern(9, *stressFile))
	big.Close()
	testinit, err := os.ReadFile(artifact(t, "testinit"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "testinit"), testinit, 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				if err := stressload.ServeConn(c, *stressBytes); err != nil {
					t.Logf("stress TCP server: %v", err)
				}
			}()
		}
	}()
	work := func(mnt string) stressload.Config {
		return stressload.Config{Work: []string{"9p", "net"}, Dir: mnt, Addr: fmt.Sprintf("10.0.2.2:%d", l.Addr().(*net.TCPAddr).Port), Bytes: *stressBytes}
	}
	phase := "9p tree hash + copy, TCP both ways"
	for i := range *stressRounds {
		os.Remove(filepath.Join(dir, "out.bin"))
		run(phase, "capsa", func() outcome { return runCapsaWorkload(t, dir, work("/mnt/stress")) })
		os.Remove(filepath.Join(dir, "out.bin"))
		c := work("/mnt")
		cmdline := "console=ttyS0 reboot=k panic=-1 ip=10.0.2.15::10.0.2.2:255.255.255.0::eth0:off capsa.test=stress capsa.stress=" + c.String()
		run(phase, "capsa-raw", func() outcome { return runCapsaRaw(t, kernel, initrd, cmdline, dir, c) })
		qemuDevices := []string{
			"-fsdev", "local,id=s0,security_model=none,path=" + dir,
			"-device", "virtio-9p-device,fsdev=s0,mount_tag=stress",
			"-netdev", "user,id=n0", "-device", "virtio-net-device,netdev=n0",
		}
		check := func(out string) error { return stressload.Check(c, out, dir) }
		os.Remove(filepath.Join(dir, "out.bin"))
		run(phase, "qemu-microvm", func() outcome {
			return runQEMU(t, qemu, "microvm,acpi=off", "kvm", kernel, initrd, cmdline, "1", qemuDevices, stressload.Prefix+"done", check)
		})
		if *stressKernelIRQ {
			// QEMU's microvm keeps the IOAPIC and PIC in userspace
			// (split irqchip); capsa uses KVM's in-kernel ones.
			os.Remove(filepath.Join(dir, "out.bin"))
			run(phase, "qemu-microvm-kirq", func() outcome {
				return runQEMU(t, qemu, "microvm,acpi=off", "kvm,kernel-irqchip=on", kernel, initrd, cmdline, "1", qemuDevices, stressload.Prefix+"done", check)
			})
		}
		t.Logf("%s: round %d of %d done", phase, i+1, *stressRounds)
	}
}

// runCapsaVM boots the test init with `capsa vm` and classifies the end.
// On a hang it asks capsa for its debug state (SIGQUIT) before killing it.
func runCapsaVM(t *testing.T, args []string) outcome {
	ctx, cancel := context.WithTimeout(context.Background(), *stressWait)
	defer cancel()
	cmd, out, errb, done := startGuest(t, artifact(t, "capsa"), args)
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		cmd.Process.Signal(syscall.SIGQUIT)
		time.Sleep(5 * time.Second)
		cmd.Process.Kill()
		<-done
		t.Logf("capsa hang after %v: capsa %s\nstderr (with the VM's debug state):\n%s\nconsole tail:\n%s", *stressWait, strings.Join(args, " "), errb.String(), tail(out.String(), 3000))
		if strings.Contains(errb.String(), "impossible state:") {
			return outcomeL1State
		}
		return outcomeHang
	}
	o := outcomeOK
	stderr := errb.String()
	switch {
	case err == nil && strings.Contains(out.String(), "capsa-testinit: rebooting"):
		return outcomeOK
	case strings.Contains(stderr, vmm.StopTripleFault.String()):
		o = outcomeReset
	case strings.Contains(stderr, vmm.StopPanic.String()):
		o = outcomePanic
	default:
		o = outcomeError
	}
	t.Logf("capsa %s: %s (%v)\nstderr:\n%s\nconsole tail:\n%s", strings.Join(args, " "), o, err, stderr, tail(out.String(), 3000))
	return o
}

// runCapsaWorkload starts a sandbox with the share and the network, runs
// the workload through the agent and checks its output.
func runCapsaWorkload(t *testing.T, dir string, c stressload.Config) outcome {
	ctx, cancel := context.WithTimeout(context.Background(), *stressWait)
	defer cancel()
	var console, vmmLog syncBuffer
	sb, err := sandbox.New().Memory(512).Console(&console).
		Logger(slog.New(slog.NewTextHandler(&vmmLog, &slog.HandlerOptions{Level: slog.LevelInfo}))).
		Kernel(artifact(t, "vmlinux")).Initrd(artifact(t, "initramfs.cpio")).
		Share(dir, c.Dir, sandbox.ReadWrite).Network(netstack.AllowAll()).
		Run("sleep", "100000").Start(ctx)
	if err != nil {
		o := classifySandbox(nil, ctx, err)
		t.Logf("capsa workload: sandbox start: %s: %v\nVMM log:\n%s\nconsole tail:\n%s", o, err, vmmLog.String(), tail(console.String(), 3000))
		return o
	}
	defer sb.Close()
	r, err := sb.Exec(ctx, sandbox.Command(c.Dir+"/testinit", "stress", c.String()))
	if err == nil && r.Code == 0 {
		if err = stressload.Check(c, string(r.Stdout), dir); err == nil {
			return outcomeOK
		}
		t.Logf("capsa workload: wrong output: %v\nstdout:\n%s", err, r.Stdout)
		return outcomeWrong
	}
	o := classifySandbox(sb, ctx, err)
	var debug string
	if d := sb.Debug(context.Background()); d != nil {
		debug = d.String()
	}
	if d := sb.Debug(context.Background()); d != nil {
		if _, ok := d.Impossible(); ok {
			o = outcomeL1State
		}
	}
	if sb.Exit() == nil {
		// Still running: a second look shows whether the vCPUs move.
		time.Sleep(2 * time.Second)
		if d := sb.Debug(context.Background()); d != nil {
			debug += "\n2 s later:\n" + d.String()
		}
	}
	var code int
	var stdout, stderr []byte
	if r != nil {
		code, stdout, stderr = r.Code, r.Stdout, r.Stderr
	}
	t.Logf("capsa workload: %s: %v (exit %d)\nstdout:\n%s\nstderr:\n%s\n%s\nVMM log:\n%s\nconsole:\n%s", o, err, code, stdout, stderr, debug,
		vmmLog.String(), tail(console.String(), 3000))
	return o
}

// runCapsaRaw runs the workload as QEMU's control does, with the test init
// as the guest's init, on capsa's VMM and devices (9p, net) without the
// agent and vsock: the same guest software as under QEMU.
func runCapsaRaw(t *testing.T, kernel, initrd, cmdline, dir string, c stressload.Config) outcome {
	ctx, cancel := context.WithTimeout(context.Background(), *stressWait)
	defer cancel()
	var console syncBuffer
	log := slog.New(slog.DiscardHandler)
	attacher, err := p9fs.New(dir, p9fs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	share, err := ninep.New("stress", attacher, ninep.Options{}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer share.Close()
	st, err := netstack.New(ctx, netstack.Config{GuestMAC: net.HardwareAddr{0x52, 0x54, 0, 0x12, 0x34, 0x56}, Policy: netstack.AllowAll(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	nic, err := virtionet.New(net.HardwareAddr{0x52, 0x54, 0, 0x12, 0x34, 0x56}, uint16(st.Addrs().MTU), st, log)
	if err != nil {
		t.Fatal(err)
	}
	defer nic.Close()
	k, err1 := os.ReadFile(kernel)
	i, err2 := os.ReadFile(initrd)
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	m, err := vmm.New(ctx, vmm.Config{Kernel: k, Initrd: i, Cmdline: cmdline, CPUs: 1, MemoryBytes: 512 << 20,
		Console: &console, Devices: []vmm.Device{{ID: "net0", Device: nic}, {ID: "9p:share", Device: share}}, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	exit := m.Run(ctx)
	out := console.String()
	o := outcomeOK
	switch {
	case exit.Reason == vmm.StopCanceled:
		o = outcomeHang
	case exit.Reason == vmm.StopTripleFault:
		o = outcomeReset
	case exit.Reason == vmm.StopPanic:
		o = outcomePanic
	case !exit.Reason.Clean():
		o = outcomeError
	default:
		if err := stressload.Check(c, out, dir); err != nil {
			t.Logf("capsa-raw: wrong output: %v", err)
			o = outcomeWrong
		}
	}
	if o != outcomeOK {
		var debug string
		if exit.Debug != nil {
			debug = exit.Debug.String()
			if _, ok := exit.Debug.Impossible(); ok {
				o = outcomeL1State
			}
		}
		t.Logf("capsa-raw: %s: %v\n%s\nconsole tail:\n%s", o, exit, debug, tail(out, 3000))
	}
	return o
}

// classifySandbox names how a sandbox's run failed.
func classifySandbox(sb *sandbox.Sandbox, ctx context.Context, err error) outcome {
	if sb != nil {
		if e := sb.Exit(); e != nil {
			switch e.Reason {
			case vmm.StopTripleFault:
				return outcomeReset
			case vmm.StopPanic:
				return outcomePanic
			}
			return outcomeError
		}
	}
	if ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) {
		return outcomeHang
	}
	if err != nil && strings.Contains(err.Error(), vmm.StopTripleFault.String()) {
		return outcomeReset
	}
	if err != nil && strings.Contains(err.Error(), vmm.StopPanic.String()) {
		return outcomePanic
	}
	return outcomeError
}

// runQEMU boots the kernel and the test init under QEMU's microvm and
// classifies the end: finished is the console line that says the guest
// did its work; check, if set, checks its output. QEMU is killed once the
// guest has finished (it can take tens of seconds to exit under nesting).
func runQEMU(t *testing.T, qemu, machine, accel, kernel, initrd, cmdline, cpus string, extra []string, finished string, check func(string) error) outcome {
	args := append([]string{"-M", machine, "-accel", accel, "-cpu", "host", "-m", "512", "-smp", cpus,
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio",
		"-global", "virtio-mmio.force-legacy=false",
		"-kernel", kernel, "-initrd", initrd, "-append", cmdline}, extra...)
	cmd, out, errb, done := startGuest(t, qemu, args)
	deadline := time.After(*stressWait)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-done:
		case <-deadline:
			cmd.Process.Kill()
			<-done
			t.Logf("qemu hang after %v: %s\nconsole tail:\n%s", *stressWait, cmdline, tail(out.String(), 3000))
			return outcomeHang
		case <-tick.C:
			if !strings.Contains(out.String(), finished) {
				continue
			}
			time.Sleep(500 * time.Millisecond) // let the guest's last lines out
			cmd.Process.Kill()
			<-done
		}
		break
	}
	console := out.String()
	o := outcomeOK
	switch {
	case strings.Contains(console, finished):
		if check != nil {
			if err := check(console); err != nil {
				t.Logf("qemu: wrong output: %v", err)
				o = outcomeWrong
			}
		}
	case strings.Contains(console, "Kernel panic"):
		o = outcomePanic
	case strings.Contains(console, "capsa-testinit:") || strings.Contains(console, "Linux version"):
		o = outcomeReset // QEMU exited (-no-reboot) on a reset before the guest finished
	default:
		o = outcomeError
	}
	if o != outcomeOK {
		t.Logf("qemu: %s: %s\nstderr:\n%s\nconsole tail:\n%s", o, cmdline, errb.String(), tail(console, 3000))
	}
	return o
}

// startGuest starts a VMM process with its output collected; done gets
// its end.
func startGuest(t *testing.T, bin string, args []string) (cmd *exec.Cmd, stdout, stderr *syncBuffer, done chan error) {
	cmd = exec.Command(bin, args...)
	stdout, stderr = &syncBuffer{}, &syncBuffer{}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done = make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return cmd, stdout, stderr, done
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

// qemuPath finds QEMU: the bundle `make` brings into the nested host
// (qemu/qemu), else qemu-system-x86_64 on PATH.
func qemuPath(t testing.TB) string {
	if p, err := exec.LookPath(artifactDir() + "/qemu/qemu"); err == nil {
		return p
	}
	p, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("QEMU not found: run `make test-e2e` or `make stress`")
	}
	return p
}
