// Package virtioblk is the virtio block device (virtio 1.2 §5.2): one
// request queue serving a disk backed by a host file, read-only or
// read-write. Its starting point is Device.serve, which runs one request.
//
// Requests are served by one goroutine per activation, never on a vCPU
// thread: the guest's notification only wakes it. Data moves between the
// file and guest memory with preadv/pwritev straight into the guest's
// buffers, without a copy or an allocation sized by the guest.
//
// The guest is hostile. Every request is checked before any I/O: its
// header, its type, that its data is whole sectors, that it lies inside
// the disk, that a read-only disk is not written. A bad request fails
// alone with VIRTIO_BLK_S_IOERR (or UNSUPP for an unknown type) and the
// next one is served; only a broken ring marks the device NEEDS_RESET.
// Nothing the guest sends can reach past the disk's size in the file.
package virtioblk

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/virtio"
)

var _ virtio.Device = (*Device)(nil)

// Sizes and limits.
const (
	// SectorSize is the unit of the protocol's offsets and lengths.
	SectorSize = 512
	queueSize  = 256
	// segMax is the most data buffers the driver may put in one request:
	// the chain also holds the header and the status byte.
	segMax = queueSize - 2
	// sizeMax bounds one data buffer, so one request moves at most
	// segMax*sizeMax bytes (and the queue caps a chain at 256 MiB).
	sizeMax = 1 << 20
	// maxDiscardSegs bounds the ranges of one discard or write-zeroes
	// request, maxDiscardSectors each range.
	maxDiscardSegs    = 32
	maxDiscardSectors = 1 << 22 // 2 GiB
	hdrLen            = 16      // struct virtio_blk_req up to the data
	discardSegLen     = 16      // struct virtio_blk_discard_write_zeroes
	idLen             = 20      // VIRTIO_BLK_ID_BYTES
)

// Feature bits (§5.2.3).
const (
	featureSizeMax     = 1 << 1
	featureSegMax      = 1 << 2
	featureRO          = 1 << 5
	featureFlush       = 1 << 9
	featureDiscard     = 1 << 13
	featureWriteZeroes = 1 << 14
)

// Request types and status values (§5.2.6).
const (
	typeIn          = 0
	typeOut         = 1
	typeFlush       = 4
	typeGetID       = 8
	typeDiscard     = 11
	typeWriteZeroes = 13

	statusOK     = 0
	statusIOErr  = 1
	statusUnsupp = 2
)

// Config space offsets (struct virtio_blk_config).
const (
	cfgCapacity            = 0  // le64, in sectors
	cfgSizeMax             = 8  // le32
	cfgSegMax              = 12 // le32
	cfgMaxDiscardSectors   = 36 // le32
	cfgMaxDiscardSeg       = 40 // le32
	cfgDiscardAlignment    = 44 // le32
	cfgMaxWriteZeroesSecs  = 48 // le32
	cfgMaxWriteZeroesSeg   = 52 // le32
	cfgWriteZeroesMayUnmap = 56 // u8
	cfgLen                 = 60
)

// Options describe a disk.
type Options struct {
	// ReadOnly makes the device refuse writes (VIRTIO_BLK_F_RO).
	ReadOnly bool
	// ID is the serial the guest reads with GET_ID (at most 20 bytes;
	// Linux shows it as /sys/block/vdX/serial).
	ID string
	// Limit, when not nil, is waited on before each request: one
	// operation, and the bytes it reads or writes.
	Limit virtio.Limiter
}

// Stats counts the requests the device served.
type Stats struct {
	Reads, ReadBytes   uint64
	Writes, WriteBytes uint64
	Flushes, Discards  uint64
	// Errors are requests answered with IOERR or UNSUPP: malformed by
	// the guest or failed on the host.
	Errors uint64
}

// Device is a virtio-blk device. Its methods are safe for concurrent use.
type Device struct {
	f        *os.File
	fd       int
	sectors  uint64
	readOnly bool
	id       [idLen]byte
	limit    virtio.Limiter // nil: none
	log      *slog.Logger

	mu      sync.Mutex
	run     *run
	closed  bool
	workers sync.WaitGroup

	reads, readBytes, writes, writeBytes, flushes, discards, errs atomic.Uint64
	warned                                                        atomic.Bool
}

// run is one activation: from DRIVER_OK to reset.
type run struct {
	act     virtio.Activation
	discard bool // discard and write zeroes were negotiated
	stop    chan struct{}
	kick    chan struct{}
}

