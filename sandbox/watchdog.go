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
	b.c.watchdog = d
	return b
}

// watch is the watchdog's loop, from the agent's first answer until the VM
// stops. It asks the agent a small question every quarter of the period;
// while no answer comes it samples the vCPUs, and stops the VM once the
// period has passed with neither.
func (s *Sandbox) watch(period time.Duration) {
	interval := max(period/4, time.Second)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	lastAnswer := time.Now()
	var first *vmm.Debug // the state when the agent first failed to answer
	for {
		select {
		case <-s.vmDone:
			return
		case <-tick.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), interval)
		_, err := s.client.Info(ctx)
		cancel()
		if err == nil {
			lastAnswer, first = time.Now(), nil
			continue
		}
		cur := s.vm.Debug(context.Background())
		if first == nil {
			first = cur
			continue
		}
		if progressed(first, cur) {
			first = cur
			continue
		}
		if silent := time.Since(lastAnswer); silent >= period {
			s.c.logger().Error("sandbox hung", "silent", silent, "state", cur.String())
			s.vm.Stop(vmm.StopHung, fmt.Sprintf("watchdog: the agent did not answer for %v and no vCPU moved", silent.Round(time.Second)))
			return
		}
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
