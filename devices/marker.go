package devices

import (
	"sync"
	"time"
)

// BootMarkerPort is the debug port the guest writes BootMarkerValue to once
// its userspace runs, as Firecracker's boot timer does. The VMM records the
// time since its own start.
const (
	BootMarkerPort  = 0x3f0
	BootMarkerValue = 123
)

// BootMarker records the first time the guest signals it reached userspace.
type BootMarker struct {
	mu    sync.Mutex
	start time.Time
	at    time.Duration
	seen  bool
	fire  func(time.Duration)
}

// NewBootMarker measures from start; fire, if not nil, is called once.
func NewBootMarker(start time.Time, fire func(time.Duration)) *BootMarker {
	return &BootMarker{start: start, fire: fire}
}

// Elapsed returns the time from start to the marker, and whether it came.
func (b *BootMarker) Elapsed() (time.Duration, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.at, b.seen
}

// Read implements Device.
func (b *BootMarker) Read(_ uint64, data []byte) {
	for i := range data {
		data[i] = 0
	}
}

// Write implements Device.
func (b *BootMarker) Write(_ uint64, data []byte) {
	if len(data) == 0 || data[0] != BootMarkerValue {
		return
	}
	b.mu.Lock()
	first := !b.seen
	if first {
		b.seen, b.at = true, time.Since(b.start)
	}
	at := b.at
	b.mu.Unlock()
	if first && b.fire != nil {
		b.fire(at)
	}
}
