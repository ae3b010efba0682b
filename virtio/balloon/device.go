// Package virtioballoon is the virtio memory balloon device (virtio 1.2
// §5.5) with free page reporting: the guest tells the host which of its
// pages are free, and the host gives them back (MADV_DONTNEED), so a
// sandbox whose workload freed memory stops costing the host that memory
// within seconds. Its starting point is Device.serve, which runs the
// chains of the three queues.
//
// The queues are inflate (0), deflate (1) and, once the driver accepts
// VIRTIO_BALLOON_F_REPORTING, the reporting queue (2): Linux numbers the
// queues it uses densely, and without the statistics and free page hint
// features (not offered) the reporting queue comes third.
//
//   - reporting: each chain's writable buffers are free guest pages
//     (Linux reports 2 MiB blocks, at most 32 a chain, 2 s after they were
//     freed); the host discards the whole pages inside each and returns
//     the chain with nothing written.
//   - inflate: readable buffers of 32-bit page frame numbers (4 KiB
//     pages) the guest gave up; each is discarded.
//   - deflate: page frame numbers the guest takes back; nothing to do,
//     since a discarded page comes back on the guest's next touch.
//
// The host never asks for pages (num_pages stays 0), so a well-behaved
// driver inflates nothing. The guest is hostile: a page frame outside its
// RAM is skipped and counted, an inflate chain is bounded, and nothing it
// sends reaches memory that is not its own (guestmem checks every range).
// A discarded page reads as zero, or as the snapshot had it in a restored
// sandbox; either way the guest had said it did not need the content.
package virtioballoon

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/virtio"
)

var _ virtio.Device = (*Device)(nil)

// Feature bits (§5.5.3).
const (
	// FeatureReporting is VIRTIO_BALLOON_F_REPORTING: the reporting queue.
	FeatureReporting = 1 << 5
)

// Queues and limits.
const (
	queueInflate   = 0
	queueDeflate   = 1
	queueReporting = 2
	// queueSize: Linux needs at least 32 descriptors on the reporting
	// queue (PAGE_REPORTING_CAPACITY) and sends at most 256 page frames
	// an inflate or deflate chain.
	queueSize = 128
	// maxPFNBytes bounds the page frame numbers of one inflate or deflate
	// chain that are read: 1024 pages (Linux sends 256).
	maxPFNBytes = 4096
	pageShift   = 12 // VIRTIO_BALLOON_PFN_SHIFT
	pageSize    = 1 << pageShift
)

// Config space offsets (struct virtio_balloon_config).
const (
	cfgNumPages = 0  // le32, pages the host asks for: always 0
	cfgActual   = 4  // le32, pages in the balloon, written by the driver
	cfgCmdID    = 8  // le32, free page hint command (not offered)
	cfgPoison   = 12 // le32, page poison value (not offered)
	cfgLen      = 16
)

// Stats counts what the guest gave back.
type Stats struct {
	// Reported is the bytes of free pages the guest reported and the
	// host discarded, a total over the device's life (a page freed,
	// used and freed again counts each time).
	Reported uint64
	// Inflated and Deflated are the pages given through the balloon
	// itself (none from Linux unless asked).
	Inflated, Deflated uint64
	// Errors are page frames outside the guest's RAM and discards the
	// host failed.
	Errors uint64
}

// Returned is the bytes the guest gave back in all: reported and inflated.
func (s Stats) Returned() uint64 { return s.Reported + s.Inflated*pageSize }

// Device is a virtio-balloon device. Its methods are safe for concurrent
// use.
type Device struct {
	log *slog.Logger

	mu      sync.Mutex
	run     *run
	closed  bool
	actual  uint32 // the driver's config field, as it wrote it
	workers sync.WaitGroup

	reported, inflated, deflated, errs atomic.Uint64
	warned                             atomic.Bool
}

// run is one activation: from DRIVER_OK to reset.
type run struct {
	act  virtio.Activation
	stop chan struct{}
	kick chan struct{}
}

// New returns a balloon device.
func New(log *slog.Logger) *Device {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Device{log: log.With("dev", "balloon")}
}

// Stats returns the device's counters.
func (d *Device) Stats() Stats {
	return Stats{Reported: d.reported.Load(), Inflated: d.inflated.Load(), Deflated: d.deflated.Load(), Errors: d.errs.Load()}
}

// Type implements virtio.Device.
func (d *Device) Type() uint32 { return virtio.TypeBalloon }

// Features implements virtio.Device: free page reporting only.
func (d *Device) Features() uint64 { return FeatureReporting }

// QueueSizes implements virtio.Device: inflate, deflate, reporting.
func (d *Device) QueueSizes() []uint16 { return []uint16{queueSize, queueSize, queueSize} }

// ReadConfig implements virtio.Device.
func (d *Device) ReadConfig(off uint64, data []byte) {
	var cfg [cfgLen]byte
	d.mu.Lock()
	binary.LittleEndian.PutUint32(cfg[cfgActual:], d.actual)
	d.mu.Unlock()
	clear(data)
	if off < cfgLen {
		copy(data, cfg[off:])
	}
}