// Open opens the disk image at path for a Device and locks it: shared for
// a read-only disk, exclusive for a writable one, so that two VMs never
// write one disk or read a disk another is writing.
func Open(path string, readOnly bool) (*os.File, error) {
	flag, lock := os.O_RDWR, unix.LOCK_EX
	if readOnly {
		flag, lock = os.O_RDONLY, unix.LOCK_SH
	}
	f, err := os.OpenFile(path, flag|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("virtio-blk: open disk: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("virtio-blk: open disk: %w", err)
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("virtio-blk: disk %s: not a regular file", path)
	}
	if err := unix.Flock(int(f.Fd()), lock|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("virtio-blk: disk %s is in use by another VM", path)
		}
		return nil, fmt.Errorf("virtio-blk: lock disk %s: %w", path, err)
	}
	return f, nil
}

// OpenDevice opens and locks the disk at path (Open) and returns a device
// serving it (New), read-only as opts says.
func OpenDevice(path string, opts Options, log *slog.Logger) (*Device, error) {
	f, err := Open(path, opts.ReadOnly)
	if err != nil {
		return nil, err
	}
	d, err := New(f, opts, log)
	if err != nil {
		f.Close()
		return nil, err
	}
	return d, nil
}

// New returns a device serving the disk in f, whose size is the disk's
// (rounded down to whole sectors). The device owns f and closes it in
// Close.
func New(f *os.File, opts Options, log *slog.Logger) (*Device, error) {
	if f == nil {
		return nil, errors.New("virtio-blk: no disk file")
	}
	if len(opts.ID) > idLen {
		return nil, fmt.Errorf("virtio-blk: disk ID %q is longer than %d bytes", opts.ID, idLen)
	}
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("virtio-blk: stat disk: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Device{
		f: f, fd: int(f.Fd()), sectors: uint64(fi.Size()) / SectorSize, readOnly: opts.ReadOnly,
		limit: opts.Limit, log: log.With("dev", "blk", "disk", f.Name()),
	}
	copy(d.id[:], opts.ID)
	if fi.Size()%SectorSize != 0 {
		d.log.Warn("virtio-blk: disk size is not whole sectors; the tail is not used", "size", fi.Size())
	}
	return d, nil
}

// Sectors is the disk's size in 512-byte sectors.
func (d *Device) Sectors() uint64 { return d.sectors }

// Stats returns the device's counters.
func (d *Device) Stats() Stats {
	return Stats{
		Reads: d.reads.Load(), ReadBytes: d.readBytes.Load(),
		Writes: d.writes.Load(), WriteBytes: d.writeBytes.Load(),
		Flushes: d.flushes.Load(), Discards: d.discards.Load(), Errors: d.errs.Load(),
	}
}

// Type implements virtio.Device.
func (d *Device) Type() uint32 { return virtio.TypeBlock }

// Features implements virtio.Device: bounded segments, flush, and either
// read-only or discard and write zeroes (which punch holes, so a sparse
// disk gives space back to the host).
func (d *Device) Features() uint64 {
	f := uint64(featureSizeMax | featureSegMax | featureFlush)
	if d.readOnly {
		return f | featureRO
	}
	return f | featureDiscard | featureWriteZeroes
}

// QueueSizes implements virtio.Device: one request queue.
func (d *Device) QueueSizes() []uint16 { return []uint16{queueSize} }

// ReadConfig implements virtio.Device.
func (d *Device) ReadConfig(off uint64, data []byte) {
	var cfg [cfgLen]byte
	le := binary.LittleEndian
	le.PutUint64(cfg[cfgCapacity:], d.sectors)
	le.PutUint32(cfg[cfgSizeMax:], sizeMax)
	le.PutUint32(cfg[cfgSegMax:], segMax)
	if !d.readOnly {
		le.PutUint32(cfg[cfgMaxDiscardSectors:], maxDiscardSectors)
		le.PutUint32(cfg[cfgMaxDiscardSeg:], maxDiscardSegs)
		le.PutUint32(cfg[cfgDiscardAlignment:], 8) // 4 KiB, the host's page
		le.PutUint32(cfg[cfgMaxWriteZeroesSecs:], maxDiscardSectors)
		le.PutUint32(cfg[cfgMaxWriteZeroesSeg:], maxDiscardSegs)
		cfg[cfgWriteZeroesMayUnmap] = 1
	}
	clear(data)
	if off < cfgLen {
		copy(data, cfg[off:])
	}
}

// WriteConfig implements virtio.Device: nothing is writable (the
// writeback toggle needs VIRTIO_BLK_F_CONFIG_WCE, not offered).
func (d *Device) WriteConfig(uint64, []byte) {}

