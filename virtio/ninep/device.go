// Package ninep is the virtio-9p device (virtio 1.2 §5.11 is silent on the
// protocol; Linux's 9p virtio transport defines it): each descriptor chain
// carries one 9P2000.L request in its readable buffers and receives the
// reply in its writable ones. The 9P messages themselves are answered by
// package p9server, so this package only frames: it checks each request's
// header before the server sees it, and routes each reply back to the
// chain whose tag it carries.
//
// The guest is hostile: a request whose header lies about its size, is too
// large, or reuses a tag still in flight gets an Rlerror reply from the
// device itself and never reaches the server; a guest that breaks the queue
// gets the device marked NEEDS_RESET. Neither stops the VMM.
package ninep

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/hugelgupf/p9/p9"

	"github.com/capsa-sandbox/capsa/p9server"
	"github.com/capsa-sandbox/capsa/virtio"
)

const (
	queueSize = 128
	// MaxMessage is the largest 9P message the server accepts (the p9
	// package's own limit); the guest's msize is capped to it.
	MaxMessage = 4 << 20
	// MaxTagLen is the longest mount tag (the Linux driver's limit is
	// the config field's u16, but tags are short names).
	MaxTagLen = 64

	featureMountTag = 1 << 0 // VIRTIO_9P_MOUNT_TAG

	// MinMessage is the smallest msize a Tversion may ask for.
	MinMessage = 4096
	// MaxFids is how many fids the guest may hold on one session (each
	// costs host memory and most a descriptor; p9fs.Options.MaxFDs bounds
	// the descriptors); MaxXattrFids how many of them may hold an extended
	// attribute's value (Txattrwalk, Txattrcreate), each up to
	// MaxXattrSize bytes (Linux's XATTR_SIZE_MAX). Past them the guest
	// gets ENFILE or E2BIG.
	MaxFids      = 32768
	MaxXattrFids = 64
	MaxXattrSize = 64 << 10

	headerLen    = 7 // size[4] type[1] tag[2]
	rreadHdrLen  = headerLen + 4
	tversion     = 100
	rversion     = 101
	tflush       = 108
	rflush       = 109
	rlerror      = 7
	tattach      = 104
	twalk        = 110
	txattrwalk   = 30
	txattrcreate = 32
	tread        = 116
	twrite       = 118
	treaddir     = 40
	tclunk       = 120
	tremove      = 122
	tgetlock     = 54
)

var (
	// closeTimeout bounds how long Close waits for the file server.
	closeTimeout = 10 * time.Second
	// inflightBudget bounds the bytes of requests being served and of
	// the replies they may bring (read counts): past it the device leaves
	// further requests in the queue until replies free room.
	inflightBudget int64 = 32 << 20
	maxFids              = MaxFids // a variable for the tests
)

// Options configures a device.
type Options struct {
	// ReadOnly refuses requests that write extended attributes before
	// they reach the server (which holds their values until the clunk;
	// the file server refuses every other mutation of a read-only share).
	ReadOnly bool
	// Limit, when not nil, is waited on before the server gets each
	// request: one operation, and the bytes a Tread asks for or a Twrite
	// carries.
	Limit virtio.Limiter
}

// Device is a virtio-9p device serving one p9.Attacher under a mount tag.
type Device struct {
	tag      string
	attacher p9.Attacher
	opts     Options
	log      *slog.Logger

	mu      sync.Mutex
	act     *virtio.Activation
	sess    *session // the current 9P connection, nil while reset
	kick    chan struct{}
	stop    chan struct{}
	workers sync.WaitGroup
}

