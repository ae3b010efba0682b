package vmm

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// Stats is what a VM has used so far.
type Stats struct {
	// CPUTime is the CPU time of the vCPU threads: guest time and the
	// exits handled on them, from when each started until now (or its
	// end).
	CPUTime time.Duration
	// MemoryResident is the guest RAM the host holds (Memory.Resident);
	// MemoryBytes is the guest's configured RAM.
	MemoryResident, MemoryBytes uint64
	// Exits counts the VM exits to the VMM, over all vCPUs.
	Exits uint64
}

// Stats reports what the VM has used; it can be called at any time, from
// any goroutine, and does not disturb the vCPUs.
func (m *Machine) Stats() (Stats, error) {
	s := Stats{MemoryBytes: m.mem.Size(), CPUTime: time.Duration(m.cpuDone.Load())}
	for i := range m.tids {
		tid := m.tids[i].Load()
		if tid == 0 {
			continue
		}
		// A thread's CPU clock, as pthread_getcpuclockid makes it:
		// CPUCLOCK_SCHED (2) | CPUCLOCK_PERTHREAD (4), of ^tid.
		var ts unix.Timespec
		if err := unix.ClockGettime(int32(^uint32(tid)<<3|6), &ts); err == nil {
			s.CPUTime += time.Duration(ts.Nano() - m.cpuBase[i].Load())
		}
		// An error means the thread ended meanwhile: its time is in
		// cpuDone, or is about to be.
	}
	for _, t := range m.track {
		for r := range t.exits {
			s.Exits += t.exits[r].Load()
		}
	}
	var err error
	if s.MemoryResident, err = m.mem.Resident(); err != nil {
		return s, fmt.Errorf("vmm: stats: %w", err)
	}
	return s, nil
}

// threadCPUTime is the calling thread's CPU time.
func threadCPUTime() time.Duration {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}