// Activate implements virtio.Device: the device starts serving requests.
func (d *Device) Activate(a virtio.Activation) error {
	if len(a.Queues) != 1 || a.Queues[0] == nil {
		return errors.New("virtio-blk: the driver did not set up the request queue")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errors.New("virtio-blk: device closed")
	}
	d.stopLocked()
	r := &run{
		act:     a,
		discard: a.Features&(featureDiscard|featureWriteZeroes) != 0,
		stop:    make(chan struct{}),
		kick:    make(chan struct{}, 1),
	}
	d.run = r
	d.workers.Add(1)
	go d.worker(r)
	r.kick <- struct{}{} // requests queued before DRIVER_OK
	return nil
}

// Notify implements virtio.Device: requests are available.
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

// Reset implements virtio.Device. A request being served finishes its I/O
// but is not returned to the guest.
func (d *Device) Reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stopLocked()
}

func (d *Device) stopLocked() {
	if d.run != nil {
		close(d.run.stop)
		d.run = nil
	}
}

// Close stops the device for good, waits for its worker and closes the
// disk file. It is idempotent.
func (d *Device) Close() error {
	d.mu.Lock()
	already := d.closed
	d.closed = true
	d.stopLocked()
	d.mu.Unlock()
	d.workers.Wait()
	if already {
		return nil
	}
	if err := d.f.Close(); err != nil {
		return fmt.Errorf("virtio-blk: close disk: %w", err)
	}
	return nil
}

// worker serves requests until the run stops.
func (d *Device) worker(r *run) {
	defer d.workers.Done()
	for {
		select {
		case <-r.stop:
			return
		case <-r.kick:
		}
		for {
			d.mu.Lock()
			if d.run != r {
				d.mu.Unlock()
				return
			}
			c, err := r.act.Queues[0].Next()
			d.mu.Unlock()
			if err != nil {
				d.fail(r, fmt.Errorf("virtio-blk: request queue: %w", err))
				return
			}
			if c == nil {
				break
			}
			if d.limit != nil {
				// The data's length: what the guest writes after the
				// header, what it reads before the status byte.
				n := max(c.ReadableLen()-hdrLen, 0) + max(c.WritableLen()-1, 0)
				d.limit.Wait(r.stop, 1, n)
			}
			d.serve(r, c)
			d.mu.Lock()
			if d.run != r {
				d.mu.Unlock()
				return
			}
			irq, err := r.act.Queues[0].Push(c)
			d.mu.Unlock()
			if err != nil {
				d.fail(r, fmt.Errorf("virtio-blk: request queue: %w", err))
				return
			}
			r.act.Report(irq, nil)
		}
	}
}

// fail marks the device broken after the guest broke its ring.
func (d *Device) fail(r *run, err error) {
	d.mu.Lock()
	if d.run == r {
		d.stopLocked()
	}
	d.mu.Unlock()
	r.act.Report(false, err)
}

// serve runs one request and writes its status into the chain's last
// writable byte. A chain with no writable byte cannot be answered and is
// returned as it is.
func (d *Device) serve(r *run, c *virtio.Chain) {
	wlen := c.WritableLen()
	if wlen == 0 {
		d.errs.Add(1)
		d.log.Debug("virtio-blk: request without a status byte")
		return
	}
	status, err := d.request(r, c, wlen-1)
	if err != nil {
		d.errs.Add(1)
		d.log.Debug("virtio-blk: request failed", "err", err)
		if !errors.Is(err, errGuest) && d.warned.CompareAndSwap(false, true) {
			d.log.Warn("virtio-blk: disk I/O failed (later failures are logged at debug level)", "err", err)
		}
	}
	// Skip whatever the request left of the writable buffers: the status
	// is the last byte.
	c.TakeWritable(wlen - 1 - int(c.Written()))
	c.Write([]byte{status})
}

// errGuest marks a request the guest got wrong, as opposed to one the host
// failed.
var errGuest = errors.New("bad request")

func guestErr(format string, a ...any) error {
	return fmt.Errorf("%w: %s", errGuest, fmt.Sprintf(format, a...))
}

