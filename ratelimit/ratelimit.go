// Package ratelimit is a sandbox's I/O limits: token buckets with a burst,
// the model of Firecracker's rate limiter (a bucket of bytes and one of
// operations, refilled at a steady rate, holding at most a burst), on
// golang.org/x/time/rate's Limiter.
//
// A Limiter is what one device (a NIC's direction, a disk, a share) waits
// on before it does some I/O: it is slowed, never failed. A request larger
// than the burst still goes through, at the rate: it waits for the
// bucket's fill one burst at a time. Limits can change while devices
// wait (Limiter.Set), as `capsa update` changes them.
package ratelimit

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Rate is one bucket: Per is its refill in units (bytes or operations) a
// second, Burst how many it holds (0: one second's worth). A zero Per is
// no limit.
type Rate struct {
	Per   float64 `json:"per_second"`
	Burst int64   `json:"burst,omitempty"`
}

// Unlimited reports whether r limits nothing.
func (r Rate) Unlimited() bool { return r.Per <= 0 }

func (r Rate) burst() int {
	b := r.Burst
	if b <= 0 {
		b = int64(math.Ceil(r.Per))
	}
	return int(min(max(b, 1), math.MaxInt32))
}

// Limit is a device's two buckets.
type Limit struct {
	Bytes Rate `json:"bytes"`
	Ops   Rate `json:"ops"`
}

// Unlimited reports whether l limits nothing.
func (l Limit) Unlimited() bool { return l.Bytes.Unlimited() && l.Ops.Unlimited() }

// Limiter is one device's buckets. The zero value and nil limit nothing.
type Limiter struct {
	mu         sync.Mutex
	bytes, ops *rate.Limiter // nil: no limit
	lim        Limit
}

// New returns a Limiter holding l.
func New(l Limit) *Limiter {
	var lim Limiter
	lim.Set(l)
	return &lim
}

// Set replaces the limits; a device waiting now waits by the new ones
// from its next burst on. Buckets start full.
func (l *Limiter) Set(lim Limit) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lim = lim
	l.bytes, l.ops = bucket(l.bytes, lim.Bytes), bucket(l.ops, lim.Ops)
}

func bucket(b *rate.Limiter, r Rate) *rate.Limiter {
	if r.Unlimited() {
		return nil
	}
	if b == nil {
		return rate.NewLimiter(rate.Limit(r.Per), r.burst())
	}
	b.SetLimit(rate.Limit(r.Per))
	b.SetBurst(r.burst())
	return b
}

// Limit returns the limits in force.
func (l *Limiter) Limit() Limit {
	if l == nil {
		return Limit{}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lim
}

// Wait takes ops operations and n bytes from the buckets, waiting until
// they hold them. It returns false, having waited less, if stop closes
// first.
func (l *Limiter) Wait(stop <-chan struct{}, ops, n int) bool {
	if l == nil {
		return true
	}
	l.mu.Lock()
	bytes, opsB := l.bytes, l.ops
	l.mu.Unlock()
	return take(stop, opsB, ops) && take(stop, bytes, n)
}

// take waits for n tokens of b, a burst at a time.
func take(stop <-chan struct{}, b *rate.Limiter, n int) bool {
	for b != nil && n > 0 {
		k := min(n, b.Burst())
		r := b.ReserveN(time.Now(), k)
		if !r.OK() { // the burst shrank meanwhile: take what it holds
			k = max(b.Burst(), 1)
			if r = b.ReserveN(time.Now(), k); !r.OK() {
				return true
			}
		}
		if d := r.Delay(); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-stop:
				t.Stop()
				r.Cancel()
				return false
			}
		}
		n -= k
	}
	return true
}

// Limits are a sandbox's limits by device (Spec.Limits): its NIC each way,
// its disks (each disk its own buckets, the image's root included) and its
// shares (each share its own bytes bucket).
type Limits struct {
	NetRx Limit `json:"net_rx,omitzero"` // to the guest
	NetTx Limit `json:"net_tx,omitzero"` // from the guest
	Disk  Limit `json:"disk,omitzero"`
	Share Limit `json:"share,omitzero"`
}

// Bounds: the least rate a limit may set, so that one frame, request or
// message never waits long (a paused sandbox waits for a device's current
// request).
const (
	MinBytesPerSec = 64 << 10
	MinOpsPerSec   = 10
	MaxPerSec      = 1 << 50
)

// Check reports a limit no device could keep.
func (ls Limits) Check() error {
	for _, d := range []struct {
		name string
		l    Limit
	}{{"net-rx", ls.NetRx}, {"net-tx", ls.NetTx}, {"disk", ls.Disk}, {"share", ls.Share}} {
		for _, r := range []struct {
			unit string
			r    Rate
			min  float64
		}{{"bytes", d.l.Bytes, MinBytesPerSec}, {"operations", d.l.Ops, MinOpsPerSec}} {
			if r.r.Per < 0 || r.r.Burst < 0 || math.IsNaN(r.r.Per) {
				return fmt.Errorf("ratelimit: %s: a negative %s rate or burst", d.name, r.unit)
			}
			if !r.r.Unlimited() && (r.r.Per < r.min || r.r.Per > MaxPerSec) {
				return fmt.Errorf("ratelimit: %s: %g %s a second: want 0 (no limit) or %g to %d", d.name, r.r.Per, r.unit, r.min, int64(MaxPerSec))
			}
		}
	}
	if ls.Share.Ops != (Rate{}) {
		return errors.New("ratelimit: share: only a bytes rate (share=RATE), not operations")
	}
	return nil
}