// New returns a device that serves a under mount tag (what the guest names
// in `mount -t 9p TAG DIR`). The device owns a: Close closes it when it is
// an io.Closer.
func New(tag string, a p9.Attacher, o Options, log *slog.Logger) (*Device, error) {
	if err := virtio.CheckTag("virtio-9p", tag, MaxTagLen); err != nil {
		return nil, err
	}
	if a == nil {
		return nil, errors.New("virtio-9p: no filesystem to serve")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Device{tag: tag, attacher: a, opts: o, log: log.With("dev", "9p", "tag", tag)}, nil
}

// Tag is the mount tag.
func (d *Device) Tag() string { return d.tag }

// Type implements virtio.Device.
func (d *Device) Type() uint32 { return virtio.Type9P }

// Features implements virtio.Device.
func (d *Device) Features() uint64 { return featureMountTag }

// QueueSizes implements virtio.Device: one request queue.
func (d *Device) QueueSizes() []uint16 { return []uint16{queueSize} }

// ReadConfig implements virtio.Device: le16 tag_len, then the tag.
func (d *Device) ReadConfig(off uint64, data []byte) {
	cfg := make([]byte, 2+len(d.tag))
	binary.LittleEndian.PutUint16(cfg, uint16(len(d.tag)))
	copy(cfg[2:], d.tag)
	clear(data)
	if off < uint64(len(cfg)) {
		copy(data, cfg[off:])
	}
}

// WriteConfig implements virtio.Device: the config space is read-only.
func (d *Device) WriteConfig(uint64, []byte) {}

// Activate implements virtio.Device: a new 9P session starts.
func (d *Device) Activate(a virtio.Activation) error {
	if len(a.Queues) != 1 || a.Queues[0] == nil {
		return errors.New("virtio-9p: the driver did not set up the request queue")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.act = &a
	d.kick = make(chan struct{}, 1)
	d.stop = make(chan struct{})
	d.sess = d.newSession(&a)
	d.workers.Add(1)
	go d.worker(d.kick, d.stop)
	// Requests the driver queued before DRIVER_OK came with notifications
	// the transport could not pass on: look at once.
	d.kick <- struct{}{}
	return nil
}

// Reset implements virtio.Device: the session ends, and with it every fid.
func (d *Device) Reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.teardown()
}

// Close stops the device and waits for its server to let go of every file,
// for at most closeTimeout: a host filesystem call that never returns
// cannot hold up the sandbox's shutdown (its goroutine is abandoned).
func (d *Device) Close() error {
	d.Reset()
	done := make(chan struct{})
	go func() { d.workers.Wait(); close(done) }()
	var err error
	select {
	case <-done:
	case <-time.After(closeTimeout):
		err = fmt.Errorf("virtio-9p %s: close: the file server did not stop within %v", d.tag, closeTimeout)
	}
	// The filesystem is the device's: its descriptors go now, not when
	// the garbage collector finds it (a closed sandbox may be kept).
	if c, ok := d.attacher.(io.Closer); ok {
		if cerr := c.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("virtio-9p %s: close the file server: %w", d.tag, cerr)
		}
	}
	return err
}

// Notify implements virtio.Device: the requests the driver made
// available go to the server at once, on the notifying goroutine (the
// VMM's ioeventfd reader), which takeRequests never blocks, instead of
// waking the worker for them: one goroutine hand-off fewer a request
// (BenchmarkShareRoundTrips).
func (d *Device) Notify(int) { d.take() }

// take passes the available requests to the server, if a session runs,
// and reports the interrupt or failure that brought.
func (d *Device) take() {
	d.mu.Lock()
	act, s := d.act, d.sess
	if act == nil {
		d.mu.Unlock()
		return
	}
	irq, err := d.takeRequests(s)
	if err != nil {
		d.teardown()
	}
	d.mu.Unlock()
	act.Report(irq, err)
}

// teardown ends the session; d.mu is held.
func (d *Device) teardown() {
	if d.act == nil {
		return
	}
	close(d.stop)
	d.sess.close()
	d.act, d.sess, d.kick, d.stop = nil, nil, nil, nil
}

func (d *Device) worker(kick, stop chan struct{}) {
	defer d.workers.Done()
	for {
		select {
		case <-stop:
			return
		case <-kick:
		}
		d.take()
	}
}

// takeRequests passes every available request to the server, answering
// malformed ones itself; d.mu is held.
func (d *Device) takeRequests(s *session) (bool, error) {
	q := d.act.Queues[0]
	irq := false
	for {
		if s.full() {
			// complete kicks the worker once replies free room.
			return irq, nil
		}
		c, err := q.Next()
		if err != nil {
			return false, err
		}
		if c == nil {
			return irq, nil
		}
		msg, tag, reply, err := s.admit(c)
		switch {
		case err != nil:
			d.log.Debug("bad 9P request", "tag", tag, "err", err)
		case reply == nil:
			// Never blocks: admit keeps at most queueSize requests in
			// flight, and the stream holds as many.
			s.requests <- msg
			continue
		}
		if c.WritableLen() >= len(reply) {
			c.Write(reply)
		}
		more, err := q.Push(c)
		if err != nil {
			return false, err
		}
		irq = irq || more
	}
}