// request runs one request whose data area (for reads and GET_ID) is the
// first room writable bytes, and returns its status.
func (d *Device) request(r *run, c *virtio.Chain, room int) (byte, error) {
	var hdr [hdrLen]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return statusIOErr, guestErr("header shorter than %d bytes", hdrLen)
	}
	typ := binary.LittleEndian.Uint32(hdr[0:])
	sector := binary.LittleEndian.Uint64(hdr[8:])
	switch typ {
	case typeIn:
		off, err := d.span(sector, uint64(room))
		if err != nil {
			return statusIOErr, err
		}
		if err := d.readAt(c.TakeWritable(room), off); err != nil {
			return statusIOErr, err
		}
		d.reads.Add(1)
		d.readBytes.Add(uint64(room))
	case typeOut:
		if d.readOnly {
			return statusIOErr, guestErr("write to a read-only disk")
		}
		n := c.ReadableLen() - hdrLen
		off, err := d.span(sector, uint64(n))
		if err != nil {
			return statusIOErr, err
		}
		if err := d.writeAt(c.TakeReadable(n), off); err != nil {
			return statusIOErr, err
		}
		d.writes.Add(1)
		d.writeBytes.Add(uint64(n))
	case typeFlush:
		if !d.readOnly {
			if err := unix.Fdatasync(d.fd); err != nil {
				return statusIOErr, fmt.Errorf("virtio-blk: flush: %w", err)
			}
		}
		d.flushes.Add(1)
	case typeGetID:
		if room < idLen {
			return statusIOErr, guestErr("GET_ID buffer of %d bytes, want %d", room, idLen)
		}
		c.Write(d.id[:])
	case typeDiscard, typeWriteZeroes:
		if d.readOnly || !r.discard {
			return statusUnsupp, guestErr("request type %d was not negotiated", typ)
		}
		if err := d.discard(c); err != nil {
			return statusIOErr, err
		}
		d.discards.Add(1)
	default:
		return statusUnsupp, guestErr("unknown request type %d", typ)
	}
	return statusOK, nil
}

// span checks that n bytes from sector are whole sectors inside the disk
// and returns their byte offset.
func (d *Device) span(sector, n uint64) (int64, error) {
	if n%SectorSize != 0 {
		return 0, guestErr("data of %d bytes is not whole sectors", n)
	}
	if sector > d.sectors || n/SectorSize > d.sectors-sector {
		return 0, guestErr("sectors %d+%d are beyond the disk's %d", sector, n/SectorSize, d.sectors)
	}
	return int64(sector * SectorSize), nil
}

// readAt fills bufs from the file at off. Past the file's end (a file
// shrunk on the host) the guest reads zeros.
func (d *Device) readAt(bufs [][]byte, off int64) error {
	for len(bufs) > 0 {
		n, err := unix.Preadv(d.fd, bufs, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("virtio-blk: read at %d: %w", off, err)
		}
		if n == 0 {
			for _, b := range bufs {
				clear(b)
			}
			return nil
		}
		off += int64(n)
		bufs = advance(bufs, n)
	}
	return nil
}

// writeAt writes bufs to the file at off.
func (d *Device) writeAt(bufs [][]byte, off int64) error {
	for len(bufs) > 0 {
		n, err := unix.Pwritev(d.fd, bufs, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("virtio-blk: write at %d: %w", off, err)
		}
		if n == 0 {
			return fmt.Errorf("virtio-blk: write at %d: %w", off, io.ErrShortWrite)
		}
		off += int64(n)
		bufs = advance(bufs, n)
	}
	return nil
}

// advance drops the first n bytes of bufs.
func advance(bufs [][]byte, n int) [][]byte {
	for n > 0 && len(bufs) > 0 {
		k := min(n, len(bufs[0]))
		bufs[0] = bufs[0][k:]
		n -= k
		if len(bufs[0]) == 0 {
			bufs = bufs[1:]
		}
	}
	for len(bufs) > 0 && len(bufs[0]) == 0 {
		bufs = bufs[1:]
	}
	return bufs
}

// discard punches a hole for each range of a discard or write-zeroes
// request: both read back as zeros and give the space back to the host.
func (d *Device) discard(c *virtio.Chain) error {
	n := c.ReadableLen() - hdrLen
	if n <= 0 || n%discardSegLen != 0 || n/discardSegLen > maxDiscardSegs {
		return guestErr("discard payload of %d bytes: want 1 to %d ranges of %d bytes", n, maxDiscardSegs, discardSegLen)
	}
	segs := make([]byte, n)
	if _, err := io.ReadFull(c, segs); err != nil {
		return guestErr("discard payload: %v", err)
	}
	for i := 0; i < n; i += discardSegLen {
		sector := binary.LittleEndian.Uint64(segs[i:])
		count := binary.LittleEndian.Uint32(segs[i+8:])
		if count > maxDiscardSectors {
			return guestErr("discard of %d sectors, at most %d", count, maxDiscardSectors)
		}
		off, err := d.span(sector, uint64(count)*SectorSize)
		if err != nil {
			return err
		}
		if count == 0 {
			continue
		}
		mode := uint32(unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE)
		if err := unix.Fallocate(d.fd, mode, off, int64(count)*SectorSize); err != nil {
			return fmt.Errorf("virtio-blk: discard at %d: %w", off, err)
		}
	}
	return nil
}
