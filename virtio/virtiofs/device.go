// Package virtiofs is the virtio-fs device (virtio 1.2 §5.11): each
// descriptor chain carries one FUSE request in its readable buffers and
// receives the reply in its writable ones, on a high-priority queue
// (FORGET, INTERRUPT) and one request queue. go-fuse's ProtocolServer
// decodes the requests and encodes the replies straight from and into the
// chain's guest memory; package fusefs answers them from a share's p9fs
// tree, so a virtio-fs share is confined as a 9P share is.
//
// The guest is hostile: a request larger than the negotiated maximum, or
// shorter than a FUSE header, gets an error reply from the device itself
// (or its chain back empty when it leaves no room for one), and a panic in
// the decoding is recovered into an EIO reply. Requests are served by a
// fixed number of workers, so the host work in flight is bounded whatever
// the guest queues.
package virtiofs

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/hugelgupf/p9/p9"

	"github.com/capsa-sandbox/capsa/fusefs"
	"github.com/capsa-sandbox/capsa/virtio"
)

const (
	queueSize = 128
	// MaxTagLen is the config space's tag field (36 bytes, NUL-padded).
	MaxTagLen = 36
	// MaxWrite is the largest read or write one request moves: the
	// INIT reply's max_write (the guest's reads are capped by the
	// same number of pages).
	MaxWrite = 1 << 20
	// maxRequest bounds a request's readable bytes: a write's data plus
	// its headers, or a name or extended attribute's value (64 KiB).
	maxRequest = MaxWrite + 4096
	// workers serve requests at once.
	workers = 8

	inHeaderLen  = 40 // struct fuse_in_header
	outHeaderLen = 16 // struct fuse_out_header

	errnoEINVAL = 22
	errnoEIO    = 5
)

// closeTimeout bounds how long Close waits for requests being served.
var closeTimeout = 10 * time.Second

// Options configures a device.
type Options struct {
	// Limit, when not nil, is waited on before each request: one
	// operation and the bytes it carries.
	Limit virtio.Limiter
	// Timeout is how long the guest may cache names and attributes
	// (fusefs.Options.Timeout).
	Timeout time.Duration
}

// Device is a virtio-fs device serving one p9.Attacher under a tag.
type Device struct {
	tag      string
	attacher p9.Attacher
	opts     Options
	log      *slog.Logger

	mu       sync.Mutex
	act      *virtio.Activation
	sess     *session
	retiring sync.WaitGroup // sessions ended and still closing
}

var (
	_ virtio.Device   = (*Device)(nil)
	_ virtio.Stateful = (*Device)(nil)
)

