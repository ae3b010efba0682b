package vmm

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/internal/testkernel"
	"github.com/capsa-sandbox/capsa/kvm"
	"github.com/capsa-sandbox/capsa/virtio"
)

// codeWaitFlag counts in RBX until the byte at waitFlagOffset (its own
// last byte) is set, then prints 'R' and resets.
var codeWaitFlag = []byte{
	0x31, 0xdb, // xor ebx, ebx
	0x48, 0xff, 0xc3, // loop: inc rbx
	0x80, 0x3d, 0x0e, 0x00, 0x00, 0x00, 0x00, // cmp byte [rip+14], 0 (the flag)
	0x74, 0xf4, // je loop
	0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
	0xb0, 'R', 0xee, // mov al, 'R'; out dx, al
	0xb0, 0xfe, 0xe6, 0x64, // reset through the i8042
	0xf4, // hlt
	0x00, // the flag
}

const waitFlagOffset = 26

// TestSaveRestoreContinues: a VM paused and saved (state through JSON,
// memory through a file) is restored as a new VM that goes on from the
// same instruction with the same registers and clock, on memory mapped
// from the file, and sees a change made there.
func TestSaveRestoreContinues(t *testing.T) {
	needKVM(t)
	ctx := context.Background()
	cfg := Config{Kernel: testkernel.Code(codeWaitFlag), CPUs: 2, MemoryBytes: 64 << 20, Cmdline: "x"}
	a, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan *Exit, 1)
	go func() { done <- a.Run(ctx) }()
	// Paused, until the guest has counted a little.
	var st *State
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the guest did not count within 30s")
		}
		if err := a.Pause(ctx); err != nil {
			if !strings.Contains(err.Error(), "not running") {
				t.Fatalf("Pause() = %v", err)
			}
			continue
		}
		if st, err = a.State(); err != nil {
			t.Fatalf("State() = %v", err)
		}
		if st.VCPUs[0].Regs.RBX != 0 {
			break
		}
		if err := a.Resume(); err != nil {
			t.Fatalf("Resume() = %v", err)
		}
	}
	rbx, rip := st.VCPUs[0].Regs.RBX, st.VCPUs[0].Regs.RIP
	if len(st.VCPUs[0].MSRs) == 0 || st.VCPUs[1].MPState == st.VCPUs[0].MPState {
		t.Errorf("vCPU state: %d MSRs, MP states %d and %d; want MSRs, and the AP waiting for SIPI unlike the BSP",
			len(st.VCPUs[0].MSRs), st.VCPUs[0].MPState, st.VCPUs[1].MPState)
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "mem"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := a.Memory().WriteFile(f, nil, nil); err != nil {
		t.Fatal(err)
	}
	a.Stop(StopCanceled, "saved")
	<-done
	a.Close()

	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var saved State
	if err := json.Unmarshal(b, &saved); err != nil {
		t.Fatal(err)
	}
	mem, err := guestmem.Map(f, cfg.MemoryBytes)
	if err != nil {
		t.Fatal(err)
	}
	mem.WriteAt([]byte{1}, testkernel.LoadAddr+waitFlagOffset)
	var out bytes.Buffer
	cfg.Console = &out
	m, err := Restore(ctx, cfg, &saved, mem)
	if err != nil {
		t.Fatalf("Restore() = %v", err)
	}
	defer m.Close()
	regs, err := m.vcpus[0].GetRegs()
	if err != nil || regs.RBX != rbx || regs.RIP != rip {
		t.Fatalf("restored RBX, RIP = %#x, %#x (%v); want %#x, %#x", regs.RBX, regs.RIP, err, rbx, rip)
	}
	if c, err := m.vm.Clock(); err != nil || c.Clock < saved.Clock || c.Clock-saved.Clock > uint64(time.Second) {
		t.Errorf("restored kvmclock = %d (%v); want just past the saved %d", c.Clock, err, saved.Clock)
	}
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if exit := m.Run(rctx); exit.Reason != StopReboot || out.String() != "R" {
		t.Errorf("the restored VM ended with %v, console %q; want a reset after \"R\"", exit, out.String())
	}
}

