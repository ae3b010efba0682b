package agent

import (
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

const (
	// replayBytes bounds the recent output a process keeps for clients
	// that attach later.
	replayBytes = 64 << 10
	// keepExited is how many exited processes the table keeps, so a
	// client that comes back can still read how one ended.
	keepExited = 64
)

// procTable is the agent's processes by ID: the running ones and the most
// recent that exited. A process belongs to the table, not to the
// connection that started it: it outlives that connection, and any
// connection may list, attach to, wait for or signal it.
type procTable struct {
	mu     sync.Mutex
	next   int
	procs  map[int]*proc
	exited []int // IDs of exited processes, oldest first
}

// add gives p an ID and enters it.
func (t *procTable) add(p *proc) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.procs == nil {
		t.procs = map[int]*proc{}
	}
	t.next++
	p.info.ID = t.next
	t.procs[p.info.ID] = p
}

// lookup returns the process with ID id for operation op, or an ESRCH
// error naming both.
func (t *procTable) lookup(op string, id int) (*proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p := t.procs[id]; p != nil {
		return p, nil
	}
	return nil, opError(op, "process "+strconv.Itoa(id), syscall.ESRCH)
}

// ended records that p exited, forgetting the oldest exited processes
// past keepExited.
func (t *procTable) ended(p *proc) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.exited = append(t.exited, p.info.ID)
	for len(t.exited) > keepExited {
		delete(t.procs, t.exited[0])
		t.exited = t.exited[1:]
	}
}

// list describes every process in the table, by ID.
func (t *procTable) list() []ProcessInfo {
	t.mu.Lock()
	ps := make([]*proc, 0, len(t.procs))
	for _, p := range t.procs {
		ps = append(ps, p)
	}
	t.mu.Unlock()
	out := make([]ProcessInfo, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.describe())
	}
	slices.SortFunc(out, func(a, b ProcessInfo) int { return a.ID - b.ID })
	return out
}

// proc is a process the agent started.
type proc struct {
	info ProcessInfo // fixed once started, but for Exit
	kill func(syscall.Signal)
	// resize sets a pty's size; nil without one.
	resize func(WindowSize) error
	// input feeds stdin (or the pty) in order; a nil slice closes it.
	// nil when the process has no input.
	input chan []byte
	done  chan struct{} // closed once it exited and attached clients were told
	exit  atomic.Pointer[ExitStatus]

	mu          sync.Mutex
	ring        []outChunk // recent output, at most replayBytes
	ringBytes   int
	subs        []*Conn // attached connections
	inputClosed bool
}

// outChunk is output as it came: its stream and bytes.
type outChunk struct {
	t FrameType
	b []byte
}

func newProc(argv []string, tty, input bool) *proc {
	p := &proc{
		info: ProcessInfo{Argv: argv, TTY: tty, StartedNs: time.Now().UnixNano()},
		done: make(chan struct{}),
	}
	if input {
		p.input = make(chan []byte, 16)
	}
	return p
}

func (p *proc) describe() ProcessInfo {
	in := p.info
	in.Exit = p.exit.Load()
	return in
}

// output keeps b for replay and sends it to every attached connection; a
// connection that fails is detached. Attached clients slow the process
// down (its pipe fills) rather than lose output.
func (p *proc) output(t FrameType, b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	keep := b
	if len(keep) > replayBytes {
		keep = keep[len(keep)-replayBytes:]
		p.ring, p.ringBytes = nil, 0
	}
	p.ring = append(p.ring, outChunk{t, slices.Clone(keep)})
	p.ringBytes += len(keep)
	for p.ringBytes > replayBytes {
		p.ringBytes -= len(p.ring[0].b)
		p.ring = p.ring[1:]
	}
	p.subs = slices.DeleteFunc(p.subs, func(c *Conn) bool {
		_, err := frameWriter{c, t}.Write(b)
		return err != nil
	})
}

// procWriter is a process's stdout or stderr. It waits for gate, which
// opens once the starting client has the process's ID and is attached.
type procWriter struct {
	p    *proc
	t    FrameType
	gate <-chan struct{}
}

func (w procWriter) Write(b []byte) (int, error) {
	<-w.gate
	w.p.output(w.t, b)
	return len(b), nil
}

// attach sends c the recent output, if replay, and then everything the
// process writes until it exits, and then its ExitStatus. It reports
// false, having sent the status, if the process has already exited.
func (p *proc) attach(c *Conn, replay bool) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if replay {
		for _, ch := range p.ring {
			if err := c.WriteFrame(ch.t, ch.b); err != nil {
				return false, err
			}
		}
	}
	if st := p.exit.Load(); st != nil {
		return false, c.WriteJSON(FrameExit, st)
	}
	p.subs = append(p.subs, c)
	return true, nil
}

// detach stops sending to c.
func (p *proc) detach(c *Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.subs = slices.DeleteFunc(p.subs, func(s *Conn) bool { return s == c })
}

// finish records how the process ended and tells every attached
// connection, once all its output has been sent.
func (p *proc) finish(st ExitStatus) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.exit.Store(&st)
	for _, c := range p.subs {
		c.WriteJSON(FrameExit, st)
	}
	p.subs = nil
	close(p.done)
}

// write queues b for the process's input; it waits while the queue is
// full, and drops b once the input is closed or the process is gone.
func (p *proc) write(b []byte) {
	p.mu.Lock()
	closed := p.inputClosed || p.input == nil
	p.mu.Unlock()
	if closed {
		return
	}
	select {
	case p.input <- b:
	case <-p.done:
	}
}

// closeInput ends the process's input (a pty's gets end-of-file).
func (p *proc) closeInput() {
	p.mu.Lock()
	closed := p.inputClosed || p.input == nil
	p.inputClosed = true
	p.mu.Unlock()
	if closed {
		return
	}
	select {
	case p.input <- nil:
	case <-p.done:
	}
}

// follow serves a connection attached to p: it passes the client's input,
// signals and window sizes on until the process exits (the connection then
// has its ExitStatus) or the client goes. Either way the process goes on.
func (p *proc) follow(c *Conn) {
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		for {
			t, b, err := c.ReadFrame()
			if err != nil {
				return
			}
			switch t {
			case FrameStdin:
				p.write(b)
			case FrameStdinClose:
				p.closeInput()
			case FrameSignal:
				var sr SignalRequest
				if decodeStrict(b, &sr) == nil {
					if sig, err := ParseSignal(sr.Name); err == nil {
						p.kill(sig)
					}
				}
			case FrameResize:
				var ws WindowSize
				if decodeStrict(b, &ws) == nil && p.resize != nil {
					p.resize(ws)
				}
			default:
				return // not a client that follows the protocol
			}
		}
	}()
	select {
	case <-p.done:
	case <-gone:
		p.detach(c)
	}
}