// WriteConfig implements virtio.Device: the driver writes actual (its
// whole 4 bytes); the rest is the device's. actual is not kept in a
// snapshot: the host asks for no pages, so a driver's is 0.
func (d *Device) WriteConfig(off uint64, data []byte) {
	if off != cfgActual || len(data) != 4 {
		return
	}
	d.mu.Lock()
	d.actual = binary.LittleEndian.Uint32(data)
	d.mu.Unlock()
}

// Activate implements virtio.Device.
func (d *Device) Activate(a virtio.Activation) error {
	if len(a.Queues) != 3 || a.Queues[queueInflate] == nil || a.Queues[queueDeflate] == nil {
		return errors.New("virtio-balloon: the driver did not set up the inflate and deflate queues")
	}
	if a.Features&FeatureReporting != 0 && a.Queues[queueReporting] == nil {
		return errors.New("virtio-balloon: free page reporting accepted without its queue")
	}
	if a.Features&FeatureReporting == 0 && a.Queues[queueReporting] != nil {
		return errors.New("virtio-balloon: a third queue set up without free page reporting")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errors.New("virtio-balloon: device closed")
	}
	d.stopLocked()
	r := &run{act: a, stop: make(chan struct{}), kick: make(chan struct{}, 1)}
	d.run = r
	d.workers.Add(1)
	go d.worker(r)
	r.kick <- struct{}{} // chains queued before DRIVER_OK
	return nil
}

// Notify implements virtio.Device: a queue has chains. The worker looks
// at all three.
func (d *Device) Notify(int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.run != nil {
		select {
		case d.run.kick <- struct{}{}:
		default:
		}
	}
}

// Reset implements virtio.Device.
func (d *Device) Reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stopLocked()
	d.actual = 0
}

func (d *Device) stopLocked() {
	if d.run != nil {
		close(d.run.stop)
		d.run = nil
	}
}

// Close stops the device for good and waits for its worker. It is
// idempotent.
func (d *Device) Close() error {
	d.mu.Lock()
	d.closed = true
	d.stopLocked()
	d.mu.Unlock()
	d.workers.Wait()
	return nil
}

// worker serves the queues until the run stops.
func (d *Device) worker(r *run) {
	defer d.workers.Done()
	for {
		select {
		case <-r.stop:
			return
		case <-r.kick:
		}
		for i, q := range r.act.Queues {
			if q != nil && !d.drain(r, i, q) {
				return
			}
		}
	}
}

// drain serves queue i's chains until it is empty; false when the run
// ended or the queue broke.
func (d *Device) drain(r *run, i int, q *virtio.Queue) bool {
	for {
		d.mu.Lock()
		if d.run != r {
			d.mu.Unlock()
			return false
		}
		c, err := q.Next()
		d.mu.Unlock()
		if err != nil {
			d.fail(r, fmt.Errorf("virtio-balloon: queue %d: %w", i, err))
			return false
		}
		if c == nil {
			return true
		}
		d.serve(r.act.Mem, i, c)
		d.mu.Lock()
		if d.run != r {
			d.mu.Unlock()
			return false
		}
		irq, err := q.Push(c)
		d.mu.Unlock()
		if err != nil {
			d.fail(r, fmt.Errorf("virtio-balloon: queue %d: %w", i, err))
			return false
		}
		r.act.Report(irq, nil)
	}
}

// fail marks the device broken after the guest broke a ring.
func (d *Device) fail(r *run, err error) {
	d.mu.Lock()
	if d.run == r {
		d.stopLocked()
	}
	d.mu.Unlock()
	r.act.Report(false, err)
}

// serve runs one chain of queue i.
func (d *Device) serve(mem *guestmem.Memory, i int, c *virtio.Chain) {
	switch i {
	case queueReporting:
		for _, b := range c.Writable() {
			n, err := mem.Discard(b)
			if err != nil {
				d.error(err)
				continue
			}
			d.reported.Add(n)
		}
	case queueInflate, queueDeflate:
		n := min(c.ReadableLen(), maxPFNBytes) &^ 3
		if c.ReadableLen() > maxPFNBytes {
			d.error(fmt.Errorf("virtio-balloon: a chain of %d bytes of page frames; the first %d are read", c.ReadableLen(), maxPFNBytes))
		}
		var buf [maxPFNBytes]byte
		if _, err := io.ReadFull(c, buf[:n]); err != nil {
			d.error(fmt.Errorf("virtio-balloon: read page frames: %w", err))
			return
		}
		for pfns := buf[:n]; len(pfns) >= 4; pfns = pfns[4:] {
			pfn := uint64(binary.LittleEndian.Uint32(pfns))
			if i == queueDeflate {
				d.deflated.Add(1)
				continue
			}
			page, err := mem.Slice(pfn<<pageShift, pageSize)
			if err == nil {
				_, err = mem.Discard(page)
			}
			if err != nil {
				d.error(fmt.Errorf("virtio-balloon: inflate page frame %#x: %w", pfn, err))
				continue
			}
			d.inflated.Add(1)
		}
	}
}

// error counts a page the device could not give back, and logs the first.
func (d *Device) error(err error) {
	d.errs.Add(1)
	d.log.Debug("virtio-balloon: page not given back", "err", err)
	if d.warned.CompareAndSwap(false, true) {
		d.log.Warn("virtio-balloon: page not given back (later ones are logged at debug level)", "err", err)
	}
}