// complete writes the server's reply into its chain and returns the chain
// to the driver.
func (d *Device) complete(s *session, c *virtio.Chain, msg []byte) {
	d.mu.Lock()
	if d.sess != s {
		// Reset meanwhile: the chain's buffers may already hold
		// something else of the guest's.
		d.mu.Unlock()
		return
	}
	c.Write(msg)
	act := d.act
	irq, err := act.Queues[0].Push(c)
	if err != nil {
		d.teardown()
	} else if s.unblocked() {
		select {
		case d.kick <- struct{}{}:
		default:
		}
	}
	d.mu.Unlock()
	act.Report(irq, err)
}

const (
	errnoE2BIG  = 7
	errnoEBUSY  = 16
	errnoEINVAL = 22
	errnoENFILE = 23
	errnoEROFS  = 30
)

// message is a 9P message: size[4] type[1] tag[2], then body.
func message(typ byte, tag uint16, body []byte) []byte {
	b := make([]byte, headerLen, headerLen+len(body))
	binary.LittleEndian.PutUint32(b, uint32(headerLen+len(body)))
	b[4] = typ
	binary.LittleEndian.PutUint16(b[5:], tag)
	return append(b, body...)
}

// flushReply is an Rflush message.
func flushReply(tag uint16) []byte { return message(rflush, tag, nil) }

// errorReply is an Rlerror message: ecode[4].
func errorReply(tag uint16, errno uint32) []byte {
	return message(rlerror, tag, binary.LittleEndian.AppendUint32(nil, errno))
}

// session is one 9P connection between the driver and the server: the
// requests admitted, in order, as the server's input stream, and the
// server's replies routed back by tag.
type session struct {
	dev      *Device
	requests chan []byte
	done     chan struct{}
	closed   sync.Once

	mu      sync.Mutex
	pending map[uint16]*virtio.Chain
	// msize is the largest request accepted: the server's, as its
	// Rversion said (it refuses a larger one by ending the connection).
	msize      uint32
	versioning bool // a Tversion is in flight: nothing else is admitted
	// After the server's first Rversion (serverMsize set), the device
	// answers every later Tversion itself (at most the server's msize, the
	// same version), and the session goes on: the server would release
	// every fid, which the device's own record of them (for snapshots)
	// would not follow.
	serverMsize uint32
	version     string
	// Flushes in flight: each Tflush's tag to the tag it flushes, and the
	// Rflush replies held back until the flushed request's reply is
	// returned (by the flushed tag).
	flushes map[uint16]uint16
	held    map[uint16][]byte
	// The fids the server holds for the guest (true: with an extended
	// attribute's value), and what each request in flight does to them.
	fids      map[uint32]bool
	xattrFids int
	fidOps    map[uint16]fidOp
	making    int // fid-making requests in flight
	xmaking   int // of them and Txattrcreates, those making xattr fids
	// Bytes of requests in flight and of the replies they may bring;
	// starved is set when the worker stopped taking requests for it.
	inflight int64
	cost     map[uint16]int64
	starved  bool
	// What the guest's fids stand for, for a snapshot (state.go): the
	// attaches, each fid's path, and the requests in flight that change
	// them; internal holds the device's own requests in flight (a
	// restore's), answered to a channel instead of a chain.
	attaches []attachInfo
	paths    map[uint32]*fidPath
	pathOps  map[uint16]pathOp
	internal map[uint16]chan []byte
}

// fidOp is what a request in flight does to the session's fids once the
// server answers it.
type fidOp struct {
	kind  byte   // one of the fid* constants
	fid   uint32 // the fid made, converted or released
	reply byte   // the reply type that says it succeeded
}

const (
	fidMake      = iota + 1 // Tattach, Twalk to a new fid
	fidMakeXattr            // Txattrwalk
	fidToXattr              // Txattrcreate
	fidRelease              // Tclunk, Tremove: released whatever the reply
)

// sessionState is a session with nothing admitted and no server yet.
func sessionState(d *Device) *session {
	return &session{
		dev:      d,
		requests: make(chan []byte, queueSize),
		done:     make(chan struct{}),
		pending:  map[uint16]*virtio.Chain{},
		flushes:  map[uint16]uint16{},
		held:     map[uint16][]byte{},
		fids:     map[uint32]bool{},
		fidOps:   map[uint16]fidOp{},
		cost:     map[uint16]int64{},
		msize:    MaxMessage,
		paths:    map[uint32]*fidPath{},
		pathOps:  map[uint16]pathOp{},
		internal: map[uint16]chan []byte{},
	}
}

