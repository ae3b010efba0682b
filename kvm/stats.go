package kvm

import (
	"encoding/binary"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// CapBinaryStatsFD is KVM_CAP_BINARY_STATS_FD (Linux 5.14): a VM or vCPU
// hands out a file of its counters.
const CapBinaryStatsFD Cap = 203

// kvmGetStatsFD is KVM_GET_STATS_FD, _IO(KVMIO, 0xce).
var kvmGetStatsFD = io_(0xce)

// Bounds on what a stats file may describe: KVM's own tables hold a few
// dozen counters with names of at most a few dozen bytes.
const (
	statsMaxDescs   = 1024
	statsMaxName    = 256
	statsMaxFile    = 1 << 20
	statsHeaderSize = 24
	statsDescFixed  = 16
	statsTypeMask   = 0xf
	statsTypeCumul  = 0 // KVM_STATS_TYPE_CUMULATIVE
	statsTypeInst   = 1 // KVM_STATS_TYPE_INSTANT
	statsTypePeak   = 2 // KVM_STATS_TYPE_PEAK
)

// Stats is an open stats file of a VM or vCPU (KVM_GET_STATS_FD): its
// counters read in one pread each time.
type Stats struct {
	fd    int
	descs []statDesc
	size  int // bytes to read: the data block's end
}

type statDesc struct {
	name   string
	offset int // into the file
}

// OpenStats opens the vCPU's counters (exits by kind, halts, page
// faults, emulated instructions...); ErrStatsUnsupported when the kernel
// has no stats files.
func (v *VCPU) OpenStats() (*Stats, error) { return openStats(v.fd) }

// OpenStats opens the VM's own counters (MMU and TLB work).
func (vm *VM) OpenStats() (*Stats, error) { return openStats(vm.fd) }

// ErrStatsUnsupported: the kernel predates KVM_GET_STATS_FD.
var ErrStatsUnsupported = errors.New("kvm: this kernel has no binary stats (KVM_GET_STATS_FD, Linux 5.14)")

func openStats(owner int) (*Stats, error) {
	fd, err := ioctl(owner, kvmGetStatsFD, 0)
	if err != nil {
		if errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL) {
			return nil, ErrStatsUnsupported
		}
		return nil, err
	}
	unix.CloseOnExec(int(fd))
	s := &Stats{fd: int(fd)}
	if err := s.parse(); err != nil {
		unix.Close(s.fd)
		return nil, fmt.Errorf("kvm: stats: %w", err)
	}
	return s, nil
}

// parse reads the header and the descriptors (struct kvm_stats_header,
// struct kvm_stats_desc), keeping the single-valued counters.
func (s *Stats) parse() error {
	var h [statsHeaderSize]byte
	if _, err := unix.Pread(s.fd, h[:], 0); err != nil {
		return err
	}
	le := binary.LittleEndian
	nameSize, num := int(le.Uint32(h[4:])), int(le.Uint32(h[8:]))
	descOff, dataOff := int(le.Uint32(h[16:])), int(le.Uint32(h[20:]))
	if nameSize <= 0 || nameSize > statsMaxName || num > statsMaxDescs || descOff > statsMaxFile || dataOff > statsMaxFile {
		return fmt.Errorf("implausible header: %d descriptors, names of %d bytes", num, nameSize)
	}
	descSize := statsDescFixed + nameSize
	buf := make([]byte, num*descSize)
	if n, err := unix.Pread(s.fd, buf, int64(descOff)); err != nil || n != len(buf) {
		return fmt.Errorf("read descriptors: %d of %d bytes, %v", n, len(buf), err)
	}
	for i := range num {
		d := buf[i*descSize : (i+1)*descSize]
		flags, size, off := le.Uint32(d), int(le.Uint16(d[6:])), int(le.Uint32(d[8:]))
		switch flags & statsTypeMask {
		case statsTypeCumul, statsTypeInst, statsTypePeak:
		default:
			continue // histograms
		}
		if size != 1 || off > statsMaxFile {
			continue
		}
		name := d[statsDescFixed:]
		for j, c := range name {
			if c == 0 {
				name = name[:j]
				break
			}
		}
		at := dataOff + off
		s.descs = append(s.descs, statDesc{name: string(name), offset: at})
		s.size = max(s.size, at+8)
	}
	return nil
}

// Read returns every counter by KVM's name for it.
func (s *Stats) Read() (map[string]uint64, error) {
	buf := make([]byte, s.size)
	if n, err := unix.Pread(s.fd, buf, 0); err != nil || n != len(buf) {
		return nil, fmt.Errorf("kvm: read stats: %d of %d bytes, %v", n, len(buf), err)
	}
	out := make(map[string]uint64, len(s.descs))
	for _, d := range s.descs {
		out[d.name] = binary.LittleEndian.Uint64(buf[d.offset:])
	}
	return out, nil
}

// Close closes the stats file.
func (s *Stats) Close() error { return closeFD(&s.fd) }