// New returns a device that serves a under tag (what the guest names in
// `mount -t virtiofs TAG DIR`). The device owns a: Close closes it when
// it is an io.Closer.
func New(tag string, a p9.Attacher, o Options, log *slog.Logger) (*Device, error) {
	if err := virtio.CheckTag("virtio-fs", tag, MaxTagLen); err != nil {
		return nil, err
	}
	if a == nil {
		return nil, errors.New("virtio-fs: no filesystem to serve")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Device{tag: tag, attacher: a, opts: o, log: log.With("dev", "virtiofs", "tag", tag)}, nil
}

// Tag is the mount tag.
func (d *Device) Tag() string { return d.tag }

// Type implements virtio.Device.
func (d *Device) Type() uint32 { return virtio.TypeFS }

// Features implements virtio.Device: no notification queue.
func (d *Device) Features() uint64 { return 0 }

// QueueSizes implements virtio.Device: the high-priority queue and one
// request queue.
func (d *Device) QueueSizes() []uint16 { return []uint16{queueSize, queueSize} }

// ReadConfig implements virtio.Device: tag[36], then le32
// num_request_queues.
func (d *Device) ReadConfig(off uint64, data []byte) {
	cfg := make([]byte, MaxTagLen+4)
	copy(cfg, d.tag)
	binary.LittleEndian.PutUint32(cfg[MaxTagLen:], 1)
	clear(data)
	if off < uint64(len(cfg)) {
		copy(data, cfg[off:])
	}
}

// WriteConfig implements virtio.Device: the config space is read-only.
func (d *Device) WriteConfig(uint64, []byte) {}

// Activate implements virtio.Device: a new FUSE session starts, with no
// node looked up (the guest's INIT begins it).
func (d *Device) Activate(a virtio.Activation) error {
	if len(a.Queues) != 2 || a.Queues[0] == nil || a.Queues[1] == nil {
		return errors.New("virtio-fs: the driver did not set up both queues")
	}
	fs, err := fusefs.New(d.attacher, fusefs.Options{Timeout: d.opts.Timeout, Logger: d.log})
	if err != nil {
		return fmt.Errorf("virtio-fs %s: %w", d.tag, err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.act = &a
	d.sess = d.newSession(&a, fs)
	// Requests queued before DRIVER_OK came with notifications the
	// transport could not pass on. They are taken as a notification's
	// are, on another goroutine: the transport holds its lock while it
	// activates, which reporting an interrupt or a broken queue takes.
	go func() {
		d.Notify(0)
		d.Notify(1)
	}()
	return nil
}

// Reset implements virtio.Device: the session ends, and with it every
// node and open file. It does not wait for the requests being served:
// the transport calls it with its lock held, which a worker reporting its
// interrupt takes; their chains are the old session's and go nowhere.
func (d *Device) Reset() {
	d.mu.Lock()
	s := d.sess
	d.act, d.sess = nil, nil
	d.mu.Unlock()
	if s != nil {
		d.retire(s)
	}
}

// retire closes a session that ended in the background; Close waits for
// it. d.mu need not be held.
func (d *Device) retire(s *session) {
	d.retiring.Add(1)
	go func() {
		defer d.retiring.Done()
		s.close()
	}()
}

// Close stops the device and waits, for at most closeTimeout, for the
// requests being served, those of sessions a reset ended included.
func (d *Device) Close() error {
	d.Reset()
	var err error
	done := make(chan struct{})
	go func() { d.retiring.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(closeTimeout):
		err = fmt.Errorf("virtio-fs %s: close: the file server did not stop within %v", d.tag, closeTimeout)
	}
	if c, ok := d.attacher.(io.Closer); ok {
		if cerr := c.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("virtio-fs %s: close the file server: %w", d.tag, cerr)
		}
	}
	return err
}

// SaveState implements virtio.Stateful. The guest's node ids name host
// inodes this process has pinned, which another process cannot pin
// again by them, so a running virtio-fs share cannot be saved.
func (d *Device) SaveState() (json.RawMessage, error) {
	return nil, errors.New("virtio-fs: a sandbox with a virtio-fs share cannot be snapshotted (use a 9p share)")
}

// RestoreState implements virtio.Stateful: only a device that was not
// running comes back.
func (d *Device) RestoreState(raw json.RawMessage) error {
	if virtio.NoState(raw) {
		return nil
	}
	return errors.New("virtio-fs: a snapshot cannot hold a running virtio-fs share")
}

// Notify implements virtio.Device: the requests the driver made
// available are handed to the workers, never blocking.
func (d *Device) Notify(q int) {
	d.mu.Lock()
	act := d.act
	if act == nil || q < 0 || q > 1 {
		d.mu.Unlock()
		return
	}
	irq, err := d.takeLocked(q)
	d.mu.Unlock()
	act.Report(irq, err)
}

// takeLocked hands queue q's available chains to the workers while they
// have room, answering malformed ones itself; d.mu is held.
func (d *Device) takeLocked(q int) (bool, error) {
	s := d.sess
	queue := d.act.Queues[q]
	irq := false
	for {
		if !s.room() {
			// A worker takes the queue again once it is done.
			return irq, nil
		}
		c, err := queue.Next()
		if err != nil {
			d.teardownLocked()
			return false, err
		}
		if c == nil {
			return irq, nil
		}
		if reason := check(c); reason != "" {
			d.log.Debug("bad FUSE request", "err", reason)
			errorReply(c, errnoEINVAL)
			more, err := queue.Push(c)
			if err != nil {
				d.teardownLocked()
				return false, err
			}
			irq = irq || more
			continue
		}
		s.admit(request{q: q, c: c})
	}
}

// teardownLocked ends the session after the queue broke; d.mu is held.
func (d *Device) teardownLocked() {
	s := d.sess
	d.act, d.sess = nil, nil
	d.retire(s)
}

// check says what is wrong with a request's sizes, or "".
func check(c *virtio.Chain) string {
	switch r, w := c.ReadableLen(), c.WritableLen(); {
	case r < inHeaderLen:
		return fmt.Sprintf("request of %d bytes is shorter than a FUSE header", r)
	case r > maxRequest:
		return fmt.Sprintf("request of %d bytes exceeds %d", r, maxRequest)
	case w > maxRequest:
		return fmt.Sprintf("reply buffers of %d bytes exceed %d", w, maxRequest)
	}
	return ""
}

// errorReply answers c's request with -errno, reading its header from
// the chain.
func errorReply(c *virtio.Chain, errno int32) {
	replyError(c, c.TakeReadable(inHeaderLen), errno)
}

// replyError writes a fuse_out_header with -errno for the request whose
// bytes are in, if c has room for one.
func replyError(c *virtio.Chain, in [][]byte, errno int32) {
	var hdr [16]byte
	n := 0
	for _, b := range in {
		n += copy(hdr[n:], b)
	}
	if n < len(hdr) || c.WritableLen() < outHeaderLen {
		return
	}
	var out [outHeaderLen]byte
	binary.LittleEndian.PutUint32(out[0:], outHeaderLen)
	binary.LittleEndian.PutUint32(out[4:], uint32(-errno))
	copy(out[8:], hdr[8:16]) // unique
	c.Write(out[:])
}

// request is one chain being served, and its queue.
type request struct {
	q int
	c *virtio.Chain
}

// session is one FUSE connection: the workers and the file system they
// answer from.
type session struct {
	dev     *Device
	act     *virtio.Activation
	fs      *fusefs.FS
	ps      *fuse.ProtocolServer
	reqs    chan request
	done    chan struct{}
	wg      sync.WaitGroup
	closing sync.Once

	mu      sync.Mutex
	pending int  // admitted and not yet returned
	starved bool // the device stopped taking requests for want of room
	inited  bool // an INIT was served, and no DESTROY since
}

func (d *Device) newSession(a *virtio.Activation, fs *fusefs.FS) *session {
	s := &session{
		dev:  d,
		act:  a,
		fs:   fs,
		ps:   fuse.NewProtocolServer(fs, fusefs.MountOptions(MaxWrite, d.log)),
		reqs: make(chan request, 2*queueSize),
		done: make(chan struct{}),
	}
	for range workers {
		s.wg.Add(1)
		go s.worker()
	}
	return s
}

// room reports whether another request may be admitted: at most both
// queues' worth are in the workers' hands.
func (s *session) room() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pending >= cap(s.reqs) {
		s.starved = true
		return false
	}
	return true
}

func (s *session) admit(r request) {
	s.mu.Lock()
	s.pending++
	s.mu.Unlock()
	s.reqs <- r // never blocks: room said so, under the device's lock
}

// close stops the workers, waits for the requests they serve, and
// releases every file the session holds.
func (s *session) close() {
	s.closing.Do(func() {
		close(s.done)
		s.wg.Wait()
		s.fs.Close()
	})
}

func (s *session) worker() {
	defer s.wg.Done()
	for {
		select {
		case <-s.done:
			return
		case r := <-s.reqs:
			s.serve(r)
		}
	}
}

// serve answers one request and returns its chain.
func (s *session) serve(r request) {
	select {
	case <-s.done:
		// Reset meanwhile: the chain's buffers may already be the
		// driver's again.
		return
	default:
	}
	c := r.c
	// The fixed part of the request is copied out of guest memory once,
	// so that what is checked is what go-fuse decodes: another vCPU may
	// rewrite the guest's buffers meanwhile. Names and data after it are
	// read from guest memory, where a change harms only the request.
	in := fixed(c.TakeReadable(c.ReadableLen()))
	if lim := s.dev.opts.Limit; lim != nil {
		if !lim.Wait(s.done, 1, ioBytes(in)) {
			return
		}
	}
	errno := validate(in)
	if errno == 0 {
		errno = s.sequence(in)
	}
	if errno != 0 {
		replyError(c, in, errno)
		s.finish(r.q, c)
		return
	}
	n, ok := s.handle(in, c.Writable())
	if opcode(in) == opDestroy {
		// The guest unmounted: what it looked up is forgotten without
		// FORGETs (Linux stops the queue that carries them first).
		s.fs.ForgetAll()
	}
	if ok {
		c.TakeWritable(n)
	} else {
		replyError(c, in, errnoEIO)
	}
	s.finish(r.q, c)
}

// handle runs one request through the protocol server, turning a panic in
// its decoding of the guest's bytes into a failed request.
func (s *session) handle(in, out [][]byte) (n int, ok bool) {
	defer func() {
		if p := recover(); p != nil {
			s.dev.log.Warn("FUSE request panicked", "panic", p)
			n, ok = 0, false
		}
	}()
	n, st := s.ps.HandleRequest(in, out)
	return n, st.Ok()
}

// finish returns a served chain to its queue, and takes more requests if
// the workers had been full.
func (s *session) finish(q int, c *virtio.Chain) {
	d := s.dev
	d.mu.Lock()
	if d.sess != s {
		d.mu.Unlock()
		return
	}
	act := d.act
	irq, err := act.Queues[q].Push(c)
	s.mu.Lock()
	s.pending--
	starved := s.starved
	s.starved = false
	s.mu.Unlock()
	if err != nil {
		d.teardownLocked()
	} else if starved {
		for i := range 2 {
			more, terr := d.takeLocked(i)
			irq = irq || more
			if terr != nil {
				err = terr
				break
			}
		}
	}
	d.mu.Unlock()
	act.Report(irq, err)
}

// fixedLen is how much of a request is copied to host memory before it
// is checked: the header and the largest fixed arguments (SETATTR's).
const fixedLen = 128

// fixed returns in with its first fixedLen bytes (or all, if fewer) copied
// into host memory.
func fixed(in [][]byte) [][]byte {
	total := 0
	for _, b := range in {
		total += len(b)
	}
	head := make([]byte, min(total, fixedLen))
	n := 0
	out := [][]byte{head}
	for _, b := range in {
		if n < len(head) {
			k := copy(head[n:], b)
			n += k
			b = b[k:]
		}
		if len(b) > 0 {
			out = append(out, b)
		}
	}
	return out
}

// opcode is a request's opcode (its header checked already).
func opcode(in [][]byte) uint32 {
	return binary.LittleEndian.Uint32(in[0][4:])
}

// sequence enforces the session's order: INIT once, until a DESTROY (a
// second INIT would change go-fuse's negotiated settings under requests
// being served).
func (s *session) sequence(in [][]byte) int32 {
	op := opcode(in)
	if op != opInit && op != opDestroy {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if op == opDestroy {
		s.inited = false
		return 0
	}
	if s.inited {
		return errnoEINVAL
	}
	s.inited = true
	return 0
}

// ioBytes is the data a request moves: a WRITE's payload (its
// fuse_in_header says the request's length), 0 for the rest. in is
// fixed's, of a request at least a header long (check).
func ioBytes(in [][]byte) int {
	const opWrite = 16
	if opcode(in) != opWrite {
		return 0
	}
	return int(binary.LittleEndian.Uint32(in[0]))
}

// Opcodes the device serves (include/uapi/linux/fuse.h), each with the
// smallest request it carries: the header and the opcode's fixed
// arguments (names and data follow). Every other opcode gets ENOSYS from
// the device, and a request shorter than its opcode's or whose header's
// length is not the request's gets EINVAL, before go-fuse decodes it:
// its decoder reports such requests through the standard library's
// process-wide logger, which a guest could otherwise fill at will.
var minRequest = func() map[uint32]int {
	hdr := binary.Size(fuse.InHeader{})
	m := map[uint32]int{
		1:  hdr,                             // LOOKUP
		2:  binary.Size(fuse.ForgetIn{}),    // FORGET
		3:  binary.Size(fuse.GetAttrIn{}),   // GETATTR
		4:  binary.Size(fuse.SetAttrIn{}),   // SETATTR
		5:  hdr,                             // READLINK
		6:  hdr,                             // SYMLINK
		8:  binary.Size(fuse.MknodIn{}),     // MKNOD
		9:  binary.Size(fuse.MkdirIn{}),     // MKDIR
		10: hdr,                             // UNLINK
		11: hdr,                             // RMDIR
		12: hdr + 8,                         // RENAME: newdir
		13: binary.Size(fuse.LinkIn{}),      // LINK
		14: binary.Size(fuse.OpenIn{}),      // OPEN
		15: binary.Size(fuse.ReadIn{}),      // READ
		16: binary.Size(fuse.WriteIn{}),     // WRITE
		17: hdr,                             // STATFS
		18: binary.Size(fuse.ReleaseIn{}),   // RELEASE
		20: binary.Size(fuse.FsyncIn{}),     // FSYNC
		21: hdr + 8,                         // SETXATTR: size, flags (no FUSE_SETXATTR_EXT)
		22: binary.Size(fuse.GetXAttrIn{}),  // GETXATTR
		23: binary.Size(fuse.GetXAttrIn{}),  // LISTXATTR
		24: hdr,                             // REMOVEXATTR
		25: binary.Size(fuse.FlushIn{}),     // FLUSH
		26: hdr + 8,                         // INIT: major, minor at least
		27: binary.Size(fuse.OpenIn{}),      // OPENDIR
		28: binary.Size(fuse.ReadIn{}),      // READDIR
		29: binary.Size(fuse.ReleaseIn{}),   // RELEASEDIR
		30: binary.Size(fuse.FsyncIn{}),     // FSYNCDIR
		34: binary.Size(fuse.AccessIn{}),    // ACCESS
		35: binary.Size(fuse.CreateIn{}),    // CREATE
		36: binary.Size(fuse.InterruptIn{}), // INTERRUPT
		38: hdr,                             // DESTROY
		42: hdr + 8,                         // BATCH_FORGET: count, dummy
		43: binary.Size(fuse.FallocateIn{}), // FALLOCATE
		44: binary.Size(fuse.ReadIn{}),      // READDIRPLUS
		45: binary.Size(fuse.RenameIn{}),    // RENAME2
		51: binary.Size(fuse.CreateIn{}),    // TMPFILE (and its name, "/")
	}
	for op, n := range m {
		if n <= 0 {
			panic(fmt.Sprintf("virtiofs: opcode %d: no fixed size", op))
		}
	}
	return m
}()

const (
	opInit       = 26
	opDestroy    = 38
	errnoENOSYS  = 38
	errnoEPROTO  = 71
	fuseMajor    = 7
	fuseMinorMin = 12 // go-fuse's oldest
)

// validate checks a request's header and size against its opcode and
// returns the errno the device answers it with itself, or 0. in is
// fixed's: its first buffer, a host copy, holds the header and at least
// the opcode's fixed arguments once the size is checked.
func validate(in [][]byte) int32 {
	total := 0
	for _, b := range in {
		total += len(b)
	}
	hdr := in[0]
	le := binary.LittleEndian
	op := opcode(in)
	if int(le.Uint32(hdr[0:])) != total {
		return errnoEINVAL
	}
	min, ok := minRequest[op]
	switch {
	case !ok:
		return errnoENOSYS
	case total < min:
		return errnoEINVAL
	case op == opInit && (le.Uint32(hdr[inHeaderLen:]) != fuseMajor || le.Uint32(hdr[inHeaderLen+4:]) < fuseMinorMin):
		return errnoEPROTO
	}
	return 0
}
