package vmm

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/capsa-sandbox/capsa/kvm"
	"github.com/capsa-sandbox/capsa/virtio"
)

// Timeline is where a VM's start went: the VMM's own steps and the
// guest's milestones the VMM can see from outside (its first console
// byte, its first virtio access, each driver's DRIVER_OK, the boot
// marker), each as the time since Config.Start, and the VM exits so far.
type Timeline struct {
	Marks []Mark
	// Exits counts the exits that reached the VMM, by reason, over all
	// vCPUs.
	Exits map[string]uint64
	// KVM is KVM's own counters summed over the vCPUs (KVM_GET_STATS_FD):
	// "exits" counts every exit, also those KVM handles itself (local
	// APIC, timers, HLT, page faults); nil where the kernel has none.
	KVM map[string]uint64
}

// Mark is one step: what happened, and when after the VMM's start.
type Mark struct {
	What string
	At   time.Duration
}

// timeline records marks, each name once.
type timeline struct {
	start time.Time
	mu    sync.Mutex
	marks []Mark
	// virtioSeen makes the per-exit check of the first virtio access a
	// load once it is marked.
	virtioSeen atomic.Bool
	exitSeen   atomic.Bool // the same for the guest's first exit
}

func (t *timeline) mark(what string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.addLocked(what, time.Since(t.start)) // under the lock: marks from several goroutines stay in order
}

// addLocked records what at at, unless it is recorded already; t.mu is
// held.
func (t *timeline) addLocked(what string, at time.Duration) {
	if !slices.ContainsFunc(t.marks, func(mk Mark) bool { return mk.What == what }) {
		t.marks = append(t.marks, Mark{What: what, At: at})
	}
}

// Mark records a step of the VM's start seen by a later layer (the
// sandbox's agent ready), once per name.
func (m *Machine) Mark(what string) { m.timeline.mark(what) }

// MarkAt records a step at a time after Config.Start that a caller
// measured itself, before the Machine existed (a restore's reading of its
// snapshot).
func (m *Machine) MarkAt(what string, at time.Duration) {
	t := &m.timeline
	t.mu.Lock()
	defer t.mu.Unlock()
	t.addLocked(what, at)
}

// virtioNames name the device types capsa attaches.
var virtioNames = map[uint32]string{
	virtio.TypeNet: "net", virtio.TypeBlock: "block", virtio.TypeBalloon: "balloon",
	virtio.Type9P: "9p", virtio.TypeFS: "virtio-fs", virtio.TypeVsock: "vsock",
}

// markVirtio notes the guest's first virtio-mmio access and, after a
// write, a driver that just set DRIVER_OK.
func (m *Machine) markVirtio(addr uint64, write bool) {
	if addr < virtioMMIOBase || addr >= virtioMMIOBase+uint64(len(m.virtio))*virtio.MMIOSize {
		return
	}
	if !m.timeline.virtioSeen.Load() && !m.timeline.virtioSeen.Swap(true) {
		m.timeline.mark("guest: first virtio access (drivers probing)")
	}
	i := int((addr - virtioMMIOBase) / virtio.MMIOSize)
	if s := m.virtio[i]; write && s.transport.Status()&virtio.StatusDriverOK != 0 {
		m.timeline.mark(fmt.Sprintf("guest: virtio-%s %d driver ready", virtioNames[s.transport.Type()], i))
	}
}

// openStats opens each vCPU's KVM counters, where the kernel has them.
func (m *Machine) openStats() {
	for _, v := range m.vcpus {
		s, err := v.OpenStats()
		if err != nil {
			m.log.Debug("no KVM counters for the boot timeline", "err", err)
			return
		}
		m.stats = append(m.stats, s)
	}
}

// Timeline returns the VM's start so far; it may be called at any time.
func (m *Machine) Timeline() Timeline {
	m.timeline.mu.Lock()
	tl := Timeline{Marks: slices.Clone(m.timeline.marks), Exits: map[string]uint64{}}
	m.timeline.mu.Unlock()
	slices.SortStableFunc(tl.Marks, func(a, b Mark) int { return int(a.At - b.At) })
	for _, t := range m.track {
		for r := range t.exits {
			if n := t.exits[r].Load(); n > 0 {
				tl.Exits[kvm.ExitReason(r).String()] += n
			}
		}
	}
	for _, s := range m.stats {
		c, err := s.Read()
		if err != nil {
			m.log.Debug("read KVM counters", "err", err)
			continue
		}
		if tl.KVM == nil {
			tl.KVM = map[string]uint64{}
		}
		for k, v := range c {
			tl.KVM[k] += v
		}
	}
	return tl
}

// BootTimeline is the timeline as it was when the guest reached
// userspace (wrote its boot marker); false before that.
func (m *Machine) BootTimeline() (Timeline, bool) {
	if tl := m.bootTimeline.Load(); tl != nil {
		return *tl, true
	}
	return Timeline{}, false
}

// timelineCounters are the KVM counters worth a line, in this order.
var timelineCounters = []string{
	"exits", "io_exits", "mmio_exits", "halt_exits", "irq_exits", "irq_window_exits",
	"request_irq_exits", "signal_exits", "insn_emulation", "hypercalls", "pf_taken",
	"pf_fixed", "pf_guest", "irq_injections", "halt_wakeup", "tlb_flush",
}

func (tl Timeline) String() string {
	var b strings.Builder
	b.WriteString("timeline, ms after the start:\n")
	var prev time.Duration
	for _, mk := range tl.Marks {
		fmt.Fprintf(&b, "  %9.1f  (+%7.1f)  %s\n", ms(mk.At), ms(mk.At-prev), mk.What)
		prev = mk.At
	}
	b.WriteString("exits to the VMM:")
	for _, k := range slices.Sorted(maps.Keys(tl.Exits)) {
		fmt.Fprintf(&b, " %s %d", k, tl.Exits[k])
	}
	b.WriteString("\n")
	if tl.KVM != nil {
		b.WriteString("KVM counters, all vCPUs:")
		for _, k := range timelineCounters {
			if v, ok := tl.KVM[k]; ok {
				fmt.Fprintf(&b, " %s %d", k, v)
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