// TestRestoreRefusesBadState: a state that does not fit the VM, or that
// no capsa wrote, is refused with an error naming what is wrong, before
// KVM is touched.
func TestRestoreRefusesBadState(t *testing.T) {
	cfg := Config{CPUs: 1, MemoryBytes: 64 << 20}
	good := func() *State {
		return &State{Version: StateVersion, CPUs: 1, MemoryBytes: 64 << 20,
			IRQChips: []kvm.IRQChip{{ChipID: 0}, {ChipID: 1}, {ChipID: 2}},
			VCPUs:    []VCPUState{{CPUID: []kvm.CPUIDEntry{{Function: 0}}}}}
	}
	for _, tc := range []struct {
		name string
		edit func(*State) *State
		want string
	}{
		{"nil", func(*State) *State { return nil }, "no state"},
		{"version", func(s *State) *State { s.Version = 99; return s }, "version 99"},
		{"cpus", func(s *State) *State { s.CPUs = 2; return s }, "vCPU count cannot change"},
		{"memory", func(s *State) *State { s.MemoryBytes = 128 << 20; return s }, "memory size cannot change"},
		{"irqchips", func(s *State) *State { s.IRQChips = s.IRQChips[:2]; return s }, "2 interrupt controllers"},
		{"chip id", func(s *State) *State { s.IRQChips[2].ChipID = 7; return s }, "has id 7"},
		{"cpuid", func(s *State) *State { s.VCPUs[0].CPUID = nil; return s }, "0 CPUID entries"},
		{"msrs", func(s *State) *State { s.VCPUs[0].MSRs = make([]kvm.MSREntry, maxMSRs+1); return s }, "MSRs, at most"},
		{"xcrs", func(s *State) *State { s.VCPUs[0].XCRs.NrXCRs = 17; return s }, "17 XCRs"},
	} {
		mem, err := guestmem.New(64 << 20)
		if err != nil {
			t.Fatal(err)
		}
		_, err = Restore(context.Background(), cfg, tc.edit(good()), mem)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Restore() = %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

// TestCheckCPUID: a snapshot's CPU features must all be offered by this
// host's KVM, except the bits capsa sets itself.
func TestCheckCPUID(t *testing.T) {
	host := []kvm.CPUIDEntry{{Function: 1, ECX: 0x1, EDX: 0x10}, {Function: 7, EBX: 0x8}}
	ok := []kvm.CPUIDEntry{{Function: 1, ECX: 0x1 | cpuidHypervisor, EDX: 0x10 | cpuidHyperThreads}, {Function: 7, EBX: 0x8}}
	if err := checkCPUID(ok, host, false); err != nil {
		t.Errorf("checkCPUID(host's own features) = %v", err)
	}
	bad := []kvm.CPUIDEntry{{Function: 7, EBX: 0x8 | 0x20}}
	if err := checkCPUID(bad, host, false); err == nil || !strings.Contains(err.Error(), "leaf 0x7.0 EBX bits 0x20") {
		t.Errorf("checkCPUID(a feature the host lacks) = %v, want an error naming leaf 0x7.0 EBX bits 0x20", err)
	}
	deadline := []kvm.CPUIDEntry{{Function: 1, ECX: cpuidTSCDeadline}}
	if err := checkCPUID(deadline, host, false); err == nil {
		t.Error("checkCPUID(TSC deadline on a host without it) = nil")
	}
}

// typedDevice is a virtio device of a given type that does nothing: the
// device checks of a restore look only at ids and types.
type typedDevice struct {
	typ  uint32
	name string
}

func (d typedDevice) Type() uint32                   { return d.typ }
func (typedDevice) Features() uint64                 { return 0 }
func (typedDevice) QueueSizes() []uint16             { return []uint16{8} }
func (typedDevice) ReadConfig(uint64, []byte)        {}
func (typedDevice) WriteConfig(uint64, []byte)       {}
func (typedDevice) Activate(virtio.Activation) error { return nil }
func (typedDevice) Notify(int)                       {}
func (typedDevice) Reset()                           {}

var _ virtio.Device = typedDevice{}

// TestRestoreMatchesDevicesByID: a state's devices are matched to the
// VM's by id, whatever the VM's order, and each is placed where it was;
// a device the state lacks, one the VM lacks, one saved as another kind,
// and repeated or bad ids are refused with an error naming the id, before
// KVM is touched.
func TestRestoreMatchesDevicesByID(t *testing.T) {
	vsock, work, data := typedDevice{virtio.TypeVsock, "vsock"}, typedDevice{virtio.Type9P, "work"}, typedDevice{virtio.Type9P, "data"}
	saved := func() *State {
		return &State{Version: StateVersion, CPUs: 1, MemoryBytes: 64 << 20,
			IRQChips: []kvm.IRQChip{{ChipID: 0}, {ChipID: 1}, {ChipID: 2}},
			VCPUs:    []VCPUState{{CPUID: []kvm.CPUIDEntry{{Function: 0}}}},
			Virtio: []DeviceState{
				{ID: "vsock", TransportState: virtio.TransportState{DeviceType: virtio.TypeVsock}},
				{ID: "9p:/mnt/work", TransportState: virtio.TransportState{DeviceType: virtio.Type9P}},
				{ID: "9p:/mnt/data", TransportState: virtio.TransportState{DeviceType: virtio.Type9P}},
			}}
	}
	// The VM lists its shares the other way round: each still gets its
	// own state and place.
	devs := []Device{{"9p:/mnt/data", data}, {"vsock", vsock}, {"9p:/mnt/work", work}}
	cfg := Config{CPUs: 1, MemoryBytes: 64 << 20, Devices: devs}
	if err := saved().Check(cfg); err != nil {
		t.Fatalf("Check(the same devices in another order) = %v", err)
	}
	if st := saved(); !st.HasDevice("9p:/mnt/data") || st.HasDevice("balloon") {
		t.Error(`HasDevice("9p:/mnt/data"), HasDevice("balloon") = false, true; want true, false`)
	}
	got := saved().deviceOrder(devs)
	if len(got) != 3 || got[0].ID != "vsock" || got[1].ID != "9p:/mnt/work" || got[2].ID != "9p:/mnt/data" ||
		got[1].Device != virtio.Device(work) || got[2].Device != virtio.Device(data) {
		t.Errorf("deviceOrder = %v; want vsock, 9p:/mnt/work, 9p:/mnt/data with their own devices", got)
	}

	for _, tc := range []struct {
		name string
		st   func(*State)
		devs []Device
		want string
	}{
		{"missing in the state", func(s *State) { s.Virtio = s.Virtio[:2] }, devs, `no virtio device "9p:/mnt/data", which this VM has`},
		{"missing in the VM", nil, devs[:2], `holds virtio device "9p:/mnt/work", which this VM lacks`},
		{"another kind", func(s *State) { s.Virtio[0].DeviceType = virtio.TypeNet }, devs, `"vsock": saved as device type 1, this VM's is type 19`},
		{"a share renamed", nil, []Device{{"9p:/mnt/data", data}, {"vsock", vsock}, {"9p:/mnt/other", work}}, `no virtio device "9p:/mnt/other", which this VM has`},
		{"repeated in the state", func(s *State) { s.Virtio[2].ID = "9p:/mnt/work" }, devs, `two virtio devices with the id "9p:/mnt/work"`},
		{"empty in the state", func(s *State) { s.Virtio[1].ID = "" }, devs, "saved virtio device 1: device id of 0 bytes"},
		{"unprintable in the state", func(s *State) { s.Virtio[1].ID = "9p:\n" }, devs, "want printable UTF-8"},
		{"overlong in the state", func(s *State) { s.Virtio[1].ID = strings.Repeat("x", maxDeviceID+1) }, devs, "device id of 257 bytes"},
		{"repeated in the VM", nil, []Device{{"vsock", vsock}, {"vsock", work}}, `two virtio devices have the id "vsock"`},
	} {
		st := saved()
		if tc.st != nil {
			tc.st(st)
		}
		mem, err := guestmem.New(64 << 20)
		if err != nil {
			t.Fatal(err)
		}
		_, err = Restore(context.Background(), Config{CPUs: 1, MemoryBytes: 64 << 20, Devices: tc.devs}, st, mem)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Restore() = %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

// TestStateVersion1Refused: a state saved before devices had ids (version
// 1, devices by position) is refused with the versions named.
func TestStateVersion1Refused(t *testing.T) {
	st := &State{Version: 1}
	if err := st.Check(Config{CPUs: 1, MemoryBytes: 64 << 20}); err == nil || !strings.Contains(err.Error(), "state version 1; this capsa reads version 2") {
		t.Errorf("Check(version 1) = %v", err)
	}
}
