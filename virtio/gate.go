package virtio

import (
	"context"
	"fmt"
	"sync"
)

// Gate holds the queues of one machine still while it is paused. Closed,
// it lets no queue hand out a chain, and Close returns once every chain
// handed out before has come back through Push (or its queue was given up
// by a reset or a failure), so that no device touches guest memory or a
// ring until Open. A paused machine's memory and rings are then exactly
// what a snapshot must hold: no request half done.
//
// It is shared plumbing, written once for every device: a device only
// sees its queues return no chain while the gate is closed, as when the
// guest has posted none, and is notified of every queue when it opens.
// One Gate serves all the transports of a machine.
type Gate struct {
	mu      sync.Mutex
	closed  bool
	held    int           // chains handed out and not yet returned
	drained chan struct{} // closed when held reaches 0 during Close
}

// NewGate returns an open gate.
func NewGate() *Gate { return &Gate{} }

// next pops q's next chain unless the gate is closed; a chain handed out
// counts as held until it is pushed. The check and the count are one step
// under g.mu, so no chain leaves after Close has seen none held.
func (g *Gate) next(q *Queue) (*Chain, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil, nil
	}
	c, err := q.next()
	if c != nil {
		q.held++
		g.held++
	}
	return c, err
}

// returned counts one of q's chains back.
func (g *Gate) returned(q *Queue) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if q.held > 0 {
		q.held--
		g.drop(1)
	}
}

// release forgets every chain q still holds: its device was reset or
// failed, and will return none of them.
func (g *Gate) release(q *Queue) {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := q.held
	q.held = 0
	g.drop(n)
}

// drop lowers the held count by n and wakes a waiting Close at zero. g.mu
// is held.
func (g *Gate) drop(n int) {
	g.held -= n
	if g.held == 0 && g.drained != nil {
		close(g.drained)
		g.drained = nil
	}
}

// Close stops the queues handing out chains and waits until every chain
// handed out has been returned. If ctx ends first, the gate stays closed
// and the error says how many chains the devices still hold; the caller
// opens it again. A device's interrupt for its last chains may come after
// Close returns (a device reports once it has pushed them all): a state
// taken then may lack it, and a restore interrupts every running device
// once for that reason (MMIO.Restore).
func (g *Gate) Close(ctx context.Context) error {
	g.mu.Lock()
	g.closed = true
	if g.held == 0 {
		g.mu.Unlock()
		return nil
	}
	if g.drained == nil {
		g.drained = make(chan struct{})
	}
	drained := g.drained
	g.mu.Unlock()
	select {
	case <-drained:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("virtio: %d requests still in the devices' hands: %w", g.Held(), context.Cause(ctx))
	}
}

// Open lets the queues hand out chains again. The caller then notifies
// every queue (MMIO.Kick), since a device that found no chain while the
// gate was closed waits for a notification.
func (g *Gate) Open() {
	g.mu.Lock()
	g.closed = false
	g.mu.Unlock()
}

// Held is how many chains the devices hold now.
func (g *Gate) Held() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.held
}