func (d *Device) newSession(a *virtio.Activation) *session {
	s := sessionState(d)
	srv := p9server.New(d.attacher, p9server.Options{MaxMessage: MaxMessage, MaxFids: maxFids, Logger: d.log})
	d.workers.Add(1)
	go func() {
		defer d.workers.Done()
		// The admitted requests, in order, each after the share's limit
		// lets it through; at the session's end, every request being
		// served is waited for and every fid released.
		defer srv.Close()
		for {
			select {
			case m := <-s.requests:
				if lim := s.dev.opts.Limit; lim != nil {
					lim.Wait(s.done, 1, ioBytes(m))
				}
				srv.Serve(m, s.reply)
			case <-s.done:
				return
			}
		}
	}()
	return s
}

func (s *session) close() {
	s.closed.Do(func() { close(s.done) })
}

// admit checks a request chain's message and records it as waiting for
// the reply with its tag. It returns the request's bytes for the server,
// or the reply the device gives itself (an error, with err saying why, or
// an Rflush).
func (s *session) admit(c *virtio.Chain) (msg []byte, tag uint16, reply []byte, err error) {
	msg, tag, err = s.check(c)
	if err != nil {
		return nil, tag, errorReply(tag, errnoEINVAL), err
	}
	return s.admitMsg(msg, tag, c, nil)
}

