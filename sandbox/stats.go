package sandbox

import (
	"fmt"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/vmm"
	"golang.org/x/sys/unix"
)

// Stats is what a sandbox has used since it started: what `capsa stats`
// shows. Counters only grow; a rate (CPU %,
// bytes a second) is the difference of two Stats over their Taken times.
type Stats struct {
	Taken  time.Time     `json:"taken"`
	Uptime time.Duration `json:"uptime_ns"`
	// CPUTime is the vCPU threads' CPU time (the guest's, and the exits
	// handled on them); CPUs is how many vCPUs there are.
	CPUTime time.Duration `json:"cpu_time_ns"`
	CPUs    int           `json:"cpus"`
	// MemoryResident is the guest RAM the host holds now; MemoryBytes the
	// guest's configured RAM, its bound.
	MemoryResident uint64 `json:"memory_resident_bytes"`
	MemoryBytes    uint64 `json:"memory_bytes"`
	// MemoryReturned is the guest RAM the guest reported free through
	// its balloon and the host discarded since it started, a total: it
	// counts free memory the host never held too (the guest reports all
	// its free memory over its first half minute), and a page freed,
	// used again and freed again twice.
	MemoryReturned uint64 `json:"memory_returned_bytes"`
	// Network: frames and bytes the guest received (Rx) and sent (Tx);
	// zero without a network.
	NetRxBytes   uint64 `json:"net_rx_bytes"`
	NetRxPackets uint64 `json:"net_rx_packets"`
	NetTxBytes   uint64 `json:"net_tx_bytes"`
	NetTxPackets uint64 `json:"net_tx_packets"`
	// Disk: what the guest read and wrote on its virtio-blk disks (the
	// image's root filesystem included).
	DiskReadBytes  uint64 `json:"disk_read_bytes"`
	DiskReads      uint64 `json:"disk_reads"`
	DiskWriteBytes uint64 `json:"disk_write_bytes"`
	DiskWrites     uint64 `json:"disk_writes"`
	// Exits counts the VM exits to capsa.
	Exits uint64 `json:"exits"`
	// VMMCPUTime is the CPU time of the process's threads other than the
	// vCPUs: device I/O, the NAT, the agent's connection. A detached
	// sandbox has a process of its own; a program that runs several
	// sandboxes through this package counts all of theirs here.
	VMMCPUTime time.Duration `json:"vmm_cpu_time_ns"`
	// LastPause is how long the sandbox's last snapshot or fork kept it
	// paused (Sandbox.LastPause; 0: none yet).
	LastPause time.Duration `json:"last_pause_ns,omitempty"`
	// MemoryRemaps counts the forks that mapped the guest's memory anew
	// from the fork snapshot they wrote (the first, and one whose pages
	// written since its base outgrew a quarter of the memory). After
	// each, the guest's first touch of each page is a fault, and its
	// first write of each a copy: a slowdown beyond the pause. A later
	// fork writes only what changed and maps nothing anew.
	MemoryRemaps uint64 `json:"memory_remaps,omitempty"`
	// NetFlows is how many DNS queries, TCP connections and UDP flows each
	// rule of the network policy allowed and refused (none without a
	// network).
	NetFlows []netstack.FlowCount `json:"net_flows,omitempty"`
}

// Stats reports what the sandbox has used so far.
func (s *Sandbox) Stats() (*Stats, error) {
	vs, err := s.vm.Stats()
	if err != nil {
		return nil, fmt.Errorf("sandbox: stats: %w", err)
	}
	now := time.Now()
	st := &Stats{
		Taken: now, Uptime: now.Sub(s.started), CPUTime: vs.CPUTime, CPUs: s.c.CPUs,
		MemoryResident: vs.MemoryResident, MemoryBytes: vs.MemoryBytes, Exits: vs.Exits, LastPause: s.LastPause(),
		MemoryRemaps: s.forkRemaps.Load(),
	}
	if s.net != nil {
		n := s.net.nic.Stats()
		st.NetRxBytes, st.NetRxPackets, st.NetTxBytes, st.NetTxPackets = n.RxBytes, n.RxFrames, n.TxBytes, n.TxFrames
		if s.net.stack != nil {
			st.NetFlows = s.net.stack.FlowCounts()
		}
	}
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err == nil {
		proc := time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		st.VMMCPUTime = max(proc-vs.CPUTime, 0)
	}
	if s.balloon != nil {
		st.MemoryReturned = s.balloon.Stats().Returned()
	}
	for _, d := range s.disks {
		b := d.Stats()
		st.DiskReadBytes += b.ReadBytes
		st.DiskReads += b.Reads
		st.DiskWriteBytes += b.WriteBytes
		st.DiskWrites += b.Writes
	}
	return st, nil
}

// Timeline is where the sandbox's start went so far, a boot's or a
// restore's: each step of capsa's and each milestone of the guest's it can
// see, as the time since the start, and the VM exits by reason (capsa vm
// --boot-time prints a boot's).
func (s *Sandbox) Timeline() vmm.Timeline { return s.vm.Timeline() }

// CPUPercent is the CPU use between two Stats of one sandbox, as `docker
// stats` shows it: 100 is one vCPU busy all the time.
func CPUPercent(prev, cur *Stats) float64 {
	return cpuPercent(prev, cur, func(s *Stats) time.Duration { return s.CPUTime })
}

// VMMCPUPercent is CPUPercent for the VMM's own threads (Stats.VMMCPUTime).
func VMMCPUPercent(prev, cur *Stats) float64 {
	return cpuPercent(prev, cur, func(s *Stats) time.Duration { return s.VMMCPUTime })
}

func cpuPercent(prev, cur *Stats, of func(*Stats) time.Duration) float64 {
	if prev == nil || cur == nil {
		return 0
	}
	wall := cur.Taken.Sub(prev.Taken)
	if wall <= 0 || of(cur) < of(prev) {
		return 0
	}
	return 100 * float64(of(cur)-of(prev)) / float64(wall)
}

// IdleSince says since when nobody has been connected to the sandbox's
// vsock Unix socket (VsockSocket; every `capsa exec` and `cp` comes that
// way): idle is false while someone is, and since is when its agent first
// answered if nobody was connected after that. A sandbox whose agent has
// not answered yet is booting, not idle (its ready timeout bounds that),
// so an idle timeout shorter than a slow boot still leaves a client its
// whole length to connect. Without a VsockSocket the sandbox is never
// idle.
func (s *Sandbox) IdleSince() (since time.Time, idle bool) {
	if s.hybrid == nil {
		return time.Time{}, false
	}
	ready := s.readyAt.Load()
	if ready == 0 {
		return time.Time{}, false
	}
	n, last := s.hybrid.Activity()
	if n > 0 {
		return time.Time{}, false
	}
	if at := time.Unix(0, ready); last.Before(at) {
		last = at
	}
	return last, true
}

// markReady notes when the agent first answered and tells Ready's waiters.
func (s *Sandbox) markReady() {
	s.readyAt.Store(time.Now().UnixNano())
	close(s.ready)
}