// Keys of ParseLimits, and what each sets.
var limitKeys = map[string]func(*Limits) *Rate{
	"net":        nil, // both ways, bytes
	"net-rx":     func(l *Limits) *Rate { return &l.NetRx.Bytes },
	"net-tx":     func(l *Limits) *Rate { return &l.NetTx.Bytes },
	"net-pps":    nil, // both ways, packets
	"net-rx-pps": func(l *Limits) *Rate { return &l.NetRx.Ops },
	"net-tx-pps": func(l *Limits) *Rate { return &l.NetTx.Ops },
	"disk":       func(l *Limits) *Rate { return &l.Disk.Bytes },
	"disk-iops":  func(l *Limits) *Rate { return &l.Disk.Ops },
	"share":      func(l *Limits) *Rate { return &l.Share.Bytes },
}

// ParseLimits reads limits written as KEY=RATE[:BURST] pairs, comma
// separated, onto base (a sandbox's current limits, for an update):
// net, net-rx, net-tx (bytes a second: 10MB, 512KiB, 10MB/s), net-pps,
// net-rx-pps, net-tx-pps (packets), disk (bytes), disk-iops (requests),
// share (bytes, each share). A rate of 0 removes that limit.
func ParseLimits(s string, base Limits) (Limits, error) {
	l := base
	for _, kv := range strings.Split(s, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		set, known := limitKeys[k]
		if !ok || !known {
			return base, fmt.Errorf("limit %q: want KEY=RATE[:BURST] with KEY one of net, net-rx, net-tx, net-pps, net-rx-pps, net-tx-pps, disk, disk-iops, share", kv)
		}
		bytes := !strings.HasSuffix(k, "pps") && k != "disk-iops"
		rv, bv, hasBurst := strings.Cut(v, ":")
		per, err := parseAmount(strings.TrimSuffix(rv, "/s"), bytes)
		if err != nil {
			return base, fmt.Errorf("limit %s: %w", kv, err)
		}
		r := Rate{Per: per}
		if hasBurst {
			b, err := parseAmount(bv, bytes)
			if err != nil || b < 1 || b > math.MaxInt32 {
				return base, fmt.Errorf("limit %s: burst %q: want a positive amount up to 2G", kv, bv)
			}
			r.Burst = int64(b)
		}
		switch k {
		case "net":
			l.NetRx.Bytes, l.NetTx.Bytes = r, r
		case "net-pps":
			l.NetRx.Ops, l.NetTx.Ops = r, r
		default:
			*set(&l) = r
		}
	}
	if err := l.Check(); err != nil {
		return base, err
	}
	return l, nil
}

// parseAmount reads a count, with a byte unit where bytes says so: K, M, G
// are decimal (KB, MB, GB too), KiB, MiB, GiB binary.
func parseAmount(s string, bytes bool) (float64, error) {
	mult := 1.0
	if bytes {
		for _, u := range []struct {
			suffix string
			m      float64
		}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"K", 1e3}, {"M", 1e6}, {"G", 1e9}, {"B", 1}} {
			if n, ok := strings.CutSuffix(s, u.suffix); ok {
				s, mult = n, u.m
				break
			}
		}
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || v < 0 || math.IsInf(v, 0) || math.IsNaN(v) {
		return 0, fmt.Errorf("%q is not an amount", s)
	}
	return v * mult, nil
}

// String writes l as ParseLimits reads it, "none" when it limits nothing.
func (ls Limits) String() string {
	var parts []string
	add := func(k string, r Rate, bytes bool) {
		if r.Unlimited() {
			return
		}
		s := k + "=" + amount(r.Per, bytes) + "/s"
		if r.Burst > 0 {
			s += ":" + amount(float64(r.Burst), bytes)
		}
		parts = append(parts, s)
	}
	add("net-rx", ls.NetRx.Bytes, true)
	add("net-tx", ls.NetTx.Bytes, true)
	add("net-rx-pps", ls.NetRx.Ops, false)
	add("net-tx-pps", ls.NetTx.Ops, false)
	add("disk", ls.Disk.Bytes, true)
	add("disk-iops", ls.Disk.Ops, false)
	add("share", ls.Share.Bytes, true)
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ",")
}

func amount(v float64, bytes bool) string {
	if bytes {
		for _, u := range []struct {
			suffix string
			m      float64
		}{{"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
			if v >= u.m && v == math.Trunc(v/u.m)*u.m {
				return strconv.FormatFloat(v/u.m, 'f', -1, 64) + u.suffix
			}
		}
		return strconv.FormatFloat(v, 'f', -1, 64) + "B"
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}