// admitMsg admits a request's bytes: for the guest's chain c, or, with c
// nil, the device's own request whose reply goes to internal.
func (s *session) admitMsg(msg []byte, tag uint16, c *virtio.Chain, internal chan []byte) (_ []byte, _ uint16, reply []byte, err error) {
	if errno, err := checkBody(msg[4], msg[headerLen:]); err != nil {
		return nil, tag, errorReply(tag, errno), fmt.Errorf("request tag %d: %w", tag, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	refuse := func(errno uint32, format string, args ...any) ([]byte, uint16, []byte, error) {
		return nil, tag, errorReply(tag, errno), fmt.Errorf("request tag %d: "+format, append([]any{tag}, args...)...)
	}
	typ, body := msg[4], msg[headerLen:]
	le := binary.LittleEndian
	switch {
	case s.pending[tag] != nil || s.internal[tag] != nil:
		return refuse(errnoEINVAL, "the tag is already in flight")
	case len(s.pending) >= queueSize:
		// Only a driver that reuses descriptors still in flight gets here.
		return refuse(errnoEBUSY, "%d requests already in flight", len(s.pending))
	case s.versioning:
		return refuse(errnoEBUSY, "a Tversion is in flight")
	}
	if typ == tflush {
		// The server waits for the flushed request to finish. A flush
		// of nothing in flight, of itself, or of another flush (two
		// flushes naming each other) would make it wait forever, so the
		// device answers those at once: there is nothing to wait for.
		old := le.Uint16(body)
		if _, isFlush := s.flushes[old]; old == tag || s.pending[old] == nil || isFlush {
			return nil, tag, flushReply(tag), nil
		}
		s.flushes[tag] = old
	}
	cost := int64(len(msg))
	op := fidOp{reply: typ + 1}
	switch typ {
	case tversion:
		// A Tversion ends every request and fid: none may be in flight.
		if len(s.pending) > 0 {
			return refuse(errnoEBUSY, "Tversion with %d requests in flight", len(s.pending))
		}
		m := le.Uint32(body)
		if m < MinMessage {
			return refuse(errnoEINVAL, "msize %d is below %d", m, MinMessage)
		}
		if s.serverMsize != 0 {
			return nil, tag, s.versionReply(tag, m, string(body[6:6+int(le.Uint16(body[4:]))])), nil
		}
		s.versioning = true
	case tread, treaddir:
		// fid[4] offset[8] count[4]: the reply must fit msize (the
		// server caps a read at its 4 MiB limit only, and a directory
		// read not at all).
		if n := le.Uint32(body[12:]); n > s.msize-rreadHdrLen {
			le.PutUint32(body[12:], s.msize-rreadHdrLen)
		}
		cost += int64(le.Uint32(body[12:]))
	case tattach:
		op.kind, op.fid = fidMake, le.Uint32(body)
	case twalk:
		if fid, newfid := le.Uint32(body), le.Uint32(body[4:]); newfid != fid {
			op.kind, op.fid = fidMake, newfid
		}
	case txattrwalk:
		// fid[4] newfid[4] name[s]
		op.kind, op.fid = fidMakeXattr, le.Uint32(body[4:])
	case txattrcreate:
		// fid[4] name[s] size[8] flags[4]: the server buffers the value
		// the guest then writes, up to size, until the clunk.
		if s.dev.opts.ReadOnly {
			return refuse(errnoEROFS, "Txattrcreate on a read-only share")
		}
		n := int(le.Uint16(body[4:]))
		if size := le.Uint64(body[6+n:]); size > MaxXattrSize {
			return refuse(errnoE2BIG, "extended attribute of %d bytes exceeds %d", size, MaxXattrSize)
		}
		op.kind, op.fid = fidToXattr, le.Uint32(body)
	case tclunk, tremove:
		op.kind, op.fid = fidRelease, le.Uint32(body)
	}
	switch op.kind {
	case fidMake, fidMakeXattr:
		if len(s.fids)+s.making >= maxFids {
			return refuse(errnoENFILE, "the guest holds %d fids (limit %d)", len(s.fids)+s.making, maxFids)
		}
	}
	xattr := op.kind == fidMakeXattr || op.kind == fidToXattr
	if xattr && s.xattrFids+s.xmaking >= MaxXattrFids {
		return refuse(errnoENFILE, "the guest holds %d extended attribute fids (limit %d)", s.xattrFids+s.xmaking, MaxXattrFids)
	}
	if op.kind == fidMake || op.kind == fidMakeXattr {
		s.making++
	}
	if xattr {
		s.xmaking++
	}
	if op.kind != 0 {
		s.fidOps[tag] = op
	}
	s.trackPath(tag, typ, body)
	if c == nil {
		s.internal[tag] = internal
	} else {
		s.pending[tag] = c
	}
	s.cost[tag] = cost
	s.inflight += cost
	return msg, tag, nil, nil
}

// answered updates the session for the reply msg to request tag; s.mu is
// held.
func (s *session) answered(tag uint16, msg []byte) {
	s.inflight -= s.cost[tag]
	delete(s.cost, tag)
	s.applyPath(tag, msg)
	if s.versioning && msg[4] == rversion && len(msg) >= headerLen+6 {
		s.versioning = false
		n := int(binary.LittleEndian.Uint16(msg[headerLen+4:]))
		if m := binary.LittleEndian.Uint32(msg[headerLen:]); m > 0 && len(msg) >= headerLen+6+n {
			s.msize, s.serverMsize = m, m
			s.version = string(msg[headerLen+6 : headerLen+6+n])
		}
	} else if s.versioning && msg[4] == rlerror {
		s.versioning = false
	}
	op, ok := s.fidOps[tag]
	if !ok {
		return
	}
	delete(s.fidOps, tag)
	ok = msg[4] == op.reply
	if op.kind == fidMakeXattr || op.kind == fidToXattr {
		s.xmaking--
	}
	switch op.kind {
	case fidMake, fidMakeXattr:
		s.making--
		if ok {
			// The server replaces a fid in use (InsertFID).
			if x, held := s.fids[op.fid]; held && x {
				s.xattrFids--
			}
			s.fids[op.fid] = op.kind == fidMakeXattr
			if op.kind == fidMakeXattr {
				s.xattrFids++
			}
		}
	case fidToXattr:
		if x, held := s.fids[op.fid]; ok && held && !x {
			s.fids[op.fid] = true
			s.xattrFids++
		}
	case fidRelease:
		if x, held := s.fids[op.fid]; held {
			if x {
				s.xattrFids--
			}
			delete(s.fids, op.fid)
		}
	}
}

// versionReply is the device's Rversion to a Tversion after the first:
// the server's version for a 9P2000.L client (else "unknown", as the
// server says), and msize at most the server's. s.mu is held.
func (s *session) versionReply(tag uint16, msize uint32, version string) []byte {
	v := s.version
	if !strings.HasPrefix(version, "9P2000.L") {
		v, msize = "unknown", 0
	} else {
		msize = min(msize, s.serverMsize)
		s.msize = msize
	}
	body := binary.LittleEndian.AppendUint32(nil, msize)
	body = binary.LittleEndian.AppendUint16(body, uint16(len(v)))
	return message(rversion, tag, append(body, v...))
}

// full reports whether the requests in flight use up the byte budget.
func (s *session) full() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inflight >= inflightBudget {
		s.starved = true
	}
	return s.starved
}

// unblocked reports, once, that the worker stopped taking requests for
// the budget and replies have freed room since.
func (s *session) unblocked() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.starved && s.inflight < inflightBudget {
		s.starved = false
		return true
	}
	return false
}

