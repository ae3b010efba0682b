package sandbox

import (
	"context"
	"fmt"
	"sync"

	"github.com/capsa-sandbox/capsa/ratelimit"
	virtionet "github.com/capsa-sandbox/capsa/virtio/net"
)

// Limits sets the sandbox's I/O limits (package ratelimit): its NIC's
// bandwidth and packets each way, each disk's bandwidth and requests (the
// image's root, its image and writable layer together, counts as one),
// and each share's bandwidth. A guest past a limit is slowed, never
// failed. Sandbox.SetLimits changes them while it runs.
func (b *Builder) Limits(l ratelimit.Limits) *Builder {
	if err := l.Check(); err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %w", err))
	}
	b.c.Limits = l
	return b
}

// LimitString sets the limits written as `capsa run --limit` takes them
// (ratelimit.ParseLimits: net=10MB/s,disk=50MB/s,disk-iops=2000), on top
// of those set so far.
func (b *Builder) LimitString(s string) *Builder {
	l, err := ratelimit.ParseLimits(s, b.c.Limits)
	if err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %w", err))
		return b
	}
	b.c.Limits = l
	return b
}

// limiters are a running sandbox's buckets, one set per device, all set
// from one Limits.
type limiters struct {
	mu     sync.Mutex
	cur    ratelimit.Limits
	netRx  *ratelimit.Limiter
	netTx  *ratelimit.Limiter
	disks  []*ratelimit.Limiter
	shares []*ratelimit.Limiter
}

func newLimiters(l ratelimit.Limits) *limiters {
	return &limiters{cur: l, netRx: ratelimit.New(l.NetRx), netTx: ratelimit.New(l.NetTx)}
}

// disk is a new disk's buckets.
func (ls *limiters) disk() *ratelimit.Limiter {
	return ls.add(&ls.disks, func(l ratelimit.Limits) ratelimit.Limit { return l.Disk })
}

// share is a new share's bucket.
func (ls *limiters) share() *ratelimit.Limiter {
	return ls.add(&ls.shares, func(l ratelimit.Limits) ratelimit.Limit { return l.Share })
}

// add makes a device's buckets with its part of the current limits, kept
// in list for set.
func (ls *limiters) add(list *[]*ratelimit.Limiter, part func(ratelimit.Limits) ratelimit.Limit) *ratelimit.Limiter {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	l := ratelimit.New(part(ls.cur))
	*list = append(*list, l)
	return l
}

func (ls *limiters) set(l ratelimit.Limits) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.cur = l
	ls.netRx.Set(l.NetRx)
	ls.netTx.Set(l.NetTx)
	for _, d := range ls.disks {
		d.Set(l.Disk)
	}
	for _, s := range ls.shares {
		s.Set(l.Share)
	}
}

// SetLimits replaces the sandbox's I/O limits while it runs (a zero rate:
// none); requests waiting now go by the new ones from their next burst.
func (s *Sandbox) SetLimits(l ratelimit.Limits) error {
	if err := l.Check(); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	s.lim.set(l)
	return nil
}

// Limits returns the sandbox's I/O limits in force.
func (s *Sandbox) Limits() ratelimit.Limits {
	s.lim.mu.Lock()
	defer s.lim.mu.Unlock()
	return s.lim.cur
}

// limitedBackend is the NAT as the NIC sees it, through the network's
// buckets: a frame from the guest waits before the NAT gets it, one for
// the guest before the NIC does (the NAT's queue toward the guest then
// fills and drops, as a link's would, and TCP slows down).
type limitedBackend struct {
	virtionet.Backend
	rx, tx *ratelimit.Limiter
	done   <-chan struct{} // closed when the sandbox's VM is done
}

var _ virtionet.Backend = (*limitedBackend)(nil)

func (b *limitedBackend) DeliverFrame(frame []byte) error {
	b.tx.Wait(b.done, 1, len(frame))
	return b.Backend.DeliverFrame(frame)
}

func (b *limitedBackend) ReadFrame(ctx context.Context) ([]byte, error) {
	f, err := b.Backend.ReadFrame(ctx)
	if err == nil {
		b.rx.Wait(ctx.Done(), 1, len(f))
	}
	return f, err
}
