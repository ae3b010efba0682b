package sandbox

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	virtioblk "github.com/capsa-sandbox/capsa/virtio/blk"
)

// MaxDisks is the most disks one sandbox can attach.
const MaxDisks = 8

// Disk attaches the host file at path to the guest as a virtio block
// device, read-only or read-write. Disks appear as /dev/vda, /dev/vdb, ...
// in the order they were added, each with the serial capsa-disk-N
// (/sys/block/vdX/serial). A writable disk is locked against every other
// VM; a read-only one only against writers.
func (b *Builder) Disk(path string, mode ShareMode) *Builder {
	if err := checkDisk(path, mode); err != nil {
		b.c.errs = append(b.c.errs, err)
		return b
	}
	if len(b.c.Disks) == MaxDisks {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: disk %s: at most %d disks", path, MaxDisks))
		return b
	}
	abs, _ := filepath.Abs(path)
	b.c.Disks = append(b.c.Disks, DiskSpec{abs, mode})
	return b
}

func checkDisk(path string, mode ShareMode) error {
	if mode != ReadOnly && mode != ReadWrite {
		return fmt.Errorf("sandbox: disk %s: unknown mode %d", path, mode)
	}
	if path == "" {
		return fmt.Errorf("sandbox: disk: empty path")
	}
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("sandbox: disk: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("sandbox: disk %s: not a regular file", path)
	}
	if fi.Size() < virtioblk.SectorSize {
		return fmt.Errorf("sandbox: disk %s: %d bytes, smaller than one %d-byte sector", path, fi.Size(), virtioblk.SectorSize)
	}
	return nil
}

// ParseDisk parses the CLI's PATH[:ro|:rw].
func ParseDisk(s string) (string, ShareMode, error) {
	path, mode := s, ReadWrite
	if i := strings.LastIndexByte(s, ':'); i >= 0 {
		switch s[i+1:] {
		case "ro":
			path, mode = s[:i], ReadOnly
		case "rw":
			path = s[:i]
		}
	}
	if path == "" {
		return "", 0, fmt.Errorf("disk %q: want PATH[:ro]", s)
	}
	return path, mode, nil
}

// diskDevices opens and locks each disk and makes its device.
func diskDevices(disks []DiskSpec, c config, lim *limiters) ([]*virtioblk.Device, error) {
	var specs []diskSpec
	for i, d := range disks {
		specs = append(specs, diskSpec{d.Path, virtioblk.Options{ReadOnly: d.Mode == ReadOnly, ID: diskSerial(i), Limit: lim.disk()}})
	}
	return openDisks(specs, c)
}

// diskSerial is the serial of the user's disk i.
func diskSerial(i int) string { return fmt.Sprintf("capsa-disk-%d", i) }

type diskSpec struct {
	path string
	opts virtioblk.Options
}

// openDisks opens every disk or none.
func openDisks(specs []diskSpec, c config) ([]*virtioblk.Device, error) {
	var devs []*virtioblk.Device
	for _, d := range specs {
		dev, err := virtioblk.OpenDevice(d.path, d.opts, c.logger())
		if err != nil {
			closeDisks(devs)
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		devs = append(devs, dev)
	}
	return devs, nil
}

func closeDisks(devs []*virtioblk.Device) error {
	var errs []error
	for _, d := range devs {
		if err := d.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("sandbox: close disks: %v", errs)
	}
	return nil
}
