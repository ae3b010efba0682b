package sandbox

import (
	"context"
	"fmt"
	"maps"
	"time"

	"github.com/capsa-sandbox/capsa/vmm"
)

// Watchdog makes the host stop a sandbox whose guest is stuck, instead of
// letting callers wait forever: when its agent has not answered for d and,
// over that time, no vCPU moved (the same instruction pointers, no exit to
// the VMM), the VM stops with vmm.StopHung and its Exit carries the state
// it was found in (Exit().Debug: registers, pending interrupts, virtqueue
// indices, the console's tail). A guest that is merely busy keeps running.
// 0, the default, turns it off.
func (b *Builder) Watchdog(d time.Duration) *Builder {
	if d < 0 {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: watchdog %v: must not be negative", d))
	}
	b.c.Watchdog = d
	return b
}

// watch is the watchdog's loop, from the agent's first answer until the VM
// stops. It asks the agent a small question every quarter of the period.
// Once no answer has come for the whole period, it looks at the vCPUs
// twice, a little apart and without asking the agent anything in between
// (its questions are guest work too), and stops the VM if none moved. An
// unanswered question's connection is aborted when it times out (the
// agent client resets it), so the guest is left nothing of the host's to
// handle while it is watched.
func (s *Sandbox) watch(period time.Duration) {
	interval := max(period/4, time.Second)
	gap := min(interval, 5*time.Second)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	lastAnswer := time.Now()
	for {
		select {
		case <-s.vmDone:
			return
		case <-tick.C:
		}
		if s.vm.Paused() {
			// Not stuck: stopped on purpose. Its silence counts from the
			// resume.
			lastAnswer = time.Now()
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), interval)
		_, err := s.client.Info(ctx)
		cancel()
		if err == nil || s.vm.Paused() {
			lastAnswer = time.Now()
			continue
		}
		silent := time.Since(lastAnswer)
		if silent < period {
			continue
		}
		// Let the guest finish with the failed question, then watch it.
		if !s.sleepUnlessDone(gap) {
			return
		}
		first := s.vm.Debug(context.Background())
		if !s.sleepUnlessDone(gap) {
			return
		}
		cur := s.vm.Debug(context.Background())
		if progressed(first, cur) || cur.Paused || first.Paused {
			continue
		}
		s.c.logger().Error("sandbox hung", "silent", silent, "state", cur.String())
		s.vm.Stop(vmm.StopHung, fmt.Sprintf("watchdog: the agent did not answer for %v and no vCPU moved", silent.Round(time.Second)))
		return
	}
}

// sleepUnlessDone waits d, or less if the VM stops (then false).
func (s *Sandbox) sleepUnlessDone(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-s.vmDone:
		return false
	case <-t.C:
		return true
	}
}

// progressed reports whether any vCPU moved between two samples: another
// instruction pointer, or exits to the VMM in between.
func progressed(a, b *vmm.Debug) bool {
	if len(a.VCPUs) != len(b.VCPUs) || !maps.Equal(a.Exits, b.Exits) {
		return true
	}
	for i := range a.VCPUs {
		if a.VCPUs[i].Err == nil && b.VCPUs[i].Err == nil && a.VCPUs[i].Regs.RIP != b.VCPUs[i].Regs.RIP {
			return true
		}
	}
	return false
}
