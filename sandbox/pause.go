package sandbox

import (
	"context"
	"fmt"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
)

// Pause stops the sandbox where it is until Resume: no vCPU runs, no
// device works on the guest's queues (requests a device holds are finished
// first), and the guest's clocks stand still. Guest operations made while
// paused wait, up to their own deadlines. Pausing a paused sandbox does
// nothing.
func (s *Sandbox) Pause(ctx context.Context) error {
	s.snapMu.Lock() // not during a snapshot, which pauses on its own
	defer s.snapMu.Unlock()
	if err := s.vm.Pause(ctx); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	return nil
}

// Resume runs a paused sandbox again. The guest's clocks went on from
// where they stood (it saw no time pass), so its wall clock is then set to
// the host's through the agent. Resuming a running sandbox only sets its
// clock.
func (s *Sandbox) Resume(ctx context.Context) error {
	s.snapMu.Lock() // not during a snapshot: its memory must stay still
	err := s.vm.Resume()
	s.snapMu.Unlock()
	if err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := s.client.Resumed(ctx, agent.Resumed{TimeNs: time.Now().UnixNano()}); err != nil {
		return fmt.Errorf("sandbox: resume: set the guest's clock: %w", s.vmErr(err))
	}
	return nil
}

// Paused reports whether the sandbox is paused.
func (s *Sandbox) Paused() bool { return s.vm.Paused() }