// check reads a request's header and bytes from its chain.
func (s *session) check(c *virtio.Chain) ([]byte, uint16, error) {
	var hdr [headerLen]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return nil, 0xffff, fmt.Errorf("request of %d bytes is shorter than a 9P header", c.ReadableLen())
	}
	size := binary.LittleEndian.Uint32(hdr[:])
	tag := binary.LittleEndian.Uint16(hdr[5:])
	s.mu.Lock()
	msize := s.msize
	s.mu.Unlock()
	switch {
	case size < headerLen || size > uint32(c.ReadableLen()):
		return nil, tag, fmt.Errorf("request tag %d: header says %d bytes, the buffers hold %d", tag, size, c.ReadableLen())
	case size > msize:
		return nil, tag, fmt.Errorf("request tag %d: %d bytes exceed msize %d", tag, size, msize)
	case c.WritableLen() < headerLen+4:
		// Not even room for an error: the driver gets the chain back
		// with nothing written.
		return nil, tag, fmt.Errorf("request tag %d: %d writable bytes cannot hold a reply", tag, c.WritableLen())
	}
	msg := make([]byte, size)
	copy(msg, hdr[:])
	if _, err := io.ReadFull(c, msg[headerLen:]); err != nil {
		return nil, tag, fmt.Errorf("request tag %d: %v", tag, err)
	}
	return msg, tag, nil
}

// reply routes one whole reply message from the server to its chain.
//
// An Rflush is returned to the driver only after the reply of the request
// it flushed (p9server sends them in that order; the device holds an
// early one all the same): Linux frees the flushed request and its
// buffers on Rflush, and a late reply would be written into freed guest
// memory and completed for a freed request. QEMU orders them the same
// way.
func (s *session) reply(msg []byte) {
	tag := binary.LittleEndian.Uint16(msg[5:])
	s.mu.Lock()
	c := s.pending[tag]
	if c == nil {
		if ch := s.internal[tag]; ch != nil {
			delete(s.internal, tag)
			s.answered(tag, msg)
			s.mu.Unlock()
			ch <- msg
			return
		}
		s.mu.Unlock()
		s.dev.log.Warn("9P reply for a tag not in flight", "tag", tag)
		return
	}
	if old, ok := s.flushes[tag]; ok && msg[4] == rflush {
		delete(s.flushes, tag)
		if s.pending[old] != nil {
			s.held[old] = msg
			s.mu.Unlock()
			return
		}
	}
	delete(s.pending, tag)
	s.answered(tag, msg)
	var ftag uint16
	flush, flushChain := s.held[tag], (*virtio.Chain)(nil)
	if flush != nil {
		delete(s.held, tag)
		ftag = binary.LittleEndian.Uint16(flush[5:])
		flushChain = s.pending[ftag]
		delete(s.pending, ftag)
		s.answered(ftag, flush)
	}
	s.mu.Unlock()
	s.deliver(tag, c, msg)
	if flushChain != nil {
		s.deliver(ftag, flushChain, flush)
	}
}

// deliver writes a reply into its chain and returns the chain.
func (s *session) deliver(tag uint16, c *virtio.Chain, msg []byte) {
	if len(msg) > c.WritableLen() {
		// The driver sized its buffers for less than it asked for (an
		// Rread larger than the room it gave): it gets an error instead.
		s.dev.log.Debug("9P reply does not fit the driver's buffers", "tag", tag, "reply", len(msg), "room", c.WritableLen())
		msg = errorReply(tag, errnoEINVAL)
	}
	s.dev.complete(s, c, msg)
}

// ioBytes is the data a request moves: a Tread's or Twrite's count
// (fid[4] offset[8] count[4], checked when admitted), 0 for the rest.
func ioBytes(m []byte) int {
	if t := m[4]; (t == tread || t == twrite) && len(m) >= headerLen+16 {
		return int(binary.LittleEndian.Uint32(m[headerLen+12:]))
	}
	return 0
}
