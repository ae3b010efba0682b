package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/capsa-sandbox/capsa/internal/assets"
	virtioblk "github.com/capsa-sandbox/capsa/virtio/blk"
	"github.com/capsa-sandbox/capsa/vmm"
)

// RawVM is a bare VM: a kernel, its command line, an optional initramfs
// and disks, the serial console, and nothing of a sandbox (no agent, no
// shares, no network). It is what `capsa vm` boots, to try a kernel or
// time its boot; a Sandbox is built with a Builder instead.
type RawVM struct {
	Kernel  string // a vmlinux ELF or a bzImage; "" is the built-in kernel
	Initrd  string // "" for none
	Cmdline string
	CPUs    int
	// MemoryBytes is the guest's memory.
	MemoryBytes uint64
	// Disks are virtio block devices, /dev/vda, /dev/vdb... in order, each
	// PATH[:ro] as ParseDisk reads it.
	Disks        []string
	Console      io.Writer
	ConsoleInput io.Reader
	// Start is when the VMM started, for the boot timeline (zero: now).
	Start time.Time
	Log   *slog.Logger
}

// RawMachine is a running RawVM: vmm.Machine's Run, Debug and
// BootTimeline; Close releases its disks too.
type RawMachine struct {
	*vmm.Machine
	disks []*virtioblk.Device
}

// Check reports the first setting of r no VM could boot with, naming it,
// before anything is mapped or built.
func (r RawVM) Check() error {
	if r.CPUs < 1 || r.CPUs > vmm.MaxCPUs {
		return fmt.Errorf("%d CPUs: must be between 1 and %d", r.CPUs, vmm.MaxCPUs)
	}
	for _, f := range []struct{ what, path string }{{"kernel", r.Kernel}, {"initrd", r.Initrd}} {
		if f.path == "" {
			continue
		}
		if fi, err := os.Stat(f.path); err != nil {
			return fmt.Errorf("%s: %w", f.what, err)
		} else if !fi.Mode().IsRegular() {
			return fmt.Errorf("%s %s: not a regular file", f.what, f.path)
		}
	}
	for _, d := range r.Disks {
		path, mode, err := ParseDisk(d)
		if err != nil {
			return err
		}
		if err := checkDisk(path, mode); err != nil {
			return err
		}
	}
	return nil
}

// Boot checks r and builds its VM, ready to Run. An error names the
// setting at fault.
func (r RawVM) Boot(ctx context.Context) (*RawMachine, error) {
	if err := r.Check(); err != nil {
		return nil, err
	}
	if r.Log == nil {
		r.Log = slog.New(slog.DiscardHandler)
	}
	cfg := vmm.Config{CPUs: r.CPUs, MemoryBytes: r.MemoryBytes, Cmdline: r.Cmdline, Start: r.Start,
		Console: r.Console, ConsoleInput: r.ConsoleInput, Log: r.Log}
	// The files are mapped, not read: the VMM copies them into guest
	// memory once, from the page cache.
	var err error
	if r.Kernel != "" {
		var release func()
		if cfg.Kernel, release, err = assets.MapFile(r.Kernel); err != nil {
			return nil, fmt.Errorf("kernel: %w", err)
		}
		defer release()
	} else if cfg.Kernel, err = assets.Kernel(); err != nil {
		return nil, err
	}
	if r.Initrd != "" {
		var release func()
		if cfg.Initrd, release, err = assets.MapFile(r.Initrd); err != nil {
			return nil, fmt.Errorf("initrd: %w", err)
		}
		defer release()
	}
	m := &RawMachine{}
	for i, d := range r.Disks {
		path, mode, err := ParseDisk(d)
		if err == nil {
			var dev *virtioblk.Device
			dev, err = virtioblk.OpenDevice(path, virtioblk.Options{ReadOnly: mode == ReadOnly, ID: fmt.Sprintf("capsa-disk-%d", i)}, r.Log)
			if err == nil {
				m.disks = append(m.disks, dev)
				cfg.Devices = append(cfg.Devices, vmm.Device{ID: fmt.Sprintf("blk:capsa-disk-%d", i), Device: dev})
			}
		}
		if err != nil {
			m.closeDisks()
			return nil, fmt.Errorf("disk %s: %w", d, err)
		}
	}
	m.Machine, err = vmm.New(ctx, cfg)
	// The guest's memory has them now: the VMM's RSS need not.
	assets.Evict(cfg.Kernel)
	assets.Evict(cfg.Initrd)
	if err != nil {
		m.closeDisks()
		return nil, err
	}
	return m, nil
}

func (m *RawMachine) closeDisks() error {
	var errs []error
	for _, d := range m.disks {
		errs = append(errs, d.Close())
	}
	m.disks = nil
	return errors.Join(errs...)
}

// Close ends the VM and closes its disks.
func (m *RawMachine) Close() error {
	return errors.Join(m.Machine.Close(), m.closeDisks())
}
