package supervisor

import (
	"context"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// statsHandles are the handles Manager.Stats keeps, one per running
// sandbox it measured, so that a stream of measurements (capsa stats, the
// metrics endpoint's scrapes, E2B's getMetrics) reuses each sandbox's
// control connection instead of opening it anew each time.
type statsHandles struct {
	mu      sync.Mutex
	handles map[string]statsHandle
	pruned  time.Time
}

type statsHandle struct {
	h       *Handle
	started time.Time // its record's start: a sandbox started again under the name is another
}

// statsPruneEvery is how often Stats drops the handles of sandboxes that
// no longer run, so that a long-lived Manager keeps none for sandboxes
// long gone.
const statsPruneEvery = time.Minute

// Stats measures the running sandbox name: its vCPUs' and the VMM's CPU
// time, memory, network and block I/O, its NAT's flows. It keeps the
// sandbox's handle for the next measurement; a handle that fails, or
// whose sandbox has ended or started again since, is dropped and opened
// afresh. A sandbox that does not run is an error saying so (ErrPaused,
// ErrNotRunning). sandbox.CPUPercent of two measurements is its CPU use
// between them.
func (m *Manager) Stats(ctx context.Context, name string) (*sandbox.Stats, error) {
	m.pruneStats()
	rec, err := m.st.Get(name)
	if err != nil {
		m.dropStats(name, nil)
		return nil, err
	}
	m.stats.mu.Lock()
	c, ok := m.stats.handles[name]
	m.stats.mu.Unlock()
	// Open refuses a sandbox that does not run, saying why.
	if !ok || !c.started.Equal(rec.Started) || rec.State != Running {
		h, err := m.Open(ctx, name)
		if err != nil {
			m.dropStats(name, nil)
			return nil, err
		}
		c = statsHandle{h, rec.Started}
		m.stats.mu.Lock()
		if m.stats.handles == nil {
			m.stats.handles = map[string]statsHandle{}
		}
		if cur, ok := m.stats.handles[name]; ok && cur.started.Equal(rec.Started) {
			// Another measurement opened one meanwhile: use it.
			h.Close()
			c = cur
		} else {
			if ok {
				cur.h.Close()
			}
			m.stats.handles[name] = c
		}
		m.stats.mu.Unlock()
	}
	s, err := c.h.Stats(ctx)
	if err != nil {
		m.dropStats(name, c.h)
	}
	return s, err
}

// dropStats drops and closes the kept handle of name: any, or only h
// (not one another measurement has put there since).
func (m *Manager) dropStats(name string, h *Handle) {
	m.stats.mu.Lock()
	defer m.stats.mu.Unlock()
	if c, ok := m.stats.handles[name]; ok && (h == nil || c.h == h) {
		c.h.Close()
		delete(m.stats.handles, name)
	}
}

// pruneStats drops, at most once every statsPruneEvery, the kept handles
// of sandboxes that are not running.
func (m *Manager) pruneStats() {
	m.stats.mu.Lock()
	due := len(m.stats.handles) > 0 && time.Since(m.stats.pruned) >= statsPruneEvery
	if due {
		m.stats.pruned = time.Now()
	}
	m.stats.mu.Unlock()
	if !due {
		return
	}
	recs, err := m.st.List()
	if err != nil {
		return
	}
	running := map[string]bool{}
	for _, r := range recs {
		if r.State == Running {
			running[r.Name] = true
		}
	}
	m.stats.mu.Lock()
	for n, c := range m.stats.handles {
		if !running[n] {
			c.h.Close()
			delete(m.stats.handles, n)
		}
	}
	m.stats.mu.Unlock()
}
